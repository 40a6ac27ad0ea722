"""``rope-rtc cache list | verify | clear``: the disk cache as its operator sees it, checked as the
loader would check it. Works without a GPU."""

from __future__ import annotations

import argparse
import datetime
import functools
import sys

from .._version import __version__
from ..build.cache.entry import terminal_text
from ..errors import count
from .common import EXIT_FAILED, EXIT_OK, disk_store, err, size


def _when(timestamp: float) -> str:
    if not timestamp:
        return "?"
    try:
        return datetime.datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="seconds")
    except (OverflowError, ValueError, OSError):  # a time the platform cannot show: still a listing
        return "?"


# A kernel's name is its family and its defines: the longest the library builds is under 200
# characters, and a header's text beyond this is shortened.
KERNEL_NAME_CHARS = 256


def _kernel(name: str) -> str:
    """A kernel name from an entry's header, as a terminal may show it (escaped, bounded)."""
    return terminal_text(name, KERNEL_NAME_CHARS)


def _entry_name(e) -> str:
    """A listed entry as a person knows it: kernel and architecture when its header says, and
    the start of its key."""
    what = " ".join(x for x in (e.kernel and _kernel(e.kernel), e.target and terminal_text(e.target)) if x)
    return f"{what} ({e.key[:12]}…)" if what else e.path.name


def _cannot_read(store) -> bool:
    """True (having said why on stderr) when the directory exists but the store cannot read it."""
    if store.usable or (store.missing and not store.problem):
        return False
    err(f"cache {store.directory}: {store.problem}")
    return True


def _absent(store) -> str | None:
    """Why the cache directory is not there, naming it, or None when it exists (or the store
    could not tell: then ``problem`` says why)."""
    if not store.missing or store.problem:
        return None
    d = store.directory
    try:
        root_there = d.parent.is_dir()
    except OSError:
        root_there = False
    if root_there:
        return (f"cache directory {d} does not exist: {d.parent} holds no cache of rope_rtc {__version__} "
                "(`rope-rtc warm` fills it)")
    return (f"cache directory {d} does not exist: there is no {d.parent} (check --cache-dir or "
            "ROPE_RTC_CACHE_DIR; `rope-rtc warm` creates and fills it)")


def cmd_list(args: argparse.Namespace) -> int:
    """``cache list``: every entry sorted, unusable ones marked, and leftover temporary files."""
    store = disk_store(args.cache_dir)
    print(f"cache {store.directory}")
    listed = store.list()
    if _cannot_read(store):
        return EXIT_FAILED
    absent = _absent(store)
    if absent:
        print(f"note: {absent}")
    if store.problem:
        print(f"note: {store.problem}")
    good = sorted((e for e in listed if e.entry is not None), key=lambda e: (e.entry.kernel, e.entry.target, e.key))
    bad = sorted((e for e in listed if e.entry is None), key=lambda e: (e.kernel or "~", e.target or "", e.key))
    # A header's text is whatever its writer put there: shown escaped and bounded, never raw.
    rows = [(_kernel(e.entry.kernel), terminal_text(e.entry.target), terminal_text(e.entry.kind), size(e.size),
             _when(e.entry.created), e.key[:12], "") for e in good]
    rows += [(_kernel(e.kernel) if e.kernel else "?", terminal_text(e.target) if e.target else "?", "-", size(e.size), "-",
              e.key[:12], f"UNUSABLE: {e.error}") for e in bad]
    if rows:
        header = ("kernel", "arch", "kind", "size", "created", "key", "")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(6)]
        for r in [header, *rows]:
            cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2]), r[3].rjust(widths[3]),
                     r[4].ljust(widths[4]), r[5].ljust(widths[5])]
            print(("  " + "  ".join(cells) + (f"  {r[6]}" if r[6] else "")).rstrip())
    temps = store.temp_files()
    for p in temps:
        try:
            st = p.lstat()
            print(f"  temporary file {p.name} ({size(st.st_size)}, {_when(st.st_mtime)}; left by an "
                  f"interrupted write unless a warm is running)")
        except OSError:
            pass
    total = sum(e.size for e in listed)
    print(f"{count(len(listed), 'entry', 'entries')}, {size(total)}; "
          f"{count(len(temps), 'temporary file', 'temporary files')}; "
          f"{count(len(store.saved_sources()), 'saved source', 'saved sources')}")
    return EXIT_OK


