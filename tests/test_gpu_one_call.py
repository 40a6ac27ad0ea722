"""The one-call functions on the GPU: per-thread plans under concurrency, bit-equality with a
plan, the position debug switch, and the NumPy round trip's stream."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from gpu_util import bits, host_random, host_tables
from rope_rtc.core import dispatch

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16
B, HQ, HK, D, ROWS = 8, 32, 8, 128, 4096


def test_eight_threads_own_arrays_and_streams_exact(cp):
    """8 threads, 1,000 apply_rope_qk calls each on their own arrays and streams: every result
    equals, bit for bit, what one call of the same kernel gave on the main thread, and no thread
    ever ran another thread's plan."""
    import rope_rtc
    from rope_rtc.ops import rope

    cos_h, sin_h = host_tables(ROWS, D // 2, 0)
    cos, sin = cp.asarray(cos_h), cp.asarray(sin_h)
    work = []  # per thread: [(q, k, starts, q_out, k_out, expected q bits, expected k bits)]
    for t in range(8):
        sets = []
        for j in range(4):
            q = cp.asarray(host_random((B, 1, HQ, D), BF16, seed=100 * t + j))
            k = cp.asarray(host_random((B, 1, HK, D), BF16, seed=100 * t + j + 50))
            starts = cp.asarray(np.random.default_rng(t * 7 + j).integers(0, ROWS - 1, B).astype(np.int32))
            eq, ek = rope_rtc.apply_rope_qk(q, k, cos, sin, offset=starts, layout="bshd")
            sets.append((q, k, starts, cp.full(q.shape, np.nan, BF16), cp.full(k.shape, np.nan, BF16),
                         bits(cp.asnumpy(eq)), bits(cp.asnumpy(ek))))
        work.append(sets)
    cp.cuda.runtime.deviceSynchronize()
    errors: list = []
    plans: dict[int, set] = {}
    start = threading.Barrier(8)

    def worker(t: int) -> None:
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            sets = work[t]
            start.wait()
            for i in range(1000):
                q, k, starts, qo, ko = sets[i % len(sets)][:5]
                rope_rtc.apply_rope_qk(q, k, cos, sin, offset=starts, q_out=qo, k_out=ko, stream=stream, layout="bshd")
            stream.synchronize()
            plans[t] = {id(p) for p in rope.ONE_CALL.thread().by_key.values()}
            for _, _, _, qo, ko, eq, ek in sets:
                assert np.array_equal(bits(cp.asnumpy(qo)), eq), f"thread {t}: q differs"
                assert np.array_equal(bits(cp.asnumpy(ko)), ek), f"thread {t}: k differs"
        except Exception as exc:  # reported on the main thread
            errors.append((t, exc))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert all(len(p) == 1 for p in plans.values())
    assert len(set().union(*plans.values())) == 8


def test_one_call_matches_a_plan_bit_for_bit_with_new_arrays_each_call(cp):
    import rope_rtc

    cos_h, sin_h = host_tables(ROWS, D // 2, 1)
    cos, sin = cp.asarray(cos_h), cp.asarray(sin_h)
    q0 = cp.asarray(host_random((B, 1, HQ, D), BF16, seed=1))
    k0 = cp.asarray(host_random((B, 1, HK, D), BF16, seed=2))
    starts = cp.asarray(np.arange(B, dtype=np.int32) * 300)
    plan = rope_rtc.RopePlan(q0, k0, cos, sin, offset=starts, q_out=cp.empty_like(q0),
                             k_out=cp.empty_like(k0), layout="bshd").compile()
    pq, pk = cp.full_like(q0, np.nan), cp.full_like(k0, np.nan)
    plan.execute(q0, k0, cos, sin, q_out=pq, k_out=pk, offset=starts)
    for _ in range(3):  # new arrays (copies) of the one signature
        q, k = q0.copy(), k0.copy()
        qo, ko = rope_rtc.apply_rope_qk(q, k, cos, sin, offset=starts, layout="bshd")
        assert np.array_equal(bits(cp.asnumpy(qo)), bits(cp.asnumpy(pq)))
        assert np.array_equal(bits(cp.asnumpy(ko)), bits(cp.asnumpy(pk)))
        q2 = q0.copy()
        assert rope_rtc.apply_rope(q2, cos, sin, offset=starts, out=q2, layout="bshd") is q2
        assert np.array_equal(bits(cp.asnumpy(q2)), bits(cp.asnumpy(pq)))


def test_allocated_outputs_come_from_the_current_allocator(cp):
    """The outputs the one-call functions allocate come from CuPy's current allocator (here one
    that counts and fills its memory with NaN bits), one allocation of the output's bytes each,
    as C-contiguous arrays of the input's shape and dtype, every element written."""
    import rope_rtc
    from rope_rtc.reference import tail_rope_reference

    pool = cp.get_default_memory_pool()
    sizes: list[int] = []

    def poisoned(nbytes):
        mem = pool.malloc(nbytes)
        cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, nbytes, cp.cuda.get_current_stream().ptr)
        sizes.append(nbytes)
        return mem

    cos_h, sin_h = host_tables(ROWS, D // 2, 2)
    cos, sin = cp.asarray(cos_h), cp.asarray(sin_h)
    q = cp.asarray(host_random((B, 1, HQ, D), BF16, seed=3))
    k = cp.asarray(host_random((B, 1, HK, D), BF16, seed=4))
    starts = cp.asarray(np.arange(B, dtype=np.int32) * 100)
    want_q, want_k = (cp.full_like(a, np.nan) for a in (q, k))
    rope_rtc.RopePlan(q, k, cos, sin, offset=starts, q_out=want_q, k_out=want_k, layout="bshd").compile().execute(
        q, k, cos, sin, offset=starts, q_out=want_q, k_out=want_k)
    x = cp.asarray(host_random((4, 8, 512), BF16, seed=5))
    ang = np.random.default_rng(6).uniform(-3, 3, (4, 32))
    c, s = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
    for _ in range(3):  # the first call and the repeat path (a caller's allocator: nothing is recycled)
        sizes.clear()
        with cp.cuda.using_allocator(poisoned):
            qo, ko = rope_rtc.apply_rope_qk(q, k, cos, sin, offset=starts, layout="bshd")
            xo = rope_rtc.apply_rope(q, cos, sin, offset=starts, layout="bshd")
            to = rope_rtc.tail_rope(x, c, s)["out"]
        assert sizes == [q.nbytes, k.nbytes, q.nbytes, x.nbytes]
        for got, want in ((qo, want_q), (ko, want_k), (xo, want_q)):
            assert got.flags.c_contiguous and got.shape == want.shape and got.dtype == want.dtype
            assert np.array_equal(bits(cp.asnumpy(got)), bits(cp.asnumpy(want)))
        assert to.flags.c_contiguous and to.shape == x.shape
        assert np.array_equal(bits(cp.asnumpy(to)),
                              bits(tail_rope_reference(cp.asnumpy(x), cp.asnumpy(c), cp.asnumpy(s))))


def test_recycled_outputs_are_written_whole_and_live_ones_are_left_alone(cp, monkeypatch):
    """From CuPy's default pool, an output the caller let go of comes back from the next call of
    its signature without an allocation (the same memory, poisoned with NaN bits in between): every
    element is written again, bit-equal to a plan's result. An output the caller still holds, or
    whose memory an alias built on its pointer reaches (``as_strided``), is never handed out, and
    its contents stay."""
    from cupy.lib.stride_tricks import as_strided

    import rope_rtc
    from rope_rtc.core import outputs as launch
    from rope_rtc.reference import tail_rope_reference

    cos_h, sin_h = host_tables(ROWS, D // 2, 2)
    cos, sin = cp.asarray(cos_h), cp.asarray(sin_h)
    qs = [cp.asarray(host_random((B, 1, HQ, D), BF16, seed=20 + i)) for i in range(2)]
    ks = [cp.asarray(host_random((B, 1, HK, D), BF16, seed=30 + i)) for i in range(2)]
    starts = cp.asarray(np.arange(B, dtype=np.int32) * 100)
    want = []
    for q, k in zip(qs, ks):
        wq, wk = (cp.full_like(a, np.nan) for a in (q, k))
        rope_rtc.RopePlan(q, k, cos, sin, offset=starts, q_out=wq, k_out=wk, layout="bshd").compile().execute(
            q, k, cos, sin, offset=starts, q_out=wq, k_out=wk)
        want.append((bits(cp.asnumpy(wq)), bits(cp.asnumpy(wk))))
    x = [cp.asarray(host_random((4, 8, 512), BF16, seed=40 + i)) for i in range(2)]
    ang = np.random.default_rng(6).uniform(-3, 3, (4, 32))
    c, s = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
    want_tail = [bits(tail_rope_reference(cp.asnumpy(xi), cp.asnumpy(c), cp.asnumpy(s))) for xi in x]
    stream = cp.cuda.get_current_stream()
    sizes: list[int] = []  # the outputs allocated (not recycled), by bytes
    new_array = launch._new_array

    def counting(shape, dtype, device, handle, current):
        out = new_array(shape, dtype, device, handle, current)
        sizes.append(out.nbytes)
        return out

    monkeypatch.setattr(launch, "_new_array", counting)

    def poison(*arrays):
        for a in arrays:
            cp.cuda.runtime.memsetAsync(a.data.ptr, 0xFF, a.nbytes, stream.ptr)

    def calls(i):
        qo, ko = rope_rtc.apply_rope_qk(qs[i], ks[i], cos, sin, offset=starts, layout="bshd")
        xo = rope_rtc.apply_rope(qs[i], cos, sin, offset=starts, layout="bshd")
        return qo, ko, xo, rope_rtc.tail_rope(x[i], c, s)["out"]

    def check(outs, i):
        for got, w in zip(outs, (want[i][0], want[i][1], want[i][0], want_tail[i])):
            assert got.flags.c_contiguous and np.array_equal(bits(cp.asnumpy(got)), w)

    for i in (0, 1, 0):
        rope_rtc.release_outputs()
        outs = calls(i)
        ptrs = sorted(a.data.ptr for a in outs)
        poison(*outs)
        del outs
        sizes.clear()
        outs = calls(i)
        assert sizes == [] and sorted(a.data.ptr for a in outs) == ptrs, "the outputs were not recycled"
        check(outs, i)
        # Held: the next calls allocate and leave these alone.
        held = [(a.data.ptr, bits(cp.asnumpy(a))) for a in outs]
        j = 1 - i
        sizes.clear()
        new = calls(j)
        assert sizes == [qs[j].nbytes, ks[j].nbytes, qs[j].nbytes, x[j].nbytes]
        assert not {a.data.ptr for a in new} & {p for p, _ in held}
        check(new, j)
        for a, (_, before) in zip(outs, held):
            assert np.array_equal(bits(cp.asnumpy(a)), before)
        del outs, new, held
    # An alias on the output's pointer keeps its memory: not recycled.
    rope_rtc.release_outputs()
    xo = rope_rtc.apply_rope(qs[0], cos, sin, offset=starts, layout="bshd")
    alias = as_strided(xo)
    del xo
    sizes.clear()
    xn = rope_rtc.apply_rope(qs[1], cos, sin, offset=starts, layout="bshd")
    assert sizes == [qs[1].nbytes] and xn.data.ptr != alias.data.ptr
    assert np.array_equal(bits(cp.asnumpy(alias)), want[0][0])
    rope_rtc.release_outputs()


def test_check_positions_switch_reads_device_positions_back(cp, monkeypatch):
    import rope_rtc

    cos_h, sin_h = host_tables(64, 8, 2)
    cos, sin = cp.asarray(cos_h), cp.asarray(sin_h)
    x = cp.asarray(host_random((2, 3, 2, 16), np.float32, seed=3))
    x0 = cp.asnumpy(x)
    bad = cp.asarray(np.array([[0, 1, 2], [5, 64, 7]], np.int32))
    # Without the switch a device-side position is not read back: its token gets NaN.
    out = rope_rtc.apply_rope(x, cos, sin, positions=bad, layout="bshd")
    assert np.isnan(cp.asnumpy(out)[1, 1]).all() and not np.isnan(cp.asnumpy(out)[0]).any()
    monkeypatch.setenv("ROPE_RTC_CHECK_POSITIONS", "1")
    from rope_rtc.ops import rope

    monkeypatch.setattr(rope.ONE_CALL, "_local", dispatch.ThreadState())  # plans read the switch when made
    with pytest.raises(ValueError, match=r"positions: entry 4 is 64, outside the table's 64 rows"):
        rope_rtc.apply_rope(x, cos, sin, positions=bad, out=x, layout="bshd")
    assert np.array_equal(cp.asnumpy(x), x0)
    plan = rope_rtc.RopePlan(x, None, cos, sin, positions=bad, layout="bshd").compile()
    with pytest.raises(ValueError, match="positions: entry 4 is 64"):
        plan.execute(x, None, cos, sin, positions=bad)
    cu = cp.asarray(np.array([0, 4, 3], np.int32))
    t = x.reshape(6, 2, 16)
    with pytest.raises(ValueError, match="cu_seqlens: must be non-decreasing"):
        rope_rtc.apply_rope(t, cos, sin, layout="thd", cu_seqlens=cu, out=t)
    assert np.array_equal(cp.asnumpy(x), x0)


def test_numpy_round_trip_waits_for_the_stream_it_launched_on(cp):
    """NumPy in, NumPy out on a stream other than the current one, while that stream is busy:
    the copy back must wait for the kernel on that stream (not on the current stream)."""
    import rope_rtc
    from rope_rtc.benchmark.runner import GpuHold

    cos, sin = host_tables(64, 16, 4)
    x = host_random((2, 5, 4, 32), np.float32, seed=5)
    stream = cp.cuda.Stream(non_blocking=True)
    hold = GpuHold(stream, cp.cuda.runtime.getDevice())
    want = rope_rtc.apply_rope(x, cos, sin, offset=3, backend="numpy", layout="bshd")
    for _ in range(3):
        hold(20_000)  # 20 ms of GPU work queued ahead of the kernel on `stream`
        got = rope_rtc.apply_rope(x, cos, sin, offset=3, stream=stream, layout="bshd")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
