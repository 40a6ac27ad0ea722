"""The NumPy backend (``backend="numpy"``) against formulas written out here, in float64.

General RoPE: every layout, pair style, rotary window, position scheme, GQA, in place, inverse and
dtype, compared with an independent float64 computation fed the same float32 tables (built here
with NumPy: float64 angles, cos/sin rounded once to float32), within DESIGN.md's bounds through
``reference.assert_rope_close``. Tail RoPE: bit for bit against ``reference.tail_rope_reference``.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

from rope_rtc import RopePlan, TailRoPEForward, apply_rope, apply_rope_qk, tail_rope
from rope_rtc import backends
from rope_rtc import rope as R
from rope_rtc.reference import assert_rope_close, tail_rope_reference
from fakes import FakeDeviceArray, FakeGPU
from tail_cases import tail_edge_inputs, tail_random_inputs

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
DTYPE_IDS = ["float32", "float16", "bfloat16"]
LAYOUTS = ["bshd", "bhsd", "sbhd", "thd"]


def make_tables(max_positions, rotary_dim, base=10000.0):
    """cos/sin [max_positions, rotary_dim // 2]: float64 frequencies and angles, one rounding to float32."""
    inv_freq = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def expected_rope(x, cos, sin, positions, *, interleaved, rotary_dim=None, rotary_offset=0, inverse=False):
    """float64 RoPE of ``x`` [..., H, D] with one table row per token (``positions`` [...]).

    Half-split pairs follow Hugging Face: ``x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x) = cat(-x2, x1)`` and the table repeated over both halves. Interleaved pairs:
    ``(x[2i], x[2i+1]) -> (x0 c - x1 s, x1 c + x0 s)``. A position outside the table gives NaN.
    """
    x64 = np.asarray(x).astype(np.float64)
    d = x64.shape[-1]
    r = d if rotary_dim is None else rotary_dim
    ro = rotary_offset
    positions = np.asarray(positions)
    valid = (positions >= 0) & (positions < cos.shape[0])
    rows = np.where(valid, positions, 0)
    c = np.where(valid[..., None], cos.astype(np.float64)[rows], np.nan)[..., None, :]  # shared by heads
    s = np.where(valid[..., None], sin.astype(np.float64)[rows], np.nan)[..., None, :]
    if inverse:
        s = -s
    out = x64.copy()
    w = x64[..., ro : ro + r]
    if interleaved:
        x0, x1 = w[..., 0::2], w[..., 1::2]
        res = np.empty_like(w)
        res[..., 0::2] = x0 * c - x1 * s
        res[..., 1::2] = x1 * c + x0 * s
    else:
        h = r // 2
        rotate_half = np.concatenate([-w[..., h:], w[..., :h]], axis=-1)
        res = w * np.concatenate([c, c], axis=-1) + rotate_half * np.concatenate([s, s], axis=-1)
    out[..., ro : ro + r] = res
    return out


def random_x(shape, dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def to_layout(x_bshd, layout):
    B, S, H, D = x_bshd.shape
    if layout == "bshd":
        return x_bshd.copy()
    if layout == "bhsd":
        return np.ascontiguousarray(x_bshd.transpose(0, 2, 1, 3))
    if layout == "sbhd":
        return np.ascontiguousarray(x_bshd.transpose(1, 0, 2, 3))
    return x_bshd.reshape(B * S, H, D).copy()


def from_layout(y, layout, B, S):
    if layout == "bshd":
        return y
    if layout == "bhsd":
        return y.transpose(0, 2, 1, 3)
    if layout == "sbhd":
        return y.transpose(1, 0, 2, 3)
    return y.reshape(B, S, *y.shape[1:])


# ---------------------------------------------------------------------------------------------
# the worked example, and the two pair conventions

def test_blog_example():
    # d = 4, base 100, position m = 2, x = [1, 2, 3, 4], adjacent pairs.
    cos, sin = make_tables(3, 4, base=100.0)
    x = np.array([[[[1.0, 2.0, 3.0, 4.0]]]], dtype=np.float32)
    want = [-2.23474, 0.07700, 2.14552, 4.51627]
    by_offset = apply_rope(x, cos, sin, offset=2, interleaved=True, backend="numpy")
    by_position = apply_rope(x, cos, sin, positions=np.array([[2]], np.int32), interleaved=True, backend="numpy")
    np.testing.assert_allclose(by_offset.reshape(-1), want, atol=1e-5)
    np.testing.assert_array_equal(by_offset, by_position)
    assert by_offset.dtype == np.float32 and by_offset.shape == x.shape
    # Half-split pairs (x0, x2) and (x1, x3) rotate by the angles 2 and 0.2 instead.
    half = apply_rope(x, cos, sin, offset=2, backend="numpy").reshape(-1)
    c, s = np.cos([2.0, 0.2]), np.sin([2.0, 0.2])
    np.testing.assert_allclose(half, [1 * c[0] - 3 * s[0], 2 * c[1] - 4 * s[1], 3 * c[0] + 1 * s[0],
                                      4 * c[1] + 2 * s[1]], atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_formula_whole_head(dtype, interleaved):
    B, S, H, D = 2, 7, 3, 64
    cos, sin = make_tables(32, D)
    x = random_x((B, S, H, D), dtype, seed=1, scale=3.0)
    got = apply_rope(x, cos, sin, offset=5, interleaved=interleaved, backend="numpy")
    pos = np.broadcast_to(5 + np.arange(S), (B, S))
    want = expected_rope(x, cos, sin, pos, interleaved=interleaved)
    assert got.dtype == dtype
    assert_rope_close(got, want, x, interleaved=interleaved)
    if dtype == np.float32:  # one rounding of the float64 value: exactly NumPy's cast
        np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("rotary_dim,rotary_offset", [(32, 0), (32, 16), (32, 32), (2, 0), (2, 62), (40, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_partial_and_offset_windows(dtype, interleaved, rotary_dim, rotary_offset):
    B, S, H, D = 2, 5, 2, 64
    cos, sin = make_tables(8, rotary_dim)
    x = random_x((B, S, H, D), dtype, seed=2)
    got = apply_rope(x, cos, sin, rotary_dim=rotary_dim, rotary_offset=rotary_offset, interleaved=interleaved,
                     backend="numpy")
    want = expected_rope(x, cos, sin, np.broadcast_to(np.arange(S), (B, S)), interleaved=interleaved,
                         rotary_dim=rotary_dim, rotary_offset=rotary_offset)
    assert_rope_close(got, want, x, interleaved=interleaved, rotary_dim=rotary_dim, rotary_offset=rotary_offset)
    outside = np.ones(D, bool)
    outside[rotary_offset : rotary_offset + rotary_dim] = False
    np.testing.assert_array_equal(np.ascontiguousarray(got[..., outside]).view(np.uint8),
                                  np.ascontiguousarray(x[..., outside]).view(np.uint8))


@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
def test_inverse(interleaved):
    B, S, H, D = 1, 9, 2, 32
    cos, sin = make_tables(16, D)
    x = random_x((B, S, H, D), np.float32, seed=3)
    fwd = apply_rope(x, cos, sin, offset=3, interleaved=interleaved, backend="numpy")
    back = apply_rope(fwd, cos, sin, offset=3, interleaved=interleaved, inverse=True, backend="numpy")
    np.testing.assert_allclose(back, x, rtol=0, atol=4e-6 * np.abs(x).max())
    pos = np.broadcast_to(3 + np.arange(S), (B, S))
    want = expected_rope(x, cos, sin, pos, interleaved=interleaved, inverse=True)
    got = apply_rope(x, cos, sin, offset=3, interleaved=interleaved, inverse=True, backend="numpy")
    assert_rope_close(got, want, x, interleaved=interleaved)
    # The inverse is the rotation by the negated sine table.
    np.testing.assert_array_equal(got, apply_rope(x, cos, -sin, offset=3, interleaved=interleaved, backend="numpy"))


# ---------------------------------------------------------------------------------------------
# layouts and position schemes

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_layout(layout, dtype):
    B, S, H, D = 2, 6, 3, 16
    cos, sin = make_tables(24, D)
    xb = random_x((B, S, H, D), dtype, seed=4)
    x = to_layout(xb, layout)
    got = apply_rope(x, cos, sin, layout=layout, offset=2, backend="numpy")
    assert got.shape == x.shape and got.dtype == dtype
    if layout == "thd":  # one packed sequence: the position runs over all B*S tokens
        pos = (2 + np.arange(B * S)).reshape(B, S)
    else:
        pos = np.broadcast_to(2 + np.arange(S), (B, S))
    want = expected_rope(xb, cos, sin, pos, interleaved=False)
    assert_rope_close(from_layout(got, layout, B, S), want, xb, interleaved=False)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
def test_strided_views_are_used_as_they_are(layout):
    # A bhsd view of bshd memory (no copy) rotates like the contiguous array.
    B, S, H, D = 2, 5, 4, 32
    cos, sin = make_tables(8, D)
    xb = random_x((B, S, H, D), np.float32, seed=5)
    perm = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}[layout]
    view = xb.transpose(perm)
    got = apply_rope(view, cos, sin, layout=layout, backend="numpy")
    want = apply_rope(np.ascontiguousarray(view), cos, sin, layout=layout, backend="numpy")
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_positions_array(layout, index_dtype):
    B, S, H, D = 2, 5, 2, 16
    cos, sin = make_tables(40, D)
    rng = np.random.default_rng(6)
    pos = rng.integers(0, 40, size=(B, S)).astype(index_dtype)
    xb = random_x((B, S, H, D), np.float16, seed=6)
    x = to_layout(xb, layout)
    positions = pos.reshape(-1) if layout == "thd" else pos
    got = apply_rope(x, cos, sin, layout=layout, positions=positions, interleaved=True, backend="numpy")
    want = expected_rope(xb, cos, sin, pos, interleaved=True)
    assert_rope_close(from_layout(got, layout, B, S), want, xb, interleaved=True)


def test_host_positions_outside_the_table_are_rejected():
    # Host positions are checked value by value: no NaN rows, no write, the argument named.
    B, S, H, D = 1, 4, 1, 8
    cos, sin = make_tables(4, 4)
    x = random_x((B, S, H, D), np.float32, seed=7)
    x0 = x.copy()
    for pos, entry in (([[0, 4, 1, 3]], "entry 1 is 4"), ([[0, 1, -1, 3]], "entry 2 is -1")):
        with pytest.raises(ValueError, match=f"positions: {entry}, outside the table's 4 rows"):
            apply_rope(x, cos, sin, positions=np.array(pos, np.int64), rotary_dim=4, rotary_offset=2, out=x,
                       backend="numpy")
        np.testing.assert_array_equal(x, x0)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
def test_offset_array(layout, index_dtype):
    B, S, H, D = 3, 4, 2, 32
    cos, sin = make_tables(64, D)
    offsets = np.array([0, 17, 60], index_dtype)  # the last sequence reads the table's last row
    xb = random_x((B, S, H, D), BF16, seed=8)
    got = apply_rope(to_layout(xb, layout), cos, sin, layout=layout, offset=offsets, backend="numpy")
    pos = offsets[:, None].astype(np.int64) + np.arange(S)[None, :]
    want = expected_rope(xb, cos, sin, pos, interleaved=False)
    assert_rope_close(from_layout(got, layout, B, S), want, xb, interleaved=False)
    with pytest.raises(ValueError, match=r"offset: sequence 2 reads positions 62..65, outside the table's 64 rows"):
        apply_rope(to_layout(xb, layout), cos, sin, layout=layout, offset=np.array([0, 17, 62], index_dtype),
                   backend="numpy")


def _cu_positions(cu, T, offset):
    pos = np.full(T, -1, np.int64)
    for b in range(len(cu) - 1):
        base = offset[b] if isinstance(offset, np.ndarray) else offset
        for t in range(cu[b], cu[b + 1]):
            pos[t] = t - cu[b] + base
    return pos


@pytest.mark.parametrize("offset", [0, 3, "array"])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_thd_cu_seqlens(offset, index_dtype):
    T, H, D = 11, 3, 16
    cos, sin = make_tables(32, D)
    cu = np.array([0, 3, 3, 8, 11], index_dtype)  # an empty sequence too
    off = np.array([5, 0, 9, 20], index_dtype) if offset == "array" else offset
    x = random_x((T, H, D), np.float32, seed=9)
    got = apply_rope(x, cos, sin, layout="thd", cu_seqlens=cu, offset=off, backend="numpy")
    pos = _cu_positions(cu.astype(np.int64), T, off.astype(np.int64) if offset == "array" else off)
    want = expected_rope(x, cos, sin, pos, interleaved=False)
    assert_rope_close(got, want, x, interleaved=False)


@pytest.mark.parametrize("cu,pattern", [
    ([0, 10, 30], r"must end at the token count T=37 \(the last entry is 30\)"),
    ([0, 10, 40], r"must end at the token count T=37 \(the last entry is 40\)"),
    ([0, 40, 37], r"must be non-decreasing, but entry 2 \(37\) is below entry 1 \(40\)"),
    ([0, 20, 10, 37], r"must be non-decreasing"),
    ([1, 10, 37], r"must start at 0"),
])
@pytest.mark.parametrize("backend", ["numpy", "fake-gpu"])
def test_bad_host_cu_seqlens_are_rejected_before_any_write(cu, pattern, backend):
    # Malformed boundaries once gave NaN for the tokens past them, written over the caller's
    # input with out=x; now they are a ValueError naming cu_seqlens, and x is unchanged.
    T, H, D = 37, 2, 16
    cos, sin = make_tables(64, D)
    x = random_x((T, H, D), np.float32, seed=10)
    x0 = x.copy()
    cu_seqlens = np.array(cu, np.int32)
    with FakeGPU() as gpu:
        with pytest.raises(ValueError, match="cu_seqlens: " + pattern):
            apply_rope(x, cos, sin, layout="thd", cu_seqlens=cu_seqlens, out=x,
                       backend="numpy" if backend == "numpy" else "nvrtc")
        assert gpu.launches == []
    np.testing.assert_array_equal(x, x0)


def test_cu_seqlens_offsets_must_keep_every_sequence_in_the_table():
    T, H, D = 8, 1, 8
    cos, sin = make_tables(8, D)
    x = random_x((T, H, D), np.float32, seed=10)
    cu = np.array([0, 3, 8], np.int32)
    with pytest.raises(ValueError, match=r"offset: sequence 1 reads positions 4..8, outside the table's 8 rows"):
        apply_rope(x, cos, sin, layout="thd", cu_seqlens=cu, offset=np.array([0, 4], np.int32), backend="numpy")
    with pytest.raises(ValueError, match=r"offset: sequence 1 reads positions 4..8"):
        apply_rope(x, cos, sin, layout="thd", cu_seqlens=cu, offset=4, backend="numpy")
    got = apply_rope(x, cos, sin, layout="thd", cu_seqlens=cu, offset=3, backend="numpy")
    pos = np.array([3, 4, 5, 3, 4, 5, 6, 7])
    assert_rope_close(got, expected_rope(x, cos, sin, pos, interleaved=False), x, interleaved=False)


# ---------------------------------------------------------------------------------------------
# q and k together, GQA, in place, outputs

@pytest.mark.parametrize("hq,hk", [(8, 2), (4, 1), (2, 2), (1, 3)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_qk_gqa(layout, hq, hk):
    B, S, D = 2, 5, 32
    cos, sin = make_tables(16, 24)
    qb = random_x((B, S, hq, D), np.float16, seed=11)
    kb = random_x((B, S, hk, D), np.float16, seed=12)
    q_out, k_out = apply_rope_qk(to_layout(qb, layout), to_layout(kb, layout), cos, sin, layout=layout, offset=1,
                                 rotary_dim=24, rotary_offset=8, interleaved=True, backend="numpy")
    pos = (1 + np.arange(B * S)).reshape(B, S) if layout == "thd" else np.broadcast_to(1 + np.arange(S), (B, S))
    for got, xb in ((q_out, qb), (k_out, kb)):
        want = expected_rope(xb, cos, sin, pos, interleaved=True, rotary_dim=24, rotary_offset=8)
        assert_rope_close(from_layout(got, layout, B, S), want, xb, interleaved=True, rotary_dim=24, rotary_offset=8)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_in_place(dtype):
    B, S, H, D = 2, 3, 2, 16
    cos, sin = make_tables(8, 8)
    x = random_x((B, S, H, D), dtype, seed=13)
    before = x.copy()
    want = apply_rope(before, cos, sin, rotary_dim=8, rotary_offset=4, backend="numpy")
    got = apply_rope(x, cos, sin, rotary_dim=8, rotary_offset=4, out=x, backend="numpy")
    assert got is x
    np.testing.assert_array_equal(x.view(np.uint8), want.view(np.uint8))
    q, k = random_x((B, S, 4, D), dtype, seed=14), random_x((B, S, 1, D), dtype, seed=15)
    q0, k0 = q.copy(), k.copy()
    rq, rk = apply_rope_qk(q, k, cos, sin, rotary_dim=8, q_out=q, k_out=k, backend="numpy")
    assert rq is q and rk is k
    wq, wk = apply_rope_qk(q0, k0, cos, sin, rotary_dim=8, backend="numpy")
    np.testing.assert_array_equal(q.view(np.uint8), wq.view(np.uint8))
    np.testing.assert_array_equal(k.view(np.uint8), wk.view(np.uint8))


def test_separate_outputs_and_untouched_inputs():
    B, S, H, D = 1, 4, 2, 16
    cos, sin = make_tables(4, 16)
    x = random_x((B, S, H, D), np.float32, seed=16)
    before = x.copy()
    out = np.full_like(x, np.nan)
    assert apply_rope(x, cos, sin, out=out, backend="numpy") is out
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(out, apply_rope(x, cos, sin, backend="numpy"))
    # q in place, k into a separate output: k's channels outside the window are copied there.
    q, k = x.copy(), random_x((B, S, 1, D), np.float32, seed=17)
    k_out = np.full_like(k, np.nan)
    cos8, sin8 = make_tables(4, 8)
    apply_rope_qk(q, k, cos8, sin8, rotary_dim=8, q_out=q, k_out=k_out, backend="numpy")
    np.testing.assert_array_equal(k_out[..., 8:], k[..., 8:])
    assert not np.isnan(k_out).any()


def test_zero_sized_inputs():
    cos, sin = make_tables(4, 16)
    for shape, layout in (((0, 2, 16), "thd"), ((2, 0, 2, 16), "bshd"), ((2, 3, 0, 16), "bshd")):
        x = np.zeros(shape, np.float16)
        got = apply_rope(x, cos, sin, layout=layout, backend="numpy")
        assert got.shape == shape and got.dtype == np.float16


def test_errors_leave_in_place_input_unchanged():
    cos, sin = make_tables(4, 16)
    x = random_x((1, 6, 2, 16), np.float32, seed=18)
    before = x.copy()
    with pytest.raises(ValueError, match="offset"):
        apply_rope(x, cos, sin, out=x, backend="numpy")  # 6 tokens, 4 table rows
    with pytest.raises(TypeError, match="positions"):
        apply_rope(x, cos, sin, out=x, positions=np.zeros((1, 6), np.float32), backend="numpy")
    with pytest.raises(ValueError, match="out overlaps x"):
        apply_rope(x[:, :3], cos, sin, out=x[:, 1:4], backend="numpy")
    np.testing.assert_array_equal(x.view(np.uint8), before.view(np.uint8))


def test_auto_backend_falls_back_to_numpy_once(monkeypatch):
    from rope_rtc import driver

    if driver.available():
        pytest.skip("a GPU is present: backend='auto' uses it")
    cos, sin = make_tables(4, 16)
    x = random_x((1, 2, 1, 16), np.float32, seed=19)
    monkeypatch.setattr(backends, "_fallback_warned", False)
    with pytest.warns(RuntimeWarning, match="runs the NumPy reference"):
        got = apply_rope(x, cos, sin)
    np.testing.assert_array_equal(got, apply_rope(x, cos, sin, backend="numpy"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_rope(x, cos, sin)  # warned once only


def test_plan_needs_device_arrays():
    cos, sin = make_tables(4, 16)
    x = random_x((1, 2, 1, 16), np.float32, seed=20)
    with pytest.raises(TypeError, match="host"):
        RopePlan(x, x.copy(), cos, sin)


# ---------------------------------------------------------------------------------------------
# tail RoPE: bit for bit

def _bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("T,H,D", [(1, None, 128), (4, 32, 128), (17, 3, 128), (5, None, 512), (3, 2, 512),
                                   (0, 2, 128), (0, None, 512)])
@pytest.mark.parametrize("inputs", ["random", "edge"])
def test_tail_numpy_bit_exact(T, H, D, inputs):
    make = tail_random_inputs if inputs == "random" else tail_edge_inputs
    x, cosine, sine = make(T, H, D, seed=T * 31 + D)
    x0 = x.copy()
    want = tail_rope_reference(x, cosine, sine)
    result = tail_rope(x, cosine, sine, backend="numpy")
    (out,) = result
    assert out is result["out"] and out.dtype == BF16 and out.shape == x.shape
    np.testing.assert_array_equal(_bits(out), _bits(want))
    out2 = np.full_like(x, np.nan)
    plan = TailRoPEForward(x, cosine, sine, out2, backend="numpy")
    assert plan.check_support() is plan and plan.compile() is plan and plan.scratch_workspace_bytes() == 0
    assert plan.execute(x, cosine, sine, out2)["out"] is out2
    np.testing.assert_array_equal(_bits(out2), _bits(want))
    # The opposite angle: the negated sine table.
    neg = plan.execute(x, cosine, -sine, out2)["out"]
    np.testing.assert_array_equal(_bits(neg), _bits(tail_rope_reference(x, cosine, -sine)))
    np.testing.assert_array_equal(_bits(x), _bits(x0))  # the input is never written


def test_tail_numpy_plan_token_count_changes():
    x, cosine, sine = tail_random_inputs(3, 4, 128, seed=1)
    plan = TailRoPEForward(x, cosine, sine, np.empty_like(x), backend="numpy").check_support()
    for T in (0, 5, 3, 64):
        x, cosine, sine = tail_edge_inputs(T, 4, 128, seed=T)
        out = np.empty_like(x)
        plan.execute(x, cosine, sine, out)
        np.testing.assert_array_equal(_bits(out), _bits(tail_rope_reference(x, cosine, sine)))
    with pytest.raises(ValueError, match="does not match the plan's H=4"):
        x, cosine, sine = tail_random_inputs(2, 3, 128, seed=2)
        plan.execute(x, cosine, sine, np.empty_like(x))


def test_tail_numpy_errors_leave_inputs_unchanged():
    x, cosine, sine = tail_random_inputs(4, 2, 128, seed=3)
    x0 = x.copy()
    plan = TailRoPEForward(x, cosine, sine, np.empty_like(x), backend="numpy").check_support()
    with pytest.raises(ValueError, match="out overlaps x"):
        plan.execute(x, cosine, sine, x)
    np.testing.assert_array_equal(_bits(x), _bits(x0))
    with pytest.raises(TypeError, match="x: dtype float32"):
        tail_rope(x.astype(np.float32), cosine, sine, backend="numpy")
    with pytest.raises(NotImplementedError, match="non-contiguous"):
        tail_rope(np.zeros((4, 2, 256), BF16)[..., ::2], cosine, sine, backend="numpy")
    with pytest.raises(TypeError, match="backend='numpy' takes host arrays"):
        TailRoPEForward(FakeDeviceArray((4, 64), np.float32), cosine, sine, np.empty_like(x),
                        backend="numpy").check_support()


def test_non_native_byte_order_is_refused_before_anything_is_written():
    # A big-endian k used to pass validation; the reference then rejected it after q_out=q had
    # been rotated. Byte order is part of the dtype check, up front.
    rng = np.random.default_rng(21)
    q = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    k = q.astype(">f4")
    q0, k0 = q.copy(), k.copy()
    cos, sin = make_tables(8, 8)
    with pytest.raises(TypeError, match=r"k: dtype >f4 is in non-native byte order"):
        apply_rope_qk(q, k, cos, sin, q_out=q, k_out=k, backend="numpy")
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)
    with pytest.raises(TypeError, match=r"cos: dtype >f4 is in non-native byte order"):
        apply_rope(q, cos.astype(">f4"), sin, out=q, backend="numpy")
    np.testing.assert_array_equal(q, q0)


@pytest.mark.parametrize("case", ["0-d x", "0-d cos", "offset 2**63, no batch", "offset 2**63"])
def test_degenerate_inputs_raise_documented_errors(case):
    rng = np.random.default_rng(22)
    x = rng.standard_normal((2, 3, 2, 8)).astype(np.float32)
    cos, sin = make_tables(8, 8)
    kw = {}
    if case == "0-d x":
        x, exc, pattern = np.full((), 1.5, np.float32), ValueError, r"x: layout 'bshd' needs a 4-d array"
    elif case == "0-d cos":
        cos, exc, pattern = np.ones((), np.float32), ValueError, r"cos: expected a 2-d table"
    else:
        if case == "offset 2**63, no batch":
            x = x[:0]
        kw, exc, pattern = {"offset": 2**63}, ValueError, r"offset: positions 9223372036854775808"
    with pytest.raises(exc, match=pattern):
        apply_rope(x, cos, sin, backend="numpy", **kw)


# ---------------------------------------------------------------------------------------------
# messages that point at the right fix

def test_a_hugging_face_full_width_table_is_recognised():
    rng = np.random.default_rng(30)
    x = rng.standard_normal((1, 4, 2, 128)).astype(np.float32)
    cos, sin = make_tables(16, 128)  # [16, 64]: rope_rtc's table
    full_cos, full_sin = np.concatenate([cos, cos], 1), np.concatenate([sin, sin], 1)  # HF's cat(freqs, freqs)
    with pytest.raises(ValueError, match=r"cos: has 128 columns, the full rotary dim 128: this looks like a Hugging "
                                         r"Face table .* pass cos\[:, :64\] and sin\[:, :64\]"):
        apply_rope(x, full_cos, full_sin, backend="numpy")
    # ... and the advice works as written.
    got = apply_rope(x, full_cos[:, :64], full_sin[:, :64], backend="numpy")
    np.testing.assert_array_equal(got, apply_rope(x, cos, sin, backend="numpy"))


def test_a_transposed_table_is_called_transposed():
    x = np.random.default_rng(31).standard_normal((1, 4, 2, 16)).astype(np.float32)
    cos, sin = make_tables(16, 16)
    t = np.ascontiguousarray(cos.T)  # built as [rotary_dim // 2, max_positions]
    with pytest.raises(ValueError, match=r"cos: .*transposed view.*pass ascontiguousarray\(t.T\)"):
        apply_rope(x, t.T, sin, backend="numpy")
    np.testing.assert_array_equal(apply_rope(x, np.ascontiguousarray(t.T), sin, backend="numpy"),
                                  apply_rope(x, cos, sin, backend="numpy"))  # the advice works as written


def test_a_float_offset_says_an_int_works():
    x = np.random.default_rng(32).standard_normal((1, 4, 2, 16)).astype(np.float32)
    cos, sin = make_tables(16, 16)
    with pytest.raises(TypeError, match=r"offset: expected an int or an int array .*got float 5.0"):
        apply_rope(x, cos, sin, offset=5.0, backend="numpy")


def test_an_odd_head_dim_does_not_blame_rotary_dim():
    x = np.random.default_rng(33).standard_normal((1, 4, 2, 129)).astype(np.float32)
    cos, sin = make_tables(16, 128)
    with pytest.raises(ValueError, match=r"x: head dim 129 is odd; .*pass an even rotary_dim"):
        apply_rope(x, cos, sin, backend="numpy")
    got = apply_rope(x, cos, sin, rotary_dim=128, backend="numpy")  # the fix the message names
    np.testing.assert_array_equal(got[..., 128], x[..., 128])


def test_the_cpu_fallback_warning_points_at_the_callers_line(monkeypatch):
    monkeypatch.setattr(backends, "_fallback_warned", False)
    monkeypatch.setattr(R, "_gpu_present", False)
    x = np.random.default_rng(34).standard_normal((1, 4, 2, 16)).astype(np.float32)
    cos, sin = make_tables(16, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from rope_rtc import driver

        if driver.available():
            pytest.skip("a GPU is present: backend='auto' does not fall back")
        apply_rope(x, cos, sin)  # the line the warning must name
    (w,) = [c for c in caught if "NumPy reference" in str(c.message)]
    assert w.filename == __file__, w.filename
