"""Loading binaries onto devices once, and launching them with as little host work as possible.

The launch path does no disk access, no allocation on the device, no synchronisation and no
compilation. Arguments live in a pre-packed ctypes block whose fields are updated in place;
``cuLaunchKernel`` copies them at launch, so the block can be reused at once (also during CUDA
graph capture, which records the copied values).
"""

from __future__ import annotations

import ctypes
import threading

from . import driver
from .build import Binary, get_binary
from .registry import KernelSpec
from .toolchain import target_for


class ArgPack:
    """Kernel arguments in one ctypes struct plus the ``void*[]`` that points at its fields."""

    def __init__(self, ctypes_fields: list[tuple[str, type]]) -> None:
        cls = type("Args", (ctypes.Structure,), {"_fields_": ctypes_fields})
        self.values = cls()
        base = ctypes.addressof(self.values)
        self._ptrs = (ctypes.c_void_p * len(ctypes_fields))(
            *(base + getattr(cls, name).offset for name, _ in ctypes_fields)
        )
        self.address = ctypes.addressof(self._ptrs)


class StructArg:
    """A kernel whose single parameter is a by-value struct (``rope_apply``)."""

    def __init__(self, struct_type: type[ctypes.Structure]) -> None:
        self.values = struct_type()
        self._ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(self.values))
        self.address = ctypes.addressof(self._ptrs)


class LoadedKernel:
    """One spec's binary, loaded once per device, with its entry points' function handles."""

    def __init__(self, spec: KernelSpec, device: int, binary: Binary) -> None:
        self.spec = spec
        self.device = device
        self.binary = binary
        module = driver.load_module(device, binary.data)
        self._module = module  # keeps the module alive with the functions
        self.functions = {name: driver.get_function(module, name) for name in spec.entries}


_loaded: dict[tuple[str, int], LoadedKernel] = {}
_loaded_lock = threading.Lock()


def load_kernel(spec: KernelSpec, device: int) -> LoadedKernel:
    """Compile or fetch from the cache, load into ``device``'s primary context; once per device.

    Thread-safe: the table is guarded, and a second thread asking for the same kernel waits for
    the first instead of loading it twice.
    """
    ident = (spec.name, device)
    k = _loaded.get(ident)
    if k is not None:
        return k
    with _loaded_lock:
        k = _loaded.get(ident)
        if k is None:
            target = target_for(driver.device_arch(device), driver_version=driver.driver_version())
            k = LoadedKernel(spec, device, get_binary(spec, target))
            _loaded[ident] = k
        return k


def loaded_kernels() -> list[tuple[str, int]]:
    return sorted(_loaded)


def stream_handle(stream, device: int | None = None) -> int:
    """A raw CUstream from ``stream``.

    ``None``: CuPy's current stream (of ``device`` when given); a CuPy stream (``.ptr``); any
    object with ``__cuda_stream__`` (returns ``(version, handle)``); a PyTorch stream
    (``.cuda_stream``); or an integer handle.
    """
    if stream is None:
        import cupy

        return cupy.cuda.get_current_stream(-1 if device is None else device).ptr
    if isinstance(stream, int):
        return stream
    ptr = getattr(stream, "ptr", None)
    if isinstance(ptr, int):
        return ptr
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        return int(value[1])
    raw = getattr(stream, "cuda_stream", None)
    if isinstance(raw, int):
        return raw
    raise TypeError(
        f"stream: expected None, an int handle, a CuPy stream or an object with __cuda_stream__, got {type(stream).__name__}"
    )


# Argument sets a plan (RopePlan, TailRoPEForward) remembers by identity.
RECENT_SETS = 16


def remember(recent: dict, key, value) -> None:
    """Store ``key`` in a plan's bounded identity cache, dropping the oldest entry when it is full."""
    if len(recent) >= RECENT_SETS:
        del recent[next(iter(recent))]
    recent[key] = value


class Launcher:
    """The hot path: one ``cuLaunchKernel`` with pre-packed arguments and a memoised stream object.

    ``prefix`` is the prepared ``(function, gx, gy, gz, bx, by, bz, shared_bytes)`` of a plan, so a
    call is one tuple splice and the driver call; the status is checked on every launch.
    """

    __slots__ = ("_launch", "_stream_handle", "_stream_obj", "_CUstream", "args_address", "device", "_get_device")

    def __init__(self, args_address: int, device: int | None = None) -> None:
        from cuda.bindings import driver as drv

        self._launch = drv.cuLaunchKernel
        self._CUstream = drv.CUstream
        self._stream_handle = None
        self._stream_obj = None
        self.args_address = args_address
        self.device = device
        if device is not None:
            import cupy

            self._get_device = cupy.cuda.runtime.getDevice

    def __call__(self, prefix: tuple, stream: int) -> None:
        if self.device is not None and self._get_device() != self.device:
            # A plan stays on its device when the caller's current device changes: launch in
            # the plan device's context (the stream must belong to that device too).
            with driver.in_context(self.device):
                self._launch_here(prefix, stream)
            return
        self._launch_here(prefix, stream)

    def _launch_here(self, prefix: tuple, stream: int) -> None:
        if stream != self._stream_handle:
            self._stream_obj = self._CUstream(stream)
            self._stream_handle = stream
        status = self._launch(*prefix, self._stream_obj, self.args_address, 0)[0]
        if status:
            driver.check((status,), f"cuLaunchKernel(grid={prefix[1:4]}, block={prefix[4:7]}, stream={stream:#x})")


def launch_prefix(function, grid: tuple[int, int, int], block: tuple[int, int, int]) -> tuple:
    return (function, grid[0], grid[1], grid[2], block[0], block[1], block[2], 0)


def launch(function, grid: tuple[int, int, int], block: tuple[int, int, int], stream: int, args_address: int) -> None:
    """Launch once (one-call APIs; plans keep a :class:`Launcher`)."""
    Launcher(args_address)(launch_prefix(function, grid, block), stream)
