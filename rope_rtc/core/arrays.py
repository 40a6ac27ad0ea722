"""Accepting arrays, and every check made on them. Validation lives here and only here.

Accepted: CuPy arrays; NumPy arrays (host; the API decides whether to stage them); anything
with ``__dlpack__`` (PyTorch, JAX; preferred when an object offers both protocols, because
PyTorch's ``__cuda_array_interface__`` describes bfloat16 as an ambiguous ``<V2``); anything
with ``__cuda_array_interface__``. No framework is imported here; CuPy only when an object
must be wrapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .descriptors import TensorDesc, bind_device
# The dtype names stay importable from here too (arrays.dtype_name, arrays.BFLOAT16, ...).
from ..errors import UnsupportedLayoutError, one_of
from .dtypes import BFLOAT16, FLOAT_DTYPES, INDEX_DTYPES, dtype_name, numpy_dtype  # noqa: F401

# The widest global access; tail RoPE requires it of every non-empty array (seed contract).
ALIGN_BYTES = 16
INT32_MAX = 2**31 - 1


@dataclass
class ArrayInfo:
    """What the checks and kernels need to know of one array, in elements."""

    name: str
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str
    itemsize: int
    device: int | None  # None: host memory
    readonly: bool
    array: object  # the object to hand back to the caller (CuPy view, NumPy array, or the original)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def byte_extent(self) -> tuple[int, int]:
        """[lo, hi) bytes touched; (ptr, ptr) when empty."""
        if self.size == 0:
            return self.ptr, self.ptr
        lo = hi = 0
        for d, s in zip(self.shape, self.strides):
            if s >= 0:
                hi += (d - 1) * s
            else:
                lo += (d - 1) * s
        return self.ptr + lo * self.itemsize, self.ptr + (hi + 1) * self.itemsize

    def is_c_contiguous(self) -> bool:
        if self.size == 0:  # no elements, no layout: NumPy and CuPy give empty arrays zero strides
            return True
        expected = 1
        for d, s in zip(reversed(self.shape), reversed(self.strides)):
            if d != 1 and s != expected:
                return False
            expected *= d
        return True


_DTYPES: dict = {}


def _resolve_dtype(dtype, name: str) -> tuple[str, int]:
    known = _DTYPES.get(dtype)
    if known is not None:
        return known
    resolved = _resolve_dtype_uncached(dtype, name)
    if isinstance(dtype, np.dtype):
        _DTYPES[dtype] = resolved
    return resolved


def _resolve_dtype_uncached(dtype, name: str) -> tuple[str, int]:
    dt = np.dtype(dtype)
    if BFLOAT16 is not None and dt == BFLOAT16:
        return "bfloat16", 2
    if not dt.isnative:
        # The kernels and the references read native-order values; a byte-swapped array would
        # be rotated as garbage (or rejected after a first output was written).
        raise TypeError(f"{name}: dtype {dt.str} is in non-native byte order; pass "
                        f"{name}.astype({name}.dtype.newbyteorder('='))")
    if issubclass(dt.type, np.void):  # ml_dtypes' types (float8_e4m3fn, int4, ...) are named, not void
        raise TypeError(
            f"{name}: dtype {dt.str} is an unnamed {dt.itemsize}-byte type (PyTorch reports bfloat16 this way through "
            "__cuda_array_interface__); pass the tensor through DLPack instead (any object with __dlpack__ "
            "works, or cupy.from_dlpack(tensor))"
        )
    return dtype_name(dt), dt.itemsize


def _requires_grad(obj, name: str) -> None:
    if getattr(obj, "requires_grad", False) is True:
        raise TypeError(
            f"{name} requires grad: rope_rtc is a forward-only API with no autograd; pass tensor.detach() "
            "only if you handle differentiation yourself"
        )


def _cupy_device_of(ptr: int) -> int | None:
    """The device ordinal owning a device pointer, or None when no driver can say."""
    try:
        from . import driver

        driver.init()
        from cuda.bindings import driver as drv

        ordinal = driver.check(
            drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
            "cuPointerGetAttribute",
        )
        return int(ordinal)
    except Exception:
        return None


KDL_CPU, KDL_DEVICE = 1, (2, 13)  # DLPack device types: the host; CUDA and CUDA managed memory


def dlpack_device_type(obj) -> int | None:
    """The DLPack device type of ``obj`` (``KDL_CPU``, one of ``KDL_DEVICE``, ...), or None when it
    has no DLPack; asks nothing of CuPy."""
    if not (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        return None
    return int(obj.__dlpack_device__()[0])


def describe(obj, name: str, *, allow_host: bool = True) -> ArrayInfo:
    """An :class:`ArrayInfo` for ``obj``; ``TypeError`` naming ``name`` for anything else."""
    if obj is None:
        raise TypeError(f"{name}: expected an array, got None")
    if isinstance(obj, TensorDesc):
        # A declaration: no address yet (ptr 0); pointer checks wait for the arrays of execute().
        return ArrayInfo(name, 0, obj.shape, obj.strides, *_resolve_dtype(obj.dtype, name), obj.device, False, obj)
    mod = type(obj).__module__
    if mod.startswith("cupy"):
        return _from_cupy(obj, name)
    if isinstance(obj, np.ndarray):
        if not allow_host:
            raise TypeError(f"{name}: a NumPy (host) array is not accepted here; pass a CuPy/device array, or every "
                            "array on the host to a one-call function (backend='numpy' computes on the CPU)")
        dt, size = _resolve_dtype(obj.dtype, name)
        return ArrayInfo(name, obj.__array_interface__["data"][0], tuple(obj.shape),
                         _element_strides(obj.strides, size, name), dt, size, None, not obj.flags.writeable, obj)
    _requires_grad(obj, name)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev_type, dev_id = obj.__dlpack_device__()
        if int(dev_type) in KDL_DEVICE:
            from .driver import import_cupy  # a missing CuPy: the ToolchainError naming the extra

            return _from_cupy(import_cupy().from_dlpack(obj), name)
        if int(dev_type) == KDL_CPU:
            if not allow_host:
                raise TypeError(f"{name}: a host (CPU) array is not accepted here; pass a device array, or every "
                                "array on the host to a one-call function (backend='numpy' computes on the CPU)")
            try:
                view = np.from_dlpack(obj)
            except (BufferError, RuntimeError, TypeError, ValueError) as exc:  # a dtype NumPy has not (bfloat16)
                hint = ("; for a bfloat16 CPU tensor pass its bits as an ml_dtypes.bfloat16 NumPy array (for torch: "
                        "t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)), or the tensor on the GPU"
                        if "dtype" in str(exc).lower() else "; pass a NumPy array, or the tensor on the GPU")
                raise TypeError(f"{name}: NumPy cannot read this host array through DLPack ({exc}){hint}") from None
            return describe(view, name, allow_host=allow_host)
        raise TypeError(f"{name}: DLPack device type {dev_type} is not a CUDA device")
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cai(obj, cai, name)
    raise TypeError(
        f"{name}: expected a CuPy or NumPy array, or an object with __dlpack__ or __cuda_array_interface__, "
        f"got {type(obj).__name__}"
    )


def _from_cupy(a, name: str) -> ArrayInfo:
    dt, size = _resolve_dtype(a.dtype, name)
    mem = a.data
    return ArrayInfo(name, mem.ptr, a.shape, _element_strides(a.strides, size, name), dt, size, mem.device_id, False, a)


def _element_strides(byte_strides, size: int, name: str) -> tuple[int, ...]:
    """Byte strides in elements; ValueError when one is not a whole number of elements (NumPy and
    CuPy build such views, ``as_strided``): no kernel addresses them, and the overlap checks
    count whole elements."""
    if any(int(s) % size for s in byte_strides):
        raise ValueError(f"{name}: strides {tuple(byte_strides)} (bytes) are not multiples of the item size {size}")
    return tuple(int(s) // size for s in byte_strides)


def _from_cai(obj, cai: dict, name: str) -> ArrayInfo:
    try:
        shape = tuple(int(d) for d in cai["shape"])
        dt, size = _resolve_dtype(cai["typestr"], name)
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, TypeError) and "DLPack" in str(exc):
            raise
        raise TypeError(f"{name}: malformed __cuda_array_interface__ ({exc})") from None
    if cai.get("mask") is not None:
        raise TypeError(f"{name}: masked arrays are not supported")
    strides = cai.get("strides")
    if strides is None:
        el, acc = [], 1
        for d in reversed(shape):
            el.append(acc)
            acc *= d
        estrides = tuple(reversed(el))
    else:
        if len(strides) != len(shape):
            raise TypeError(f"{name}: malformed __cuda_array_interface__ (strides {tuple(strides)} for shape {shape})")
        estrides = _element_strides(strides, size, name)
    ptr = int(ptr or 0)
    device = _cupy_device_of(ptr) if ptr else None
    if device is None:
        # The interface describes device memory by definition; when the driver cannot name the
        # device (an empty array's null pointer, no driver) it is the current one, never "host".
        device = bind_device(None)
    return ArrayInfo(name, ptr, shape, estrides, dt, size, device, bool(readonly), obj)


# ---------------------------------------------------------------------------------------------
# checks: each raises TypeError/ValueError naming the argument, before anything is launched

def check_holds_memory(info: ArrayInfo) -> None:
    """A TensorDesc declares an array but holds no memory: launching with it would use address 0."""
    if isinstance(info.array, TensorDesc):
        raise TypeError(f"{info.name}: a TensorDesc declares an array but holds none; pass arrays here "
                        "(declarations build a RopePlan or a TailRoPEForward)")


def check_dtype(info: ArrayInfo, allowed: tuple[str, ...], what: str = "") -> None:
    if info.dtype not in allowed:
        raise TypeError(f"{info.name}: dtype {info.dtype} is not supported{what}; expected {one_of(allowed)}")


def check_ndim(info: ArrayInfo, ndims: tuple[int, ...], meaning: str) -> None:
    if len(info.shape) not in ndims:
        raise ValueError(f"{info.name}: expected {meaning}, got shape {info.shape}")


def check_last_dim_contiguous(info: ArrayInfo, hint: str = "") -> None:
    if not info.shape:
        raise ValueError(f"{info.name}: expected an array with at least one dimension, got a 0-d array")
    if info.size and info.shape[-1] > 1 and info.strides[-1] != 1:
        raise UnsupportedLayoutError(
            f"{info.name}: the last dimension must be contiguous (stride 1 element), got strides {info.strides} "
            f"in elements{hint or '; pass a copy made with .copy() or ascontiguousarray()'}"
        )


def check_contiguous(info: ArrayInfo, what: str = "must be C-contiguous") -> None:
    if not info.is_c_contiguous():
        raise UnsupportedLayoutError(f"{info.name}: {what}, got shape {info.shape} with strides {info.strides} "
                                     "elements; pass a contiguous copy")


def check_aligned(info: ArrayInfo, nbytes: int = ALIGN_BYTES) -> None:
    if info.size and info.ptr % nbytes:
        raise ValueError(f"{info.name}: data pointer {info.ptr:#x} is not {nbytes}-byte aligned; pass a fresh "
                         "allocation or a copy, which are")


def check_writable(info: ArrayInfo) -> None:
    if info.readonly:
        raise ValueError(f"{info.name}: is read-only and cannot receive the output")


def check_same_device(infos: list[ArrayInfo], device: int | None = None) -> int | None:
    """All device arrays on one device (``device`` when given); returns it."""
    known = [(i.name, i.device) for i in infos if i.device is not None]
    want = device if device is not None else (known[0][1] if known else None)
    for nm, dev in known:
        if dev != want:
            first = f"the plan's device {want}" if device is not None else f"{known[0][0]} (device {want})"
            raise ValueError(f"{nm} is on device {dev} but {first}: move it with cupy.asarray under "
                             f"cupy.cuda.Device({want})")
    return want


def _as_address_array(info: ArrayInfo) -> np.ndarray:
    # A NumPy view that only describes addresses: np.shares_memory solves the overlap problem
    # on bounds and strides without reading memory, which is what makes it usable on device
    # pointers.
    class _Addr:
        __array_interface__ = {
            "data": (info.ptr, True),
            "shape": info.shape,
            "strides": tuple(s * info.itemsize for s in info.strides),
            "typestr": f"|V{info.itemsize}",
            "version": 3,
        }

    return np.asarray(_Addr())


def _is_declaration(info: ArrayInfo) -> bool:
    return isinstance(info.array, TensorDesc)


def overlaps(a: ArrayInfo, b: ArrayInfo) -> bool:
    """True when some element of ``a`` shares a byte with some element of ``b`` (exact)."""
    if a.size == 0 or b.size == 0:
        return False
    if _is_declaration(a) or _is_declaration(b):  # no address yet: checked when arrays arrive
        return False
    if (a.device is None) != (b.device is None) or (a.device is not None and a.device != b.device):
        return False
    alo, ahi = a.byte_extent()
    blo, bhi = b.byte_extent()
    if ahi <= blo or bhi <= alo:
        return False
    try:
        return bool(np.shares_memory(_as_address_array(a), _as_address_array(b), max_work=10**6))
    except np.exceptions.TooHardError:  # pragma: no cover - pathological strides; be conservative
        return True


def same_view(a: ArrayInfo, b: ArrayInfo) -> bool:
    if _is_declaration(a) or _is_declaration(b):  # declarations share ptr 0: only identity counts
        return a.array is b.array
    return a.ptr == b.ptr and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype


def overlaps_itself(info: ArrayInfo) -> bool:
    """True unless the strides provably give every element its own bytes (conservative: an exotic
    interleaving of axes that does not overlap may still be reported)."""
    reach = 1  # elements spanned by the axes seen so far, smallest stride first
    for stride, extent in sorted((abs(s), d) for d, s in zip(info.shape, info.strides) if d > 1):
        if stride < reach:
            return True
        reach += stride * (extent - 1)
    return False


def check_outputs(outputs: list[tuple[ArrayInfo, ArrayInfo | None]], inputs: list[ArrayInfo]) -> None:
    """Each output may be its own input (in place) and must overlap nothing else, itself included."""
    for i, (out, own) in enumerate(outputs):
        check_writable(out)
        if out.size > 1 and overlaps_itself(out):  # parallel writes to one address race
            raise ValueError(f"{out.name}: its elements overlap each other (strides {out.strides} elements for "
                             f"shape {out.shape}, e.g. a broadcast view); an output needs distinct elements")
        for inp in inputs:
            if own is not None and inp is own and same_view(out, own):
                continue
            if overlaps(out, inp):
                hint = (" (in place needs the very same view as the input)" if own is not None and inp is own else "")
                raise ValueError(f"{out.name} overlaps {inp.name}{hint}")
        for other, _ in outputs[i + 1 :]:
            if overlaps(out, other):
                raise ValueError(f"{out.name} overlaps {other.name}")
