"""Command-line arguments of the benchmark: parsing, the default JSON path and the command
that regenerates a run (recorded in the results and the docs)."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from .cases import GROUPS, PEERS, parse_filter


# =============================================================================================
# arguments


# Seconds after which the remaining cases are skipped, and judged as misses. The quick run's keeps
# the device check (the GPU tests, then the quick run) within a 10-minute command.
QUICK_TIME_BUDGET_S = 320.0
# Each small case of a full run captures and replays graphs of a call per cold buffer set (up to
# 32,768), so the whole run takes well over 10 minutes on an H100: room for it, not a cut.
FULL_TIME_BUDGET_S = 2400.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rope-rtc bench", description="RoPE benchmarks: rope_rtc against a size-matched copy and every peer, one run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Groups: " + ", ".join(GROUPS) + ". Peers: " + ", ".join(PEERS) + ".")
    p.add_argument("--quick", action="store_true", help="fewer cases and repetitions (~6 min on an H100; every case takes well over 10)")
    p.add_argument("--cases", metavar="LIST",
                   help="comma-separated: group names, substrings of case ids or globs (e.g. 'blog,tail/T=1/*')")
    p.add_argument("--peers", metavar="LIST", default=",".join(PEERS),
                   help=f"peers to run (default: all of {','.join(PEERS)}; 'none' for none)")
    p.add_argument("--json", metavar="PATH", help="results file (default: $OUT/bench.json if $OUT is set, else ./bench.json)")
    p.add_argument("--plot", metavar="PATH", help="bandwidth plot (default: beside the JSON, bench.png)")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument("--write-docs", action="store_true",
                   help="regenerate docs/benchmarks.md and docs/benchmarks/<gpu>.json/.png (mirrored under $OUT when set)")
    p.add_argument("--docs-dir", metavar="DIR", help="where --write-docs writes (default: the checkout's docs/)")
    p.add_argument("--from-json", metavar="PATH", help="re-render a saved run (tables, targets, plot, docs); needs no GPU")
    p.add_argument("--merge-json", metavar="PATH",
                   help="with --from-json: replace that run's cases, host-cost tables and engine records by the "
                        "same ones of a later run (each keeps its own copy ceiling and peers); the docs list "
                        "what was replaced")
    p.add_argument("--targets", action="store_true", help="print only the target summary (PASS/MISS) at the end")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--compile-budget", type=float, metavar="S",
                   help="torch.compile: stop compiling new shapes after this many seconds (default 60 quick, 150 full)")
    p.add_argument("--time-budget", type=float, metavar="S",
                   help="skip the remaining cases after this many seconds (default 320 quick, 600 full)")
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the inputs")
    args = p.parse_args(argv)
    peers = parse_filter(args.peers) or []
    if peers == ["none"]:
        peers = []
    unknown = [x for x in peers if x not in PEERS]
    if unknown:
        p.error(f"--peers: unknown {', '.join(unknown)}; choose from {', '.join(PEERS)} or 'none'")
    args.peer_list = peers
    args.case_tokens = parse_filter(args.cases)
    if args.compile_budget is None:
        args.compile_budget = 60.0 if args.quick else 150.0
    if args.time_budget is None:
        args.time_budget = QUICK_TIME_BUDGET_S if args.quick else FULL_TIME_BUDGET_S
    return args


def default_json_path(args: argparse.Namespace) -> Path:
    if args.json:
        return Path(args.json)
    out = os.environ.get("OUT")
    return Path(out) / "bench.json" if out else Path("bench.json")


def regenerate_command(args: argparse.Namespace) -> str:
    parts = ["PYTHONPATH=.", "python3", "scripts/bench.py"]
    if args.quick:
        parts.append("--quick")
    if args.cases:
        parts += ["--cases", shlex.quote(args.cases)]
    if sorted(args.peer_list) != sorted(PEERS):
        parts += ["--peers", ",".join(args.peer_list) or "none"]
    # What else shapes the run's figures, where not the default: the same inputs, the same cases.
    quick = args.quick
    for flag, value, default in (("--compile-budget", args.compile_budget, 60.0 if quick else 150.0),
                                 ("--time-budget", args.time_budget, QUICK_TIME_BUDGET_S if quick else FULL_TIME_BUDGET_S),
                                 ("--seed", args.seed, 0)):
        if value != default:
            parts += [flag, str(value) if isinstance(value, int) else f"{value:.15g}"]
    return " ".join(parts + ["--write-docs"])


