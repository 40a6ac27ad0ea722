"""Inputs for tail RoPE tests: plain random ones, and random ones with hard cases planted.

``tail_edge_inputs`` is what bit-exact tests of the CUDA kernel should feed both the kernel and
``rope_rtc.reference.tail_rope_reference``. Besides ordinary values it plants, in a fixed-seed
random subset of the tail pairs (and of the table entries):

* signed zeros in x and in the tables, so every IEEE sign rule of the FMA is exercised;
* BF16 subnormals, and values whose products land in or near the FP32 subnormal range;
* large values near the BF16/FP32 maximum (sums may overflow to infinity: that is what the
  contract gives, and infinities compare bit for bit);
* rounding-boundary pairs, found by search, where a reassociated expression
  (``reassociated_tail_rope``) rounds to a different BF16 than the contract.

Tables stay finite, as the contract requires. Shapes are [T, H, D], or [T, D] when H is None.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from rope_rtc.reference import TAIL_CHANNELS, TAIL_TABLE_COLUMNS, bf16_rne, fma_f32

BF16 = np.dtype(ml_dtypes.bfloat16)

#: The reassociated forms a careless kernel might compute instead of the contract.
#: "unfused":      bf16(fp32(fp32(a*c) - fp32(b*s)))   (no FMA at all)
#: "fused_other":  bf16(fma(-b, s, fp32(a*c)))          (the FMA taken over the other product)
REASSOCIATED_FORMS = ("unfused", "fused_other")

# At most this many pairs (and table entries) receive planted values; the rest stay random,
# and at least half of every input stays random.
_MAX_PLANTED_PAIRS = 1 << 15
_MAX_PLANTED_TABLE_ENTRIES = 1 << 12
# Candidates tried per boundary pair and search round.
_BOUNDARY_CANDIDATES = 64
_BOUNDARY_ROUNDS = 6


def _shape(T: int, H: int | None, D: int) -> tuple[int, ...]:
    if D not in (128, 512):
        raise ValueError(f"D must be 128 or 512, got {D}")
    return (T, D) if H is None else (T, H, D)


def _f32_bits(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _bf16_from_bits(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(BF16)


def _mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.multiply(a, b, dtype=np.float32)


def _rotate_pairs(a, b, c, s, form: str) -> tuple[np.ndarray, np.ndarray]:
    """(real, imag) in float32 for float32 pair values and table entries, by ``form``."""
    if form == "contract":
        return fma_f32(a, c, -_mul(b, s)), fma_f32(b, c, _mul(a, s))
    if form == "unfused":
        with np.errstate(over="ignore", invalid="ignore"):
            return _mul(a, c) - _mul(b, s), _mul(b, c) + _mul(a, s)
    if form == "fused_other":
        return fma_f32(-b, s, _mul(a, c)), fma_f32(a, s, _mul(b, c))
    raise ValueError(f"unknown form {form!r}")


def _pairs_view(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tail = x[..., x.shape[-1] - TAIL_CHANNELS :]
    return tail[..., 0::2], tail[..., 1::2]


def reassociated_tail_rope(x: np.ndarray, cosine: np.ndarray, sine: np.ndarray, form: str) -> np.ndarray:
    """Tail RoPE computed with a reassociated expression (one of ``REASSOCIATED_FORMS``).

    Not the contract: tests use it to show that the edge inputs tell the contract apart from
    what a kernel that reassociates would produce.
    """
    if form not in REASSOCIATED_FORMS:
        raise ValueError(f"form must be one of {REASSOCIATED_FORMS}, got {form!r}")
    out = np.array(x, copy=True)
    a, b = (v.astype(np.float32) for v in _pairs_view(x))
    c, s = (cosine, sine) if x.ndim == 2 else (cosine[:, None, :], sine[:, None, :])
    real, imag = _rotate_pairs(a, b, c, s, form)
    start = x.shape[-1] - TAIL_CHANNELS
    out[..., start::2] = bf16_rne(np.asarray(real, np.float32))
    out[..., start + 1 :: 2] = bf16_rne(np.asarray(imag, np.float32))
    return out


def tail_random_inputs(T: int, H: int | None, D: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain random tail RoPE inputs: x ~ N(0, 1) in BF16, angles uniform in [-100, 100].

    Returns ``(x, cosine, sine)``: x bfloat16 of shape [T, H, D] ([T, D] when H is None),
    cosine and sine float32 [T, 32], each the correctly rounded cos/sin of a float64 angle.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(_shape(T, H, D), dtype=np.float32).astype(BF16)
    angle = rng.uniform(-100.0, 100.0, size=(T, TAIL_TABLE_COLUMNS))
    return x, np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


# ---- planted values -------------------------------------------------------------------------

_SIGNED_ZERO_TABLE = np.array(
    [(0.0, 0.0), (-0.0, -0.0), (0.0, -0.0), (-0.0, 0.0), (1.0, 0.0), (1.0, -0.0),
     (-1.0, -0.0), (0.0, 1.0), (-0.0, -1.0), (-0.0, 1.0)],
    dtype=np.float32,
)


def _table_specials(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` finite (cos, sin) entries: signed zeros, ±1, FP32 subnormals and tiny values,
    and the FP32 cos/sin of angles near multiples of pi/2 (tiny but normal)."""
    kinds = np.arange(n) % 4
    c = np.empty(n, np.float32)
    s = np.empty(n, np.float32)
    z = kinds == 0
    pick = _SIGNED_ZERO_TABLE[rng.integers(0, len(_SIGNED_ZERO_TABLE), int(z.sum()))]
    c[z], s[z] = pick[:, 0], pick[:, 1]
    sub = kinds == 1  # one FP32 subnormal, the other close to one in magnitude
    m = int(sub.sum())
    tiny = _f32_bits(rng.integers(1, 1 << 23, m)) * rng.choice(np.float32([-1, 1]), m)
    big = np.cos(rng.uniform(0, 0.01, m)).astype(np.float32) * rng.choice(np.float32([-1, 1]), m)
    swap = rng.random(m) < 0.5
    c[sub], s[sub] = np.where(swap, tiny, big), np.where(swap, big, tiny)
    small = kinds == 2  # both tiny normals: products land deep in the FP32 subnormal range
    m = int(small.sum())
    c[small] = np.ldexp(rng.uniform(-1, 1, m), rng.integers(-126, -90, m)).astype(np.float32)
    s[small] = np.ldexp(rng.uniform(-1, 1, m), rng.integers(-126, -90, m)).astype(np.float32)
    quarter = kinds == 3  # what a real table holds near angle k*pi/2
    m = int(quarter.sum())
    angle = rng.integers(-64, 64, m) * (np.pi / 2) + rng.uniform(-1e-7, 1e-7, m)
    c[quarter], s[quarter] = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    return c, s


