"""Per-head RMSNorm fused with RoPE (QK-norm), as Qwen3 and Gemma 3 prepare q and k: each head
is normalised over the head dim in FP32, scaled by a learned weight (``q_weight`` or
``k_weight``, ``head_dim`` entries), then rotated, in one launch over q and k
(cuda_src/qk_norm_rope.cu).

Numerics (``numerics=``):

- ``"exact"``: FP32 throughout, one rounding to the output dtype at the end, within
  :func:`rope_rtc.reference.qk_norm_error_bound` of the float64 reference
  (:func:`rope_rtc.reference.qk_norm_rope_reference`).
- ``"transformers"``: rounds where Hugging Face's ``Qwen3RMSNorm`` and ``apply_rotary_pos_emb``
  round: the normalised value is cast to the input dtype before the weight (of the input dtype)
  multiplies it, and the rotation runs in the input dtype with the tables cast to it.

Gemma 3 stores its norm weights as offsets from one (``Gemma3RMSNorm`` scales by ``1 + weight``
in FP32): pass ``1 + weight`` as float32 weights with ``numerics="exact"``.

The plan is the general plan's specialised-build path on the prepared-launch core
(docs/design.md), with the two weights after the general arguments:

- :class:`QKNormRopePlan`: built once; ``execute`` allocates nothing and can be captured.
- :func:`apply_qk_norm_rope`: one call (a plan per signature and thread).
"""

from __future__ import annotations

import math
import struct
from dataclasses import replace

import numpy as np

from ..build.registry import (NORM_ENTRIES, NORM_MODES, NORM_STAGED_THREADS, FixedGeometry, NormGeometry, norm_builds,
                              norm_head_batch, norm_stageable, norm_vector_widths)
from ..core import arrays as A
from ..core import outputs
from ..core.backends import (as_given, auto_without_gpu, host_array, in_layout, on_gpu, refuse_device, resolve,
                             token_heads, token_positions, write_results)
from ..core.codegen import preferred_predicate
from ..core.launcher import launch_prefix, load_kernel, stream_handle
from ..core.dispatch import OneCall, split_offset
from ..core.prepared import Op, Prepared, signature
from ..errors import UnsupportedLayoutError, shown
from . import rope_plan
from .rope_launch import check_fixed_block, fill_fixed
from .rope_params import NormParams
from .rope_plan import K, K_OUT, Q, Q_OUT, RopePlan, RopeTemplate, generated_quick_path
from .rope_request import Request, check_kinds, check_positions_of, float_or_inf, validate

NUMERICS = tuple(NORM_MODES)
# The weights follow the general plan's nine arguments in the core's calls.
Q_WEIGHT, K_WEIGHT = 9, 10
_WEIGHTS = struct.Struct("<2Q")
_WEIGHTS_AT = NormParams.weight.offset
BLOCK_THREADS = 256  # __launch_bounds__ of qk_norm_rope.cu


def load_norm_function(g: NormGeometry, device: int):
    """The entry of the fused QK-norm build ``g``, loaded on ``device`` (compiled on a cache miss)."""
    return load_kernel(g.spec(), device).functions[NORM_ENTRIES[0]]


def check_norm_options(eps, numerics) -> float:
    """``eps`` as the float32 the kernel adds, after checking both options."""
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
    value = float_or_inf(eps)
    with np.errstate(over="ignore"):
        eps32 = np.float32(value)  # what the kernel adds: finite as a float32 too
    if not math.isfinite(value) or value < 0 or not np.isfinite(eps32):
        raise ValueError(f"eps: expected a finite value >= 0 (as a float32), got {shown(eps)}")
    if value > 0 and eps32 == 0:  # the guard asked for would be gone: an all-zero head normalises to NaN
        raise ValueError(f"eps: {shown(eps)} is 0 as a float32, the kernel's precision; pass at least "
                         f"{float(np.finfo(np.float32).smallest_subnormal):.2g} (or 0 to add none)")
    if not isinstance(numerics, str) or numerics not in NUMERICS:
        raise ValueError(f"numerics: expected one of {', '.join(map(repr, NUMERICS))}, got {numerics!r}")
    return float(eps32)


