"""Tests of rope_rtc.reference against independent, exact oracles.

The FMA and rounding oracles below use ``fractions.Fraction``: every float is an exact rational,
products and sums are exact, and rounding picks the nearer of the two neighbouring
representable values by exact distance (ties to even). They share no code with the module
under test.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from rope_rtc.reference import (
    TAIL_CHANNELS,
    assert_rope_close,
    bf16_rne,
    fma_f32,
    rope_error_bound,
    rope_reference,
    round_to_dtype,
    tail_rope_reference,
)
from tail_cases import REASSOCIATED_FORMS, reassociated_tail_rope, tail_edge_inputs, tail_random_inputs

BF16 = np.dtype(ml_dtypes.bfloat16)

# ---- exact oracle ---------------------------------------------------------------------------

# (precision incl. implicit bit, minimum normal exponent, maximum exponent)
F32 = (24, -126, 127)
FBF16 = (8, -126, 127)
F16 = (11, -14, 15)


def round_exact(v: Fraction, fmt, negative_zero: bool = False) -> float:
    """Round an exact rational to the binary format ``fmt``, to nearest, ties to even.

    Returns a Python float holding the representable value exactly (or ±inf on overflow, ±0
    on underflow, keeping the sign of ``v``; ``negative_zero`` gives the sign of an exact 0).
    """
    p, emin, emax = fmt
    if v == 0:
        return -0.0 if negative_zero else 0.0
    neg = v < 0
    mag = -v if neg else v
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    if mag < Fraction(2) ** e:
        e -= 1  # now 2^e <= mag < 2^(e+1)
    quantum = Fraction(2) ** (max(e, emin) - p + 1)
    n = math.floor(mag / quantum)
    lo, hi = n * quantum, (n + 1) * quantum
    d_lo, d_hi = mag - lo, hi - mag
    if d_lo < d_hi or (d_lo == d_hi and n % 2 == 0):
        pick = lo
    else:
        pick = hi
    result = math.inf if pick >= Fraction(2) ** (emax + 1) else float(pick)
    return -result if neg else result


def _neg(v: float) -> bool:
    return math.copysign(1.0, v) < 0


def oracle_mul_f32(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.nan
    if math.isinf(a) or math.isinf(b):
        if a == 0 or b == 0:
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return round_exact(Fraction(a) * Fraction(b), F32, _neg(a) != _neg(b))


def oracle_fma_f32(a: float, b: float, c: float) -> float:
    """IEEE 754 fusedMultiplyAdd in binary32, round to nearest even."""
    if math.isnan(a) or math.isnan(b) or math.isnan(c):
        return math.nan
    prod_neg = _neg(a) != _neg(b)
    if math.isinf(a) or math.isinf(b):
        if a == 0 or b == 0:
            return math.nan  # inf * 0
        if math.isinf(c) and _neg(c) != prod_neg:
            return math.nan  # inf - inf
        return -math.inf if prod_neg else math.inf
    if math.isinf(c):
        return c
    prod = Fraction(a) * Fraction(b)
    exact = prod + Fraction(c)
    # An exact zero sum is -0 only when both terms are -0 (round to nearest).
    negative_zero = prod == 0 and c == 0 and prod_neg and _neg(c)
    return round_exact(exact, F32, negative_zero)


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def oracle_bf16_bits(v: float) -> int:
    """BF16 bits of a float32 value v, rounded to nearest even; NaN -> canonical 0x7FFF."""
    if math.isnan(v):
        return 0x7FFF
    if math.isinf(v):
        r = v
    else:
        r = round_exact(Fraction(v), FBF16, _neg(v))
    bits = f32_bits(r)
    assert bits & 0xFFFF == 0
    return bits >> 16


def oracle_tail(x: np.ndarray, cosine: np.ndarray, sine: np.ndarray, *, conjugate: bool = False) -> np.ndarray:
    """The tail contract, one pair at a time with exact arithmetic. ``conjugate`` computes the
    opposite rotation written out: real = fma(a, c, +fp32(b*s)), imag = fma(b, c, -fp32(a*s))."""
    x3 = x.reshape(x.shape[0], -1, x.shape[-1])
    out = x3.view(np.uint16).copy()
    start = x.shape[-1] - TAIL_CHANNELS
    xf = x3.astype(np.float32)
    for t in range(x3.shape[0]):
        for j in range(TAIL_CHANNELS // 2):
            c, s = float(cosine[t, j]), float(sine[t, j])
            for h in range(x3.shape[1]):
                a, b = float(xf[t, h, start + 2 * j]), float(xf[t, h, start + 2 * j + 1])
                bs, as_ = oracle_mul_f32(b, s), oracle_mul_f32(a, s)
                if conjugate:
                    real = oracle_fma_f32(a, c, bs)
                    imag = oracle_fma_f32(b, c, -as_)
                else:
                    real = oracle_fma_f32(a, c, -bs)
                    imag = oracle_fma_f32(b, c, as_)
                out[t, h, start + 2 * j] = oracle_bf16_bits(real)
                out[t, h, start + 2 * j + 1] = oracle_bf16_bits(imag)
    return out.reshape(x.shape)


def assert_same_f32(actual: np.ndarray, expected: list[float], context) -> None:
    actual = np.asarray(actual, np.float32).ravel()
    for i, e in enumerate(expected):
        got = float(actual[i])
        if math.isnan(e):
            assert math.isnan(got), (i, context(i), got, e)
        else:
            assert f32_bits(got) == f32_bits(e), (i, context(i), got, e)


# ---- fma_f32 --------------------------------------------------------------------------------


def _random_bits_f32(rng, n) -> np.ndarray:
    return rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def _halfway_traps(rng, n):
    """Triples whose exact a*b + c lies a hair above or below the halfway point between two
    float32 neighbours of c, closer to it than float64 can resolve: float64(a*b + c) lands on
    the halfway point itself, and the float32 cast then breaks the tie the wrong way half the
    time. a*b = (1 + (k+1) 2^-23)(1 - k 2^-23) * 2^q = (1 + (2^23 - k(k+1)) 2^-46) 2^q."""
    ks = np.array([k for k in range(2800, 3000) if 0 < abs((1 << 23) - k * (k + 1)) < (1 << 17)])
    k = rng.choice(ks, n)
    ec = rng.integers(-90, 90, n)
    c = np.ldexp(1.0 + rng.integers(0, 1 << 23, n) * 2.0**-23, ec) * rng.choice([-1.0, 1.0], n)
    # Product of magnitude half an ulp of c (ulp = 2^(ec-23)), either sign; split 2^q between a, b.
    q = ec - 24
    qa = rng.integers(-20, 21, n)
    a = np.ldexp(1.0 + (k + 1) * 2.0**-23, qa) * rng.choice([-1.0, 1.0], n)
    b = np.ldexp(1.0 - k * 2.0**-23, q - qa)
    swap = rng.random(n) < 0.5
    a, b = np.where(swap, b, a), np.where(swap, a, b)
    # Exact ties too: a*b exactly half an ulp of c.
    exact_tie = rng.random(n) < 0.2
    a = np.where(exact_tie, np.ldexp(1.0, qa) * np.sign(a), a)
    b = np.where(exact_tie, np.ldexp(1.0, q - qa), b)
    return a.astype(np.float32), b.astype(np.float32), c.astype(np.float32)


def _fma_cases() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(20240601)
    cases = {}
    n = 1500
    cases["random bits"] = tuple(_random_bits_f32(rng, n) for _ in range(3))
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    # Near-cancellation: c is -a*b rounded to float32, nudged by a few ulps.
    c = np.nextafter(-(a * b), np.float32(np.inf) * rng.choice(np.float32([-1, 1]), n))
    cases["cancellation"] = (a, b, c.astype(np.float32))
    cases["halfway traps"] = _halfway_traps(rng, n)

    def scaled(lo, hi):
        return np.ldexp(rng.uniform(-2, 2, n), rng.integers(lo, hi, n)).astype(np.float32)

    # Products of magnitude 2^-200..2^-120 added to FP32 subnormals (sign and mantissa random).
    subnormal = (_random_bits_f32(rng, n).view(np.uint32) & np.uint32(0x807FFFFF)).view(np.float32)
    cases["subnormal range"] = (scaled(-100, -60), scaled(-100, -60), subnormal)
    cases["overflow range"] = (scaled(60, 128), scaled(60, 128), scaled(60, 128))
    special = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 2.0**-149, -(2.0**-149),
                          3.4028235e38, -3.4028235e38, 2.0**-126, 1.5])
    grid = np.array(np.meshgrid(special, special, special, indexing="ij")).reshape(3, -1)
    cases["special values"] = (grid[0], grid[1], grid[2])
    return cases


FMA_CASES = _fma_cases()


@pytest.mark.parametrize("name", list(FMA_CASES))
def test_fma_f32_matches_exact_oracle(name):
    a, b, c = FMA_CASES[name]
    got = fma_f32(a, b, c)
    assert got.dtype == np.float32 and got.shape == a.shape
    expected = [oracle_fma_f32(float(x), float(y), float(z)) for x, y, z in zip(a, b, c)]
    assert_same_f32(got, expected, lambda i: (a[i], b[i], c[i]))


def test_double_rounding_traps_are_real_and_handled():
    a, b, c = FMA_CASES["halfway traps"]
    with np.errstate(over="ignore"):
        naive = (a.astype(np.float64) * b + c).astype(np.float32)
    expected = np.float32([oracle_fma_f32(float(x), float(y), float(z)) for x, y, z in zip(a, b, c)])
    wrong = naive.view(np.uint32) != expected.view(np.uint32)
    assert wrong.sum() >= 100, "the trap generator should defeat float64-then-float32 often"
    np.testing.assert_array_equal(fma_f32(a[wrong], b[wrong], c[wrong]).view(np.uint32), expected[wrong].view(np.uint32))


def test_double_rounding_worked_example():
    # a*b = 2^-24 + 4688 * 2^-70: exactly a hair above half an ulp of 1.0. float64 rounds
    # 1 + a*b to 1 + 2^-24, the float32 tie, which goes to the even 1.0; the exact sum is
    # above the tie and rounds up.
    a = np.float32(1 + 2896 * 2.0**-23)
    b = np.float32((1 - 2895 * 2.0**-23) * 2.0**-24)
    c = np.float32(1.0)
    naive = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    assert naive == np.float32(1.0)
    assert fma_f32(a, b, c) == np.float32(1 + 2.0**-23)
    assert oracle_fma_f32(float(a), float(b), float(c)) == 1 + 2.0**-23


@pytest.mark.parametrize(
    "a, b, c, expected_bits",
    [
        (0.0, 1.0, -0.0, 0x00000000),  # +0 + -0 -> +0
        (-0.0, 1.0, -0.0, 0x80000000),  # -0 + -0 -> -0
        (-0.0, 1.0, 0.0, 0x00000000),
        (1.0, 1.0, -1.0, 0x00000000),  # exact cancellation -> +0
        (2.0**-100, -(2.0**-100), 0.0, 0x80000000),  # underflow keeps the product's sign
        (2.0**-100, -(2.0**-100), -0.0, 0x80000000),
        (2.0**-75, 2.0**-75, 0.0, 0x00000000),  # 2^-150: half the least subnormal, tie to even 0
        (2.0**-75, 2.0**-75 * (1 + 2.0**-23), 0.0, 0x00000001),  # a hair above the tie
        (2.0**-75, 2.0**-75, 2.0**-149, 0x00000002),  # 1.5 * 2^-149: tie to even 2 * 2^-149
        (np.inf, 0.0, 1.0, 0x7FFFFFFF),  # inf * 0 -> canonical NaN
        (np.inf, 1.0, -np.inf, 0x7FFFFFFF),  # inf - inf -> NaN
        (np.inf, -1.0, -np.inf, 0xFF800000),
        (1.0, 1.0, np.inf, 0x7F800000),
        (3.4028235e38, 2.0, -3.4028235e38, 0x7F7FFFFF),  # no intermediate overflow
        (3.4028235e38, 1.0, 3.4028235e38, 0x7F800000),
    ],
)
def test_fma_f32_ieee_special_cases(a, b, c, expected_bits):
    got = fma_f32(np.float32(a), np.float32(b), np.float32(c))
    oracle = oracle_fma_f32(float(np.float32(a)), float(np.float32(b)), float(np.float32(c)))
    if math.isnan(oracle):
        assert int(got.view(np.uint32)) == 0x7FFFFFFF
    else:
        assert int(got.view(np.uint32)) == f32_bits(oracle)
    assert int(got.view(np.uint32)) == expected_bits


def test_fma_f32_refuses_other_dtypes_and_broadcasts():
    with pytest.raises(TypeError, match="float32"):
        fma_f32(np.float64(1.0), np.float32(1.0), np.float32(1.0))
    out = fma_f32(np.ones((3, 1), np.float32), np.ones((1, 4), np.float32), np.float32(2.0))
    assert out.shape == (3, 4) and out.dtype == np.float32 and np.all(out == 3.0)


# ---- rounding helpers -----------------------------------------------------------------------


def test_bf16_rne_agrees_with_ml_dtypes_and_canonicalises_nan():
    rng = np.random.default_rng(7)
    bits = np.concatenate([
        rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32),
        np.arange(0, 1 << 17, dtype=np.uint32),  # subnormals and their rounding boundaries
        np.uint32([0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0xFF7F8000, 0x3F808000, 0x3F818000]),
    ])
    f = bits.view(np.float32)
    mine = bf16_rne(f)
    assert mine.dtype == BF16
    nan = np.isnan(f)
    with np.errstate(invalid="ignore"):
        theirs = f.astype(BF16)
    np.testing.assert_array_equal(mine.view(np.uint16)[~nan], theirs.view(np.uint16)[~nan])
    assert np.all(mine.view(np.uint16)[nan] == 0x7FFF)
    # Spot checks against the exact oracle, including ties.
    for v in bits[:: 1 << 12].view(np.float32)[:400]:
        assert int(bf16_rne(np.float32(v)).view(np.uint16)) == oracle_bf16_bits(float(v)), v


@pytest.mark.parametrize("dtype, fmt", [(np.float16, F16), (BF16, FBF16), (np.float32, F32)])
def test_round_to_dtype_rounds_once(dtype, fmt):
    rng = np.random.default_rng(11)
    base = np.ldexp(rng.uniform(1, 2, 600), rng.integers(-30, 16, 600)) * rng.choice([-1.0, 1.0], 600)
    p = fmt[0]
    # Just above and below halfway points of the target format: float32 rounding first would
    # land on the halfway point and break the tie by parity instead of by the exact value.
    e = np.floor(np.log2(np.abs(base)))
    grid = np.ldexp(np.floor(np.ldexp(np.abs(base), -(e - p + 1).astype(int))), (e - p + 1).astype(int))
    half = grid + np.ldexp(1.0, (e - p).astype(int))
    nudged = half * (1 + rng.choice([-1.0, 1.0], 600) * 2.0**-40)
    values = np.concatenate([base, np.copysign(nudged, base), [0.0, -0.0, 1e-30, 7e4, -7e4]])
    got = round_to_dtype(values, dtype)
    assert got.dtype == np.dtype(dtype)
    got64 = got.astype(np.float64)
    for i, v in enumerate(values):
        expected = round_exact(Fraction(float(v)), fmt, _neg(float(v)))
        assert got64[i] == expected and _neg(got64[i]) == _neg(expected), (v, got64[i], expected)


def test_round_to_dtype_avoids_the_float32_double_rounding():
    v = np.float64(1 + 2.0**-8 + 2.0**-40)  # just above the BF16 tie between 1 and 1 + 2^-7
    via_f32 = v.astype(np.float32).astype(BF16)
    assert float(via_f32) == 1.0
    assert float(round_to_dtype(np.array([v]), BF16)[0]) == 1 + 2.0**-7


# ---- tail RoPE ------------------------------------------------------------------------------

EDGE_SHAPES = [(40, 3, 128), (20, None, 512)]


@pytest.fixture(scope="module", params=EDGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def edge(request):
    x, c, s = tail_edge_inputs(*request.param, seed=1234)
    return x, c, s, oracle_tail(x, c, s)


def test_tail_matches_scalar_oracle_bit_for_bit(edge):
    x, c, s, expected = edge
    got = tail_rope_reference(x, c, s)
    assert got.dtype == BF16 and got.shape == x.shape and got.flags.c_contiguous
    mismatch = np.argwhere(got.view(np.uint16) != expected)
    assert mismatch.size == 0, f"{len(mismatch)} mismatches, first at {mismatch[:3].tolist()}"


def test_tail_matches_oracle_on_random_inputs():
    x, c, s = tail_random_inputs(16, 2, 128, seed=5)
    np.testing.assert_array_equal(tail_rope_reference(x, c, s).view(np.uint16), oracle_tail(x, c, s))


def _tail_pairs(x, c, s):
    x3 = x.reshape(x.shape[0], -1, x.shape[-1])
    tail = x3[..., -TAIL_CHANNELS:].astype(np.float32)
    a, b = tail[..., 0::2], tail[..., 1::2]
    cc = np.broadcast_to(c[:, None, :], a.shape)
    ss = np.broadcast_to(s[:, None, :], a.shape)
    return a, b, cc, ss


def test_edge_inputs_contain_every_planted_kind(edge):
    x, c, s, expected = edge
    a, b, cc, ss = _tail_pairs(x, c, s)
    vals = np.concatenate([a.ravel(), b.ravel()])
    bits = vals.view(np.uint32)
    assert np.any(bits == 0) and np.any(bits == 0x80000000), "signed zeros in x"
    for table in (c, s):
        tb = table.view(np.uint32)
        assert np.any(tb == 0) and np.any(tb == 0x80000000), "signed zeros in the tables"
    assert np.all(np.isfinite(c)) and np.all(np.isfinite(s)) and np.all(np.isfinite(vals))
    assert np.any((vals != 0) & (np.abs(vals) < 2.0**-126)), "BF16 subnormals in x"
    assert np.any(np.abs(vals) >= 2.0**120), "large values in x"
    with np.errstate(over="ignore", under="ignore"):
        prod = np.abs(np.concatenate([(a * cc).ravel(), (b * ss).ravel()]).astype(np.float64))
    assert np.any((prod > 0) & (prod < 2.0**-126)), "products in the FP32 subnormal range"
    out = expected.reshape(x.shape[0], -1, x.shape[-1])[..., -TAIL_CHANNELS:].ravel().view(BF16).astype(np.float32)
    assert np.any(np.isinf(out)), "overflow to infinity is part of the contract"
    assert np.any((out != 0) & (np.abs(out) < 2.0**-126)), "subnormal results"
    zero_bits = out.view(np.uint32)
    assert np.any(zero_bits == 0) and np.any(zero_bits == 0x80000000), "signed zero results"


@pytest.mark.parametrize("form", REASSOCIATED_FORMS)
def test_reassociated_kernels_would_be_caught(edge, form):
    """The edge inputs tell the contract apart from each reassociated expression: a kernel
    computing one of those would fail the bit-exact comparison."""
    x, c, s, expected = edge
    wrong = reassociated_tail_rope(x, c, s, form).view(np.uint16) != expected
    assert wrong.sum() >= 5, f"only {wrong.sum()} elements distinguish {form!r} from the contract"
    # The random inputs alone would rarely have shown it.
    xr, cr, sr = tail_random_inputs(*EDGE_SHAPES[0], seed=1234)
    rand_wrong = reassociated_tail_rope(xr, cr, sr, form).view(np.uint16) != tail_rope_reference(xr, cr, sr).view(np.uint16)
    assert wrong.sum() > 5 * rand_wrong.sum()


def test_negated_sine_is_the_opposite_rotation():
    x, c, s = tail_edge_inputs(12, 2, 128, seed=99)
    neg = tail_rope_reference(x, c, -s)
    np.testing.assert_array_equal(neg.view(np.uint16), oracle_tail(x, c, s, conjugate=True))
    # And it undoes a forward rotation up to BF16 rounding, on a genuine cos/sin table.
    x, c, s = tail_random_inputs(64, 4, 128, seed=3)
    back = tail_rope_reference(tail_rope_reference(x, c, s), c, -s).astype(np.float32)
    np.testing.assert_allclose(back, x.astype(np.float32), rtol=2.0**-6, atol=2.0**-6)
    assert not np.array_equal(tail_rope_reference(x, c, s).view(np.uint16), x.view(np.uint16))


def test_tail_prefix_is_copied_bit_for_bit_and_inputs_are_untouched():
    x, c, s = tail_edge_inputs(8, 2, 512, seed=4)
    prefix_bits = x.view(np.uint16)[..., : 512 - TAIL_CHANNELS]
    prefix_bits[0, 0, :4] = [0x7FC1, 0xFF81, 0x8000, 0x0001]  # NaN payloads, -0, a subnormal
    x_before, c_before, s_before = x.copy(), c.copy(), s.copy()
    out = tail_rope_reference(x, c, s)
    np.testing.assert_array_equal(out.view(np.uint16)[..., :-TAIL_CHANNELS], x.view(np.uint16)[..., :-TAIL_CHANNELS])
    assert not np.shares_memory(out, x)
    np.testing.assert_array_equal(x.view(np.uint16), x_before.view(np.uint16))
    np.testing.assert_array_equal(c.view(np.uint32), c_before.view(np.uint32))
    np.testing.assert_array_equal(s.view(np.uint32), s_before.view(np.uint32))


def test_tail_rank2_equals_one_head_and_empty_tokens_work():
    x, c, s = tail_random_inputs(9, None, 128, seed=8)
    np.testing.assert_array_equal(
        tail_rope_reference(x, c, s).view(np.uint16),
        tail_rope_reference(x[:, None, :], c, s)[:, 0, :].view(np.uint16),
    )
    empty = tail_rope_reference(np.zeros((0, 4, 512), BF16), np.zeros((0, 32), np.float32), np.zeros((0, 32), np.float32))
    assert empty.shape == (0, 4, 512)


def test_tail_nan_results_are_canonical():
    x = np.zeros((1, 128), BF16)
    x.view(np.uint16)[0, 64] = 0xFF80  # -inf times a zero cosine: NaN
    c = np.zeros((1, 32), np.float32)
    s = np.zeros((1, 32), np.float32)
    out = tail_rope_reference(x, c, s).view(np.uint16)
    assert out[0, 64] == 0x7FFF


def test_tail_edge_inputs_are_deterministic():
    one = tail_edge_inputs(16, 2, 128, seed=10)
    two = tail_edge_inputs(16, 2, 128, seed=10)
    other = tail_edge_inputs(16, 2, 128, seed=11)
    for u, v in zip(one, two):
        assert u.tobytes() == v.tobytes()
    assert one[0].tobytes() != other[0].tobytes()


@pytest.mark.parametrize(
    "x, c, s, error, match",
    [
        (np.zeros((2, 128), np.float32), None, None, TypeError, "bfloat16"),
        (np.zeros((2, 128), BF16), np.zeros((2, 32)), None, TypeError, "cosine must be float32"),
        (np.zeros((128,), BF16), None, None, ValueError, r"\[T, D\] or \[T, H, D\]"),
        (np.zeros((2, 1, 1, 128), BF16), None, None, ValueError, r"\[T, D\] or \[T, H, D\]"),
        (np.zeros((2, 256), BF16), None, None, ValueError, "D must be one of"),
        (np.zeros((2, 0, 128), BF16), None, None, ValueError, "H must be positive"),
        (np.zeros((2, 128), BF16), np.zeros((2, 31), np.float32), None, ValueError, "cosine must have shape"),
        (np.zeros((2, 128), BF16), None, np.zeros((3, 32), np.float32), ValueError, "sine must have shape"),
    ],
)
def test_tail_validation(x, c, s, error, match):
    c = np.zeros((x.shape[0], 32), np.float32) if c is None else c
    s = np.zeros((x.shape[0], 32), np.float32) if s is None else s
    with pytest.raises(error, match=match):
        tail_rope_reference(x, c, s)


# ---- general RoPE ---------------------------------------------------------------------------


def _tables(num_rows: int, rotary_dim: int, base: float = 10000.0):
    inv_freq = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angle = np.arange(num_rows, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def test_blog_worked_example():
    cos, sin = _tables(3, 4, base=100.0)  # angles at m=2: 2.0 and 0.2
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]], np.float32)
    out = rope_reference(x, cos, sin, np.array([2]), interleaved=True)
    np.testing.assert_allclose(out[0, 0], [-2.23474, 0.07700, 2.14552, 4.51627], atol=1e-5)
    assert out.dtype == np.float64


def _rotate_half(v):
    half = v.shape[-1] // 2
    return np.concatenate([-v[..., half:], v[..., :half]], axis=-1)


def test_half_split_equals_hugging_face_rotate_half():
    rng = np.random.default_rng(21)
    n, h, d = 7, 3, 16
    cos, sin = _tables(50, d)
    x = rng.standard_normal((n, h, d)).astype(np.float32)
    pos = rng.integers(0, 50, n)
    cos_full = np.concatenate([cos, cos], axis=-1)[pos][:, None, :].astype(np.float64)
    sin_full = np.concatenate([sin, sin], axis=-1)[pos][:, None, :].astype(np.float64)
    x64 = x.astype(np.float64)
    hf = x64 * cos_full + _rotate_half(x64) * sin_full
    np.testing.assert_allclose(rope_reference(x, cos, sin, pos, interleaved=False), hf, rtol=0, atol=1e-12)


def test_interleaved_is_half_split_on_even_odd_permuted_channels():
    rng = np.random.default_rng(22)
    n, h, d = 5, 2, 8
    cos, sin = _tables(20, d)
    x = rng.standard_normal((n, h, d)).astype(np.float16)
    pos = rng.integers(0, 20, n)
    perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    inter = rope_reference(x, cos, sin, pos, interleaved=True)
    split = rope_reference(x[..., perm], cos, sin, pos, interleaved=False)
    np.testing.assert_array_equal(inter[..., perm], split)
    # GPT-J's rotate_every_two, written out.
    x64 = x.astype(np.float64)
    c = np.repeat(cos[pos], 2, axis=-1)[:, None, :].astype(np.float64)
    s = np.repeat(sin[pos], 2, axis=-1)[:, None, :].astype(np.float64)
    every_two = np.stack([-x64[..., 1::2], x64[..., 0::2]], axis=-1).reshape(x64.shape)
    np.testing.assert_allclose(inter, x64 * c + every_two * s, rtol=0, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_dim_with_offset(interleaved):
    rng = np.random.default_rng(23)
    n, h, d, r, ro = 6, 2, 24, 8, 10
    cos, sin = _tables(30, r)
    x = rng.standard_normal((n, h, d)).astype(BF16)
    pos = rng.integers(0, 30, n)
    out = rope_reference(x, cos, sin, pos, interleaved=interleaved, rotary_dim=r, rotary_offset=ro)
    x64 = x.astype(np.float64)
    np.testing.assert_array_equal(out[..., :ro], x64[..., :ro])
    np.testing.assert_array_equal(out[..., ro + r :], x64[..., ro + r :])
    inner = rope_reference(x[..., ro : ro + r], cos, sin, pos, interleaved=interleaved)
    np.testing.assert_array_equal(out[..., ro : ro + r], inner)
    assert not np.allclose(out[..., ro : ro + r], x64[..., ro : ro + r])


@pytest.mark.parametrize("interleaved", [False, True])
def test_inverse_undoes_forward(interleaved):
    rng = np.random.default_rng(24)
    n, h, d = 9, 4, 32
    cos, sin = _tables(100, d)
    x = rng.standard_normal((n, h, d))
    pos = rng.integers(0, 100, n)
    fwd = rope_reference(x, cos, sin, pos, interleaved=interleaved)
    back = rope_reference(fwd, cos, sin, pos, interleaved=interleaved, inverse=True)
    # Rotating by (c, s) then (c, -s) scales each pair by c^2 + s^2, which for float32-rounded
    # cos/sin is 1 only to ~1e-7; divide that out and the round trip is exact to float64 noise.
    norm = (cos.astype(np.float64) ** 2 + sin.astype(np.float64) ** 2)[pos]
    norm = (np.repeat(norm, 2, axis=-1) if interleaved else np.concatenate([norm, norm], axis=-1))[:, None, :]
    np.testing.assert_allclose(back / norm, x, rtol=0, atol=1e-12)
    assert np.abs(back - x).max() < 1e-6


def test_out_of_range_positions_give_nan_in_rotated_channels_only():
    rng = np.random.default_rng(25)
    cos, sin = _tables(10, 8)
    x = rng.standard_normal((5, 2, 12)).astype(np.float32)
    pos = np.array([-1, 10, 3, 1000, 9])
    out = rope_reference(x, cos, sin, pos, interleaved=False, rotary_dim=8, rotary_offset=2)
    bad = np.array([True, True, False, True, False])
    assert np.all(np.isnan(out[bad][..., 2:10]))
    assert np.all(np.isfinite(out[~bad]))
    np.testing.assert_array_equal(out[..., :2], x[..., :2].astype(np.float64))
    np.testing.assert_array_equal(out[..., 10:], x[..., 10:].astype(np.float64))
    empty = rope_reference(x, cos[:0], sin[:0], pos, interleaved=True, rotary_dim=8)
    assert np.all(np.isnan(empty[..., :8])) and np.all(np.isfinite(empty[..., 8:]))


def test_rope_reference_validation():
    cos, sin = _tables(4, 8)
    x = np.zeros((2, 1, 8), np.float32)
    with pytest.raises(TypeError, match="float32"):
        rope_reference(x, cos.astype(np.float64), sin, np.zeros(2, int), interleaved=True)
    with pytest.raises(TypeError, match="integer"):
        rope_reference(x, cos, sin, np.zeros(2), interleaved=True)
    with pytest.raises(ValueError, match="inside the head dim"):
        rope_reference(x, cos, sin, np.zeros(2, int), interleaved=True, rotary_offset=2)
    with pytest.raises(ValueError, match=r"\[P, 2\]"):
        rope_reference(x, cos, sin, np.zeros(2, int), interleaved=True, rotary_dim=4)
    with pytest.raises(ValueError, match=r"\[N, H, D\]"):
        rope_reference(x[0], cos, sin, np.zeros(2, int), interleaved=True)


# ---- assert_rope_close ----------------------------------------------------------------------


def _gpu_like(x, cos, sin, pos, *, interleaved, rotary_dim, rotary_offset, dtype):
    """What the kernel computes: FP32 products and sum, then one RNE rounding to ``dtype``."""
    xf = x.astype(np.float32)
    out = xf.copy()
    r, ro = rotary_dim, rotary_offset
    rot = xf[..., ro : ro + r]
    if interleaved:
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
    else:
        x0, x1 = rot[..., : r // 2], rot[..., r // 2 :]
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    o0 = x0 * c - x1 * s
    o1 = x1 * c + x0 * s
    if interleaved:
        out[..., ro : ro + r : 2], out[..., ro + 1 : ro + r : 2] = o0, o1
    else:
        out[..., ro : ro + r // 2], out[..., ro + r // 2 : ro + r] = o0, o1
    res = bf16_rne(out) if np.dtype(dtype) == BF16 else out.astype(dtype)
    res[..., :ro] = x[..., :ro]
    res[..., ro + r :] = x[..., ro + r :]
    return res


CLOSE_DTYPES = [np.float32, np.float16, BF16]


@pytest.fixture(params=[(d, il) for d in CLOSE_DTYPES for il in (False, True)],
                ids=lambda p: f"{np.dtype(p[0]).name}-{'inter' if p[1] else 'split'}")
def close_case(request):
    dtype, interleaved = request.param
    rng = np.random.default_rng(31)
    n, h, d, r, ro = 64, 4, 40, 32, 4
    cos, sin = _tables(4096, r)
    x = (rng.standard_normal((n, h, d)) * 4).astype(dtype)
    pos = rng.integers(0, 4096, n)
    kw = dict(interleaved=interleaved, rotary_dim=r, rotary_offset=ro)
    expected = rope_reference(x, cos, sin, pos, **kw)
    actual = _gpu_like(x, cos, sin, pos, dtype=dtype, **kw)
    return x, expected, actual, kw, np.dtype(dtype)


def test_assert_rope_close_accepts_correct_results(close_case):
    x, expected, actual, kw, dtype = close_case
    assert_rope_close(actual, expected, x, dtype=dtype, **kw)
    assert_rope_close(round_to_dtype(expected, dtype), expected, x, dtype=dtype, **kw)


def _toward_zero(v: np.ndarray, steps: int) -> np.ndarray:
    v = v.copy()
    for _ in range(steps):
        v = np.nextafter(v, np.zeros((), v.dtype)) if v.dtype != BF16 else _bf16_toward_zero(v)
    return v


def _bf16_toward_zero(v):
    bits = v.view(np.uint16).copy()
    nonzero = (bits & 0x7FFF) != 0
    bits[nonzero] -= 1
    return bits.view(BF16)


def test_assert_rope_close_rejects_wrong_results(close_case):
    x, expected, actual, kw, dtype = close_case
    ro, r = kw["rotary_offset"], kw["rotary_dim"]
    if dtype == np.float32:
        # The FP32 bound 2^-22 (|x0| + |x1|) is at least two ulps of any result, so perturb by
        # twice the bound instead.
        x64 = x.astype(np.float64)
        bound = 2.0**-21 * (np.abs(x64[..., ro : ro + r]).max())
        bad = actual.copy()
        bad[..., ro : ro + r] += np.float32(bound)
    else:
        bad = actual.copy()
        bad[..., ro : ro + r] = _toward_zero(actual[..., ro : ro + r], 2)
    with pytest.raises(AssertionError, match="exceed the RoPE error bound"):
        assert_rope_close(bad, expected, x, dtype=dtype, **kw)

    # One element, the largest result relative to its pair, two ulps (FP32: 8) toward zero.
    one = actual.copy()
    rot = np.abs(expected[..., ro : ro + r])
    idx = np.unravel_index(int(np.argmax(rot)), rot.shape)
    idx = idx[:-1] + (idx[-1] + ro,)
    one[idx] = _toward_zero(one[idx][None], 8 if dtype == np.float32 else 2)[0]
    with pytest.raises(AssertionError, match=rf"1 of \d+ .*index \({idx[0]}, {idx[1]}, {idx[2]}\)"):
        assert_rope_close(one, expected, x, dtype=dtype, **kw)


def test_assert_rope_close_checks_copied_channels_and_nan(close_case):
    x, expected, actual, kw, dtype = close_case
    flipped = actual.copy()
    flipped.view(np.uint8)[0, 0, 0] ^= 1  # channel 0 is copied (rotary_offset 4)
    with pytest.raises(AssertionError, match=r"copied channel changed at index \(0, 0, 0\)"):
        assert_rope_close(flipped, expected, x, dtype=dtype, **kw)
    nan = actual.copy()
    nan[3, 1, kw["rotary_offset"] + 5] = np.nan
    with pytest.raises(AssertionError, match=r"index \(3, 1, 9\)"):
        assert_rope_close(nan, expected, x, dtype=dtype, **kw)


def test_assert_rope_close_accepts_matching_nan_and_overflow():
    cos, sin = _tables(8, 4)
    # Half-split pairs (x0, x2) and (x1, x3); the first, 60000 * (cos 3 - sin 3), overflows.
    x = np.array([[[60000.0, 1.0, 60000.0, 2.0]], [[1.0, 2.0, 3.0, 4.0]]], np.float16)
    pos = np.array([3, 99])  # token 1 is out of range: NaN expected and produced
    kw = dict(interleaved=False, rotary_dim=4, rotary_offset=0)
    expected = rope_reference(x, cos, sin, pos, **kw)
    actual = round_to_dtype(expected, np.float16)
    assert np.isinf(actual[0, 0]).any() and np.isnan(actual[1]).all()
    assert_rope_close(actual, expected, x, dtype=np.float16, **kw)


def test_rope_error_bound_formula():
    pair = np.array([1.0, 3.0])
    result = np.array([1.5, 0.0])
    np.testing.assert_array_equal(rope_error_bound(pair, np.float32, result), 2.0**-22 * pair)
    np.testing.assert_array_equal(rope_error_bound(pair, BF16, result), 2.0**-22 * pair + [2.0**-7, 2.0**-133])
    np.testing.assert_array_equal(rope_error_bound(pair, np.float16, result), 2.0**-22 * pair + [2.0**-10, 2.0**-24])
