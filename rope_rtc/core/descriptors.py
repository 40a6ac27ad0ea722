"""Declarations that stand in for arrays when a plan is built, and the result mapping."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from ..errors import shown
from .dtypes import dtype_name


class TensorDesc:
    """A declared array: dtype, shape, optional element strides, device.

    Accepted wherever a plan takes an array at construction. ``device`` is ``"cuda"`` or
    ``None`` (the current CUDA device, bound now: later device changes do not move the plan),
    ``"cuda:N"`` or an integer N. ``strides`` are in elements (default: C-contiguous).

    ``shape`` and ``strides`` are tuples or lists of Python ints or NumPy integers; anything
    else (a float, a bool, a string) is refused with a ``TypeError`` rather than converted,
    since a converted extent would declare an array the caller did not describe.
    """

    def __init__(self, dtype, shape, strides=None, device=None) -> None:
        if dtype is None:  # np.dtype(None) is float64: a dtype left out would declare float64
            raise TypeError("TensorDesc: dtype None is not a dtype; pass one, e.g. numpy.float32 or "
                            "ml_dtypes.bfloat16")
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"TensorDesc: dtype {shown(dtype)} is not a dtype") from None
        self.dtype_name = dtype_name(self.dtype)
        self.shape = _ints("shape", shape)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"TensorDesc: shape {self.shape} has a negative extent")
        if strides is None:
            acc, el = 1, []
            for d in reversed(self.shape):
                el.append(acc)
                acc *= max(d, 1)
            strides = tuple(reversed(el))
        self.strides = _ints("strides", strides)
        if len(self.strides) != len(self.shape):
            raise ValueError(f"TensorDesc: strides {self.strides} do not match shape {self.shape}")
        self.device = bind_device(device)

    def __repr__(self) -> str:
        return f"TensorDesc({self.dtype_name}, shape={self.shape}, strides={self.strides}, device={self.device})"


def is_int(value) -> bool:
    """A Python int or a NumPy integer; never a bool (an int to ``isinstance``)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _ints(field: str, values) -> tuple[int, ...]:
    """``values`` (a tuple, a list or a 1-d NumPy integer array) as a tuple of Python ints;
    ``TypeError`` naming ``field`` and the first value that is not an int."""
    if isinstance(values, np.ndarray) and values.ndim == 1:
        values = values.tolist()
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"TensorDesc: {field} must be a tuple of ints, got {type(values).__name__} {shown(values)}")
    for i, v in enumerate(values):
        if not is_int(v):
            raise TypeError(f"TensorDesc: {field} {shown(tuple(values))} has {shown(v)} ({type(v).__name__}) at "
                            f"index {i}; pass ints")
    return tuple(int(v) for v in values)


def bind_device(device) -> int:
    """The device ordinal ``device`` names (``"cuda"``/``None``: the current device, bound now;
    ``"cuda:N"`` or an int N); 0 where no GPU can say which is current."""
    if is_int(device):
        if device < 0:
            raise ValueError(f"TensorDesc: device {int(device)} is not a device ordinal")
        return int(device)
    if device is None or isinstance(device, str) and device == "cuda":
        try:
            import cupy

            return int(cupy.cuda.runtime.getDevice())
        except Exception:
            return 0  # no GPU here: the declaration still validates shapes and dtypes
    if not isinstance(device, str):
        raise TypeError(f"TensorDesc: device must be 'cuda', 'cuda:N', an int or None, got "
                        f"{type(device).__name__} {shown(device)}")
    if device.startswith("cuda:") and device[5:].isascii() and device[5:].isdigit():
        return int(device[5:])
    raise ValueError(f"TensorDesc: device {device!r} is not 'cuda', 'cuda:N', an int or None")


class TupleDict(Mapping):
    """A read-only mapping that also unpacks like a tuple of its values: ``out, = result``."""

    __slots__ = ("_items",)

    def __init__(self, **items) -> None:
        object.__setattr__(self, "_items", dict(items))

    @classmethod
    def of_out(cls, out) -> "TupleDict":
        """``TupleDict(out=out)`` without the keyword machinery (a one-call function's result)."""
        self = object.__new__(cls)
        object.__setattr__(self, "_items", {"out": out})
        return self

    def __getitem__(self, key):
        if isinstance(key, int):
            return tuple(self._items.values())[key]
        return self._items[key]

    def __iter__(self) -> Iterator:
        # Iterating yields the values, so that unpacking works like a tuple's.
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def keys(self):
        return self._items.keys()

    def items(self):
        return self._items.items()

    def values(self):
        return self._items.values()

    def __contains__(self, key) -> bool:
        return key in self._items

    def __setattr__(self, name, value):
        raise AttributeError("TupleDict is read-only")

    def __repr__(self) -> str:
        return "TupleDict(" + ", ".join(f"{k}=<{type(v).__name__} {getattr(v, 'shape', '')}>" for k, v in self._items.items()) + ")"