def _random_sign(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.choice(np.float32([-1, 1]), n)


def _signed_zero_pairs(rng, n):
    zeros = np.float32([0.0, -0.0])
    a = zeros[rng.integers(0, 2, n)]
    b = zeros[rng.integers(0, 2, n)]
    # A third of the pairs keep one ordinary value beside the zero.
    one = rng.integers(0, 3, n)
    other = rng.standard_normal(n).astype(np.float32)
    a = np.where(one == 1, other, a)
    b = np.where(one == 2, other, b)
    return a, b


def _bf16_subnormal(rng, n):
    bits = rng.integers(1, 1 << 7, n).astype(np.uint16) | (rng.integers(0, 2, n).astype(np.uint16) << 15)
    return _bf16_from_bits(bits).astype(np.float32)


def _subnormal_pairs(rng, n):
    a = _bf16_subnormal(rng, n)
    b = _bf16_subnormal(rng, n)
    # Some pairs mix a subnormal with the smallest normals or with an ordinary value.
    mix = rng.integers(0, 3, n)
    near_min = np.ldexp(rng.uniform(1, 2, n), rng.integers(-126, -120, n)) * _random_sign(rng, n)
    b = np.where(mix == 1, near_min.astype(np.float32), b)
    b = np.where(mix == 2, rng.standard_normal(n).astype(np.float32), b)
    return a, b


def _near_fp32_subnormal_products(rng, n):
    # |a|, |b| in [2^-126, 2^-100): times |c|, |s| <= 1 the products fall around 2^-149..2^-100,
    # straddling the FP32 subnormal range, and FMAs round there.
    def draw():
        return (np.ldexp(rng.uniform(1, 2, n), rng.integers(-126, -100, n)) * _random_sign(rng, n)).astype(np.float32)

    return draw(), draw()


def _large_pairs(rng, n):
    # Finite BF16 values with exponents 120..127, drawn as bit patterns so that none rounds up
    # to infinity itself: results near the top straddle the BF16 round-to-infinity boundary.
    # A quarter of the pairs are (±max, ±max): for any angle not a multiple of pi/2,
    # |cos| + |sin| > 1, so one of real and imag overflows to infinity (the contract's answer).
    def draw():
        exponent = rng.integers(127 + 120, 127 + 128, n).astype(np.uint16)
        mantissa = rng.integers(0, 1 << 7, n).astype(np.uint16)
        sign = rng.integers(0, 2, n).astype(np.uint16)
        return _bf16_from_bits((sign << 15) | (exponent << 7) | mantissa).astype(np.float32)

    a, b = draw(), draw()
    top = rng.integers(0, 4, n) == 0
    bf16_max = np.float32(ml_dtypes.finfo(BF16).max)
    a[top] = bf16_max * _random_sign(rng, int(top.sum()))
    b[top] = bf16_max * _random_sign(rng, int(top.sum()))
    return a, b


def _mixed_scale_pairs(rng, n):
    # One huge and one tiny value: the FMA adds terms 2^200 apart, where only one rounding
    # step separates the contract from a sloppy emulation.
    big = (np.ldexp(rng.uniform(1, 2, n), rng.integers(60, 127, n)) * _random_sign(rng, n)).astype(np.float32)
    tiny = (np.ldexp(rng.uniform(1, 2, n), rng.integers(-133, -60, n)) * _random_sign(rng, n)).astype(np.float32)
    swap = rng.random(n) < 0.5
    return np.where(swap, big, tiny), np.where(swap, tiny, big)


_VALUE_PLANTERS = (
    _signed_zero_pairs,
    _subnormal_pairs,
    _near_fp32_subnormal_products,
    _large_pairs,
    _mixed_scale_pairs,
)


def _search_boundary_pairs(rng, c, s, which):
    """For each table entry (c[i], s[i]) find a BF16 pair (a, b) whose ``which`` component
    ("real" or "imag") the contract rounds differently from some reassociated form.

    The pair is built to nearly cancel (a*c ~ b*s for real, b*c ~ -a*s for imag): the result is
    then small next to the products, so the FP32 rounding of whichever product is not fused
    decides the BF16 result often enough for a short random search.
    Returns (a, b, found) as float32, float32, bool arrays; unfound entries keep random values.
    """
    m = c.shape[0]
    a_out = rng.standard_normal(m).astype(BF16).astype(np.float32)
    b_out = rng.standard_normal(m).astype(BF16).astype(np.float32)
    found = np.zeros(m, bool)
    comp = 0 if which == "real" else 1
    for _ in range(_BOUNDARY_ROUNDS):
        todo = np.flatnonzero(~found)
        if todo.size == 0:
            break
        k = _BOUNDARY_CANDIDATES
        cc = np.repeat(c[todo], k)
        ss = np.repeat(s[todo], k)
        free = np.ldexp(rng.uniform(1, 2, cc.size), rng.integers(-8, 9, cc.size)) * _random_sign(rng, cc.size)
        free = free.astype(BF16).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if which == "real":  # a*c - b*s ~ 0: b = a*c/s
                a = free
                b = (a.astype(np.float64) * cc / ss).astype(np.float32).astype(BF16).astype(np.float32)
            else:  # b*c + a*s ~ 0: a = -b*c/s
                b = free
                a = (-b.astype(np.float64) * cc / ss).astype(np.float32).astype(BF16).astype(np.float32)
        ok = np.isfinite(a) & np.isfinite(b)
        want = bf16_rne(_rotate_pairs(a, b, cc, ss, "contract")[comp]).view(np.uint16)
        hit = np.zeros(cc.size, bool)
        for form in REASSOCIATED_FORMS:
            got = bf16_rne(np.asarray(_rotate_pairs(a, b, cc, ss, form)[comp], np.float32)).view(np.uint16)
            hit |= got != want
        hit &= ok
        hit = hit.reshape(todo.size, k)
        row_hit = hit.any(axis=1)
        first = np.argmax(hit, axis=1)
        rows = todo[row_hit]
        sel = np.flatnonzero(row_hit) * k + first[row_hit]
        a_out[rows], b_out[rows] = a[sel], b[sel]
        found[rows] = True
    return a_out, b_out, found


def tail_edge_inputs(T: int, H: int | None, D: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random tail RoPE inputs with hard cases planted (see the module docstring).

    Returns ``(x, cosine, sine)`` like :func:`tail_random_inputs`. Deterministic in ``seed``.
    Every kind of planted case appears once there are a few dozen tail pairs (T * H * 32).
    """
    x, cosine, sine = tail_random_inputs(T, H, D, seed)
    if x.size == 0:
        return x, cosine, sine
    rng = np.random.default_rng([seed, 0x7A11])
    heads = 1 if H is None else H
    x3 = x.reshape(T, heads, D)  # a view: planting into it plants into x
    num_pairs = T * heads * TAIL_TABLE_COLUMNS

    # Special table entries: a quarter of the (token, column) slots at most.
    num_slots = T * TAIL_TABLE_COLUMNS
    n_tab = min(num_slots // 4, _MAX_PLANTED_TABLE_ENTRIES)
    special_slot = np.zeros(num_slots, bool)
    if n_tab:
        slots = rng.choice(num_slots, n_tab, replace=False)
        special_slot[slots] = True
        c, s = _table_specials(rng, n_tab)
        cosine.reshape(-1)[slots] = c
        sine.reshape(-1)[slots] = s

    # Planted pairs: half of the pairs at most, dealt round-robin to the planters; boundary
    # pairs (the last two planters) go only where the table entry is ordinary and nonzero.
    n_plant = min(num_pairs // 2, _MAX_PLANTED_PAIRS)
    order = rng.permutation(num_pairs)[:n_plant]
    n_kinds = len(_VALUE_PLANTERS) + 2
    kind = np.arange(n_plant) % n_kinds
    t_idx, h_idx, j_idx = np.unravel_index(order, (T, heads, TAIL_TABLE_COLUMNS))
    slot = t_idx * TAIL_TABLE_COLUMNS + j_idx
    a_all, b_all = (v.astype(np.float32) for v in _pairs_view(x3))
    a_new = a_all[t_idx, h_idx, j_idx]
    b_new = b_all[t_idx, h_idx, j_idx]

    for k, planter in enumerate(_VALUE_PLANTERS):
        sel = kind == k
        a_new[sel], b_new[sel] = planter(rng, int(sel.sum()))

    c_flat, s_flat = cosine.reshape(-1), sine.reshape(-1)
    ordinary = ~special_slot[slot] & (c_flat[slot] != 0) & (s_flat[slot] != 0)
    for k, which in ((len(_VALUE_PLANTERS), "real"), (len(_VALUE_PLANTERS) + 1, "imag")):
        sel = np.flatnonzero((kind == k) & ordinary)
        if sel.size:
            a, b, _ = _search_boundary_pairs(rng, c_flat[slot[sel]], s_flat[slot[sel]], which)
            a_new[sel], b_new[sel] = a, b

    start = D - TAIL_CHANNELS
    x3[t_idx, h_idx, start + 2 * j_idx] = a_new.astype(BF16)
    x3[t_idx, h_idx, start + 2 * j_idx + 1] = b_new.astype(BF16)
    return x, cosine, sine
