"""The JAX functions' arguments checked at trace time, by the library's own validation.

Inside ``jax.jit`` an argument is an abstract value: a shape and a dtype, no address. Each one is
declared as a :class:`~rope_rtc.TensorDesc` (C-contiguous, which is how XLA hands buffers to a
custom call) and the declarations go through the checks of the CuPy API (``rope_request.validate``,
``kv_cache.validate_cache_call``), so a call is refused with the same ``TypeError`` or
``ValueError``, naming the argument, before anything is staged out. What a check settles (the
layout, the rotary window, the position scheme) is kept in a :class:`RopeCall` or
:class:`CacheCall`: the static half of a call, which the kernel's callback and the jnp reference
both read, and which ``jax.custom_vjp`` receives as a non-differentiable argument (so it is
frozen and hashable).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..core.descriptors import TensorDesc, is_int
from ..errors import shown
from ..ops.conventions import head_dim_of, name_the_cache, split_cos_sin_cache, unflatten_heads
from ..ops.kv_cache import check_cache_options, validate_cache_call
from ..ops.rope_request import Request, validate

BACKENDS = ("auto", "nvrtc", "jnp")
# The device every declaration names: validation only compares devices with each other, and the
# device a jitted call runs on is known only when XLA runs it.
_DECLARED_DEVICE = 0


@dataclass(frozen=True)
class RopeCall:
    """What the checks settled about one call of ``apply_rope`` / ``apply_rope_qk`` (and the
    RoPE part of ``rope_and_cache``), with the arrays left out: which of them are present, and
    every option in the form the CuPy API takes it."""

    names: tuple[str, str]  # the names messages give the two tensors: ("q", "k") or ("x", "k")
    has_k: bool
    layout: str  # as settled: "bshd", "bhsd", "sbhd" or "thd"
    interleaved: bool
    rotary_dim: int
    rotary_offset: int
    inverse: bool
    combined: bool  # one cos_sin_cache instead of cos and sin
    positions: bool  # a positions array
    offsets: bool  # an offset array (one start per sequence)
    cu_seqlens: bool
    offset: int  # the scalar offset (0 with an offset array or positions)
    backend: str
    in_place: bool

    def inverted(self) -> "RopeCall":
        """The same call rotating by the opposite angle: the backward of this one."""
        return replace(self, inverse=not self.inverse)


@dataclass(frozen=True)
class CacheCall:
    """What the checks settled about one call of ``rope_and_cache``."""

    rope: RopeCall  # q and k: layout "thd", tables, no cos_sin_cache
    kv_layout: str
    kv_cache_dtype: str


def check_backend(backend, in_place) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: {shown(backend)} is not one of {', '.join(map(repr, BACKENDS))}")
    if not isinstance(in_place, (bool, np.bool_)):
        raise TypeError(f"in_place: expected a bool, got {type(in_place).__name__} {shown(in_place)}")


def as_array(value, name: str):
    """``value`` as a JAX array (a tracer inside ``jit`` stays one); None stays None. A NumPy
    array (``rope_rtc.rope_tables`` returns them) is converted; anything without a shape and a
    dtype is refused, naming the argument."""
    import jax
    import jax.numpy as jnp

    if value is None or isinstance(value, jax.Array):
        return value
    if isinstance(value, np.ndarray) or (hasattr(value, "shape") and hasattr(value, "dtype")):
        out = jnp.asarray(value)
        if isinstance(value, np.ndarray) and value.dtype.kind in "iu" and value.size and \
                value.dtype.itemsize > out.dtype.itemsize:
            # Without jax_enable_x64 JAX narrows a 64-bit array without a word: a position or slot
            # past 2^31 would land inside the table or the cache.
            for v in (int(value.min()), int(value.max())):
                if not np.iinfo(out.dtype).min <= v <= np.iinfo(out.dtype).max:
                    raise ValueError(f"{name}: {v} does not fit the {out.dtype} JAX makes of a 64-bit array "
                                     "without jax_enable_x64; enable it (jax.config.update('jax_enable_x64', "
                                     "True)) or pass values that fit")
        return out
    raise TypeError(f"{name}: expected a JAX or NumPy array, got {type(value).__name__} {shown(value)}")


def declared(x) -> TensorDesc | None:
    """The declaration of a JAX array (or tracer): its dtype and shape, C-contiguous."""
    if x is None:
        return None
    return TensorDesc(np.dtype(x.dtype), tuple(int(d) for d in x.shape), device=_DECLARED_DEVICE)


def offset_arg(offset, name: str = "offset"):
    """``offset`` as the checks take it: a Python int stays (static: one compilation per value),
    an array becomes a JAX array (traced: one compilation for every value). A 0-d array is one
    start for every sequence, broadcast by :func:`broadcast_offset`."""
    if offset is None or is_int(offset) or isinstance(offset, (bool, np.bool_, float, np.floating)):
        return offset  # an int, or what validation refuses by its type
    return as_array(offset, name)


def is_array(offset) -> bool:
    """Whether an offset is an array (traced), not a Python int."""
    return offset is not None and not is_int(offset) and hasattr(offset, "shape")


def broadcast_offset(offset, sequences: int):
    """A 0-d offset array as ``[sequences]``: the CuPy API takes one start per sequence."""
    import jax.numpy as jnp

    if offset.ndim == 0:
        return jnp.broadcast_to(offset, (sequences,))
    return offset


def _sequences(req: Request) -> int:
    return req.cu_seqlens.shape[0] - 1 if req.cu_seqlens is not None else req.cq.B


def _validated(names, q, k, cos, sin, cache, positions, offset, cu_seqlens, layout, interleaved, rotary_dim,
               rotary_offset, inverse) -> Request:
    """``rope_request.validate`` on declarations, the messages naming ``cos_sin_cache`` where the
    tables are its halves."""
    try:
        return validate(q, k, cos, sin, positions=positions, offset=offset, cu_seqlens=cu_seqlens, layout=layout,
                        interleaved=interleaved, rotary_dim=rotary_dim, rotary_offset=rotary_offset, inverse=inverse,
                        allow_host=False, names=names, allow_desc=True)
    except (TypeError, ValueError) as exc:
        name_the_cache(exc, cache)
        raise


def check_rope(names: tuple[str, str], q, k, cos, sin, cos_sin_cache, positions, offset, cu_seqlens, layout,
               interleaved, rotary_dim, rotary_offset, inverse, head_dim, backend, in_place) -> tuple:
    """One call of ``apply_rope(_qk)`` checked.

    Returns ``(call, q, k, tables, index, flat_shapes)``: the :class:`RopeCall`; q and k as JAX
    arrays (flat ``[T, H * D]`` ones reshaped to ``[T, H, D]``, which costs XLA nothing); the
    tables, ``(cos, sin)`` or ``(cos_sin_cache,)``; the index arrays ``(positions, offsets,
    cu_seqlens)`` (None where absent); and the flat shapes to give the results back (None where
    the array was not flat)."""
    check_backend(backend, in_place)
    q, k = as_array(q, names[0]), as_array(k, names[1])
    cos, sin, cache = as_array(cos, "cos"), as_array(sin, "sin"), as_array(cos_sin_cache, "cos_sin_cache")
    positions, cu_seqlens = as_array(positions, "positions"), as_array(cu_seqlens, "cu_seqlens")
    offset = offset_arg(offset)
    if q is None:
        raise TypeError(f"{names[0]}: expected an array, got None")
    dq, dk = declared(q), declared(k)
    # The engines' flat [T, H * D] arrays: checked as the library checks them, then viewed as
    # [T, H, D] by a reshape (a bitcast in XLA: no copy).
    vq, vk = unflatten_heads(dq, head_dim, layout, names[0]), unflatten_heads(dk, head_dim, layout, names[1])
    flat = (None if vq is dq else q.shape, None if vk is dk else k.shape)
    if vq is not dq:
        q = q.reshape(vq.shape)
    if vk is not dk:
        k = k.reshape(vk.shape)
    dc, ds = split_cos_sin_cache(declared(cache), declared(cos), declared(sin), rotary_dim,
                                 head_dim_of(vq, head_dim, layout))

    def checked(offset_decl) -> Request:
        return _validated(names, vq, vk, dc, ds, cache, declared(positions), offset_decl, declared(cu_seqlens), layout,
                          interleaved, rotary_dim, rotary_offset, inverse)

    offsets = None
    if is_array(offset):
        # The number of sequences is settled by the checks (the layout's batch, or cu_seqlens):
        # a first pass without the offset learns it (None: no range to check), the second checks
        # the offset broadcast to one start per sequence.
        offsets = broadcast_offset(offset, _sequences(checked(None)))
        req = checked(declared(offsets))
    else:
        req = checked(offset)
    call = RopeCall(names=tuple(names), has_k=k is not None, layout=req.layout, interleaved=req.interleaved,
                    rotary_dim=req.rotary_dim, rotary_offset=req.rotary_offset, inverse=req.inverse,
                    combined=cache is not None, positions=positions is not None, offsets=offsets is not None,
                    cu_seqlens=cu_seqlens is not None, offset=req.offset, backend=backend, in_place=bool(in_place))
    tables = (cache,) if cache is not None else (cos, sin)
    return call, q, k, tables, (positions, offsets, cu_seqlens), flat


def check_cache(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, kv_layout, kv_cache_dtype, k_scale,
                v_scale, offset, cu_seqlens, interleaved, rotary_dim, backend, in_place) -> tuple:
    """One call of ``rope_and_cache`` checked.

    Returns ``(call, arrays)``: the :class:`CacheCall`, and the arrays as JAX arrays in the
    order the kernel's callback and the jnp reference take them: ``q, k, v, (cos, sin),
    (positions, offsets, cu_seqlens), slot_mapping, (k_cache, v_cache), (k_scale, v_scale)``
    (scales: float32 ``[1]``, None for caches of the input dtype)."""
    import jax.numpy as jnp

    check_backend(backend, in_place)
    check_cache_options(kv_layout, kv_cache_dtype)
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    cos, sin = as_array(cos, "cos"), as_array(sin, "sin")
    positions, cu_seqlens = as_array(positions, "positions"), as_array(cu_seqlens, "cu_seqlens")
    slots = as_array(slot_mapping, "slot_mapping")
    k_cache, v_cache = as_array(k_cache, "k_cache"), as_array(v_cache, "v_cache")
    scales = []
    for scale, name in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        if isinstance(scale, (int, float, np.integer, np.floating)) and not isinstance(scale, (bool, np.bool_)):
            scale = jnp.full((1,), scale, jnp.float32)  # a Python scale: a constant of the program
        scale = as_array(scale, name)
        if scale is not None and scale.ndim == 0:
            scale = scale.reshape(1)
        scales.append(scale)
    offset = offset_arg(offset)

    def checked(offset):
        arrays = [declared(a) for a in (q, k, v, cos, sin, positions, slots, k_cache, v_cache, *scales, cu_seqlens)]
        return validate_cache_call(*arrays[:9], kv_layout=kv_layout, kv_cache_dtype=kv_cache_dtype, k_scale=arrays[9],
                                   v_scale=arrays[10], cu_seqlens=arrays[11],
                                   offset=declared(offset) if is_array(offset) else offset, interleaved=interleaved,
                                   rotary_dim=rotary_dim, allow_desc=True)[0]

    offsets = None
    if is_array(offset):  # as in check_rope
        offsets = broadcast_offset(offset, _sequences(checked(None).rope))
        creq = checked(offsets)
    else:
        creq = checked(offset)
    req = creq.rope
    rope = RopeCall(names=("q", "k"), has_k=True, layout="thd", interleaved=req.interleaved,
                    rotary_dim=req.rotary_dim, rotary_offset=0, inverse=False, combined=False,
                    positions=positions is not None, offsets=offsets is not None, cu_seqlens=cu_seqlens is not None,
                    offset=req.offset, backend=backend, in_place=bool(in_place))
    call = CacheCall(rope=rope, kv_layout=kv_layout, kv_cache_dtype=kv_cache_dtype)
    return call, (q, k, v, (cos, sin), (positions, offsets, cu_seqlens), slots, (k_cache, v_cache), tuple(scales))
