"""cos and sin computed in the kernel from inv_freq (cuda_src/angles.cuh) on the GPU: every
position 0 .. 2^20 against the exact table (within one ulp; equal, as measured),
both numerics and every rope_type against table calls, NaN-poisoned outputs, plans rebinding
inv_freq, graph capture."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gpu_util import DTYPES, after_current_stream, bits, host_random, poisoned
from helpers import layout_shape

pytestmark = pytest.mark.gpu

SCALINGS = {
    "default": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4096},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.01 * i for i in range(64)],
                 "long_factor": [2.0 + 0.1 * i for i in range(64)], "original_max_position_embeddings": 4096,
                 "max_position_embeddings": 131072},
}


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in ulps of their (equal) float type: ordered integer representations; +0 and -0
    are one apart."""
    bits_ = 8 * a.dtype.itemsize
    signed = {16: np.int16, 32: np.int32}[bits_]

    def ordered(x):
        i = x.view(signed).astype(np.int64)
        return np.where(i < 0, -(i & ((1 << (bits_ - 1)) - 1)), i)

    return np.abs(ordered(a) - ordered(b))


EPS = {2: {"bfloat16": 2.0**-7, "float16": 2.0**-10}, 4: {"float32": 2.0**-23}}


def assert_same_but_boundaries(got, want, x):
    """Equal bit for bit, except where an entry of the kernel's cos/sin is one ulp from the exact
    table's (a value within about 1e-16 of a float32 rounding boundary; none measured): there
    the output moves by at most that ulp times the input, plus a rounding of the output (``x``:
    the input, whose largest channel of each head bounds it)."""
    d = ulps(got, want)
    assert np.count_nonzero(d) <= 1e-4 * d.size + 1, np.count_nonzero(d)
    eps = EPS[got.dtype.itemsize][str(got.dtype)]
    scale = np.abs(x.astype(np.float64)).max(axis=-1, keepdims=True)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert (err <= 2.0**-23 * scale + 2 * eps * np.abs(want.astype(np.float64))).all()


def kernel_tables(cp, inv_freq, attention, positions, interleaved=False):
    """cos and sin as the kernel computes them: float32 q of ones and zeros (x0 = 1, x1 = 0), whose
    rotation is exactly (cos, sin), out of place into NaN-poisoned outputs."""
    import rope_rtc

    half = inv_freq.size
    T = positions.size
    x = np.zeros((T, 1, 2 * half), np.float32)
    if interleaved:
        x[..., 0::2] = 1.0
    else:
        x[..., :half] = 1.0
    q = cp.asarray(x)
    out = poisoned(cp, q.shape, np.float32)
    rope_rtc.apply_rope(q, inv_freq=cp.asarray(inv_freq), attention_scaling=attention, positions=cp.asarray(positions),
                        layout="thd", interleaved=interleaved, out=out)
    o = cp.asnumpy(out)[:, 0]
    if interleaved:
        return o[:, 0::2], o[:, 1::2]
    return o[:, :half], o[:, half:]


@pytest.mark.parametrize("scaling", ["default", "llama3", "yarn"])
def test_every_position_to_2_20_within_one_ulp_of_the_exact_table(cp, scaling):
    import rope_rtc

    rows = 2**20 + 1
    f, att = rope_rtc.inverse_frequencies(128, base=5e5, scaling=SCALINGS[scaling], max_positions=rows)
    cos, sin = rope_rtc.rope_tables(rows, 128, base=5e5, scaling=SCALINGS[scaling])
    pos = np.arange(rows, dtype=np.int64)
    c, s = kernel_tables(cp, f, att, pos)
    for got, want in ((c, cos), (s, sin)):
        d = ulps(got, want)
        assert int(d.max()) <= 1, (scaling, np.argwhere(d > 1)[:5])
        # One ulp only where a value sits within about 1e-16 of a rounding boundary (measured: none);
        # the series to x^11 / x^12 left about 4 per million, which this catches.
        assert np.count_nonzero(d) <= 1e-6 * d.size


