"""The three kernels of the blog "Rotary Positional Embeddings in CUDA: From Math to
High-Performance Kernels": FP32, interleaved, contiguous ``bhsd``, whole-head rotation,
positions ``offset + s``. They show the progression in the benchmark and the demo
(:func:`prepare_blog_variant`); the general API's kernel serves every other use. Their build
(``registry.blog_spec``) compiles on first use: ``rope-rtc warm`` leaves it out of a production
cache (``registry.DEMO_FAMILIES``)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from ..build.registry import blog_spec
from ..core.launcher import ArgPack, launch_prefix, load_kernel, stream_handle
from ..core.prepared import direct_launcher

BLOG_BLOCK = 256
VARIANTS = ("baseline", "vectorized", "fused")


def check_blog_variant(variant: str, req) -> None:
    """Raise ``ValueError`` naming what a validated call (``req``: a ``rope_request.Request``) has
    that the blog's kernel ``variant`` does not take."""
    problems = []
    if req.dtype != "float32":
        problems.append(f"dtype {req.dtype}")
    if not req.interleaved:
        problems.append("interleaved=False")
    if req.layout != "bhsd":
        problems.append(f"layout {req.layout!r}")
    if req.rotary_dim != req.cq.D or req.rotary_offset:
        problems.append("a partial rotary window")
    if req.pos_mode != 0:
        problems.append("positions/offset arrays/cu_seqlens")
    if req.inverse:
        problems.append("inverse=True")
    for info in (req.q, req.k, req.q_out, req.k_out, req.cos, req.sin):
        if info is not None and not info.is_c_contiguous():
            problems.append(f"non-contiguous {info.name}")
    if variant == "fused" and (req.k is None or req.k.shape != req.q.shape):
        problems.append("q and k of different shapes")
    if problems:
        raise ValueError(f"variant: {variant!r} is the blog's kernel (FP32, interleaved, contiguous bhsd, whole head, "
                         f"offset positions, q/k of one shape for 'fused'); not for {', '.join(problems)}; use "
                         "apply_rope / apply_rope_qk")


def _packed_table(req):
    """The blog's (cos, sin) pair table [P, D/2, 2]."""
    import cupy

    return cupy.ascontiguousarray(cupy.stack([req.cos.array, req.sin.array], axis=-1))


def _launcher(variant: str, req, device: int):
    """A callable ``run(stream)`` launching the variant on ``req``'s arrays; everything it needs
    (argument blocks, the packed table) is built here, once."""
    k = load_kernel(blog_spec(), device)
    B, S, D = req.cq.B, req.cq.S, req.cq.D
    row = req.offset * (D // 2)
    pairs = [(req.q, req.q_out)] + ([(req.k, req.k_out)] if req.k is not None else [])
    launches = []
    table = None
    if variant == "baseline":
        for src, dst in pairs:
            a = ArgPack([("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("cos", ctypes.c_uint64),
                         ("sin", ctypes.c_uint64), ("seq_len", ctypes.c_int32), ("num_heads", ctypes.c_int32),
                         ("head_dim", ctypes.c_int32)])
            v = a.values
            v.src, v.dst, v.cos, v.sin = src.ptr, dst.ptr, req.cos.ptr + 4 * row, req.sin.ptr + 4 * row
            v.seq_len, v.num_heads, v.head_dim = S, src.shape[1], D
            launches.append((k.functions["rope_blog_baseline"], (S, src.shape[1], B), (D // 2, 1, 1), a))
    else:
        table = _packed_table(req)
        base = table.data.ptr + 8 * row
        if variant == "vectorized":
            for src, dst in pairs:
                a = ArgPack([("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("cs", ctypes.c_uint64),
                             ("n", ctypes.c_int64), ("seq_len", ctypes.c_int32), ("half", ctypes.c_int32)])
                v = a.values
                total = src.size // 2
                v.src, v.dst, v.cs, v.n, v.seq_len, v.half = src.ptr, dst.ptr, base, total, S, D // 2
                launches.append((k.functions["rope_blog_vectorized"], (-(-total // BLOG_BLOCK), 1, 1),
                                 (BLOG_BLOCK, 1, 1), a))
        else:  # fused
            a = ArgPack([("qs", ctypes.c_uint64), ("qd", ctypes.c_uint64), ("ks", ctypes.c_uint64),
                         ("kd", ctypes.c_uint64), ("cs", ctypes.c_uint64), ("n", ctypes.c_int64),
                         ("seq_len", ctypes.c_int32), ("half", ctypes.c_int32)])
            v = a.values
            total = req.q.size // 2
            v.qs, v.qd, v.ks, v.kd = req.q.ptr, req.q_out.ptr, req.k.ptr, req.k_out.ptr
            v.cs, v.n, v.seq_len, v.half = base, total, S, D // 2
            launches.append((k.functions["rope_blog_fused_qk"], (-(-total // BLOG_BLOCK), 1, 1),
                             (BLOG_BLOCK, 1, 1), a))

    # One launcher per argument pack, built once: the timed calls only launch.
    prepared = []
    for fn, grid, block, pack in launches:
        prepared.append((direct_launcher(pack.address, device), launch_prefix(fn, grid, block), pack))

    def run(stream: int) -> None:
        for launcher, prefix, _ in prepared:
            launcher(prefix, stream)

    run.table = table  # the packed table lives as long as the launcher
    return run


def prepare_blog_variant(variant: str, q, k, cos, sin, *, q_out, k_out=None,
                         offset: int = 0) -> Callable[..., None]:
    """One of the blog's kernels, ready to run on these arrays: validated once, packed table built
    once, so each call only launches (and can be captured in a CUDA graph).

    Parameters
    ----------
    variant
        ``"baseline"``, ``"vectorized"`` or ``"fused"`` (q and k in one launch).
    q, k
        CuPy FP32 arrays ``[B, H, S, D]``, contiguous; ``k`` may be None except for ``"fused"``.
    cos, sin
        CuPy FP32 tables ``[P, D/2]`` covering positions ``offset .. offset + S - 1``.
    q_out, k_out
        Outputs of q's and k's shape (the inputs themselves for in place).
    offset
        Position of token 0.

    Returns
    -------
    ``run(stream=None)``, which launches on ``stream`` (default: the current stream).

    Raises
    ------
    ValueError
        For an unknown variant, or a call outside what the blog's kernels take (named).
    """
    import cupy

    from .rope_request import validate

    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r} is not one of {', '.join(map(repr, VARIANTS))}")
    req = validate(q, k, cos, sin, offset=offset, layout="bhsd", interleaved=True, q_out=q_out, k_out=k_out,
                   allow_host=False)
    check_blog_variant(variant, req)
    device = req.device if req.device is not None else cupy.cuda.runtime.getDevice()
    run = _launcher(variant, req, device)

    def call(stream=None) -> None:
        run(stream_handle(stream, device))

    call.table = run.table
    return call
