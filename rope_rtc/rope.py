"""The general RoPE API: ``apply_rope``, ``apply_rope_qk`` and the prepared ``RopePlan``.

Numerical contract (DESIGN.md): load, convert to FP32, ``o0 = x0*c - x1*s``,
``o1 = x1*c + x0*s`` in FP32, one round-to-nearest-even to the output dtype. Channels outside
the rotary window are copied (out of place) or left untouched (in place).
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass

import numpy as np

from . import arrays as A
from .descriptors import TensorDesc
from .launch import RECENT_SETS  # noqa: F401 - part of this module's interface
from .launch import Launcher, StructArg, launch, launch_prefix, load_kernel, remember, stream_handle
from .layouts import Canonical, canonical, check_layout, to_bshd_index
from .registry import ROPE_ENTRIES, rope_head_batch, rope_head_batches, rope_spec, rope_vector_widths
from .rope_params import (IDX_CU_SEQLENS_I64, IDX_OFFSETS_I64, IDX_POSITIONS_I64, POS_CU_SEQLENS, POS_OFFSET,
                          POS_OFFSETS, POS_POSITIONS, RopeParams, fast_divisor)

BACKENDS = ("auto", "nvrtc", "numpy")
VARIANTS = ("auto", "baseline", "vectorized", "fused")
# Threads per block of the general kernel (cuda_src/rope.cu: __launch_bounds__(256)).
BLOCK_THREADS = 256
GRID_LIMIT = 2**31 - 1
# Index spaces below this run the kernel's 32-bit path (rope.cu: narrow_thread).
NARROW_LIMIT = 2**31
# Threads per token tile when tokens are the denser axis (token_tile): one warp.
TILE_THREADS = 32
# Launches with fewer (token, head) pairs than this run one head per thread (decode: latency).
SMALL_TOKEN_HEADS = 2**14


@dataclass
class Request:
    """A validated call, in canonical (B, S, H, D) terms."""

    q: A.ArrayInfo
    k: A.ArrayInfo | None
    q_out: A.ArrayInfo | None
    k_out: A.ArrayInfo | None
    cos: A.ArrayInfo
    sin: A.ArrayInfo
    positions: A.ArrayInfo | None
    offsets: A.ArrayInfo | None
    cu_seqlens: A.ArrayInfo | None
    offset: int
    cq: Canonical
    ck: Canonical | None
    layout: str
    interleaved: bool
    rotary_dim: int
    rotary_offset: int
    inverse: bool
    device: int | None

    @property
    def dtype(self) -> str:
        return self.q.dtype

    @property
    def num_tokens(self) -> int:
        return self.cq.B * self.cq.S

    @property
    def in_place(self) -> bool:
        """Every output is its own input's view (then nothing outside the window needs copying)."""
        q_in = self.q_out is not None and A.same_view(self.q_out, self.q)
        if self.k is None:
            return q_in
        return q_in and self.k_out is not None and A.same_view(self.k_out, self.k)

    @property
    def pos_mode(self) -> int:
        if self.cu_seqlens is not None:
            return POS_CU_SEQLENS
        if self.positions is not None:
            return POS_POSITIONS
        return POS_OFFSETS if self.offsets is not None else POS_OFFSET


