"""The build lifecycle of one kernel specialisation, in named steps:

1. ``key``: hash every input that can change the binary;
2. ``lookup``: memory, then disk (verified; a corrupt entry is deleted and reads as a miss);
3. ``refuse`` a miss when compilation is forbidden (ROPE_RTC_NO_COMPILE=1);
4. ``compile`` with NVRTC, announcing a first-use compile in one line;
5. ``publish`` atomically, keeping the bytes we compiled even if another process won the race.

Nothing here runs on a launch path: plans call it once, in ``compile()``.
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from dataclasses import dataclass

from .._version import __version__
from ..env import settings
from ..errors import KernelNotCachedError
from . import sources
from .cache import Entry, cache_key, open_store
from .cache.store import SOURCE_SUFFIX, CacheStore
from .compiler import assembled_source, compile_options, compile_source
from .registry import KernelSpec, not_waiting
from .toolchain import Target, cuda_headers, nvrtc_version

logger = logging.getLogger("rope_rtc")


@dataclass(frozen=True)
class Binary:
    spec: KernelSpec
    target: Target
    key: str
    data: bytes
    kind: str
    source: str  # "memory", "disk" or "compiled"


def spec_key(spec: KernelSpec, target: Target) -> str:
    return cache_key(
        package_version=__version__,
        nvrtc_version=nvrtc_version(),
        cuda_headers_version=cuda_headers().cuda_version,
        target=target.name,
        kind=target.kind,
        source_name=spec.source,
        sources=sources.included_sources(spec.source),
        options=compile_options(spec.defines, target),
    )


def _notice(message: str) -> None:
    # A slow first call must never look like a hang: say so on stderr unless the application
    # configured logging, in which case it goes through the "rope_rtc" logger.
    if logger.hasHandlers():
        logger.info(message)
    else:
        print(f"rope_rtc: {message}", file=sys.stderr, flush=True)


def _expected(entry: Entry, spec: KernelSpec, target: Target) -> bool:
    """Whether a hit under ``spec``'s key for ``target`` is that build: its header names the
    kernel, the target, NVRTC and rope_rtc that produce the key."""
    major, minor = nvrtc_version()
    return (entry.kernel == spec.name and entry.target == target.name and entry.kind == target.kind
            and entry.rope_rtc == __version__ and entry.nvrtc == f"{major}.{minor}")


# Families specialised on one model's geometry, which only `warm --model` builds, and the flag
# that adds each family's builds to a model's set.
_MODEL_FAMILIES = {"rope_fixed": "", "rope_cache": "", "qk_norm_rope": " --qk-norm"}


def _not_cached_message(spec: KernelSpec, target: Target, store: CacheStore) -> str:
    """Why a miss may not compile, and the ``rope-rtc warm`` command that fills the cache with it."""
    head = (f"kernel {spec.name} for {target.name} is not in the cache and ROPE_RTC_NO_COMPILE=1 forbids "
            f"compiling it")
    if store.disk is None:  # nothing is read from disk, so no warm can help
        return (f"{head} (the disk cache is off: ROPE_RTC_DISABLE_DISK_CACHE=1); unset ROPE_RTC_NO_COMPILE or "
                "ROPE_RTC_DISABLE_DISK_CACHE")
    where = f" --cache-dir {shlex.quote(str(store.disk.directory.parent))}"  # a command that runs as pasted
    if not store.disk.usable and store.disk.problem:
        head += f" (the disk cache was not read: {store.disk.problem})"
    plain = not_waiting(spec)
    if plain is not None:  # a pdl=True build: warm --pdl adds it beside the plain one
        model = " --model config.json" if spec.family in _MODEL_FAMILIES else ""
        return (f"{head}; it is the build for pdl=True (programmatic dependent launch): fill the cache on a build "
                f"machine with: rope-rtc warm --arch {target.name}{model} --pdl --kernels {shlex.quote(plain.name)}"
                f"{where}")
    if spec.family in _MODEL_FAMILIES:
        angles = dict(spec.defines).get("FIX_ANGLES")
        flag = _MODEL_FAMILIES[spec.family] + (
            "" if angles is None else " --inv-freq " + {"1": "float64", "2": "float32"}[angles])
        return (f"{head}; it is specialised on one model's head counts and head dim: fill the cache on a build "
                f"machine with: rope-rtc warm --arch {target.name} --model config.json{flag}{where} (or the same "
                f"fields as flags: --dtype, --head-dim, --heads, --kv-heads, --rotary-dim, --interleaved)")
    if spec.family == "mla_rope_cache":  # its geometry comes from an MLA config's own fields only
        return (f"{head}; it is specialised on one MLA model's heads, head dims and kv_lora_rank: fill the cache on "
                f"a build machine with: rope-rtc warm --arch {target.name} --model config.json{where} (the "
                "model's config.json, with its kv_lora_rank)")
    if spec.family == "rope":
        hint = f" (or only one model's kernels: rope-rtc warm --arch {target.name} --model config.json{where})"
    elif spec.family == "tail":  # the default warm builds a fixed list of head counts
        hint = f" --tail-heads {dict(spec.defines)['TAIL_HEADS']}"
    else:
        hint = ""
    return f"{head}; fill the cache on a build machine with: rope-rtc warm --arch {target.name}{where}{hint}"


def get_binary(spec: KernelSpec, target: Target, *, store: CacheStore | None = None,
               announce: bool = True) -> Binary:
    store = store or open_store()
    key = spec_key(spec, target)

    hit = store.memory.get(key)
    origin = "memory"
    if hit is None:
        hit = store.get(key)
        origin = "disk"
    if hit is not None:
        if _expected(hit, spec, target):
            return Binary(spec, target, key, hit.payload, hit.kind, origin)
        # Same key, other build: cannot happen unless the file was tampered with. Never load it.
        if store.disk is not None:
            store.disk.discard(key, f"cache entry {key[:16]}… holds {hit.kernel} built for {hit.target}/NVRTC "
                                    f"{hit.nvrtc}/rope_rtc {hit.rope_rtc}, not {spec.name} for {target.name}")

    s = settings()
    if s.no_compile:
        raise KernelNotCachedError(_not_cached_message(spec, target, store))

    if announce:
        _notice(f"compiling {spec.name} for {target.name} (first use; cached afterwards)")
    t0 = time.perf_counter()
    result = compile_source(spec.name, spec.source, spec.defines, target)
    elapsed = time.perf_counter() - t0
    if s.log_compiles:
        logger.warning("compiled %s for %s in %.3f s (%d bytes of %s); options: %s", spec.name, target.name,
                       elapsed, len(result.binary), result.kind, " ".join(result.options))
    major, minor = nvrtc_version()
    entry = Entry(key, spec.name, target.name, result.kind, f"{major}.{minor}", __version__, result.binary,
                  time.time())
    store.put(entry)
    if s.save_source and store.disk is not None:
        store.disk.put_text(key, SOURCE_SUFFIX, assembled_source(spec.source, spec.defines, target))
    return Binary(spec, target, key, result.binary, result.kind, "compiled")
