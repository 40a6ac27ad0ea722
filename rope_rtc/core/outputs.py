"""The outputs a one-call function allocates: from CuPy's current allocator without
``cupy.empty``'s Python layer, on the caller's device and stream, and, for small outputs from the
default pool, recycled once nothing but this module holds them (:func:`allocate`)."""

from __future__ import annotations

import math
import sys
import threading
import weakref

from . import driver
from .launcher import cupy_stream, single_device
from .recent import remember


def allocate(shape: tuple, dtype, device: int, stream: int, current: bool = False):
    """A C-contiguous CuPy array on ``device`` for an output that a one-call function allocates,
    in the order of raw stream ``stream`` (CuPy's pool reuses memory in the order of the stream it
    was allocated on). ``current``: ``stream`` is the current stream of ``device`` (the caller
    passed no stream); with one visible device that is the common case, and CuPy's own defaults
    already say it.

    Small outputs from CuPy's default memory pool are recycled: the thread keeps the last outputs
    of each (shape, dtype, device, stream), and an output whose array, memory pointer and memory
    nothing but this cache references (no view, no alias made from its pointer, no weak
    reference) is handed out again instead of a new one. That is the reuse the pool would make of
    the same memory once it is freed (in the order of the same stream), without the pool's
    allocation, array construction and free, a large share of an allocating call's host time
    (``benchmarks/probes/one_call_cost.py`` times ``cupy.empty``). The default pool lives as long
    as the process, so a kept output's
    memory stays valid; under any other allocator (``set_allocator``, ``using_allocator``: a pool
    of the caller's that may be freed, or plain ``cudaMalloc``) nothing is kept.
    :func:`release_outputs` drops the calling thread's."""
    if not _EMPTY:
        _import_empty()
    _, get_allocator, _, default_pool = _EMPTY[0]
    # The thread's last key first (an engine allocates one signature's outputs call after call):
    # hashing a key with a dtype in it is a good part of a recycled output's cost.
    last = getattr(_recycled, "last", _NO_KEY)
    if (shape == last.shape and dtype is last.dtype and device == last.device and stream == last.stream
            and _FREE is not None):
        slot = last.slot
    else:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > RECYCLE_BYTES or not nbytes or _FREE is None:
            return _new_array(shape, dtype, device, stream, current)
        slot = None
    if getattr(get_allocator(), "__self__", None) is not default_pool:
        return _new_array(shape, dtype, device, stream, current)
    if slot is None:
        key = (shape, dtype, device, stream)
        try:
            kept = _recycled.by_key
        except AttributeError:
            kept = _recycled.by_key = {}
        slot = kept.get(key)
        if slot is None:
            arr = _new_array(shape, dtype, device, stream, current)
            remember(kept, key, [arr], RECYCLE_KEYS)
            _recycled.last = _LastKey(shape, dtype, device, stream, kept[key])
            return arr
        _recycled.last = _LastKey(shape, dtype, device, stream, slot)
    i = _idle(slot, _FREE)
    while i >= 0:
        arr = slot[i]
        # The caller may have reshaped it in place (``a.shape = ...``) before letting it go:
        # dropped by position (``list.remove`` would compare arrays with ``==``, elementwise).
        if arr.shape == shape and arr._c_contiguous and (arr.dtype is dtype or arr.dtype == dtype):
            return arr
        del slot[i], arr
        i = _idle(slot, _FREE)
    arr = _new_array(shape, dtype, device, stream, current)
    if len(slot) >= RECYCLE_PER_KEY:
        del slot[0]
    slot.append(arr)
    return arr


# Outputs of at most this many bytes are recycled (``allocate``): the sizes whose GPU time is
# shorter than the host time an allocation costs. Each thread keeps at most RECYCLE_PER_KEY
# outputs for each of RECYCLE_KEYS signatures: 32 MiB at most.
RECYCLE_BYTES = 1 << 20
RECYCLE_KEYS = 8
# A loop that rebinds its results (``q, k = apply_rope_qk(...)``) still holds the last call's
# outputs when it makes the next call; q_out and k_out of equal shapes share a key: four.
RECYCLE_PER_KEY = 4
_recycled = threading.local()