def _weight(w, name: str, req: Request, numerics: str, host: bool) -> A.ArrayInfo:
    if w is None:
        raise TypeError(f"{name}: expected an array of head_dim ({req.cq.D}) weights")
    wi = A.describe(w, name, allow_host=host)
    allowed = (req.dtype, "float32") if numerics == "exact" else (req.dtype,)
    A.check_dtype(wi, tuple(dict.fromkeys(allowed)),
                  f" for {req.dtype} q/k with numerics={numerics!r} (transformers multiplies in the input dtype)"
                  if numerics != "exact" else f" for {req.dtype} q/k")
    if wi.shape != (req.cq.D,):
        raise ValueError(f"{name}: expected shape [head_dim] = ({req.cq.D},), got {wi.shape}")
    if req.cq.D > 1 and wi.strides[0] != 1:  # a layout, as everywhere: UnsupportedLayoutError (a ValueError)
        raise UnsupportedLayoutError(f"{name}: expected a contiguous vector (stride 1 element), got stride "
                                     f"{wi.strides[0]}; pass a contiguous copy")
    return wi


def validate_qk_norm(q, k, q_weight, k_weight, cos, sin, *, eps, numerics: str, positions=None, offset=0,
                     cu_seqlens=None, layout: str | None = None, interleaved: bool = False, rotary_dim: int | None = None,
                     rotary_offset: int = 0, inverse: bool = False, q_out=None, k_out=None,
                     names: tuple[str, str] = ("q", "k"), host: bool = False):
    """Every check of a fused QK-norm call, before anything is launched or written. Returns
    ``(request, q_weight info, k_weight info, build, eps as float32)``.

    ``host``: host arrays are accepted too, all of one kind (the one-call function's host path,
    whose arrays the NumPy backend reads or the GPU path copies); their addresses and strides,
    which no kernel reads, are not checked."""
    eps32 = check_norm_options(eps, numerics)
    if k is None:
        raise TypeError("k: expected an array (the fused norm rotates q and k together)")
    req = validate(q, k, cos, sin, positions=positions, offset=offset, cu_seqlens=cu_seqlens, q_out=q_out,
                   k_out=k_out, layout=layout, interleaved=interleaved, rotary_dim=rotary_dim,
                   rotary_offset=rotary_offset, inverse=inverse, allow_host=host, names=names)
    if req.ck.D != req.cq.D:  # pragma: no cover - validate refuses different head dims
        raise ValueError("k: the head dim must equal q's")
    qw, kw = _weight(q_weight, "q_weight", req, numerics, host), _weight(k_weight, "k_weight", req, numerics, host)
    if qw.dtype != kw.dtype:
        raise TypeError(f"q_weight/k_weight: one dtype for both, got {qw.dtype} and {kw.dtype}")
    check_kinds([req.q, qw, kw])  # the weights where q is
    for out in (req.q_out or req.q, req.k_out or req.k):  # what the launch writes (in place: q and k)
        for w in (qw, kw):
            if A.overlaps(out, w):
                raise ValueError(f"{out.name} overlaps {w.name}: the weights must not share bytes with an output")
    return req, qw, kw, norm_geometry(req, (qw, kw), numerics), eps32


