"""The CUDA driver, through cuda-python's bindings: status checks, devices, modules.

Imported lazily by everything that needs a GPU; ``import rope_rtc`` never loads libcuda.
"""

from __future__ import annotations

import functools
import threading

from .errors import CudaError


def _drv():
    from cuda.bindings import driver

    return driver


def _name(status) -> str:
    return getattr(status, "name", None) or f"CUresult({int(status)})"


def check(result, what: str):
    """Unpack a driver call's (status, values...) tuple, raising :class:`CudaError` on failure."""
    status = result[0]
    if int(status) != 0:
        drv = _drv()
        try:
            _, text = drv.cuGetErrorString(status)
            text = text.decode(errors="replace") if text else ""
        except Exception:  # the error string is a courtesy; the name is what matters
            text = ""
        raise CudaError(f"{what} failed: {_name(status)}{f' ({text})' if text else ''}",
                        name=_name(status), code=int(status))
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


_init_lock = threading.Lock()
_init_error: list[str] = []
_initialised = False


def init() -> None:
    """cuInit once; raises :class:`CudaError` (with the reason) when there is no usable driver."""
    global _initialised
    if _initialised:
        return
    with _init_lock:
        if _initialised:
            return
        if _init_error:
            raise CudaError(_init_error[0], name="CUDA_ERROR_NO_DEVICE", code=100)
        try:
            check(_drv().cuInit(0), "cuInit")
        except CudaError as exc:
            _init_error.append(str(exc))
            raise
        except Exception as exc:  # libcuda not found: a machine without the NVIDIA driver
            _init_error.append(f"no CUDA driver: {exc}")
            raise CudaError(_init_error[0], name="CUDA_ERROR_NO_DEVICE", code=100) from None
        _initialised = True


def available() -> bool:
    try:
        init()
        return device_count() > 0
    except CudaError:
        return False


def unavailable_reason() -> str | None:
    try:
        init()
    except CudaError as exc:
        return str(exc)
    return None if device_count() > 0 else "no CUDA device"


def device_count() -> int:
    init()
    return int(check(_drv().cuDeviceGetCount(), "cuDeviceGetCount"))


def driver_version() -> int:
    init()
    return int(check(_drv().cuDriverGetVersion(), "cuDriverGetVersion"))


@functools.lru_cache(maxsize=None)
def _device(ordinal: int):
    init()
    return check(_drv().cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")


@functools.lru_cache(maxsize=None)
def device_arch(ordinal: int) -> int:
    """Compute capability as an integer, e.g. 90 for sm_90."""
    drv = _drv()
    dev = _device(ordinal)
    a = drv.CUdevice_attribute
    major = check(drv.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute")
    minor = check(drv.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute")
    return int(major) * 10 + int(minor)


@functools.lru_cache(maxsize=None)
def device_attribute(ordinal: int, name: str) -> int:
    drv = _drv()
    attr = getattr(drv.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    return int(check(drv.cuDeviceGetAttribute(attr, _device(ordinal)), f"cuDeviceGetAttribute({name})"))


def device_name(ordinal: int) -> str:
    raw = check(_drv().cuDeviceGetName(256, _device(ordinal)), "cuDeviceGetName")
    return raw.split(b"\x00", 1)[0].decode(errors="replace")


@functools.lru_cache(maxsize=None)
def primary_context(ordinal: int):
    """The device's primary context (the one CuPy's runtime calls use), retained for the process."""
    return check(_drv().cuDevicePrimaryCtxRetain(_device(ordinal)), f"cuDevicePrimaryCtxRetain({ordinal})")


class in_context:
    """Make ``ordinal``'s primary context current for a block (module loads, cross-device launches)."""

    def __init__(self, ordinal: int) -> None:
        self.ctx = primary_context(ordinal)

    def __enter__(self):
        check(_drv().cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        return self

    def __exit__(self, *exc):
        check(_drv().cuCtxPopCurrent(), "cuCtxPopCurrent")
        return False


class relaxed_capture:
    """This thread's stream-capture interaction mode set to relaxed for a block.

    Instantiating and destroying a graph are "potentially unsafe" calls: while any stream of
    this thread is being captured in global mode they fail, and the failure invalidates that
    capture. Relaxed mode permits them; they touch no captured stream.
    """

    def __enter__(self):
        drv = _drv()
        self.old = check(drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
                         "cuThreadExchangeStreamCaptureMode")
        return self

    def __exit__(self, *exc):
        check(_drv().cuThreadExchangeStreamCaptureMode(self.old), "cuThreadExchangeStreamCaptureMode")
        return False


def load_module(ordinal: int, image: bytes):
    with in_context(ordinal):
        return check(_drv().cuModuleLoadData(image), f"cuModuleLoadData on device {ordinal}")


def get_function(module, name: str):
    return check(_drv().cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
