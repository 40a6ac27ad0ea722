"""RoPE fused with the paged KV-cache write, as inference engines run it: one launch rotates q
and k and writes the rotated k and the unrotated v into the caches at ``slot_mapping[t]``
(cuda_src/rope_cache.cu), optionally quantised to FP8.

- :func:`rope_and_cache`: the one-call function (a plan per signature and thread, as
  ``apply_rope_qk`` keeps).
- :class:`RopeCachePlan`: the prepared form, on the prepared-launch core (rope_rtc.core.prepared):
  validated once, then ``execute`` (device arrays only) allocates nothing, never synchronises
  and is capturable in a CUDA graph; new arrays of a signature seen before take only the
  address checks (alignment, overlap), as the general plan's do.

Caches: ``[num_blocks, block_size, H_kv, D]`` (``kv_layout="nhd"``) or ``[num_blocks, H_kv,
block_size, D]`` (``"hnd"``), of the input dtype, or FP8 held as ``uint8`` with
``kv_cache_dtype="fp8_e4m3"`` (e4m3fn) or ``"fp8_e5m2"`` and per-tensor float32 device scales
``k_scale`` / ``v_scale``. The FP8 entry is the value as rounded to the input dtype (what
``k_out`` holds for k), divided by the scale in FP32, saturated to the format's finite range and
rounded to nearest even: what RoPE followed by a separate quantising cache write (vLLM's
``reshape_and_cache_flash``) stores. ``rope_rtc.reference.rope_and_cache_reference`` is the
NumPy reference.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, replace
from operator import itemgetter

import numpy as np

from ..build.registry import cache_head_batch, cache_spec, cache_vector_widths
from ..core import arrays as A
from ..core.driver import current_device
from ..core.backends import (as_given, auto_without_gpu, host_array, on_gpu, refuse_device, resolve, token_positions,
                             write_results)
from ..core.codegen import (address_predicate, address_terms, aligned_term, arrays_title, generated,
                            preferred_predicate, signature_checks)
from ..core.launcher import StructArg, cupy_stream, launch_prefix, load_kernel, single_device, stream_handle
from ..core.dispatch import OneCall, split_offset
from ..core.prepared import Call, Op, Prepared, cupy_ndarray, disjoint_pairs, made_once, pointers, repeat_signature
from ..numerics.cache_options import CACHE_KINDS, FP8_DTYPES, check_cache_options, check_scale_given
from .rope_launch import fill_positions_and_tables
from .rope_params import POS_CU_SEQLENS, POS_OFFSET, CacheParams, fast_divisor
from .rope_request import Request, check_kinds, check_positions_of, validate

BLOCK_THREADS = 128  # level with 256 or faster on prefill
# Argument order of the core's calls.
ARGS = ("q", "k", "v", "cos", "sin", "positions", "slot_mapping", "k_cache", "v_cache", "k_scale", "v_scale",
        "q_out", "k_out", "cu_seqlens", "offsets")
(Q, K, V, COS, SIN, POSITIONS, SLOTS, K_CACHE, V_CACHE, K_SCALE, V_SCALE, Q_OUT, K_OUT, CU_SEQLENS,
 OFFSETS) = range(len(ARGS))


@dataclass
class CacheRequest:
    """A validated call: the RoPE part (a general-API ``Request`` on layout ``thd``) and the cache part."""

    rope: Request
    v: A.ArrayInfo
    slots: A.ArrayInfo
    k_cache: A.ArrayInfo
    v_cache: A.ArrayInfo
    k_scale: A.ArrayInfo | None
    v_scale: A.ArrayInfo | None
    kv_layout: str
    kind: int
    vec: int
    head_batch: int  # heads per thread (registry.cache_head_batch)

    @property
    def num_slots(self) -> int:
        return self.k_cache.shape[0] * self.block_size

    def without_arrays(self) -> "CacheRequest":
        """The same request holding no caller's array (what a template keeps)."""
        strip = {f: replace(getattr(self, f), array=None) for f in
                 ("v", "slots", "k_cache", "v_cache", "k_scale", "v_scale") if getattr(self, f) is not None}
        return replace(self, rope=self.rope.without_arrays(), **strip)

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1 if self.kv_layout == "nhd" else 2]


