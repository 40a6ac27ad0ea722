"""The argument conventions of inference engines (vLLM, SGLang, FlashInfer), mapped onto the
general API without a copy:

- one float32 ``cos_sin_cache`` of shape ``[max_position, rotary_dim]``, cos in the first half
  of each row and sin in the second, becomes two strided views (``cos``, ``sin``) of the same
  buffer (row stride ``rotary_dim``; the kernels read any row stride);
- flat q/k of shape ``[T, H * D]`` with ``layout="thd"`` and ``head_dim=D`` become ``[T, H, D]``
  views of the same memory.
"""

from __future__ import annotations

import numpy as np

from . import arrays as A
from .descriptors import TensorDesc


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


def split_cos_sin_cache(cache, cos, sin) -> tuple:
    """``(cos, sin)``: the tables given, or the two halves of ``cache`` as views."""
    if cache is None:
        if cos is None or sin is None:
            raise TypeError("cos, sin: pass both tables, or one combined table as cos_sin_cache=")
        return cos, sin
    if cos is not None or sin is not None:
        raise TypeError("cos_sin_cache: pass it instead of cos and sin, not with them")
    info = _described(cache, "cos_sin_cache")  # an interface-only cache; None for any other object
    shape = getattr(cache, "shape", None) if info is None else info.shape
    if shape is None or len(shape) != 2:
        raise ValueError("cos_sin_cache: expected a 2-d float32 array [max_position, rotary_dim] (cos in the first "
                         f"half of each row, sin in the second), got {'shape ' + str(tuple(shape)) if shape is not None else type(cache).__name__}")
    dtype = getattr(cache, "dtype", None) if info is None else info.dtype
    if dtype is not None and str(getattr(dtype, "name", dtype)) not in ("float32", "torch.float32"):
        raise TypeError(f"cos_sin_cache: expected float32 (the engines' cache is float32), got {dtype}")
    width = int(shape[1])
    if width == 0 or width % 2:
        raise ValueError(f"cos_sin_cache: its rows hold cos then sin, so their width must be even and positive, got "
                         f"{width}")
    half = width // 2
    if isinstance(cache, TensorDesc):  # a declaration: two declared views of one buffer
        return (TensorDesc(cache.dtype_name, (shape[0], half), cache.strides, cache.device),
                TensorDesc(cache.dtype_name, (shape[0], half), cache.strides, cache.device))
    if info is not None:
        return (_view(cache, info, 0, (shape[0], half), info.strides),
                _view(cache, info, half, (shape[0], half), info.strides))
    return cache[:, :half], cache[:, half:]


def unflatten_heads(x, head_dim, layout: str, name: str):
    """``x`` of shape ``[T, H * head_dim]`` as a ``[T, H, head_dim]`` view (``head_dim=None``:
    ``x`` unchanged). ``ValueError`` when it cannot be a view of the same memory."""
    if head_dim is None or x is None:
        return x
    if isinstance(head_dim, (bool, np.bool_)) or not isinstance(head_dim, (int, np.integer)):
        raise TypeError(f"head_dim: expected a positive int, got {head_dim!r}")
    if head_dim <= 0:  # a value, as for rotary_dim
        raise ValueError(f"head_dim: expected a positive int, got {head_dim!r}")
    head_dim = int(head_dim)
    if layout != "thd":
        raise ValueError(f"head_dim: flat [T, H * head_dim] arrays take layout='thd', got layout={layout!r}")
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
    if before.strides[-1] != 1 and width > 1:
        raise ValueError(f"{name}: a flat [T, H * head_dim] array needs a contiguous last axis (stride 1), got "
                         f"element strides {before.strides}")
    y = _view(x, before, 0, (T, width // head_dim, head_dim), (before.strides[0], head_dim, 1))
    after = A.describe(y, name)
    if after.ptr != before.ptr or (T > 1 and after.strides[0] != before.strides[0]):
        raise ValueError(f"{name}: could not view it as [T, H, head_dim] without a copy; pass a [T, H, D] array")
    return y


def flatten_like(out, flat_shape):
    """An output the API allocated as ``[T, H, D]``, returned in the caller's flat shape."""
    return out if out is None or flat_shape is None else out.reshape(flat_shape)