def registered_build(key: str, claimed=None):
    """(spec, target) of the registered build whose cache key is ``key``, or None: the claimed
    target's builds first, then each other target's until one holds it."""
    from ..build import toolchain

    for target in ([claimed] if claimed is not None else []) + [t for t in toolchain.every_target() if t != claimed]:
        found = registered_builds(target).get(key)
        if found is not None:
            return found
    return None


@functools.lru_cache(maxsize=None)
def registered_builds(target) -> dict:
    """Cache key -> (spec, target) of every registered build for ``target`` (``registry.all_specs``
    and, on sm_90 and newer, the waiting builds: the kernels that look keys up without
    ``warm --model``). Computed once per target, only for an entry whose header does not name its
    key's build."""
    from ..build import kernels as build, registry

    specs = registry.all_specs()
    specs += registry.waiting_builds(specs, target.arch)
    return {build.spec_key(spec, target): (spec, target) for spec in specs}


def _loader_refusal(entry, key: str) -> tuple[str, str] | None:
    """("refused", why) when the loader would refuse this verified entry under its key,
    ("stale", why) when no kernel of this installation looks its key up (built from other
    sources, by another NVRTC or against other CUDA headers: never loaded, never deleted by a
    load), None when it loads. Any kernel the library builds is recognised, whatever built it
    (`warm`, `warm --model`, a first call, the benchmark)."""
    from ..build import kernels as build, toolchain
    from ..warm import build_of

    if entry.rope_rtc != __version__:
        return "refused", f"built by rope_rtc {terminal_text(entry.rope_rtc)}, not {__version__}"
    try:  # the header's own claim first: for a sound entry that is the only key computed
        claimed = toolchain.Target(toolchain.parse_arch(entry.target), entry.kind)
    except ValueError:
        claimed = None
    found = build_of(entry.kernel, key, claimed)
    major, minor = toolchain.nvrtc_version()
    if found is None and entry.nvrtc == f"{major}.{minor}":
        # A header that names another kernel than the one under its key (a tampered or misplaced
        # entry): build_of, going by the header's name, cannot see it. Look the key up among the
        # registered builds, as their loads would. (An entry of another NVRTC, the usual stale one
        # after an upgrade, is not looked for; nor is a model's build, warm --model, found but by
        # its own name.)
        found = registered_build(key, claimed)
    if found is None:
        return "stale", "built from other sources, by another NVRTC or against other CUDA headers; never loaded"
    spec, target = found
    # The very check the loader makes before it loads a hit (build.get_binary).
    if build._expected(entry, spec, target):
        return None
    other = "" if entry.kernel == spec.name else f"{_kernel(entry.kernel)} for "
    return "refused", (f"its key is {_kernel(spec.name)} for {target.name} {target.kind} built by NVRTC "
                       f"{major}.{minor}, but its header says {other}{terminal_text(entry.target)} "
                       f"{terminal_text(entry.kind)}, NVRTC {terminal_text(entry.nvrtc)}: the loader refuses it")


