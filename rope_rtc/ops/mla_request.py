"""The checks of an MLA call (rope_rtc.ops.mla) and its argument block: every check runs before
anything is launched or written, and each error names the argument and the fix.

An MLA call: q ``[T, H, nope + R]`` (the last R channels rotate), k_pe ``[T, R]`` or ``[T, 1, R]``
(one rotary head shared by all q heads, rotated in place), kv_c ``[T, L]`` (the compressed latent),
cos/sin ``[rows, R / 2]`` float32, positions and slot_mapping ``[T]`` int32/int64, and a paged
cache ``[num_blocks, block_size, L + R]`` of q's dtype or FP8 (uint8 storage, a per-tensor scale),
whose row for token t is ``[kv_c[t] | rotated k_pe[t]]``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import numpy as np

from ..build.registry_mla import mla_vector_widths
from ..core import arrays as A
from ..numerics.cache_options import CACHE_KINDS, check_cache_dtype, check_scale_given
from .rope_params import fast_divisor
from .rope_request import check_kinds, check_position_rows

# q_fp8_dtype -> MLA_QFP8 code of mla_rope_cache.cu (kv_cache_dtype: CACHE_KINDS)
FP8_KINDS = {"fp8_e4m3": 1, "fp8_e5m2": 2}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# Argument order of the core's calls.
ARGS = ("q", "k_pe", "kv_c", "cos", "sin", "positions", "slot_mapping", "kv_cache", "kv_scale", "q_out", "q_fp8_out",
        "q_fp8_scale")
Q, K_PE, KV_C, COS, SIN, POSITIONS, SLOTS, KV_CACHE, KV_SCALE, Q_OUT, Q_FP8_OUT, Q_FP8_SCALE = range(len(ARGS))

_U64, _I64 = ctypes.c_uint64, ctypes.c_int64
MLA_FIELDS = [(n, _U64) for n in ("q", "q_out", "q_fp8", "k_pe", "kv_c", "cache", "slot_mapping", "positions", "cos",
                                  "sin", "cache_scale", "q_scale")] + \
             [(n, _I64) for n in ("q_st", "q_sh", "qo_st", "qo_sh", "qf_st", "qf_sh", "kpe_st", "kvc_st", "cache_sb",
                                  "cache_so", "num_slots", "block_size", "table_rows", "table_stride", "index_flags",
                                  "slot_i64", "total", "q_units", "token_units")] + \
             [(n, _U64) for n in ("div_block", "div_token", "div_q_units")]


class MlaParams(ctypes.Structure):
    """The host mirror of ``struct MlaParams`` in cuda_src/mla_rope_cache.cu (every field 8 bytes)."""

    _fields_ = MLA_FIELDS


@dataclass
class MlaRequest:
    """A validated call: each argument's description (None where absent) and what the launch fixes."""

    q: A.ArrayInfo
    k_pe: A.ArrayInfo
    kv_c: A.ArrayInfo
    cos: A.ArrayInfo
    sin: A.ArrayInfo
    positions: A.ArrayInfo
    slots: A.ArrayInfo
    cache: A.ArrayInfo
    kv_scale: A.ArrayInfo | None
    q_out: A.ArrayInfo | None  # None: in place
    q_fp8: A.ArrayInfo | None
    q_scale: A.ArrayInfo | None
    interleaved: bool
    kind: int  # CACHE_KINDS code
    q_kind: int  # FP8_KINDS code of the FP8 q, 0 for none
    nope: int
    rope: int
    lora: int
    vec: int
    device: int | None

    @property
    def dtype(self) -> str:
        return self.q.dtype

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def num_slots(self) -> int:
        return self.cache.shape[0] * self.cache.shape[1]

    def infos(self) -> tuple:
        """Every argument's description in the core's order (``ARGS``); q_out is q in place."""
        return (self.q, self.k_pe, self.kv_c, self.cos, self.sin, self.positions, self.slots, self.cache,
                self.kv_scale, self.q_out or self.q, self.q_fp8, self.q_scale)

    def without_arrays(self) -> "MlaRequest":
        """The same request holding no caller's array (what a template keeps)."""
        strip = {f: replace(getattr(self, f), array=None) for f in
                 ("q", "k_pe", "kv_c", "cos", "sin", "positions", "slots", "cache", "kv_scale", "q_out", "q_fp8",
                  "q_scale") if getattr(self, f) is not None}
        return replace(self, **strip)