def norm_geometry(req: Request, weights: tuple, numerics: str) -> NormGeometry:
    """The build for a validated call: the widest vector that the geometry and every address allow."""
    D = req.cq.D
    widths = norm_vector_widths(req.dtype, req.interleaved, D, req.rotary_offset, req.rotary_dim)
    if not widths:
        raise NotImplementedError(
            f"head_dim {D} with rotary_dim {req.rotary_dim} at rotary_offset {req.rotary_offset}: the fused QK-norm "
            "kernel needs head_dim to be a power-of-two number (at most 32) of its vectors and the window whole "
            "vectors; normalise separately, then call apply_rope_qk")
    for vec in widths:  # q/k/outputs and the weights are read in vectors (with or without tokens)
        if req.device is None:  # host arrays: the kernel reads copies of them (rope_rtc.core.backends.on_gpu)
            break
        if _strides_allow(req, vec) and not any(ptr & mask for ptr, mask in _vector_masks(req, weights, vec)):
            break
    else:
        for w in weights:
            need = weight_alignment(widths[-1], w.itemsize)
            if w.ptr % need:
                raise ValueError(f"{w.name}: address {w.ptr:#x} is not {need}-byte aligned, which the fused QK-norm "
                                 "kernel needs to read the weights in vectors; pass an aligned array (a fresh "
                                 "allocation is)")
        raise ValueError(f"{req.q.name}/{req.k.name}/outputs: addresses or strides are not aligned to any vector "
                         "the fused QK-norm kernel reads; pass aligned arrays")
    g = NormGeometry(req.dtype, req.interleaved, req.cq.H, req.ck.H, D, req.rotary_offset, req.rotary_dim, vec,
                     weights[0].dtype == "float32" and req.dtype != "float32", numerics,
                     norm_head_batch(req.cq.H, req.ck.H))
    threads = norm_threads(req, g)
    if threads >= 2**31:
        raise ValueError(f"{req.q.name}: {req.num_tokens} tokens need 2^31 threads or more; split the call")
    if threads >= NORM_STAGED_THREADS and norm_stageable(g):
        g = replace(g, staged=True)
    check_fixed_block(req, "the fused QK-norm kernel")
    return g


def _views(req: Request) -> tuple:
    """``(argument index, info)`` of what the build reads and writes in vectors of the input dtype:
    none without tokens."""
    if not req.num_tokens:
        return ()
    return tuple((i, info) for i, info in ((Q, req.q), (K, req.k), (Q_OUT, req.q_out), (K_OUT, req.k_out))
                 if info is not None)


def _strides_allow(req: Request, vec: int) -> bool:
    """Whether the arrays' strides (fixed by a call's signature) allow ``vec``-element vectors."""
    return not any(s % vec for _, i in _views(req) for d, s in zip(i.shape[:-1], i.strides[:-1]) if d > 1)


def _vector_masks(req: Request, weights: tuple, vec: int, *, indices: bool = False) -> tuple:
    """``(pointer, mask)`` (``indices``: ``(argument index, mask)``) of each address a build of
    ``vec``-element vectors reads or writes in vectors: the views and the weights."""
    size = req.q.itemsize
    views = tuple((i if indices else info.ptr, vec * size - 1) for i, info in _views(req))
    return views + tuple((i if indices else w.ptr, weight_alignment(vec, w.itemsize) - 1)
                         for i, w in zip((Q_WEIGHT, K_WEIGHT), weights))


def preferred_masks(req: Request, weights: tuple, g: NormGeometry) -> tuple:
    """``(argument index, mask)`` of the narrowest build wider than ``g`` (widths are preferred
    widest first) that the call's signature allows, for ``codegen.preferred_predicate``; empty
    when ``g`` is the widest."""
    widths = norm_vector_widths(req.dtype, req.interleaved, req.cq.D, req.rotary_offset, req.rotary_dim)
    wider = [vec for vec in widths if vec > g.vec and _strides_allow(req, vec)]
    return _vector_masks(req, weights, min(wider), indices=True) if wider else ()


def weight_alignment(vec: int, itemsize: int) -> int:
    """Bytes the weights' address must be a multiple of for a build of ``vec``-element vectors:
    one aligned load, or 16-byte loads when the lane's weights span more (eight float32)."""
    return min(vec * itemsize, 16)


def norm_threads(req: Request, g: NormGeometry) -> int:
    return req.num_tokens * (g.q_heads + g.k_heads) // g.head_batch * g.lanes