class _LastKey:
    """A thread's last recycling key and its slot (the list of outputs kept for it)."""

    __slots__ = ("shape", "dtype", "device", "stream", "slot")

    def __init__(self, shape, dtype, device, stream, slot) -> None:
        self.shape, self.dtype, self.device, self.stream, self.slot = shape, dtype, device, stream, slot


# Before a thread's first key: no key.
_NO_KEY = _LastKey(None, None, None, None, None)


def release_outputs() -> None:
    """Drop the outputs the calling thread keeps for recycling (see :func:`allocate`), so that
    their memory goes back to CuPy's pool once nothing else references them."""
    _recycled.__dict__.clear()


def _idle(slot: list, free: tuple | None):
    """The position in ``slot`` of the first array that nothing but ``slot`` references, or -1.

    ``free`` is the reference counts of such an array, its memory pointer and its memory, and
    its weak references, as read here (measured once on this interpreter through this same
    function: ``_calibrate``); None returns the first array's counts instead."""
    for i in range(len(slot)):
        arr = slot[i]
        # What keeps an output's memory in use is any of these: a view holds the array, an alias
        # built on ``a.data`` (``as_strided``) the pointer, a pointer offset from it the memory.
        data = arr.data
        counts = _getrefcount(arr), _getrefcount(data), _getrefcount(data.mem), _getweakrefcount(arr)
        if free is None:
            return counts
        if counts == free:
            return i
    return -1


def _calibrate() -> tuple | None:
    """``_idle``'s counts of an array that only its slot holds, or None (no recycling) where
    reference counts cannot say that: a free-threaded build, or an interpreter on which an array,
    pointer or memory that something else still holds would pass for free."""
    import sysconfig

    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None

    class Probe:
        pass

    def probe():
        arr, arr.data, arr.data.mem = Probe(), Probe(), Probe()
        return arr

    slot = [probe()]
    free = _idle(slot, None)
    for hold in (lambda a: a, lambda a: a.data, lambda a: a.data.mem, weakref.ref):
        held = hold(slot[0])
        if _idle(slot, free) >= 0:
            return None
        del held
    return free if _idle(slot, free) == 0 else None


_getrefcount = sys.getrefcount
_getweakrefcount = weakref.getweakrefcount
_FREE = _calibrate()


def _new_array(shape: tuple, dtype, device: int, stream: int, current: bool):
    if current and single_device():
        return empty(shape, dtype)
    import cupy

    if cupy.cuda.runtime.getDevice() == device and stream == cupy.cuda.get_current_stream().ptr:
        return empty(shape, dtype)  # the current device and stream, without switching either
    with cupy.cuda.Device(device):
        if stream == cupy.cuda.get_current_stream().ptr:
            return empty(shape, dtype)
        with cupy_stream(stream):
            return empty(shape, dtype)


# (cupy.ndarray, cupy.cuda.get_allocator, cupy.empty, CuPy's default memory pool), once CuPy is imported
_EMPTY: list = []


def _import_empty() -> None:
    cupy = driver.device_cupy()

    _EMPTY.append((cupy.ndarray, cupy.cuda.get_allocator, cupy.empty, cupy.get_default_memory_pool()))


def empty(shape: tuple, dtype):
    """``cupy.empty(shape, dtype)`` on the current device and stream, from the current allocator
    (``cupy.cuda.get_allocator()``: the default pool, or what the caller set with
    ``cupy.cuda.set_allocator`` / ``using_allocator``), without ``cupy.empty``'s Python layer:
    the allocator's memory wrapped as a C-contiguous array, cheaper on the host than
    ``cupy.empty``; an empty shape takes ``cupy.empty`` itself."""
    if not _EMPTY:
        _import_empty()
    nd, get_allocator, cupy_empty, _ = _EMPTY[0]
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return cupy_empty(shape, dtype)
    return nd(shape, dtype, get_allocator()(nbytes))
