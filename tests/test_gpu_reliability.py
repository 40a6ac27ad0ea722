"""Reliability on the GPU: threads and streams, two devices, resource and launch
failures, big tensors through every kernel."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gpu_util import DTYPES, bits, host_random, host_tables
from rope_rtc.ops.blog import prepare_blog_variant
from rope_rtc.reference import assert_rope_close, rope_reference, tail_rope_reference
from tail_cases import tail_random_inputs


def _check_general(cp, got, x, cos, sin, pos):
    xc = x.reshape(-1, x.shape[-2], x.shape[-1])
    assert_rope_close(cp.asnumpy(got).reshape(xc.shape), rope_reference(xc, cos, sin, pos, interleaved=False), xc,
                      interleaved=False, dtype=xc.dtype)


@pytest.mark.gpu
def test_threads_on_separate_streams_exact(cp):
    """Eight threads, each on its own stream, call the one-call and plan APIs at once: exact
    results, no cross-talk."""
    import rope_rtc

    errors: list[BaseException] = []
    cos_h, sin_h = host_tables(64, 64, 1)
    barrier = threading.Barrier(8)

    def worker(n: int) -> None:
        try:
            cp.cuda.Device(0).use()
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                cos, sin = cp.asarray(cos_h), cp.asarray(sin_h)
                xh = host_random((2, 16, 4, 128), DTYPES["bfloat16"], 1000 + n)
                th = tail_random_inputs(8, 4, 128, seed=2000 + n)
                x, (tx, tc, ts) = cp.asarray(xh), (cp.asarray(a) for a in th)
                tout = cp.full(tx.shape, cp.nan, dtype=tx.dtype)
                plan = rope_rtc.TailRoPEForward(tx, tc, ts, tout).check_support().compile()
                barrier.wait()
                for _ in range(20):
                    out = rope_rtc.apply_rope(x, cos, sin, stream=stream, layout="bshd")
                    plan.execute(tx, tc, ts, tout, current_stream=stream)
                stream.synchronize()
                _check_general(cp, out, xh, cos_h, sin_h, np.tile(np.arange(16), 2))
                assert np.array_equal(bits(cp.asnumpy(tout)), bits(tail_rope_reference(*th)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.mark.gpu
def test_module_table_loads_once_under_threads(cp, monkeypatch):
    from rope_rtc.core import driver
    from rope_rtc.core import launcher as launch
    from rope_rtc.build.registry import tail_spec

    spec = tail_spec(5, 128)
    for key in [k for k in launch._loaded if k[0] == spec.name]:
        del launch._loaded[key]
    loads = []
    real = driver.load_module

    def counting(device, image):
        loads.append(device)
        return real(device, image)

    monkeypatch.setattr(driver, "load_module", counting)
    got: list = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        got.append(launch.load_kernel(spec, 0))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == 1 and len({id(k) for k in got}) == 1


@pytest.mark.gpu
def test_out_of_memory_is_cupys_error_and_nothing_written(cp):
    import rope_rtc

    # A private pool holding exactly the inputs, so that what earlier tests left in the default
    # pool (free space inside split chunks) cannot serve the output.
    pool = cp.cuda.MemoryPool()
    previous = cp.cuda.get_allocator()
    cp.cuda.set_allocator(pool.malloc)
    try:
        x = cp.asarray(host_random((64, 128, 8, 128), np.float32, 5))
        before = cp.asnumpy(x)
        cos, sin = (cp.asarray(t) for t in host_tables(128, 64, 2))
        pool.set_limit(size=pool.total_bytes() + 1024)
        with pytest.raises(cp.cuda.memory.OutOfMemoryError):
            rope_rtc.apply_rope(x, cos, sin, layout="bshd")
    finally:
        pool.set_limit(size=0)  # no limit
        cp.cuda.set_allocator(previous)
    assert np.array_equal(cp.asnumpy(x), before)
    out = rope_rtc.apply_rope(x, cos, sin, layout="bshd")  # usable afterwards
    _check_general(cp, out, before, cp.asnumpy(cos), cp.asnumpy(sin), np.tile(np.arange(128), 64))


@pytest.mark.gpu
def test_launch_failure_names_the_cuda_error_and_plan_survives(cp):
    import rope_rtc
    from rope_rtc.core import launcher as launch

    th = tail_random_inputs(4, 2, 128, seed=9)
    x, c, s = (cp.asarray(a) for a in th)
    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    plan = rope_rtc.TailRoPEForward(x, c, s, out).check_support().compile()
    plan.execute(x, c, s, out)
    with pytest.raises(rope_rtc.CudaError, match="CUDA_ERROR_INVALID_VALUE") as info:
        launcher = launch.Launcher(plan._core.args.address, plan.device)
        launcher(launch.launch_prefix(plan._function, (2**31, 1, 1), (256, 1, 1)), cp.cuda.get_current_stream().ptr)
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    out.fill(float("nan"))
    plan.execute(x, c, s, out)
    cp.cuda.get_current_stream().synchronize()
    assert np.array_equal(bits(cp.asnumpy(out)), bits(tail_rope_reference(*th)))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["baseline", "vectorized", "fused"])
def test_blog_kernel_past_2_31_elements(cp, variant):
    """Offsets past 2^32 bytes through each of the blog's kernels (FP32: 8.6 GB per tensor)."""

    D = 128
    S = 2**31 // D + 5
    rng = cp.random.default_rng(3)
    x = rng.standard_normal((1, 1, S, D), dtype=cp.float32)
    k = rng.standard_normal((1, 1, S, D), dtype=cp.float32) if variant == "fused" else None
    ang = cp.random.default_rng(4).uniform(-3, 3, (S, D // 2)).astype(cp.float32)
    cos, sin = cp.cos(ang), cp.sin(ang)
    del ang
    idx = np.array([0, 1, S // 2, S - 2, S - 1])
    sel = cp.asarray(idx)
    before = [cp.asnumpy(a[0, 0, sel]) for a in (x, k) if a is not None]
    ch, sh = cp.asnumpy(cos[sel]), cp.asnumpy(sin[sel])
    prepare_blog_variant(variant, x, k, cos, sin, q_out=x, k_out=k)()
    for a, xs in zip((x, k), before):
        got = cp.asnumpy(a[0, 0, sel])
        ref = rope_reference(xs[:, None, :], ch, sh, np.arange(len(idx)), interleaved=True)[:, 0]
        assert np.abs(got - ref).max() <= 1e-6
    del x, k, cos, sin
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.multigpu
def test_two_devices(cp):
    """A plan built for device 1 while device 0 is current runs on device 1; arrays on the wrong
    device are rejected naming both; kernels load once per device; both devices at once."""
    import rope_rtc
    from rope_rtc.core import launcher as launch

    dt = DTYPES["bfloat16"]
    cos_h, sin_h = host_tables(32, 64, 7)
    with cp.cuda.Device(1):
        cos1, sin1 = cp.asarray(cos_h), cp.asarray(sin_h)
        q1 = cp.asarray(host_random((2, 8, 4, 128), dt, 1))
        k1 = cp.asarray(host_random((2, 8, 2, 128), dt, 2))
    cp.cuda.Device(0).use()
    plan = rope_rtc.RopePlan(q1, k1, cos1, sin1, device=1, layout="bshd").compile()
    assert plan.device == 1
    qh, kh = cp.asnumpy(q1), cp.asnumpy(k1)
    plan.execute(q1, k1, cos1, sin1)  # device 0 is current
    with cp.cuda.Device(1):
        cp.cuda.get_current_stream().synchronize()
    pos = np.tile(np.arange(8), 2)
    _check_general(cp, q1, qh, cos_h, sin_h, pos)
    _check_general(cp, k1, kh, cos_h, sin_h, pos)

    q0 = cp.asarray(qh)
    with pytest.raises(ValueError, match="device 0.*device 1|device 1.*device 0"):
        plan.execute(q0, k1, cos1, sin1)

    names = [name for name, dev in launch.loaded_kernels() if dev == 1]
    assert len(names) == len(set(names))

    # both devices at once, tail plans, bit-exact
    errors = []

    def worker(dev):
        try:
            with cp.cuda.Device(dev):
                th = tail_random_inputs(256, 8, 512, seed=30 + dev)
                x, c, s = (cp.asarray(a) for a in th)
                out = cp.full(x.shape, cp.nan, dtype=x.dtype)
                p = rope_rtc.TailRoPEForward(x, c, s, out).check_support().compile()
                for _ in range(50):
                    p.execute(x, c, s, out)
                cp.cuda.get_current_stream().synchronize()
                assert np.array_equal(bits(cp.asnumpy(out)), bits(tail_rope_reference(*th)))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(d,)) for d in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[0]
    counts = {}
    for name, dev in launch.loaded_kernels():
        counts[(name, dev)] = counts.get((name, dev), 0) + 1
    assert all(v == 1 for v in counts.values())
