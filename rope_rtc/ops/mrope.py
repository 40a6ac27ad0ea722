"""Multimodal RoPE (MRoPE), as Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotate q and k, and the axial
RoPE of vision towers (Qwen2.5-VL's, Qwen3-VL's, Pixtral's), which is MRoPE with two streams.

Every token has n = 2, 3 or 4 positions (``positions`` ``[n, T]``, or ``[n, B, S]`` for the
batched layouts): for three, temporal, height and width; for a vision tower's patches, height
and width (:func:`rope_rtc.vision_positions`). ``mrope_section`` (n ints summing to
``rotary_dim / 2``) says which of them each frequency takes: contiguous sections (Qwen2-VL,
Qwen2.5-VL ``[t, h, w]``: the first ``t`` frequencies the temporal position, the next ``h`` the
height, the last ``w`` the width; a vision tower's ``[D/4, D/4]``) or, with
``interleaved_sections=True``, Qwen3-VL's T, H, W, T, H, W, ... with the remainder to T (for n
streams: 0, 1, .., n-1, 0, ... with the remainder to stream 0). Pairs are half-split
(``rotate_half``), as those models rotate. A vision tower's table holds its own axis's frequency
in each column (:func:`rope_rtc.axial_tables`).

The kernel is the general kernel's specialised build (cuda_src/rope_fixed.cu) with the sections
fixed at compile time, so the rotation has the general API's numerical contract (FP32, one
rounding); a plan runs on the same prepared-launch core (docs/design.md).
:func:`rope_rtc.reference.mrope_reference` is the float64 reference.

- :class:`MRopePlan`: built once, then ``execute`` allocates nothing and can be captured.
- :func:`apply_mrope_qk` / :func:`apply_mrope`: one call (a plan per signature and thread).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..build.registry import FixedGeometry, both_strides, mrope_geometries
from ..core import arrays as A
from ..core import outputs
from ..core.backends import (as_given, auto_without_gpu, host_array, in_layout, on_gpu, refuse_device, resolve,
                             token_heads, write_results)
from ..core.launcher import stream_handle
from ..core.dispatch import OneCall
from ..core.prepared import Op, signature
from ..numerics.reference import mrope_sections, mrope_streams
from . import rope_plan
from .conventions import interface_view, shape_of
from .rope_launch import (FIXED_SMALL_THREADS, NARROW_LIMIT, check_fixed_block, fixed_threads, misaligned_view,
                          with_dense)
from .rope_plan import K, K_OUT, POSITIONS, Q, Q_OUT, RopePlan, RopeTemplate, generated_quick_path
from .rope_request import Request, validate

# The stride between position streams travels in a 32-bit field of the block.
MROPE_STRIDE_LIMIT = 2**31


def _positions(positions, q, layout, host: bool = False, streams: int = 3) -> tuple:
    """``(info, first stream)`` of ``positions``: its ArrayInfo and a view of its first stream (its
    address is the array's), which the general checks take as one position per token. ``streams``:
    the number of position streams (``len(mrope_section)``). ``host``: a host array is accepted
    (the one-call functions' host path)."""
    pi = A.describe(positions, "positions", allow_host=host)
    A.check_holds_memory(pi)  # a declaration has no first stream to view
    want = _streams_shape(q, layout, streams)
    if want is not None and pi.shape != want or len(pi.shape) < 2 or pi.shape[0] != streams:
        what = f"[{streams}, T]" if layout == "thd" else f"[{streams}, B, S]"
        expected = f"shape {want} ({what}" if want is not None else f"{what} ("
        why = ("the temporal, height and width positions of each token" if streams == 3
               else "one position stream per mrope_section entry")
        hint = ""
        if len(pi.shape) >= 2 and pi.shape[0] != streams and (want is None or pi.shape[1:] == want[1:]):
            hint = (f"; its first axis ({pi.shape[0]} streams) disagrees with mrope_section's {streams} sections: "
                    "pass one section per position stream")
        raise ValueError(f"positions: expected {expected}: {why}), got {pi.shape}{hint}")
    base = pi.array
    if hasattr(base, "__getitem__"):
        return pi, base[0]
    return pi, interface_view(positions, pi, 0, pi.shape[1:], pi.strides[1:])  # interface-only


def _streams_shape(q, layout, streams: int = 3) -> tuple | None:
    """The shape ``positions`` has for ``q`` in ``layout``: ``(n, T)`` or ``(n, B, S)`` for ``n =
    streams``; None when q's shape cannot tell (its own checks then name it)."""
    shape = shape_of(q, "q")
    axes = {"thd": (3, (0,)), "bshd": (4, (0, 1)), "bhsd": (4, (0, 2)), "sbhd": (4, (1, 0))}.get(layout)
    if shape is None or axes is None or len(shape) != axes[0]:
        return None
    return (streams,) + tuple(int(shape[i]) for i in axes[1])


def _interleaved_option(value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"interleaved_sections: expected a bool, got {value!r}")
    return bool(value)


def validate_mrope(q, k, cos, sin, positions, mrope_section, *, interleaved_sections=False, layout="thd",
                   rotary_dim=None, inverse=False, q_out=None, k_out=None, names=("q", "k"), host: bool = False):
    """Every check of an MRoPE call, before anything is launched or written. Returns the general
    request (validated with the temporal stream as its positions), the info of the whole
    ``positions`` array and the specialised build that runs the call.

    ``host``: host arrays are accepted too, all of one kind (the one-call functions' host path,
    whose arrays the NumPy backend reads or the GPU path copies): their addresses and strides,
    which no kernel reads, are not checked, and every host position is checked against the
    table."""
    interleaved_sections = _interleaved_option(interleaved_sections)
    sections = mrope_sections(mrope_section)  # how many streams positions holds
    pi, stream_zero = _positions(positions, q, layout, host, len(sections))
    req = validate(q, k, cos, sin, positions=stream_zero, layout=layout, rotary_dim=rotary_dim,
                   inverse=inverse, q_out=q_out, k_out=k_out, allow_host=host, names=names)
    if req.rotary_offset:  # pragma: no cover - validate's rotary_offset is 0 here
        raise NotImplementedError("rotary_offset: multimodal RoPE rotates the window at channel 0")
    mrope_streams(sections, req.rotary_dim, interleaved_sections=interleaved_sections)  # checks their sum
    if pi.device is None:  # host streams (the general checks have read the temporal one)
        _check_stream_values(np.asarray(pi.array), req.table_rows)
    elif pi.strides[0] < 0:
        raise ValueError(f"positions: a negative stride between streams ({pi.strides[0]} elements) is not supported")
    if pi.device is not None and pi.strides[0] >= MROPE_STRIDE_LIMIT:  # the block's field is 32-bit (fixed_params.cuh)
        raise ValueError(f"positions: streams {pi.strides[0]} elements apart; multimodal RoPE takes streams fewer "
                         f"than 2^31 elements apart (pass a [{len(sections)}, T] array of its own, e.g. "
                         "positions.copy())")
    for out in (req.q_out, req.k_out):
        if out is not None and A.overlaps(out, pi):
            raise ValueError(f"{out.name}: overlaps positions; pass separate arrays")
    return req, pi, mrope_geometry(req, layout, sections, interleaved_sections, pi.strides[0])


def mrope_geometry(req: Request, layout: str, sections: tuple, interleaved_sections: bool,
                   stream_stride: int) -> FixedGeometry:
    """The specialised build with the sections fixed, or an error saying why none fits.

    Its dense build (FIX_DENSE) also takes the position streams to be the call's token count
    apart (an [n, T] or [n, B, S] array of its own): it derives that stride from the thread count
    instead of reading ``mrope_stride`` from the block's third line."""
    if not req.in_place and req.rotary_dim < req.cq.D:
        fix = "out=x" if req.k is None else f"{req.q.name}_out={req.q.name}, {req.k.name}_out={req.k.name}"
        raise NotImplementedError(f"rotary_dim: {req.rotary_dim} of {req.cq.D} channels out of place; multimodal "
                                  f"RoPE rotates a partial window in place only (pass {fix}, or the whole head)")
    if req.cq.H == 0:
        raise NotImplementedError(f"{req.q.name}: shape {req.q.shape} has no heads; multimodal RoPE rotates at least "
                                  "one q head")
    builds = mrope_geometries(req.dtype, req.cq.H, req.ck.H if req.ck is not None else 0, req.cq.D, req.rotary_dim,
                              sections, interleaved_sections, layout == "bhsd")  # [small launches, large ones]
    if not builds:
        raise NotImplementedError(f"rotary_dim: {req.rotary_dim} is not a whole number of the kernel's vectors per "
                                  f"half for {req.dtype}")
    g = builds[0]
    bad = misaligned_view(req, g.vec) if req.num_tokens and req.device is not None else None
    if bad is not None:
        raise ValueError(f"{bad.name}: address {bad.ptr:#x} or element strides {bad.strides} are not aligned to "
                         f"{g.vec * req.q.itemsize} bytes, which multimodal RoPE reads; pass aligned arrays (a "
                         "contiguous array is)")
    small = fixed_threads(req, dataclasses.replace(g, head_batch=1)) < FIXED_SMALL_THREADS
    chosen = builds[0] if small else builds[1]
    if fixed_threads(req, chosen) >= NARROW_LIMIT:
        raise ValueError(f"{req.q.name}: {req.num_tokens} tokens need 2^31 threads or more; split the call")
    check_fixed_block(req, "multimodal RoPE")
    chosen = with_dense(req, chosen)
    return chosen if stream_stride == req.num_tokens else dataclasses.replace(chosen, dense=False)


class _MRopeTemplate(RopeTemplate):
    """The general template with the MRoPE build, the whole positions array in the address checks,
    and no generic fallback."""

    generic = False

    def __init__(self, plan: "MRopePlan", req: Request, positions: A.ArrayInfo, g: FixedGeometry) -> None:
        self._positions, self._g = positions, g
        super().__init__(plan, req)
        self._positions = None  # hold no caller's array
        self.stream_stride = positions.strides[0]

    def _infos(self, req: Request) -> tuple:
        infos = list(req.infos())
        infos[POSITIONS] = self._positions
        return tuple(infos)

    def _geometry(self, req: Request) -> FixedGeometry:
        return self._g

    def _fill_fixed(self, p) -> None:
        super()._fill_fixed(p)
        p.mrope_stride = self.stream_stride


class _MRopeOp(Op):
    # A remembered set is launched again only while q, k and the positions keep their shapes (a
    # positions array reshaped in place to [T, 3] is another call, which validation refuses).
    watched = (Q, K, POSITIONS)

    def __init__(self, plan: "MRopePlan") -> None:
        self.plan = plan

    def quick_path(self, template, arrays: tuple):
        return generated_quick_path(template, arrays, _MRopeTemplate)

    def signature(self, arrays: tuple):
        sig = signature(arrays)
        return None if sig is None else (sig, arrays[Q_OUT] is arrays[Q], arrays[K_OUT] is arrays[K])

    takes_request = True  # the one-call functions' first call hands over validate_mrope's result

    def validate(self, arrays: tuple, scalar: int, request: tuple | None = None) -> _MRopeTemplate:
        plan = self.plan
        q, k, cos, sin, positions, q_out, k_out, _, _ = arrays
        rope_plan.check_plan_arguments(plan, k, q_out, k_out)
        if request is None:
            request = validate_mrope(q, k, cos, sin, positions, plan.mrope_section,
                                     interleaved_sections=plan.interleaved_sections, layout=plan.layout,
                                     rotary_dim=plan._opts["rotary_dim"], inverse=plan.inverse, q_out=q_out,
                                     k_out=k_out, names=plan._names)
        req, pi, g = request
        rope_plan.check_request_fits_plan(plan, req)
        return _MRopeTemplate(plan, req, pi, g)


class MRopePlan(RopePlan):
    """A prepared :func:`apply_mrope_qk`: built from one call's arrays (device arrays) with the
    same keywords, ``compile()`` once, then ``execute(q, k, cos, sin, positions, ...)`` launches
    with no allocation, no synchronisation and no compilation (and can be captured in a CUDA
    graph). Fixed: dtype, layout, rotary dim, sections and their style, head counts, head dim,
    in place or not, the device. New arrays of a signature seen before take the address checks
    alone; the last 16 argument sets of CuPy arrays are relaunched without any (from the second
    launch as a one-node CUDA graph; other libraries' arrays are validated on every call)."""

    def __init__(self, q, k, cos, sin, positions, mrope_section, *, interleaved_sections: bool = False,
                 layout: str = "thd", rotary_dim: int | None = None, inverse: bool = False, q_out=None, k_out=None,
                 device: int | None = None) -> None:
        # Omitted outputs mean in place (RopePlan's rule): checked as the in-place call execute makes.
        validate_mrope(q, k, cos, sin, positions, mrope_section, interleaved_sections=interleaved_sections,
                       layout=layout, rotary_dim=rotary_dim, inverse=inverse,
                       q_out=q if q_out is None else q_out, k_out=k if k_out is None and k is not None else k_out)
        streams = len(mrope_sections(mrope_section))
        super().__init__(q, k, cos, sin, positions=_positions(positions, q, layout, streams=streams)[1], layout=layout,
                         rotary_dim=rotary_dim, inverse=inverse, q_out=q_out, k_out=k_out, device=device)
        self.mrope_section = tuple(int(v) for v in mrope_section)
        self.interleaved_sections = bool(interleaved_sections)

    @classmethod
    def _from_mrope_request(cls, validated: tuple, options: tuple, device: int) -> "MRopePlan":
        """The plan of a call ``validate_mrope`` has checked (``validated``: what it returns, both
        outputs given), by the one-call functions' options: their first call is validated once."""
        names, layout, rotary_dim, inverse, interleaved_sections, section = options
        plan = cls._from_request(validated[0], dict(layout=layout, interleaved=False, rotary_dim=rotary_dim,
                                                    rotary_offset=0, inverse=inverse), names, device)
        plan.mrope_section = tuple(int(v) for v in section)
        plan.interleaved_sections = bool(interleaved_sections)
        return plan

    def _op(self) -> Op:
        return _MRopeOp(self)

    def fixed_kernel(self, g: FixedGeometry):
        """The entry of the sectioned build ``g``, loaded on first use. No generic kernel serves
        multimodal RoPE: with ``ROPE_RTC_NO_COMPILE=1`` and the build missing, the
        KernelNotCachedError says so."""
        fn = self._fixed.get(g)
        if fn is None:
            fn = self._fixed[g] = rope_plan.load_fixed_function(g, self.device)
        return fn

    def compile(self) -> "MRopePlan":
        """Load the specialised builds of this plan's geometry and sections, for small launches and
        large ones (compiling on a cache miss). After this, ``execute`` never compiles."""
        for g in both_strides(mrope_geometries(self.dtype, self.q_heads, self.k_heads, self.head_dim, self.rotary_dim,
                                               self.mrope_section, self.interleaved_sections, self.layout == "bhsd")):
            self.fixed_kernel(g)  # the decode and the prefill build, strided and dense
        self._ensure_core()
        return self

    def execute(self, q, k=None, cos=None, sin=None, positions=None, q_out=None, k_out=None, stream=None):
        """Validate (cheaply when the arrays repeat) and launch. Returns ``(q_out, k_out)``."""
        core = self._core or self.compile()._core
        if self.in_place:
            q_out = q if q_out is None else q_out
            k_out = k if k_out is None else k_out
        arrays = (q, k, cos, sin, positions, q_out, k_out, None, None)
        if self._check_positions:  # the call's checks first: only then are its positions read back
            validate_mrope(q, k, cos, sin, positions, self.mrope_section,
                           interleaved_sections=self.interleaved_sections, layout=self.layout,
                           rotary_dim=self._opts["rotary_dim"], inverse=self.inverse, q_out=q_out, k_out=k_out,
                           names=self._names)
            check_mrope_positions(positions, cos)
        return core.execute(arrays, 0, stream)


def _positions_read_back(positions) -> np.ndarray:
    """The values of device ``positions`` on the host (synchronising)."""
    import cupy

    return cupy.asnumpy(cupy.asarray(positions))


def check_mrope_positions(positions, cos) -> None:
    """``ROPE_RTC_CHECK_POSITIONS=1``: read the positions of a validated call back (synchronising)
    and raise on one outside the table."""
    _check_stream_values(_positions_read_back(positions), int(cos.shape[0]))


def _check_stream_values(host: np.ndarray, rows: int) -> None:
    """ValueError naming the first of the host ``positions`` outside the table's ``rows``."""
    bad = np.argwhere((host < 0) | (host >= rows))
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        raise ValueError(f"positions: entry {at} is {int(host[at])}, outside the table's {rows} rows")


def apply_mrope_qk(q, k, cos, sin, positions, mrope_section, *, interleaved_sections: bool = False,
                   layout: str = "thd", rotary_dim: int | None = None, inverse: bool = False, q_out=None, k_out=None,
                   stream=None, backend: str = "auto"):
    """Rotate q and k with multimodal RoPE in one launch (q and k may have different head counts).

    Parameters
    ----------
    q, k : arrays
        ``layout``-shaped (``"thd"`` ``[T, H, D]``, ``"bshd"``, ``"bhsd"``, ``"sbhd"``), float32,
        float16 or bfloat16; CuPy or any object with ``__cuda_array_interface__`` / ``__dlpack__``,
        or NumPy (every array then on the host; the results are NumPy, computed on the GPU when
        there is one).
    cos, sin : float32 tables ``[max_positions, rotary_dim // 2]`` (:func:`rope_rtc.rope_tables`;
        for a vision tower :func:`rope_rtc.axial_tables`, each column its own axis's frequency)
    positions : int32/int64 array ``[n, T]`` (``thd``) or ``[n, B, S]``, ``n = len(mrope_section)``
        Each token's position in each stream: for three, temporal, height and width (text tokens:
        three equal ones); for a vision tower's patches, height and width
        (:func:`rope_rtc.vision_positions`). A device position outside the table gives NaN for its
        pairs (device positions are not read back unless ``ROPE_RTC_CHECK_POSITIONS=1``); host
        positions are checked.
    mrope_section : 2, 3 or 4 ints summing to ``rotary_dim / 2``
        Frequencies per stream: Qwen2-VL's ``[16, 24, 24]`` at head dim 128; a vision tower's
        ``[D/4, D/4]`` (``[20, 20]`` for Qwen2.5-VL's head dim 80).
    interleaved_sections : bool
        ``False``: contiguous sections (Qwen2-VL, Qwen2.5-VL, vision towers); ``True``: T, H, W,
        T, H, W, ..., the remainder to T (Qwen3-VL); for n streams 0, 1, .., n-1, 0, ..., the
        remainder to stream 0.
    rotary_dim, inverse, q_out, k_out, stream
        As :func:`rope_rtc.apply_rope_qk` (pairs are half-split; the window starts at channel 0).
    backend : {"auto", "nvrtc", "numpy"}
        As :func:`rope_rtc.apply_rope_qk`: ``"numpy"`` runs the float64 reference
        (:func:`rope_rtc.reference.mrope_reference`, rounded once to the dtype) on host arrays,
        with the checks of the GPU path; ``"auto"`` uses the GPU when one is present, else NumPy
        (with a one-time warning).

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
        raise TypeError("k: expected an array (use apply_mrope for a single tensor)")
    return _apply(("q", "k"), q, k, cos, sin, positions, mrope_section, interleaved_sections, layout, rotary_dim,
                  inverse, q_out, k_out, stream, backend)


def apply_mrope(x, cos, sin, positions, mrope_section, *, interleaved_sections: bool = False, layout: str = "thd",
                rotary_dim: int | None = None, inverse: bool = False, out=None, stream=None, backend: str = "auto"):
    """Rotate one tensor with multimodal RoPE; the arguments of :func:`apply_mrope_qk` with
    ``x``/``out`` for ``q``/``q_out`` (``out=x``: in place). Returns the output."""
    return _apply(("x", "k"), x, None, cos, sin, positions, mrope_section, interleaved_sections, layout, rotary_dim,
                  inverse, out, None, stream, backend)[0]


def _apply(names, q, k, cos, sin, positions, section, interleaved_sections, layout, rotary_dim, inverse, q_out,
           k_out, stream, backend):
    if isinstance(section, np.ndarray) and section.ndim == 1:  # hashable, as the plan cache's key needs
        section = tuple(section.tolist())  # (its values checked later; another rank is named there)
    if isinstance(interleaved_sections, np.bool_):
        interleaved_sections = bool(interleaved_sections)
    plain = (type(layout) is str and type(inverse) is bool and type(interleaved_sections) is bool
             and (rotary_dim is None or type(rotary_dim) is int)
             and isinstance(section, (list, tuple)) and all(type(v) is int for v in section))
    options = (names, layout, rotary_dim, inverse, interleaved_sections,
               tuple(section) if isinstance(section, (list, tuple)) else section)
    given = q_out is not None and (k is None or k_out is not None)
    if (plain and given and (backend == "auto" or backend == "nvrtc")
            and ONE_CALL.launched(options, stream, q, k, cos, sin, positions, q_out, k_out, None, None, 0)):
        return q_out, k_out
    requested, backend = backend, resolve(backend)
    qi = A.describe(q, names[0])
    if backend == "numpy" or qi.device is None:
        return _apply_host(names, q, k, cos, sin, positions, section, interleaved_sections, layout, rotary_dim,
                           inverse, q_out, k_out, stream, backend, requested)
    device = qi.device
    handle = stream_handle(stream, device)
    if q_out is None:
        q_out = outputs.allocate(qi.shape, A.numpy_dtype(qi.dtype), device, handle)
    if k is not None and k_out is None:
        ki = A.describe(k, names[1], allow_host=False)
        k_out = outputs.allocate(ki.shape, A.numpy_dtype(ki.dtype), device, handle)
    # The last path only for calls that give their outputs (an allocated one is new every call).
    ONE_CALL.run(options, plain, (q, k, cos, sin, positions, q_out, k_out, None, None), 0, handle, device,
                 remember_last=given)
    return q_out, k_out


def _apply_host(names, q, k, cos, sin, positions, section, interleaved_sections, layout, rotary_dim, inverse, q_out,
                k_out, stream, backend, requested: str = "numpy"):
    """A call with host arrays (or with ``backend="numpy"``): the GPU path's checks, then the
    float64 reference, or the GPU through copies of the arrays (:func:`rope_rtc.core.backends.on_gpu`)."""
    auto_without_gpu(requested, q)
    req, pi, _ = validate_mrope(q, k, cos, sin, positions, section, interleaved_sections=interleaved_sections,
                                layout=layout, rotary_dim=rotary_dim, inverse=inverse, q_out=q_out, k_out=k_out,
                                names=names, host=True)
    sections = tuple(int(v) for v in section)
    if backend == "numpy":
        refuse_device(req.q)
        from ..numerics.reference import mrope_reference, round_to_dtype

        pos = host_array(pi).reshape(len(sections), -1).astype(np.int64)  # [n, B*S]: token_heads' token order
        cos_t, sin_t = host_array(req.cos), host_array(req.sin)
        if req.inverse:  # the opposite angle: the negated sine (exact), as the kernel's sign
            sin_t = -sin_t
        results = []
        for x, out in ((req.q, req.q_out), (req.k, req.k_out)):
            if x is not None:
                flat, shape = token_heads(host_array(x), req.layout)
                res = mrope_reference(flat, cos_t, sin_t, pos, sections, interleaved_sections=interleaved_sections,
                                      rotary_dim=req.rotary_dim)
                results.append((in_layout(round_to_dtype(res, flat.dtype), shape, req.layout), out))
        returned = write_results(results)
        return as_given((returned[0], returned[1] if len(returned) > 1 else None), (q_out, k_out))
    arrays = tuple(host_array(i) for i in (req.q, req.k, req.cos, req.sin, pi, req.q_out, req.k_out))

    def call(a, handle):
        return _apply(names, a[0], a[1], a[2], a[3], a[4], sections, interleaved_sections, layout, rotary_dim,
                      inverse, a[5], a[6], handle, "nvrtc")

    return as_given(on_gpu(arrays, (5, 6), stream, call), (q_out, k_out))


def _validate(arrays: tuple, scalar: int, options: tuple) -> tuple[tuple, tuple]:
    """The call validated (``validate_mrope``'s result, which the plan binds from), and its plan's
    key (``OneCall``'s ``validate``)."""
    names, layout, rotary_dim, inverse, interleaved_sections, section = options
    q, k, cos, sin, positions, q_out, k_out, _, _ = arrays
    validated = validate_mrope(q, k, cos, sin, positions, section, interleaved_sections=interleaved_sections,
                               layout=layout, rotary_dim=rotary_dim, inverse=inverse, q_out=q_out, k_out=k_out,
                               names=names)
    req = validated[0]
    return validated, (options, req.dtype, req.cq.H, None if req.ck is None else req.ck.H, req.cq.D, req.in_place,
                       req.device)


def _new_plan(validated: tuple, arrays: tuple, scalar: int, options: tuple, device: int) -> MRopePlan:
    plan = MRopePlan._from_mrope_request(validated, options, device)
    plan._ensure_core()
    return plan


# The one-call functions' dispatch; options: (names, layout, rotary_dim, inverse, interleaved_sections,
# section).
ONE_CALL = OneCall(_validate, _new_plan, takes_request=True, own_input=((Q_OUT, Q), (K_OUT, K)),
                   check_positions=lambda plan, arrays, scalar, options: check_mrope_positions(arrays[POSITIONS],
                                                                                               arrays[2]))
