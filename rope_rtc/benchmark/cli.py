"""The benchmark's entry point: ``--list``, ``--from-json`` re-rendering, or a run on the GPU
(``rope-rtc bench``, ``scripts/bench.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .arguments import default_json_path, parse_args
from .cases import all_cases, selected
from .engine import engine_job_selected, engine_jobs
from .report import merge_results, report
from .runner import gpu_unavailable_reason, run_benchmark


# =============================================================================================
# entry point


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for c in all_cases(args.quick):
            if selected(c.id, c.group, args.case_tokens):
                print(f"{c.id:<40} {c.bytes_moved() / 1e6:12.3f} MB moved")
        for g in ("host", "coldstart"):
            if selected(g, g, args.case_tokens):
                print(f"{g} (section)")
        for name, _, _ in engine_jobs(args.quick):  # the engine section's jobs, as --cases selects them
            if engine_job_selected(name, args.case_tokens):
                print(f"engine/{name} (engine)")
        return 0
    if args.from_json:
        try:
            result = _saved_run(args.from_json, "--from-json")
            if args.merge_json:
                result = merge_results(result, _saved_run(args.merge_json, "--merge-json"))
        except ValueError as exc:
            print(f"rope-rtc bench: {exc}", file=sys.stderr)
            return 2
        report(result, args, Path(args.json) if args.json else None)
        return 0
    reason = gpu_unavailable_reason()
    if reason is not None:
        print(f"rope-rtc bench: no GPU found: {reason}; nothing to measure.\n"
              "Run it on a machine with an NVIDIA GPU, or re-render a saved run: --from-json bench.json",
              file=sys.stderr)
        return 2
    json_path = default_json_path(args)
    result = run_benchmark(args)
    report(result, args, json_path)
    return 0


def _saved_run(path: str, flag: str) -> dict:
    """A run saved by ``--json``; ValueError naming ``flag`` and the file when it cannot be read."""
    try:
        run = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:  # missing, unreadable, not JSON (JSONDecodeError is a ValueError)
        raise ValueError(f"{flag}: cannot read {path}: {exc} (pass a file written by --json)") from None
    if not isinstance(run, dict) or not isinstance(run.get("cases"), list):
        raise ValueError(f"{flag}: {path} is not a benchmark run (no 'cases'; pass a file written by --json)")
    return run


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