def test_transformers_numerics_is_the_transformers_table(cp):
    import rope_rtc

    rows = 2**17
    scaling = SCALINGS["yarn"]
    f, att = rope_rtc.inverse_frequencies(128, base=1e6, scaling=scaling, max_positions=rows, numerics="transformers")
    cos, sin = rope_rtc.rope_tables(rows, 128, base=1e6, scaling=scaling, numerics="transformers")
    pos = np.random.default_rng(0).integers(0, rows, 2**16)
    c, s = kernel_tables(cp, f, att, pos, interleaved=True)
    for got, want in ((c, cos[pos]), (s, sin[pos])):
        d = ulps(got, want)
        # One ulp before the float32 factor (about 1.14 here), which can widen it to two.
        assert int(d.max()) <= 2
        assert np.count_nonzero(d) <= 1e-5 * d.size


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
@pytest.mark.parametrize("numerics", ["exact", "transformers"])
def test_every_rope_type_gives_its_table_call(cp, scaling, numerics):
    import rope_rtc

    rows = 262144
    f, att = rope_rtc.inverse_frequencies(128, base=1e4, scaling=SCALINGS[scaling], max_positions=rows,
                                          numerics=numerics)
    cos, sin = rope_rtc.rope_tables(rows, 128, base=1e4, scaling=SCALINGS[scaling], numerics=numerics)
    rng = np.random.default_rng(1)
    q = cp.asarray(host_random((3, 50, 8, 128), DTYPES["bfloat16"], 2))
    k = cp.asarray(host_random((3, 50, 2, 128), DTYPES["bfloat16"], 3))
    pos = cp.asarray(rng.integers(0, rows, (3, 50)).astype(np.int64))
    qa, ka = poisoned(cp, q.shape, q.dtype), poisoned(cp, k.shape, k.dtype)
    rope_rtc.apply_rope_qk(q, k, inv_freq=cp.asarray(f), attention_scaling=att, positions=pos, q_out=qa, k_out=ka,
                           layout="bshd")
    qb, kb = rope_rtc.apply_rope_qk(q, k, cp.asarray(cos), cp.asarray(sin), positions=pos, layout="bshd")
    for a, b, x in ((qa, qb, q), (ka, kb, k)):
        assert_same_but_boundaries(cp.asnumpy(a), cp.asnumpy(b), cp.asnumpy(x))


CASES = list(itertools.product(["float32", "float16", "bfloat16"], ["bshd", "bhsd", "sbhd", "thd"], [False, True],
                               ["offset", "offsets", "positions", "cu_seqlens"], [False, True], [False, True]))


@pytest.mark.parametrize("dtype,layout,interleaved,scheme,in_place,large", [
    c for c in CASES if (c[3] != "cu_seqlens" or c[1] == "thd") and (c[3] != "offsets" or c[1] != "thd")])
def test_rotation_matches_the_table_call(cp, dtype, layout, interleaved, scheme, in_place, large):
    """Every dtype, layout, pair style, position scheme, in place or out, small launches (one head
    per thread) and large ones (8), against the same call with the exact table."""
    import rope_rtc

    B, S, Hq, Hk, D = (2, 1500, 16, 8, 128) if large else (2, 37, 32, 8, 64)
    rows = 4096
    dt = DTYPES[dtype]
    f, att = rope_rtc.inverse_frequencies(D, base=1e4, scaling=SCALINGS["yarn"])
    cos, sin = (cp.asarray(a) for a in rope_rtc.rope_tables(rows, D, base=1e4, scaling=SCALINGS["yarn"]))
    rng = np.random.default_rng(4)
    if scheme == "offset":
        kw = {"offset": 5}
    elif scheme == "offsets":
        kw = {"offset": cp.asarray(rng.integers(0, rows - S, B).astype(np.int32))}
    elif scheme == "positions":
        kw = {"positions": cp.asarray(rng.integers(0, rows, (B * S,) if layout == "thd" else (B, S)))}
    else:
        kw = {"cu_seqlens": cp.asarray(np.array([0, 30, B * S], np.int32)),
              "offset": cp.asarray(np.array([3, 600], np.int64))}
    q = cp.asarray(host_random(layout_shape(layout, B, S, Hq, D), dt, 5))
    k = cp.asarray(host_random(layout_shape(layout, B, S, Hk, D), dt, 6))
    want = rope_rtc.apply_rope_qk(q, k, cos, sin, layout=layout, interleaved=interleaved, **kw)
    if in_place:
        qo, ko = q.copy(), k.copy()
        rope_rtc.apply_rope_qk(qo, ko, inv_freq=cp.asarray(f), attention_scaling=att, layout=layout,
                               interleaved=interleaved, q_out=qo, k_out=ko, **kw)
    else:
        qo, ko = poisoned(cp, q.shape, dt), poisoned(cp, k.shape, dt)
        rope_rtc.apply_rope_qk(q, k, inv_freq=cp.asarray(f), attention_scaling=att, layout=layout,
                               interleaved=interleaved, q_out=qo, k_out=ko, **kw)
    for a, b, x in ((qo, want[0], q), (ko, want[1], k)):
        assert_same_but_boundaries(cp.asnumpy(a), cp.asnumpy(b), cp.asnumpy(x))


def test_partial_window_in_place_and_inverse(cp):
    import rope_rtc

    f, _ = rope_rtc.inverse_frequencies(64)
    cos, sin = (cp.asarray(a) for a in rope_rtc.rope_tables(100, 64))
    x = cp.asarray(host_random((2, 9, 4, 128), DTYPES["float16"], 7))
    want = rope_rtc.apply_rope(x, cos, sin, rotary_dim=64, rotary_offset=32, inverse=True, offset=11, layout="bshd")
    got = x.copy()
    rope_rtc.apply_rope(got, inv_freq=cp.asarray(f), rotary_dim=64, rotary_offset=32, inverse=True, offset=11, out=got,
                        layout="bshd")
    assert np.array_equal(bits(cp.asnumpy(got)), bits(cp.asnumpy(want)))