def check_options(kv_cache_dtype, q_fp8_dtype, interleaved) -> None:
    """The options' types and values (before they are hashed into a plan's key)."""
    check_cache_dtype(kv_cache_dtype)
    if not isinstance(q_fp8_dtype, str) or q_fp8_dtype not in FP8_KINDS:
        raise ValueError(f"q_fp8_dtype: expected one of {', '.join(map(repr, FP8_KINDS))}, got {q_fp8_dtype!r}")
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"interleaved: expected True (adjacent pairs, DeepSeek's) or False (half-split pairs), got "
                        f"{interleaved!r}")


def q_units(req: MlaRequest) -> int:
    """Threads per q head: the rotary units, and one per vector of the unrotated channels when they
    are copied (q_out given) or quantised (FP8 q)."""
    rot = (req.rope if req.interleaved else req.rope // 2) // req.vec
    return rot + (req.nope // req.vec if (req.q_out is not None or req.q_fp8 is not None) else 0)


def token_units(req: MlaRequest) -> int:
    """Threads per token: its q heads', then its cache row's (k_pe's rotary units, kv_c's vectors)."""
    rot = (req.rope if req.interleaved else req.rope // 2) // req.vec
    return req.heads * q_units(req) + rot + req.lora // req.vec


def threads(req: MlaRequest) -> int:
    return req.num_tokens * token_units(req)


def _describe(obj, name: str, host: bool) -> A.ArrayInfo:
    info = A.describe(obj, name, allow_host=host)
    A.check_holds_memory(info)
    return info


def _same_dtype(info: A.ArrayInfo, q: A.ArrayInfo) -> None:
    if info.dtype != q.dtype:  # a dtype is a TypeError, as for every other argument
        raise TypeError(f"{info.name}: dtype {info.dtype} differs from q's {q.dtype}; pass every activation in one "
                        "dtype")


def _index_array(obj, name: str, T: int, host: bool) -> A.ArrayInfo:
    info = _describe(obj, name, host)
    A.check_dtype(info, A.INDEX_DTYPES)
    if info.shape != (T,):
        raise ValueError(f"{name}: expected one entry per token, shape ({T},), got {info.shape}")
    A.check_contiguous(info)
    if info.device is not None:  # read as aligned int32/int64
        A.check_aligned(info, info.itemsize)
    return info


def _scale(obj, name: str, host: bool) -> A.ArrayInfo:
    info = _describe(obj, name, host)
    A.check_dtype(info, ("float32",))
    if info.size != 1:
        raise ValueError(f"{name}: expected one element (a per-tensor scale), got shape {info.shape}")
    if info.device is not None:
        A.check_aligned(info, 4)
    return info


def validate_mla_call(q, k_pe, kv_c, cos, sin, positions, slot_mapping, kv_cache, *, kv_cache_dtype="auto",
                      kv_scale=None, q_out=None, q_fp8_out=None, q_fp8_scale=None, q_fp8_dtype="fp8_e4m3",
                      interleaved=True, qk_nope_head_dim=None, allow_host_slots: bool = False,
                      host: bool = False) -> MlaRequest:
    """Every check of an MLA call, before anything is launched or written. ``host``: host arrays
    are accepted, all of one kind (the one-call function's host path); ``allow_host_slots``: a
    NumPy ``slot_mapping`` with device arrays (the one-call function copies it), checked value by
    value as host slots always are."""
    check_options(kv_cache_dtype, q_fp8_dtype, interleaved)
    interleaved = bool(interleaved)  # a NumPy bool (a flag read from a config array) keys builds as a bool
    qi = _describe(q, "q", host)
    A.check_dtype(qi, FLOAT_DTYPES)
    if len(qi.shape) != 3:
        raise ValueError(f"q: expected [tokens, heads, qk_nope_head_dim + qk_rope_head_dim], got shape {qi.shape}")
    A.check_last_dim_contiguous(qi)
    T, H, D = qi.shape
    ki = _describe(k_pe, "k_pe", host)
    _same_dtype(ki, qi)
    if len(ki.shape) == 3 and ki.shape[1] != 1:
        raise ValueError(f"k_pe: {ki.shape[1]} heads (shape {ki.shape}); MLA's rotary k is one head shared by every q "
                         "head: pass [tokens, qk_rope_head_dim] or [tokens, 1, qk_rope_head_dim]")
    if len(ki.shape) not in (2, 3) or ki.shape[0] != T:
        raise ValueError(f"k_pe: expected [{T}, qk_rope_head_dim] or [{T}, 1, qk_rope_head_dim] (q has {T} tokens), "
                         f"got shape {ki.shape}")
    A.check_last_dim_contiguous(ki)
    R = ki.shape[-1]
    if R == 0 or R % 2:
        raise ValueError(f"k_pe: {R} channels; the rotary part is whole channel pairs (an even, non-zero width)")
    if qk_nope_head_dim is not None and (isinstance(qk_nope_head_dim, bool) or not isinstance(qk_nope_head_dim, int)):
        raise TypeError(f"qk_nope_head_dim: expected an int, got {qk_nope_head_dim!r}")
    nope = D - R
    if nope < 0 or (qk_nope_head_dim is not None and qk_nope_head_dim != nope):
        want = "" if qk_nope_head_dim is None else f"qk_nope_head_dim {qk_nope_head_dim} + "
        raise ValueError(f"q: last dim {D} is not {want}qk_rope_head_dim {R} (k_pe's width){'' if want else ' or more'}"
                         "; q is [tokens, heads, qk_nope_head_dim + qk_rope_head_dim], its last channels rotating")
    ci = _describe(kv_c, "kv_c", host)
    _same_dtype(ci, qi)
    if len(ci.shape) != 2 or ci.shape[0] != T:
        raise ValueError(f"kv_c: expected [{T}, kv_lora_rank] (q has {T} tokens), got shape {ci.shape}")
    A.check_last_dim_contiguous(ci)
    L = ci.shape[1]
    tables = []
    for obj, name in ((cos, "cos"), (sin, "sin")):
        ti = _describe(obj, name, host)
        A.check_dtype(ti, ("float32",))
        if len(ti.shape) != 2 or ti.shape[1] * 2 != R:
            raise ValueError(f"{name}: expected a table [max_positions, {R // 2}] (qk_rope_head_dim {R} / 2 columns, "
                             f"k_pe's width and q's rotary part), got shape {ti.shape}")
        A.check_last_dim_contiguous(ti)
        if ti.device is not None:
            A.check_aligned(ti, 4)
        tables.append(ti)
    # A row stride is read only between rows: a one-row table's is free, as for apply_rope.
    if tables[0].shape != tables[1].shape or tables[0].shape[0] > 1 and tables[0].strides[0] != tables[1].strides[0]:
        raise ValueError(f"sin: expected cos's shape and row stride {tables[0].shape} {tables[0].strides}, got "
                         f"{tables[1].shape} {tables[1].strides}")
    if tables[0].shape[0] == 0:
        raise ValueError("cos: the table has no row")
    if isinstance(positions, np.ndarray) and not host:
        raise TypeError("positions: a NumPy (host) array with device arrays; pass the positions where q is")
    pi = _index_array(positions, "positions", T, host)
    if isinstance(slot_mapping, np.ndarray) and not (allow_host_slots or host):
        raise TypeError("slot_mapping: a plan takes device arrays; pass a CuPy/device array (the one-call "
                        "mla_rope_and_cache also takes a NumPy one)")
    # Host slots only as a NumPy array (checked below, then copied): another host array (a torch
    # CPU tensor) would reach the kernel as a host address.
    si = _index_array(slot_mapping, "slot_mapping", T, host or isinstance(slot_mapping, np.ndarray))
    kind = CACHE_KINDS[kv_cache_dtype]
    vi = _describe(kv_cache, "kv_cache", host)
    want = "uint8" if kind else qi.dtype
    if vi.dtype != want:
        hint = "; an FP8 cache is a uint8 array with kv_cache_dtype='fp8_e4m3' or 'fp8_e5m2'" if kind == 0 else ""
        raise TypeError(f"kv_cache: dtype {vi.dtype}, expected {want} for kv_cache_dtype={kv_cache_dtype!r}{hint}")
    if len(vi.shape) != 3:
        raise ValueError(f"kv_cache: expected [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], got shape "
                         f"{vi.shape}")
    if vi.shape[2] != L + R:
        raise ValueError(f"kv_c: {L} channels, but kv_cache rows hold {vi.shape[2]} = kv_lora_rank + qk_rope_head_dim "
                         f"{R} (k_pe's width): expected kv_c of width {vi.shape[2] - R}, or a cache of rows {L + R}")
    A.check_last_dim_contiguous(vi)
    A.check_writable(vi)
    if vi.size > 1 and A.overlaps_itself(vi):
        raise ValueError(f"kv_cache: its rows overlap each other (strides {vi.strides} elements); pass a cache whose "
                         "slots have their own memory")
    num_slots = vi.shape[0] * vi.shape[1]
    if num_slots == 0:
        raise ValueError("kv_cache: holds no slot (a dimension is 0)")
    if num_slots >= 2**31:
        raise ValueError(f"kv_cache: {num_slots} slots; the kernel indexes slots with 32 bits (at most 2^31 - 1)")
    check_scale_given(kv_cache_dtype, kv_scale, "kv_scale", " (an array of one element, where the cache is)")
    vs = _scale(kv_scale, "kv_scale", host) if kind else None
    qo = None
    if q_out is not None and q_out is not q:
        qo = _describe(q_out, "q_out", host)
        _same_dtype(qo, qi)
        if qo.shape != qi.shape:
            raise ValueError(f"q_out: shape {qo.shape} differs from q's {qi.shape}")
        A.check_last_dim_contiguous(qo)
        if A.same_view(qo, qi):  # q's own view under another object: in place
            qo = None
    qf = qs = None
    if (q_fp8_out is None) != (q_fp8_scale is None):
        given, missing = ("q_fp8_out", "q_fp8_scale") if q_fp8_scale is None else ("q_fp8_scale", "q_fp8_out")
        raise TypeError(f"{missing}: {given} is given; an FP8 q needs both its uint8 output [T, H, D] and its float32 "
                        "scale")
    if q_fp8_out is not None:
        qf = _describe(q_fp8_out, "q_fp8_out", host)
        if qf.dtype != "uint8":
            raise TypeError(f"q_fp8_out: dtype {qf.dtype}, expected uint8 (FP8 {q_fp8_dtype} bytes)")
        if qf.shape != qi.shape:
            raise ValueError(f"q_fp8_out: shape {qf.shape} differs from q's {qi.shape}")
        A.check_last_dim_contiguous(qf)
        qs = _scale(q_fp8_scale, "q_fp8_scale", host)
    if si.device is None:  # slots from the host: every value checked
        _check_host_slots(np.asarray(si.array).astype(np.int64), num_slots)
    if pi.device is None:  # positions from the host too: each names a table row
        check_position_rows(np.asarray(pi.array), tables[0].shape[0])
    written = [(x, None) for x in (qo or qi, ki, vi, qf) if x is not None]
    read = [x for x in (qi, ci, *tables, pi, si, vs, qs) if x is not None]
    if host:
        check_kinds(read + [x for x, _ in written])
    device = None if host else A.check_same_device(read + [x for x, _ in written])
    for out, _ in written:
        A.check_writable(out)
        if out.size > 1 and A.overlaps_itself(out):
            raise ValueError(f"{out.name}: its elements overlap each other (strides {out.strides} elements); an "
                             "output needs distinct elements")
    for i, (out, _) in enumerate(written):
        for other in read + [w for w, _ in written[i + 1:]]:
            if other is out:
                continue  # in place: q's (without q_out) and k_pe's own memory
            if A.overlaps(out, other):
                raise ValueError(f"{out.name}: overlaps {other.name}, which the same launch reads or writes; pass "
                                 "separate arrays")
    req = MlaRequest(qi, ki, ci, tables[0], tables[1], pi, si, vi, vs, qo, qf, qs, interleaved, kind,
                     FP8_KINDS[q_fp8_dtype] if qf is not None else 0, nope, R, L, 0, device)
    req.vec = _vector(req)
    if threads(req) >= 2**31:
        raise ValueError(f"q: {T} tokens of {H} heads need more than 2^31 threads; split the call")
    return req


def _check_host_slots(s: np.ndarray, num_slots: int) -> None:
    bad = s >= num_slots
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"slot_mapping: entry {i} is {int(s[i])}, past the cache's {num_slots} slots (a negative "
                         "slot skips its token)")
    # Two tokens writing one slot would race in the kernel: each slot is one token's.
    used = np.flatnonzero(s >= 0)
    order = used[np.argsort(s[used], kind="stable")]
    same = np.flatnonzero(s[order[1:]] == s[order[:-1]])
    if same.size:
        i, j = sorted((int(order[k]), int(order[k + 1])) for k in same)[0]
        raise ValueError(f"slot_mapping: entries {i} and {j} both name slot {int(s[i])}; each slot takes one token's "
                         "row (a negative slot skips its token)")


def widths(req: MlaRequest) -> list[int]:
    """The vectors of :func:`registry_mla.mla_vector_widths` that tile q's parts and the cache row."""
    span = req.rope if req.interleaved else req.rope // 2
    return [v for v in mla_vector_widths(req.dtype, req.interleaved, bool(req.kind or req.q_kind))
            if not (span % v or req.nope % v or req.lora % v)]


def vector_arrays(req: MlaRequest) -> tuple:
    """``(argument index, info)`` of every array the kernel reads or writes in vectors."""
    return tuple((i, x) for i, x in ((Q, req.q), (K_PE, req.k_pe), (KV_C, req.kv_c), (KV_CACHE, req.cache),
                                     (Q_OUT, req.q_out or req.q), (Q_FP8_OUT, req.q_fp8)) if x is not None)


def strides_allow(info: A.ArrayInfo, vec: int) -> bool:
    return not any(s % vec for d, s in zip(info.shape[:-1], info.strides[:-1]) if d > 1)


def _fits(info: A.ArrayInfo, vec: int) -> bool:
    return not info.ptr % (vec * info.itemsize) and strides_allow(info, vec)


def _vector(req: MlaRequest) -> int:
    fits = widths(req)
    if not fits:
        raise NotImplementedError(f"q's parts ({req.nope} + {req.rope} channels) and kv_c's {req.lora} channels are "
                                  f"not whole vectors of {'2 elements (FP8 entries are stored in pairs)' if req.kind or req.q_kind else '1 element'}; "
                                  "use apply_rope on the rotary part and a separate cache write")
    if req.device is None:  # host arrays: the kernel reads copies of them (rope_rtc.core.backends.on_gpu)
        return fits[0]
    arrays = [x for _, x in vector_arrays(req)]
    for vec in fits:
        if all(_fits(x, vec) for x in arrays):
            return vec
    bad = next(x for x in arrays if not _fits(x, fits[-1]))
    raise ValueError(f"{bad.name}: address {bad.ptr:#x} or element strides {bad.strides} are not aligned to the "
                     f"{fits[-1] * bad.itemsize}-byte accesses the kernel needs at least; pass aligned arrays (a "
                     "fresh allocation is)")


def fill_mla_params(p: MlaParams, req: MlaRequest) -> None:
    """Everything the block holds for ``req`` (its addresses included)."""
    qo = req.q_out or req.q
    p.q, p.q_out, p.k_pe, p.kv_c, p.cache = req.q.ptr, qo.ptr, req.k_pe.ptr, req.kv_c.ptr, req.cache.ptr
    p.q_fp8 = req.q_fp8.ptr if req.q_fp8 is not None else 0
    p.slot_mapping, p.positions, p.cos, p.sin = req.slots.ptr, req.positions.ptr, req.cos.ptr, req.sin.ptr
    p.cache_scale = req.kv_scale.ptr if req.kv_scale is not None else 0
    p.q_scale = req.q_scale.ptr if req.q_scale is not None else 0
    p.q_st, p.q_sh = req.q.strides[0], req.q.strides[1]
    p.qo_st, p.qo_sh = qo.strides[0], qo.strides[1]
    p.qf_st, p.qf_sh = (req.q_fp8.strides[0], req.q_fp8.strides[1]) if req.q_fp8 is not None else (0, 0)
    p.kpe_st, p.kvc_st = req.k_pe.strides[0], req.kv_c.strides[0]
    p.cache_sb, p.cache_so = req.cache.strides[0], req.cache.strides[1]
    p.num_slots, p.block_size = req.num_slots, req.cache.shape[1]
    p.table_rows, p.table_stride = req.cos.shape[0], req.cos.strides[0]
    p.index_flags = int(req.positions.dtype == "int64")  # positions.cuh: IDX_POSITIONS_I64
    p.slot_i64 = int(req.slots.dtype == "int64")
    p.total = threads(req)
    p.q_units, p.token_units = q_units(req), token_units(req)
    p.div_block, p.div_token, p.div_q_units = (fast_divisor(req.cache.shape[1]), fast_divisor(p.token_units),
                                               fast_divisor(p.q_units))
