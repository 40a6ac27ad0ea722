"""What the ``rope-rtc`` subcommands share: exit codes, the usage error, messages on stderr,
sizes as a person reads them, and the cache directory opened for inspection."""

from __future__ import annotations

import sys

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class Usage(Exception):
    """The command cannot start; the text says why."""


def err(message: str) -> None:
    """``message`` on stderr, prefixed with the program's name."""
    print(f"rope-rtc: {message}", file=sys.stderr)


def size(n: int) -> str:
    """``n`` bytes in B, KiB, MiB or GiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def disk_store(cache_dir: str | None):
    """A store over the versioned directory for inspection; never creates the directory."""
    from ..build.cache import DiskStore, versioned_cache_dir
    from ..env import settings

    return DiskStore(versioned_cache_dir(cache_dir), trust_shared=settings().trust_shared_cache, create=False)