def validate_cache_call(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, *, kv_layout="nhd",
                        kv_cache_dtype="auto", k_scale=None, v_scale=None, q_out=None, k_out=None, offset=0,
                        cu_seqlens=None, interleaved=False, rotary_dim=None,
                        allow_host_slots: bool = False, host: bool = False,
                        allow_desc: bool = False) -> tuple[CacheRequest, tuple]:
    """Every check of a call, before anything is launched or written. Returns the request and the
    call's arguments in the core's order. Positions follow the general API (device arrays); a
    NumPy ``slot_mapping`` (``allow_host_slots``: the one-call function, which copies it to the
    device after these checks) is checked value by value.

    ``host``: host arrays are accepted too, all of one kind (the one-call function's host path,
    whose arrays the NumPy backend reads or the GPU path copies); their addresses and strides,
    which no kernel reads, are not checked.

    ``allow_desc``: the arrays may be :class:`~rope_rtc.TensorDesc` declarations (the JAX
    functions' abstract values, checked at trace time), whose addresses the checks skip."""
    check_cache_options(kv_layout, kv_cache_dtype)
    if k is None or v is None:
        raise TypeError("k, v: rope_and_cache writes both caches; pass k and v")
    # q and k are rotated in place unless outputs are given: checked as the outputs they are.
    q_out = q if q_out is None else q_out
    k_out = k if k_out is None else k_out
    req = validate(q, k, cos, sin, positions=positions, offset=offset, cu_seqlens=cu_seqlens, layout="thd",
                   interleaved=interleaved, rotary_dim=rotary_dim, q_out=q_out, k_out=k_out, allow_host=host,
                   allow_desc=allow_desc)
    T, Hk, D = req.num_tokens, req.ck.H, req.cq.D
    vi = A.describe(v, "v", allow_host=host)
    if vi.dtype != req.k.dtype:  # a dtype is a TypeError, as for every other argument
        raise TypeError(f"v: dtype {vi.dtype} differs from k's {req.k.dtype}")
    if vi.shape != req.k.shape:
        raise ValueError(f"v: shape {vi.shape} differs from k's {req.k.shape}")
    A.check_last_dim_contiguous(vi)
    if isinstance(slot_mapping, np.ndarray) and not (allow_host_slots or host):
        raise TypeError("slot_mapping: a plan takes device arrays; pass a CuPy/device array (the one-call "
                        "rope_and_cache also takes a NumPy one)")
    # Host slots only as a NumPy array (checked value by value below, then copied to the device):
    # another host array (a torch CPU tensor) would reach the kernel as a host address.
    si = A.describe(slot_mapping, "slot_mapping", allow_host=host or isinstance(slot_mapping, np.ndarray))
    A.check_dtype(si, A.INDEX_DTYPES)
    if si.shape != (T,):
        raise ValueError(f"slot_mapping: expected one slot per token, shape ({T},), got {si.shape}")
    A.check_contiguous(si)
    if si.device is not None:  # read as aligned int32/int64
        A.check_aligned(si, si.itemsize)
    kind = CACHE_KINDS[kv_cache_dtype]
    caches = []
    for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        ci = A.describe(cache, name, allow_host=host)
        want = "uint8" if kind else req.dtype
        if ci.dtype != want:
            hint = ("; an FP8 cache is a uint8 array with kv_cache_dtype='fp8_e4m3' or 'fp8_e5m2'" if kind == 0 else "")
            # ml_dtypes' FP8 types: their bytes are the kernels' storage
            fmt = next((kind_name for kind_name, typed in FP8_DTYPES.items() if typed == ci.dtype), None)
            if fmt is not None:
                hint = f"; its bytes are {name}.view('uint8')"
                if fmt != kv_cache_dtype:
                    hint += f", with kv_cache_dtype={fmt!r}"
            raise TypeError(f"{name}: dtype {ci.dtype}, expected {want} for kv_cache_dtype={kv_cache_dtype!r}{hint}")
        if len(ci.shape) != 4:
            raise ValueError(f"{name}: expected a 4-d cache ({'[blocks, block_size, H_kv, D]' if kv_layout == 'nhd' else '[blocks, H_kv, block_size, D]'}), got shape {ci.shape}")
        heads, dim = (ci.shape[2], ci.shape[3]) if kv_layout == "nhd" else (ci.shape[1], ci.shape[3])
        if (heads, dim) != (Hk, D):
            raise ValueError(f"{name}: holds {heads} heads of dim {dim} ({kv_layout}); k has {Hk} heads of dim {D}")
        A.check_last_dim_contiguous(ci)
        A.check_writable(ci)
        if ci.size > 1 and A.overlaps_itself(ci):
            raise ValueError(f"{name}: its entries overlap each other (strides {ci.strides} elements); pass a cache "
                             "whose slots have their own memory")
        caches.append(ci)
    kc, vc = caches
    if kc.shape != vc.shape or kc.strides != vc.strides:
        raise ValueError(f"v_cache: expected k_cache's shape and strides {kc.shape} {kc.strides}, got {vc.shape} "
                         f"{vc.strides}")
    scales = []
    for scale, name in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        check_scale_given(kv_cache_dtype, scale, name, " (an array of one element, where the caches are)")
        if kind == 0:
            scales.append(None)
            continue
        sc = A.describe(scale, name, allow_host=host)
        A.check_dtype(sc, ("float32",))
        if sc.size != 1:
            raise ValueError(f"{name}: expected one element (a per-tensor scale), got shape {sc.shape}")
        if sc.device is not None:
            A.check_aligned(sc, 4)
        scales.append(sc)
    num_slots = kc.shape[0] * kc.shape[1 if kv_layout == "nhd" else 2]
    if num_slots >= 2**31:
        raise ValueError(f"k_cache: {num_slots} slots; the kernel indexes slots with 32 bits (at most 2^31 - 1)")
    if cache_threads_of(req) >= 2**31:
        raise ValueError(f"q: {req.num_tokens} tokens need more than 2^31 threads; split the call")
    if num_slots == 0:
        raise ValueError("k_cache: holds no slot (a dimension is 0)")
    if si.device is None:  # slots from the host: every value checked
        s = np.asarray(si.array).astype(np.int64)
        bad = s >= num_slots
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"slot_mapping: entry {i} is {int(s[i])}, past the cache's {num_slots} slots "
                             f"(a negative slot skips its token)")
        # Two tokens writing one slot would race in the kernel: each slot is one token's.
        used = np.flatnonzero(s >= 0)
        order = used[np.argsort(s[used], kind="stable")]
        same = np.flatnonzero(s[order[1:]] == s[order[:-1]])
        if same.size:
            pairs = sorted((int(order[j]), int(order[j + 1])) for j in same)
            i, j = pairs[0]
            raise ValueError(f"slot_mapping: entries {i} and {j} both name slot {int(s[i])}; each slot takes one "
                             "token's k and v (a negative slot skips its token)")
    everything = [i for i in (*req.infos(), vi, si, *scales) if i is not None]
    for info in (vi, si, *caches, *scales):  # the RoPE part's arguments were checked by validate
        if info is not None and not allow_desc:
            A.check_holds_memory(info)
    if host:  # everything of one kind (the general checks have seen to q, k, the tables and positions)
        check_kinds(everything + caches)
    else:
        A.check_same_device(everything + caches)
    for ci in caches:
        for other in everything + [c for c in caches if c is not ci]:
            if A.overlaps(ci, other):
                raise ValueError(f"{ci.name}: overlaps {other.name}; the caches must not share memory with any "
                                 "other argument")
    # What the launch writes besides the caches (q_out, k_out; q and k themselves in place) must
    # not meet what it reads besides q and k (the general API's checks cover those).
    written = [req.q_out or req.q, req.k_out or req.k]
    for out in written:
        for other in [vi, si, *(x for x in scales if x is not None), *(w for w in written if w is not out)]:
            if A.overlaps(out, other):
                raise ValueError(f"{out.name}: overlaps {other.name}, which the same launch reads or writes; pass "
                                 "separate arrays")
    vec = _vector(req, vi, kc, vc, kind)
    creq = CacheRequest(req, vi, si, kc, vc, scales[0], scales[1], kv_layout, kind, vec,
                        cache_head_batch(req.cq.H, req.ck.H, req.dtype, req.interleaved, vec))
    args = (q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, k_scale, v_scale, q_out, k_out, cu_seqlens,
            split_offset(offset)[1])
    return creq, args


