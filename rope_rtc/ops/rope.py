"""The general RoPE API's one-call functions: ``apply_rope`` and ``apply_rope_qk``.

Numerical contract (docs/design.md): load, convert to FP32, ``o0 = x0*c - x1*s``,
``o1 = x1*c + x0*s`` in FP32, one round-to-nearest-even to the output dtype. Channels outside
the rotary window are copied (out of place) or left untouched (in place).

On CuPy arrays a call runs through a :class:`~rope_rtc.RopePlan` of the calling thread, found
by the call's signature (options, and each array's shape, strides, dtype and device): a call
with new arrays of a signature seen before makes only the address checks and one launch, and
remembers none of its arrays. Validation is in ``rope_request``, the plan in ``rope_plan``, the
mechanism under both in ``prepared`` (docs/design.md).
"""

from __future__ import annotations

import numpy as np

from ..core import arrays as A
from ..core import launcher, outputs
from ..core.backends import as_given, auto_without_gpu, host_array as _host
from ..core.backends import in_layout, refuse_device, resolve, token_heads, token_positions, write_results
from ..core.launcher import CURRENT_STREAM, stream_handle
from ..core.dispatch import OneCall, signature_and_pointers, split_offset
from ..core.prepared import cupy_ndarray
from .conventions import flatten_like, head_dim_of, name_the_cache, shape_of, split_cos_sin_cache, unflatten_heads
from .rope_plan import OWN_INPUT, SECOND_HALF, RopePlan, check_no_tables, check_pdl
from .rope_request import Request, check_positions_of, validate

# backends (rope_rtc.core.backends resolves the switch; this module keeps what its own quick paths read)

_gpu_present = False  # once a GPU has been seen, "auto" means it without asking the driver again
_NDARRAY: type | None = None  # cupy.ndarray, once a GPU has been seen


def _resolve_backend(backend: str) -> str:
    if _gpu_present and (backend == "auto" or backend == "nvrtc"):
        return "nvrtc"
    resolved = resolve(backend)
    if resolved == "nvrtc":
        _gpu_seen()
    return resolved


def _gpu_seen() -> None:
    global _gpu_present, _NDARRAY
    _NDARRAY = cupy_ndarray()  # a module global: the one-call path reads it on every call
    _gpu_present = True


# the NumPy backend

def _numpy_one(x: A.ArrayInfo, req: Request, pos: np.ndarray) -> np.ndarray:
    from ..numerics.reference import rope_reference, round_to_dtype

    arr = _host(x)
    flat, shape = token_heads(arr, req.layout)
    if req.angles:  # each token's row, as the kernel computes it (the table's entries, tables.angle_rows)
        from ..numerics.tables import angle_rows

        cos, sin = angle_rows(pos, _host(req.cos), req.attention)
        pos = np.arange(pos.size, dtype=np.int64)
    else:
        cos, sin = _host(req.cos), _host(req.sin)
    res = rope_reference(flat, cos, sin, pos, interleaved=req.interleaved,
                         rotary_dim=req.rotary_dim, rotary_offset=req.rotary_offset, inverse=req.inverse)
    return in_layout(round_to_dtype(res, arr.dtype), shape, req.layout)


def _run_numpy(req: Request):
    # Every result first, then the writes: an error leaves every output untouched.
    pos = token_positions(req)
    returned = write_results([(_numpy_one(x, req, pos), out) for x, out in ((req.q, req.q_out), (req.k, req.k_out))
                              if x is not None])
    return returned[0], (returned[1] if len(returned) > 1 else None)


# the GPU backend

# The names the two functions give their arrays in messages; the first entry of their options.
_QK = ("q", "k")
_X = ("x", "k")
# attention_scaling: None for calls with tables; the factor for calls with inv_freq (then cos holds it).
OPTION_NAMES = ("layout", "interleaved", "rotary_dim", "rotary_offset", "inverse", "attention_scaling", "pdl")


def _kw(opts: tuple) -> dict:
    """The options tuple (OPTION_NAMES order) as the keywords of validation (all but ``pdl``, the
    plan's own)."""
    return dict(zip(OPTION_NAMES[:-1], opts))


