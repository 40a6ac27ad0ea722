"""Prepared BF16 tail RoPE on the GPU: bit for bit against the NumPy reference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gpu_util import after_current_stream, bits, count_allocations, count_compiles, fill_behind_busy_kernel
from rope_rtc.reference import tail_rope_reference
from tail_cases import tail_edge_inputs, tail_random_inputs

pytestmark = pytest.mark.gpu

SHAPES = [(1, None, 128), (4, 32, 128), (17, 3, 128), (4096, 1, 512), (4096, 64, 512), (16384, 64, 512)]
# Beyond this many elements the reference runs on sampled tokens (the prefix is still compared everywhere).
FULL_COMPARE = 40_000_000


def _inputs(cp, T, H, D, gen):
    """(host triple or None, device triple). Large shapes are generated on the GPU and compared
    on sampled tokens; small ones alternate planted edge cases with plain random data."""
    shape = (T, D) if H is None else (T, H, D)
    if T * (H or 1) * D <= FULL_COMPARE:
        host = tail_edge_inputs(T, H, D, seed=gen) if gen % 2 == 0 else tail_random_inputs(T, H, D, seed=gen)
        return host, tuple(cp.asarray(a) for a in host)
    rng = cp.random.default_rng(gen)
    x = rng.standard_normal(shape, dtype=cp.float32).astype(ml_dtypes.bfloat16)
    ang = rng.uniform(-20.0, 20.0, (T, 32))
    return None, (x, cp.cos(ang).astype(cp.float32), cp.sin(ang).astype(cp.float32))


def _compare(cp, host, dev, out_d):
    x, c, s = dev
    if host is not None:
        ref = tail_rope_reference(*host)
        assert np.array_equal(bits(cp.asnumpy(out_d)), bits(ref)), "tail output differs from the reference"
        return
    T, D = x.shape[0], x.shape[-1]
    idx = cp.asarray(np.unique(np.concatenate([[0, 1, T - 1], np.random.default_rng(T).integers(0, T, 96)])))
    ref = tail_rope_reference(cp.asnumpy(x[idx]), cp.asnumpy(c[idx]), cp.asnumpy(s[idx]))
    assert np.array_equal(bits(cp.asnumpy(out_d[idx])), bits(ref))
    assert bool(cp.array_equal(out_d[..., : D - 64].view(cp.uint16), x[..., : D - 64].view(cp.uint16))), \
        "prefix not copied bit for bit"
    assert not bool(cp.isnan(out_d[..., D - 64 :].astype(cp.float32)).any()), "a tail element was never written"


@pytest.mark.parametrize("negate", [False, True])
@pytest.mark.parametrize("T,H,D", SHAPES)
def test_bit_exact_seven_generations(cp, T, H, D, negate):
    import rope_rtc

    shape = (T, D) if H is None else (T, H, D)
    plan = None
    for gen in range(7):
        host, (x, c, s) = _inputs(cp, T, H, D, gen + 10 * negate)
        if negate:
            # Negate on the host when there is a host copy: CuPy's own elementwise kernels may
            # flush the planted FP32 subnormals, which would change the table under test.
            if host is not None:
                host = (host[0], host[1], -host[2])
                s = cp.asarray(host[2])
            else:
                s = -s
        keep = (x.copy(), c.copy(), s.copy())
        out = cp.full(shape, cp.nan, dtype=x.dtype)
        if plan is None:
            plan = rope_rtc.TailRoPEForward(x, c, s, out).check_support()
            plan.compile()
        result = plan.execute(x, c, s, out)
        (ret,) = result
        assert ret is out and result["out"] is out
        cp.cuda.get_current_stream().synchronize()
        _compare(cp, host, (x, c, s), out)
        for a, b in zip((x, c, s), keep):  # inputs and tables unchanged
            assert bool(cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)))
        del x, c, s, out, keep


def test_negated_sine_is_the_opposite_angle(cp):
    import rope_rtc

    x_h, c_h, s_h = tail_random_inputs(33, 4, 128, seed=3)
    x, c, s = cp.asarray(x_h), cp.asarray(c_h), cp.asarray(s_h)
    fwd = rope_rtc.tail_rope(x, c, s)["out"]
    back = rope_rtc.tail_rope(fwd, c, -s)["out"]
    assert np.array_equal(bits(cp.asnumpy(back)), bits(tail_rope_reference(cp.asnumpy(fwd), c_h, -s_h)))


def test_one_plan_many_token_counts_no_compile_no_alloc(cp, monkeypatch):
    import rope_rtc

    H, D = 8, 512
    xdesc = rope_rtc.TensorDesc(ml_dtypes.bfloat16, (1, H, D))
    tdesc = rope_rtc.TensorDesc("float32", (1, 32))
    plan = rope_rtc.TailRoPEForward(xdesc, tdesc, tdesc, xdesc)
    plan.check_support().compile()
    cases = {}
    for T in (0, 5, 257, 4096):
        x_h, c_h, s_h = tail_random_inputs(T, H, D, seed=T)
        cases[T] = (x_h, c_h, s_h, cp.asarray(x_h), cp.asarray(c_h), cp.asarray(s_h),
                    cp.full((T, H, D), cp.nan, dtype=cp.asarray(x_h).dtype))
    with count_compiles(monkeypatch) as compiles, count_allocations(cp) as allocs:
        for T, (_, _, _, x, c, s, o) in cases.items():
            plan.execute(x, c, s, o)
        cp.cuda.get_current_stream().synchronize()
    assert compiles[0] == 0, "execute compiled"
    assert allocs[0] == 0, "execute allocated device memory"
    for T, (x_h, c_h, s_h, x, c, s, o) in cases.items():
        _compare(cp, (x_h, c_h, s_h), (x, c, s), o)


def test_cuda_graph_capture_and_replay(cp):
    import rope_rtc

    T, H, D = 4, 64, 512
    x_h, c_h, s_h = tail_random_inputs(T, H, D, seed=40)
    x, c, s = cp.asarray(x_h), cp.asarray(c_h), cp.asarray(s_h)
    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    plan = rope_rtc.TailRoPEForward(x, c, s, out).check_support().compile()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        plan.execute(x, c, s, out, current_stream=stream)
        stream.begin_capture()
        plan.execute(x, c, s, out, current_stream=stream)
        graph = stream.end_capture()
    for gen in range(4):
        x_h, c_h, s_h = tail_edge_inputs(T, H, D, seed=50 + gen) if gen % 2 else tail_random_inputs(T, H, D, seed=50 + gen)
        x.set(x_h, stream=stream)
        c.set(c_h, stream=stream)
        s.set(s_h, stream=stream)
        with stream:
            out.fill(float("nan"))
        graph.launch(stream)
        stream.synchronize()
        _compare(cp, (x_h, c_h, s_h), (x, c, s), out)


def test_stream_ordering(cp):
    import rope_rtc

    T, H, D = 512, 8, 512
    x_h, c_h, s_h = tail_random_inputs(T, H, D, seed=60)
    x = cp.empty(x_h.shape, dtype=cp.asarray(x_h[:1]).dtype)
    c, s = cp.asarray(c_h), cp.asarray(s_h)
    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    plan = rope_rtc.TailRoPEForward(x, c, s, out).check_support().compile()
    stream = cp.cuda.Stream(non_blocking=True)
    after_current_stream(cp, stream)  # the tables and the NaN fill, made on the current stream
    pinned = fill_behind_busy_kernel(cp, stream, x, x_h)
    plan.execute(x, c, s, out, current_stream=stream)
    stream.synchronize()
    del pinned
    _compare(cp, (x_h, c_h, s_h), (x, c, s), out)


def test_more_than_2_31_elements(cp):
    import rope_rtc

    H, D = 64, 512
    T = 2**31 // (H * D) + 1
    x = cp.random.default_rng(7).standard_normal((T, H, D), dtype=cp.float32).astype(ml_dtypes.bfloat16)
    ang = np.random.default_rng(8).uniform(-5, 5, (T, 32))
    c_h, s_h = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    c, s = cp.asarray(c_h), cp.asarray(s_h)
    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    rope_rtc.TailRoPEForward(x, c, s, out).check_support().compile().execute(x, c, s, out)
    cp.cuda.get_current_stream().synchronize()
    idx = np.array([0, 1, T // 2, T - 2, T - 1])
    xs = cp.asnumpy(x[cp.asarray(idx)])
    ref = tail_rope_reference(xs, c_h[idx], s_h[idx])
    assert np.array_equal(bits(cp.asnumpy(out[cp.asarray(idx)])), bits(ref))
    assert not bool(cp.isnan(out).any())


@pytest.mark.parametrize("which", ["x", "cosine", "sine", "out"])
def test_rejects_misaligned_noncontiguous_overlapping(cp, which):
    import rope_rtc

    T, H, D = 8, 2, 128
    x_h, c_h, s_h = tail_random_inputs(T, H, D, seed=70)
    arrs = {"x": cp.asarray(x_h), "cosine": cp.asarray(c_h), "sine": cp.asarray(s_h),
            "out": cp.empty((T, H, D), dtype=ml_dtypes.bfloat16)}
    plan = rope_rtc.TailRoPEForward(*arrs.values()).check_support().compile()
    before = bits(cp.asnumpy(arrs["out"])).copy()

    def call(**override):
        a = dict(arrs, **override)
        return plan.execute(a["x"], a["cosine"], a["sine"], a["out"])

    ref = arrs[which]
    flat = cp.empty(ref.size + 8, dtype=ref.dtype)
    mis = flat[1:1 + ref.size].reshape(ref.shape)
    with pytest.raises(ValueError, match="aligned"):
        call(**{which: mis})
    wide = cp.empty(ref.shape[:-1] + (ref.shape[-1] * 2,), dtype=ref.dtype)[..., : ref.shape[-1]]
    with pytest.raises(ValueError, match="contiguous"):
        call(**{which: wide})
    if which != "out":
        # One buffer holding an output and, inside it, the input under test.
        buf = cp.empty(2 * T * H * D * 2, dtype=cp.uint8)
        alias_out = cp.ndarray((T, H, D), dtype=ml_dtypes.bfloat16, memptr=buf.data)
        inner = cp.ndarray(ref.shape, dtype=ref.dtype, memptr=buf.data + 1024)
        inner[...] = ref
        with pytest.raises(ValueError, match=f"out overlaps {which}"):
            call(**{which: inner, "out": alias_out})
    assert np.array_equal(bits(cp.asnumpy(arrs["out"])), before), "a rejected call wrote to out"


def test_plan_stays_on_its_device(cp, monkeypatch):
    """A plan built while device 0 is current keeps device 0 when another device becomes current."""
    import rope_rtc
    from rope_rtc.core import descriptors

    desc = rope_rtc.TensorDesc(ml_dtypes.bfloat16, (4, 2, 128), device="cuda")
    tab = rope_rtc.TensorDesc("float32", (4, 32), device="cuda")
    plan = rope_rtc.TailRoPEForward(desc, tab, tab, desc).check_support().compile()
    assert plan.device == 0
    monkeypatch.setattr(cp.cuda.runtime, "getDevice", lambda: 1)
    x_h, c_h, s_h = tail_random_inputs(4, 2, 128, seed=80)
    x, c, s = cp.asarray(x_h), cp.asarray(c_h), cp.asarray(s_h)
    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    plan.execute(x, c, s, out)
    assert plan.device == 0
    cp.cuda.get_current_stream().synchronize()
    _compare(cp, (x_h, c_h, s_h), (x, c, s), out)
    desc2 = descriptors.TensorDesc(ml_dtypes.bfloat16, (4, 2, 128), device="cuda")
    assert desc2.device == 1  # a new declaration binds to the (patched) current device


def test_new_arrays_every_call_still_checked(cp):
    """Fresh arrays of a validated signature: results right; overlap and misalignment still rejected."""
    import rope_rtc

    T, H, D = 16, 4, 128
    plan = None
    for gen in range(5):
        x_h, c_h, s_h = tail_random_inputs(T, H, D, seed=90 + gen)
        x, c, s = cp.asarray(x_h), cp.asarray(c_h), cp.asarray(s_h)
        out = cp.full(x.shape, cp.nan, dtype=x.dtype)
        plan = plan or rope_rtc.TailRoPEForward(x, c, s, out).check_support().compile()
        plan.execute(x, c, s, out)
        _compare(cp, (x_h, c_h, s_h), (x, c, s), out)
    buf = cp.empty((2 * T * H * D,), dtype=ml_dtypes.bfloat16)
    xo = buf[: T * H * D].reshape(T, H, D)
    oo = buf[T * H * D // 2: T * H * D // 2 + T * H * D].reshape(T, H, D)
    with pytest.raises(ValueError, match="overlaps x"):
        plan.execute(xo, c, s, oo)
    flat = cp.empty((T * H * D + 8,), dtype=ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="aligned"):
        plan.execute(flat[1:1 + T * H * D].reshape(T, H, D), c, s, out)
