"""The argument conventions of inference engines (vLLM, SGLang, FlashInfer), mapped onto the
general API without a copy:

- one float32 ``cos_sin_cache`` of shape ``[max_position, rotary_dim]``, cos in the first half
  of each row and sin in the second, becomes two strided views (``cos``, ``sin``) of the same
  buffer (row stride ``rotary_dim``; the kernels read any row stride);
- flat q/k of shape ``[T, H * D]`` with ``head_dim=D`` (and no layout, or ``layout="thd"``) become
  ``[T, H, D]`` views of the same memory.
"""

from __future__ import annotations

import numpy as np

from ..core import arrays as A
from ..core.descriptors import TensorDesc
from ..errors import UnsupportedLayoutError, rename_arguments


class _InterfaceView:
    """Part of the memory of an object that speaks only ``__cuda_array_interface__`` (which has
    no slicing or ``reshape`` of its own), described through that interface alone. It holds the
    object, so the memory outlives the view as long as the object does."""

    def __init__(self, owner, info: A.ArrayInfo, offset: int, shape: tuple, strides: tuple) -> None:
        cai = owner.__cuda_array_interface__
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": cai["typestr"], "version": 3,
            "data": (info.ptr + offset * info.itemsize, info.readonly),
            "strides": tuple(st * info.itemsize for st in strides),
        }


def interface_view(owner, info: A.ArrayInfo, offset: int, shape: tuple, strides: tuple):
    """Elements of an interface-only ``owner`` (described by ``info``) from ``offset`` as an array of
    ``shape`` and element ``strides``, through ``__cuda_array_interface__``, without a copy."""
    return _InterfaceView(owner, info, offset, shape, strides)


def _view(x, info: A.ArrayInfo, offset: int, shape: tuple, strides: tuple):
    """``x``'s elements from ``offset`` as an array of ``shape`` and element ``strides``, without
    a copy: a view of the caller's own kind where it can make one (CuPy, NumPy, torch), of the
    CuPy view of a DLPack export, else of the interface (``_InterfaceView``)."""
    for base in (x, info.array):
        if hasattr(base, "reshape") and hasattr(base, "__getitem__"):
            break
    else:
        return _InterfaceView(x, info, offset, shape, strides)
    if len(shape) == 3:  # [T, H * D] -> [T, H, D]
        return base.reshape(shape)
    return base[:, offset:offset + shape[1]]  # a table's half


def _described(x, name: str) -> A.ArrayInfo | None:
    """``x``'s ArrayInfo when it has no ``shape`` of its own (an interface-only object); None
    when it has one, or is no array at all (the caller names it)."""
    if x is None or hasattr(x, "shape"):
        return None
    try:
        return A.describe(x, name)
    except TypeError:
        return None


def shape_of(x, name: str):
    """``x.shape``, or the shape its array interface gives; None for anything else."""
    shape = getattr(x, "shape", None)
    if shape is None:
        info = _described(x, name)
        shape = None if info is None else info.shape
    return shape


# The names the checks give the halves of a cos_sin_cache, and the argument the caller passed.
CACHE_NAMES = {"cos": "cos_sin_cache", "sin": "cos_sin_cache"}


def split_cos_sin_cache(cache, cos, sin, rotary_dim=None, head_dim=None) -> tuple:
    """``(cos, sin)``: the tables given, or the two halves of ``cache`` as views. With the call's
    ``rotary_dim`` (None: the head dim) and its head dim, where known, the cache's width is checked
    here, in the cache's terms; the general checks of the halves speak of cos and sin, and the
    callers rename those (:func:`name_the_cache`)."""
    if cache is None:
        if cos is None or sin is None:
            raise TypeError("cos, sin: pass both tables, or one combined table as cos_sin_cache=")
        return cos, sin
    if cos is not None or sin is not None:
        raise TypeError("cos_sin_cache: pass it instead of cos and sin, not with them")
    info = _described(cache, "cos_sin_cache")  # an interface-only cache; None for any other object
    shape = getattr(cache, "shape", None) if info is None else info.shape
    what = ("cos_sin_cache: expected a 2-d float32 array [max_position, rotary_dim] (cos in the first half of each "
            "row, sin in the second), got ")
    if shape is None:
        raise TypeError(what + type(cache).__name__)
    if len(shape) != 2:
        raise ValueError(what + f"shape {tuple(shape)}")
    dtype = getattr(cache, "dtype", None) if info is None else info.dtype
    if dtype is not None and str(getattr(dtype, "name", dtype)) not in ("float32", "torch.float32"):
        raise TypeError(f"cos_sin_cache: expected float32, got {dtype}; the kernels read float32 tables (an engine "
                        "may keep its cache in the model's dtype): cast it once (cos_sin_cache.astype(float32), or "
                        ".float() for a torch tensor), or build it with rope_rtc.cos_sin_cache")
    width = int(shape[1])
    if width == 0 or width % 2:
        raise ValueError(f"cos_sin_cache: its rows hold cos then sin, so their width must be even and positive, got "
                         f"{width}")
    _check_cache_width(width, rotary_dim, head_dim)
    half = width // 2
    if isinstance(cache, TensorDesc):  # a declaration: two declared views of one buffer
        return (TensorDesc(cache.dtype_name, (shape[0], half), cache.strides, cache.device),
                TensorDesc(cache.dtype_name, (shape[0], half), cache.strides, cache.device))
    if info is None and not hasattr(cache, "__getitem__"):  # a shape but no slicing (DLPack only): its array's views
        info = A.describe(cache, "cos_sin_cache")
    if info is not None:
        return (_view(cache, info, 0, (shape[0], half), info.strides),
                _view(cache, info, half, (shape[0], half), info.strides))
    return cache[:, :half], cache[:, half:]


