"""Exceptions raised by rope_rtc. Each carries the evidence needed to act on it."""

from __future__ import annotations

import functools
import numbers
import re
from typing import Any


class RopeRtcError(RuntimeError):
    """Base class of rope_rtc's run-time failures (bad arguments raise TypeError/ValueError)."""


class ToolchainError(RopeRtcError):
    """NVRTC or the CUDA headers are missing or cannot serve the requested architecture."""


class CompileError(RopeRtcError):
    """NVRTC rejected a kernel. ``log`` holds the full compile log, ``options`` the options."""

    def __init__(self, message: str, *, kernel: str, options: list[str], log: str) -> None:
        super().__init__(message)
        self.kernel = kernel
        self.options = options
        self.log = log


class KernelNotCachedError(RopeRtcError):
    """Compilation is forbidden (``ROPE_RTC_NO_COMPILE=1``) and the cache has no entry."""


class CudaError(RopeRtcError):
    """A CUDA driver call failed. ``name`` is the CUresult name, e.g. ``CUDA_ERROR_INVALID_VALUE``."""

    def __init__(self, message: str, *, name: str, code: int) -> None:
        super().__init__(message)
        self.name = name
        self.code = code


class UnsupportedLayoutError(ValueError, NotImplementedError):
    """An array layout the kernels do not support (strides, contiguity): rejected, never copied.

    Both a ``ValueError`` (the argument's value is the problem) and a ``NotImplementedError``
    (the prepared tail RoPE contract's word for a rejected layout), so either ``except`` works
    and the general and tail APIs raise the same type for the same problem.
    """


class SettingError(ValueError):
    """A ``ROPE_RTC_*`` environment variable holds a value it does not accept; the text names the
    variable and the values it takes."""


class NoDeviceError(RopeRtcError):
    """The GPU backend was asked for on a machine with no usable CUDA driver or device."""


@functools.lru_cache(maxsize=None)
def _argument_names(names: frozenset) -> re.Pattern:
    # A name where a message uses it as an argument's: leading the message or a list of names
    # ("x, positions: ..."), after "overlaps", "but" or "from" ("out overlaps x", "from cos's"),
    # followed by ":", ",", "'s", " (", " is " or the end; never a word of the prose around it.
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    return re.compile(rf"(?:^|(?<=, )|(?<=overlaps )|(?<=but )|(?<=from ))({alternatives})\b"
                      r"(?=:|,|'s| \(| is |$)")


def rename_arguments(exc: Exception, names: dict) -> None:
    """Rename, in place, the argument names of ``exc``'s message (``names``: the checks' name ->
    the caller's): for an API that hands its arguments to checks written for other names (ONNX's
    inputs, the halves of a ``cos_sin_cache``), so that the message names what the caller passed."""
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        pattern = _argument_names(frozenset(names))
        exc.args = (pattern.sub(lambda m: names[m.group(1)], exc.args[0]),)


def shown(value: Any) -> str:
    """``repr`` of an argument for a message, except that an enormous int is described, not
    spelled out (a 400-digit number would bury the message), and a long repr is cut."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(int(value)) >= 10**20:
        return f"{'-' if value < 0 else ''}an int of {int(value).bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def one_of(choices) -> str:
    """The choices a message expects: ``"float32"`` for a single one, ``"one of int32, int64"``
    for several (so that no message offers "one of" a single choice)."""
    names = [str(c) for c in choices]
    return names[0] if len(names) == 1 else "one of " + ", ".join(names)


def count(n: int, one: str, many: str) -> str:
    """``n`` and the words that agree with it: ``count(1, "entry", "entries")`` is ``"1 entry"``,
    ``count(2, "of them is", "of them are")`` is ``"2 of them are"``."""
    return f"{n} {one if n == 1 else many}"
