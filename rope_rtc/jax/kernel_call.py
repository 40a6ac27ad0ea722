"""The kernels inside ``jax.jit``, through ``jax.experimental.buffer_callback`` (docs/jax.md says
why this route and what the others cost).

XLA runs the staged-out call as an FFI custom call whose handler takes the GIL and calls a Python
function with XLA's own device buffers and the stream of the computation: here the buffers become
CuPy arrays over the same memory (no copy) and the CuPy API's one-call function launches the
kernel on that stream (no synchronisation, no allocation: every output is a buffer XLA gave).
The result buffers alias q and k where the call rotates in place, and the caches always: a
donated (or no longer needed) input is then rotated where it lies, and the cache write never
copies the cache.

The buffers are valid only while the callback runs; nothing here keeps them (the one-call
functions keep none of their arrays either). The callback runs on the thread XLA executes the
computation from: on every execution, or, with ``COMMAND_BUFFER``, each time XLA records it
into a command buffer.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

from .checks import CacheCall, RopeCall

# What the callback asks of the CuPy API's one-call functions: the kernels. The CPU tests run the
# same callback through JAX's CPU backend, on host buffers, with "numpy".
CALLBACK_BACKEND = "nvrtc"
# buffer_callback's command_buffer_compatible: whether XLA may record the callback's launch into
# its command buffers (CUDA graphs), running the callback under stream capture once for each set
# of buffer addresses, and replay the recording without calling Python again. The callback's
# launch depends only on the buffers' addresses and the call's static arguments (positions and
# offsets are read on the GPU), so a replay is the launch the callback would make, without the
# Python call and its launch gap: what brings decode to XLA's own fusion (docs/jax.md;
# benchmarks/probes/jax_cost.py measures both ways). False: a Python call at every execution.
COMMAND_BUFFER = True
# How buffer_callback maps over a vmapped axis: one call per element, in a loop (the kernels
# take no extra batch axis).
VMAP_METHOD = "sequential"

_usable: list = []  # [why rope_rtc cannot launch kernels here, or None], once asked
_warned: list = []


def unusable_reason() -> str | None:
    """Why rope_rtc cannot launch kernels in this process (no CUDA driver or GPU, no CuPy), or
    None when it can (asked once)."""
    if not _usable:
        from ..core import driver
        from ..errors import ToolchainError

        reason = driver.unavailable_reason()
        if reason is None:
            try:
                driver.import_cupy()
            except ToolchainError as exc:
                reason = str(exc)
        _usable.append(reason)
    return _usable[0]


def require_kernels() -> None:
    """Raise why rope_rtc cannot launch kernels here, in the library's words:
    :class:`~rope_rtc.errors.NoDeviceError` (no driver or GPU) or
    :class:`~rope_rtc.errors.ToolchainError` (no CuPy), each naming the way out."""
    from ..core import driver

    driver.require_gpu()
    driver.import_cupy()


def warn_reference_once(reason: str) -> None:
    """One warning per process that ``backend="auto"`` stages out the jnp reference for CUDA too."""
    if not _warned:
        _warned.append(True)
        warnings.warn(f"rope_rtc.jax: backend='auto' runs the jnp reference, since rope_rtc cannot launch its kernels "
                      f"here: {reason}", RuntimeWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside rope_rtc and JAX (counted from the function
    that warns): a call traced inside ``jax.jit`` reaches the warning through JAX's frames, and
    the user's line is the one to name."""
    import jax

    import rope_rtc

    packages = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (rope_rtc, jax))
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(packages):
        frame, level = frame.f_back, level + 1
    return level


def launch_stream(ctx, device: int) -> int:
    """XLA's stream (the raw CUstream of the computation it is running: the launch goes there, in
    order with the work around it), with ``device`` made current on this thread: XLA calls back
    from a thread of its own, which need not have a CUDA context current, and the launch needs
    its device's (cudaSetDevice makes the device's primary context current, the one XLA uses)."""
    _cupy().cuda.runtime.setDevice(device)
    return ctx.stream


def device_array(buffer, device: int):
    """``(array, address)``: a CuPy array over an XLA buffer's memory (no copy), and its address.

    XLA's buffers are dense and row-major; their ``__cuda_array_interface__`` gives the address
    (no stream entry: nothing to wait for) and the buffer's ``dtype`` names bfloat16, which the
    interface's type string cannot."""
    cupy = _cupy()
    address = buffer.__cuda_array_interface__["data"][0]
    shape = tuple(buffer.shape)
    dtype = buffer.dtype
    memory = cupy.cuda.UnownedMemory(address, math.prod(shape) * dtype.itemsize, buffer, device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0)), address


_CUPY: list = []


def _cupy():
    if not _CUPY:
        import cupy

        _CUPY.append(cupy)
    return _CUPY[0]


def _arrays(ctx, order: tuple[str, ...], ins: tuple, outs: tuple, out_names: tuple[str, ...]) -> tuple:
    """``(inputs by name, outputs, stream)`` of one callback: each buffer as an array over its
    memory. Where XLA gave an output its input's buffer (aliased), the output is that very input
    array, which the CuPy API reads as in place."""
    device = ins[0].__dlpack_device__()[1]
    stream = launch_stream(ctx, device)
    arrays = {name: device_array(buffer, device) for name, buffer in zip(order, ins)}
    outputs = []
    for out, name in zip(outs, out_names):
        array, address = device_array(out, device)
        own = arrays.get(name)
        outputs.append(own[0] if own is not None and own[1] == address else array)
    return {name: value[0] for name, value in arrays.items()}, outputs, stream