def _int_arg(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    return int(value)


def validate(q, k, cos, sin, *, positions=None, offset=0, cu_seqlens=None, layout="bshd", interleaved=False,
             rotary_dim=None, rotary_offset=0, inverse=False, q_out=None, k_out=None, allow_host=True,
             names=("q", "k"), allow_desc=False) -> Request:
    """Every check of the general API, in one place, before anything is launched or written."""
    check_layout(layout)
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"interleaved: expected a bool, got {type(interleaved).__name__}")
    if not isinstance(inverse, (bool, np.bool_)):
        raise TypeError(f"inverse: expected a bool, got {type(inverse).__name__}")
    qn, kn = names
    qi = A.describe(q, qn, allow_host=allow_host)
    A.check_dtype(qi, A.FLOAT_DTYPES)
    A.check_last_dim_contiguous(qi)
    cq = canonical(qi.shape, qi.strides, layout, qn)
    ki = ck = None
    if k is not None:
        ki = A.describe(k, kn, allow_host=allow_host)
        if ki.dtype != qi.dtype:
            raise TypeError(f"{kn}: dtype {ki.dtype} differs from {qn}'s {qi.dtype}")
        A.check_last_dim_contiguous(ki)
        ck = canonical(ki.shape, ki.strides, layout, kn)
        if (ck.B, ck.S, ck.D) != (cq.B, cq.S, cq.D):
            raise ValueError(f"{kn}: shape {ki.shape} does not match {qn}'s {qi.shape} outside the head axis "
                             f"(only head counts may differ, for GQA/MQA)")
    D = cq.D

    # rotary window
    rdim = D if rotary_dim is None else _int_arg(rotary_dim, "rotary_dim")
    roff = _int_arg(rotary_offset, "rotary_offset")
    if rdim <= 0 or rdim % 2:
        raise ValueError(f"rotary_dim: must be a positive even number, got {rdim}")
    if roff < 0 or roff + rdim > D:
        raise ValueError(f"rotary_dim/rotary_offset: window [{roff}, {roff + rdim}) does not fit the head dim {D}")

    # tables
    ci = A.describe(cos, "cos", allow_host=allow_host)
    si = A.describe(sin, "sin", allow_host=allow_host)
    for t in (ci, si):
        A.check_dtype(t, ("float32",), " (tables are float32: build them with rope_tables)")
        A.check_ndim(t, (2,), "a 2-d table [max_positions, rotary_dim // 2]")
        A.check_last_dim_contiguous(t)
    if ci.shape != si.shape:
        raise ValueError(f"sin: shape {si.shape} differs from cos's {ci.shape}")
    if ci.shape[1] != rdim // 2:
        hint = "" if rotary_dim is not None else f" (rotary_dim defaults to the head dim {D}; pass rotary_dim={2 * ci.shape[1]}?)"
        raise ValueError(f"cos: has {ci.shape[1]} columns but rotary_dim {rdim} needs {rdim // 2}{hint}")
    if ci.shape[0] > 1 and ci.strides[0] != si.strides[0]:
        raise ValueError(f"sin: row stride {si.strides[0]} differs from cos's {ci.strides[0]}")
    for t in (ci, si):
        if t.device is not None:  # the kernel loads table entries as aligned floats
            A.check_aligned(t, t.itemsize)

    # positions
    pi = oi = cui = None
    off = 0
    if cu_seqlens is not None:
        if layout != "thd":
            raise ValueError(f"cu_seqlens: only for layout 'thd' (packed tokens), not {layout!r}")
        if positions is not None:
            raise ValueError("positions and cu_seqlens: pass one of them, not both")
        cui = A.describe(cu_seqlens, "cu_seqlens", allow_host=allow_host)
        A.check_dtype(cui, A.INDEX_DTYPES)
        A.check_ndim(cui, (1,), "a 1-d array [num_seqs + 1]")
        if cui.shape[0] < 2:
            raise ValueError(f"cu_seqlens: needs at least 2 entries ([0, T] for one sequence), got {cui.shape[0]}")
        A.check_contiguous(cui)
        if cui.device is not None:  # loaded as aligned int32/int64
            A.check_aligned(cui, cui.itemsize)
    if positions is not None:
        if offset is not None and not (isinstance(offset, (int, np.integer)) and int(offset) == 0):
            raise ValueError("positions and offset: pass one of them (positions are absolute)")
        pi = A.describe(positions, "positions", allow_host=allow_host)
        A.check_dtype(pi, A.INDEX_DTYPES)
        want = (cq.S,) if layout == "thd" else (cq.B, cq.S)
        if pi.shape != want:
            raise ValueError(f"positions: expected shape {want} (one per token), got {pi.shape}")
        A.check_contiguous(pi)
        if pi.device is not None:  # loaded as aligned int32/int64
            A.check_aligned(pi, pi.itemsize)
    elif isinstance(offset, (int, np.integer)) and not isinstance(offset, (bool, np.bool_)):
        off = int(offset)
        if cui is None and cq.S and cq.B and (off < 0 or off + cq.S > ci.shape[0]):
            raise ValueError(f"offset: positions {off}..{off + cq.S - 1} fall outside the table's {ci.shape[0]} rows")
    elif offset is None:
        off = 0
    else:
        oi = A.describe(offset, "offset", allow_host=allow_host)
        A.check_dtype(oi, A.INDEX_DTYPES)
        nseq = (cui.shape[0] - 1) if cui is not None else cq.B
        if oi.shape != (nseq,):
            raise ValueError(f"offset: an array offset needs shape ({nseq},) (one per sequence), got {oi.shape}")
        A.check_contiguous(oi)
        if oi.device is not None:
            A.check_aligned(oi, oi.itemsize)

    # outputs
    qo = ko = None
    if q_out is not None:
        qo = A.describe(q_out, f"{qn}_out" if k is not None else "out", allow_host=allow_host)
        _check_out(qo, qi)
    if k_out is not None:
        if k is None:
            raise ValueError("k_out: given without k")
        ko = A.describe(k_out, f"{kn}_out", allow_host=allow_host)
        _check_out(ko, ki)

    inputs = [x for x in (qi, ki, ci, si, pi, oi, cui) if x is not None]
    outs = [(qo, qi)] + ([(ko, ki)] if ko is not None else [])
    A.check_outputs([(o, own) for o, own in outs if o is not None], inputs)
    everything = inputs + [o for o, _ in outs if o is not None]
    if not allow_desc:
        for x in everything:
            if isinstance(x.array, TensorDesc):  # no address: launching would read address 0
                raise TypeError(f"{x.name}: a TensorDesc declares an array but holds none; pass arrays here "
                                "(declarations are for building a RopePlan)")
    hosts = {x.device is None for x in everything if not isinstance(x.array, TensorDesc)}
    if len(hosts) > 1:
        host = [x.name for x in everything if x.device is None]
        raise TypeError(f"{', '.join(host)}: host (NumPy) arrays mixed with device arrays; pass all of one kind")
    device = A.check_same_device(everything)
    return Request(qi, ki, qo, ko, ci, si, pi, oi, cui, off, cq, ck, layout, bool(interleaved), rdim, roff,
                   bool(inverse), device)


