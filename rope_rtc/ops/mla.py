"""DeepSeek-style multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2): RoPE on q's rotary part
and on k_pe, and the latent KV-cache write, in one launch (cuda_src/mla_rope_cache.cu).

- :func:`mla_rope_and_cache`: the one-call function (a plan per signature and thread, as
  ``rope_and_cache`` keeps).
- :class:`MlaRopeCachePlan`: the prepared form, on the prepared-launch core
  (rope_rtc.core.prepared): validated once, then ``execute`` allocates nothing, never synchronises
  and is capturable in a CUDA graph; new arrays of a signature seen before take only the address
  checks (alignment, overlap).

The arguments and their checks are rope_rtc.ops.mla_request's; the NumPy reference is
``rope_rtc.reference.mla_rope_and_cache_reference``.
"""

from __future__ import annotations

import numpy as np

from ..build.registry_mla import mla_spec
from ..core import arrays as A
from ..core.backends import as_given, auto_without_gpu, host_array, on_gpu, refuse_device, resolve, write_results
from ..core.codegen import address_predicate, preferred_predicate
from ..core.dispatch import OneCall, signature_with_own
from ..core.driver import current_device
from ..core.launcher import StructArg, cupy_stream, launch_prefix, load_kernel, stream_handle
from ..core.prepared import Call, Op, Prepared, cupy_ndarray, disjoint_pairs, made_once, pointers, repeat_signature
from .mla_request import (ARGS, KV_CACHE, Q, Q_FP8_OUT, Q_OUT, MlaParams, MlaRequest, check_options, fill_mla_params,
                          strides_allow, threads, validate_mla_call, vector_arrays, widths)
from .rope_request import check_position_rows

BLOCK_THREADS = 128
_OWN_INPUT = {Q_OUT: Q}  # q_out is q: in place
_NATURAL = (3, 4, 5, 6, 8, 11)  # cos, sin, positions, slot_mapping, the scales: read as 4/8-byte scalars


def load_mla_function(req: MlaRequest, device: int):
    """The kernel's function for ``req``'s build on ``device`` (compiled on a cache miss)."""
    spec = mla_spec(req.dtype, req.interleaved, req.vec, req.kind, req.q_kind, req.heads, req.nope, req.rope, req.lora)
    return load_kernel(spec, device).functions[spec.entries[0]]


def _result(arrays: tuple) -> tuple:
    """What a call returns: (q_out, k_pe, q_fp8_out), q_out being q in place."""
    return arrays[Q_OUT], arrays[1], arrays[Q_FP8_OUT]


