"""The benchmark's vision-tower case (engine/vision-axial: Qwen2.5-VL's 16 heads of 80 channels,
one 128 x 128-patch image in merge order, bf16 q and k rotated in place by ``MRopePlan`` on two
position streams) for Nsight Compute, and beside what its head dim and its second stream cost.

    PYTHONPATH=. python3 benchmarks/probes/vision_case.py ncu
        one warm-up and two launches of the MRoPE kernel (profile the last:
        ncu -k regex:rope_fixed --launch-skip 2 --launch-count 1 ...)
    PYTHONPATH=. python3 benchmarks/probes/vision_case.py bounds
        GPU µs with a cold L2 (a 256 MiB fill before each launch; best of 15) of: a copy of the
        same bytes (cudaMemcpyAsync); the MRoPE plan; RopePlan on the same q and k with one
        position stream (what the second stream costs); RopePlan on q and k of the same bytes
        with 10 heads of 128 channels (what the head dim of 80 costs).
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

import rope_rtc
from rope_rtc.benchmark.engine.vision import VISION_GRID, VISION_HEADS, vision_bytes_moved

HEADS, DIM = VISION_HEADS
FLUSH_BYTES = 256 << 20  # over 4x the L2 of an H100 or H200


def _case():
    import cupy as cp

    rng = np.random.default_rng(0)
    pos_h = rope_rtc.vision_positions([VISION_GRID], spatial_merge_size=2)
    n = pos_h.shape[1]
    q = cp.asarray(rng.standard_normal((n, HEADS, DIM), dtype=np.float32).astype(ml_dtypes.bfloat16))
    k = cp.asarray(rng.standard_normal((n, HEADS, DIM), dtype=np.float32).astype(ml_dtypes.bfloat16))
    pos = cp.asarray(pos_h)
    cos, sin = rope_rtc.axial_tables(max(VISION_GRID[1:]), DIM, style="same", xp=cp)
    plan = rope_rtc.MRopePlan(q, k, cos, sin, pos, (DIM // 4, DIM // 4)).compile()
    return plan, (q, k, cos, sin, pos), pos_h


def ncu() -> None:
    import cupy as cp

    plan, args, _ = _case()
    for _ in range(3):
        plan.execute(*args)
    cp.cuda.runtime.deviceSynchronize()


def _cold_us(fn, flush) -> float:
    import cupy as cp

    best = float("inf")
    for _ in range(15):
        flush.fill(1)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, end) * 1e3)
    return best


def bounds() -> None:
    import cupy as cp

    plan, (q, k, cos, sin, pos), pos_h = _case()
    n = pos_h.shape[1]
    moved = vision_bytes_moved(n)
    src, dst = cp.empty(moved // 2, cp.uint8), cp.empty(moved // 2, cp.uint8)
    one = cp.asarray(pos_h[0].astype(np.int64))
    cos80, sin80 = rope_rtc.rope_tables(4096, DIM, xp=cp)
    plain = rope_rtc.RopePlan(q, k, cos80, sin80, positions=one, layout="thd").compile()
    heads128 = HEADS * DIM // 128  # the same bytes per token in heads of 128 channels
    rng = np.random.default_rng(1)
    q128 = cp.asarray(rng.standard_normal((n, heads128, 128), dtype=np.float32).astype(ml_dtypes.bfloat16))
    k128 = q128.copy()
    cos128, sin128 = rope_rtc.rope_tables(4096, 128, xp=cp)
    wide = rope_rtc.RopePlan(q128, k128, cos128, sin128, positions=one, layout="thd").compile()
    rows = {
        "copy (same bytes)": lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, moved // 2, 3,
                                                                 cp.cuda.get_current_stream().ptr),
        "MRopePlan, two streams": lambda: plan.execute(q, k, cos, sin, pos),
        f"RopePlan, one stream, {HEADS} x {DIM}": lambda: plain.execute(q, k, cos80, sin80, one),
        f"RopePlan, one stream, {heads128} x 128": lambda: wide.execute(q128, k128, cos128, sin128, one),
    }
    flush = cp.empty(FLUSH_BYTES, cp.uint8)
    for _ in range(2):
        us = {name: _cold_us(fn, flush) for name, fn in rows.items()}
        copy = us["copy (same bytes)"]
        for name, t in us.items():
            print(f"N={n} {name:<34} {t:8.2f} µs  {100 * copy / t:5.1f}% of the copy")


if __name__ == "__main__":
    ncu() if sys.argv[1:] == ["ncu"] else bounds()
