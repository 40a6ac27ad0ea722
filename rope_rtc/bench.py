"""The benchmark's entry point (``rope-rtc bench``, ``scripts/bench.py``, ``python -m rope_rtc.bench``).

The benchmark itself lives in the :mod:`rope_rtc.benchmark` package; its docstring describes the method.

    PYTHONPATH=. python3 scripts/bench.py --list         # the cases, without running anything
"""

from __future__ import annotations

from .benchmark.cli import main

__all__ = ["main"]

if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