class _MlaTemplate:
    """What full validation established for one signature, minus the addresses (it holds no caller's
    array): new arrays of the signature bind after the address checks alone (alignment of every
    vector access, and no overlap of a written array with another argument, at offsets validation
    did not see); anything else goes back to full validation."""

    def __init__(self, plan: "MlaRopeCachePlan", req: MlaRequest) -> None:
        self.plan = plan
        infos = req.infos()
        self.validated_pointers = tuple(0 if i is None else i.ptr for i in infos)
        extents = tuple(None if i is None or i.size == 0 else tuple(e - i.ptr for e in i.byte_extent()) for i in infos)
        in_place = req.q_out is None
        self.same_view = ((Q_OUT, Q),) if in_place else ()
        self.disjoint = disjoint_pairs(extents, (Q_OUT, 1, KV_CACHE, Q_FP8_OUT), {Q_OUT: Q if in_place else None},
                                       self.validated_pointers)
        self.align = req.vec * req.q.itemsize  # the build's access width (prepared.narrower)
        self.masks = tuple((i, req.vec * x.itemsize - 1) for i, x in vector_arrays(req)) + tuple(
            (i, infos[i].itemsize - 1) for i in _NATURAL if infos[i] is not None)
        self._addresses = address_predicate(self.same_view, self.disjoint, self.masks, owner="MlaRopeCachePlan")
        # Built for a call off a wider build's alignment: aligned calls go back to validation.
        ws = widths(req)
        better = [v for v in ws[:ws.index(req.vec)] if all(strides_allow(x, v) for _, x in vector_arrays(req))]
        self.preferred_masks = tuple((i, min(better) * x.itemsize - 1) for i, x in vector_arrays(req)) if better else ()
        self._preferred = preferred_predicate(self.preferred_masks, owner="MlaRopeCachePlan")
        self.prefix = None
        total = threads(req)
        if total:
            self.prefix = launch_prefix(plan.function(req), (-(-total // BLOCK_THREADS), 1, 1), (BLOCK_THREADS, 1, 1))
        self._quick: dict = {}
        self.req = req.without_arrays()  # after the infos above: the template holds no caller's array

    pointers = staticmethod(pointers)

    def check_scalar(self, scalar: int) -> None:
        if scalar:
            raise ValueError("offset: MLA calls take absolute positions only")

    @staticmethod
    def write_scalar(block, scalar: int, call=None) -> None:
        """No scalar argument: positions are an array."""

    def _write(self, core: Prepared, ptrs: tuple) -> None:
        p = core.block
        if core.filled is not self:
            fill_mla_params(p, self.req)
            core.filled = self
        q, k_pe, kv_c, c, s, pos, slots, cache, vs, qo, qf, qs = ptrs
        p.q, p.k_pe, p.kv_c, p.cos, p.sin, p.positions, p.slot_mapping = q, k_pe, kv_c, c, s, pos, slots
        p.cache, p.cache_scale, p.q_out, p.q_fp8, p.q_scale = cache, vs, qo, qf, qs

    def accepts(self, ptrs: tuple) -> bool:
        return self._addresses(ptrs) and not (self._preferred is not None and self._preferred(ptrs))

    def bind(self, core: Prepared, arrays: tuple, scalar: int, ptrs: tuple) -> Call | None:
        """Address checks, then the block's addresses; None sends the call through full validation."""
        if scalar or not self.accepts(ptrs):
            return None
        self._write(core, ptrs)
        return Call(arrays, scalar, self, self.prefix, _result(arrays))

    def repeat_path(self, sig: tuple):
        """``fn(*arrays, scalar)`` for new CuPy arrays of signature ``sig`` (``repeat_signature``):
        the signature compared, the address checks, the block written; returns the launch prefix,
        or None (the caller then goes the full way). One per signature; None when there is nothing
        to launch."""
        return made_once(self._quick, sig, self._repeat_function)

    def _repeat_function(self, sig: tuple):
        if self.prefix is None:
            return None
        nd, core, prefix = cupy_ndarray(), self.plan._core, self.prefix

        def repeat_path(*args):
            arrays, scalar = args[:-1], args[-1]
            if scalar or any(a is not None and type(a) is not nd for a in arrays):
                return None
            if repeat_signature(arrays, _OWN_INPUT) != sig:
                return None
            ptrs = tuple(0 if a is None else a.data.ptr for a in arrays)
            if not self.accepts(ptrs):
                return None
            self._write(core, ptrs)
            return prefix

        return repeat_path


class _MlaOp(Op):
    # q (the launch's geometry) and the cache (its block size fixes where a row goes).
    watched = (Q, KV_CACHE)

    def __init__(self, plan: "MlaRopeCachePlan") -> None:
        self.plan = plan

    def quick_path(self, template, arrays: tuple):
        if not hasattr(cupy_ndarray(), "_c_contiguous"):
            return None
        fn = template.repeat_path(repeat_signature(arrays, _OWN_INPUT))
        return None if fn is None else (fn, _result)

    def validate(self, arrays: tuple, scalar: int):
        if scalar:
            raise ValueError("offset: MLA calls take absolute positions only")
        kw = dict(zip(ARGS, arrays))
        req = validate_mla_call(**kw, **self.plan._opts)
        plan = self.plan
        if req.device is not None and req.device != plan.device:
            raise ValueError(f"q: on device {req.device}; this plan was built for device {plan.device}")
        fixed = _fixed(req)
        if fixed != plan._fixed:
            raise ValueError(f"execute: this plan was built for (dtype, heads, nope, rope, kv_lora_rank, cache kind, "
                             f"FP8 q kind) {plan._fixed}, got {fixed}")
        return _MlaTemplate(plan, req)


def _fixed(req: MlaRequest) -> tuple:
    return (req.dtype, req.heads, req.nope, req.rope, req.lora, req.kind, req.q_kind)


class MlaRopeCachePlan:
    """A prepared :func:`mla_rope_and_cache`: built from one call's arguments (the same keywords),
    ``execute`` takes the same arguments again. Fixed: dtype, heads, q's unrotated and rotated
    widths, kv_lora_rank, pair style, cache kind, FP8 q kind and the device. The last 16 argument
    sets of CuPy arrays are remembered and relaunched without validation; new arrays of a seen
    signature take only the address checks. For one thread at a time (its argument block is the
    plan's)."""

    def __init__(self, q, k_pe, kv_c, cos, sin, positions, slot_mapping, kv_cache, *, kv_cache_dtype: str = "auto",
                 kv_scale=None, q_out=None, q_fp8_out=None, q_fp8_scale=None, q_fp8_dtype: str = "fp8_e4m3",
                 interleaved: bool = True) -> None:
        self._opts = dict(kv_cache_dtype=kv_cache_dtype, q_fp8_dtype=q_fp8_dtype, interleaved=interleaved)
        req = validate_mla_call(q, k_pe, kv_c, cos, sin, positions, slot_mapping, kv_cache, kv_scale=kv_scale,
                                q_out=q_out, q_fp8_out=q_fp8_out, q_fp8_scale=q_fp8_scale, **self._opts)
        self._fixed = _fixed(req)
        self.device = int(req.device if req.device is not None else current_device())
        self._functions: dict = {}
        self._core = Prepared(_MlaOp(self), StructArg(MlaParams), self.device)
        from ..env import settings

        self._check_positions = settings().check_positions  # read once per plan, as every plan does

    def function(self, req: MlaRequest):
        fn = self._functions.get(req.vec)
        if fn is None:
            fn = self._functions[req.vec] = load_mla_function(req, self.device)
        return fn

    def execute(self, q, k_pe, kv_c, cos, sin, positions, slot_mapping, kv_cache, *, kv_scale=None, q_out=None,
                q_fp8_out=None, q_fp8_scale=None, stream=None) -> tuple:
        """Validate (nothing when the arguments repeat) and launch on ``stream``. Returns
        ``(q_out, k_pe, q_fp8_out)`` (q when rotated in place; q_fp8_out None without an FP8 q)."""
        arrays = (q, k_pe, kv_c, cos, sin, positions, slot_mapping, kv_cache, kv_scale, q if q_out is None else q_out,
                  q_fp8_out, q_fp8_scale)
        if self._check_positions:  # the call's checks first: only then are its positions read back
            validate_mla_call(q, k_pe, kv_c, cos, sin, positions, slot_mapping, kv_cache, kv_scale=kv_scale,
                              q_out=q_out, q_fp8_out=q_fp8_out, q_fp8_scale=q_fp8_scale, **self._opts)
            check_mla_positions(arrays)
        return self._core.execute(arrays, 0, stream)


def check_mla_positions(arrays: tuple) -> None:
    """``ROPE_RTC_CHECK_POSITIONS=1``: read a validated call's device positions back
    (synchronising) and raise on one outside the table (its token's rotation and cache row would
    be NaN)."""
    check_position_rows(_read_back(arrays[5]), int(arrays[3].shape[0]))


def _read_back(positions) -> np.ndarray:
    """The values of device ``positions`` on the host (synchronising)."""
    import cupy

    return cupy.asnumpy(cupy.asarray(positions))


def mla_rope_and_cache(q, k_pe, kv_c, cos, sin, positions, slot_mapping, kv_cache, *, kv_cache_dtype: str = "auto",
                       kv_scale=None, q_out=None, q_fp8_out=None, q_fp8_scale=None, q_fp8_dtype: str = "fp8_e4m3",
                       interleaved: bool = True, stream=None, backend: str = "auto") -> tuple:
    """DeepSeek-style MLA in one launch: rotate q's rotary part and k_pe, and write each token's
    latent cache row ``[kv_c | rotated k_pe]``.

    Parameters
    ----------
    q : array ``[T, H, qk_nope_head_dim + qk_rope_head_dim]``
        float32, float16 or bfloat16 (any token and head strides; channels contiguous). Its last
        ``qk_rope_head_dim`` channels are rotated in place (or into ``q_out``, with the others
        copied); the first ``qk_nope_head_dim`` are left as they are.
    k_pe : array ``[T, R]`` or ``[T, 1, R]``, q's dtype
        The rotary part of k, one head shared by every q head. Rotated **in place**, whether or not
        its token's slot is written (as RoPE before vLLM's ``concat_and_cache_mla`` leaves it).
    kv_c : array ``[T, kv_lora_rank]``, q's dtype
        The compressed latent, copied (or quantised) into the cache row unchanged.
    cos, sin : float32 tables ``[max_positions, R // 2]`` (``rope_rtc.rope_tables``: DeepSeek's YaRN,
        with its mscale, is ``rope_type="yarn"``); views of one ``cos_sin_cache`` (cos in the first
        half of each row, sin in the second) work too.
    positions : int32/int64 ``[T]``, absolute positions (a position outside the table gives NaN).
    slot_mapping : int32/int64 ``[T]``
        Each token's cache slot, ``block * block_size + offset``; a negative slot writes no row.
        A NumPy array is checked on the host (range, no slot twice) and copied to the device.
    kv_cache : ``[num_blocks, block_size, kv_lora_rank + R]``
        q's dtype, or uint8 holding FP8 with ``kv_cache_dtype="fp8_e4m3"`` (e4m3fn) / ``"fp8_e5m2"``.
    kv_scale : float32 device array of one element, FP8 caches only
        The cache holds ``value / scale`` (an FP32 division of the value as rounded to q's dtype),
        saturated to the format's largest finite value and rounded to nearest even: bit for bit
        RoPE followed by a separate quantising write (vLLM's ``concat_and_cache_mla``).
    q_out : optional, where the rotated q goes (default: in place).
    q_fp8_out, q_fp8_scale : optional, together
        A uint8 ``[T, H, D]`` array that receives the rotated q in FP8 (``q_fp8_dtype``), quantised
        as the cache is with the float32 one-element ``q_fp8_scale``.
    interleaved : bool
        True (default): adjacent pairs ``(x[2i], x[2i+1])``, DeepSeek's (vLLM ``is_neox_style=False``);
        False: half-split pairs ``(x[i], x[i + R/2])``.
    backend : {"auto", "nvrtc", "numpy"}
        ``"numpy"`` runs :func:`rope_rtc.reference.mla_rope_and_cache_reference` on host arrays, with
        the checks of the GPU path; ``"auto"`` uses the GPU when one is present.

    Returns
    -------
    (q_out, k_pe, q_fp8_out)
        q itself when rotated in place; ``q_fp8_out`` None without an FP8 q.

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        Before anything is launched or written, naming the argument.
    """
    check_options(kv_cache_dtype, q_fp8_dtype, interleaved)  # before they are hashed into a key
    options = (kv_cache_dtype, q_fp8_dtype, bool(interleaved))
    arrays = (q, k_pe, kv_c, cos, sin, positions, slot_mapping, kv_cache, kv_scale, q if q_out is None else q_out,
              q_fp8_out, q_fp8_scale)
    host_slots = isinstance(slot_mapping, np.ndarray)
    if not host_slots and (backend == "auto" or backend == "nvrtc"):
        if ONE_CALL.launched(options, stream, *arrays, 0):
            return _result(arrays)
    requested, backend = backend, resolve(backend)
    device = A.describe(q, "q").device
    if backend == "numpy" or device is None:
        return _apply_host(arrays, options, stream, backend, requested)
    handle = stream_handle(stream, device)
    if host_slots:
        # Every check, the host slots value by value; then their device copy, made in the order of
        # the launch's stream (CuPy's pool reuses it only after the launch has read it).
        validate_mla_call(*arrays[:8], kv_scale=kv_scale, q_out=q_out, q_fp8_out=q_fp8_out, q_fp8_scale=q_fp8_scale,
                          kv_cache_dtype=kv_cache_dtype, q_fp8_dtype=q_fp8_dtype, interleaved=interleaved,
                          allow_host_slots=True)
        from ..core.driver import device_cupy

        cupy = device_cupy()
        with cupy.cuda.Device(device), cupy_stream(handle):
            arrays = arrays[:6] + (cupy.asarray(slot_mapping),) + arrays[7:]
    # The last path is not for host slots (a new device copy every call, and their host checks).
    _, call = ONE_CALL.run(options, True, arrays, 0, handle, device, remember_last=not host_slots)
    return call.result


def _plan_key(arrays: tuple, scalar: int, options: tuple) -> tuple:
    """A plan per signature and options (validated by the plan itself)."""
    sig, _ = _SIGNATURE(arrays)
    return None, (None if sig is None else (options, sig))


def _new_plan(request, arrays: tuple, scalar: int, options: tuple, device: int) -> MlaRopeCachePlan:
    kv_cache_dtype, q_fp8_dtype, interleaved = options
    return MlaRopeCachePlan(*arrays[:8], kv_scale=arrays[8], q_out=arrays[Q_OUT], q_fp8_out=arrays[Q_FP8_OUT],
                            q_fp8_scale=arrays[11], kv_cache_dtype=kv_cache_dtype, q_fp8_dtype=q_fp8_dtype,
                            interleaved=interleaved)


_SIGNATURE = signature_with_own(((Q_OUT, Q),))
# The one-call function's dispatch; options: (kv_cache_dtype, q_fp8_dtype, interleaved).
ONE_CALL = OneCall(_plan_key, _new_plan, signature_of=_SIGNATURE,
                   check_positions=lambda plan, arrays, scalar, options: check_mla_positions(arrays))


def _apply_host(arrays: tuple, options: tuple, stream, backend: str, requested: str) -> tuple:
    """A call with host arrays (or ``backend="numpy"``): the GPU path's checks, then the NumPy
    reference, or the GPU through copies of the arrays (:func:`rope_rtc.core.backends.on_gpu`).
    The caller's arrays are written only once everything has been computed."""
    auto_without_gpu(requested, arrays[Q])
    kv_cache_dtype, q_fp8_dtype, interleaved = options
    q, k_pe, kv_c, cos, sin, positions, slots, kv_cache, kv_scale, q_out, q_fp8_out, q_fp8_scale = arrays
    req = validate_mla_call(q, k_pe, kv_c, cos, sin, positions, slots, kv_cache, kv_scale=kv_scale, q_out=q_out,
                            q_fp8_out=q_fp8_out, q_fp8_scale=q_fp8_scale, kv_cache_dtype=kv_cache_dtype,
                            q_fp8_dtype=q_fp8_dtype, interleaved=interleaved, host=True)
    if backend == "numpy":
        refuse_device(req.q)
        from ..numerics.reference import mla_rope_and_cache_reference

        def scalar(info):
            return None if info is None else host_array(info).reshape(-1)[0]

        qo, ko, cache, qf = mla_rope_and_cache_reference(
            *(host_array(i) for i in (req.q, req.k_pe, req.kv_c, req.cos, req.sin, req.positions, req.slots,
                                      req.cache)),
            kv_cache_dtype=kv_cache_dtype, kv_scale=scalar(req.kv_scale), q_fp8_scale=scalar(req.q_scale),
            q_fp8_dtype=q_fp8_dtype, interleaved=interleaved)
        results = [(qo, req.q_out or req.q), (ko, req.k_pe), (cache, req.cache)]
        if qf is not None:
            results.append((qf, req.q_fp8))
        returned = write_results(results)
        return as_given((returned[0], returned[1], returned[3] if qf is not None else None), (q_out, k_pe, q_fp8_out))
    staged = tuple(host_array(i) for i in (req.q, req.k_pe, req.kv_c, req.cos, req.sin, req.positions, req.slots,
                                           req.cache, req.kv_scale, req.q_out or req.q, req.q_fp8, req.q_scale))

    def call(a, handle):
        return mla_rope_and_cache(*a[:8], kv_scale=a[8], q_out=a[9], q_fp8_out=a[10], q_fp8_scale=a[11],
                                  kv_cache_dtype=kv_cache_dtype, q_fp8_dtype=q_fp8_dtype, interleaved=interleaved,
                                  stream=handle, backend="nvrtc")

    return as_given(on_gpu(staged, (1, 7, 9, 10), stream, call), (q_out, k_pe, q_fp8_out))
