"""Offline cache warming: compile every kernel the library launches for a list of architectures.

A build machine needs no GPU: NVRTC runs on the CPU, and each binary goes through the same
lifecycle a first call would use (:func:`rope_rtc.build.kernels.get_binary`), so what is warmed is
exactly what a server later looks up. Entries already present and valid are left untouched
(the file is not rewritten); a corrupt one is deleted and rebuilt.

Compiles run in a thread pool: cuda-python releases the GIL inside ``nvrtcCompileProgram``
and NVRTC compiles independent programs concurrently, so threads scale like processes
without paying for a process start and an NVRTC load per worker.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from .build import cache, registry, sources
from .build.kernels import get_binary, spec_key
from .build.registry import KernelSpec
from .build.toolchain import MIN_ARCH, Target, every_target, nvrtc_version, parse_arch, supported_archs
from .env import cache_root_path, settings
from .errors import CompileError, KernelNotCachedError, RopeRtcError, shown


class WarmError(RopeRtcError):
    """Warming cannot start: an architecture NVRTC cannot build, or no disk cache to fill."""


# Why a kernel failed to warm, in the order a report lists them.
NOT_CACHED, COMPILE, WRITE, OTHER = "not cached", "compile", "write", "other"


@dataclass(frozen=True)
class WarmFailure:
    kernel: str
    target: str
    error: str
    cause: str = OTHER  # NOT_CACHED, COMPILE, WRITE or OTHER


class _NotWritten(RopeRtcError):
    """Compiled, but the entry did not reach the disk."""


def _cause(exc: BaseException) -> str:
    if isinstance(exc, KernelNotCachedError):
        return NOT_CACHED
    if isinstance(exc, CompileError):
        return COMPILE
    if isinstance(exc, _NotWritten):
        return WRITE
    return OTHER


def _kernels(n: int) -> str:
    return f"{n} kernel{'' if n == 1 else 's'}"


@dataclass
class WarmReport:
    """What one warm did. ``ok`` is True when nothing failed."""

    targets: list[Target]
    directory: Path
    compiled: int = 0
    cached: int = 0
    failed: list[WarmFailure] = field(default_factory=list)
    seconds: float = 0.0
    stale_temporaries_removed: int = 0
    #: ROPE_RTC_NO_COMPILE=1: the warm only checked what the cache holds, and wrote nothing
    checked: bool = False
    #: the cache directory does not exist (a check creates nothing)
    directory_missing: bool = False
    #: the ``rope-rtc warm`` flags that chose the kernels (all but ``--arch`` and ``--cache-dir``),
    #: as shell words (quoted where a shell needs it), repeated in the command a report suggests
    #: so that it warms the same set: the command line sets the flags it was given; :func:`warm`
    #: sets what its arguments say, with ``--model <your config>`` for a model's ``specs`` (which
    #: do not say their config)
    selection: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def ready(self) -> int:
        return self.compiled + self.cached

    @property
    def total(self) -> int:
        return self.compiled + self.cached + len(self.failed)

    def summary(self) -> str:
        return (f"compiled {self.compiled}, already cached {self.cached}, failed {len(self.failed)} "
                f"in {self.seconds:.1f} s")

    def headline(self) -> str:
        """One line: what the cache now holds for these targets."""
        where = f"for {', '.join(t.name for t in self.targets)} in {self.directory}"
        if self.ok and self.checked:
            return (f"{'all ' if self.ready > 1 else ''}{_kernels(self.ready)} present {where} "
                    "(ROPE_RTC_NO_COMPILE=1: checked, nothing compiled or written)")
        if self.ok:
            return f"warmed {_kernels(self.ready)} {where}"
        missing = " (the directory does not exist)" if self.directory_missing else ""
        return f"warm incomplete: {self.ready} of {_kernels(self.total)} ready {where}{missing}"

    def missing_lines(self, limit: int = 20) -> list[str]:
        """``missing: KERNEL for ARCH`` for each kernel a check found absent (the first ``limit``)."""
        missing = [f for f in self.failed if f.cause == NOT_CACHED]
        lines = [f"missing: {f.kernel} for {f.target}" for f in missing[:limit]]
        if len(missing) > limit:
            lines.append(f"... and {len(missing) - limit} more (--kernels GLOB narrows the check)")
        return lines

    def failure_lines(self) -> list[str]:
        """One line per kind of failure, with its count; then, for failures whose evidence differs
        from kernel to kernel (a compile log, a disk error), one line per kernel."""
        by_cause: dict[str, list[WarmFailure]] = {}
        for f in self.failed:
            by_cause.setdefault(f.cause, []).append(f)
        lines: list[str] = []
        for cause in (NOT_CACHED, COMPILE, WRITE, OTHER):
            group = by_cause.get(cause, [])
            if not group:
                continue
            n = len(group)
            if cause == NOT_CACHED:
                archs = [a for t in dict.fromkeys(f.target for f in group) for a in ("--arch", t)]
                command = " ".join(["rope-rtc", "warm", *archs, *self.selection, "--cache-dir",
                                    shlex.quote(os.fspath(self.directory.parent))])
                them = "it" if n == 1 else "them"
                lines.append(f"{_kernels(n)} {'is' if n == 1 else 'are'} not in the cache and ROPE_RTC_NO_COMPILE=1 "
                             f"forbids compiling {them}: unset it to compile {them} ({command})")
                continue
            lines.append({COMPILE: f"{_kernels(n)} failed to compile:",
                          WRITE: f"{_kernels(n)} compiled but could not be written to {self.directory}:",
                          OTHER: f"{_kernels(n)} failed:"}[cause])
            lines += [f"- {f.kernel} for {f.target}: {f.error}" for f in group]
        return lines


def resolve_targets(archs: Iterable[str | int]) -> list[Target]:
    """CUBIN targets for ``archs`` (``"sm_90"``, ``"9.0"``, ``90`` ...), in order, without repeats;
    PTX for ``"compute_90"``: what a GPU newer than NVRTC loads (``toolchain.target_for``), and
    what a miss's message names for it.

    Raises :class:`WarmError` for an architecture this NVRTC cannot generate CUBIN for or one
    older than rope_rtc supports, and ``ValueError`` for text that is not an architecture.
    """
    known = supported_archs()
    targets: list[Target] = []
    for a in archs:
        arch = parse_arch(a)
        if arch < MIN_ARCH:
            raise WarmError(f"{shown(a)}: rope_rtc needs sm_{MIN_ARCH} or newer")
        if arch not in known:
            major, minor = nvrtc_version()
            usable = " ".join(f"sm_{k}" for k in known if k >= MIN_ARCH)
            raise WarmError(
                f"{shown(a)}: NVRTC {major}.{minor} cannot generate code for sm_{arch}; it can build {usable} "
                f"(a newer GPU needs a newer 'nvidia-cuda-nvrtc' package)"
            )
        ptx = isinstance(a, str) and a.strip().lower().startswith("compute_")
        t = Target(arch, "ptx" if ptx else "cubin")
        if t not in targets:
            targets.append(t)
    if not targets:
        raise WarmError("no architecture given")
    return targets


def select_specs(tail_heads: Sequence[int] = registry.DEFAULT_TAIL_HEADS,
                 kernels: Sequence[str] | None = None) -> list[KernelSpec]:
    """The registry's specs for a production cache (``registry.warm_specs``: no demo or benchmark
    kernel), or, given ``kernels``, every registered spec whose name or family matches a glob in
    it (so ``--kernels blog`` still reaches the demo's kernels)."""
    heads = tuple(int(h) for h in tail_heads)
    if not heads or any(h <= 0 for h in heads):
        raise ValueError(f"tail_heads must be positive head counts, got {list(tail_heads)}")
    specs = registry.all_specs(heads) if kernels else registry.warm_specs(heads)
    if kernels:
        specs = list(filter(_selects(kernels), specs))
        if not specs:
            raise ValueError(f"no registered kernel matches {_listed(kernels)}")
    return specs


class _Glob:
    """A ``--kernels`` pattern: ``*`` matches any run of characters, ``?`` any one, and every other
    character itself. Brackets are literal, not ``fnmatch`` classes: kernel names contain them
    (``rope[ROPE_DTYPE=2,...]``), and a name copied from ``rope-rtc cache list`` must match itself.

    The pieces between the stars have fixed lengths, so a match puts the first at the start, the
    last at the end and each other one at its leftmost place after the one before, in at most
    (name length x piece length) steps for each piece. (A regular expression with ``.*`` for each star backtracks
    exponentially on a pattern like ``?*?*?*?*?*?*=]`` that matches nothing.)"""

    def __init__(self, pattern: str) -> None:
        pieces = pattern.split("*")
        self.pieces = [(re.compile("".join("." if c == "?" else re.escape(c) for c in p), re.DOTALL), len(p))
                       for p in pieces]
        self.width = sum(len(p) for p in pieces)

    def matches(self, name: str) -> bool:
        (first, head), *rest = self.pieces
        if not rest:
            return first.fullmatch(name) is not None
        (last, tail) = rest.pop()
        if len(name) < self.width or not first.match(name) or not last.match(name, len(name) - tail):
            return False
        at, end = head, len(name) - tail
        for piece, _ in rest:
            found = piece.search(name, at, end)
            if found is None:
                return False
            at = found.end()
        return True


def _listed(patterns: Sequence[str]) -> str:
    return "[" + ", ".join(map(shown, patterns)) + "]"


def _selects(patterns: Sequence[str]) -> Callable[[KernelSpec], bool]:
    """Whether a spec's name or family matches one of ``patterns``."""
    globs = [_Glob(p) for p in patterns]
    return lambda spec: any(g.matches(spec.name) or g.matches(spec.family) for g in globs)


def _read_switches() -> bool:
    """Every switch the build reads for each kernel, read once before the first: a malformed
    value is one error up front (SettingError), not one failure per kernel. Returns whether
    compiling is forbidden."""
    s = settings()
    no_compile = s.no_compile
    _ = (s.save_source, s.log_compiles)  # read for their errors alone
    return no_compile


def _disk_store(cache_dir: str | os.PathLike | None, *, check_only: bool) -> cache.CacheStore:
    # A store of our own, not the process's shared one: warming must look at what is on the disk,
    # never be satisfied by a binary this process holds in memory. A check (no compiling) opens
    # it read-only: a cache shipped read-only in an image can be checked, and nothing is created,
    # written or deleted, not even a corrupt entry or an old temporary file.
    s = settings()
    if cache_dir is None and s.disable_disk_cache:
        raise WarmError("the disk cache is disabled (ROPE_RTC_DISABLE_DISK_CACHE=1), so warming would keep "
                        "nothing; unset it or pass a cache directory")
    directory = cache.versioned_cache_dir(cache_dir)
    disk = cache.DiskStore(directory, trust_shared=s.trust_shared_cache, read_only=check_only)
    if check_only:
        if disk.problem:
            raise WarmError(f"cannot check {directory}: {disk.problem}")
    elif not disk.writable or disk.problem:
        raise WarmError(f"cannot warm {directory}: "
                        f"{disk.usable and disk.not_writable_reason('warm it') or disk.problem or 'not writable'}")
    return cache.CacheStore(disk)


def warm(
    archs: Sequence[str | int],
    *,
    cache_dir: str | os.PathLike | None = None,
    jobs: int | None = None,
    tail_heads: Sequence[int] = registry.DEFAULT_TAIL_HEADS,
    kernels: Sequence[str] | None = None,
    progress: bool = True,
    specs: Sequence[KernelSpec] | None = None,
    pdl: bool = False,
) -> WarmReport:
    """Compile the library's kernels (``registry.warm_specs``) for each architecture in ``archs``
    into the disk cache.

    Parameters
    ----------
    archs
        Architectures, e.g. ``["sm_90", "sm_80"]``; CUBIN is built for each. Needs no GPU.
    cache_dir
        Cache root, as ``ROPE_RTC_CACHE_DIR`` (the version subdirectory is appended). Default:
        the configured cache.
    jobs
        Concurrent compiles (default ``os.cpu_count()``).
    tail_heads
        Head counts to build the tail kernel for (it specialises on H).
    kernels
        Only specs whose name or family matches one of these patterns (``*`` and ``?`` are
        wildcards, brackets are literal), e.g. ``["tail", "rope[ROPE_DTYPE=2,*"]``; matched
        against every registered spec, the demo's ``blog`` kernels included.
    progress
        Show a progress bar on a terminal.
    specs
        Exactly these specialisations instead of the registry's (``rope_rtc.numerics.model.ModelRope.specs``:
        what one model needs); ``kernels`` still filters them.
    pdl
        Also the builds that ``pdl=True`` plans load (``registry.waiting_for_producer``) of the
        selected RoPE kernels, for the targets of sm_90 and newer.

    A kernel that fails to compile or to reach the disk is recorded in the report's ``failed``
    list with its error text and cause; the others still run. Temporary files older than an
    hour, left in the directory by killed processes, are removed first. With
    ``ROPE_RTC_NO_COMPILE=1`` ``warm`` is a completeness check: nothing is compiled, and the cache is
    only read (it may be read-only, or not exist); every missing entry is a failure.
    """
    check_only = _read_switches()
    given_specs = specs is not None
    if cache_dir is not None:
        cache_dir = cache_root_path(os.fspath(cache_dir), f"cache_dir={os.fspath(cache_dir)!r}")
    targets = resolve_targets(archs)
    if specs is None:
        specs = select_specs(tail_heads, kernels)
    elif kernels:
        specs = list(filter(_selects(kernels), specs))
    if not specs:
        raise ValueError(f"no kernel to warm (kernels={_listed(kernels or [])})")
    specs = list(dict.fromkeys(specs))  # one task per kernel: two compiling one key waste a worker
    store = _disk_store(cache_dir, check_only=check_only)
    disk = store.disk
    assert disk is not None
    report = WarmReport(targets, disk.directory, checked=check_only, directory_missing=disk.missing,
                        selection=_selection(given_specs, tail_heads, kernels, pdl))
    report.stale_temporaries_removed = disk.remove_stale_temporaries()  # none in a check: it writes nothing
    tasks = [(spec, target) for target in targets for spec in specs]
    if pdl:
        tasks += [(spec, target) for target in targets for spec in registry.waiting_builds(specs, target.arch)]
    workers = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))

    t0 = time.perf_counter()
    spec_key(tasks[0][0], tasks[0][1])  # load NVRTC, find headers, read sources once, before the threads

    def one(spec: KernelSpec, target: Target) -> str:
        binary = get_binary(spec, target, store=store, announce=False)
        if binary.source != "compiled":
            return "cached"
        if binary.key in disk.write_errors or not os.path.isfile(disk.path_for(binary.key)):
            raise _NotWritten(disk.write_errors.get(binary.key) or disk.problem or "not written")
        return "compiled"

    bar = _progress_bar(len(tasks), progress, ", ".join(t.name for t in targets))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rope_rtc-warm")
    try:
        pending = {pool.submit(one, s, t): (s, t) for s, t in tasks}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                spec, target = pending.pop(fut)
                try:
                    outcome = fut.result()
                except Exception as exc:  # a compile error, a toolchain or disk failure: record, go on
                    report.failed.append(WarmFailure(spec.name, target.name,
                                                     str(exc) if isinstance(exc, _NotWritten)
                                                     else f"{type(exc).__name__}: {exc}", _cause(exc)))
                else:
                    if outcome == "compiled":
                        report.compiled += 1
                    else:
                        report.cached += 1
                bar.update(1)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        bar.close()
    pool.shutdown(wait=True)
    report.seconds = time.perf_counter() - t0
    order = {(s.name, t.name): i for i, (s, t) in enumerate(tasks)}
    report.failed.sort(key=lambda f: order[(f.kernel, f.target)])
    return report


