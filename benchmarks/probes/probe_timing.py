"""Timing helpers shared by the probes (host time per call; CUDA events; CUDA-graph replay for
latency-bound calls), and the decode arrays the host-cost probes cycle through."""

from __future__ import annotations

import gc
import time


def host_us(fn, n: int = 20000, reps: int = 5, warmup: int = 200) -> float:
    """Host µs per call of ``fn``: the best of ``reps`` loops of ``n`` calls (after ``warmup``
    untimed ones), with the garbage collector off."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    gc.disable()
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
    finally:
        gc.enable()
    return best


def event_us(fn, reps: int = 20) -> float:
    """µs per call of ``fn`` issued ``reps`` times back to back on the current stream (after one
    untimed call)."""
    import cupy as cp

    fn()
    cp.cuda.runtime.deviceSynchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / reps * 1e3


def graph_us(fn, n: int = 200, samples: int = 5) -> float:
    """GPU µs per call of ``fn`` captured ``n`` times into one CUDA graph, best of ``samples``
    replays (``fn`` must launch on CuPy's current stream): ``rope_rtc.measure.graph_us``."""
    import cupy as cp

    from rope_rtc.measure import graph_us as measure_graph_us

    return measure_graph_us(cp, fn, n=n, samples=samples)


def decode_sets(cp, rng, n: int = 64) -> list:
    """``n`` new (q, k, offsets) sets of a bf16 decode step, bshd [8, 1, 32|8, 128] with int32
    offsets below 4000: the arrays the host-cost probes cycle through, so that no call finds the
    previous call's arrays."""
    import ml_dtypes
    import numpy as np

    bf16 = ml_dtypes.bfloat16
    return [(cp.asarray(rng.standard_normal((8, 1, 32, 128)).astype(bf16)),
             cp.asarray(rng.standard_normal((8, 1, 8, 128)).astype(bf16)),
             cp.asarray(rng.integers(0, 4000, 8).astype(np.int32))) for _ in range(n)]
