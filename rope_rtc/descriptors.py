"""Declarations that stand in for arrays when a plan is built, and the result mapping."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np


class TensorDesc:
    """A declared array: dtype, shape, optional element strides, device.

    Accepted wherever a plan takes an array at construction. ``device`` is ``"cuda"`` or
    ``None`` (the current CUDA device, bound now: later device changes do not move the plan),
    ``"cuda:N"`` or an integer N. ``strides`` are in elements (default: C-contiguous).
    """

    def __init__(self, dtype, shape, strides=None, device=None) -> None:
        from .arrays import dtype_name

        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"TensorDesc: dtype {dtype!r} is not a dtype") from None
        self.dtype_name = dtype_name(self.dtype)
        self.shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"TensorDesc: shape {self.shape} has a negative extent")
        if strides is None:
            acc, el = 1, []
            for d in reversed(self.shape):
                el.append(acc)
                acc *= max(d, 1)
            strides = tuple(reversed(el))
        self.strides = tuple(int(s) for s in strides)
        if len(self.strides) != len(self.shape):
            raise ValueError(f"TensorDesc: strides {self.strides} do not match shape {self.shape}")
        self.device = _bind_device(device)

    def __repr__(self) -> str:
        return f"TensorDesc({self.dtype_name}, shape={self.shape}, strides={self.strides}, device={self.device})"


def _bind_device(device) -> int:
    if isinstance(device, bool):
        raise TypeError("TensorDesc: device must be 'cuda', 'cuda:N', an int or None")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"TensorDesc: device {device} is not a device ordinal")
        return device
    if device is None or device == "cuda":
        try:
            import cupy

            return int(cupy.cuda.runtime.getDevice())
        except Exception:
            return 0  # no GPU here: the declaration still validates shapes and dtypes
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
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