def _plain(opts: tuple) -> bool:
    """Whether the options (OPTION_NAMES order) are of the types validation accepts as they are:
    equal values of other types (such as interleaved=1 or rotary_dim=64.0) share a dictionary key,
    so they get no cached path and take full validation every call."""
    layout, interleaved, rotary_dim, rotary_offset, inverse, attention, pdl = opts
    return ((interleaved is True or interleaved is False) and (inverse is True or inverse is False)
            and (pdl is True or pdl is False)
            and type(rotary_offset) is int and (rotary_dim is None or type(rotary_dim) is int)
            and (layout is None or type(layout) is str) and (attention is None or type(attention) is float))


def _validate(arrays: tuple, scalar: int, options: tuple) -> tuple[Request, tuple]:
    """The call validated, and its plan's key (``OneCall``'s ``validate``)."""
    q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offsets = arrays
    names, opts = options[0], options[1:]
    req = validate(q, k, cos, sin, positions=positions, offset=scalar if offsets is None else offsets,
                   cu_seqlens=cu_seqlens, q_out=q_out, k_out=k_out, allow_host=False, names=names, **_kw(opts))
    key = (options, req.dtype, req.cq.H, req.cq.D, None if req.ck is None else req.ck.H, req.in_place, req.pos_mode,
           req.angles, tuple(None if i is None else i.dtype for i in (req.positions, req.offsets, req.cu_seqlens)),
           req.device)
    return req, key


def _new_plan(req: Request, arrays: tuple, scalar: int, options: tuple, device: int) -> RopePlan:
    plan = RopePlan._from_request(req, _kw(options[1:]), options[0], req.device, options[-1])
    plan._ensure_core()
    return plan


def _check_positions(plan: RopePlan, arrays: tuple, scalar: int, options: tuple) -> None:
    check_positions_of(arrays, scalar, _kw(options[1:]))


def _repeat_path(plan: RopePlan, call, arrays: tuple, sig):
    """The template's generated function for the call's signature (``_signature_and_pointers``
    gives the repeat path's signature)."""
    return call.template.one_call(sig)


def _signature_and_pointers(arrays: tuple) -> tuple:
    """The repeat path's signature of a call (q_out and k_out: True when they are q and k) and
    its data pointers."""
    return signature_and_pointers(arrays, OWN_INPUT)


# The general op's one-call dispatch; options: (names,) + OPTION_NAMES' values.
ONE_CALL = OneCall(_validate, _new_plan, takes_request=True, signature_of=_signature_and_pointers,
                   check_positions=_check_positions, repeat_path=_repeat_path)
# The engines' convention (cos_sin_cache=, flat [T, H * D] q/k with head_dim=): its last path
# alone, the template's generated checks written for the flat arrays and the cache itself (sin:
# the second half of its rows); options: (names, head_dim) + OPTION_NAMES' first five values.
CONVENTION = OneCall(_validate, _new_plan)


def _remember_convention(names, q, k, q_out, k_out, positions, offset, cu_seqlens, cache, views: tuple, head_dim,
                         opts: tuple) -> None:
    """After a call in the engines' convention that went the full way: the convention's last
    path, once the signature of the call's views (the cache's halves, q and k as ``[T, H, D]``)
    has a generated repeat path: from its second call, and never while positions are checked on
    the device."""
    if not _plain(opts) or not (head_dim is None or type(head_dim) is int):
        return
    cos, sin = views[2], views[3]
    offsets = offset if type(offset) is _NDARRAY else None
    sig, ptrs = _signature_and_pointers((*views[:2], cos, sin, positions, *views[4:], cu_seqlens, offsets))
    hit = None if sig is None else ONE_CALL.thread().by_signature.get(((names,) + opts, sig))
    if hit is None or hit[0]._check_positions:
        return
    plan, tmpl = hit
    flat, _ = _signature_and_pointers((q, k, cache, None, positions, q_out, k_out, cu_seqlens, offsets))
    if flat is None:
        return
    flat = flat[:3] + ((SECOND_HALF, ptrs[3] - ptrs[2]),) + flat[4:]
    one_call = tmpl.one_call(flat)
    if one_call is not None:
        CONVENTION.remember_last((names, head_dim) + opts[:5] + opts[6:], one_call, plan)