def _check_out(out: A.ArrayInfo, inp: A.ArrayInfo) -> None:
    if out.dtype != inp.dtype:
        raise TypeError(f"{out.name}: dtype {out.dtype} differs from {inp.name}'s {inp.dtype} (the output keeps the input dtype)")
    if out.shape != inp.shape:
        raise ValueError(f"{out.name}: shape {out.shape} differs from {inp.name}'s {inp.shape}")
    A.check_last_dim_contiguous(out)


# ---------------------------------------------------------------------------------------------
# kernel configuration

def _views(req: Request):
    """(info, canonical strides) of the four tensors the kernel touches (outputs default to inputs)."""
    lay = req.layout
    q_out = req.q_out or req.q
    out = [(req.q, req.cq), (q_out, canonical(q_out.shape, q_out.strides, lay, q_out.name))]
    if req.k is not None:
        k_out = req.k_out or req.k
        out += [(req.k, req.ck), (k_out, canonical(k_out.shape, k_out.strides, lay, k_out.name))]
    return out


def allowed_vectors(req: Request) -> tuple[int, ...]:
    """Vector widths (elements, widest first) the window and strides allow, pointers aside."""
    D, R, ro = req.cq.D, req.rotary_dim, req.rotary_offset
    copy = not req.in_place and R < D
    out = []
    for vec in rope_vector_widths(req.dtype, req.interleaved):
        if ro % vec or ((R // 2) if not req.interleaved else R) % vec or (copy and D % vec):
            continue
        if all(extent <= 1 or stride % vec == 0 for _, c in _views(req)
               for extent, stride in ((c.B, c.sb), (c.S, c.ss), (c.H, c.sh))):
            out.append(vec)
    return tuple(out)


def choose_vector(req: Request) -> int:
    """The widest vector (elements) every address the kernel forms is aligned to."""
    size = req.q.itemsize
    D, R, ro = req.cq.D, req.rotary_dim, req.rotary_offset
    half = R // 2
    views = _views(req)
    copy = not req.in_place and R < D
    culprit = req.q.name  # what stopped the narrowest width: the error names it
    for vec in rope_vector_widths(req.dtype, req.interleaved):
        if ro % vec or (half if not req.interleaved else R) % vec:
            culprit = "rotary_offset/rotary_dim"
            continue
        if copy and (D % vec):
            culprit = f"{req.q.name} (head dim {D})"
            continue
        ok = True
        for info, c in views:
            if info.ptr % (vec * size):
                ok = False
            for extent, stride in ((c.B, c.sb), (c.S, c.ss), (c.H, c.sh)):
                if extent > 1 and stride % vec:
                    ok = False
            if not ok:
                culprit = info.name
                break
        if ok:
            return vec
    worst = min(rope_vector_widths(req.dtype, req.interleaved))
    raise ValueError(
        f"{culprit}: addresses or strides are not aligned to {worst * size} bytes, the smallest access "
        f"{'interleaved pairs' if req.interleaved else 'the kernel'} can use for {req.dtype}; pass an aligned copy"
    )


def fill_params(p: RopeParams, req: Request, vec: int) -> None:
    views = _views(req)
    (qi, cq), (qo, cqo) = views[0], views[1]
    p.q_in, p.q_out = qi.ptr, qo.ptr
    p.q_in_sb, p.q_in_ss, p.q_in_sh = cq.sb, cq.ss, cq.sh
    p.q_out_sb, p.q_out_ss, p.q_out_sh = cqo.sb, cqo.ss, cqo.sh
    if req.k is not None:
        (ki, ck), (ko, cko) = views[2], views[3]
        p.k_in, p.k_out = ki.ptr, ko.ptr
        p.k_in_sb, p.k_in_ss, p.k_in_sh = ck.sb, ck.ss, ck.sh
        p.k_out_sb, p.k_out_ss, p.k_out_sh = cko.sb, cko.ss, cko.sh
        p.k_heads = ck.H
    else:
        p.k_in = p.k_out = 0
        p.k_in_sb = p.k_in_ss = p.k_in_sh = p.k_out_sb = p.k_out_ss = p.k_out_sh = 0
        p.k_heads = 0
    p.cos, p.sin = req.cos.ptr, req.sin.ptr
    p.table_rows = req.cos.shape[0]
    p.table_stride = req.cos.strides[0]
    p.positions = req.positions.ptr if req.positions is not None else 0
    p.offsets = req.offsets.ptr if req.offsets is not None else 0
    p.cu_seqlens = req.cu_seqlens.ptr if req.cu_seqlens is not None else 0
    p.offset = req.offset
    p.num_tokens = req.num_tokens
    p.seq_len = max(req.cq.S, 1)
    p.num_seqs = req.cu_seqlens.shape[0] - 1 if req.cu_seqlens is not None else req.cq.B
    p.q_heads, p.head_dim = req.cq.H, req.cq.D
    p.rot_offset, p.rot_half = req.rotary_offset, req.rotary_dim // 2
    p.pos_mode = req.pos_mode
    p.index_flags = ((IDX_POSITIONS_I64 if req.positions is not None and req.positions.dtype == "int64" else 0)
                     | (IDX_OFFSETS_I64 if req.offsets is not None and req.offsets.dtype == "int64" else 0)
                     | (IDX_CU_SEQLENS_I64 if req.cu_seqlens is not None and req.cu_seqlens.dtype == "int64" else 0))
    p.inverse = int(req.inverse)
    p.copy_passthrough = int(not req.in_place and req.rotary_dim < req.cq.D)
    # Table rows read NPAIR floats per access when every row slice is aligned to that.
    npair = vec // 2 if req.interleaved else vec
    rows_aligned = req.cos.shape[0] <= 1 or req.cos.strides[0] % npair == 0
    p.table_vec = int(rows_aligned and req.cos.ptr % (4 * npair) == 0 and req.sin.ptr % (4 * npair) == 0)
    space = index_space(req, vec)
    p.tile, p.units, p.groups, p.copy_units = space.tile, space.units, space.groups, space.copy_units
    p.rot_total, p.total, p.narrow = space.rot_total, space.total, int(space.narrow)
    if space.narrow:  # (a zero extent means no thread divides by it: 1 stands in)
        p.div_units = fast_divisor(max(space.units, 1))
        p.div_groups = fast_divisor(max(space.groups, 1))
        p.div_tile = fast_divisor(space.tile)
        p.div_seq = fast_divisor(p.seq_len)
        p.div_copy_units = fast_divisor(max(space.copy_units, 1))
        p.div_heads = fast_divisor(max(space.heads, 1))


def tokens_denser(req: Request) -> bool:
    """Whether consecutive tokens of a head lie closer in memory than consecutive heads (bhsd)."""
    return not (req.cq.H <= 1 or req.num_tokens <= 1 or abs(req.cq.sh) <= abs(req.cq.ss))


def token_tile(req: Request, units: int) -> int:
    """Tokens per tile of the thread order (tile, head group, token, unit).

    1 when heads are the denser axis (bshd, thd): a warp covers one token's heads, in memory
    order. When tokens are (bhsd), TILE_THREADS // units tokens: a warp reads consecutive rows
    of one head (one contiguous run), and the block's other warps, on other heads, find the
    same cos/sin rows in L1. Measured on the H200 (scripts/rope_variants.py): 91-93% of the copy
    rate at S=4096 and S=16384 alike, where walking each head's tokens end to end (a tile of
    every token) gave 93-96% at S=4096 but 86-89% at S=16384.
    """
    if not tokens_denser(req):
        return 1
    return max(1, min(TILE_THREADS // max(units, 1), req.num_tokens))


@dataclass(frozen=True)
class IndexSpace:
    """The flat kernel's threads for one launch: rot_total rotating threads (one per token, head
    group and unit, the token count rounded up to whole tiles), then the copying ones."""

    head_batch: int
    tile: int
    units: int        # vector units per head group
    groups: int       # head groups
    copy_units: int   # units per head outside the rotary window (out of place), else 0
    heads: int
    rot_total: int
    total: int

    @property
    def narrow(self) -> bool:
        """Whether the launch fits the 32-bit entry (rope.cu: rope_apply, not rope_apply_wide)."""
        return self.total < NARROW_LIMIT


def index_space(req: Request, vec: int) -> IndexSpace:
    """The one derivation of the launch's threads: fill_params, launch_shape and kernel_for all read it."""
    D, R = req.cq.D, req.rotary_dim
    units = (R if req.interleaved else R // 2) // vec
    copy_units = (D - R) // vec if (not req.in_place and R < D) else 0
    heads = req.cq.H + (req.ck.H if req.ck is not None else 0)
    hb = head_batch(req)
    groups = -(-heads // hb)
    tile = token_tile(req, units)
    tokens = -(-req.num_tokens // tile) * tile  # whole tiles; the kernel skips the padding
    rot_total = tokens * groups * units
    return IndexSpace(hb, tile, units, groups, copy_units, heads, rot_total, rot_total + tokens * heads * copy_units)


def is_narrow(req: Request, vec: int) -> bool:
    """Whether the launch runs the 32-bit entry point."""
    return index_space(req, vec).narrow


def head_batch(req: Request) -> int:
    """Heads per thread for this launch (registry.rope_head_batch: 1 for small launches)."""
    heads = req.cq.H + (req.ck.H if req.ck is not None else 0)
    return rope_head_batch(req.interleaved, small=req.num_tokens * heads < SMALL_TOKEN_HEADS,
                           heads_inner=not tokens_denser(req))


def kernel_for(kernels: dict, req: Request, vec: int):
    """The entry (narrow or wide) of the kernel for this launch, from a plan's loaded kernels."""
    space = index_space(req, vec)
    return kernels[(vec, space.head_batch)][0 if space.narrow else 1]


def launch_shape(req: Request, vec: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of the flat kernel: one thread per (token, head, vector unit), like a copy."""
    total = index_space(req, vec).total
    # Below NARROW_LIMIT one thread per index; past it the kernel grid-strides up to the limit.
    blocks = min(max(1, -(-total // BLOCK_THREADS)), GRID_LIMIT)
    return (blocks, 1, 1), (BLOCK_THREADS, 1, 1)


# ---------------------------------------------------------------------------------------------
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


class RopePlan:
    """A prepared :func:`apply_rope_qk` for inference engines.

    Build it from arrays or :class:`~rope_rtc.TensorDesc` declarations with the same keywords as
    ``apply_rope_qk``; ``compile()`` once; then ``execute`` validates and launches with no
    allocation, no synchronisation and no compilation. Fixed by the plan: dtype, layout, pair
    style, rotary window, direction, head counts, head dim, the position scheme and the device.
    Free between executes: the token count (B, S or T, including zero), strides and addresses.

    ``q_out``/``k_out`` at construction decide in place (omitted, or ``q_out=q``) or out of place;
    an out-of-place plan needs ``q_out``/``k_out`` at every ``execute``. ``execute`` remembers the
    last 16 argument sets it saw (holding references to them) and skips re-validation when one
    repeats; new arrays of a shape, stride and dtype signature seen before get the cheaper
    pointer-only checks. From its second launch, a remembered set is launched as a one-node
    CUDA graph instantiated once for it (about 2 µs of host time instead of 4-6 µs for
    ``cuLaunchKernel``; never into a stream that is being captured; a new scalar ``offset`` is
    a new set; ``ROPE_RTC_NO_GRAPH_REPLAY=1`` turns it off).
    Capturable in a CUDA graph: capture ``execute`` on the capturing stream, then refill the same
    buffers and replay. A plan holds one argument block: give each thread its own plan.
    """

    def __init__(self, q, k, cos, sin, *, positions=None, offset=0, cu_seqlens=None, layout: str = "bshd",
                 interleaved: bool = False, rotary_dim: int | None = None, rotary_offset: int = 0,
                 inverse: bool = False, q_out=None, k_out=None, device: int | None = None) -> None:
        self._opts = dict(layout=layout, interleaved=interleaved, rotary_dim=rotary_dim,
                          rotary_offset=rotary_offset, inverse=inverse)
        req = validate(q, k, cos, sin, positions=positions, offset=offset, cu_seqlens=cu_seqlens,
                       q_out=q_out, k_out=k_out, allow_host=False, allow_desc=True, **self._opts)
        # Omitted outputs, or q_out=q / k_out=k, mean in place (Request.in_place needs both given).
        self.in_place = ((q_out is None or A.same_view(req.q_out, req.q))
                         and (k_out is None or k is None or A.same_view(req.k_out, req.k)))
        if not self.in_place and k is not None and k_out is None:
            raise ValueError("k_out: an out-of-place plan (q_out given) needs k_out too")
        if not self.in_place and q_out is None:  # execute() would refuse every call
            raise ValueError("q_out: an out-of-place plan (k_out given) needs q_out too")
        self.dtype, self.layout = req.dtype, layout
        self.interleaved, self.inverse = bool(interleaved), bool(inverse)
        self.rotary_dim, self.rotary_offset = req.rotary_dim, req.rotary_offset
        self.q_heads, self.head_dim = req.cq.H, req.cq.D
        self.k_heads = req.ck.H if req.ck is not None else 0
        self.has_k = k is not None
        self.pos_mode = req.pos_mode
        if device is None:
            device = req.device if req.device is not None else _current_device()
        self.device = int(device)
        self._kernels: dict[int, object] = {}
        self._compiled = False
        # The last call, for the identity fast path (a flat tuple: indexing it is the cheapest read):
        # (q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens, q.shape, launch prefix or
        #  None when there is nothing to launch, S for the scalar-offset bound check or 0).
        self._last = None
        self._templates: dict[tuple, _Template] = {}
        self._filled: _Template | None = None
        self._args = StructArg(RopeParams)
        self._params_address = ctypes.addressof(self._args.values)
        # The last RECENT_SETS argument sets by identity, each with its filled argument block:
        # engines cycle through a few buffers (per layer, per double-buffered step), and a
        # repeat restores the block in one copy instead of re-deriving it. Keyed by the
        # arguments' ids; each entry holds its arguments (in its _last tuple), so the ids cannot
        # be reused while the entry lives.
        self._recent: dict[tuple, tuple] = {}

    def compile(self) -> "RopePlan":
        """Load the kernels this plan can launch (every vector width of its dtype and pair style),
        compiling on a cache miss. After this, ``execute`` never compiles."""
        for vec in rope_vector_widths(self.dtype, self.interleaved):
            for hb in rope_head_batches(self.interleaved):
                k = load_kernel(rope_spec(self.dtype, self.interleaved, vec, hb), self.device)
                self._kernels[(vec, hb)] = tuple(k.functions[e] for e in ROPE_ENTRIES)  # (narrow, wide)
        self._launch = Launcher(self._args.address, self.device)
        self._compiled = True
        return self

    def execute(self, q, k=None, cos=None, sin=None, positions=None, q_out=None, k_out=None, stream=None, *,
                offset=None, cu_seqlens=None):
        """Validate (cheaply when the arrays repeat) and launch. Returns ``(q_out, k_out)``."""
        last = self._last
        off = 0 if offset is None else offset
        if not (last is not None and q is last[0] and k is last[1] and cos is last[2] and sin is last[3]
                and positions is last[4] and q_out is last[5] and k_out is last[6] and cu_seqlens is last[8]
                and q.shape == last[9] and (off is last[7] or (type(off) is int and type(last[7]) is int))):
            self._prepare(q, k, cos, sin, positions, q_out, k_out, off, cu_seqlens)
            last = self._last
        elif type(off) is int and off != last[7]:
            # A new decode step with a new scalar offset: only that field changes.
            self._set_offset(off)
            last = self._last
        qo = q if q_out is None else q_out
        ko = k if k_out is None else k_out
        if last[10] is None:
            return qo, ko
        self._launch(last[10], stream, last)
        return qo, ko

    def _set_offset(self, offset: int) -> None:
        if self.pos_mode == POS_POSITIONS:
            raise ValueError("positions and offset: pass one of them (positions are absolute)")
        rows = self._args.values.table_rows
        S = self._last[11]
        if S and (offset < 0 or offset + S > rows):
            raise ValueError(f"offset: positions {offset}..{offset + S - 1} fall outside the table's {rows} rows")
        self._args.values.offset = offset
        self._last = self._last[:7] + (offset,) + self._last[8:]

    def _prepare(self, q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens) -> None:
        if not self._compiled:
            self.compile()
        key = (id(q), id(k), id(cos), id(sin), id(positions), id(q_out), id(k_out), id(cu_seqlens),
               None if type(offset) is int else id(offset))
        hit = self._recent.get(key)
        if hit is not None and hit[1][9] == q.shape:
            snapshot, last = hit
            ctypes.memmove(self._params_address, snapshot, len(snapshot))
            self._filled = None  # the block no longer matches what the templates last wrote
            self._last = last
            if type(offset) is int and offset != last[7]:
                self._set_offset(offset)
            return
        self._prepare_new(q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens)
        remember(self._recent, key, (bytes(self._args.values), self._last))

    def _prepare_new(self, q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens) -> None:
        """Arguments not among the recent sets: template reuse or full validation."""
        qo = q if (q_out is None and self.in_place) else q_out
        ko = k if (k_out is None and self.in_place) else k_out
        arrays = (q, k, cos, sin, positions, qo, ko, cu_seqlens, None if type(offset) is int else offset)
        sig = _signature(arrays, qo is q, ko is k)
        tmpl = self._templates.get(sig) if sig is not None else None
        if tmpl is not None and self._reuse(tmpl, arrays, offset, q_out, k_out):
            return
        self._full_prepare(q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens, arrays, sig)

    def _reuse(self, tmpl: "_Template", arrays, offset, q_out, k_out) -> bool:
        """Arrays of a shape/stride/dtype signature validated before: only pointer-dependent
        checks run (alignment, and overlap when the arrays' relative placement is new). False
        sends the call through full validation (which raises on a real problem)."""
        ptrs = tuple(0 if a is None else a.data.ptr for a in arrays)
        if not tmpl.placement_ok(ptrs):
            return False
        if type(offset) is int and offset and tmpl.req.positions is not None:
            return False  # positions and an offset: full validation rejects it
        for i, mask in tmpl.natural:
            if ptrs[i] & mask:
                return False  # a table or index array off its natural alignment
        vec = tmpl.vector_for(ptrs)
        if vec is None:
            return False
        if type(offset) is int and tmpl.pos_offset_rows is not None:
            S, rows = tmpl.pos_offset_rows
            if S and (offset < 0 or offset + S > rows):
                return False
        p = self._args.values
        if self._filled is not tmpl or tmpl.filled_vec != vec:
            fill_params(p, tmpl.req, vec)
            self._filled, tmpl.filled_vec = tmpl, vec
        tmpl.write_pointers(p, ptrs, vec, offset)
        q, k, cos, sin, positions, _, _, cu_seqlens, _ = arrays
        self._last = (q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens, q.shape,
                      tmpl.prefix(self._kernels, vec), tmpl.pos_offset_rows[0] if tmpl.pos_offset_rows else 0)
        return True

    def _full_prepare(self, q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens, arrays, sig) -> None:
        if self.has_k != (k is not None):
            raise TypeError("k: this plan was built " + ("with" if self.has_k else "without") + " k")
        if self.in_place:
            if q_out is not None and q_out is not q:
                raise ValueError("q_out: this plan rotates in place; pass q_out=None or q_out=q")
            if k_out is not None and k_out is not k:
                raise ValueError("k_out: this plan rotates in place; pass k_out=None or k_out=k")
            qo, ko = q, k
        else:
            if q_out is None or (self.has_k and k_out is None):
                raise TypeError("q_out/k_out: this plan writes to separate outputs; pass them to execute()")
            qo, ko = q_out, k_out
        req = validate(q, k, cos, sin, positions=positions, offset=offset,
                       cu_seqlens=cu_seqlens, q_out=qo, k_out=ko, allow_host=False, **self._opts)
        if req.device is not None and req.device != self.device:
            A.check_same_device([req.q], self.device)
        problems = []
        if req.dtype != self.dtype:
            problems.append(f"dtype {req.dtype} (plan: {self.dtype})")
        if (req.cq.H, req.cq.D) != (self.q_heads, self.head_dim):
            problems.append(f"q heads/dim {(req.cq.H, req.cq.D)} (plan: {(self.q_heads, self.head_dim)})")
        if req.ck is not None and req.ck.H != self.k_heads:
            problems.append(f"k heads {req.ck.H} (plan: {self.k_heads})")
        if req.pos_mode != self.pos_mode:
            problems.append("the position scheme (positions / offset array / cu_seqlens) differs from the plan's")
        if problems:
            raise ValueError("execute: " + "; ".join(problems))
        prefix = None
        if req.num_tokens:
            vec = choose_vector(req)
            fill_params(self._args.values, req, vec)
            prefix = launch_prefix(kernel_for(self._kernels, req, vec), *launch_shape(req, vec))
        self._filled = None
        if sig is not None:
            if len(self._templates) >= 64:  # bounded: engines cycle through a few shapes
                self._templates.clear()
            self._templates[sig] = _Template(req, arrays)
        self._last = (q, k, cos, sin, positions, q_out, k_out, offset,
                      cu_seqlens, q.shape, prefix, req.cq.S if req.pos_mode == POS_OFFSET else 0)


def _current_device() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def _signature(arrays, q_in_place: bool, k_in_place: bool):
    """Shape/stride/dtype/device of each argument, when every one is a CuPy array (else None)."""
    parts = []
    for a in arrays:
        if a is None:
            parts.append(None)
        elif type(a).__name__ == "ndarray" and type(a).__module__.startswith("cupy"):
            parts.append((a.shape, a.strides, a.dtype, a.data.device_id))
        else:
            return None
    return (tuple(parts), q_in_place, k_in_place)


class _Template:
    """What full validation established for one argument signature, minus the pointers.

    Order of ``arrays``/``ptrs``: q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offset array.
    """

    OUTPUTS = ((5, 0), (6, 1))  # (output index, its own input index)

    def __init__(self, req: Request, arrays) -> None:
        self.req = req
        infos = (req.q, req.k, req.cos, req.sin, req.positions, req.q_out, req.k_out, req.cu_seqlens, req.offsets)
        ptrs = tuple(0 if a is None else a.data.ptr for a in arrays)
        # Extents relative to each array's pointer; and the placement full validation accepted.
        self.extents = tuple(None if i is None or i.size == 0 else tuple(e - i.ptr for e in i.byte_extent())
                             for i in infos)
        self.validated = tuple(p - ptrs[0] for p in ptrs)
        self.in_place = tuple(arrays[o] is not None and arrays[o] is arrays[i] for o, i in self.OUTPUTS)
        self.allowed = allowed_vectors(req)
        self.itemsize = req.q.itemsize
        # Tables and index arrays are read as aligned 4/8-byte scalars: (argument, alignment mask).
        self.natural = tuple((i, info.itemsize - 1) for i, info in enumerate(infos)
                             if i in (2, 3, 4, 7, 8) and info is not None)
        self.npair_div = 2 if req.interleaved else 1
        self.pos_offset_rows = (req.cq.S, req.cos.shape[0]) if req.pos_mode == POS_OFFSET and req.cu_seqlens is None else None
        self.rows_stride = req.cos.strides[0] if req.cos.shape[0] > 1 else 0
        self.filled_vec = None
        self._prefixes: dict[int, tuple] = {}

    def placement_ok(self, ptrs) -> bool:
        if tuple(p - ptrs[0] for p in ptrs) == self.validated:
            return True  # same relative placement as a validated call: same overlap answer
        for (o, own), same in zip(self.OUTPUTS, self.in_place):
            eo = self.extents[o]
            if eo is None:
                continue
            lo, hi = ptrs[o] + eo[0], ptrs[o] + eo[1]
            for j, ej in enumerate(self.extents):
                if ej is None or j == o or (same and j == own):
                    continue
                if ptrs[j] + ej[0] < hi and lo < ptrs[j] + ej[1]:
                    return False  # extents meet: let full validation decide exactly
        return True

    def vector_for(self, ptrs) -> int | None:
        combined = ptrs[0] | ptrs[1] | ptrs[5] | ptrs[6]
        for vec in self.allowed:
            if combined % (vec * self.itemsize) == 0:
                return vec
        return None

    def write_pointers(self, p: RopeParams, ptrs, vec: int, offset) -> None:
        q, k, cos, sin, positions, q_out, k_out, cu, offs = ptrs
        p.q_in, p.k_in, p.cos, p.sin = q, k, cos, sin
        p.q_out = q_out or q
        p.k_out = k_out or k
        p.positions, p.cu_seqlens, p.offsets = positions, cu, offs
        if type(offset) is int:
            p.offset = offset
        npair = vec // self.npair_div
        p.table_vec = int(self.rows_stride % npair == 0 and cos % (4 * npair) == 0 and sin % (4 * npair) == 0)

    def prefix(self, kernels: dict, vec: int):
        pre = self._prefixes.get(vec)
        if pre is None and self.req.num_tokens:
            pre = self._prefixes[vec] = launch_prefix(kernel_for(kernels, self.req, vec), *launch_shape(self.req, vec))
        return pre
