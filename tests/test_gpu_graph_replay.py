"""Plans replay a repeated launch as a one-node CUDA graph (rope_rtc.core.launcher.Launcher): the replay
sees in-place changes of the inputs, keeps stream order, never reaches a capturing stream, and
its instantiation does not disturb another stream's capture. Outputs are re-poisoned before
every call; tail results are compared bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_util import DTYPES, assert_half_split_qk, bits, fill_behind_busy_kernel, host_random, host_tables
from rope_rtc.reference import tail_rope_reference
from tail_cases import tail_random_inputs

pytestmark = pytest.mark.gpu

T, H, D = 33, 4, 128


def _tail_plan(cp, seed=1):
    import rope_rtc

    x_h, c_h, s_h = tail_random_inputs(T, H, D, seed=seed)
    x, c, s = cp.asarray(x_h), cp.asarray(c_h), cp.asarray(s_h)
    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    return rope_rtc.TailRoPEForward(x, c, s, out).check_support().compile(), (x, c, s, out)


def _refill(cp, arrays, seed):
    """New values in place (same objects, same addresses); the output re-poisoned."""
    x, c, s, out = arrays
    x_h, c_h, s_h = tail_random_inputs(T, H, D, seed=seed)
    x.set(x_h)
    c.set(c_h)
    s.set(s_h)
    out.fill(cp.nan)
    return x_h, c_h, s_h


def _exact(cp, host, out):
    assert np.array_equal(bits(cp.asnumpy(out)), bits(tail_rope_reference(*host)))


def test_repeated_tail_launch_replays_a_graph_with_fresh_inputs(cp):
    plan, arrays = _tail_plan(cp)
    for gen in range(6):
        host = _refill(cp, arrays, 100 + gen)
        plan.execute(*arrays)
        cp.cuda.get_current_stream().synchronize()
        _exact(cp, host, arrays[3])
    assert len(plan._core.launcher._graphs) == 1, "the repeated argument set was not replayed as a graph"


def test_graph_replay_keeps_stream_order(cp):
    """The graph exists before the busy stream is filled: replay still waits for the fill."""
    plan, (x, c, s, out) = _tail_plan(cp, seed=2)
    stream = cp.cuda.Stream(non_blocking=True)
    for _ in range(3):
        plan.execute(x, c, s, out, current_stream=stream)
    stream.synchronize()
    assert plan._core.launcher._graphs
    x_h, c_h, s_h = tail_random_inputs(T, H, D, seed=61)
    c.set(c_h)
    s.set(s_h)
    out.fill(cp.nan)
    cp.cuda.Device().synchronize()
    pinned = fill_behind_busy_kernel(cp, stream, x, x_h)
    plan.execute(x, c, s, out, current_stream=stream)
    stream.synchronize()
    del pinned
    _exact(cp, (x_h, c_h, s_h), out)


@pytest.mark.parametrize("as_int", [False, True], ids=["cupy-stream", "int-handle"])
@pytest.mark.parametrize("mode", ["relaxed", "global", "thread_local"])
def test_capture_of_a_replayed_plan_records_a_kernel(cp, mode, as_int):
    """A graph cannot be launched into a capturing stream: the capture gets a kernel launch,
    whether the stream is passed as a CuPy stream or as a raw handle."""
    rt = cp.cuda.runtime
    modes = {"relaxed": rt.streamCaptureModeRelaxed, "global": rt.streamCaptureModeGlobal,
             "thread_local": rt.streamCaptureModeThreadLocal}
    plan, arrays = _tail_plan(cp, seed=3)
    stream = cp.cuda.Stream(non_blocking=True)
    arg = stream.ptr if as_int else stream
    for _ in range(3):
        plan.execute(*arrays, current_stream=arg)
    assert plan._core.launcher._graphs
    stream.synchronize()
    stream.begin_capture(modes[mode])
    plan.execute(*arrays, current_stream=arg)
    graph = stream.end_capture()
    for gen in range(2):
        host = _refill(cp, arrays, 300 + gen)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        _exact(cp, host, arrays[3])


def test_instantiating_does_not_break_another_streams_global_capture(cp):
    """The plan's graph is instantiated (twice the same set, on an idle stream) while another
    stream of this thread captures in global mode; that capture still ends and replays."""
    plan, arrays = _tail_plan(cp, seed=4)
    other_plan, other = _tail_plan(cp, seed=5)
    capturing = cp.cuda.Stream(non_blocking=True)
    idle = cp.cuda.Stream(non_blocking=True)
    host = _refill(cp, arrays, 400)
    plan.execute(*arrays, current_stream=idle)  # validated before the capture begins
    other_plan.execute(*other, current_stream=idle)
    cp.cuda.Device().synchronize()
    capturing.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
    other_plan.execute(*other, current_stream=capturing)  # a repeat, but capturing: no graph
    plan.execute(*arrays, current_stream=idle)  # instantiates
    plan.execute(*arrays, current_stream=idle)  # replays
    graph = capturing.end_capture()
    assert not other_plan._core.launcher._graphs
    idle.synchronize()
    assert plan._core.launcher._graphs
    _exact(cp, host, arrays[3])
    other_host = _refill(cp, other, 401)
    cp.cuda.Device().synchronize()
    graph.launch(capturing)
    capturing.synchronize()
    _exact(cp, other_host, other[3])


def test_rope_plan_replay_same_offset_then_new_offsets(cp):
    """RopePlan: a repeated (arrays, offset) set replays its graph; a new offset is a new
    argument set (no stale offset is ever replayed)."""
    import rope_rtc

    dt = DTYPES["bfloat16"]
    B, S, Hq, Hk, Dh = 1, 3, 8, 2, 128
    cos_h, sin_h = host_tables(64, Dh // 2, 7)
    cos, sin = cp.asarray(cos_h), cp.asarray(sin_h)
    q, k = cp.empty((B, S, Hq, Dh), dt), cp.empty((B, S, Hk, Dh), dt)
    qo, ko = cp.empty(q.shape, dt), cp.empty(k.shape, dt)
    plan = rope_rtc.RopePlan(q, k, cos, sin, q_out=qo, k_out=ko, layout="bshd").compile()
    for step, off in enumerate([5, 5, 5, 5, 9, 9, 2, 9]):
        qh, kh = host_random(q.shape, dt, 700 + step), host_random(k.shape, dt, 800 + step)
        q.set(qh)
        k.set(kh)
        qo.fill(cp.nan)
        ko.fill(cp.nan)
        plan.execute(q, k, cos, sin, q_out=qo, k_out=ko, offset=off)
        assert_half_split_qk(cp, (qo, ko), (qh, kh), cos_h, sin_h, np.tile(np.arange(S) + off, B))
    assert len(plan._core.launcher._graphs) == 2  # offset 5 and the first run of 9s; the last 9 is a new set


def test_no_graph_replay_switch(cp, monkeypatch):
    monkeypatch.setenv("ROPE_RTC_NO_GRAPH_REPLAY", "1")
    plan, arrays = _tail_plan(cp, seed=6)
    for gen in range(3):
        host = _refill(cp, arrays, 600 + gen)
        plan.execute(*arrays)
        cp.cuda.get_current_stream().synchronize()
        _exact(cp, host, arrays[3])
    assert not plan._core.launcher._graphs


def test_one_call_tail_rope_keeps_no_graphs_or_arrays(cp):
    import rope_rtc

    x_h, c_h, s_h = tail_random_inputs(T, H, D, seed=7)
    x, c, s = cp.asarray(x_h), cp.asarray(c_h), cp.asarray(s_h)
    for _ in range(3):
        out, = rope_rtc.tail_rope(x, c, s)
        _exact(cp, (x_h, c_h, s_h), out)
    from rope_rtc.ops import tail

    for plan in tail.ONE_CALL.thread().by_key.values():
        assert not plan._core.launcher._graphs and not plan._core.launcher._seen


def test_alternating_argument_sets_each_replay(cp):
    """Two argument sets alternating (an engine's per-layer buffers): each set's second launch
    instantiates its own graph; every result exact with fresh inputs."""
    plan, a = _tail_plan(cp, seed=8)
    _, b = _tail_plan(cp, seed=9)
    for rnd in range(3):
        for i, arrays in enumerate((a, b)):
            host = _refill(cp, arrays, 900 + 2 * rnd + i)
            plan.execute(*arrays)
            cp.cuda.get_current_stream().synchronize()
            _exact(cp, host, arrays[3])
    assert len(plan._core.launcher._graphs) == 2


# The decode sets of the quick-path tests: bf16 q [4,1,8,128] and k [4,1,2,128] with per-sequence
# offsets.
QB, QHQ, QHK, QD = 4, 8, 2, 128


def _decode_set(cp, rng, seed: int, rows: int) -> tuple:
    """``(host, device)`` (q, k, offsets below ``rows``) of one decode set."""
    qh = host_random((QB, 1, QHQ, QD), DTYPES["bfloat16"], seed, 2.0)
    kh = host_random((QB, 1, QHK, QD), DTYPES["bfloat16"], seed + 1, 2.0)
    oh = rng.integers(0, rows - 1, QB).astype(np.int32)
    return (qh, kh, oh), (cp.asarray(qh), cp.asarray(kh), cp.asarray(oh))


def _assert_rotated(cp, host: tuple, outs: tuple, cos_h, sin_h) -> None:
    """q's and k's outputs bit for bit the kernel arithmetic of the host set ``host``."""
    from rope_rtc.reference import rope_kernel_arithmetic

    for x, out in zip(host[:2], outs):
        want = rope_kernel_arithmetic(x.reshape(QB, x.shape[2], QD), cos_h, sin_h, host[2], interleaved=False)
        np.testing.assert_array_equal(bits(cp.asnumpy(out).reshape(want.shape)), bits(want))


def test_a_plan_with_new_arrays_every_call_writes_each_calls_own_result(cp):
    """A plan called with ever new arrays of its signature (the quick path: the block written
    per call, launched through the prefix's graph node), a rotation of a few sets (remembered on
    their second call, replayed from their third) and new views each call, interleaved, out of
    place into outputs poisoned before every call: every output bit for bit the kernel
    arithmetic of its own inputs and per-sequence offsets, the inputs untouched."""
    import rope_rtc

    rows = 512
    cos_h, sin_h = host_tables(rows, QD // 2, 71)
    cos, sin = cp.asarray(cos_h), cp.asarray(sin_h)
    rng = np.random.default_rng(72)

    def new_set(seed):
        host, dev = _decode_set(cp, rng, seed, rows)
        return host, dev, (cp.empty_like(dev[0]), cp.empty_like(dev[1]))

    first = new_set(0)
    (_, (q0, k0, o0), (qo0, ko0)) = first
    plan = rope_rtc.RopePlan(q0, k0, cos, sin, offset=o0, q_out=qo0, k_out=ko0, layout="bshd").compile()
    rotation = [new_set(10 + 2 * i) for i in range(3)]
    calls = 0
    for step in range(6):
        fresh = [new_set(100 + 10 * step + 2 * i) for i in range(3)]
        for host, dev, outs in fresh + rotation + [first]:
            for o in outs:
                o.fill(cp.nan)
            q, k = (dev[0][:], dev[1][:]) if calls % 4 == 3 else dev[:2]  # new views now and then
            got = plan.execute(q, k, cos, sin, offset=dev[2], q_out=outs[0], k_out=outs[1])
            assert got[0] is outs[0] and got[1] is outs[1]
            cp.cuda.get_current_stream().synchronize()
            _assert_rotated(cp, host, outs, cos_h, sin_h)
            np.testing.assert_array_equal(bits(cp.asnumpy(dev[0])), bits(host[0]))
            calls += 1
    assert len(plan._core.recent) >= 2  # the rotation's sets were remembered


def test_node_updates_do_not_break_another_streams_global_capture(cp):
    """The one-call functions and a plan's quick path (new arrays every call) write each call's
    block into a graph node (``cuGraphExecKernelNodeSetParams``) and launch it. Done on an idle
    stream while another stream of this thread captures in global mode, the capture still ends
    and replays what it recorded, and every idle-stream call writes its own result."""
    import rope_rtc

    rows = 256
    cos_h, sin_h = host_tables(rows, QD // 2, 81)
    cos, sin = cp.asarray(cos_h), cp.asarray(sin_h)
    rng = np.random.default_rng(82)

    def new_set(seed):
        return _decode_set(cp, rng, seed, rows)

    def check(host, outs):
        _assert_rotated(cp, host, outs, cos_h, sin_h)

    idle = cp.cuda.Stream(non_blocking=True)
    capturing = cp.cuda.Stream(non_blocking=True)
    _, (q0, k0, o0) = new_set(0)
    plan = rope_rtc.RopePlan(q0, k0, cos, sin, offset=o0, layout="bshd").compile()
    with idle:  # both paths' graph nodes exist before the capture begins
        for seed in (10, 20):
            _, (q, k, o) = new_set(seed)
            rope_rtc.apply_rope_qk(q, k, cos, sin, offset=o, q_out=q, k_out=k, layout="bshd")
            plan.execute(q, k, cos, sin, offset=o)
    captured_host, (cq, ck, co) = new_set(30)
    cq_in, ck_in = cq.copy(), ck.copy()
    calls = [new_set(40 + 2 * i) for i in range(4)]
    cp.cuda.Device().synchronize()  # the sets' copies, before launches on the non-blocking streams
    capturing.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
    with capturing:
        rope_rtc.apply_rope_qk(cq, ck, cos, sin, offset=co, q_out=cq, k_out=ck, layout="bshd")
    for i, (_, (q, k, o)) in enumerate(calls):
        with idle:
            if i % 2:
                plan.execute(q, k, cos, sin, offset=o)
            else:
                rope_rtc.apply_rope_qk(q, k, cos, sin, offset=o, q_out=q, k_out=k, layout="bshd")
    graph = capturing.end_capture()
    idle.synchronize()
    for host, dev in calls:
        check(host, dev[:2])
    for got, before in ((cq, cq_in), (ck, ck_in)):  # captured, not run
        np.testing.assert_array_equal(bits(cp.asnumpy(got)), bits(cp.asnumpy(before)))
    graph.launch(capturing)
    capturing.synchronize()
    check(captured_host, (cq, ck))


def test_a_tail_plan_with_new_arrays_every_call_writes_each_calls_own_result(cp):
    """TailRoPEForward called with new arrays of its signature (the quick path), a rotation of a
    few sets (remembered on their second call, replayed from their third) and new output views,
    interleaved, into outputs poisoned before every call: every output bit for bit the reference
    of its own inputs."""
    plan, first = _tail_plan(cp, seed=20)
    rotation = [_tail_plan(cp, seed=21 + i)[1] for i in range(3)]
    for step in range(5):
        fresh = [_tail_plan(cp, seed=40 + 3 * step + i)[1] for i in range(3)]
        for n, arrays in enumerate(fresh + rotation + [first]):
            host = _refill(cp, arrays, 500 + 10 * step + n)
            x, c, s, out = arrays
            got = plan.execute(x, c, s, out[:] if n % 3 == 2 else out)
            assert got["out"].data.ptr == out.data.ptr
            cp.cuda.get_current_stream().synchronize()
            _exact(cp, host, out)
    assert len(plan._core.recent) >= 3


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("entry", ["plan", "one-call", "engines' convention"])
def test_one_capture_of_many_layers_rotates_each_layers_own_arrays(cp, entry, T):
    """A decode step captured whole, as an engine does: one call per layer on that layer's own q
    and k (bf16 thd, Hq=32, Hkv=8, D=128, device positions), through a plan, the one-call
    function and the engines' flat arrays with cos_sin_cache, each warmed first (so the capture
    meets the remembered paths and graph replay). Replayed twice on new values written in place:
    every layer's q and k are the eager call's bits on copies of the same inputs, and the capture
    itself wrote nothing."""
    import rope_rtc

    layers, P = 6, 64
    bf16 = DTYPES["bfloat16"]
    ch, sh = host_tables(P, 64, 70)
    cos, sin = cp.asarray(ch), cp.asarray(sh)
    cache = cp.asarray(np.concatenate([ch, sh], axis=1))
    pos = cp.asarray(np.random.default_rng(71).integers(0, P, T).astype(np.int32))
    qs = [cp.asarray(host_random((T, 32, 128), bf16, 100 + i)) for i in range(layers)]
    ks = [cp.asarray(host_random((T, 8, 128), bf16, 200 + i)) for i in range(layers)]
    plan = rope_rtc.RopePlan(qs[0], ks[0], cos, sin, positions=pos, layout="thd").compile()

    def rotate(q, k, stream):
        if entry == "plan":
            plan.execute(q, k, cos, sin, positions=pos, stream=stream)
        elif entry == "one-call":
            rope_rtc.apply_rope_qk(q, k, cos, sin, positions=pos, q_out=q, k_out=k, layout="thd", stream=stream)
        else:
            fq, fk = q.reshape(T, -1), k.reshape(T, -1)
            rope_rtc.apply_rope_qk(fq, fk, cos_sin_cache=cache, positions=pos, head_dim=128, q_out=fq, k_out=fk,
                                   stream=stream)

    stream = cp.cuda.Stream(non_blocking=True)
    for _ in range(3):  # the remembered paths and graph replay warmed on every layer's arrays
        for q, k in zip(qs, ks):
            rotate(q, k, stream)
    stream.synchronize()
    before = [(q.copy(), k.copy()) for q, k in zip(qs, ks)]
    stream.begin_capture()
    for q, k in zip(qs, ks):
        rotate(q, k, stream)
    graph = stream.end_capture()
    for (q, k), (q0, k0) in zip(zip(qs, ks), before):  # captured, not run
        np.testing.assert_array_equal(bits(cp.asnumpy(q)), bits(cp.asnumpy(q0)))
        np.testing.assert_array_equal(bits(cp.asnumpy(k)), bits(cp.asnumpy(k0)))
    for gen in range(2):
        for i, (q, k) in enumerate(zip(qs, ks)):
            q.set(host_random(q.shape, bf16, 1000 * (gen + 1) + i))
            k.set(host_random(k.shape, bf16, 1000 * (gen + 1) + 50 + i))
        want = [(q.copy(), k.copy()) for q, k in zip(qs, ks)]
        cp.cuda.Device().synchronize()
        for q, k in want:  # eager, on copies
            rope_rtc.RopePlan(q, k, cos, sin, positions=pos, layout="thd").execute(q, k, cos, sin, positions=pos)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        for (q, k), (wq, wk) in zip(zip(qs, ks), want):
            np.testing.assert_array_equal(bits(cp.asnumpy(q)), bits(cp.asnumpy(wq)))
            np.testing.assert_array_equal(bits(cp.asnumpy(k)), bits(cp.asnumpy(wk)))