def _run_device(q, k, cos, sin, positions, offset, cu_seqlens, q_out, k_out, stream, opts: tuple,
                names: tuple[str, str], device: int | None = None):
    """One launch through the thread's plan for this signature (``ONE_CALL``); outputs allocated
    when omitted. ``device``: q's device when q is not a CuPy array."""
    if type(offset) is int:
        scalar, offsets = offset, None
    elif type(offset) is _NDARRAY:
        scalar, offsets = 0, offset
    else:
        scalar, offsets = split_offset(offset)
    if device is None:
        device = q.data.device_id
    handle = stream_handle(stream, device)
    if q_out is None:
        q_out = outputs.allocate(q.shape, q.dtype, device, handle, stream is None)
    if k is not None and k_out is None:
        k_out = outputs.allocate(k.shape, k.dtype, device, handle, stream is None)
    options, plain = (names,) + opts, _plain(opts)
    if not (plain and ONE_CALL.launched_on(options, handle, q, k, cos, sin, positions, q_out, k_out, cu_seqlens,
                                           offsets, scalar)):
        ONE_CALL.run(options, plain, (q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offsets), scalar, handle,
                     device)
    return q_out, k_out


def _apply(names: tuple[str, str], q, k, cos, sin, positions, offset, cu_seqlens, q_out, k_out, stream, backend,
           opts: tuple):
    check_pdl(opts[6])
    requested, backend = backend, _resolve_backend(backend)
    if backend == "nvrtc" and type(q) is _NDARRAY and (k is None or type(k) is _NDARRAY):
        return _run_device(q, k, cos, sin, positions, offset, cu_seqlens, q_out, k_out, stream, opts, names)
    if backend == "numpy":
        auto_without_gpu(requested, q, names[0])
    req = validate(q, k, cos, sin, positions=positions, offset=offset, cu_seqlens=cu_seqlens, q_out=q_out,
                   k_out=k_out, names=names, **_kw(opts))
    host = req.q.device is None
    if backend == "numpy":
        refuse_device(req.q)
        return as_given(_run_numpy(req), (q_out, k_out))
    if not host:  # other device arrays (DLPack, __cuda_array_interface__): their CuPy views or themselves
        view = [None if i is None else i.array for i in (req.q, req.k, req.cos, None if req.angles else req.sin,
                                                            req.positions, req.offsets, req.cu_seqlens, req.q_out,
                                                            req.k_out)]
        handle = stream_handle(stream, req.device)
        for i, info in ((7, req.q), (8, req.k)):
            if view[i] is None and info is not None:
                view[i] = outputs.allocate(info.shape, A.numpy_dtype(info.dtype), req.device, handle)
        stream = handle
        qo, ko = _run_device(view[0], view[1], view[2], view[3], view[4], req.offset if view[5] is None else view[5],
                             view[6], view[7], view[8], stream, opts, names, req.device)
        return (q_out if q_out is not None else qo), (k_out if k_out is not None or k is None else ko)
    return as_given(_run_staged(req, names, q, k, stream, opts), (q_out, k_out))


