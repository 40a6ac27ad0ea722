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
from rope_rtc.core import backends
from rope_rtc.ops import rope as R
from rope_rtc.reference import assert_rope_close, tail_rope_reference
from fakes import FakeDeviceArray, FakeGPU
from helpers import bits
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
    by_offset = apply_rope(x, cos, sin, offset=2, interleaved=True, backend="numpy", layout="bshd")
    by_position = apply_rope(x, cos, sin, positions=np.array([[2]], np.int32), interleaved=True, backend="numpy",
                             layout="bshd")
    np.testing.assert_allclose(by_offset.reshape(-1), want, atol=1e-5)
    np.testing.assert_array_equal(by_offset, by_position)
    assert by_offset.dtype == np.float32 and by_offset.shape == x.shape
    # Half-split pairs (x0, x2) and (x1, x3) rotate by the angles 2 and 0.2 instead.
    half = apply_rope(x, cos, sin, offset=2, backend="numpy", layout="bshd").reshape(-1)
    c, s = np.cos([2.0, 0.2]), np.sin([2.0, 0.2])
    np.testing.assert_allclose(half, [1 * c[0] - 3 * s[0], 2 * c[1] - 4 * s[1], 3 * c[0] + 1 * s[0],
                                      4 * c[1] + 2 * s[1]], atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_formula_whole_head(dtype, interleaved):
    B, S, H, D = 2, 7, 3, 64
    cos, sin = make_tables(32, D)
    x = random_x((B, S, H, D), dtype, seed=1, scale=3.0)
    got = apply_rope(x, cos, sin, offset=5, interleaved=interleaved, backend="numpy", layout="bshd")
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
                     backend="numpy", layout="bshd")
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
    fwd = apply_rope(x, cos, sin, offset=3, interleaved=interleaved, backend="numpy", layout="bshd")
    back = apply_rope(fwd, cos, sin, offset=3, interleaved=interleaved, inverse=True, backend="numpy", layout="bshd")
    np.testing.assert_allclose(back, x, rtol=0, atol=4e-6 * np.abs(x).max())
    pos = np.broadcast_to(3 + np.arange(S), (B, S))
    want = expected_rope(x, cos, sin, pos, interleaved=interleaved, inverse=True)
    got = apply_rope(x, cos, sin, offset=3, interleaved=interleaved, inverse=True, backend="numpy", layout="bshd")
    assert_rope_close(got, want, x, interleaved=interleaved)
    # The inverse is the rotation by the negated sine table.
    np.testing.assert_array_equal(got, apply_rope(x, cos, -sin, offset=3, interleaved=interleaved, backend="numpy",
                                                  layout="bshd"))


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
                       backend="numpy", layout="bshd")
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
    want = apply_rope(before, cos, sin, rotary_dim=8, rotary_offset=4, backend="numpy", layout="bshd")
    got = apply_rope(x, cos, sin, rotary_dim=8, rotary_offset=4, out=x, backend="numpy", layout="bshd")
    assert got is x
    np.testing.assert_array_equal(x.view(np.uint8), want.view(np.uint8))
    q, k = random_x((B, S, 4, D), dtype, seed=14), random_x((B, S, 1, D), dtype, seed=15)
    q0, k0 = q.copy(), k.copy()
    rq, rk = apply_rope_qk(q, k, cos, sin, rotary_dim=8, q_out=q, k_out=k, backend="numpy", layout="bshd")
    assert rq is q and rk is k
    wq, wk = apply_rope_qk(q0, k0, cos, sin, rotary_dim=8, backend="numpy", layout="bshd")
    np.testing.assert_array_equal(q.view(np.uint8), wq.view(np.uint8))
    np.testing.assert_array_equal(k.view(np.uint8), wk.view(np.uint8))


def test_separate_outputs_and_untouched_inputs():
    B, S, H, D = 1, 4, 2, 16
    cos, sin = make_tables(4, 16)
    x = random_x((B, S, H, D), np.float32, seed=16)
    before = x.copy()
    out = np.full_like(x, np.nan)
    assert apply_rope(x, cos, sin, out=out, backend="numpy", layout="bshd") is out
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(out, apply_rope(x, cos, sin, backend="numpy", layout="bshd"))
    # q in place, k into a separate output: k's channels outside the window are copied there.
    q, k = x.copy(), random_x((B, S, 1, D), np.float32, seed=17)
    k_out = np.full_like(k, np.nan)
    cos8, sin8 = make_tables(4, 8)
    apply_rope_qk(q, k, cos8, sin8, rotary_dim=8, q_out=q, k_out=k_out, backend="numpy", layout="bshd")
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
        apply_rope(x, cos, sin, out=x, backend="numpy", layout="bshd")  # 6 tokens, 4 table rows
    with pytest.raises(TypeError, match="positions"):
        apply_rope(x, cos, sin, out=x, positions=np.zeros((1, 6), np.float32), backend="numpy", layout="bshd")
    with pytest.raises(ValueError, match="out overlaps x"):
        apply_rope(x[:, :3], cos, sin, out=x[:, 1:4], backend="numpy", layout="bshd")
    np.testing.assert_array_equal(x.view(np.uint8), before.view(np.uint8))