def cmd_verify(args: argparse.Namespace) -> int:
    """``cache verify``: exit 1 naming each entry the loader would refuse, or when there is no cache."""
    store = disk_store(args.cache_dir)
    listed = store.list()
    if _cannot_read(store):
        err("verify: the loader cannot use this directory, so none of its entries is served")
        return EXIT_FAILED
    absent = _absent(store)
    if absent:
        # A check of nothing must not pass: a mistyped --cache-dir would read as a sound cache.
        # Exit 1 as for a path that is not a directory, and as `warm`'s check of a missing cache.
        err(f"verify: {absent}; nothing verified")
        return EXIT_FAILED
    bad, foreign, stale, unchecked = [], [], 0, None
    for e in listed:
        if e.error:
            (foreign if e.foreign else bad).append(f"{_entry_name(e)}: {e.error}")
            continue
        try:
            verdict = _loader_refusal(e.entry, e.key)
        except Exception as exc:  # no NVRTC here: the checksum still held; say what was not checked
            unchecked = f"{type(exc).__name__}: {exc}"
            verdict = None
        if verdict and verdict[0] == "refused":
            bad.append(f"{_entry_name(e)}: {verdict[1]}")
        elif verdict:
            stale += 1
    if bad or foreign:
        failing = len(bad) + len(foreign)
        print(f"{failing} of {len(listed)} entries in {store.directory} {'fails' if failing == 1 else 'fail'} "
              "verification:", file=sys.stderr)
        for line in bad + foreign:
            print(f"- {line}", file=sys.stderr)
        if bad:
            it = "it" if len(bad) == 1 else "them"
            locked = store.not_writable_reason("warm or clear it")
            if locked:  # the loader leaves a bad entry it cannot replace, and compiles the kernel every time
                print(f"this user cannot replace {it}: {locked}", file=sys.stderr)
            else:
                print(f"{count(len(bad), 'of them is', 'of them are')} replaced when next compiled (on next use; "
                      f"`rope-rtc warm` rebuilds {it} now)", file=sys.stderr)
        if foreign:
            it, kernels = ("it", "that kernel") if len(foreign) == 1 else ("them", "those kernels")
            print(f"{count(len(foreign), 'of them is not a file', 'of them are not files')}, which the cache never "
                  f"deletes or replaces: the loader ignores {it} and compiles {kernels} instead; remove {it} by hand",
                  file=sys.stderr)
        return EXIT_FAILED
    temps = len(store.temp_files())
    # What this user may not remove is not advised as removable: the owner and the fix instead
    # (warm removes old temporary files, clear removes them and entries).
    print(("the 1 entry" if len(listed) == 1 else f"all {len(listed)} entries") + f" in {store.directory} verified"
          + (f" ({count(temps, 'temporary file', 'temporary files')} left by interrupted writes, or being written "
             "now; " + _removal_advice(store, "warm or clear it", "it" if temps == 1 else "them",
                                       "`rope-rtc warm` and `rope-rtc cache clear` remove those older than an hour")
             + ")" if temps else ""))
    if stale:
        # `cache clear` removes every entry: advise it only when none of them is in use.
        them, they = ("it", "it only takes") if stale == 1 else ("them", "they only take")
        print(f"{count(stale, 'of them is', 'of them are')} never loaded by this installation (built from other "
              f"sources, by another NVRTC or against other CUDA headers); {they} disk space"
              + ("" if stale != len(listed) else
                 "; " + _removal_advice(store, "clear it", them, f"`rope-rtc cache clear` removes {them}")))
    if unchecked:
        print(f"note: whether the loader accepts each entry's header was not checked ({unchecked})")
    return EXIT_OK


def _removal_advice(store, action: str, them: str, advice: str) -> str:
    """``advice`` (the command that removes files), or, where this user may not remove files from
    the directory, why not and what to do (``action`` as its owner)."""
    locked = store.not_writable_reason(action)
    return f"this user cannot remove {them}: {locked}" if locked else advice


def cmd_clear(args: argparse.Namespace) -> int:
    """``cache clear``: remove the cache's own files, and say what was left and why."""
    store = disk_store(args.cache_dir)
    d = store.directory
    if store.missing and not store.problem:
        print(f"nothing to clear: {d} does not exist")
        return EXIT_OK
    if _cannot_read(store):
        err("clear: nothing removed")
        return EXIT_FAILED
    from ..build.cache.store import Refused

    try:
        done = store.clear()
    except Refused as exc:  # not this user's to clear (a cache warmed by root into an image)
        err(f"clear: {exc}; nothing removed")
        return EXIT_FAILED
    except OSError as exc:
        err(f"clear: cannot read {d}: {exc.strerror}; nothing removed")
        return EXIT_FAILED
    print(f"removed {count(done.removed, 'file', 'files')} from {d} ({count(done.entries, 'entry', 'entries')}, "
          f"{count(done.sources, 'saved source', 'saved sources')}, "
          f"{count(done.temporary, 'temporary file', 'temporary files')})")
    if done.left:
        shown = ", ".join(done.left[:5]) + (", …" if len(done.left) > 5 else "")
        print(f"left {count(len(done.left), 'file that is', 'files that are')} not the cache's: {shown}")
    if done.in_progress:
        them = "it" if len(done.in_progress) == 1 else "them"
        print(f"left {count(len(done.in_progress), 'temporary file', 'temporary files')} younger than an hour (a "
              f"compile in another process may be publishing {them}; `rope-rtc warm` removes {them} once "
              f"{'it is' if them == 'it' else 'they are'} older)")
    if done.failed:
        err(f"{count(len(done.failed), 'file', 'files')} could not be removed: "
             + "; ".join(f"{name} ({why})" for name, why in done.failed[:5]))
        return EXIT_FAILED
    return EXIT_OK
