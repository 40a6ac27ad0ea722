"""``rope-rtc``: information, offline cache warming, cache maintenance, the demo and the benchmark.

Every subcommand except ``demo`` and ``bench`` works on a machine without a GPU: devices are
asked for through the CUDA driver bindings (never by importing CuPy), and NVRTC runs on the CPU.

Exit codes: 0 success; 1 the work failed (a kernel did not compile, an entry is corrupt);
2 the command could not start (bad arguments, no architecture, a module that is missing).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from ._version import __version__
from .build.cache.entry import terminal_text
from .errors import SettingError, count, shown

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# -- small helpers ---------------------------------------------------------------------------

class _Usage(Exception):
    """The command cannot start; the text says why."""


def _err(message: str) -> None:
    print(f"rope-rtc: {message}", file=sys.stderr)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def _when(timestamp: float) -> str:
    if not timestamp:
        return "?"
    try:
        return datetime.datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="seconds")
    except (OverflowError, ValueError, OSError):  # a time the platform cannot show: still a listing
        return "?"


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _show_warning(message, category, filename, lineno, file=None, line=None):
    # Cache warnings are for operators: the message, not the library's source line.
    print(f"warning: {message}", file=sys.stderr if file is None else file)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{shown(text)} must be positive")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)}: expected comma-separated integers, e.g. 1,8,32") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{shown(text)}: expected positive integers, e.g. 1,8,32")
    return values


def _cache_dir_arg(text: str) -> str:
    """``--cache-dir``: ROPE_RTC_CACHE_DIR's rule (an absolute path, ``~`` expanded), in its words."""
    from .env import cache_root_path

    try:
        return cache_root_path(text, repr(text))
    except SettingError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _arch_arg(text: str) -> str:
    from .build.toolchain import parse_arch

    try:
        parse_arch(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _disk_store(cache_dir: str | None):
    """A store over the versioned directory for inspection; never creates the directory."""
    from .build.cache import DiskStore, versioned_cache_dir
    from .env import settings

    return DiskStore(versioned_cache_dir(cache_dir), trust_shared=settings().trust_shared_cache, create=False)


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


# -- info ------------------------------------------------------------------------------------

def _cmd_info(args: argparse.Namespace) -> int:
    from .core import driver
    from .build import toolchain
    from .env import settings

    rows: list[tuple[str, str]] = [
        ("rope_rtc", f"{__version__} ({Path(__file__).resolve().parent})"),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
    ]
    # Which CUDA toolchain this is: each part's version, where it came from, and its CUDA major
    # (one extra installs one coherent set; parts of two majors cannot work on one driver).
    majors: dict[str, int] = {}
    try:
        major, minor = toolchain.nvrtc_version()
        majors["NVRTC"] = major
        lib = toolchain.nvrtc_library()
        wheel = toolchain.installed_from(lib, toolchain.NVRTC_PACKAGES.values()) if lib else None
        where = ", ".join(x for x in (wheel, lib) if x)
        rows.append(("NVRTC", f"{major}.{minor}" + (f" ({where})" if where else "")))
    except Exception as exc:
        rows.append(("NVRTC", f"unavailable: {exc}"))
    bindings = toolchain.bindings_version()
    if toolchain.bindings_major() is not None:
        majors["cuda-bindings"] = toolchain.bindings_major()
    rows.append(("cuda-bindings", bindings or f"not installed: {toolchain.install_hint()}"))
    cupy_dist = next((n for n in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if _dist_version(n)), None)
    cupy_version = _dist_version(cupy_dist) if cupy_dist else None
    if cupy_dist and cupy_dist != "cupy":
        majors["CuPy"] = int(cupy_dist[len("cupy-cuda"):-1])
        cupy_version = f"{cupy_version} ({cupy_dist})"
    if cupy_version is None and importlib.util.find_spec("cupy") is not None:
        cupy_version = "installed (version unknown)"
    rows.append(("CuPy", cupy_version or f"not installed: {toolchain.install_hint()}"))
    rows.append(("NumPy", _dist_version("numpy") or "not installed"))
    rows.append(("ml_dtypes", _dist_version("ml_dtypes", "ml-dtypes") or "not installed"))

    gpu = driver.available()
    driver_major = None
    if gpu:
        try:
            v = driver.driver_version()
            driver_major = v // 1000
            rows.append(("CUDA driver", f"{v // 1000}.{(v % 1000) // 10}"))
        except Exception as exc:
            rows.append(("CUDA driver", f"unknown: {exc}"))
    else:
        rows.append(("CUDA driver", "none"))

    try:
        h = toolchain.cuda_headers()
        majors["CUDA headers"] = h.cuda_version // 1000
        origin = h.origin
        if h.origin == "wheel":
            wheel = toolchain.installed_from(Path(h.path) / "cuda_fp16.h", toolchain.RUNTIME_PACKAGES.values())
            origin = f"the {wheel} wheel" if wheel else "a wheel"
        elif h.origin == "system":
            origin = "a system CUDA"
        rows.append(("CUDA headers", f"{h.path} (CUDA {h.version_text}, from {origin})"))
    except Exception as exc:
        rows.append(("CUDA headers", f"not found: {exc}"))

    found = sorted(set(majors.values()))
    if "NVRTC" not in majors:
        summary = f"no CUDA toolchain: {toolchain.install_hint(driver_major)}"
    elif len(found) == 1:
        extra = toolchain.EXTRAS.get(found[0])
        summary = f"CUDA {found[0]}" + (f" (the rope-rtc[{extra}] set)" if extra else "")
        if driver_major is not None and driver_major < found[0]:
            summary += f"; the CUDA {driver_major} driver needs the CUDA {driver_major} one: " \
                       f"{toolchain.install_hint(driver_major)}"
    else:
        parts = ", ".join(f"{name} {m}" for name, m in majors.items())
        summary = (f"mixed CUDA versions ({parts}): install one set, "
                   f"{toolchain.install_hint(driver_major)}")
    rows.insert(2, ("toolchain", summary))
    try:
        archs = toolchain.supported_archs()
        rows.append(("NVRTC archs", " ".join(f"sm_{a}" for a in archs)
                     + f" (rope_rtc builds sm_{toolchain.MIN_ARCH} and newer)"))
    except Exception as exc:
        rows.append(("NVRTC archs", f"unknown: {exc}"))

    if gpu:
        for i in range(driver.device_count()):
            try:
                arch = driver.device_arch(i)
                try:
                    t = toolchain.target_for(arch, driver_version=driver.driver_version())
                    how = f"builds {t.name} {'CUBIN' if t.kind == 'cubin' else 'PTX (JIT by the driver)'}"
                except Exception as exc:
                    how = f"cannot build: {exc}"
                rows.append((f"device {i}", f"{driver.device_name(i)}, sm_{arch}; {how}"))
            except Exception as exc:
                rows.append((f"device {i}", f"unreadable: {exc}"))
    else:
        rows.append(("devices", f"no GPU found: {driver.unavailable_reason() or 'no CUDA device'}"))

    s = settings()
    store = _disk_store(args.cache_dir)
    listed = store.list()
    bad = sum(1 for e in listed if e.error)
    where = f"{store.directory}"
    if s.disable_disk_cache and args.cache_dir is None:
        where += " (disabled by ROPE_RTC_DISABLE_DISK_CACHE)"
    rows.append(("cache", where))
    contents = f"{count(len(listed), 'entry', 'entries')}, {_size(sum(e.size for e in listed))}"
    if bad:
        contents += f", {bad} unusable (rope-rtc cache verify names them)"
    try:
        created = store.directory.exists()
    except OSError:  # a parent directory this user cannot search: store.problem says so
        created = True
    if not created:
        contents = "empty (not created yet)"
    elif store.problem:
        contents += f"; {store.problem}"
    rows.append(("cache entries", contents))

    switches = sorted((k, v) for k, v in os.environ.items() if k.startswith("ROPE_RTC_"))
    rows.append(("switches", ", ".join(f"{k}={v}" for k, v in switches) if switches else "none set"))

    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return EXIT_OK


# -- warm ------------------------------------------------------------------------------------

def _default_archs() -> list[str]:
    from .core import driver

    if not driver.available():
        raise _Usage(f"no GPU found: {driver.unavailable_reason() or 'no CUDA device'}; say which "
                     "architectures to build for, e.g. --arch sm_90 --arch sm_80")
    return [f"sm_{driver.device_arch(i)}" for i in range(driver.device_count())]


def _cmd_warm(args: argparse.Namespace) -> int:
    from . import warm as warming
    from .errors import RopeRtcError

    archs = [a for group in (args.arch or []) for a in group.split(",") if a.strip()] or _default_archs()
    try:
        model = _model_from_args(args)
        report = warming.warm(archs, cache_dir=args.cache_dir, jobs=args.jobs,
                              tail_heads=tuple(args.tail_heads), kernels=args.kernels,
                              progress=not args.no_progress, specs=None if model is None else model.specs())
    except (RopeRtcError, ValueError) as exc:
        raise _Usage(str(exc)) from None
    report.selection = _warm_selection(args)
    if model is not None:
        print(f"model: head_dim {model.head_dim}, {model.q_heads} q heads, {model.kv_heads} kv heads, rotary_dim "
              f"{model.rotary_dim}, {model.dtype}, {'interleaved' if model.interleaved else 'half-split'} pairs"
              + (f", MRoPE sections {list(model.mrope_section)}" + (" interleaved" if model.mrope_interleaved else "")
                 if model.mrope_section else "")
              + (", per-head QK-norm" if model.qk_norm else "")
              + (f", cos/sin from {' and '.join(model.inv_freq)} inv_freq" if model.inv_freq else "")
              + f": {len(model.specs())} kernel builds per architecture")
    print(report.headline())
    print(report.summary())
    if report.checked:
        for line in report.missing_lines():
            print(line)
    if report.failed:
        for line in report.failure_lines():
            print(line, file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


_MODEL_FLAGS = (("dtype", "--dtype"), ("head_dim", "--head-dim"), ("q_heads", "--heads"),
                ("kv_heads", "--kv-heads"), ("rotary_dim", "--rotary-dim"))


def _warm_selection(args: argparse.Namespace) -> tuple[str, ...]:
    """The flags of this ``warm`` that chose its kernels, as typed (shell-quoted), for the command
    its report suggests: it must warm the same set (a model's kernels, not every registered one)."""
    from .build.registry import DEFAULT_TAIL_HEADS

    flags: list[str] = []
    if args.model is not None:
        flags += ["--model", args.model]
    for field, flag in _MODEL_FLAGS:
        if getattr(args, field) is not None:
            flags += [flag, str(getattr(args, field))]
    flags += ["--interleaved"] * bool(args.interleaved) + ["--qk-norm"] * bool(args.qk_norm)
    for dtype in args.inv_freq or ():
        flags += ["--inv-freq", dtype]
    if list(args.tail_heads) != list(DEFAULT_TAIL_HEADS):
        flags += ["--tail-heads", ",".join(map(str, args.tail_heads))]
    for pattern in args.kernels or ():
        flags += ["--kernels", pattern]
    return tuple(shlex.quote(f) for f in flags)


def _model_from_args(args: argparse.Namespace):
    """The model geometry of ``warm --model`` and its field flags, or None (warm everything)."""
    from .numerics.model import from_config

    given = {field: getattr(args, field) for field, _ in _MODEL_FLAGS if getattr(args, field) is not None}
    if args.model is None and not given and not args.interleaved and not args.qk_norm and not args.inv_freq:
        return None
    if args.model is None:
        missing = [flag for field, flag in _MODEL_FLAGS[:3] if field not in given]
        if missing:
            raise ValueError(f"warm without --model needs {', '.join(missing)} (or --model config.json)")
    return from_config(args.model if args.model is not None else {}, interleaved=True if args.interleaved else None,
                       qk_norm=True if args.qk_norm else None, inv_freq=tuple(args.inv_freq or ()), **given)


# -- cache -----------------------------------------------------------------------------------

def _cannot_read(store) -> bool:
    """True (having said why on stderr) when the directory exists but the store cannot read it."""
    if store.usable or (store.missing and not store.problem):
        return False
    _err(f"cache {store.directory}: {store.problem}")
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


def _cmd_cache_list(args: argparse.Namespace) -> int:
    store = _disk_store(args.cache_dir)
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
    rows = [(_kernel(e.entry.kernel), terminal_text(e.entry.target), terminal_text(e.entry.kind), _size(e.size),
             _when(e.entry.created), e.key[:12], "") for e in good]
    rows += [(_kernel(e.kernel) if e.kernel else "?", terminal_text(e.target) if e.target else "?", "-", _size(e.size), "-",
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
            print(f"  temporary file {p.name} ({_size(st.st_size)}, {_when(st.st_mtime)}; left by an "
                  f"interrupted write unless a warm is running)")
        except OSError:
            pass
    total = sum(e.size for e in listed)
    print(f"{count(len(listed), 'entry', 'entries')}, {_size(total)}; "
          f"{count(len(temps), 'temporary file', 'temporary files')}; "
          f"{count(len(store.saved_sources()), 'saved source', 'saved sources')}")
    return EXIT_OK


def _loader_refusal(entry, key: str) -> tuple[str, str] | None:
    """("refused", why) when the loader would refuse this verified entry under its key,
    ("stale", why) when no kernel of this installation looks its key up (built from other
    sources, by another NVRTC or against other CUDA headers: never loaded, never deleted by a
    load), None when it loads. Any kernel the library builds is recognised, whatever built it
    (`warm`, `warm --model`, a first call, the benchmark)."""
    from .build import kernels as build, toolchain
    from .warm import build_of

    if entry.rope_rtc != __version__:
        return "refused", f"built by rope_rtc {terminal_text(entry.rope_rtc)}, not {__version__}"
    try:  # the header's own claim first: for a sound entry that is the only key computed
        claimed = toolchain.Target(toolchain.parse_arch(entry.target), entry.kind)
    except ValueError:
        claimed = None
    found = build_of(entry.kernel, key, claimed)
    if found is None:
        return "stale", "built from other sources, by another NVRTC or against other CUDA headers; never loaded"
    spec, target = found
    # The very check the loader makes before it loads a hit (build.get_binary).
    if build._expected(entry, target):
        return None
    major, minor = toolchain.nvrtc_version()
    return "refused", (f"its key is {_kernel(spec.name)} for {target.name} {target.kind} built by NVRTC "
                       f"{major}.{minor}, but its header says {terminal_text(entry.target)} {terminal_text(entry.kind)}, NVRTC "
                       f"{terminal_text(entry.nvrtc)}: the loader refuses it")


def _cmd_cache_verify(args: argparse.Namespace) -> int:
    store = _disk_store(args.cache_dir)
    listed = store.list()
    if _cannot_read(store):
        _err("verify: the loader cannot use this directory, so none of its entries is served")
        return EXIT_FAILED
    absent = _absent(store)
    if absent:
        # A check of nothing must not pass: a mistyped --cache-dir would read as a sound cache.
        # Exit 1 as for a path that is not a directory, and as `warm`'s check of a missing cache.
        _err(f"verify: {absent}; nothing verified")
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
            print(f"{count(len(bad), 'of them is', 'of them are')} replaced when next compiled (on next use; "
                  f"`rope-rtc warm` rebuilds {'it' if len(bad) == 1 else 'them'} now)", file=sys.stderr)
        if foreign:
            it, kernels = ("it", "that kernel") if len(foreign) == 1 else ("them", "those kernels")
            print(f"{count(len(foreign), 'of them is not a file', 'of them are not files')}, which the cache never "
                  f"deletes or replaces: the loader ignores {it} and compiles {kernels} instead; remove {it} by hand",
                  file=sys.stderr)
        return EXIT_FAILED
    temps = len(store.temp_files())
    print(("the 1 entry" if len(listed) == 1 else f"all {len(listed)} entries") + f" in {store.directory} verified"
          + (f" ({count(temps, 'temporary file', 'temporary files')} left by interrupted writes, or being written "
             "now; `rope-rtc warm` and `rope-rtc cache clear` remove those older than an hour)" if temps else ""))
    if stale:
        # `cache clear` removes every entry: advise it only when none of them is in use.
        them, they = ("it", "it only takes") if stale == 1 else ("them", "they only take")
        print(f"{count(stale, 'of them is', 'of them are')} never loaded by this installation (built from other "
              f"sources, by another NVRTC or against other CUDA headers); {they} disk space"
              + (f"; `rope-rtc cache clear` removes {them}" if stale == len(listed) else ""))
    if unchecked:
        print(f"note: whether the loader accepts each entry's header was not checked ({unchecked})")
    return EXIT_OK


def _cmd_cache_clear(args: argparse.Namespace) -> int:
    store = _disk_store(args.cache_dir)
    d = store.directory
    if store.missing and not store.problem:
        print(f"nothing to clear: {d} does not exist")
        return EXIT_OK
    if _cannot_read(store):
        _err("clear: nothing removed")
        return EXIT_FAILED
    from .build.cache.store import Refused

    try:
        done = store.clear()
    except Refused as exc:  # not this user's to clear (a cache warmed by root into an image)
        _err(f"clear: {exc}; nothing removed")
        return EXIT_FAILED
    except OSError as exc:
        _err(f"clear: cannot read {d}: {exc.strerror}; nothing removed")
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
        _err(f"{count(len(done.failed), 'file', 'files')} could not be removed: "
             + "; ".join(f"{name} ({why})" for name, why in done.failed[:5]))
        return EXIT_FAILED
    return EXIT_OK


# -- demo, bench -----------------------------------------------------------------------------

def _optional_module(name: str, command: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        raise _Usage(f"`rope-rtc {command}` is not available in this installation ({name} is missing)") from None


def _cmd_demo(args: argparse.Namespace) -> int:
    rc = _optional_module("rope_rtc.demo", "demo").main(args)
    return EXIT_OK if rc is None else int(rc)


def _cmd_bench(args: argparse.Namespace) -> int:
    argv = list(args.bench_args)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    rc = _optional_module("rope_rtc.bench", "bench").main(argv)
    return EXIT_OK if rc is None else int(rc)


# -- parser ----------------------------------------------------------------------------------

WARM_DESCRIPTION = ("Compile every registered kernel specialisation (the blog's demo kernels only when --kernels "
                    "names them) for each --arch into the disk cache "
                    "(no GPU needed). Entries already present and valid are left as they are. Under "
                    "ROPE_RTC_NO_COMPILE=1 only check, read-only, that the cache holds them all: exit 1 "
                    "listing those missing.")


DEMO_DESCRIPTION = ("With a GPU: run the blog's configuration (B=4, H=32, S=4096, D=128, FP32) through the blog's "
                    "three kernels and the production kernel, check each against the float64 reference and print "
                    "its bandwidth beside a same-size copy. Without a GPU: run the blog's worked example and "
                    "Hugging Face's rotate_half against apply_rope on the NumPy reference, in seconds and without "
                    "the CUDA toolchain; --warm also compiles the kernels for --arch into the cache.")


def _add_cache_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", metavar="D", default=None, type=_cache_dir_arg,
                   help="cache root, an absolute path like ROPE_RTC_CACHE_DIR (a version subdirectory is appended)")


def _add_warm_arguments(w: argparse.ArgumentParser) -> None:
    from .numerics.model import MAX_HEAD_DIM, MAX_HEADS
    from .build.registry import DEFAULT_TAIL_HEADS

    w.add_argument("--arch", action="append", metavar="ARCH",
                   help="architecture to build for, e.g. sm_90 (repeatable, or comma-separated); "
                        "default: those of this machine's GPUs")
    w.add_argument("--jobs", "-j", type=_positive_int, default=None, help="concurrent compiles (default: CPU count)")
    w.add_argument("--tail-heads", type=_int_list, default=list(DEFAULT_TAIL_HEADS), metavar="H,H,...",
                   help=f"head counts to build the tail kernel for (default: {','.join(map(str, DEFAULT_TAIL_HEADS))})")
    w.add_argument("--kernels", action="append", metavar="GLOB",
                   help="only kernels whose family or name matches (repeatable), e.g. 'tail' or 'rope*': '*' and "
                        "'?' are wildcards, brackets are literal (a kernel's name selects itself)")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = w.add_argument_group("one model's kernels (instead of every registered kernel)")
    m.add_argument("--model", metavar="CONFIG", default=None,
                   help="a Hugging Face config.json: warm exactly the kernels that model needs (head_dim, "
                        "num_attention_heads, num_key_value_heads, partial_rotary_factor, torch_dtype)")
    m.add_argument("--dtype", default=None, help="the model's dtype (bfloat16, float16, float32); overrides the config")
    m.add_argument("--head-dim", dest="head_dim", type=_positive_int, default=None,
                   help=f"head dim (1..{MAX_HEAD_DIM})")
    m.add_argument("--heads", dest="q_heads", type=_positive_int, default=None, help=f"q heads (1..{MAX_HEADS})")
    m.add_argument("--kv-heads", dest="kv_heads", type=_positive_int, default=None,
                   help=f"k/v heads (1..{MAX_HEADS})")
    m.add_argument("--rotary-dim", dest="rotary_dim", type=_positive_int, default=None,
                   help="rotated channels per head (default: head_dim x partial_rotary_factor)")
    m.add_argument("--interleaved", action="store_true",
                   help="adjacent pairs (RoFormer, GPT-J) instead of Hugging Face's half-split pairs; a --model "
                        "whose model_type rotates adjacent pairs (GPT-J, GLM, Cohere, ...) is read as such without it")
    m.add_argument("--qk-norm", dest="qk_norm", action="store_true",
                   help="also the fused per-head RMSNorm + RoPE builds (apply_qk_norm_rope); on by default for "
                        "Qwen3, Qwen3-Next, Qwen3.5 and Gemma 3 configs")
    m.add_argument("--inv-freq", dest="inv_freq", action="append", choices=("float64", "float32"),
                   help="also the builds that compute cos and sin from inv_freq of this dtype (apply_rope(..., "
                        "inv_freq=); float64: numerics 'exact', float32: 'transformers'); repeatable")
    w.set_defaults(func=_cmd_warm, command="warm")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rope-rtc",
        description="RoPE CUDA kernels compiled at run time with NVRTC: inspect, warm and manage the kernel cache.",
    )
    p.add_argument("--version", action="version", version=f"rope_rtc {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    cache_dir = argparse.ArgumentParser(add_help=False)
    _add_cache_dir(cache_dir)

    info = sub.add_parser("info", parents=[cache_dir], help="versions, CUDA headers, devices, cache (no GPU needed)")
    info.set_defaults(func=_cmd_info)

    w = sub.add_parser("warm", parents=[cache_dir],
                       help="compile every registered kernel for some architectures (no GPU needed)",
                       description=WARM_DESCRIPTION)
    _add_warm_arguments(w)

    c = sub.add_parser("cache", help="list, verify or clear the kernel cache")
    csub = c.add_subparsers(dest="cache_command", metavar="ACTION")
    for name, func, text in (
        ("list", _cmd_cache_list, "each entry (kernel, architecture, kind, size, created, key), sorted, and "
                                  "leftover temporary files"),
        ("verify", _cmd_cache_verify, "check every entry as the loader would; exit 1 naming any it would refuse"),
        ("clear", _cmd_cache_clear, "remove every entry, saved source and temporary file older than an hour "
                                    "(and nothing else)"),
    ):
        csub.add_parser(name, parents=[cache_dir], help=text, description=text).set_defaults(func=func)
    c.set_defaults(func=None, parser=c)

    d = sub.add_parser("demo", help="time the blog's kernels (GPU) or run the examples on the NumPy reference (no GPU)",
                       description=DEMO_DESCRIPTION)
    d.add_argument("--warm", action=argparse.BooleanOptionalAction, default=False,
                   help="without a GPU, also compile every kernel for --arch into the cache (default: no; "
                        "a GPU machine compiles what the demo runs on first use)")
    d.add_argument("--arch", default="sm_90", type=_arch_arg,
                   help="architecture --warm builds for (default sm_90)")
    d.add_argument("--cache-dir", metavar="D", default=None, type=_cache_dir_arg,
                   help="cache root --warm fills (an absolute path; default: ROPE_RTC_CACHE_DIR or the user cache)")
    d.set_defaults(func=_cmd_demo)

    b = sub.add_parser("bench", help="benchmark the kernels against a device copy (GPU)", add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark (try: bench --help)")
    b.set_defaults(func=_cmd_bench)
    return p


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, bad arguments: argparse has printed why
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return args.func(args)
        except (_Usage, SettingError) as exc:  # a bad ROPE_RTC_* value is the caller's to fix: no traceback
            _err(f"{args.command}: {exc}")
            return EXIT_USAGE
        except KeyboardInterrupt:
            _err("interrupted")
            return 130
        except BrokenPipeError:
            # The reader has gone (`rope-rtc cache list | head -5`): stop quietly, as a Unix tool
            # does, and keep the interpreter's final flush of stdout from failing again.
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            except (OSError, ValueError):
                pass
            return 128 + signal.SIGPIPE
        except OSError as exc:  # the environment (a directory, a disk), not a bug: one line, no traceback
            _err(f"{args.command}: {exc}")
            return EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # REMAINDER does not take a leading option ("bench --iters 5"): hand everything over as is.
        args = _parse(parser, ["bench"])
        if not isinstance(args, int):
            args.bench_args = argv[1:]
    else:
        args = _parse(parser, argv)
    if isinstance(args, int):
        return args
    if getattr(args, "func", None) is None:
        (getattr(args, "parser", None) or parser).print_help(sys.stderr)
        return EXIT_USAGE
    return _run(args)


def warm_main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """``rope-rtc warm`` as a program of its own (``scripts/warm_cache.py``), named ``prog``."""
    parser = argparse.ArgumentParser(prog=prog or os.path.basename(sys.argv[0]), description=WARM_DESCRIPTION)
    _add_cache_dir(parser)
    _add_warm_arguments(parser)
    args = _parse(parser, list(sys.argv[1:] if argv is None else argv))
    return args if isinstance(args, int) else _run(args)


if __name__ == "__main__":
    sys.exit(main())
