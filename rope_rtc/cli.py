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
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from ._version import __version__

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
    return datetime.datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="seconds")


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
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,8,32") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 1,8,32")
    return values


def _disk_store(cache_dir: str | None):
    """A store over the versioned directory for inspection; never creates the directory."""
    from .cache import DiskStore, versioned_cache_dir
    from .env import settings

    return DiskStore(versioned_cache_dir(cache_dir), trust_shared=settings().trust_shared_cache, create=False)


def _entry_problem(error: str) -> str:
    if "Too many levels of symbolic links" in error:
        return "is a symbolic link (never followed)"
    return error


# -- info ------------------------------------------------------------------------------------

def _cmd_info(args: argparse.Namespace) -> int:
    from . import driver, toolchain
    from .env import settings

    rows: list[tuple[str, str]] = [
        ("rope_rtc", f"{__version__} ({Path(__file__).resolve().parent})"),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
    ]
    try:
        major, minor = toolchain.nvrtc_version()
        rows.append(("NVRTC", f"{major}.{minor}"))
    except Exception as exc:
        rows.append(("NVRTC", f"unavailable ({exc})"))
    rows.append(("cuda-bindings", _dist_version("cuda-bindings") or "not installed"))
    cupy_version = _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy")
    if cupy_version is None and importlib.util.find_spec("cupy") is not None:
        cupy_version = "installed (version unknown)"
    rows.append(("CuPy", cupy_version or "not installed (pip install 'rope-rtc[cuda13]' or '[cuda12]')"))
    rows.append(("NumPy", _dist_version("numpy") or "not installed"))
    rows.append(("ml_dtypes", _dist_version("ml_dtypes", "ml-dtypes") or "not installed"))

    gpu = driver.available()
    if gpu:
        try:
            v = driver.driver_version()
            rows.append(("CUDA driver", f"{v // 1000}.{(v % 1000) // 10}"))
        except Exception as exc:
            rows.append(("CUDA driver", f"unknown ({exc})"))
    else:
        rows.append(("CUDA driver", "none"))

    try:
        h = toolchain.cuda_headers()
        rows.append(("CUDA headers", f"{h.path} (CUDA {h.version_text}, from {h.origin})"))
    except Exception as exc:
        rows.append(("CUDA headers", f"not found ({exc})"))
    try:
        archs = toolchain.supported_archs()
        rows.append(("NVRTC archs", " ".join(f"sm_{a}" for a in archs)
                     + f" (rope_rtc builds sm_{toolchain.MIN_ARCH} and newer)"))
    except Exception as exc:
        rows.append(("NVRTC archs", f"unknown ({exc})"))

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
                rows.append((f"device {i}", f"unreadable ({exc})"))
    else:
        rows.append(("devices", f"no GPU found ({driver.unavailable_reason() or 'no CUDA device'})"))

    s = settings()
    store = _disk_store(args.cache_dir)
    listed = store.list()
    bad = sum(1 for e in listed if e.error)
    where = f"{store.directory}"
    if s.disable_disk_cache and args.cache_dir is None:
        where += " (disabled by ROPE_RTC_DISABLE_DISK_CACHE)"
    rows.append(("cache", where))
    contents = f"{len(listed)} entries, {_size(sum(e.size for e in listed))}"
    if bad:
        contents += f", {bad} unusable (rope-rtc cache verify names them)"
    if not store.directory.exists():
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
    from . import driver

    if not driver.available():
        raise _Usage(f"no GPU found ({driver.unavailable_reason() or 'no CUDA device'}); say which "
                     "architectures to build for, e.g. --arch sm_90 --arch sm_80")
    return [f"sm_{driver.device_arch(i)}" for i in range(driver.device_count())]