def test_auto_backend_falls_back_to_numpy_once(monkeypatch):
    from rope_rtc.core import driver

    if driver.available():
        pytest.skip("a GPU is present: backend='auto' uses it")
    cos, sin = make_tables(4, 16)
    x = random_x((1, 2, 1, 16), np.float32, seed=19)
    monkeypatch.setattr(backends, "_fallback_warned", False)
    with pytest.warns(RuntimeWarning, match="runs the NumPy reference"):
        got = apply_rope(x, cos, sin, layout="bshd")
    np.testing.assert_array_equal(got, apply_rope(x, cos, sin, backend="numpy", layout="bshd"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_rope(x, cos, sin, layout="bshd")  # warned once only


@pytest.mark.parametrize("first", ["execute", "compile"])
def test_a_tail_plan_on_auto_without_a_gpu_runs_the_reference_from_its_first_execute(first, monkeypatch):
    """TailRoPEForward(backend="auto") where no GPU is usable: an execute() before compile()
    compiles first, as a plan's does, which here means the NumPy reference (it raised
    AttributeError: 'NoneType' object has no attribute 'execute'). The machine is made GPU-less
    for the plan by the backend choice alone, so the test means the same on a GPU machine."""
    from rope_rtc.ops import tail as tail_module

    monkeypatch.setattr(tail_module, "resolve", lambda backend: "numpy")
    x, cosine, sine = tail_random_inputs(4, 2, 128, seed=3)
    out = np.full_like(x, np.nan)
    plan = TailRoPEForward(x, cosine, sine, out, backend="auto")
    if first == "compile":
        plan.compile()
    assert plan.execute(x, cosine, sine, out)["out"] is out
    np.testing.assert_array_equal(bits(out), bits(tail_rope_reference(x, cosine, sine)))


def test_plan_needs_device_arrays():
    cos, sin = make_tables(4, 16)
    x = random_x((1, 2, 1, 16), np.float32, seed=20)
    with pytest.raises(TypeError, match="host"):
        RopePlan(x, x.copy(), cos, sin)


# ---------------------------------------------------------------------------------------------
# tail RoPE: bit for bit

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
    np.testing.assert_array_equal(bits(out), bits(want))
    out2 = np.full_like(x, np.nan)
    plan = TailRoPEForward(x, cosine, sine, out2, backend="numpy")
    assert plan.check_support() is plan and plan.compile() is plan and plan.scratch_workspace_bytes() == 0
    assert plan.execute(x, cosine, sine, out2)["out"] is out2
    np.testing.assert_array_equal(bits(out2), bits(want))
    # The opposite angle: the negated sine table.
    neg = plan.execute(x, cosine, -sine, out2)["out"]
    np.testing.assert_array_equal(bits(neg), bits(tail_rope_reference(x, cosine, -sine)))
    np.testing.assert_array_equal(bits(x), bits(x0))  # the input is never written


def test_tail_numpy_plan_token_count_changes():
    x, cosine, sine = tail_random_inputs(3, 4, 128, seed=1)
    plan = TailRoPEForward(x, cosine, sine, np.empty_like(x), backend="numpy").check_support()
    for T in (0, 5, 3, 64):
        x, cosine, sine = tail_edge_inputs(T, 4, 128, seed=T)
        out = np.empty_like(x)
        plan.execute(x, cosine, sine, out)
        np.testing.assert_array_equal(bits(out), bits(tail_rope_reference(x, cosine, sine)))
    with pytest.raises(ValueError, match="does not match the plan's H=4"):
        x, cosine, sine = tail_random_inputs(2, 3, 128, seed=2)
        plan.execute(x, cosine, sine, np.empty_like(x))


def test_tail_numpy_errors_leave_inputs_unchanged():
    x, cosine, sine = tail_random_inputs(4, 2, 128, seed=3)
    x0 = x.copy()
    plan = TailRoPEForward(x, cosine, sine, np.empty_like(x), backend="numpy").check_support()
    with pytest.raises(ValueError, match="out overlaps x"):
        plan.execute(x, cosine, sine, x)
    np.testing.assert_array_equal(bits(x), bits(x0))
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
        apply_rope_qk(q, k, cos, sin, q_out=q, k_out=k, backend="numpy", layout="bshd")
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)
    with pytest.raises(TypeError, match=r"cos: dtype >f4 is in non-native byte order"):
        apply_rope(q, cos.astype(">f4"), sin, out=q, backend="numpy", layout="bshd")
    np.testing.assert_array_equal(q, q0)


@pytest.mark.parametrize("case", ["0-d x", "0-d cos", "offset 2**63, no batch", "offset 2**63"])
def test_degenerate_inputs_raise_documented_errors(case):
    rng = np.random.default_rng(22)
    x = rng.standard_normal((2, 3, 2, 8)).astype(np.float32)
    cos, sin = make_tables(8, 8)
    kw = {"layout": "bshd"}
    if case == "0-d x":
        x, exc, pattern = np.full((), 1.5, np.float32), ValueError, r"x: layout 'bshd' needs a 4-d array"
    elif case == "0-d cos":
        cos, exc, pattern = np.ones((), np.float32), ValueError, r"cos: expected a 2-d table"
    else:
        if case == "offset 2**63, no batch":
            x = x[:0]
        kw, exc, pattern = {**kw, "offset": 2**63}, ValueError, r"offset: positions 9223372036854775808"
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
        apply_rope(x, full_cos, full_sin, backend="numpy", layout="bshd")
    # ... and the advice works as written.
    got = apply_rope(x, full_cos[:, :64], full_sin[:, :64], backend="numpy", layout="bshd")
    np.testing.assert_array_equal(got, apply_rope(x, cos, sin, backend="numpy", layout="bshd"))


def test_a_transposed_table_is_called_transposed():
    x = np.random.default_rng(31).standard_normal((1, 4, 2, 16)).astype(np.float32)
    cos, sin = make_tables(16, 16)
    t = np.ascontiguousarray(cos.T)  # built as [rotary_dim // 2, max_positions]
    with pytest.raises(ValueError, match=r"cos: .*transposed view.*pass ascontiguousarray\(t.T\)"):
        apply_rope(x, t.T, sin, backend="numpy", layout="bshd")
    np.testing.assert_array_equal(apply_rope(x, np.ascontiguousarray(t.T), sin, backend="numpy", layout="bshd"),
                                  apply_rope(x, cos, sin, backend="numpy",
                                             layout="bshd"))  # the advice works as written


def test_a_float_offset_says_an_int_works():
    x = np.random.default_rng(32).standard_normal((1, 4, 2, 16)).astype(np.float32)
    cos, sin = make_tables(16, 16)
    with pytest.raises(TypeError, match=r"offset: expected an int or an int array .*got float 5.0"):
        apply_rope(x, cos, sin, offset=5.0, backend="numpy", layout="bshd")


def test_an_odd_head_dim_does_not_blame_rotary_dim():
    x = np.random.default_rng(33).standard_normal((1, 4, 2, 129)).astype(np.float32)
    cos, sin = make_tables(16, 128)
    with pytest.raises(ValueError, match=r"x: head dim 129 is odd; .*pass an even rotary_dim"):
        apply_rope(x, cos, sin, backend="numpy", layout="bshd")
    got = apply_rope(x, cos, sin, rotary_dim=128, backend="numpy", layout="bshd")  # the fix the message names
    np.testing.assert_array_equal(got[..., 128], x[..., 128])


def test_the_cpu_fallback_warning_points_at_the_callers_line(monkeypatch):
    monkeypatch.setattr(backends, "_fallback_warned", False)
    monkeypatch.setattr(R, "_gpu_present", False)
    x = np.random.default_rng(34).standard_normal((1, 4, 2, 16)).astype(np.float32)
    cos, sin = make_tables(16, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from rope_rtc.core import driver

        if driver.available():
            pytest.skip("a GPU is present: backend='auto' does not fall back")
        apply_rope(x, cos, sin, layout="bshd")  # the line the warning must name
    (w,) = [c for c in caught if "NumPy reference" in str(c.message)]
    assert w.filename == __file__, w.filename


# ---------------------------------------------------------------------------------------------
# every public op takes the same backend switch: multimodal RoPE

from rope_rtc import NoDeviceError, apply_mrope, apply_mrope_qk, apply_qk_norm_rope, rope_and_cache  # noqa: E402
from rope_rtc.onnx import rotary_embedding  # noqa: E402
from rope_rtc.reference import (fp8_quantize, mrope_reference, qk_norm_rope_reference,  # noqa: E402
                                qk_norm_rope_transformers_reference, rope_and_cache_reference,
                                rope_kernel_arithmetic, round_to_dtype)
from fakes import fake_cupy  # noqa: E402

SECTION = (8, 12, 12)  # sums to 32: a rotary dim of 64


def _streams(section, half, interleaved_sections):
    """The stream (0 T, 1 H, 2 W) of each frequency, written out as the models lay them out."""
    t, h, w = section
    if not interleaved_sections:  # Qwen2-VL: contiguous
        return np.array([0] * t + [1] * h + [2] * w)
    out = []
    for i in range(half):  # Qwen3-VL: T H W T H W ..., what is left to T
        out.append(1 if i % 3 == 1 and i < 3 * h else 2 if i % 3 == 2 and i < 3 * w else 0)
    return np.array(out)


def _mrope_case(layout, dtype, seed, B=2, S=5, HQ=4, HK=2, D=64, rows=40):
    rng = np.random.default_rng(seed)
    qb, kb = random_x((B, S, HQ, D), dtype, seed), random_x((B, S, HK, D), dtype, seed + 1)
    pos = rng.integers(0, rows, size=(3, B, S))
    positions = pos.reshape(3, B * S) if layout == "thd" else pos
    cos, sin = make_tables(rows, D)
    return qb, kb, to_layout(qb, layout), to_layout(kb, layout), cos, sin, positions, pos


def _expected_mrope(xb, cos, sin, pos, section, interleaved_sections, rotary_dim=None):
    """float64 MRoPE of xb [B, S, H, D]: a per-token table row gathered from each pair's stream."""
    B, S = xb.shape[:2]
    r = xb.shape[-1] if rotary_dim is None else rotary_dim
    stream = _streams(section, r // 2, interleaved_sections)
    rows = pos.reshape(3, B * S)[stream, :].T  # [tokens, R/2]
    cols = np.arange(r // 2)
    tok_cos, tok_sin = cos[rows, cols], sin[rows, cols]
    return expected_rope(xb, tok_cos, tok_sin, np.arange(B * S).reshape(B, S), interleaved=False, rotary_dim=rotary_dim)


@pytest.mark.parametrize("interleaved_sections", [False, True], ids=["contiguous", "interleaved_sections"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mrope_numpy_is_the_float64_reference_rounded_once(dtype, layout, interleaved_sections):
    B, S = 2, 5
    qb, kb, q, k, cos, sin, positions, pos = _mrope_case(layout, dtype, seed=40)
    q0, k0 = q.copy(), k.copy()
    qo, ko = apply_mrope_qk(q, k, cos, sin, positions, SECTION, interleaved_sections=interleaved_sections,
                            layout=layout, backend="numpy")
    assert type(qo) is np.ndarray and qo.dtype == dtype and qo.shape == q.shape and ko.shape == k.shape
    np.testing.assert_array_equal(q.view(np.uint8), q0.view(np.uint8))  # out of place: inputs untouched
    np.testing.assert_array_equal(k.view(np.uint8), k0.view(np.uint8))
    for got, xb in ((qo, qb), (ko, kb)):
        want = _expected_mrope(xb, cos, sin, pos, SECTION, interleaved_sections)
        assert_rope_close(from_layout(got, layout, B, S), want, xb, interleaved=False)
        ref = mrope_reference(xb.reshape(B * S, *xb.shape[2:]), cos, sin, pos.reshape(3, B * S), SECTION,
                              interleaved_sections=interleaved_sections)
        np.testing.assert_array_equal(from_layout(got, layout, B, S).reshape(ref.shape).view(np.uint8),
                                      round_to_dtype(ref, dtype).view(np.uint8))
    x = apply_mrope(q, cos, sin, positions, SECTION, interleaved_sections=interleaved_sections, layout=layout,
                    backend="numpy")
    np.testing.assert_array_equal(x.view(np.uint8), qo.view(np.uint8))


def test_mrope_numpy_with_equal_streams_is_plain_rope():
    _, _, q, k, cos, sin, _, _ = _mrope_case("thd", BF16, seed=41)
    text = np.broadcast_to(np.arange(3, 13), (3, 10))  # text tokens: three equal positions
    got = apply_mrope_qk(q, k, cos, sin, text, SECTION, layout="thd", backend="numpy")
    want = apply_rope_qk(q, k, cos, sin, positions=text[0], layout="thd", backend="numpy")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint16), w.view(np.uint16))


def test_mrope_numpy_outputs_in_place_and_inverse():
    # A partial window rotated in place (the only way the kernel rotates one), then back.
    _, _, q, k, cos96, sin96, positions, _ = _mrope_case("thd", np.float32, seed=42, D=96)
    cos, sin = make_tables(40, 64)
    q0, k0 = q.copy(), k.copy()
    rq, rk = apply_mrope_qk(q, k, cos, sin, positions, SECTION, rotary_dim=64, q_out=q, k_out=k, layout="thd",
                            backend="numpy")
    assert rq is q and rk is k
    np.testing.assert_array_equal(q[..., 64:], q0[..., 64:])  # outside the window: untouched
    assert not np.array_equal(q[..., :64], q0[..., :64])
    back = apply_mrope(q, cos, sin, positions, SECTION, rotary_dim=64, inverse=True, out=q, layout="thd",
                       backend="numpy")
    assert back is q
    np.testing.assert_allclose(q, q0, rtol=0, atol=1e-5)
    # Given outputs receive the result; the returned arrays are those outputs.
    q_out, k_out = np.full_like(q0, np.nan), np.full_like(k0, np.nan)
    q_full = q0.copy()
    want = apply_mrope_qk(q_full, k0, cos96, sin96, positions, (16, 16, 16), layout="thd", backend="numpy")
    got = apply_mrope_qk(q_full, k0, cos96, sin96, positions, (16, 16, 16), q_out=q_out, k_out=k_out, layout="thd",
                         backend="numpy")
    assert got[0] is q_out and got[1] is k_out
    np.testing.assert_array_equal(q_out, want[0])
    np.testing.assert_array_equal(k_out, want[1])


def test_mrope_numpy_checks_every_host_position_and_writes_nothing():
    _, _, q, k, cos, sin, positions, _ = _mrope_case("thd", np.float32, seed=43)
    positions = positions.copy()
    positions[2, 7] = 40  # the width stream, one past the table
    q0 = q.copy()
    with pytest.raises(ValueError, match=r"positions: entry \(2, 7\) is 40, outside the table's 40 rows"):
        apply_mrope_qk(q, k, cos, sin, positions, SECTION, q_out=q, k_out=k, layout="thd", backend="numpy")
    np.testing.assert_array_equal(q, q0)


# ---------------------------------------------------------------------------------------------
# QK-norm + RoPE

def _qk_norm_case(dtype, seed, B=2, S=5, HQ=4, HK=2, D=64, rows=24, weight_dtype=None):
    rng = np.random.default_rng(seed)
    q, k = random_x((B, S, HQ, D), dtype, seed, scale=3.0), random_x((B, S, HK, D), dtype, seed + 1, scale=3.0)
    wdt = dtype if weight_dtype is None else weight_dtype
    qw = (1 + 0.25 * rng.standard_normal(D)).astype(np.float32).astype(wdt)
    kw = (1 + 0.25 * rng.standard_normal(D)).astype(np.float32).astype(wdt)
    cos, sin = make_tables(rows, D)
    return q, k, qw, kw, cos, sin


def _transformers_by_hand(x, w, cos, sin, pos, eps):
    """Qwen3RMSNorm then apply_rotary_pos_emb (half-split pairs) as torch evaluates them: every
    operation in x's dtype computes in float32 and rounds its result to the dtype."""
    dt = x.dtype
    f = np.float32
    xf = x.astype(f)
    ss = np.sum(np.square(xf.astype(np.float64)), axis=-1, keepdims=True).astype(f)  # the sum of squares, in float32
    r = (1 / np.sqrt((ss * (f(1) / f(x.shape[-1])) + f(eps)).astype(np.float64))).astype(f)  # torch.rsqrt
    h = (xf * r).astype(dt)  # hidden_states.to(input_dtype)
    y = (w.astype(f) * h.astype(f)).astype(dt)  # weight * hidden_states
    c, s = cos[pos].astype(dt)[:, None, :], sin[pos].astype(dt)[:, None, :]
    c, s = np.concatenate([c, c], -1), np.concatenate([s, s], -1)
    half = x.shape[-1] // 2
    rot = np.concatenate([-y[..., half:].astype(f), y[..., :half].astype(f)], -1).astype(dt)  # rotate_half
    a = (y.astype(f) * c.astype(f)).astype(dt)
    b = (rot.astype(f) * s.astype(f)).astype(dt)
    return (a.astype(f) + b.astype(f)).astype(dt)  # q * cos + rotate_half(q) * sin


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_the_transformers_numerics_reference_is_qwen3s_arithmetic(dtype):
    x, _, w, _, cos, sin = _qk_norm_case(dtype, seed=50)
    flat = x.reshape(-1, *x.shape[2:])
    pos = np.random.default_rng(50).integers(0, cos.shape[0], flat.shape[0])
    got = qk_norm_rope_transformers_reference(flat, w, cos, sin, pos, eps=1e-6, interleaved=False)
    assert got.dtype == dtype
    want = _transformers_by_hand(flat, w, cos, sin, pos, 1e-6)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("numerics", ["exact", "transformers"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_qk_norm_numpy_is_the_reference_of_its_numerics(dtype, layout, numerics):
    B, S = 2, 5
    qb, kb, qw, kw, cos, sin = _qk_norm_case(dtype, seed=51)
    q, k = to_layout(qb, layout), to_layout(kb, layout)
    qo, ko = apply_qk_norm_rope(q, k, qw, kw, cos, sin, eps=1e-5, numerics=numerics, offset=2, layout=layout,
                                backend="numpy")
    assert qo.dtype == dtype and qo.shape == q.shape and ko.shape == k.shape
    pos = (2 + np.arange(B * S)) if layout == "thd" else np.broadcast_to(2 + np.arange(S), (B, S)).reshape(-1)
    for got, xb, w in ((qo, qb, qw), (ko, kb, kw)):
        flat = xb.reshape(B * S, *xb.shape[2:])
        if numerics == "exact":
            want = round_to_dtype(qk_norm_rope_reference(flat, w, cos, sin, pos, eps=1e-5, interleaved=False), dtype)
        else:
            want = qk_norm_rope_transformers_reference(flat, w, cos, sin, pos, eps=1e-5, interleaved=False)
        np.testing.assert_array_equal(from_layout(got, layout, B, S).reshape(want.shape).view(np.uint8),
                                      want.view(np.uint8))


def test_qk_norm_numpy_exact_is_rmsnorm_then_rope():
    # Against the formula written out: x / sqrt(mean(x^2) + eps) * w, then float64 RoPE, float32 weights.
    B, S = 1, 6
    q, k, qw, kw, cos, sin = _qk_norm_case(np.float32, seed=52, B=B, S=S, weight_dtype=np.float32)
    positions = np.array([[5, 0, 23, 7, 7, 1]], np.int64)
    cos, sin = cos[:, :16], sin[:, :16]
    qo, ko = apply_qk_norm_rope(q, k, qw, kw, cos, sin, eps=1e-6, positions=positions, interleaved=True,
                                rotary_dim=32, rotary_offset=16, layout="bshd", backend="numpy")
    for got, x, w in ((qo, q, qw), (ko, k, kw)):
        x64 = x.astype(np.float64)
        normed = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + float(np.float32(1e-6))) * w
        want = expected_rope(normed, cos, sin, positions, interleaved=True, rotary_dim=32,
                             rotary_offset=16)
        np.testing.assert_array_equal(got, want.astype(np.float32))


def test_qk_norm_numpy_outputs_and_in_place():
    q, k, qw, kw, cos, sin = _qk_norm_case(BF16, seed=53)
    q0, k0 = q.copy(), k.copy()
    want = apply_qk_norm_rope(q, k, qw, kw, cos, sin, layout="bshd", backend="numpy")
    np.testing.assert_array_equal(q.view(np.uint16), q0.view(np.uint16))
    q_out, k_out = np.full_like(q, np.nan), np.full_like(k, np.nan)
    got = apply_qk_norm_rope(q, k, qw, kw, cos, sin, q_out=q_out, k_out=k_out, layout="bshd", backend="numpy")
    assert got[0] is q_out and got[1] is k_out
    got = apply_qk_norm_rope(q, k, qw, kw, cos, sin, q_out=q, k_out=k, layout="bshd", backend="numpy")
    assert got[0] is q and got[1] is k
    for a, b, c in ((q_out, q, want[0]), (k_out, k, want[1])):
        np.testing.assert_array_equal(a.view(np.uint16), c.view(np.uint16))
        np.testing.assert_array_equal(b.view(np.uint16), c.view(np.uint16))


@pytest.mark.parametrize("numerics", ["exact", "transformers"])
def test_qk_norm_numpy_without_a_layout_reads_3d_arrays_as_thd(numerics):
    """A 3-d [T, H, D] call needs no layout on the NumPy backend either (it raised KeyError: None)."""
    q, k, qw, kw, cos, sin = _qk_norm_case(BF16, seed=59)
    q, k = q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for backend in ("numpy", "auto"):
            got = apply_qk_norm_rope(q, k, qw, kw, cos, sin, numerics=numerics, backend=backend)
            want = apply_qk_norm_rope(q, k, qw, kw, cos, sin, numerics=numerics, layout="thd", backend="numpy")
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


# ---------------------------------------------------------------------------------------------
# RoPE fused with the paged KV-cache write

def _cache_case(dtype, seed, kv_layout="nhd", kind="auto", T=6, HQ=4, HK=2, D=64, blocks=3, block_size=4):
    """A valid rope_and_cache call on host arrays (rotary_dim 48): caches full of random entries
    (FP8 ones as random bytes), T distinct slots but one token's, which is skipped (-1)."""
    rng = np.random.default_rng(seed)
    q, k, v = (random_x((T, h, D), dtype, seed + i) for i, h in enumerate((HQ, HK, HK)))
    cos, sin = make_tables(32, 48)
    shape = (blocks, block_size, HK, D) if kv_layout == "nhd" else (blocks, HK, block_size, D)
    if kind == "auto":
        k_cache, v_cache = random_x(shape, dtype, seed + 7), random_x(shape, dtype, seed + 8)
    else:
        k_cache, v_cache = (rng.integers(0, 256, size=shape).astype(np.uint8) for _ in range(2))
    slots = rng.permutation(blocks * block_size)[:T].astype(np.int64)
    slots[2] = -1
    positions = rng.integers(0, 32, T).astype(np.int32)
    return dict(q=q, k=k, v=v, cos=cos, sin=sin, positions=positions, slot_mapping=slots, k_cache=k_cache,
                v_cache=v_cache)


@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("kv_layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope_and_cache_numpy_writes_what_the_kernel_writes(dtype, kv_layout, kind):
    kw = _cache_case(dtype, seed=60, kv_layout=kv_layout, kind=kind)
    scales = {} if kind == "auto" else dict(k_scale=np.array([0.5], np.float32), v_scale=np.array(2.0, np.float32))
    before = {name: a.copy() for name, a in kw.items()}
    want = rope_and_cache_reference(*(before[n] for n in ("q", "k", "v", "cos", "sin", "positions", "slot_mapping",
                                                         "k_cache", "v_cache")), kv_layout=kv_layout,
                                    kv_cache_dtype=kind, interleaved=True, rotary_dim=48,
                                    **{n: s.reshape(-1)[0] for n, s in scales.items()})
    got = rope_and_cache(**kw, kv_layout=kv_layout, kv_cache_dtype=kind, interleaved=True, rotary_dim=48,
                         backend="numpy", **scales)
    # q and k rotated in place (the default), the caches written in place: as on the GPU.
    assert got[0] is kw["q"] and got[1] is kw["k"]
    for a, b in zip((kw["q"], kw["k"], kw["k_cache"], kw["v_cache"]), want):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    # What that is, written out: the kernel's arithmetic, each slot's k and v (as FP8: value / scale).
    k_rot = rope_kernel_arithmetic(before["k"], before["cos"], before["sin"], before["positions"], interleaved=True,
                                   rotary_dim=48)
    np.testing.assert_array_equal(kw["k"].view(np.uint8), k_rot.view(np.uint8))
    block_size = kw["k_cache"].shape[1 if kv_layout == "nhd" else 2]
    for t, slot in enumerate(before["slot_mapping"]):
        if slot < 0:
            continue
        blk, off = divmod(int(slot), block_size)
        entry_k = kw["k_cache"][blk, off] if kv_layout == "nhd" else kw["k_cache"][blk, :, off]
        entry_v = kw["v_cache"][blk, off] if kv_layout == "nhd" else kw["v_cache"][blk, :, off]
        want_k = k_rot[t] if kind == "auto" else fp8_quantize(k_rot[t], 0.5, kind)
        want_v = before["v"][t] if kind == "auto" else fp8_quantize(before["v"][t], 2.0, kind)
        np.testing.assert_array_equal(entry_k.view(np.uint8), want_k.view(np.uint8))
        np.testing.assert_array_equal(entry_v.view(np.uint8), want_v.view(np.uint8))
    np.testing.assert_array_equal(kw["v"], before["v"])


def test_rope_and_cache_numpy_outputs_offsets_and_untouched_inputs():
    kw = _cache_case(np.float16, seed=61)
    del kw["positions"]
    q0, k0 = kw["q"].copy(), kw["k"].copy()
    q_out, k_out = np.full_like(q0, np.nan), np.full_like(k0, np.nan)
    cu = np.array([0, 2, 6], np.int32)
    got = rope_and_cache(**kw, positions=None, cu_seqlens=cu, offset=np.array([3, 20], np.int64), q_out=q_out,
                         k_out=k_out, rotary_dim=48, backend="numpy")
    assert got[0] is q_out and got[1] is k_out
    np.testing.assert_array_equal(kw["q"], q0)  # given outputs: q and k untouched
    pos = np.array([3, 4, 20, 21, 22, 23])
    for out, x in ((q_out, q0), (k_out, k0)):
        np.testing.assert_array_equal(out, rope_kernel_arithmetic(x, kw["cos"], kw["sin"], pos, interleaved=False,
                                                                  rotary_dim=48))


def test_rope_and_cache_numpy_refuses_a_slot_twice_and_writes_nothing():
    kw = _cache_case(BF16, seed=62)
    kw["slot_mapping"][4] = kw["slot_mapping"][1]
    before = {n: a.copy() for n, a in kw.items()}
    with pytest.raises(ValueError, match=r"slot_mapping: entries 1 and 4 both name slot"):
        rope_and_cache(**kw, rotary_dim=48, backend="numpy")
    for n in ("q", "k", "k_cache", "v_cache"):
        np.testing.assert_array_equal(kw[n].view(np.uint16), before[n].view(np.uint16))


# ---------------------------------------------------------------------------------------------
# the switch, op by op: "auto" without a GPU, "nvrtc" without one, names, device arrays

def _host_calls():
    """Each public op's call on host arrays (fixed seeds): ``name -> fn(backend)``."""
    cos, sin = make_tables(16, 16)
    x = random_x((1, 4, 2, 16), np.float32, seed=70)
    _, _, mq, mk, mcos, msin, mpos, _ = _mrope_case("thd", np.float32, seed=71)
    nq, nk, nqw, nkw, ncos, nsin = _qk_norm_case(BF16, seed=72)
    cache = _cache_case(np.float32, seed=73)
    tx, tc, ts = tail_random_inputs(3, 2, 128, seed=74)
    onnx_x = random_x((1, 2, 4, 16), np.float32, seed=75)
    return {
        "apply_rope": lambda b: apply_rope(x, cos, sin, layout="bshd", backend=b),
        "apply_rope_qk": lambda b: apply_rope_qk(x, x[:, :, :1], cos, sin, layout="bshd", backend=b),
        "tail_rope": lambda b: tail_rope(tx, tc, ts, backend=b)["out"],
        "apply_mrope": lambda b: apply_mrope(mq, mcos, msin, mpos, SECTION, layout="thd", backend=b),
        "apply_mrope_qk": lambda b: apply_mrope_qk(mq, mk, mcos, msin, mpos, SECTION, layout="thd", backend=b),
        "apply_qk_norm_rope": lambda b: apply_qk_norm_rope(nq, nk, nqw, nkw, ncos, nsin, layout="bshd", backend=b),
        "rope_and_cache": lambda b: rope_and_cache(
            **{n: a.copy() for n, a in cache.items()}, interleaved=True, rotary_dim=48, backend=b),
        "rotary_embedding": lambda b: rotary_embedding(onnx_x, cos, sin, np.arange(4).reshape(1, 4), backend=b),
    }


OPS = sorted(_host_calls())


def _byte_views(result):
    return [np.asarray(r).view(np.uint8) for r in (result if isinstance(result, tuple) else (result,))]


@pytest.fixture
def no_gpu():
    from rope_rtc.core import driver

    if driver.available():
        pytest.skip("a GPU is present: backend='auto' uses it and 'nvrtc' runs")


@pytest.mark.parametrize("op", OPS)
def test_auto_without_a_gpu_is_numpy_with_one_warning_at_the_callers_line(op, no_gpu, monkeypatch):
    monkeypatch.setattr(backends, "_fallback_warned", False)
    call = _host_calls()[op]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = call("auto")
        again = call("auto")  # warned once only
    (w,) = [c for c in caught if "runs the NumPy reference" in str(c.message)]
    assert w.category is RuntimeWarning and w.filename == __file__, w.filename
    want = call("numpy")
    for a, b, c in zip(_byte_views(got), _byte_views(again), _byte_views(want)):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)


@pytest.mark.parametrize("op", OPS)
def test_the_default_is_auto(op, no_gpu, monkeypatch):
    import inspect

    from rope_rtc import onnx

    fn = {"rotary_embedding": onnx.rotary_embedding}.get(op) or getattr(__import__("rope_rtc"), op)
    assert inspect.signature(fn).parameters["backend"].default == "auto"


@pytest.mark.parametrize("op", OPS)
def test_nvrtc_without_a_gpu_raises_what_apply_rope_raises(op, no_gpu):
    with pytest.raises(NoDeviceError) as general:
        _host_calls()["apply_rope"]("nvrtc")
    assert "backend='numpy'" in str(general.value)
    with pytest.raises(NoDeviceError) as this:
        _host_calls()[op]("nvrtc")
    assert str(this.value) == str(general.value)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["cuda", "NUMPY", None])
def test_an_unknown_backend_is_named(op, backend):
    with pytest.raises(ValueError, match=r"backend: .* (is not one of|is not supported; use one of) 'auto', 'nvrtc', "
                                         r"'numpy'"):
        _host_calls()[op](backend)


def _device_calls():
    """Each op's call on fake device arrays: ``name -> fn(backend)`` (no launch is reached)."""
    cos, sin = fake_cupy((16, 8), np.float32), fake_cupy((16, 8), np.float32)
    x = fake_cupy((1, 4, 2, 16), np.float32)
    D = 64
    mcos, msin = fake_cupy((40, 32), np.float32), fake_cupy((40, 32), np.float32)
    mq, mk, mpos = fake_cupy((10, 4, D), np.float32), fake_cupy((10, 2, D), np.float32), fake_cupy((3, 10), np.int64)
    nq, nk = fake_cupy((2, 5, 4, D), BF16), fake_cupy((2, 5, 2, D), BF16)
    nw = fake_cupy((D,), BF16)
    cache = dict(q=fake_cupy((6, 4, D), np.float32), k=fake_cupy((6, 2, D), np.float32),
                 v=fake_cupy((6, 2, D), np.float32), cos=fake_cupy((32, 24), np.float32),
                 sin=fake_cupy((32, 24), np.float32), positions=fake_cupy((6,), np.int32),
                 slot_mapping=fake_cupy((6,), np.int64), k_cache=fake_cupy((3, 4, 2, D), np.float32),
                 v_cache=fake_cupy((3, 4, 2, D), np.float32))
    tx, tc = fake_cupy((3, 2, 128), BF16), fake_cupy((3, 32), np.float32)
    return {
        "apply_rope": lambda b, **h: apply_rope(x, h.get("cos", cos), sin, layout="bshd", backend=b),
        "apply_rope_qk": lambda b, **h: apply_rope_qk(x, x[:, :, :1], h.get("cos", cos), sin, layout="bshd",
                                                      backend=b),
        "tail_rope": lambda b, **h: tail_rope(tx, h.get("cos", tc), tc, backend=b),
        "apply_mrope": lambda b, **h: apply_mrope(mq, h.get("cos", mcos), msin, mpos, SECTION, layout="thd",
                                                  backend=b),
        "apply_mrope_qk": lambda b, **h: apply_mrope_qk(mq, mk, h.get("cos", mcos), msin, mpos, SECTION,
                                                        layout="thd", backend=b),
        "apply_qk_norm_rope": lambda b, **h: apply_qk_norm_rope(nq, nk, nw, nw, h.get("cos", mcos), msin,
                                                                layout="bshd", backend=b),
        "rope_and_cache": lambda b, **h: rope_and_cache(**dict(cache, cos=h.get("cos", cache["cos"])),
                                                        interleaved=True, rotary_dim=48, backend=b),
    }


@pytest.mark.parametrize("op", sorted(_device_calls()))
def test_numpy_refuses_device_arrays(op):
    with pytest.raises(TypeError, match="backend='numpy' takes host"):
        _device_calls()[op]("numpy")


@pytest.mark.parametrize("op", sorted(_device_calls()))
def test_a_host_array_on_the_gpu_path_names_the_numpy_backend(op):
    """Device arrays with one host table, on a (fake) GPU: refused before any launch, and the
    message names the other way (every array on the host, backend='numpy')."""
    host_cos = {"apply_rope": make_tables(16, 16)[0], "apply_rope_qk": make_tables(16, 16)[0],
                "tail_rope": np.zeros((3, 32), np.float32)}.get(op, make_tables(40, 64)[0])
    if op == "rope_and_cache":
        host_cos = make_tables(32, 48)[0]
    with FakeGPU() as gpu:
        for backend in ("auto", "nvrtc"):
            with pytest.raises(TypeError, match=r"(cos|cosine): a NumPy \(host\) array is not accepted here.*"
                                                r"backend='numpy'"):
                _device_calls()[op](backend, cos=host_cos)
        assert gpu.launches == []


# Invalid calls, each made on host arrays with backend="numpy" and on fake device arrays of the same
# shapes on a fake GPU: the same error, word for word.
_SAME_ERRORS = {
    "apply_mrope_qk": [
        dict(mrope_section=(8, 12, 11)), dict(mrope_section=(8, 24)),
        dict(rotary_dim=32, mrope_section=(4, 6, 6), cos=("zeros", (40, 16), np.float32),
             sin=("zeros", (40, 16), np.float32)),
        dict(positions=("zeros", (3, 9), np.int64)), dict(positions=("zeros", (3, 10), np.float32)),
        dict(cos=("zeros", (40, 30), np.float32)), dict(k=("zeros", (10, 2, 64), np.float16)),
        dict(q_out=("zeros", (10, 4, 64), np.float16)), dict(q=("zeros", (10, 0, 64), np.float32),
                                                             k=("zeros", (10, 0, 64), np.float32)),
        dict(interleaved_sections=1), dict(layout="bsdh"),
    ],
    "apply_qk_norm_rope": [
        dict(eps=-1.0), dict(numerics="torch"), dict(q_weight=("zeros", (32,), BF16)),
        dict(q_weight=("zeros", (64,), np.float32), k_weight=("zeros", (64,), np.float32), numerics="transformers"),
        dict(k_weight=("zeros", (64,), np.float32)), dict(offset=3.0), dict(positions=("zeros", (2, 4), np.int64)),
        dict(rotary_dim=20, rotary_offset=50, cos=("zeros", (24, 10), np.float32),
             sin=("zeros", (24, 10), np.float32)),
        dict(q=("zeros", (2, 5, 4, 96), BF16), k=("zeros", (2, 5, 2, 96), BF16), q_weight=("zeros", (96,), BF16),
             k_weight=("zeros", (96,), BF16), cos=("zeros", (24, 48), np.float32),
             sin=("zeros", (24, 48), np.float32)),
    ],
    "rope_and_cache": [
        dict(kv_layout="nchw"), dict(kv_cache_dtype="int8"), dict(k_cache=("zeros", (3, 4, 2, 64), np.float16)),
        dict(k_cache=("zeros", (3, 4, 3, 64), np.float32), v_cache=("zeros", (3, 4, 3, 64), np.float32)),
        dict(v=("zeros", (6, 2, 32), np.float32)), dict(k_scale=("zeros", (1,), np.float32)),
        dict(kv_cache_dtype="fp8_e4m3", k_cache=("zeros", (3, 4, 2, 64), np.uint8),
             v_cache=("zeros", (3, 4, 2, 64), np.uint8)),
        dict(slot_mapping=("zeros", (5,), np.int64)), dict(rotary_dim=47),
        dict(v_cache=("zeros", (3, 4, 2, 64), np.float32, "strided")),
    ],
}


def _same_error_args(op, change, kind):
    """The op's valid call (host arrays or fake device ones) with ``change`` made."""
    if op == "apply_mrope_qk":
        q, k = random_x((10, 4, 64), np.float32, 80), random_x((10, 2, 64), np.float32, 81)
        cos, sin = make_tables(40, 64)
        base = dict(q=q, k=k, cos=cos, sin=sin, positions=np.zeros((3, 10), np.int64), mrope_section=SECTION,
                    layout="thd")
    elif op == "apply_qk_norm_rope":
        q, k, qw, kw, cos, sin = _qk_norm_case(BF16, seed=82)
        base = dict(q=q, k=k, q_weight=qw, k_weight=kw, cos=cos, sin=sin, layout="bshd")
    else:
        base = dict(_cache_case(np.float32, seed=83, kv_layout="nhd"), rotary_dim=48)
    base.update(change)
    out = {}
    for name, value in base.items():
        if isinstance(value, tuple) and value and value[0] == "zeros":
            shape, dtype = value[1], value[2]
            value = np.zeros(shape, dtype)
            if len(change[name]) > 3:  # every other token slot of a cache twice as long: strides differ
                value = np.zeros((shape[0], 2 * shape[1]) + shape[2:], dtype)[:, ::2]
        if kind == "device" and isinstance(value, np.ndarray):
            value = fake_cupy(value.shape, value.dtype, strides=value.strides)
        out[name] = value
    return out


@pytest.mark.parametrize("op,change", [(op, c) for op, cases in _SAME_ERRORS.items() for c in cases],
                         ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)))
def test_an_invalid_call_raises_the_same_error_on_both_backends(op, change):
    fn = {"apply_mrope_qk": apply_mrope_qk, "apply_qk_norm_rope": apply_qk_norm_rope,
          "rope_and_cache": rope_and_cache}[op]
    fn(**_same_error_args(op, {}, "host"), backend="numpy")  # the call unchanged is valid
    host = _same_error_args(op, change, "host")
    with pytest.raises((TypeError, ValueError, NotImplementedError)) as on_numpy:
        fn(**host, backend="numpy")
    with FakeGPU() as gpu:
        with pytest.raises((TypeError, ValueError, NotImplementedError)) as on_gpu:
            fn(**_same_error_args(op, change, "device"), backend="nvrtc")
        assert gpu.launches == []
    assert (type(on_numpy.value), str(on_numpy.value)) == (type(on_gpu.value), str(on_gpu.value))


def test_the_onnx_operators_fallback_warning_names_the_callers_line(no_gpu, monkeypatch):
    """The operator runs on apply_rope, a frame further from the caller than apply_rope's own
    callers: the one-time warning names the caller's line, not the operator's in rope_rtc/ops/onnx.py."""
    monkeypatch.setattr(backends, "_fallback_warned", False)
    monkeypatch.setattr(R, "_gpu_present", False)
    cos, sin = make_tables(16, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rotary_embedding(random_x((1, 2, 4, 16), np.float32, seed=76), cos, sin, np.arange(4).reshape(1, 4))
    (w,) = [c for c in caught if "NumPy reference" in str(c.message)]
    assert w.filename == __file__, w.filename


@pytest.mark.parametrize("convention", ["cos_sin_cache", "inv_freq", "head_dim"])
def test_the_fallback_warning_names_the_callers_line_in_the_engines_conventions(convention, no_gpu, monkeypatch):
    """apply_rope's calls with a combined cache, inverse frequencies or flat [T, H * D] arrays pass
    through more of its functions than its table calls: the warning names the caller's line."""
    from rope_rtc import inverse_frequencies

    monkeypatch.setattr(backends, "_fallback_warned", False)
    monkeypatch.setattr(R, "_gpu_present", False)
    cos, sin = make_tables(16, 16)
    x = random_x((4, 2, 16), np.float32, seed=77)
    kw = {"cos_sin_cache": dict(cos_sin_cache=np.concatenate([cos, sin], axis=1)),
          "inv_freq": dict(inv_freq=inverse_frequencies(16)[0]),
          "head_dim": dict(cos=cos, sin=sin, head_dim=16)}[convention]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_rope(x.reshape(4, 32) if convention == "head_dim" else x, layout="thd", **kw)
    (w,) = [c for c in caught if "NumPy reference" in str(c.message)]
    assert w.filename == __file__, w.filename
