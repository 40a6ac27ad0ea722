#!/usr/bin/env python3
"""Benchmark rope_rtc against a size-matched device copy and every importable peer, in one run.

    PYTHONPATH=. python3 scripts/bench.py --quick          # ~3 min on an H200
    PYTHONPATH=. python3 scripts/bench.py                  # every case, ~8 min
    PYTHONPATH=. python3 scripts/bench.py --write-docs     # also regenerate docs/benchmarks.md
    python3 scripts/bench.py --help

The same as ``rope-rtc bench``; everything lives in the rope_rtc/benchmark/ package.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout works without installing

from rope_rtc.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
