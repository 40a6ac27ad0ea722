"""The general RoPE API on the GPU, each case against the float64 reference within
DESIGN.md's bounds, outputs NaN-poisoned first, inputs unchanged out of place."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gpu_util import (DTYPES, after_current_stream, assert_half_split_qk, count_allocations, count_compiles,
                      fill_behind_busy_kernel, host_random, host_tables, poisoned)
from helpers import layout_shape, token_rows
from rope_rtc.core import dispatch
from rope_rtc.reference import assert_rope_close, rope_reference

pytestmark = pytest.mark.gpu


def _positions(scheme, B, S, P, rng):
    """(kwargs for the API as host arrays, per-token positions [B*S])."""
    if scheme == "offset":
        off = 3
        return {"offset": off}, np.tile(np.arange(S) + off, B)
    if scheme == "offsets":
        offs = rng.integers(0, P - S, B).astype(np.int32)
        return {"offset": offs}, (offs[:, None] + np.arange(S)[None, :]).reshape(-1)
    pos = rng.integers(0, P, (B, S)).astype(np.int64)
    return {"positions": pos}, pos.reshape(-1)


def _run_case(cp, dtype, layout, interleaved, window, scheme, in_place, gqa, B=2, S=13, D=64, seed=0, plan=False):
    import rope_rtc

    rng = np.random.default_rng(seed)
    Hq, Hk = (4, 2) if gqa else (3, 3)
    rdim, roff = window
    P = 64
    dt = DTYPES[dtype]
    if layout == "thd":
        kw, pos = _positions("positions" if scheme == "positions" else "offset", 1, B * S, P, rng)
        if scheme == "positions":
            kw = {"positions": kw["positions"].reshape(-1)}
        elif scheme == "offsets":  # thd: restart per sequence with cu_seqlens and per-sequence offsets
            cu = np.array([0, 5, B * S], dtype=np.int32)
            offs = np.array([7, 11], dtype=np.int64)
            kw = {"cu_seqlens": cu, "offset": offs}
            t = np.arange(B * S)
            seq = np.searchsorted(cu, t, side="right") - 1
            pos = t - cu[seq] + offs[seq]
    else:
        kw, pos = _positions(scheme, B, S, P, rng)
    q = host_random(layout_shape(layout, B, S, Hq, D), dt, seed + 1)
    k = host_random(layout_shape(layout, B, S, Hk, D), dt, seed + 2)
    cos, sin = host_tables(P, (rdim or D) // 2, seed + 3)
    qd, kd, cd, sd = (cp.asarray(a) for a in (q, k, cos, sin))
    kwd = {n: (cp.asarray(v) if isinstance(v, np.ndarray) else v) for n, v in kw.items()}
    if in_place:
        qo, ko = qd, kd
    else:
        qo, ko = poisoned(cp, q.shape, dt), poisoned(cp, k.shape, dt)
    if plan:
        p = rope_rtc.RopePlan(qd, kd, cd, sd, layout=layout, interleaved=interleaved, rotary_dim=rdim,
                              rotary_offset=roff, q_out=qo, k_out=ko, **kwd).compile()
        p.execute(qd, kd, cd, sd, q_out=qo, k_out=ko, **kwd)
    else:
        rope_rtc.apply_rope_qk(qd, kd, cd, sd, layout=layout, interleaved=interleaved, rotary_dim=rdim,
                               rotary_offset=roff, q_out=qo, k_out=ko, **kwd)
    for got, x in ((qo, q), (ko, k)):
        xc = token_rows(x, layout)
        ref = rope_reference(xc, cos, sin, pos, interleaved=interleaved, rotary_dim=rdim, rotary_offset=roff)
        assert_rope_close(token_rows(cp.asnumpy(got), layout), ref, xc, interleaved=interleaved, rotary_dim=rdim,
                          rotary_offset=roff, dtype=np.dtype(dt))
    if not in_place:
        assert np.array_equal(cp.asnumpy(qd).view(np.uint8), q.view(np.uint8))
        assert np.array_equal(cp.asnumpy(kd).view(np.uint8), k.view(np.uint8))


MATRIX = list(itertools.product(
    ["float32", "float16", "bfloat16"],
    ["bshd", "bhsd", "sbhd", "thd"],
    [False, True],
    [(None, 0), (32, 16)],
    ["offset", "offsets", "positions"],
    [False, True],
    [False, True],
))


@pytest.fixture(params=["fixed", "small", "prefill", "wide"])
def kernel_path(request, monkeypatch):
    """Which build of the general kernel runs the matrix's small shapes: the specialised build
    (cuda_src/rope_fixed.cu, for every call it fits), or the generic kernel alone with one head
    per thread (what small shapes get), the prefill head batch, or the 64-bit grid-stride entry
    with a grid of one block, so every thread loops (what only tensors past 2^31 indices get)."""
    import threading

    from rope_rtc.ops import rope, rope_launch

    # The one-call functions keep templates per thread, each with its choice of build: start empty.
    monkeypatch.setattr(rope.ONE_CALL, "_local", dispatch.ThreadState())
    if request.param != "fixed":
        monkeypatch.setattr(rope_launch, "USE_FIXED", False)
    if request.param in ("prefill", "wide"):
        monkeypatch.setattr(rope_launch, "SMALL_TOKEN_HEADS", 0)
    if request.param == "wide":
        monkeypatch.setattr(rope_launch, "NARROW_LIMIT", 0)
        monkeypatch.setattr(rope_launch, "GRID_LIMIT", 1)
    return request.param


@pytest.mark.parametrize("dtype,layout,interleaved,window,scheme,in_place,gqa", MATRIX)
def test_matrix(cp, kernel_path, dtype, layout, interleaved, window, scheme, in_place, gqa):
    _run_case(cp, dtype, layout, interleaved, window, scheme, in_place, gqa, seed=len(dtype) + len(layout))


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_plan_through_each_build(cp, kernel_path, layout, interleaved, in_place):
    """RopePlan (which loads its builds up front) through each build, every layout."""
    _run_case(cp, "bfloat16", layout, interleaved, (None, 0), "positions", in_place, True, seed=5, plan=True)


def test_kernel_path_fixture_reaches_each_build(cp, monkeypatch):
    """The monkeypatched limits really change the build and entry a launch takes."""
    from rope_rtc.ops import rope_launch
    from rope_rtc.ops.rope_request import validate

    q = cp.asarray(host_random((2, 50, 3, 64), DTYPES["float16"], 1))  # 100 tokens x 3 heads x 4 units
    cos, sin = (cp.asarray(a) for a in host_tables(64, 32, 2))
    req = validate(q, None, cos, sin, allow_host=False, layout="bshd")
    vec = rope_launch.choose_vector(req)
    assert rope_launch.head_batch(req) == 1 and rope_launch.is_narrow(req, vec)
    monkeypatch.setattr(rope_launch, "SMALL_TOKEN_HEADS", 0)
    assert rope_launch.head_batch(req) > 1
    assert rope_launch.launch_shape(req, vec)[0][0] > 1
    monkeypatch.setattr(rope_launch, "NARROW_LIMIT", 0)
    monkeypatch.setattr(rope_launch, "GRID_LIMIT", 1)
    assert not rope_launch.is_narrow(req, vec) and rope_launch.launch_shape(req, vec)[0][0] == 1
    assert rope_launch.fixed_build(req, False) is None  # past 32-bit indices: the generic kernel
    monkeypatch.setattr(rope_launch, "NARROW_LIMIT", 2**31)
    assert rope_launch.fixed_build(req, False) is not None
    monkeypatch.setattr(rope_launch, "USE_FIXED", False)
    assert rope_launch.fixed_build(req, False) is None


@pytest.mark.parametrize("tokens", [0, 1, 3, 17, 4097])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_odd_token_counts(cp, tokens, dtype):
    import rope_rtc

    dt = DTYPES[dtype]
    q = host_random((tokens, 5, 96), dt, tokens)
    cos, sin = host_tables(tokens + 8, 48, 1)
    out = poisoned(cp, q.shape, dt)
    rope_rtc.apply_rope(cp.asarray(q), cp.asarray(cos), cp.asarray(sin), layout="thd", offset=2, out=out)
    ref = rope_reference(q, cos, sin, np.arange(tokens) + 2, interleaved=False)
    assert_rope_close(cp.asnumpy(out), ref, q, interleaved=False, dtype=np.dtype(dt))


def test_odd_alignment_uses_narrow_vectors(cp):
    """A view starting one element into a buffer still gives the right answer (narrower accesses)."""
    import rope_rtc

    base = cp.asarray(host_random((3 * 4 * 64 + 2,), DTYPES["bfloat16"], 5))
    x = base[1:1 + 3 * 4 * 64].reshape(3, 4, 64)  # 2-byte offset: only 2-byte accesses fit
    cos, sin = host_tables(8, 32, 2)
    out = rope_rtc.apply_rope(x, cp.asarray(cos), cp.asarray(sin), layout="thd")
    xh = cp.asnumpy(x)
    assert_rope_close(cp.asnumpy(out), rope_reference(xh, cos, sin, np.arange(3), interleaved=False), xh,
                      interleaved=False, dtype=xh.dtype)


def test_fused_qkv_views_in_place(cp):
    """q and k as strided views into one fused QKV buffer work in place, without a copy."""
    import rope_rtc

    B, S, Hq, Hk, D = 2, 9, 4, 2, 128
    qkv_h = host_random((B, S, Hq + 2 * Hk, D), DTYPES["bfloat16"], 7)
    qkv = cp.asarray(qkv_h)
    q, k = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hk]  # v (the rest) must stay untouched
    cos, sin = host_tables(S, D // 2, 3)
    rope_rtc.apply_rope_qk(q, k, cp.asarray(cos), cp.asarray(sin), q_out=q, k_out=k, layout="bshd")
    got = cp.asnumpy(qkv)
    pos = np.tile(np.arange(S), B)
    for sl, h in ((slice(0, Hq), Hq), (slice(Hq, Hq + Hk), Hk)):
        xc = qkv_h[:, :, sl].reshape(-1, h, D)
        assert_rope_close(got[:, :, sl].reshape(-1, h, D), rope_reference(xc, cos, sin, pos, interleaved=False), xc,
                          interleaved=False, dtype=xc.dtype)
    assert np.array_equal(got[:, :, Hq + Hk:].view(np.uint16), qkv_h[:, :, Hq + Hk:].view(np.uint16))


def test_inverse_undoes_forward(cp):
    import rope_rtc

    x = cp.asarray(host_random((2, 7, 3, 64), np.float32, 11))
    cos, sin = (cp.asarray(t) for t in host_tables(16, 32, 4))
    y = rope_rtc.apply_rope(x, cos, sin, layout="bshd")
    z = rope_rtc.apply_rope(y, cos, sin, inverse=True, layout="bshd")
    np.testing.assert_allclose(cp.asnumpy(z), cp.asnumpy(x), atol=2e-6)


def test_numpy_inputs_computed_on_gpu(cp):
    import rope_rtc

    q = host_random((2, 5, 3, 64), np.float32, 12)
    cos, sin = host_tables(8, 32, 5)
    out = rope_rtc.apply_rope(q, cos, sin, layout="bshd")
    assert isinstance(out, np.ndarray)
    ref = rope_reference(q.reshape(-1, 3, 64), cos, sin, np.tile(np.arange(5), 2), interleaved=False)
    assert_rope_close(out.reshape(-1, 3, 64), ref, q.reshape(-1, 3, 64), interleaved=False, dtype=q.dtype)


@pytest.mark.parametrize("entry", ["rope_apply", "rope_apply_wide"])
def test_more_than_2_31_elements(cp, monkeypatch, entry):
    """2^31 + a few elements in one array (offsets past 2^32 bytes) through each entry point:
    64-bit offsets throughout (checked on sampled tokens, no element left unwritten). The 64-bit
    entry runs naturally only past 2^31 threads (2^35 elements here); the limit is lowered."""
    import rope_rtc
    from rope_rtc.ops import rope_launch

    if entry == "rope_apply_wide":
        monkeypatch.setattr(rope_launch, "NARROW_LIMIT", 0)

    H, D = 8, 128
    T = 2**31 // (H * D) + 3
    dt = DTYPES["bfloat16"]
    x = cp.random.default_rng(1).standard_normal((T, H, D), dtype=cp.float32).astype(dt)
    rng = np.random.default_rng(2)
    pos_h = rng.integers(0, 256, T).astype(np.int32)
    cos, sin = host_tables(256, D // 2, 6)
    out = cp.full(x.shape, cp.nan, dtype=dt)
    rope_rtc.apply_rope(x, cp.asarray(cos), cp.asarray(sin), positions=cp.asarray(pos_h), layout="thd", out=out)
    idx = np.concatenate([[0, 1, T // 2, T - 2, T - 1], rng.integers(0, T, 64)])
    xs = cp.asnumpy(x[cp.asarray(idx)])
    got = cp.asnumpy(out[cp.asarray(idx)])
    assert_rope_close(got, rope_reference(xs, cos, sin, pos_h[idx], interleaved=False), xs, interleaved=False,
                      dtype=xs.dtype)
    assert not bool(cp.isnan(out).any())
    del x, out
    cp.get_default_memory_pool().free_all_blocks()


def test_plan_token_counts_graph_and_no_allocation(cp, monkeypatch):
    """One plan, T changing (incl. 0), no compile and no allocation after compile(); then a graph."""
    import rope_rtc

    dt = DTYPES["bfloat16"]
    Hq, Hk, D, P = 8, 2, 128, 512
    cos, sin = (cp.asarray(t) for t in host_tables(P, D // 2, 8))
    plan = rope_rtc.RopePlan(rope_rtc.TensorDesc(dt, (1, 1, Hq, D)), rope_rtc.TensorDesc(dt, (1, 1, Hk, D)),
                             cos, sin, layout="bshd").compile()
    bufs = {T: (cp.asarray(host_random((1, T, Hq, D), dt, T)), cp.asarray(host_random((1, T, Hk, D), dt, T + 1)))
            for T in (0, 5, 257, 300)}
    hosts = {T: (cp.asnumpy(q), cp.asnumpy(k)) for T, (q, k) in bufs.items()}
    with count_compiles(monkeypatch) as compiles, count_allocations(cp) as allocs:
        for T, (q, k) in bufs.items():
            plan.execute(q, k, cos, sin, offset=11)
        cp.cuda.get_current_stream().synchronize()
    assert compiles[0] == 0 and allocs[0] == 0, (compiles[0], allocs[0])
    ch, sh = cp.asnumpy(cos), cp.asnumpy(sin)
    for T, (q, k) in bufs.items():
        for got, x in ((q, hosts[T][0]), (k, hosts[T][1])):
            xc = x.reshape(-1, x.shape[2], D)
            assert_rope_close(cp.asnumpy(got).reshape(xc.shape), rope_reference(xc, ch, sh, np.arange(T) + 11,
                              interleaved=False), xc, interleaved=False, dtype=xc.dtype)

    # CUDA graph: capture one execute, change the inputs in place, replay.
    q, k = bufs[257]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        plan.execute(q, k, cos, sin, offset=11)  # warm the fast path on this stream
        stream.begin_capture()
        plan.execute(q, k, cos, sin, offset=11)
        graph = stream.end_capture()
    for gen in range(3):
        qh = host_random(q.shape, dt, 100 + gen)
        kh = host_random(k.shape, dt, 200 + gen)
        q.set(qh, stream=stream)
        k.set(kh, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        for got, x in ((q, qh), (k, kh)):
            xc = x.reshape(-1, x.shape[2], D)
            assert_rope_close(cp.asnumpy(got).reshape(xc.shape), rope_reference(xc, ch, sh, np.arange(257) + 11,
                              interleaved=False), xc, interleaved=False, dtype=xc.dtype)


def test_non_default_stream_ordering(cp):
    """Work queued on a busy stream runs after the data it depends on was written on that stream."""
    import rope_rtc

    dt = np.float32
    x = cp.empty((4, 64, 8, 128), dtype=dt)
    xh = host_random(x.shape, dt, 21)
    cos, sin = (cp.asarray(t) for t in host_tables(64, 64, 9))
    stream = cp.cuda.Stream(non_blocking=True)
    out = poisoned(cp, x.shape, dt)
    after_current_stream(cp, stream)  # the tables and the NaN fill, made on the current stream
    pinned = fill_behind_busy_kernel(cp, stream, x, xh)
    rope_rtc.apply_rope(x, cos, sin, out=out, stream=stream, layout="bshd")
    stream.synchronize()
    del pinned
    xc = xh.reshape(-1, 8, 128)
    assert_rope_close(cp.asnumpy(out).reshape(xc.shape), rope_reference(xc, cp.asnumpy(cos), cp.asnumpy(sin),
                      np.tile(np.arange(64), 4), interleaved=False), xc, interleaved=False, dtype=xc.dtype)


@pytest.mark.device
def test_torch_tensors_through_dlpack(cp):
    torch = pytest.importorskip("torch")
    import rope_rtc

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    for tdt, ndt in ((torch.bfloat16, DTYPES["bfloat16"]), (torch.float16, np.float16), (torch.float32, np.float32)):
        q = torch.randn(2, 7, 4, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).to(tdt)
        k = torch.randn(2, 7, 2, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(4)).to(tdt)
        cos, sin = host_tables(16, 32, 10)
        qh = cp.asnumpy(cp.from_dlpack(q.detach()))
        kh = cp.asnumpy(cp.from_dlpack(k.detach()))
        rope_rtc.apply_rope_qk(q, k, torch.from_numpy(cos).cuda(), torch.from_numpy(sin).cuda(), q_out=q, k_out=k,
                               layout="bshd")
        torch.cuda.synchronize()
        pos = np.tile(np.arange(7), 2)
        for got, x in ((q, qh), (k, kh)):
            xc = x.reshape(-1, x.shape[2], 64)
            g = cp.asnumpy(cp.from_dlpack(got)).reshape(xc.shape)
            assert g.dtype == np.dtype(ndt)
            assert_rope_close(g, rope_reference(xc, cos, sin, pos, interleaved=False), xc, interleaved=False,
                              dtype=xc.dtype)
    with pytest.raises(TypeError, match="grad"):
        rope_rtc.apply_rope(torch.ones(1, 1, 1, 64, device="cuda", requires_grad=True), torch.from_numpy(cos).cuda(),
                            torch.from_numpy(sin).cuda(), layout="bshd")


def test_plan_new_arrays_every_call(cp):
    """Fresh arrays of one signature each call (an engine's memory pool): the cached validation
    still checks pointers — results right, misalignment and overlap still rejected."""
    import rope_rtc

    dt = DTYPES["bfloat16"]
    B, S, Hq, Hk, D = 2, 6, 4, 2, 128
    cos, sin = (cp.asarray(t) for t in host_tables(32, D // 2, 12))
    ch, sh = cp.asnumpy(cos), cp.asnumpy(sin)
    plan = rope_rtc.RopePlan(rope_rtc.TensorDesc(dt, (B, S, Hq, D)), rope_rtc.TensorDesc(dt, (B, S, Hk, D)), cos, sin,
                             q_out=rope_rtc.TensorDesc(dt, (B, S, Hq, D)),
                             k_out=rope_rtc.TensorDesc(dt, (B, S, Hk, D)), layout="bshd").compile()
    pos = np.tile(np.arange(S) + 4, B)
    for gen in range(6):
        qh, kh = host_random((B, S, Hq, D), dt, 300 + gen), host_random((B, S, Hk, D), dt, 400 + gen)
        q, k = cp.asarray(qh), cp.asarray(kh)
        qo, ko = poisoned(cp, q.shape, dt), poisoned(cp, k.shape, dt)
        plan.execute(q, k, cos, sin, q_out=qo, k_out=ko, offset=4)
        assert_half_split_qk(cp, (qo, ko), (qh, kh), ch, sh, pos)
    # Same signature, but the outputs now overlap an input / are misaligned: still rejected.
    buf = cp.empty((2 * B * S * Hq * D,), dtype=dt)
    q = buf[: B * S * Hq * D].reshape(B, S, Hq, D)
    qo_overlap = buf[B * S * Hq * D // 2: B * S * Hq * D // 2 + B * S * Hq * D].reshape(B, S, Hq, D)
    k, ko = cp.asarray(kh), cp.empty_like(cp.asarray(kh))
    with pytest.raises(ValueError, match="overlaps"):
        plan.execute(q, k, cos, sin, q_out=qo_overlap, k_out=ko, offset=4)
    flat = cp.empty((B * S * Hq * D + 1,), dtype=dt)
    mis = flat[1:].reshape(B, S, Hq, D)
    out = poisoned(cp, mis.shape, dt)
    mis[...] = cp.asarray(qh)
    plan.execute(mis, k, cos, sin, q_out=out, k_out=ko, offset=4)  # narrower vectors, still right
    xc = qh.reshape(-1, Hq, D)
    assert_rope_close(cp.asnumpy(out).reshape(xc.shape), rope_reference(xc, ch, sh, pos, interleaved=False), xc,
                      interleaved=False, dtype=xc.dtype)


def test_plan_alternating_argument_sets(cp):
    """Remembered argument sets (an engine's per-layer buffers): each call rotates its own arrays
    with its own offset, outputs re-poisoned before every call."""
    import rope_rtc

    dt = DTYPES["float16"]
    B, S, Hq, Hk, D = 2, 5, 4, 2, 64
    cos_h, sin_h = host_tables(40, D // 2, 21)
    cos, sin = cp.asarray(cos_h), cp.asarray(sin_h)
    sets = []
    for i in range(3):
        qh, kh = host_random((B, S, Hq, D), dt, 500 + i), host_random((B, S, Hk, D), dt, 600 + i)
        sets.append((qh, kh, cp.asarray(qh), cp.asarray(kh), cp.empty(qh.shape, dt), cp.empty(kh.shape, dt)))
    plan = rope_rtc.RopePlan(*sets[0][2:4], cos, sin, q_out=sets[0][4], k_out=sets[0][5], layout="bshd").compile()
    for rnd in range(3):
        for i, (qh, kh, q, k, qo, ko) in enumerate(sets):
            off = 3 * i + rnd
            qo.fill(cp.nan)
            ko.fill(cp.nan)
            plan.execute(q, k, cos, sin, q_out=qo, k_out=ko, offset=off)
            assert_half_split_qk(cp, (qo, ko), (qh, kh), cos_h, sin_h, np.tile(np.arange(S) + off, B))
