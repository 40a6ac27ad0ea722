"""Where the disk cache lives: ROPE_RTC_CACHE_DIR, else the user cache directory, and always a
version subdirectory beneath, so an upgrade never meets another version's entries."""

from __future__ import annotations

import os
from pathlib import Path

from ..._version import __version__
from ...env import settings
from .key import KEY_FORMAT


def cache_root() -> Path:
    explicit = settings().cache_dir
    if explicit:
        return Path(explicit).expanduser()
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("rope_rtc", appauthor=False))
    except ImportError:  # pragma: no cover - a base dependency; XDG is the same on Linux
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "rope_rtc"


def version_subdir() -> str:
    return f"v{__version__}-k{KEY_FORMAT}"


def versioned_cache_dir(root: str | os.PathLike | None = None) -> Path:
    return Path(root).expanduser() / version_subdir() if root is not None else cache_root() / version_subdir()
