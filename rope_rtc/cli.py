"""``rope-rtc``: information, offline cache warming, cache maintenance, the demo and the benchmark.

Every subcommand except ``demo`` and ``bench`` works on a machine without a GPU: devices are
asked for through the CUDA driver bindings (never by importing CuPy), and NVRTC runs on the CPU.

Exit codes: 0 success; 1 the work failed (a kernel did not compile, an entry is corrupt);
2 the command could not start (bad arguments, no architecture, a module that is missing).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import signal
import sys
import warnings
from collections.abc import Sequence

from ._version import __version__
from .commands.cache import cmd_clear, cmd_list, cmd_verify
from .commands.info import cmd_info
from .commands.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Usage, err
from .errors import SettingError, shown


# -- small helpers ---------------------------------------------------------------------------

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
    from .build.toolchain import MIN_ARCH, parse_arch

    try:
        arch = parse_arch(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if arch < MIN_ARCH:  # what warm refuses too (warm.resolve_targets)
        raise argparse.ArgumentTypeError(f"{text!r}: rope_rtc needs sm_{MIN_ARCH} or newer")
    return text


# -- warm ------------------------------------------------------------------------------------

def _default_archs() -> list[str]:
    from .core import driver

    if not driver.available():
        raise Usage(f"no GPU found: {driver.unavailable_reason() or 'no CUDA device'}; say which "
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
                              progress=not args.no_progress, specs=None if model is None else model.specs(),
                              pdl=args.pdl)
    except (RopeRtcError, ValueError) as exc:
        raise Usage(str(exc)) from None
    report.selection = _warm_selection(args)
    if model is not None:
        print(f"model: head_dim {model.head_dim}, {model.q_heads} q heads, {model.kv_heads} kv heads, rotary_dim "
              f"{model.rotary_dim}, {model.dtype}, {'interleaved' if model.interleaved else 'half-split'} pairs"
              + (f", MRoPE sections {list(model.mrope_section)}" + (" interleaved" if model.mrope_interleaved else "")
                 if model.mrope_section else "")
              + (", per-head QK-norm" if model.qk_norm else "")
              + (f", vision tower: head_dim {model.vision[0]}, {model.vision[1]} heads (axial RoPE)"
                 if model.vision else "")
              + (f", multi-head latent attention (kv_lora_rank {model.mla[0]}, qk_nope_head_dim {model.mla[1]})"
                 if model.mla else "")
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
    flags += ["--pdl"] * bool(args.pdl)
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

# -- demo, bench -----------------------------------------------------------------------------

def _optional_module(name: str, command: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        raise Usage(f"`rope-rtc {command}` is not available in this installation ({name} is missing)") from None


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
                   help="architecture to build for, e.g. sm_90 (repeatable, or comma-separated); compute_XX "
                        "builds PTX, what a GPU newer than NVRTC loads; default: those of this machine's GPUs")
    w.add_argument("--jobs", "-j", type=_positive_int, default=None, help="concurrent compiles (default: CPU count)")
    w.add_argument("--tail-heads", type=_int_list, default=list(DEFAULT_TAIL_HEADS), metavar="H,H,...",
                   help=f"head counts to build the tail kernel for (default: {','.join(map(str, DEFAULT_TAIL_HEADS))})")
    w.add_argument("--kernels", action="append", metavar="GLOB",
                   help="only kernels whose family or name matches (repeatable), e.g. 'tail' or 'rope*': '*' and "
                        "'?' are wildcards, brackets are literal (a kernel's name selects itself)")
    w.add_argument("--pdl", action="store_true",
                   help="also the builds of the selected RoPE kernels that pdl=True plans load (programmatic "
                        "dependent launch), for sm_90 and newer")
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
    info.set_defaults(func=cmd_info)

    w = sub.add_parser("warm", parents=[cache_dir],
                       help="compile every registered kernel for some architectures (no GPU needed)",
                       description=WARM_DESCRIPTION)
    _add_warm_arguments(w)

    c = sub.add_parser("cache", help="list, verify or clear the kernel cache")
    csub = c.add_subparsers(dest="cache_command", metavar="ACTION")
    for name, func, text in (
        ("list", cmd_list, "each entry (kernel, architecture, kind, size, created, key), sorted, and "
                         "leftover temporary files"),
        ("verify", cmd_verify, "check every entry as the loader would; exit 1 naming any it would refuse"),
        ("clear", cmd_clear, "remove every entry, saved source and temporary file older than an hour "
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
        except (Usage, SettingError) as exc:  # a bad ROPE_RTC_* value is the caller's to fix: no traceback
            err(f"{args.command}: {exc}")
            return EXIT_USAGE
        except KeyboardInterrupt:
            err("interrupted")
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
            err(f"{args.command}: {exc}")
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
