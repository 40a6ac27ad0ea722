"""The CUDA driver, through cuda-python's bindings: status checks, devices, modules.

Imported lazily by everything that needs a GPU; ``import rope_rtc`` never loads libcuda.
:func:`unavailable_reason` says why there is no usable GPU in words a user can act on,
:func:`require_gpu` turns that into an error, :func:`import_cupy` names the package to
install when CuPy is missing, and :func:`device_cupy` is CuPy for work on a device, after
:func:`require_gpu` (CuPy itself says only "CUDA driver version is insufficient" when there is
no driver at all).

Reasons and messages never nest one parenthetical in another: a reason that quotes a
:class:`CudaError` (whose text ends in the driver's words in parentheses) joins it with "; ".
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

from ..build.toolchain import install_hint
from ..errors import CudaError, NoDeviceError, ToolchainError

# The driver library the dynamic loader must find; the CUDA toolkit's libcuda.so is only a stub.
LIBCUDA = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
NO_DRIVER = "no CUDA driver found"


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
_init_error: list[CudaError] = []
_initialised = False


def _libcuda_load_error() -> str | None:
    """Why the dynamic loader cannot open the driver library, or None when it can."""
    try:
        ctypes.CDLL(LIBCUDA)
    except OSError as exc:
        return str(exc) or f"{LIBCUDA} cannot be loaded"
    return None


def _driver_major(drv) -> int | None:
    """The CUDA major version the installed driver supports (cuDriverGetVersion needs no cuInit)."""
    try:
        status, version = drv.cuDriverGetVersion()
    except Exception:  # a courtesy for the message
        return None
    return int(version) // 1000 if int(status) == 0 and int(version) > 0 else None


def _explain(exc: CudaError, drv) -> str:
    """cuInit's failure in words a user can act on; the CUresult name stays in the text."""
    if exc.name == "CUDA_ERROR_STUB_LIBRARY":
        return f"{NO_DRIVER}: the CUDA toolkit's stub driver library was loaded instead of a driver; {exc}"
    if exc.name == "CUDA_ERROR_NO_DEVICE":
        return f"no CUDA device found; {exc}"
    if exc.name == "CUDA_ERROR_INSUFFICIENT_DRIVER":
        missing = _libcuda_load_error()
        if missing is not None:  # what a runtime reports when there is no driver at all
            return f"{NO_DRIVER} ({missing})"
        return (f"the CUDA driver is older than this toolchain needs; {exc}; upgrade the driver, or install the "
                f"toolchain of the driver's CUDA version: {install_hint(_driver_major(drv))}")
    return str(exc)


def _init_failure() -> CudaError | None:
    try:
        drv = _drv()
    except ImportError as exc:
        return CudaError(f"cuda-bindings is not installed ({exc}): {install_hint()}",
                         name="CUDA_ERROR_NOT_INITIALIZED", code=3)
    try:
        check(drv.cuInit(0), "cuInit")
    except CudaError as exc:
        return CudaError(_explain(exc, drv), name=exc.name, code=exc.code)
    except Exception as exc:  # the bindings could not load the driver library
        missing = _libcuda_load_error()
        if missing is not None:
            return CudaError(f"{NO_DRIVER} ({missing})", name="CUDA_ERROR_NO_DEVICE", code=100)
        return CudaError(f"cuda-bindings could not load the CUDA driver ({type(exc).__name__}: {exc})",
                         name="CUDA_ERROR_NOT_INITIALIZED", code=3)
    return None


def init() -> None:
    """cuInit once; raises :class:`CudaError` (with the reason) when there is no usable driver."""
    global _initialised
    if _initialised:
        return
    with _init_lock:
        if _initialised:
            return
        if not _init_error:
            failure = _init_failure()
            if failure is None:
                _initialised = True
                return
            _init_error.append(failure)
        first = _init_error[0]
        raise CudaError(str(first), name=first.name, code=first.code)


def available() -> bool:
    try:
        init()
        return device_count() > 0
    except CudaError:
        return False


def unavailable_reason() -> str | None:
    """Why no CUDA device can be used here, or None when one can: ``"no CUDA driver found"`` and
    the loader's words in parentheses, ``"no CUDA device found"``, ... Quote it after a colon,
    never inside parentheses (it may end in a parenthetical of its own)."""
    try:
        init()
        count = device_count()
    except CudaError as exc:
        return str(exc)
    return None if count > 0 else "no CUDA device found"


_gpu_found = False  # once a device has been found, require_gpu asks the driver no more


def require_gpu() -> None:
    """Return when a CUDA device is usable; else raise :class:`NoDeviceError` with the reason and
    what to do about it. Once a device has been found, returns at once."""
    global _gpu_found
    if _gpu_found:
        return
    reason = unavailable_reason()
    if reason is None:
        _gpu_found = True
        return
    way = ("install the NVIDIA driver (nvidia-smi then lists the GPU)" if reason.startswith(NO_DRIVER)
           else "run on a machine with an NVIDIA GPU and its driver")
    raise NoDeviceError(f"no usable CUDA GPU: {reason}; {way}, or use backend='numpy', the NumPy reference "
                        "on host arrays (every one-call function takes it; plans need a GPU)")


def device_cupy():
    """The ``cupy`` module for work on a device (its streams, devices and allocations): raises
    :class:`NoDeviceError` first when no GPU is usable, where CuPy would say only "CUDA driver
    version is insufficient"; :func:`import_cupy`'s error when CuPy is missing."""
    require_gpu()
    return import_cupy()


def current_device() -> int:
    """CuPy's current device ordinal, the device a plan without arrays of its own runs on."""
    return int(device_cupy().cuda.runtime.getDevice())


def import_cupy():
    """The ``cupy`` module; a :class:`ToolchainError` naming the extra to install when it is missing."""
    try:
        import cupy
    except ImportError as exc:
        major = None
        if available():
            try:
                major = driver_version() // 1000
            except CudaError:
                pass
        message = f"the GPU backend needs CuPy, which is not importable ({exc}): {install_hint(major)}"
        raise ToolchainError(message) from exc
    return cupy


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