def test_a_device_position_past_2_31_gives_nan_and_long_positions_work(cp):
    import rope_rtc

    f, _ = rope_rtc.inverse_frequencies(128, base=5e5)
    x = cp.asarray(host_random((3, 2, 128), DTYPES["float32"], 8))
    pos = cp.asarray(np.array([2**31 - 1, 2**31, 2**24 + 3], np.int64))
    out = rope_rtc.apply_rope(x, inv_freq=cp.asarray(f), positions=pos, layout="thd")
    o = cp.asnumpy(out)
    assert np.isnan(o[1]).all() and np.isfinite(o[[0, 2]]).all()
    c, s = rope_rtc.tables.angle_rows(np.array([2**31 - 1, 2**24 + 3]), f, 1.0)
    c2, s2 = kernel_tables(cp, f, 1.0, np.array([2**31 - 1, 2**24 + 3]))
    assert ulps(c2, c).max() <= 1 and ulps(s2, s).max() <= 1


def test_plan_rebinds_inv_freq_and_replays_under_capture(cp):
    import rope_rtc

    f1, a1 = rope_rtc.inverse_frequencies(128, base=1e4)
    f2, _ = rope_rtc.inverse_frequencies(128, base=5e5)
    d1, d2 = cp.asarray(f1), cp.asarray(f2)
    q = cp.asarray(host_random((8, 1, 32, 128), DTYPES["bfloat16"], 9))
    k = cp.asarray(host_random((8, 1, 8, 128), DTYPES["bfloat16"], 10))
    offs = cp.asarray(np.arange(8, dtype=np.int32) * 1000)
    plan = rope_rtc.RopePlan(q, k, inv_freq=d1, offset=offs, q_out=poisoned(cp, q.shape, q.dtype),
                             k_out=poisoned(cp, k.shape, k.dtype), layout="bshd").compile()
    results = []
    for d, f in ((d1, f1), (d2, f2), (d1, f1)):
        qo, ko = poisoned(cp, q.shape, q.dtype), poisoned(cp, k.shape, k.dtype)
        plan.execute(q, k, q_out=qo, k_out=ko, offset=offs, inv_freq=d)
        cos, sin = (cp.asarray(a) for a in rope_rtc.rope_tables(8000, 128, base=1e4 if f is f1 else 5e5))
        want = rope_rtc.apply_rope_qk(q, k, cos, sin, offset=offs, layout="bshd")
        assert np.array_equal(bits(cp.asnumpy(qo)), bits(cp.asnumpy(want[0])))
        results.append((qo, ko))
    stream = cp.cuda.Stream(non_blocking=True)
    qo, ko = poisoned(cp, q.shape, q.dtype), poisoned(cp, k.shape, k.dtype)
    with stream:
        stream.begin_capture()
        plan.execute(q, k, q_out=qo, k_out=ko, offset=offs, inv_freq=d2, stream=stream)
        graph = stream.end_capture()
    after_current_stream(cp, stream)  # the outputs' NaN fill
    graph.launch(stream)
    stream.synchronize()
    assert np.array_equal(bits(cp.asnumpy(qo)), bits(cp.asnumpy(results[1][0])))
    assert np.array_equal(bits(cp.asnumpy(ko)), bits(cp.asnumpy(results[1][1])))


def test_numpy_arrays_and_torch_tensors_take_the_same_path(cp):
    """NumPy in and out (staged through the GPU), and PyTorch tensors through DLPack, with
    inv_freq: the same bits as CuPy arrays."""
    import rope_rtc

    f, att = rope_rtc.inverse_frequencies(64, base=1e4, scaling=SCALINGS["yarn"])
    x = host_random((2, 9, 4, 64), np.float32, 11)
    want = cp.asnumpy(rope_rtc.apply_rope(cp.asarray(x), inv_freq=cp.asarray(f), attention_scaling=att, offset=3,
                                          layout="bshd"))
    got = rope_rtc.apply_rope(x, inv_freq=f, attention_scaling=att, offset=3, layout="bshd")
    assert isinstance(got, np.ndarray) and np.array_equal(bits(got), bits(want))
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(x).cuda()
    out = torch.empty_like(t)
    rope_rtc.apply_rope(t, inv_freq=torch.from_numpy(f).cuda(), attention_scaling=att, offset=3, out=out, layout="bshd")
    assert np.array_equal(bits(out.cpu().numpy()), bits(want))


def test_numpy_in_with_a_partial_window_is_served_on_the_gpu_too(cp):
    # The staged copies are private: a partial window out of place (the caller's view) is rotated
    # in place on the GPU, as the NumPy backend computes it.
    import rope_rtc

    f, _ = rope_rtc.inverse_frequencies(32)
    x = host_random((2, 5, 3, 64), np.float32, 12)
    want = rope_rtc.apply_rope(x, inv_freq=f, rotary_dim=32, offset=2, backend="numpy", layout="bshd")
    got = rope_rtc.apply_rope(x, inv_freq=f, rotary_dim=32, offset=2, layout="bshd")
    y = np.full_like(x, np.nan)
    rope_rtc.apply_rope(x, inv_freq=f, rotary_dim=32, offset=2, out=y, layout="bshd")
    for a in (got, y):
        assert np.array_equal(a[..., 32:], x[..., 32:])
        assert np.allclose(a, want, rtol=0, atol=1e-6 * np.abs(x).max())