def _rope_callback(call: RopeCall, order: tuple[str, ...]):
    """The buffer callback of one ``apply_rope(_qk)`` call: its inputs arrive in ``order``."""
    from ..ops import rope as ops_rope

    tensors = ("q", "k") if call.has_k else ("q",)
    static = dict(layout=call.layout, interleaved=call.interleaved, rotary_dim=call.rotary_dim,
                  rotary_offset=call.rotary_offset, inverse=call.inverse)

    def callback(ctx, outs, *ins) -> None:
        got, outputs, stream = _arrays(ctx, order, ins, outs, tensors)
        kw = dict(static, positions=got.get("positions"), cu_seqlens=got.get("cu_seqlens"),
                  offset=got["offsets"] if call.offsets else call.offset, stream=stream, backend=CALLBACK_BACKEND)
        if call.combined:
            kw["cos_sin_cache"] = got["cos_sin_cache"]
        else:
            kw["cos"], kw["sin"] = got["cos"], got["sin"]
        if call.has_k:
            ops_rope.apply_rope_qk(got["q"], got["k"], q_out=outputs[0], k_out=outputs[1], **kw)
        else:
            ops_rope.apply_rope(got["q"], out=outputs[0], **kw)

    return callback


def rope_order(call: RopeCall) -> tuple[str, ...]:
    """The names of a call's inputs, in the order the callback receives them."""
    names = ["q"] + (["k"] if call.has_k else [])
    names += ["cos_sin_cache"] if call.combined else ["cos", "sin"]
    names += [n for n, present in (("positions", call.positions), ("offsets", call.offsets),
                                   ("cu_seqlens", call.cu_seqlens)) if present]
    return tuple(names)


def _present(*groups) -> list:
    return [a for group in groups for a in group if a is not None]


def rope(call: RopeCall, q, k, tables: tuple, index: tuple):
    """``(q, k)`` rotated by the kernel (``k`` None for ``apply_rope``), staged out as one buffer
    callback."""
    import jax
    from jax.experimental.buffer_callback import buffer_callback

    inputs = _present((q, k), tables, index)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype),) + (
        (jax.ShapeDtypeStruct(k.shape, k.dtype),) if k is not None else ())
    aliases = {i: i for i in range(len(results))} if call.in_place else None
    run = buffer_callback(_rope_callback(call, rope_order(call)), results, vmap_method=VMAP_METHOD,
                          input_output_aliases=aliases, command_buffer_compatible=COMMAND_BUFFER)
    out = run(*inputs)
    return out[0], (out[1] if k is not None else None)


# rope_and_cache: the callback's inputs, in order (the scales and index arrays where present).
CACHE_ORDER = ("q", "k", "v", "cos", "sin", "positions", "offsets", "cu_seqlens", "slot_mapping", "k_cache", "v_cache",
               "k_scale", "v_scale")


def _cache_callback(call: CacheCall, order: tuple[str, ...]):
    from ..ops import kv_cache as ops_cache

    rope_call = call.rope
    static = dict(kv_layout=call.kv_layout, kv_cache_dtype=call.kv_cache_dtype, interleaved=rope_call.interleaved,
                  rotary_dim=rope_call.rotary_dim)

    def callback(ctx, outs, *ins) -> None:
        got, (q_out, k_out, k_cache, v_cache), stream = _arrays(ctx, order, ins, outs, ("q", "k", "k_cache", "v_cache"))
        if k_cache is not got["k_cache"] or v_cache is not got["v_cache"]:
            # The caches are always aliased: XLA gives their own buffers back (after a copy of
            # its own when the caller kept the input alive).
            raise RuntimeError("rope_rtc.jax: XLA gave the caches' results buffers of their own; the cache write "
                               "needs the caches' buffers (input_output_aliases)")
        ops_cache.rope_and_cache(got["q"], got["k"], got["v"], got["cos"], got["sin"], got.get("positions"),
                                 got["slot_mapping"], k_cache, v_cache, k_scale=got.get("k_scale"),
                                 v_scale=got.get("v_scale"), q_out=q_out, k_out=k_out,
                                 offset=got["offsets"] if rope_call.offsets else rope_call.offset,
                                 cu_seqlens=got.get("cu_seqlens"), stream=stream, backend=CALLBACK_BACKEND,
                                 **static)

    return callback


def rope_and_cache(call: CacheCall, q, k, v, tables: tuple, index: tuple, slots, caches: tuple, scales: tuple):
    """``(q, k, k_cache, v_cache)`` after the fused RoPE and cache write, staged out as one
    buffer callback whose cache results alias the caches."""
    import jax
    from jax.experimental.buffer_callback import buffer_callback

    named = dict(zip(CACHE_ORDER, (q, k, v, *tables, *index, slots, *caches, *scales)))
    order = tuple(name for name in CACHE_ORDER if named[name] is not None)
    position = {name: i for i, name in enumerate(order)}
    results = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, *caches))
    aliases = {position["k_cache"]: 2, position["v_cache"]: 3}
    if call.rope.in_place:
        aliases.update({position["q"]: 0, position["k"]: 1})
    run = buffer_callback(_cache_callback(call, order), results, vmap_method=VMAP_METHOD,
                          input_output_aliases=aliases, command_buffer_compatible=COMMAND_BUFFER)
    return tuple(run(*(named[name] for name in order)))
