"""What the engine records are built from: the record and row dicts every job fills, the timing
of a row's calls (CuPy or torch work, replayed from a CUDA graph when small) and the row of the
same-size copy.
"""

from __future__ import annotations

from ..cases import COPY
from ..impls import _cupy_capture


def _record(ident: str, params: dict, moved: int) -> dict:
    return {"id": ident, "group": "engine", "params": params, "bytes_moved": moved, "rows": []}


def _row(impl: str, timings: dict, note: str = "", check: str = "-") -> dict:
    return {"impl": impl, "layout": "-", "check": check, "note": note, "timings": timings}


def _timed_torch(ctx, measure, torch, fn, small: bool) -> dict:
    """``measure``'s timings of ``fn``, torch work on the benchmark's stream: replayed from a CUDA
    graph when the record is small, as the general peers are captured."""
    from ..timing import capture_torch

    def capture(indices):
        return capture_torch(torch, [fn for _ in indices])

    return measure(ctx, [fn], capture if small else None, small, 1)


def _timed(ctx, measure, fns: list, small: bool) -> dict:
    """``measure``'s timings of ``fns``, work on the benchmark's CuPy stream: replayed from a
    CUDA graph when the record is small (decode), as the general cases' small calls are."""
    return measure(ctx, fns, _cupy_capture(ctx, fns) if small else None, small, 1)


def _copy_row(cp, ctx, measure, copy_runner, moved: int, small: bool, impl: str = COPY) -> dict:
    """The row of a device-to-device copy of ``moved`` bytes (read and written), timed as the
    record's own rows are: the ceiling its percentages are of."""
    copy = copy_runner(cp, ctx.stream, moved, 1)
    return _row(impl, _timed(ctx, measure, copy.fns, small), f"cudaMemcpyAsync of {copy.half} bytes")
