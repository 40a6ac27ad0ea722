"""Exceptions raised by rope_rtc. Each carries the evidence needed to act on it."""

from __future__ import annotations

import functools
import numbers
import os
import re
import reprlib
import sys
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


# Containers are shown a few levels and items deep: a message needs the value's start, and
# repr() of a deeply nested value (a JSON config) recurses past the interpreter's limit.
_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = SHOWN_CHARS = 80


def shown(value: Any) -> str:
    """``repr`` of a value for a message, at most about ``SHOWN_CHARS`` characters: a long one is
    cut, with an ellipsis and the value's own length (a 30 MiB string in a config would
    otherwise be the message), and an enormous int is described, not spelled out (a 400-digit
    number would bury the message)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(int(value)) >= 10**20:
        return f"{'-' if value < 0 else ''}an int of {int(value).bit_length()} bits"
    if isinstance(value, (str, bytes, bytearray)):
        text, cut = repr(value[:SHOWN_CHARS]), len(value) > SHOWN_CHARS  # never the repr of all of it
        unit = "characters" if isinstance(value, str) else "bytes"
    else:
        try:
            text = _REPR.repr(value)
        except Exception:  # a repr that fails is no reason to lose the message it is part of
            text = f"<{type(value).__name__}>"
        cut, unit = False, "items"
    if len(text) <= SHOWN_CHARS and not cut:
        return text
    try:
        n = len(value)
    except Exception:  # no length: the cut repr says enough
        return text[:SHOWN_CHARS - 3] + "..."
    return text[:SHOWN_CHARS - 3] + f"... ({n} {'item' if unit == 'items' and n == 1 else unit})"


def one_of(choices) -> str:
    """The choices a message expects: ``"float32"`` for a single one, ``"one of int32, int64"``
    for several (so that no message offers "one of" a single choice)."""
    names = [str(c) for c in choices]
    return names[0] if len(names) == 1 else "one of " + ", ".join(names)


def count(n: int, one: str, many: str) -> str:
    """``n`` and the words that agree with it: ``count(1, "entry", "entries")`` is ``"1 entry"``,
    ``count(2, "of them is", "of them are")`` is ``"2 of them are"``."""
    return f"{n} {one if n == 1 else many}"


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning, raised by the function that calls this one, at
    the first frame outside rope_rtc: one-call functions and plans reach the same warning through
    different numbers of the package's frames, and the user's line is the one to name."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
