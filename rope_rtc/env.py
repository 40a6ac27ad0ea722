"""Environment switches, read here and nowhere else.

Each variable is read when it is needed (never at import), so a test or a long-running server
can change it between calls. None of them is read on a launch path (``ROPE_RTC_NO_GRAPH_REPLAY`` is read when a plan compiles).

``ROPE_RTC_CACHE_DIR``
    Root of the on-disk kernel cache. Default: the platform user cache directory
    (``$XDG_CACHE_HOME/rope_rtc`` on Linux). A version subdirectory is always appended.
``ROPE_RTC_DISABLE_DISK_CACHE=1``
    Keep compiled kernels in memory only; never read or write the disk cache.
``ROPE_RTC_NO_COMPILE=1``
    Forbid compilation: a cache miss raises :class:`rope_rtc.errors.KernelNotCachedError`
    naming the kernel, the architecture and the ``rope-rtc warm`` command that would fill it.
    For production images whose cache was warmed offline.
``ROPE_RTC_SAVE_SOURCE=1``
    Beside each entry compiled by this process, save the exact source and options
    (``<key>.cu``) for debugging.
``ROPE_RTC_LOG_COMPILES=1``
    Log every compilation with its options, duration and output size.
``ROPE_RTC_TRUST_SHARED_CACHE=1``
    Accept a cache directory or entry that users other than its owner can write (a team's
    deliberately shared cache). This trusts every such user: a cached CUBIN runs with this
    process's access to all of its GPU memory.
``ROPE_RTC_NO_GRAPH_REPLAY=1``
    Plans launch with ``cuLaunchKernel`` every time, instead of replaying a repeated launch
    (same arrays, same stream) as a one-node CUDA graph. Read when a plan is compiled.
``ROPE_RTC_CUDA_INCLUDE``
    Folder holding ``cuda_fp16.h`` / ``cuda_bf16.h`` for NVRTC, overriding the search
    (the CUDA runtime wheel's include folder, then a system CUDA of NVRTC's major version).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    cache_dir: str | None
    disable_disk_cache: bool
    no_compile: bool
    save_source: bool
    log_compiles: bool
    trust_shared_cache: bool
    no_graph_replay: bool
    cuda_include: str | None


def settings() -> Settings:
    """The switches as they stand now."""
    return Settings(
        cache_dir=os.environ.get("ROPE_RTC_CACHE_DIR") or None,
        disable_disk_cache=_flag("ROPE_RTC_DISABLE_DISK_CACHE"),
        no_compile=_flag("ROPE_RTC_NO_COMPILE"),
        save_source=_flag("ROPE_RTC_SAVE_SOURCE"),
        log_compiles=_flag("ROPE_RTC_LOG_COMPILES"),
        trust_shared_cache=_flag("ROPE_RTC_TRUST_SHARED_CACHE"),
        no_graph_replay=_flag("ROPE_RTC_NO_GRAPH_REPLAY"),
        cuda_include=os.environ.get("ROPE_RTC_CUDA_INCLUDE") or None,
    )
