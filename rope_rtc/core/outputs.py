"""The outputs a one-call function allocates: from CuPy's current allocator without
``cupy.empty``'s Python layer, on the caller's device and stream (:func:`allocate`)."""

from __future__ import annotations

import math

from . import driver
from .launcher import cupy_stream, single_device


def allocate(shape: tuple, dtype, device: int, stream: int, current: bool = False):
    """A C-contiguous CuPy array on ``device`` for an output that a one-call function allocates,
    from the current allocator, in the order of raw stream ``stream`` (CuPy's pool reuses memory
    in the order of the stream it was allocated on). ``current``: ``stream`` is the current stream
    of ``device`` (the caller passed no stream); with one visible device that is the common case,
    and CuPy's own defaults already say it."""
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


def release_outputs() -> None:
    """Nothing to drop: every output a one-call function allocates comes from CuPy's allocator and
    goes back to it when the caller lets it go. Kept so that code calling it keeps working."""


# (cupy.ndarray, cupy.cuda.get_allocator, cupy.empty), once CuPy is imported
_EMPTY: list = []


def _import_empty() -> None:
    cupy = driver.device_cupy()

    _EMPTY.append((cupy.ndarray, cupy.cuda.get_allocator, cupy.empty))


def empty(shape: tuple, dtype):
    """``cupy.empty(shape, dtype)`` on the current device and stream, from the current allocator
    (``cupy.cuda.get_allocator()``: the default pool, or what the caller set with
    ``cupy.cuda.set_allocator`` / ``using_allocator``), without ``cupy.empty``'s Python layer:
    the allocator's memory wrapped as a C-contiguous array, cheaper on the host than
    ``cupy.empty``; an empty shape takes ``cupy.empty`` itself."""
    if not _EMPTY:
        _import_empty()
    nd, get_allocator, cupy_empty = _EMPTY[0]
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return cupy_empty(shape, dtype)
    return nd(shape, dtype, get_allocator()(nbytes))
