"""Measuring on the device: the yardstick every kernel is judged against (a device-to-device copy
of the same number of bytes) and GPU time per call by CUDA events, or under CUDA-graph replay for
calls too small to time one by one.

The demo times with :func:`gpu_us`; the benchmark (``rope_rtc.benchmark``) builds its rotations
and its copy kernel on :class:`CopyRunner` and times with its own adaptive clock. Library code,
so that the dependency points from the benchmark to the library and never back.
"""

from __future__ import annotations

import math
import statistics
from functools import partial


class CopyRunner:
    """Device-to-device copies moving ``moved`` bytes (half read, half written), n buffer sets."""

    def __init__(self, cp, stream, moved: int, n: int) -> None:
        self.half = max(moved // 2, 16)
        stride = -(-self.half // 256) * 256
        self.slab = cp.random.RandomState(1).standard_normal(size=(2 * n * stride) // 4, dtype=cp.float32)
        base = self.slab.data.ptr
        copy = cp.cuda.runtime.memcpyAsync
        kind = cp.cuda.runtime.memcpyDeviceToDevice
        self.pairs = [(base + 2 * i * stride, base + (2 * i + 1) * stride) for i in range(n)]  # (src, dst)
        self.fns = [partial(copy, dst, src, self.half, kind, stream.ptr) for src, dst in self.pairs]


def _burst_seconds(cp, stream, fn, calls: int) -> float:
    """GPU seconds of ``calls`` back-to-back calls of ``fn``, after one untimed call: the GPU works
    on that one while the start event is recorded, so the window holds the calls' GPU time and
    not the host's latency of the first call after a synchronisation."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    fn()
    start.record(stream)
    for _ in range(calls):
        fn()
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e-3


def gpu_us(cp, stream, fn, *, reps: int = 7, sample_s: float = 1e-3, max_calls: int = 2000) -> float:
    """Median GPU microseconds per call of ``fn`` (which launches on ``stream``): ``reps`` samples
    of CUDA events around enough back-to-back calls that a sample lasts about ``sample_s``.

    Parameters
    ----------
    cp
        The CuPy module.
    stream
        The CuPy stream ``fn`` launches on.
    fn
        A callable of no arguments that enqueues one call.
    reps
        Samples; the median is returned.
    sample_s
        Target length of one sample, in seconds of GPU time.
    max_calls
        The most calls one sample makes.
    """
    for _ in range(3):  # warm-up: first launches load modules and instantiate graphs
        fn()
    stream.synchronize()
    estimate = max(_burst_seconds(cp, stream, fn, 3) / 3, 1e-7)
    calls = max(1, min(max_calls, math.ceil(sample_s / estimate)))
    return statistics.median(_burst_seconds(cp, stream, fn, calls) / calls * 1e6 for _ in range(reps))


def graph_us(cp, fn, *, n: int = 200, samples: int = 5) -> float:
    """GPU µs per call of ``fn`` captured ``n`` times into one CUDA graph, best of ``samples``
    replays (``fn`` launches on CuPy's current stream): the time of a latency-bound call as a node
    among others, without the host's launch rate."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        for _ in range(n):
            fn()
        graph = stream.end_capture()
        graph.upload(stream)
        graph.launch(stream)
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        best = float("inf")
        for _ in range(samples):
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, end) / n * 1e3)
    return best


__all__ = ["CopyRunner", "gpu_us", "graph_us"]
