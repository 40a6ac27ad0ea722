"""Environment switches, read here and nowhere else.

Each variable is read when it is needed (never at import), so a test or a long-running server
can change it between calls. None of them is read on a launch path (``ROPE_RTC_NO_GRAPH_REPLAY`` is read when a plan compiles).

A switch written ``=1`` below is on for ``1``, ``true``, ``yes`` or ``on`` and off for ``0``,
``false``, ``no``, ``off``, an empty value or none at all, in any letter case. Any other value
raises :class:`rope_rtc.errors.SettingError` (a ``ValueError``) naming the variable when that
switch is read: a typo must not silently forbid compiling, or silently allow it. ``ROPE_RTC_TRUST_SHARED_CACHE`` is the exception: an
unknown value means off, with a warning, so a typo can only ever refuse a cache.

``ROPE_RTC_CACHE_DIR``
    Root of the on-disk kernel cache: an absolute path (``~`` expands). Default: the platform
    user cache directory (``$XDG_CACHE_HOME/rope_rtc`` on Linux). A version subdirectory is
    always appended. A relative path, or a switch word such as ``false``, raises ``SettingError``.
``ROPE_RTC_DISABLE_DISK_CACHE=1``
    Keep compiled kernels in memory only; never read or write the disk cache.
``ROPE_RTC_NO_COMPILE=1``
    Forbid compilation: a cache miss raises :class:`rope_rtc.errors.KernelNotCachedError`
    naming the kernel, the architecture and the ``rope-rtc warm`` command that would fill it
    (with the disk cache off as well: which of the two switches to unset).
    For production images whose cache was warmed offline.
``ROPE_RTC_SAVE_SOURCE=1``
    Beside each entry compiled by this process, save the exact source and options
    (``<key>.cu``) for debugging.
``ROPE_RTC_LOG_COMPILES=1``
    Log every compilation with its options, duration and output size.
``ROPE_RTC_TRUST_SHARED_CACHE=1``
    Accept a cache directory or entry that users other than its owner can write or own (a
    team's deliberately shared cache), and create the cache's directories and files with the
    modes the umask leaves (by default they are private: 0700 and 0600). This trusts every such
    user: a cached CUBIN runs with this process's access to all of its GPU memory. A team's
    setup: a group holding every member; the cache root owned by that group, mode 2770
    (``chgrp team /srv/rope-cache && chmod 2770 /srv/rope-cache``: group-writable, setgid so
    that what is created inside belongs to the group, no sticky bit so that a member may replace
    another's entry); and every process using it (``rope-rtc warm`` and ``rope-rtc cache``
    too) run with ``ROPE_RTC_CACHE_DIR=/srv/rope-cache``, this switch, and umask 002 or 007 (a
    member under umask 022 creates a version directory the others cannot write to: they then
    serve it read-only).
``ROPE_RTC_NO_GRAPH_REPLAY=1``
    Plans launch with ``cuLaunchKernel`` every time, instead of replaying a repeated launch
    (same arrays, same stream) as a one-node CUDA graph. Read when a plan is compiled.
``ROPE_RTC_CHECK_POSITIONS=1``
    Read device-resident positions/offsets/cu_seqlens back to the host and check them before
    launching; synchronises; for debugging.
``ROPE_RTC_CUDA_INCLUDE``
    Folder holding ``cuda_fp16.h`` / ``cuda_bf16.h`` for NVRTC, overriding the search
    (the CUDA runtime wheel's include folder, then a system CUDA of NVRTC's major version).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .errors import SettingError

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off", "")
_ACCEPTED = "1, true, yes or on (on); 0, false, no, off or empty (off); any letter case"


def _parse_flag(variable: str, raw: str | None) -> bool:
    if raw is None:
        return False
    word = raw.strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise SettingError(f"{variable}={raw!r} is not a switch value; use {_ACCEPTED}")


def _parse_trust(variable: str, raw: str | None) -> bool:
    try:
        return _parse_flag(variable, raw)
    except SettingError as exc:
        # Failing closed: an unknown value never trusts a cache other users can write.
        warnings.warn(f"{exc}; shared caches are not trusted", UserWarning, stacklevel=3)
        return False


def _parse_cache_dir(variable: str, raw: str | None) -> str | None:
    if not raw:
        return None
    if raw.strip().lower() in _ON + _OFF:
        raise SettingError(
            f"{variable}={raw!r} is a switch value, not a directory; set it to an absolute path, "
            "or unset it for the user cache directory (ROPE_RTC_DISABLE_DISK_CACHE=1 keeps kernels "
            "in memory only)"
        )
    return cache_root_path(raw, f"{variable}={raw!r}")


def cache_root_path(raw: str, named: str) -> str:
    """``raw`` as a cache root, ``~`` expanded: the one rule for ``ROPE_RTC_CACHE_DIR``,
    ``rope-rtc ... --cache-dir`` and ``warm(cache_dir=)``. Raises :class:`SettingError` for a
    relative path, its text beginning with ``named`` (how the caller names the value)."""
    path = os.path.expanduser(raw)
    # A relative root would be resolved against each process's working directory: every server
    # started elsewhere would fill (and trust) a cache in a directory nobody chose.
    if not os.path.isabs(path):
        raise SettingError(f"{named} is a relative path; set it to an absolute path (or ~/...)")
    return path


def _parse_path(variable: str, raw: str | None) -> str | None:
    return raw or None


class _Setting:
    """One variable, parsed when its attribute is read, so that a malformed value raises in
    the code that uses that switch, not in whatever read the environment first."""

    def __init__(self, variable: str, parse: Callable[[str, str | None], Any]) -> None:
        self.variable = variable
        self.parse = parse

    def __get__(self, settings: Settings | None, owner: type | None = None) -> Any:
        if settings is None:
            return self
        return self.parse(self.variable, settings._raw.get(self.variable))


class Settings:
    """The switches as they stood when :func:`settings` was called, each parsed when read."""

    __slots__ = ("_raw",)

    cache_dir: str | None = _Setting("ROPE_RTC_CACHE_DIR", _parse_cache_dir)
    disable_disk_cache: bool = _Setting("ROPE_RTC_DISABLE_DISK_CACHE", _parse_flag)
    no_compile: bool = _Setting("ROPE_RTC_NO_COMPILE", _parse_flag)
    save_source: bool = _Setting("ROPE_RTC_SAVE_SOURCE", _parse_flag)
    log_compiles: bool = _Setting("ROPE_RTC_LOG_COMPILES", _parse_flag)
    trust_shared_cache: bool = _Setting("ROPE_RTC_TRUST_SHARED_CACHE", _parse_trust)
    no_graph_replay: bool = _Setting("ROPE_RTC_NO_GRAPH_REPLAY", _parse_flag)
    check_positions: bool = _Setting("ROPE_RTC_CHECK_POSITIONS", _parse_flag)
    cuda_include: str | None = _Setting("ROPE_RTC_CUDA_INCLUDE", _parse_path)

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self._raw = {name: environ.get(name) for name in VARIABLES}

    def __repr__(self) -> str:
        raw = ", ".join(f"{k}={v!r}" for k, v in self._raw.items() if v is not None)
        return f"Settings({raw})"


#: Every variable this module reads.
VARIABLES = tuple(v.variable for v in vars(Settings).values() if isinstance(v, _Setting))


def settings() -> Settings:
    """The switches as they stand now."""
    return Settings()