def _widths(req: Request, kind: int) -> list[int]:
    """The vectors of :func:`cache_vector_widths` (in its order of preference) that the channel
    split allows (FP8 entries: >= 2 bytes)."""
    D, R = req.cq.D, req.rotary_dim
    return [vec for vec in cache_vector_widths(req.dtype, req.interleaved, kind)
            if not (kind and vec < 2) and not ((R if req.interleaved else R // 2) % vec or (D - R) % vec)]


def _vector_arrays(req: Request, vi: A.ArrayInfo, kc: A.ArrayInfo, vc: A.ArrayInfo) -> tuple:
    """``(argument index, info)`` of every array the kernel reads or writes in vectors: q, k, v,
    the outputs (q and k themselves in place) and the caches."""
    return ((Q, req.q), (K, req.k), (V, vi), (Q_OUT, req.q_out or req.q), (K_OUT, req.k_out or req.k),
            (K_CACHE, kc), (V_CACHE, vc))


def _strides_allow(info: A.ArrayInfo, vec: int) -> bool:
    return not any(s % vec for d, s in zip(info.shape[:-1], info.strides[:-1]) if d > 1)


def _fits(info: A.ArrayInfo, vec: int) -> bool:
    """Whether ``info``'s address and strides allow accesses of ``vec`` elements."""
    return not info.ptr % (vec * info.itemsize) and _strides_allow(info, vec)


def _vector(req: Request, vi: A.ArrayInfo, kc: A.ArrayInfo, vc: A.ArrayInfo, kind: int) -> int:
    """The first vector of :func:`_widths` that every address and stride allows."""
    D, R = req.cq.D, req.rotary_dim
    fits = _widths(req, kind)
    if not fits:
        raise NotImplementedError(f"rotary_dim {R} / head dim {D}: the fused kernel needs the window and the rest of "
                                  f"the head to be whole vectors of at least {2 if kind else 1} elements"
                                  f"{' for FP8 entries' if kind else ''}; use apply_rope_qk and a separate cache write")
    if req.device is None:  # host arrays: the kernel reads copies of them (rope_rtc.core.backends.on_gpu)
        return fits[0]
    arrays = [info for _, info in _vector_arrays(req, vi, kc, vc)]
    for vec in fits:
        if all(_fits(info, vec) for info in arrays):
            return vec
    least = fits[-1]
    bad = next(info for info in arrays if not _fits(info, least))
    raise ValueError(f"{bad.name}: address {bad.ptr:#x} or element strides {bad.strides} are not aligned to the "
                     f"{least * bad.itemsize}-byte accesses the kernel needs at least for {req.dtype}"
                     f"{' with an FP8 cache' if kind else ''}; pass aligned arrays (a fresh allocation is)")


def preferred_masks(creq: CacheRequest) -> tuple:
    """``(argument index, mask)`` of the least demanding vector that :func:`_widths` prefers to the
    request's and its signature (strides) allows, for ``codegen.preferred_predicate``; empty when
    none is preferred."""
    arrays = _vector_arrays(creq.rope, creq.v, creq.k_cache, creq.v_cache)
    widths = _widths(creq.rope, creq.kind)
    better = [vec for vec in widths[:widths.index(creq.vec)] if all(_strides_allow(info, vec) for _, info in arrays)]
    if not better:
        return ()
    vec = min(better)
    return tuple((i, vec * info.itemsize - 1) for i, info in arrays)


def fill_cache_params(p: CacheParams, creq: CacheRequest) -> None:
    req = creq.rope
    q_out, k_out = req.q_out or req.q, req.k_out or req.k
    for w, info in enumerate((req.q, req.k, creq.v)):
        p.in_[w], p.in_st[w], p.in_sh[w] = info.ptr, info.strides[0], info.strides[1]
    for w, info in enumerate((q_out, k_out)):
        p.out[w], p.out_st[w], p.out_sh[w] = info.ptr, info.strides[0], info.strides[1]
    kc = creq.k_cache
    p.k_cache, p.v_cache = kc.ptr, creq.v_cache.ptr
    st = kc.strides
    p.cache_sb, p.cache_so, p.cache_sh = (st[0], st[1], st[2]) if creq.kv_layout == "nhd" else (st[0], st[2], st[1])
    p.num_slots, p.block_size = creq.num_slots, creq.block_size
    p.slot_mapping = creq.slots.ptr
    p.k_scale = creq.k_scale.ptr if creq.k_scale is not None else 0
    p.v_scale = creq.v_scale.ptr if creq.v_scale is not None else 0
    fill_positions_and_tables(p, req)  # thd: one sequence unless cu_seqlens says otherwise
    p.slot_i64 = int(creq.slots.dtype == "int64")
    p.total = cache_threads(creq)
    p.div_block = fast_divisor(creq.block_size)


def cache_threads(creq: CacheRequest) -> int:
    return cache_threads_of(creq.rope, creq.vec, creq.head_batch)


def cache_threads_of(req: Request, vec: int = 1, head_batch: int = 1) -> int:
    """Threads of the fused kernel at vector width ``vec`` and ``head_batch`` heads per thread
    (1, 1: the most any build gives)."""
    D, R = req.cq.D, req.rotary_dim
    units = (R if req.interleaved else R // 2) // vec + (D - R) // vec
    return req.num_tokens * ((req.cq.H + 2 * req.ck.H) // head_batch) * units


def load_cache_function(creq: CacheRequest, device: int):
    req = creq.rope
    spec = cache_spec(req.dtype, req.interleaved, creq.vec, creq.kind, req.cq.H, req.ck.H, req.cq.D, req.rotary_dim,
                      creq.head_batch)
    return load_kernel(spec, device).functions[spec.entries[0]]


# The core's argument indices (ARGS order).
_VECTOR_ARGS = (Q, K, V, Q_OUT, K_OUT)  # read or written as vectors of the input dtype
_NATURAL_ARGS = (COS, SIN, POSITIONS, SLOTS, K_SCALE, V_SCALE, CU_SEQLENS, OFFSETS)  # aligned 4/8-byte scalars


class _CacheTemplate:
    """What full validation established for one signature, minus the addresses (it holds no
    caller's array): new arrays of the signature bind after the address checks alone, as the
    general plan's template does (rope_plan.RopeTemplate); anything those checks cannot settle
    goes back to full validation."""

    def __init__(self, plan: "RopeCachePlan", creq: CacheRequest) -> None:
        self.plan = plan
        r = creq.rope
        infos = (r.q, r.k, creq.v, r.cos, r.sin, r.positions, creq.slots, creq.k_cache, creq.v_cache, creq.k_scale,
                 creq.v_scale, r.q_out or r.q, r.k_out or r.k, r.cu_seqlens, r.offsets)
        self.validated_pointers = tuple(0 if i is None else i.ptr for i in infos)
        # Extents relative to each array's pointer.
        extents = tuple(None if i is None or i.size == 0 else tuple(e - i.ptr for e in i.byte_extent())
                        for i in infos)
        vp = self.validated_pointers
        in_place = tuple(A.same_view(infos[o], infos[i]) for o, i in ((Q_OUT, Q), (K_OUT, K)))
        self.same_view = tuple(pair for pair, same in zip(((Q_OUT, Q), (K_OUT, K)), in_place) if same)
        # Every array the launch writes must not meet any other argument (its own input aside, in
        # place): prepared.disjoint_pairs (k and v caches may be interleaved in one allocation).
        self.disjoint = disjoint_pairs(extents, (Q_OUT, K_OUT, K_CACHE, V_CACHE),
                                       {Q_OUT: Q if in_place[0] else None, K_OUT: K if in_place[1] else None}, vp)
        vec_bytes = creq.vec * r.q.itemsize
        self.align = vec_bytes  # the build's access width (prepared.narrower)
        cache_bytes = creq.vec * creq.k_cache.itemsize
        self.masks = tuple((i, vec_bytes - 1) for i in _VECTOR_ARGS) + tuple(
            (i, cache_bytes - 1) for i in (K_CACHE, V_CACHE)) + tuple(
            (i, infos[i].itemsize - 1) for i in _NATURAL_ARGS if infos[i] is not None)
        self._addresses = address_predicate(self.same_view, self.disjoint, self.masks, owner="RopeCachePlan")
        # Built for a call off a preferred build's alignment: aligned calls go back to validation.
        self.preferred_masks = preferred_masks(creq)
        self._preferred = preferred_predicate(self.preferred_masks, owner="RopeCachePlan")
        self._one_calls: dict = {}  # signature -> its generated repeat path (one_call)
        self.has_positions = r.positions is not None
        # Tokens read from the offset on: all of them (offset scheme); with cu_seqlens each sequence
        # starts there, so a call with tokens reads that row at least.
        self.offset_tokens = (r.num_tokens if r.pos_mode == POS_OFFSET else
                              1 if r.pos_mode == POS_CU_SEQLENS and r.num_tokens else None)
        self.table_rows = r.cos.shape[0]
        total = cache_threads(creq)
        self.prefix = None
        if total:
            fn = plan.function(creq)
            self.prefix = launch_prefix(fn, (-(-total // BLOCK_THREADS), 1, 1), (BLOCK_THREADS, 1, 1))
        self.creq = creq.without_arrays()  # after the infos above: the template holds no caller's array

    pointers = staticmethod(pointers)

    def one_call(self, sig: tuple):
        """The repeat path of calls of signature ``sig`` (:func:`cache_signature`): ``fn(q, k, v, cos,
        sin, positions, slot_mapping, k_cache, v_cache, k_scale, v_scale, q_out, k_out, cu_seqlens,
        offsets, offset)`` checks each argument against the signature, runs this template's address
        and offset checks, writes the block and returns the launch prefix, or returns None (the
        caller then goes the full way). Generated once per signature, as the general template's
        (rope_plan.RopeTemplate.one_call); None when there is nothing to launch."""
        return made_once(self._one_calls, sig, self._one_call_function)

    def _one_call_function(self, sig: tuple):
        if self.prefix is None:
            return None
        namespace: dict = {"nd": cupy_ndarray()}
        conds, reads = signature_checks(ARGS, sig, _OWN_INPUT, not single_device(), namespace)
        same_view = tuple(pair for pair in self.same_view if sig[pair[0]] is not True)
        terms = address_terms(same_view, self.disjoint, self.masks, ref=lambda i: f"p{i}")
        if self.has_positions:
            terms.append("offset == 0")
        else:
            terms.append(f"0 <= offset <= {int(self.table_rows - (self.offset_tokens or 0))}")
        if self.preferred_masks:  # a call the preferred vector can take goes back to validation
            terms.append(f"not ({aligned_term(self.preferred_masks, lambda i: f'p{i}')})")
        body = (f"    if not ({conds}):\n"
                "        return None\n"
                + reads +
                f"    if not ({' and '.join(terms)}):\n"
                "        return None\n"
                "    if core.filled is not tmpl:\n"
                "        fill(block, creq)\n"
                "        core.filled = tmpl\n"
                f"    arrays(raw, 0, p{Q}, p{K}, p{V}, p{Q_OUT}, p{K_OUT})\n"
                f"    caches(raw, {CacheParams.k_cache.offset}, p{K_CACHE}, p{V_CACHE})\n"
                f"    rest(raw, {CacheParams.slot_mapping.offset}, p{SLOTS}, p{K_SCALE}, p{V_SCALE}, p{COS}, p{SIN}, "
                f"p{POSITIONS}, p{OFFSETS}, p{CU_SEQLENS}, offset)\n"
                "    return prefix\n")
        core = self.plan._core
        namespace.update(core=core, tmpl=self, fill=fill_cache_params, block=core.block, creq=self.creq,
                         raw=(ctypes.c_char * ctypes.sizeof(CacheParams)).from_address(ctypes.addressof(core.block)),
                         arrays=_ARRAYS.pack_into, caches=_CACHES.pack_into, rest=_REST.pack_into, prefix=self.prefix)
        return generated("repeat_path", ", ".join(ARGS) + ", offset", body, namespace,
                         title=f"RopeCachePlan repeat path ({arrays_title(ARGS, sig)})",
                         qualname="RopeCachePlan.repeat_path")

    def _offset_ok(self, offset: int) -> bool:
        if self.has_positions and offset:
            return False
        return 0 <= offset <= self.table_rows and (self.offset_tokens is None
                                                    or offset + self.offset_tokens <= self.table_rows)

    def check_scalar(self, offset: int) -> None:
        """A new int offset for arguments already validated (ValueError when it cannot be used)."""
        if self.has_positions and offset:
            raise ValueError("positions and offset: pass one of them (positions are absolute)")
        if not self._offset_ok(offset):
            n = self.offset_tokens or 1
            raise ValueError(f"offset: positions {offset}..{offset + n - 1} fall outside the table's "
                             f"{self.table_rows} rows")

    @staticmethod
    def write_scalar(block, offset: int, call=None) -> None:
        block.offset = offset

    def bind(self, core: Prepared, arrays: tuple, scalar: int, ptrs: tuple) -> Call | None:
        """Address checks, then the block's addresses; None sends the call through full validation."""
        # An output validated in place that is now separate, extents that meet at an offset not
        # validated, an address off its alignment (narrower vectors: a new template; or a real
        # misalignment), an offset off the table: full validation decides.
        if not self._addresses(ptrs) or not self._offset_ok(scalar):
            return None
        if self._preferred is not None and self._preferred(ptrs):
            return None
        p = core.block
        if core.filled is not self:
            fill_cache_params(p, self.creq)
            core.filled = self
        q, k, v, c, s, pos, slots, kc, vc, ks, vs, qo, ko, cu, offs = ptrs
        p.in_[0], p.in_[1], p.in_[2] = q, k, v
        p.out[0], p.out[1] = qo, ko
        p.k_cache, p.v_cache, p.slot_mapping, p.k_scale, p.v_scale = kc, vc, slots, ks, vs
        p.cos, p.sin, p.positions, p.offsets, p.cu_seqlens, p.offset = c, s, pos, offs, cu, scalar
        return Call(arrays, scalar, self, self.prefix, (arrays[Q_OUT], arrays[K_OUT]))


# The block's fields a call writes, in three runs (fill_cache_params writes the rest): q, k, v and
# the two outputs; the caches; the slots, scales, tables, index arrays and the int offset.
_ARRAYS, _CACHES, _REST = struct.Struct("<5Q"), struct.Struct("<2Q"), struct.Struct("<8Qq")
assert (CacheParams.out.offset, CacheParams.v_cache.offset - CacheParams.k_cache.offset,
        CacheParams.offset.offset - CacheParams.slot_mapping.offset) == (24, 8, 64)
_OWN_INPUT = {Q_OUT: Q, K_OUT: K}
_RESULT = itemgetter(Q_OUT, K_OUT)  # what a call returns: (q_out, k_out)


def cache_signature(arrays: tuple) -> tuple:
    """The repeat path's signature of a call's CuPy arrays (None where the caller passed none): each
    argument's (shape, dtype, device), with its strides before the dtype when it is not
    C-contiguous; None when absent; True for an output that is its own input (q and k in place)."""
    return repeat_signature(arrays, _OWN_INPUT)


class _CacheOp(Op):
    # q and k, and the caches: their shapes (block size, layout) fix where each entry goes.
    watched = (0, 1, ARGS.index("k_cache"), ARGS.index("v_cache"))

    def __init__(self, plan: "RopeCachePlan") -> None:
        self.plan = plan

    def quick_path(self, template, arrays: tuple):
        """The template's generated repeat path for new arrays of a bound signature (as the general
        plan's), or None where CuPy does not expose its contiguity flag."""
        if not hasattr(cupy_ndarray(), "_c_contiguous"):
            return None
        fn = template.one_call(cache_signature(arrays))
        return None if fn is None else (fn, _RESULT)

    takes_request = True  # rope_and_cache's first call hands over its CacheRequest

    def validate(self, arrays: tuple, scalar: int, request: "CacheRequest | None" = None):
        creq = request if request is not None else validate_arrays(arrays, scalar, self.plan._opts)
        plan = self.plan
        if creq.rope.device is not None and creq.rope.device != plan.device:
            raise ValueError(f"q: on device {creq.rope.device}; this plan was built for device {plan.device}")
        fixed = (creq.rope.dtype, creq.rope.cq.H, creq.rope.ck.H, creq.rope.cq.D, creq.kind, creq.rope.pos_mode)
        if fixed != plan._fixed:
            raise ValueError(f"execute: this plan was built for (dtype, q heads, k heads, head dim, cache kind, position "
                             f"scheme) {plan._fixed}, got {fixed}")
        return _CacheTemplate(plan, creq)


def validate_arrays(arrays: tuple, scalar: int, opts: dict) -> "CacheRequest":
    """``validate_cache_call`` of a call's arguments in the core's order (``ARGS``)."""
    kw = dict(zip(ARGS, arrays))
    offsets = kw.pop("offsets")
    creq, _ = validate_cache_call(**{n: kw[n] for n in ARGS[:9]}, **opts, k_scale=kw["k_scale"],
                                  v_scale=kw["v_scale"], q_out=kw["q_out"], k_out=kw["k_out"],
                                  cu_seqlens=kw["cu_seqlens"], offset=scalar if offsets is None else offsets)
    return creq


class RopeCachePlan:
    """A prepared :func:`rope_and_cache`: built from one call's arguments (the same keywords),
    ``execute`` takes the same arguments again. Fixed: dtype, head counts, head dim, pair style,
    rotary dim, cache layout and kind, the position scheme and the device. The last 16 argument
    sets of CuPy arrays are remembered (held) and relaunched without validation (other libraries'
    arrays are validated on every call), from the second time as a one-node CUDA graph; new
    arrays of a seen signature (shapes, strides, dtypes) take only the address checks."""

    def __init__(self, q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, *, kv_layout: str = "nhd",
                 kv_cache_dtype: str = "auto", k_scale=None, v_scale=None, q_out=None, k_out=None, offset=0,
                 cu_seqlens=None, interleaved: bool = False, rotary_dim: int | None = None) -> None:
        self._opts = dict(kv_layout=kv_layout, kv_cache_dtype=kv_cache_dtype, interleaved=interleaved,
                          rotary_dim=rotary_dim)
        creq, _ = validate_cache_call(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, k_scale=k_scale,
                                      v_scale=v_scale, q_out=q_out, k_out=k_out, offset=offset, cu_seqlens=cu_seqlens,
                                      **self._opts)
        self._configure(creq)

    @classmethod
    def _from_request(cls, creq: "CacheRequest", opts: dict) -> "RopeCachePlan":
        """The plan of a call already validated into ``creq`` with the keywords ``opts``: what
        ``rope_and_cache`` builds, so that its first call is validated once."""
        plan = cls.__new__(cls)
        plan._opts = dict(opts)
        plan._configure(creq)
        return plan

    def _configure(self, creq: "CacheRequest") -> None:
        """What the plan fixes, from its validated request."""
        r = creq.rope
        self._fixed = (r.dtype, r.cq.H, r.ck.H, r.cq.D, creq.kind, r.pos_mode)
        self.device = int(r.device if r.device is not None else current_device())
        self._functions: dict = {}
        self._core = Prepared(_CacheOp(self), StructArg(CacheParams), self.device)
        from ..env import settings

        self._check_positions = settings().check_positions  # read once per plan, as every plan does

    def function(self, creq: CacheRequest):
        key = (creq.vec, creq.head_batch, creq.rope.interleaved, creq.rope.rotary_dim)
        fn = self._functions.get(key)
        if fn is None:
            fn = self._functions[key] = load_cache_function(creq, self.device)
        return fn

    def execute(self, q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, *, k_scale=None, v_scale=None,
                q_out=None, k_out=None, offset=0, cu_seqlens=None, stream=None):
        """Validate (nothing when the arguments repeat) and launch on ``stream``. Returns
        ``(q_out, k_out)`` (q and k when rotated in place)."""
        scalar, offsets = split_offset(offset)
        arrays = (q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, k_scale, v_scale,
                  q if q_out is None else q_out, k if k_out is None else k_out, cu_seqlens, offsets)
        if self._check_positions:
            self.check_positions(arrays, scalar)
        return self._core.execute(arrays, scalar, stream)

    def check_positions(self, arrays: tuple, scalar: int) -> None:
        """``ROPE_RTC_CHECK_POSITIONS=1``: read the call's device positions, offsets and
        ``cu_seqlens`` back (synchronising) and raise before the launch on one outside the table
        (otherwise its token's rotation and cache entries are NaN)."""
        q, k, v, cos, sin, positions, _, _, _, _, _, q_out, k_out, cu_seqlens, offsets = arrays
        check_positions_of((q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offsets), scalar,
                           dict(layout="thd", interleaved=self._opts["interleaved"],
                                rotary_dim=self._opts["rotary_dim"]))


def rope_and_cache(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, *, kv_layout: str = "nhd",
                   kv_cache_dtype: str = "auto", k_scale=None, v_scale=None, q_out=None, k_out=None, offset=0,
                   cu_seqlens=None, interleaved: bool = False, rotary_dim: int | None = None, stream=None,
                   backend: str = "auto"):
    """Rotate q and k and write the rotated k and the unrotated v into a paged KV cache, in one launch.

    Parameters
    ----------
    q, k, v : arrays ``[T, Hq, D]``, ``[T, Hkv, D]``, ``[T, Hkv, D]``
        float32, float16 or bfloat16 (any token and head strides; the channel axis contiguous).
        Device arrays, or NumPy arrays with every other array on the host too (caches, scales and
        outputs written in place as on the GPU; computed on the GPU when there is one).
    cos, sin : float32 tables ``[max_positions, rotary_dim // 2]``
    positions : int array ``[T]``, or None with ``offset`` / ``cu_seqlens`` (as :func:`apply_rope_qk`).
    slot_mapping : int32/int64 ``[T]``
        Cache slot of each token, ``block * block_size + offset``; a negative slot writes no cache
        entry for its token (q and k are still rotated). Each slot takes one token: two tokens
        naming one slot would race. NumPy slots are checked on the host (range, and no slot twice)
        and copied to the device (on ``stream``); device slots are not read back: one past the
        cache is skipped by the kernel, which never writes outside it, and a slot named twice
        holds one of its tokens' entries, which one undefined.
    k_cache, v_cache : device arrays ``[num_blocks, block_size, Hkv, D]`` (``kv_layout="nhd"``) or
        ``[num_blocks, Hkv, block_size, D]`` (``"hnd"``): q's dtype, or uint8 holding FP8 with
        ``kv_cache_dtype="fp8_e4m3"`` / ``"fp8_e5m2"``.
    k_scale, v_scale : float32 device arrays of one element, FP8 caches only
        Per-tensor scales: the cache holds ``value / scale`` (an FP32 division) saturated to the
        format's largest finite value and rounded to nearest even; they may change between calls.
        Their values are not checked (reading them back would synchronise): a zero, infinite or
        NaN scale gives what that arithmetic gives (:func:`rope_rtc.reference.fp8_quantize`).
    q_out, k_out : optional
        Where the rotated q and k go (default: in place).
    interleaved, rotary_dim : as :func:`apply_rope_qk` (the window starts at channel 0).
    backend : {"auto", "nvrtc", "numpy"}
        As :func:`rope_rtc.apply_rope_qk`: ``"numpy"`` runs
        :func:`rope_rtc.reference.rope_and_cache_reference` (the kernel's arithmetic and FP8
        encoding, bit for bit) on host arrays, with the checks of the GPU path; ``"auto"`` uses
        the GPU when one is present, else NumPy (with a one-time warning).

    Positions outside the table give NaN (and NaN cache entries) for their token unless
    ``ROPE_RTC_CHECK_POSITIONS=1``, which reads device positions back and raises first. A
    :class:`RopeCachePlan` is for one thread at a time (its argument block is the plan's).

    Returns
    -------
    (q_out, k_out)

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        Before anything is launched or written, naming the argument.
    rope_rtc.errors.NoDeviceError
        ``backend="nvrtc"`` on a machine with no usable CUDA driver or GPU.
    """
    check_cache_options(kv_layout, kv_cache_dtype)  # before they are hashed into a key
    plain = type(interleaved) is bool and (rotary_dim is None or type(rotary_dim) is int)
    options = (kv_layout, kv_cache_dtype, interleaved, rotary_dim)
    if plain and not isinstance(slot_mapping, np.ndarray) and (backend == "auto" or backend == "nvrtc"):
        scalar, offsets = split_offset(offset)
        if ONE_CALL.launched(options, stream, q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, k_scale,
                             v_scale, q if q_out is None else q_out, k if k_out is None else k_out, cu_seqlens,
                             offsets, scalar):
            return (q if q_out is None else q_out), (k if k_out is None else k_out)
    requested, backend = backend, resolve(backend)
    device = A.describe(q, "q").device
    if backend == "numpy" or device is None:
        return _apply_host(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, options, k_scale, v_scale,
                           q_out, k_out, offset, cu_seqlens, stream, backend, requested)
    handle = stream_handle(stream, device)
    host_slots = isinstance(slot_mapping, np.ndarray)
    if host_slots:
        # Every check, the host slots value by value; then their device copy, made in the order
        # of the launch's stream (CuPy's pool reuses it only after the launch has read it).
        validate_cache_call(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, kv_layout=kv_layout,
                            kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, q_out=q_out,
                            k_out=k_out, offset=offset, cu_seqlens=cu_seqlens, interleaved=interleaved,
                            rotary_dim=rotary_dim, allow_host_slots=True)
        from ..core.driver import device_cupy

        cupy = device_cupy()
        with cupy.cuda.Device(device), cupy_stream(handle):
            slot_mapping = cupy.asarray(slot_mapping)
    scalar, offsets = split_offset(offset)
    arrays = (q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, k_scale, v_scale,
              q if q_out is None else q_out, k if k_out is None else k_out, cu_seqlens, offsets)
    # The last path is not for host slots (a new device copy every call, and their host checks).
    _, call = ONE_CALL.run(options, plain, arrays, scalar, handle, device, remember_last=not host_slots)
    return call.result


def _options(options: tuple) -> dict:
    return dict(zip(("kv_layout", "kv_cache_dtype", "interleaved", "rotary_dim"), options))


def _validate(arrays: tuple, scalar: int, options: tuple) -> tuple:
    """The call validated (its CacheRequest, which the plan binds from) and its plan's key: what a
    RopeCachePlan fixes (``OneCall``'s ``validate``)."""
    creq = validate_arrays(arrays, scalar, _options(options))
    r = creq.rope
    return creq, (options, r.dtype, r.cq.H, r.ck.H, r.cq.D, creq.kind, r.pos_mode, r.device)


def _new_plan(creq: "CacheRequest", arrays: tuple, scalar: int, options: tuple, device: int) -> RopeCachePlan:
    return RopeCachePlan._from_request(creq, _options(options))


# The one-call function's dispatch; options: (kv_layout, kv_cache_dtype, interleaved, rotary_dim).
ONE_CALL = OneCall(_validate, _new_plan, takes_request=True, own_input=((11, 0), (12, 1)),
                   check_positions=lambda plan, arrays, scalar, options: plan.check_positions(arrays, scalar))


def _apply_host(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, options: tuple, k_scale, v_scale, q_out,
                k_out, offset, cu_seqlens, stream, backend: str, requested: str = "numpy"):
    """A call with host arrays (or with ``backend="numpy"``): the GPU path's checks, then
    :func:`rope_rtc.reference.rope_and_cache_reference`, or the GPU through copies of the arrays
    (:func:`rope_rtc.core.backends.on_gpu`)."""
    auto_without_gpu(requested, q)
    kv_layout, kv_cache_dtype, interleaved, rotary_dim = options
    creq, _ = validate_cache_call(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, kv_layout=kv_layout,
                                  kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, q_out=q_out,
                                  k_out=k_out, offset=offset, cu_seqlens=cu_seqlens, interleaved=interleaved,
                                  rotary_dim=rotary_dim, host=True)
    req = creq.rope
    given = (q if q_out is None else q_out, k if k_out is None else k_out)  # what the call returns
    q_out, k_out = req.q_out or req.q, req.k_out or req.k  # in place unless given
    if backend == "numpy":
        refuse_device(req.q)
        from ..numerics.reference import rope_and_cache_reference

        scales = [None if i is None else host_array(i).reshape(-1)[0] for i in (creq.k_scale, creq.v_scale)]
        arrays = [host_array(i) for i in (req.q, req.k, creq.v, req.cos, req.sin)]
        qo, ko, kc, vc = rope_and_cache_reference(
            *arrays, token_positions(req), host_array(creq.slots), host_array(creq.k_cache),
            host_array(creq.v_cache), kv_layout=kv_layout, kv_cache_dtype=kv_cache_dtype, k_scale=scales[0],
            v_scale=scales[1], interleaved=req.interleaved, rotary_dim=req.rotary_dim)
        returned = write_results([(qo, q_out), (ko, k_out), (kc, creq.k_cache), (vc, creq.v_cache)])
        return as_given(returned[:2], given)
    arrays = tuple(host_array(i) for i in (req.q, req.k, creq.v, req.cos, req.sin, req.positions, creq.slots,
                                           creq.k_cache, creq.v_cache, creq.k_scale, creq.v_scale, q_out, k_out,
                                           req.cu_seqlens, req.offsets))

    def call(a, handle):
        return rope_and_cache(*a[:9], kv_layout=kv_layout, kv_cache_dtype=kv_cache_dtype, k_scale=a[9], v_scale=a[10],
                              q_out=a[11], k_out=a[12], offset=req.offset if a[14] is None else a[14],
                              cu_seqlens=a[13], interleaved=interleaved, rotary_dim=rotary_dim, stream=handle,
                              backend="nvrtc")

    return as_given(on_gpu(arrays, (7, 8, 11, 12), stream, call), given)