def _run_staged(req: Request, names, q, k, stream, opts: tuple):
    """NumPy in, NumPy out, computed on the GPU: stage, launch, synchronise the launch's stream,
    copy back (into the caller's outputs only once everything has succeeded)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    handle = stream_handle(stream, device)
    with launcher.cupy_stream(handle):  # the uploads and the kernel in one stream's order
        staged = [None if x is None else cupy.asarray(_host(x)) for x in (req.q, req.k, req.cos,
                                                                          None if req.angles else req.sin,
                                                                          req.positions, req.offsets, req.cu_seqlens)]
    sq, sk = staged[0], staged[1]
    if req.angles:  # the staged copies are private: rotate them in place (inv_freq's partial windows need it)
        q_out, k_out = sq, sk
    else:
        q_out = sq if req.q_out is not None and req.q_out.array is q else None
        k_out = sk if req.k_out is not None and req.k is not None and req.k_out.array is k else None
    qd, kd = _run_device(sq, sk, staged[2], staged[3], staged[4], req.offset if staged[5] is None else staged[5],
                         staged[6], q_out, k_out, handle, opts, names, device)
    cupy.cuda.runtime.streamSynchronize(handle)  # the stream the kernel ran on, not the current one
    results = [None if d is None else cupy.asnumpy(d) for d in (qd, kd)]
    returned = []
    for res, user_out in zip(results, (req.q_out, req.k_out)):
        if res is not None and user_out is not None:
            user_out.array[...] = res
            res = user_out.array
        returned.append(res)
    return returned[0], returned[1]


def apply_rope_qk(q, k, cos=None, sin=None, *, positions=None, offset=0, cu_seqlens=None, layout: str | None = None,
                  interleaved: bool = False, rotary_dim: int | None = None, rotary_offset: int = 0,
                  inverse: bool = False, q_out=None, k_out=None, stream=None, backend: str = "auto",
                  cos_sin_cache=None, head_dim: int | None = None, inv_freq=None,
                  attention_scaling: float | None = None, pdl: bool = False):
    """Rotate q and k in one launch. q and k may have different head counts (GQA/MQA).

    Parameters
    ----------
    q, k : array
        ``layout``-shaped arrays of float32, float16 or bfloat16 (``ml_dtypes.bfloat16``): CuPy,
        NumPy (the result is NumPy; computed on the GPU when there is one), or any object with
        ``__dlpack__`` / ``__cuda_array_interface__`` (PyTorch, JAX), used without a copy. Leading
        dimensions may have any strides (views into a fused QKV buffer work); the last is contiguous.
    cos, sin : array
        float32 tables ``[max_positions, rotary_dim // 2]`` (see :func:`rope_tables`); any row stride.
    cos_sin_cache : array, optional
        Instead of ``cos`` and ``sin``: one float32 ``[max_positions, rotary_dim]`` table with cos in
        the first half of each row and sin in the second (vLLM's, SGLang's and FlashInfer's
        ``cos_sin_cache``; :func:`rope_rtc.tables.cos_sin_cache` builds one). Read in place, no copy.
    head_dim : int, optional
        With ``layout="thd"`` or no layout: q and k (and given outputs) may be flat
        ``[T, H * head_dim]``, as engines keep them; they are viewed as ``[T, H, head_dim]`` without
        a copy, and allocated outputs are returned flat.
    inv_freq : array, optional
        Instead of tables: the inverse frequencies ``[rotary_dim // 2]``
        (:func:`rope_rtc.inverse_frequencies`), and the kernel computes each token's cos and sin.
        float64 (``numerics="exact"``): the angle ``position * inv_freq`` in float64, cos and sin
        in float64, one rounding: within one float32 ulp of the ``rope_tables(numerics="exact")``
        entry (equal to it at every position to 2^20, as measured). float32
        (``numerics="transformers"``): torch's float32 angle ``float32(position) * inv_freq``.
        Positions may be any of 0 .. 2**31 - 1, with no table to hold. Entries must be finite and
        at most 2**20 in magnitude (what the kernel's angle reduction serves at every position;
        every model's are below 1): host values are checked, device ones are not read back. Runs
        the specialised kernel only: the window a whole number of its vectors, rotated in place
        when partial.
    attention_scaling : float, optional
        With ``inv_freq``: the factor that multiplies cos and sin (the second value
        ``inverse_frequencies`` returns; 1.0 when omitted).
    positions : array of int32/int64, optional
        One absolute position per token: ``[B, S]``, or ``[T]`` for ``layout="thd"``. ``offset``
        then stays the int 0 (any other offset is a ``ValueError``: the positions are absolute).
    offset : int or int array ``[B]``
        Default positions are ``offset + s``; an array gives each sequence its own start (decode with
        different cache lengths). With ``cu_seqlens``, the per-sequence start of the restarted positions.
    cu_seqlens : int array ``[B + 1]``, optional
        ``layout="thd"`` only: sequence boundaries of packed tokens ``[0, ..., T]``; positions restart at each.
    layout : {"bshd", "bhsd", "sbhd", "thd"}, optional
        The axes of q and k: ``"bshd"`` ``[B, S, H, D]`` (vLLM, FlashInfer, most engines), ``"bhsd"``
        ``[B, H, S, D]`` (torch and Hugging Face attention), ``"sbhd"`` ``[S, B, H, D]``, ``"thd"``
        ``[T, H, D]`` (packed tokens). Omitted: a 3-d array (or a flat one with ``head_dim``) is
        ``"thd"``; a 4-d array raises ValueError, since its shape cannot tell ``[B, S, H, D]`` from
        ``[B, H, S, D]`` and reading one as the other gives wrong values.
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
    pdl : bool
        Programmatic dependent launch (compute capability 9.0 and newer; elsewhere it changes
        nothing): the kernel is launched with programmatic stream serialization and may start
        while the kernel before it on the stream (the QKV projection, say) finishes; it waits for
        that kernel's writes before its first load. The same bits as without. Launched with
        ``cuLaunchKernelEx`` on every call (no graph replay of the plan's own); inside a CUDA-graph
        capture it records a programmatic edge.

    Returns
    -------
    (q_out, k_out)

    Raises
    ------
    TypeError, ValueError
        Before anything is launched or written, naming the argument. Positions given as host
        arrays are checked value by value; device-resident ones are not read back (a position
        outside the table gives NaN for its token) unless ``ROPE_RTC_CHECK_POSITIONS=1``.
    rope_rtc.errors.NoDeviceError
        ``backend="nvrtc"`` on a machine with no usable CUDA driver or GPU.
    """
    if k is None:
        raise TypeError("k: expected an array (use apply_rope for a single tensor)")
    if cos_sin_cache is None and head_dim is None and inv_freq is None and attention_scaling is None:
        if (q_out is not None and k_out is not None and (backend == "auto" or backend == "nvrtc")
                and (interleaved is True or interleaved is False) and (inverse is True or inverse is False)
                and type(rotary_offset) is int and (rotary_dim is None or type(rotary_dim) is int)
                and (layout is None or type(layout) is str) and (pdl is False or pdl is True)):
            # The engine's call: the thread's last path (the template's generated checks of one
            # signature), options of the types validation accepts as they are (_plain).
            options = (_QK, layout, interleaved, rotary_dim, rotary_offset, inverse, None, pdl)
            if type(offset) is int:
                if ONE_CALL.launched(options, stream, q, k, cos, sin, positions, q_out, k_out, cu_seqlens, None,
                                     offset):
                    return q_out, k_out
            elif ONE_CALL.launched(options, stream, q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offset, 0):
                return q_out, k_out  # an offsets array; anything else the function declines (not its signature)
        return _apply(_QK, q, k, cos, sin, positions, offset, cu_seqlens, q_out, k_out, stream, backend,
                      (layout, interleaved, rotary_dim, rotary_offset, inverse, None, pdl))
    if (cos_sin_cache is not None and cos is None and sin is None and inv_freq is None and attention_scaling is None
            and q_out is not None and k_out is not None and (backend == "auto" or backend == "nvrtc")
            and (head_dim is None or type(head_dim) is int)
            and _plain((layout, interleaved, rotary_dim, rotary_offset, inverse, None, pdl))):
        # The engines' convention: its last path, checked on the flat arrays and the cache themselves.
        options = (_QK, head_dim, layout, interleaved, rotary_dim, rotary_offset, inverse, pdl)
        if type(offset) is int:
            if CONVENTION.launched(options, stream, q, k, cos_sin_cache, None, positions, q_out, k_out, cu_seqlens,
                                   None, offset):
                return q_out, k_out
        elif CONVENTION.launched(options, stream, q, k, cos_sin_cache, None, positions, q_out, k_out, cu_seqlens,
                                 offset, 0):
            return q_out, k_out
    engine = (cos_sin_cache is not None and cos is None and sin is None and inv_freq is None
              and attention_scaling is None and _gpu_present and type(q) is _NDARRAY and type(k) is _NDARRAY
              and q_out is not None and k_out is not None and (backend == "auto" or backend == "nvrtc"))
    opts = (layout, interleaved, rotary_dim, rotary_offset, inverse, _attention_option(inv_freq, attention_scaling),
            pdl)
    cos, sin = _tables_or_angles(inv_freq, cos, sin, cos_sin_cache, rotary_dim, head_dim_of(q, head_dim, layout))
    flat_q = shape_of(q, "q") if head_dim is not None and q_out is None else None
    flat_k = shape_of(k, "k") if head_dim is not None and k_out is None else None
    qo, ko = _apply_converted(_QK, ("q_out", "k_out"), q, k, cos, sin, cos_sin_cache, head_dim, positions, offset,
                              cu_seqlens, q_out, k_out, stream, backend, opts, engine)
    return (q_out if q_out is not None else flatten_like(qo, flat_q),
            k_out if k_out is not None else flatten_like(ko, flat_k))


def apply_rope(x, cos=None, sin=None, *, positions=None, offset=0, cu_seqlens=None, layout: str | None = None,
               interleaved: bool = False, rotary_dim: int | None = None, rotary_offset: int = 0,
               inverse: bool = False, out=None, stream=None, backend: str = "auto", cos_sin_cache=None,
               head_dim: int | None = None, inv_freq=None, attention_scaling: float | None = None,
               pdl: bool = False):
    """Rotate one tensor. Same arguments as :func:`apply_rope_qk` with ``x``/``out`` for ``q``/``q_out``.

    ``out=x`` rotates in place. Returns the output array.
    """
    if cos_sin_cache is None and head_dim is None and inv_freq is None and attention_scaling is None:
        if (_gpu_present and type(x) is _NDARRAY and (backend == "auto" or backend == "nvrtc")
                and (interleaved is True or interleaved is False) and (inverse is True or inverse is False)
                and type(rotary_offset) is int and (rotary_dim is None or type(rotary_dim) is int)
                and (layout is None or type(layout) is str) and (pdl is False or pdl is True)):
            # As in apply_rope_qk; an output allocated as _run_device would (it takes it if the last
            # path declines), on the stream resolved inline (CURRENT_STREAM) as launched does.
            options = (_X, layout, interleaved, rotary_dim, rotary_offset, inverse, None, pdl)
            if out is not None:
                if type(offset) is int:
                    if ONE_CALL.launched(options, stream, x, None, cos, sin, positions, out, None, cu_seqlens, None,
                                         offset):
                        return out
                elif ONE_CALL.launched(options, stream, x, None, cos, sin, positions, out, None, cu_seqlens, offset,
                                       0):
                    return out
                handle = stream_handle(stream, x.data.device_id)
            else:
                device, current = x.data.device_id, CURRENT_STREAM[0]
                handle = (current(device).ptr if stream is None and current is not None
                          else stream_handle(stream, device))
                out = outputs.allocate(x.shape, x.dtype, device, handle, stream is None)
                if type(offset) is int:
                    if ONE_CALL.launched_on(options, handle, x, None, cos, sin, positions, out, None, cu_seqlens,
                                            None, offset):
                        return out
                elif ONE_CALL.launched_on(options, handle, x, None, cos, sin, positions, out, None, cu_seqlens,
                                          offset, 0):
                    return out
            return _run_device(x, None, cos, sin, positions, offset, cu_seqlens, out, None, handle, options[1:],
                               _X)[0]
        q, _ = _apply(_X, x, None, cos, sin, positions, offset, cu_seqlens, out, None, stream, backend,
                      (layout, interleaved, rotary_dim, rotary_offset, inverse, None, pdl))
        return q
    if (cos_sin_cache is not None and cos is None and sin is None and inv_freq is None and attention_scaling is None
            and out is not None and (backend == "auto" or backend == "nvrtc")
            and (head_dim is None or type(head_dim) is int)
            and _plain((layout, interleaved, rotary_dim, rotary_offset, inverse, None, pdl))):
        options = (_X, head_dim, layout, interleaved, rotary_dim, rotary_offset, inverse, pdl)  # as in apply_rope_qk
        if type(offset) is int:
            if CONVENTION.launched(options, stream, x, None, cos_sin_cache, None, positions, out, None, cu_seqlens,
                                   None, offset):
                return out
        elif CONVENTION.launched(options, stream, x, None, cos_sin_cache, None, positions, out, None, cu_seqlens,
                                 offset, 0):
            return out
    engine = (cos_sin_cache is not None and cos is None and sin is None and inv_freq is None
              and attention_scaling is None and _gpu_present and type(x) is _NDARRAY and out is not None
              and (backend == "auto" or backend == "nvrtc"))
    opts = (layout, interleaved, rotary_dim, rotary_offset, inverse, _attention_option(inv_freq, attention_scaling),
            pdl)
    cos, sin = _tables_or_angles(inv_freq, cos, sin, cos_sin_cache, rotary_dim, head_dim_of(x, head_dim, layout))
    flat = shape_of(x, "x") if head_dim is not None and out is None else None
    q, _ = _apply_converted(_X, ("out", "k_out"), x, None, cos, sin, cos_sin_cache, head_dim, positions, offset,
                            cu_seqlens, out, None, stream, backend, opts, engine)
    return out if out is not None else flatten_like(q, flat)


def _apply_converted(names, out_names, q, k, cos, sin, cache, head_dim, positions, offset, cu_seqlens, q_out, k_out,
                     stream, backend, opts: tuple, engine: bool) -> tuple:
    """A call in the engines' conventions the full way: flat arrays viewed as ``[T, H, D]`` (``cos``
    and ``sin`` already the cache's halves, or the tables), the checks' messages naming the cache,
    and, for an ``engine`` call, the thread's convention path remembered for the next calls."""
    layout = opts[0]
    views = (unflatten_heads(q, head_dim, layout, names[0]), unflatten_heads(k, head_dim, layout, names[1]), cos, sin,
             unflatten_heads(q_out, head_dim, layout, out_names[0]), unflatten_heads(k_out, head_dim, layout,
                                                                                     out_names[1]))
    try:
        result = _apply(names, views[0], views[1], cos, sin, positions, offset, cu_seqlens, views[4], views[5],
                        stream, backend, opts)
    except (TypeError, ValueError) as exc:
        name_the_cache(exc, cache)
        raise
    if engine:
        _remember_convention(names, q, k, q_out, k_out, positions, offset, cu_seqlens, cache, views, head_dim, opts)
    return result


def _attention_option(inv_freq, attention_scaling):
    """The options' last entry: None for tables; the factor (a float where it is a number, so
    equal factors share a plan) for inv_freq."""
    if inv_freq is None:
        if attention_scaling is not None:
            raise TypeError("attention_scaling: only with inv_freq (a table already holds the factor: rope_tables "
                            "applies it)")
        return None
    if attention_scaling is None:
        return 1.0
    if isinstance(attention_scaling, (int, float, np.integer, np.floating)) and not isinstance(
            attention_scaling, (bool, np.bool_)):
        try:
            return float(attention_scaling)
        except OverflowError:  # an int past float's range: validation names it
            return attention_scaling
    return attention_scaling  # validation names the wrong type


def _tables_or_angles(inv_freq, cos, sin, cos_sin_cache, rotary_dim, head_dim) -> tuple:
    """The (cos slot, sin slot) of a call: the tables, or inv_freq and None."""
    if inv_freq is not None:
        check_no_tables(cos, sin, cos_sin_cache)
        return inv_freq, None
    return split_cos_sin_cache(cos_sin_cache, cos, sin, rotary_dim, head_dim)