def _selection(given_specs: bool, tail_heads: Sequence[int], kernels: Sequence[str] | None,
               pdl: bool = False) -> tuple[str, ...]:
    """The ``rope-rtc warm`` flags that choose what :func:`warm` was asked for, as far as its
    arguments say: ``specs`` do not name the config they came from, hence a placeholder."""
    flags: list[str] = ["--model", "<your config>"] if given_specs else []
    if not given_specs and tuple(int(h) for h in tail_heads) != tuple(registry.DEFAULT_TAIL_HEADS):
        flags += ["--tail-heads", ",".join(str(int(h)) for h in tail_heads)]
    for pattern in kernels or ():
        flags += ["--kernels", shlex.quote(pattern)]
    return tuple(flags) + ("--pdl",) * bool(pdl)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, wanted: bool, what: str):
    if not wanted or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - a base dependency
        return _NoBar()
    return tqdm(total=total, desc=f"warming {what}", unit="kernel", file=sys.stderr, leave=False)


# A kernel's name is its family and its defines in order (registry.KernelSpec.name).
_SPEC_NAME = re.compile(r"([A-Za-z_]\w*)(?:\[(.*)\])?")
_DEFINE = re.compile(r"([A-Za-z_]\w*)=([^,=\[\]]*)")


def specs_named(name: str) -> list[KernelSpec]:
    """Every specialisation this installation could have built under the name ``name``: its
    family and defines read back from the name, with each device source that could hold the
    family, likeliest first (a name does not say its source; the cache key does). Empty when
    ``name`` is not a kernel's name.

    No list of specialisations is consulted, so a model's builds (``warm --model``: QK-norm,
    KV cache, fixed geometry), any tail head count and the benchmark's kernels are found alike.
    """
    m = _SPEC_NAME.fullmatch(name)
    if m is None:
        return []
    family, inside = m.groups()
    defines: tuple[tuple[str, str], ...] = ()
    if inside is not None:
        parts = [_DEFINE.fullmatch(p) for p in inside.split(",")]
        if not all(parts):
            return []
        defines = tuple((p.group(1), p.group(2)) for p in parts)

    def likeness(source: str) -> int:
        stem = source[: -len(".cu")]
        return 0 if stem == family else 1 if stem.startswith(family + "_") or family.startswith(stem + "_") else 2

    entry_sources = sorted((n for n, _ in sources.all_sources() if n.endswith(".cu")), key=likeness)
    return [KernelSpec(family, src, (), defines) for src in entry_sources]


def build_of(kernel: str, key: str, claimed: Target | None = None) -> tuple[KernelSpec, Target] | None:
    """The specialisation named ``kernel`` and the target whose cache key is ``key`` in this
    installation (same sources, NVRTC, CUDA headers and version), or None: then nothing here
    ever looks that key up. ``claimed``, the target an entry's header names, is tried first; the
    others are tried too, so that a header rewritten to claim another target is still matched
    to the key it sits under (and the loader's refusal of it can be reported)."""
    specs = specs_named(kernel)
    if not specs:
        return None
    tries = [(spec, claimed) for spec in specs] if claimed is not None else []
    tries += [(specs[0], target) for target in every_target() if target != claimed]
    for spec, target in tries:
        if spec_key(spec, target) == key:
            return spec, target
    return None


__all__ = ["WarmError", "WarmFailure", "WarmReport", "build_of", "resolve_targets", "select_specs", "specs_named",
           "warm"]