def _cmd_warm(args: argparse.Namespace) -> int:
    from . import warm as warming
    from .errors import RopeRtcError

    archs = [a for group in (args.arch or []) for a in group.split(",") if a.strip()] or _default_archs()
    try:
        report = warming.warm(archs, cache_dir=args.cache_dir, jobs=args.jobs,
                              tail_heads=tuple(args.tail_heads), kernels=args.kernels,
                              progress=not args.no_progress)
    except (RopeRtcError, ValueError) as exc:
        raise _Usage(str(exc)) from None
    print(f"warmed {report.total // len(report.targets)} kernels for "
          f"{', '.join(t.name for t in report.targets)} in {report.directory}")
    print(report.summary())
    if report.failed:
        print(f"{len(report.failed)} failed:", file=sys.stderr)
        for f in report.failed:
            print(f"- {f.kernel} for {f.target}: {f.error}", file=sys.stderr)
        hint = warming.no_compile_hint()
        if hint:
            print(hint, file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


# -- cache -----------------------------------------------------------------------------------

def _cmd_cache_list(args: argparse.Namespace) -> int:
    store = _disk_store(args.cache_dir)
    print(f"cache {store.directory}")
    if store.problem and store.directory.exists():
        print(f"note: {store.problem}")
    listed = store.list()
    for e in listed:
        if e.entry is not None:
            print(f"  {e.entry.kernel:<48} {e.entry.target:<12} {e.entry.kind:<5} {_size(e.size):>10}  "
                  f"{_when(e.entry.created)}")
        else:
            print(f"  UNUSABLE {e.path.name}: {_entry_problem(e.error or '')}")
    temps = store.temp_files()
    for p in temps:
        try:
            st = p.lstat()
            print(f"  temporary file {p.name} ({_size(st.st_size)}, {_when(st.st_mtime)}; left by an "
                  f"interrupted write unless a warm is running)")
        except OSError:
            pass
    sources = sorted(store.directory.glob("*.cu")) if store.directory.is_dir() else []
    total = sum(e.size for e in listed)
    print(f"{len(listed)} entries, {_size(total)}; {len(temps)} temporary files; {len(sources)} saved sources")
    return EXIT_OK


def _cmd_cache_verify(args: argparse.Namespace) -> int:
    store = _disk_store(args.cache_dir)
    listed = store.list()
    bad = []
    for e in listed:
        if e.error:
            bad.append(f"{e.path.name}: {_entry_problem(e.error)}")
        elif e.entry is not None and e.entry.rope_rtc != __version__:
            bad.append(f"{e.path.name}: built by rope_rtc {e.entry.rope_rtc}, not {__version__}")
    if bad:
        print(f"{len(bad)} of {len(listed)} entries in {store.directory} fail verification:", file=sys.stderr)
        for line in bad:
            print(f"- {line}", file=sys.stderr)
        print("they are deleted and rebuilt on next use; `rope-rtc warm` rebuilds them now", file=sys.stderr)
        return EXIT_FAILED
    temps = len(store.temp_files())
    print(f"all {len(listed)} entries in {store.directory} verified"
          + (f" ({temps} temporary files left by interrupted writes; `rope-rtc cache clear` removes them)"
             if temps else ""))
    return EXIT_OK


def _cmd_cache_clear(args: argparse.Namespace) -> int:
    store = _disk_store(args.cache_dir)
    d = store.directory
    if not d.is_dir():
        print(f"nothing to clear: {d} does not exist")
        return EXIT_OK
    counts = {what: len(list(d.glob(pattern))) for what, pattern in
              (("entries", "*.bin"), ("saved sources", "*.cu"), ("temporary files", ".tmp-*"))}
    removed = store.clear()
    print(f"removed {removed} files from {d} ({', '.join(f'{n} {w}' for w, n in counts.items())})")
    if removed < sum(counts.values()):
        _err(f"{sum(counts.values()) - removed} files could not be removed")
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

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rope-rtc",
        description="RoPE CUDA kernels compiled at run time with NVRTC: inspect, warm and manage the kernel cache.",
    )
    p.add_argument("--version", action="version", version=f"rope_rtc {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    cache_dir = argparse.ArgumentParser(add_help=False)
    cache_dir.add_argument("--cache-dir", metavar="D", default=None,
                           help="cache root, like ROPE_RTC_CACHE_DIR (a version subdirectory is appended)")

    info = sub.add_parser("info", parents=[cache_dir], help="versions, CUDA headers, devices, cache (no GPU needed)")
    info.set_defaults(func=_cmd_info)

    w = sub.add_parser("warm", parents=[cache_dir],
                       help="compile every registered kernel for some architectures (no GPU needed)",
                       description="Compile every registered kernel specialisation for each --arch into the "
                                   "disk cache. Entries already present and valid are left as they are.")
    w.add_argument("--arch", action="append", metavar="ARCH",
                   help="architecture to build for, e.g. sm_90 (repeatable, or comma-separated); "
                        "default: those of this machine's GPUs")
    w.add_argument("--jobs", "-j", type=_positive_int, default=None, help="concurrent compiles (default: CPU count)")
    from .registry import DEFAULT_TAIL_HEADS

    w.add_argument("--tail-heads", type=_int_list, default=list(DEFAULT_TAIL_HEADS), metavar="H,H,...",
                   help=f"head counts to build the tail kernel for (default: {','.join(map(str, DEFAULT_TAIL_HEADS))})")
    w.add_argument("--kernels", action="append", metavar="GLOB",
                   help="only kernels whose family or name matches (repeatable), e.g. 'tail' or 'rope*'")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.set_defaults(func=_cmd_warm)

    c = sub.add_parser("cache", help="list, verify or clear the kernel cache")
    csub = c.add_subparsers(dest="cache_command", metavar="ACTION")
    for name, func, text in (
        ("list", _cmd_cache_list, "each entry (kernel, target, kind, size, created) and leftover temporary files"),
        ("verify", _cmd_cache_verify, "check every entry; exit 1 naming any that is corrupt"),
        ("clear", _cmd_cache_clear, "remove every entry, saved source and temporary file"),
    ):
        csub.add_parser(name, parents=[cache_dir], help=text, description=text).set_defaults(func=func)
    c.set_defaults(func=None, parser=c)

    d = sub.add_parser("demo", help="run the blog's kernels (GPU) or the reference and a warm (no GPU)")
    d.add_argument("--cache-dir", metavar="D", default=None, help="cache root for the no-GPU warm")
    d.set_defaults(func=_cmd_demo)

    b = sub.add_parser("bench", help="benchmark the kernels against a device copy (GPU)", add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark (try: bench --help)")
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:
            # REMAINDER does not take a leading option ("bench --iters 5"): hand everything over as is.
            args = parser.parse_args(["bench"])
            args.bench_args = argv[1:]
        else:
            args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, bad arguments: argparse has printed why
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    func = getattr(args, "func", None)
    if func is None:
        (getattr(args, "parser", None) or parser).print_help(sys.stderr)
        return EXIT_USAGE
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return func(args)
        except _Usage as exc:
            _err(f"{args.command}: {exc}")
            return EXIT_USAGE
        except KeyboardInterrupt:
            _err("interrupted")
            return 130


if __name__ == "__main__":
    sys.exit(main())