def _check_cache_width(width: int, rotary_dim, head_dim) -> None:
    """Rows of ``width`` values serve ``rotary_dim`` (the head dim when None) when they are as wide;
    an option of another type is left to validation, which names it."""
    plain = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and v > 0
    want = rotary_dim if rotary_dim is not None else head_dim
    if not plain(want) or int(want) == width:
        return
    want = int(want)
    hint = ""
    if rotary_dim is None and width < want:
        hint = (f" (rotary_dim defaults to the head dim {want}; to rotate only the first {width} channels pass "
                f"rotary_dim={width})")
    raise ValueError(f"cos_sin_cache: rows of {width} values (cos then sin of {width // 2} frequencies), but rotary_dim "
                     f"{want} needs rows of {want}{hint}")


def name_the_cache(exc: Exception, cache) -> None:
    """Rename, in place, ``cos`` and ``sin`` in the message of ``exc`` (raised by the checks of a call,
    before anything is launched or written) to ``cos_sin_cache`` when the call's tables are that
    cache's halves (``cache`` not None)."""
    if cache is not None:
        rename_arguments(exc, CACHE_NAMES)


def head_dim_of(x, head_dim, layout):
    """The head dim of ``x`` as the call will see it (``head_dim`` for a flat array it divides), or
    None when it cannot be told yet (the checks of ``x`` and ``head_dim`` then name the problem)."""
    shape = shape_of(x, "q")
    if not shape:
        return None
    if head_dim is None:
        return shape[-1]
    if isinstance(head_dim, (int, np.integer)) and not isinstance(head_dim, (bool, np.bool_)) and head_dim > 0 and (
            len(shape) == 2 and shape[1] % head_dim == 0 or len(shape) == 3 and shape[2] == head_dim):
        return int(head_dim)
    return None


def unflatten_heads(x, head_dim, layout: str | None, name: str):
    """``x`` of shape ``[T, H * head_dim]`` as a ``[T, H, head_dim]`` view (``head_dim=None``:
    ``x`` unchanged). ``ValueError`` when it cannot be a view of the same memory."""
    if head_dim is None or x is None:
        return x
    if isinstance(head_dim, (bool, np.bool_)) or not isinstance(head_dim, (int, np.integer)):
        raise TypeError(f"head_dim: expected a positive int, got {head_dim!r}")
    if head_dim <= 0:  # a value, as for rotary_dim
        raise ValueError(f"head_dim: expected a positive int, got {head_dim!r}")
    head_dim = int(head_dim)
    if layout is not None and layout != "thd":  # None: the arrays' rank decides, and [T, H, D] is thd
        raise ValueError(f"head_dim: flat [T, H * head_dim] arrays take layout='thd' (or no layout), got "
                         f"layout={layout!r}")
    shape = shape_of(x, name)
    if shape is None:
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    if len(shape) == 3 and shape[-1] == head_dim:
        return x  # already [T, H, D]
    if len(shape) != 2 or shape[1] % head_dim:
        raise ValueError(f"{name}: with head_dim={head_dim}, expected a flat [T, H * {head_dim}] array, got shape "
                         f"{tuple(shape)}")
    T, width = int(shape[0]), int(shape[1])
    if isinstance(x, TensorDesc):
        st = x.strides
        return TensorDesc(x.dtype_name, (T, width // head_dim, head_dim), (st[0], head_dim * st[1], st[1]), x.device)
    before = A.describe(x, name)
    # A fresh empty array has strides (0, 0): with no token there is no layout to refuse.
    if before.strides[-1] != 1 and width > 1 and T:  # a layout, as for a [T, H, D] array
        raise UnsupportedLayoutError(f"{name}: a flat [T, H * head_dim] array needs a contiguous last axis (stride 1), "
                                     f"got element strides {before.strides}")
    y = _view(x, before, 0, (T, width // head_dim, head_dim), (before.strides[0], head_dim, 1))
    after = A.describe(y, name)
    if after.ptr != before.ptr or (T > 1 and after.strides[0] != before.strides[0]):
        raise ValueError(f"{name}: could not view it as [T, H, head_dim] without a copy; pass a [T, H, D] array")
    return y


def flatten_like(out, flat_shape):
    """An output the API allocated as ``[T, H, D]``, returned in the caller's flat shape."""
    return out if out is None or flat_shape is None else out.reshape(flat_shape)
