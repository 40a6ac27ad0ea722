"""What the engine records are built from: the record and row dicts every job fills, and the
CUDA-graph capture of a torch peer (the MRoPE, QK-norm and angles peers use it).
"""

from __future__ import annotations


def _record(ident: str, params: dict, moved: int) -> dict:
    return {"id": ident, "group": "engine", "params": params, "bytes_moved": moved, "rows": []}


def _row(impl: str, timings: dict, note: str = "", check: str = "-") -> dict:
    return {"impl": impl, "layout": "-", "check": check, "note": note, "timings": timings}


def _torch_capture(ctx, torch, fn):
    """Capture ``fn`` (torch work on the benchmark's stream) into a CUDA graph, as the general
    peers are captured."""
    from ..timing import capture_torch

    def capture(indices):
        return capture_torch(torch, [fn for _ in indices])

    return capture