class _NormTemplate(RopeTemplate):
    """The general template with the fused norm build, the weights in the address checks and no
    generic fallback."""

    generic = False

    def __init__(self, plan: "QKNormRopePlan", req: Request, qw: A.ArrayInfo, kw: A.ArrayInfo,
                 g: NormGeometry) -> None:
        self._weights, self._g = (qw, kw), g
        super().__init__(plan, req)
        self._weights = None  # hold no caller's array
        # The weights are read in vectors of the build's width.
        self.natural = self.natural + ((Q_WEIGHT, weight_alignment(g.vec, qw.itemsize) - 1),
                                       (K_WEIGHT, weight_alignment(g.vec, kw.itemsize) - 1))
        self.prepare_checks()
        # Built for a call off a wider build's alignment: aligned calls go back to validation.
        self.preferred_masks = preferred_masks(req, (qw, kw), g)
        self._preferred = preferred_predicate(self.preferred_masks, owner=type(self.plan).__name__)
        # fill_fixed's view of the build (the block's shared fields), the norm's own thread count.
        self._as_fixed = FixedGeometry(g.dtype, g.interleaved, g.q_heads, g.k_heads, g.head_dim, g.rotary_offset,
                                       g.rotary_dim, g.vec, 1, 0)

    def _infos(self, req: Request) -> tuple:
        return req.infos() + self._weights

    def _geometry(self, req: Request) -> NormGeometry:
        return self._g

    def _fill_fixed(self, p) -> None:
        fill_fixed(p, self.req, self._as_fixed)
        p.total = norm_threads(self.req, self._g)
        p.eps = self.plan.eps

    def bind(self, core: Prepared, arrays: tuple, offset: int, ptrs: tuple):
        """The general template's bind, after declining a call a wider build can take."""
        if self._preferred is not None and self._preferred(ptrs):
            return None
        return super().bind(core, arrays, offset, ptrs)

    EXTRA_ARGS = ("q_weight", "k_weight")

    def _extra_writes(self) -> tuple[str, dict]:
        return f"    wpack(block, {_WEIGHTS_AT}, p{Q_WEIGHT}, p{K_WEIGHT})\n", {"wpack": _WEIGHTS.pack_into}

    def _write_fixed(self, core: Prepared, ptrs: tuple, offset: int) -> tuple:
        """The general build's block, then the weights' addresses after it."""
        pre = super()._write_fixed(core, ptrs, offset)
        _WEIGHTS.pack_into(self.plan._fixed_bytes, _WEIGHTS_AT, ptrs[Q_WEIGHT], ptrs[K_WEIGHT])
        return pre

    def _launch_fixed(self) -> tuple:
        total = norm_threads(self.req, self._g)
        return launch_prefix(self.plan.fixed_kernel(self._g), (max(1, -(-total // BLOCK_THREADS)), 1, 1),
                             (BLOCK_THREADS, 1, 1))


class _NormOp(Op):
    def __init__(self, plan: "QKNormRopePlan") -> None:
        self.plan = plan

    def quick_path(self, template, arrays: tuple):
        return generated_quick_path(template, arrays, _NormTemplate)

    def signature(self, arrays: tuple):
        sig = signature(arrays)
        return None if sig is None else (sig, arrays[Q_OUT] is arrays[Q], arrays[K_OUT] is arrays[K])

    takes_request = True  # apply_qk_norm_rope's first call hands over validate_qk_norm's result

    def validate(self, arrays: tuple, scalar: int, request: tuple | None = None) -> _NormTemplate:
        plan = self.plan
        q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offsets, qw, kw = arrays
        rope_plan.check_plan_arguments(plan, k, q_out, k_out)
        if request is None:
            request = validate_qk_norm(q, k, qw, kw, cos, sin, eps=plan.eps, numerics=plan.numerics,
                                       positions=positions, offset=scalar if offsets is None else offsets,
                                       cu_seqlens=cu_seqlens, q_out=q_out, k_out=k_out, names=plan._names,
                                       **plan._opts)
        req, qwi, kwi, g, _ = request
        rope_plan.check_request_fits_plan(plan, req)
        if qwi.dtype != plan.weight_dtype:
            raise ValueError(f"q_weight/k_weight: dtype {qwi.dtype} (plan: {plan.weight_dtype})")
        return _NormTemplate(plan, req, qwi, kwi, g)


class QKNormRopePlan(RopePlan):
    """A prepared :func:`apply_qk_norm_rope`: built from one call's device arrays with the same
    keywords, ``compile()`` once, then ``execute(q, k, q_weight, k_weight, cos, sin, ...)``
    launches with no allocation, no synchronisation and no compilation (and can be captured in
    a CUDA graph). Fixed: what a :class:`~rope_rtc.RopePlan` fixes, plus ``eps``, ``numerics``
    and the weights' dtype. New arrays of a signature seen before take the address checks alone;
    the last 16 argument sets are relaunched without any (from the second launch as a one-node
    CUDA graph)."""

    def __init__(self, q, k, q_weight, k_weight, cos, sin, *, eps: float = 1e-6, numerics: str = "exact",
                 positions=None, offset=0, cu_seqlens=None, layout: str | None = None, interleaved: bool = False,
                 rotary_dim: int | None = None, rotary_offset: int = 0, inverse: bool = False, q_out=None,
                 k_out=None, device: int | None = None) -> None:
        _, qw, _, _, self.eps = validate_qk_norm(
            q, k, q_weight, k_weight, cos, sin, eps=eps, numerics=numerics, positions=positions, offset=offset,
            cu_seqlens=cu_seqlens, layout=layout, interleaved=interleaved, rotary_dim=rotary_dim,
            rotary_offset=rotary_offset, inverse=inverse, q_out=q_out, k_out=k_out)
        super().__init__(q, k, cos, sin, positions=positions, offset=offset, cu_seqlens=cu_seqlens, layout=layout,
                         interleaved=interleaved, rotary_dim=rotary_dim, rotary_offset=rotary_offset,
                         inverse=inverse, q_out=q_out, k_out=k_out, device=device)
        self.numerics = numerics
        self.weight_dtype = qw.dtype
        self._norm: dict[NormGeometry, object] = {}

    @classmethod
    def _from_norm_request(cls, validated: tuple, options: tuple, device: int) -> "QKNormRopePlan":
        """The plan of a call ``validate_qk_norm`` has checked (``validated``: what it returns,
        both outputs given), by the one-call function's options: its first call is validated once."""
        layout, interleaved, rotary_dim, rotary_offset, inverse, eps, numerics = options
        req, qw, _, _, eps32 = validated
        plan = cls._from_request(req, dict(layout=layout, interleaved=interleaved, rotary_dim=rotary_dim,
                                           rotary_offset=rotary_offset, inverse=inverse), ("q", "k"), device)
        plan.eps, plan.numerics, plan.weight_dtype = eps32, numerics, qw.dtype
        plan._norm = {}
        return plan

    _fixed_params = NormParams  # the fused build's block: FixedParams, then the weights and eps

    def _op(self) -> Op:
        return _NormOp(self)

    def fixed_kernel(self, g: NormGeometry):
        """The entry of the fused build ``g``, loaded on first use (no generic kernel serves the
        fused norm: with ``ROPE_RTC_NO_COMPILE=1`` and the build missing, the
        KernelNotCachedError says so)."""
        fn = self._norm.get(g)
        if fn is None:
            fn = self._norm[g] = load_norm_function(g, self.device)
        return fn

    def compile(self) -> "QKNormRopePlan":
        """Load every build this plan's calls can take (one per vector width the geometry allows,
        the widest serving aligned arrays, and the staged twins for large launches), compiling on a
        cache miss. After this, ``execute`` never compiles."""
        f32 = self.weight_dtype == "float32" and self.dtype != "float32"
        for g in norm_builds(self.dtype, self.interleaved, self.q_heads, self.k_heads, self.head_dim,
                             self.rotary_offset, self.rotary_dim, f32, self.numerics):
            self.fixed_kernel(g)
        self._ensure_core()
        return self

    def execute(self, q, k, q_weight, k_weight, cos, sin, positions=None, q_out=None, k_out=None, stream=None, *,
                offset=None, cu_seqlens=None):
        """Validate (cheaply when the arrays repeat) and launch. Returns ``(q_out, k_out)``."""
        return self._execute(q, k, cos, sin, positions, q_out, k_out, stream, offset, cu_seqlens, (q_weight, k_weight))


def apply_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, *, eps: float = 1e-6, numerics: str = "exact",
                       positions=None, offset=0, cu_seqlens=None, layout: str | None = None, interleaved: bool = False,
                       rotary_dim: int | None = None, rotary_offset: int = 0, inverse: bool = False, q_out=None,
                       k_out=None, stream=None, backend: str = "auto"):
    """RMSNorm each q and k head over the head dim, scale by its weight, then rotate: one launch.

    Parameters
    ----------
    q, k : arrays
        ``layout``-shaped, float32, float16 or bfloat16 (CuPy, or any object with
        ``__cuda_array_interface__`` / ``__dlpack__``, or NumPy: every array then on the host,
        the results NumPy, computed on the GPU when there is one); q and k may have different
        head counts.
    q_weight, k_weight : arrays ``[head_dim]``
        The scale of each channel, the input's dtype or float32 (``numerics="exact"`` only):
        Qwen3's ``q_norm.weight`` / ``k_norm.weight`` as they are. Gemma 3 scales by ``1 + weight``
        in FP32: pass ``1 + weight`` as float32 with ``numerics="exact"``.
    cos, sin : float32 tables ``[max_positions, rotary_dim // 2]`` (:func:`rope_rtc.rope_tables`)
    eps : float
        Added to the mean square before the square root (``rms_norm_eps``), as float32.
    numerics : {"exact", "transformers"}
        ``"exact"``: FP32 throughout and one rounding. ``"transformers"``: the roundings of Hugging
        Face's ``Qwen3RMSNorm`` followed by ``apply_rotary_pos_emb`` in the input dtype.
    positions, offset, cu_seqlens, layout, interleaved, rotary_dim, rotary_offset, inverse, q_out, k_out, stream
        As :func:`rope_rtc.apply_rope_qk`. Channels outside the rotary window are normalised and
        not rotated.
    backend : {"auto", "nvrtc", "numpy"}
        As :func:`rope_rtc.apply_rope_qk`: ``"numpy"`` runs the reference of ``numerics`` on host
        arrays, with the checks of the GPU path (``"exact"``:
        :func:`rope_rtc.reference.qk_norm_rope_reference` in float64, rounded once to the dtype;
        ``"transformers"``: :func:`rope_rtc.reference.qk_norm_rope_transformers_reference`, the
        kernel's roundings); ``"auto"`` uses the GPU when one is present, else NumPy (with a
        one-time warning).

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
    if k is None:
        raise TypeError("k: expected an array (the fused norm rotates q and k together)")
    options = (layout, interleaved, rotary_dim, rotary_offset, inverse, eps, numerics)
    plain = ((layout is None or type(layout) is str) and type(interleaved) is bool and type(inverse) is bool
             and type(rotary_offset) is int and (rotary_dim is None or type(rotary_dim) is int)
             and type(eps) in (float, int) and type(numerics) is str)
    if plain and q_out is not None and k_out is not None and (backend == "auto" or backend == "nvrtc"):
        scalar, offsets = split_offset(offset)
        if ONE_CALL.launched(options, stream, q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offsets, q_weight,
                             k_weight, scalar):
            return q_out, k_out
    requested, backend = backend, resolve(backend)
    qi = A.describe(q, "q")
    if backend == "numpy" or qi.device is None:
        return _apply_host(q, k, q_weight, k_weight, cos, sin, options, positions, offset, cu_seqlens, q_out, k_out,
                           stream, backend, requested)
    device = qi.device
    handle = stream_handle(stream, device)
    given = q_out is not None and k_out is not None
    if q_out is None:
        q_out = outputs.allocate(qi.shape, A.numpy_dtype(qi.dtype), device, handle)
    if k_out is None:
        ki = A.describe(k, "k", allow_host=False)
        k_out = outputs.allocate(ki.shape, A.numpy_dtype(ki.dtype), device, handle)
    scalar, offsets = split_offset(offset)
    # The last path only for calls that give their outputs (an allocated one is new every call).
    ONE_CALL.run(options, plain, (q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offsets, q_weight, k_weight),
                 scalar, handle, device, remember_last=given)
    return q_out, k_out


def _apply_host(q, k, q_weight, k_weight, cos, sin, options: tuple, positions, offset, cu_seqlens, q_out, k_out,
                stream, backend: str, requested: str = "numpy"):
    """A call with host arrays (or with ``backend="numpy"``): the GPU path's checks, then the
    reference of the call's numerics, or the GPU through copies of the arrays
    (:func:`rope_rtc.core.backends.on_gpu`)."""
    auto_without_gpu(requested, q)
    layout, interleaved, rotary_dim, rotary_offset, inverse, eps, numerics = options
    req, qwi, kwi, _, eps32 = validate_qk_norm(q, k, q_weight, k_weight, cos, sin, eps=eps, numerics=numerics,
                                               positions=positions, offset=offset, cu_seqlens=cu_seqlens,
                                               layout=layout, interleaved=interleaved, rotary_dim=rotary_dim,
                                               rotary_offset=rotary_offset, inverse=inverse, q_out=q_out,
                                               k_out=k_out, host=True)
    if backend == "numpy":
        refuse_device(req.q)
        from ..numerics.reference import qk_norm_rope_reference, qk_norm_rope_transformers_reference, round_to_dtype

        pos = token_positions(req)
        kw = dict(eps=eps32, interleaved=req.interleaved, rotary_dim=req.rotary_dim,
                  rotary_offset=req.rotary_offset, inverse=req.inverse)
        results = []
        cos_t, sin_t = host_array(req.cos), host_array(req.sin)
        for x, w, out in ((req.q, qwi, req.q_out), (req.k, kwi, req.k_out)):
            flat, shape = token_heads(host_array(x), req.layout)
            if numerics == "exact":
                res = round_to_dtype(qk_norm_rope_reference(flat, host_array(w), cos_t, sin_t, pos, **kw), flat.dtype)
            else:
                res = qk_norm_rope_transformers_reference(flat, host_array(w), cos_t, sin_t, pos, **kw)
            results.append((in_layout(res, shape, req.layout), out))
        return as_given(write_results(results), (q_out, k_out))
    arrays = tuple(host_array(i) for i in (req.q, req.k, qwi, kwi, req.cos, req.sin, req.positions, req.q_out,
                                           req.k_out, req.cu_seqlens, req.offsets))

    def call(a, handle):
        return apply_qk_norm_rope(a[0], a[1], a[2], a[3], a[4], a[5], eps=eps, numerics=numerics, positions=a[6],
                                  offset=req.offset if a[10] is None else a[10], cu_seqlens=a[9], layout=layout,
                                  interleaved=interleaved, rotary_dim=rotary_dim, rotary_offset=rotary_offset,
                                  inverse=inverse, q_out=a[7], k_out=a[8], stream=handle, backend="nvrtc")

    return as_given(on_gpu(arrays, (7, 8), stream, call), (q_out, k_out))


def _validate(arrays: tuple, scalar: int, options: tuple) -> tuple[tuple, tuple]:
    """The call validated (``validate_qk_norm``'s result, which the plan binds from), and its
    plan's key (``OneCall``'s ``validate``)."""
    layout, interleaved, rotary_dim, rotary_offset, inverse, eps, numerics = options
    q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offsets, qw, kw = arrays
    validated = validate_qk_norm(q, k, qw, kw, cos, sin, eps=eps, numerics=numerics, positions=positions,
                                 offset=scalar if offsets is None else offsets, cu_seqlens=cu_seqlens, layout=layout,
                                 interleaved=interleaved, rotary_dim=rotary_dim, rotary_offset=rotary_offset,
                                 inverse=inverse, q_out=q_out, k_out=k_out)
    req, qwi = validated[0], validated[1]
    return validated, (options, req.dtype, req.cq.H, req.ck.H, req.cq.D, req.in_place, req.pos_mode,
                       tuple(None if i is None else i.dtype for i in (req.positions, req.offsets, req.cu_seqlens)),
                       qwi.dtype, req.device)


def _new_plan(validated: tuple, arrays: tuple, scalar: int, options: tuple, device: int) -> QKNormRopePlan:
    plan = QKNormRopePlan._from_norm_request(validated, options, device)
    plan._ensure_core()
    return plan


# The one-call function's dispatch; options: (layout, interleaved, rotary_dim, rotary_offset, inverse,
# eps, numerics).
ONE_CALL = OneCall(_validate, _new_plan, takes_request=True, own_input=((Q_OUT, Q), (K_OUT, K)),
                   check_positions=lambda plan, arrays, scalar, options: check_positions_of(arrays[:9], scalar,
                                                                                            plan._opts))
