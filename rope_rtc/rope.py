"""The general RoPE API: ``apply_rope``, ``apply_rope_qk`` and the prepared ``RopePlan``.

Numerical contract (DESIGN.md): load, convert to FP32, ``o0 = x0*c - x1*s``,
``o1 = x1*c + x0*s`` in FP32, one round-to-nearest-even to the output dtype. Channels outside
the rotary window are copied (out of place) or left untouched (in place).

This module holds the one-call APIs; validation is in ``rope_request``, the kernel's launch
configuration in ``rope_launch`` and the plan in ``rope_plan``.
"""

from __future__ import annotations

import warnings

import numpy as np

from . import arrays as A
from .launch import RECENT_SETS  # noqa: F401 - part of this module's interface
from .launch import StructArg, launch, load_kernel, stream_handle
from .layouts import to_bshd_index
from .registry import ROPE_ENTRIES, rope_spec
from .rope_launch import choose_vector, fill_params, head_batch, launch_shape
from .rope_params import RopeParams
from .rope_plan import RopePlan  # noqa: F401 - part of this module's interface
from .rope_request import Request, validate

BACKENDS = ("auto", "nvrtc", "numpy")
VARIANTS = ("auto", "baseline", "vectorized", "fused")

# backends

_numpy_fallback_warned = False


def _resolve_backend(backend: str) -> str:
    global _numpy_fallback_warned
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    if backend != "auto":
        return backend
    from . import driver

    if driver.available():
        return "nvrtc"
    if not _numpy_fallback_warned:
        _numpy_fallback_warned = True
        warnings.warn(f"rope_rtc: no usable GPU ({driver.unavailable_reason()}); backend='auto' runs the NumPy "
                      "reference on the CPU", RuntimeWarning, stacklevel=3)
    return "numpy"


def _host(x):
    return None if x is None else (x.array if isinstance(x.array, np.ndarray) else np.asarray(x.array))


def _token_positions(req: Request) -> np.ndarray:
    """Positions of every token, [B*S], on the host (NumPy backend)."""
    B, S = req.cq.B, req.cq.S
    if req.positions is not None:
        return _host(req.positions).reshape(-1).astype(np.int64)
    s = np.arange(S, dtype=np.int64)
    if req.cu_seqlens is not None:
        cu = _host(req.cu_seqlens).astype(np.int64)
        t = np.arange(S, dtype=np.int64)
        seq = np.searchsorted(cu, t, side="right") - 1
        valid = (t >= cu[0]) & (t < cu[-1])
        seq = np.clip(seq, 0, len(cu) - 2)
        base = _host(req.offsets).astype(np.int64)[seq] if req.offsets is not None else req.offset
        pos = t - cu[seq] + base
        return np.where(valid, pos, -1)
    if req.offsets is not None:
        return (_host(req.offsets).astype(np.int64)[:, None] + s[None, :]).reshape(-1)
    return np.broadcast_to(req.offset + s, (B, S)).reshape(-1)


def _numpy_one(x: A.ArrayInfo, req: Request, pos: np.ndarray, out) -> np.ndarray:
    from .reference import rope_reference, round_to_dtype

    arr = _host(x)
    perm = to_bshd_index(req.layout)
    canon = np.transpose(arr, perm)
    shape = canon.shape
    flat = canon.reshape(int(np.prod(shape[:-2])), shape[-2], shape[-1])  # -1 is ambiguous when empty
    res = rope_reference(flat, _host(req.cos), _host(req.sin), pos, interleaved=req.interleaved,
                         rotary_dim=req.rotary_dim, rotary_offset=req.rotary_offset, inverse=req.inverse)
    res = round_to_dtype(res, arr.dtype).reshape(shape)
    res = np.transpose(res, np.argsort(perm))
    if out is None:
        return np.ascontiguousarray(res)
    out[...] = res
    return out


def _run_numpy(req: Request):
    pos = _token_positions(req)
    q = _numpy_one(req.q, req, pos, _host(req.q_out) if req.q_out is not None else None)
    k = None
    if req.k is not None:
        k = _numpy_one(req.k, req, pos, _host(req.k_out) if req.k_out is not None else None)
    return q, k


