"""The benchmark's own GPU helpers (rope_rtc/benchmark/runner.py): the spin kernel that host
timings queue behind, and the naive copy kernel shown beside every tail case."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gpu_util import after_current_stream

pytestmark = pytest.mark.gpu


def test_gpu_hold_keeps_the_stream_busy_and_calls_queue_behind_it(cp):
    from rope_rtc.benchmark.runner import GpuHold

    stream = cp.cuda.Stream(non_blocking=True)
    hold = GpuHold(stream, cp.cuda.Device().id)
    x = cp.zeros(1, cp.float32)
    after_current_stream(cp, stream)  # the zero fill, made on the current stream
    start, end = cp.cuda.Event(), cp.cuda.Event()
    hold(10.0)  # loads the module, and compiles CuPy's kernel for ``x += 1``, outside the timed part
    with stream:
        x += 1
    stream.synchronize()
    start.record(stream)
    t0 = time.perf_counter()
    hold(3000.0)
    with stream:
        x += 1  # queued behind the hold
    issued = time.perf_counter() - t0
    end.record(stream)
    end.synchronize()
    gpu_ms = cp.cuda.get_elapsed_time(start, end)
    assert 2.9 <= gpu_ms < 100, gpu_ms  # the GPU waited about 3 ms
    assert issued < 2e-3, issued        # the host did not
    assert float(x.get()[0]) == 2.0


def test_copy_kernel_copies_every_byte(cp):
    from rope_rtc.benchmark.runner import CopyKernelRunner, CopyRunner

    stream = cp.cuda.Stream(non_blocking=True)
    copy = CopyRunner(cp, stream, 2 * 4096 + 2 * 48, 2)  # 4144 bytes each way, a 16-byte multiple
    after_current_stream(cp, stream)  # the slab's random fill, made on the current stream
    for src, dst in copy.pairs:
        cp.cuda.runtime.memsetAsync(dst, 0xFF, copy.half, stream.ptr)
    kern = CopyKernelRunner(stream, copy, cp.cuda.Device().id)
    for f in kern.fns:
        f()
    stream.synchronize()
    slab = cp.asnumpy(copy.slab).view(np.uint8)
    base = copy.slab.data.ptr
    for src, dst in copy.pairs:
        s, d = src - base, dst - base
        assert np.array_equal(slab[s:s + copy.half], slab[d:d + copy.half])