def _run_gpu(req: Request, stream, variant: str):
    """Allocate missing outputs (one-call API only) and launch once."""
    import cupy


    device = req.device if req.device is not None else cupy.cuda.runtime.getDevice()
    with cupy.cuda.Device(device):
        handle = stream_handle(stream, device)
        if req.q_out is None:
            req.q_out = A.describe(cupy.empty_like(req.q.array), "out" if req.k is None else "q_out")
        if req.k is not None and req.k_out is None:
            req.k_out = A.describe(cupy.empty_like(req.k.array), "k_out")
        q_out = req.q_out.array
        k_out = req.k_out.array if req.k is not None else None
        if req.num_tokens == 0 or (q_out.size == 0 and (k_out is None or k_out.size == 0)):
            return q_out, k_out
        if variant != "auto":
            from .blog import run_blog_variant

            run_blog_variant(variant, req, handle, device)
            return q_out, k_out
        vec = choose_vector(req)
        kernel = load_kernel(rope_spec(req.dtype, req.interleaved, vec, head_batch(req)), device)
        args = StructArg(RopeParams)
        fill_params(args.values, req, vec)
        grid, block = launch_shape(req, vec)
        launch(kernel.functions[ROPE_ENTRIES[0 if args.values.narrow else 1]], grid, block, handle, args.address)
        return q_out, k_out


def _stage_host(req_kwargs: dict, names: tuple[str, ...]):
    """Copy NumPy arguments to the device (NumPy inputs, GPU present)."""
    import cupy

    staged = dict(req_kwargs)
    for n in names:
        v = staged.get(n)
        if isinstance(v, np.ndarray):
            staged[n] = cupy.asarray(v)
    return staged


def apply_rope_qk(q, k, cos, sin, *, positions=None, offset=0, cu_seqlens=None, layout: str = "bshd",
                  interleaved: bool = False, rotary_dim: int | None = None, rotary_offset: int = 0,
                  inverse: bool = False, q_out=None, k_out=None, stream=None, backend: str = "auto",
                  variant: str = "auto"):
    """Rotate q and k in one launch. q and k may have different head counts (GQA/MQA).

    Parameters
    ----------
    q, k : array
        ``layout``-shaped arrays of float32, float16 or bfloat16 (``ml_dtypes.bfloat16``): CuPy,
        NumPy (the result is NumPy; computed on the GPU when there is one), or any object with
        ``__dlpack__`` / ``__cuda_array_interface__`` (PyTorch, JAX), used without a copy. Leading
        dimensions may have any strides (views into a fused QKV buffer work); the last is contiguous.
    cos, sin : array
        float32 tables ``[max_positions, rotary_dim // 2]`` (see :func:`rope_tables`).
    positions : array of int32/int64, optional
        One absolute position per token: ``[B, S]``, or ``[T]`` for ``layout="thd"``. Overrides ``offset``.
    offset : int or int array ``[B]``
        Default positions are ``offset + s``; an array gives each sequence its own start (decode with
        different cache lengths). With ``cu_seqlens``, the per-sequence start of the restarted positions.
    cu_seqlens : int array ``[B + 1]``, optional
        ``layout="thd"`` only: sequence boundaries of packed tokens; positions restart at each.
    layout : {"bshd", "bhsd", "sbhd", "thd"}
    interleaved : bool
        ``False``: half-split pairs ``(x[i], x[i + r/2])`` — GPT-NeoX, Hugging Face ``rotate_half``,
        vLLM ``is_neox_style=True``. ``True``: adjacent pairs ``(x[2i], x[2i+1])`` — RoFormer, GPT-J,
        Meta's original LLaMA, MLX ``traditional=True``.
    rotary_dim, rotary_offset : int
        Rotate channels ``rotary_offset … rotary_offset + rotary_dim`` (default: the whole head); the
        rest is copied (out of place) or untouched (in place).
    inverse : bool
        Rotate by the opposite angle.
    q_out, k_out : array, optional
        Outputs; ``q_out=q`` / ``k_out=k`` rotates in place. Any other overlap is rejected.
    stream : optional
        ``None`` (CuPy's current stream), a CuPy stream, an object with ``__cuda_stream__``, or a raw handle.
    backend : {"auto", "nvrtc", "numpy"}
        ``"numpy"`` runs the float64-accumulating reference on the CPU; ``"auto"`` uses the GPU when one
        is present, else NumPy (with a one-time warning).
    variant : {"auto", "baseline", "vectorized", "fused"}
        The blog's kernels, for FP32 interleaved ``bhsd`` only (benchmark progression); ``"auto"`` is the
        production kernel.

    Returns
    -------
    (q_out, k_out)

    Raises
    ------
    TypeError, ValueError
        Before anything is launched or written, naming the argument.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r} is not one of {', '.join(map(repr, VARIANTS))}")
    if k is None:
        raise TypeError("k: expected an array (use apply_rope for a single tensor)")
    return _apply(q, k, cos, sin, positions=positions, offset=offset, cu_seqlens=cu_seqlens, layout=layout,
                  interleaved=interleaved, rotary_dim=rotary_dim, rotary_offset=rotary_offset, inverse=inverse,
                  q_out=q_out, k_out=k_out, stream=stream, backend=backend, variant=variant)


def apply_rope(x, cos, sin, *, positions=None, offset=0, cu_seqlens=None, layout: str = "bshd",
               interleaved: bool = False, rotary_dim: int | None = None, rotary_offset: int = 0,
               inverse: bool = False, out=None, stream=None, backend: str = "auto", variant: str = "auto"):
    """Rotate one tensor. Same arguments as :func:`apply_rope_qk` with ``x``/``out`` for ``q``/``q_out``.

    ``out=x`` rotates in place. Returns the output array.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r} is not one of {', '.join(map(repr, VARIANTS))}")
    if variant == "fused":
        raise ValueError("variant: 'fused' rotates q and k together; use apply_rope_qk")
    q, _ = _apply(x, None, cos, sin, positions=positions, offset=offset, cu_seqlens=cu_seqlens, layout=layout,
                  interleaved=interleaved, rotary_dim=rotary_dim, rotary_offset=rotary_offset, inverse=inverse,
                  q_out=out, k_out=None, stream=stream, backend=backend, variant=variant, names=("x", "k"))
    return q


def _apply(q, k, cos, sin, *, backend, variant, stream, names=("q", "k"), **kw):
    backend = _resolve_backend(backend)
    req = validate(q, k, cos, sin, names=names, **kw)
    host = req.q.device is None
    if variant != "auto":
        from .blog import check_blog_variant

        check_blog_variant(variant, req)
    if backend == "numpy":
        if not host:
            raise TypeError(f"{req.q.name}: backend='numpy' takes host (NumPy) arrays; use backend='nvrtc' for device arrays")
        if variant != "auto":
            raise ValueError("variant: the blog variants are GPU kernels; use backend='nvrtc'")
        return _run_numpy(req)
    if not host:
        return _run_gpu(req, stream, variant)
    # NumPy in, NumPy out, computed on the GPU.
    import cupy

    names_all = ("q", "k", "cos", "sin", "positions", "offset", "cu_seqlens")
    staged = _stage_host({"q": q, "k": k, "cos": cos, "sin": sin, "positions": kw.get("positions"),
                          "offset": kw.get("offset"), "cu_seqlens": kw.get("cu_seqlens")}, names_all)
    kw2 = {n: kw[n] for n in kw if n not in ("positions", "offset", "cu_seqlens", "q_out", "k_out")}
    in_place_q = req.q_out is not None and req.in_place
    in_place_k = req.k_out is not None and req.k is not None and A.same_view(req.k_out, req.k)
    dreq = validate(staged["q"], staged["k"], staged["cos"], staged["sin"], positions=staged["positions"],
                    offset=staged["offset"], cu_seqlens=staged["cu_seqlens"], q_out=staged["q"] if in_place_q else None,
                    k_out=staged["k"] if in_place_k else None, names=names, **kw2)
    qd, kd = _run_gpu(dreq, stream, variant)
    cupy.cuda.get_current_stream().synchronize()
    results = []
    for dev_arr, user_out in ((qd, req.q_out), (kd, req.k_out)):
        if dev_arr is None:
            results.append(None)
            continue
        host_arr = cupy.asnumpy(dev_arr)
        if user_out is not None:
            user_out.array[...] = host_arr
            results.append(user_out.array)
        else:
            results.append(host_arr)
    return results[0], results[1]
