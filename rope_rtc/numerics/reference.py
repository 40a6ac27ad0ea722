"""NumPy reference implementations of rope_rtc's numerical contracts.

Two contracts live here (docs/design.md, "Numerical contracts"):

* **General RoPE** is held to a float64 reference fed the same FP32 cos/sin tables as the GPU.
  :func:`rope_reference` computes it, :func:`rope_error_bound` states how far a correct FP32,
  FP16 or BF16 result may be from it, and :func:`assert_rope_close` applies that bound to a
  whole tensor and reports the worst offender.
* **Tail RoPE** (the prepared BF16 tail seed) is bit-exact. :func:`tail_rope_reference`
  reproduces it exactly, using :func:`fma_f32` (a correctly rounded FP32 fused multiply-add,
  emulated because NumPy has none) and :func:`bf16_rne`.

Pure NumPy and ml_dtypes: no GPU, no CuPy. Everything is vectorised; nothing loops over tokens.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..build.registry import TAIL_DIMS as TAIL_HEAD_DIMS  # D values the contract allows (named once)

__all__ = [
    "TAIL_CHANNELS",
    "TAIL_HEAD_DIMS",
    "TAIL_TABLE_COLUMNS",
    "assert_rope_close",
    "bf16_rne",
    "fma_f32",
    "rope_error_bound",
    "rope_reference",
    "round_to_dtype",
    "tail_rope_reference",
]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: Channels rotated by tail RoPE: the last 64 of every head, fixed by the seed's contract.
TAIL_CHANNELS = 64
#: One table column per rotated pair.
TAIL_TABLE_COLUMNS = TAIL_CHANNELS // 2
#: Head dims the tail contract accepts.

# The canonical NaN NVIDIA hardware produces: FP32 arithmetic returns 0x7FFFFFFF for any NaN
# result, and cvt.rn.bf16.f32 (what __float2bfloat16_rn compiles to) returns 0x7FFF for any NaN
# input. Emitting the same bits keeps GPU outputs bit-comparable even where a NaN appears.
_CANONICAL_NAN_F32 = np.uint32(0x7FFFFFFF)
_CANONICAL_NAN_BF16 = np.uint16(0x7FFF)

# Error bound of general RoPE computed in FP32, relative to the pair magnitude |x0| + |x1|.
# Two rounded products and one rounded sum, each off by at most 2^-24 of its magnitude, give
# about 2^-23 * (|x0| + |x1|) when |cos|, |sin| <= 1; 2^-22 leaves a factor of two of margin.
_FP32_PAIR_REL_BOUND = 2.0**-22

# (precision in bits including the implicit one, minimum normal exponent) of each output dtype.
_FORMATS = {
    np.dtype(np.float16): (11, -14),
    BFLOAT16: (8, -126),
    np.dtype(np.float32): (24, -126),
    np.dtype(np.float64): (53, -1022),
}
_ROUNDED_OUTPUTS = (np.dtype(np.float16), BFLOAT16)  # dtypes whose rounding adds one ulp


def _float_dtype(dtype, what: str) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in _FORMATS:
        raise TypeError(f"{what} must be float16, bfloat16, float32 or float64, got {dt}")
    return dt


# --------------------------------------------------------------------------------------------
# Rounding helpers
# --------------------------------------------------------------------------------------------


def _round_to_odd_f32(values64: np.ndarray) -> np.ndarray:
    """Round float64 to float32 with round-to-odd (truncate, then set the last bit if inexact).

    Round-to-odd to a format with at least two more bits than the final one, followed by a
    round-to-nearest-even to the final format, equals one correct rounding of the original
    value (Boldo and Melquiond). It is how every double-rounding hazard here is avoided.
    Values that overflow float32 are left as infinities; every format rounded to afterwards
    (float16, bfloat16) overflows at a smaller magnitude anyway.
    """
    v = np.asarray(values64, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = v.astype(np.float32)
    back = f.astype(np.float64)
    fix = (back != v) & np.isfinite(f) & ((f.view(np.uint32) & 1) == 0)
    if np.any(fix):
        toward = np.where(v[fix] > back[fix], np.float32(np.inf), np.float32(-np.inf))
        f[fix] = np.nextafter(f[fix], toward)
    return f


def bf16_rne(values_f32: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16, to nearest even, exactly as ``__float2bfloat16_rn``.

    Done with integer bit operations, so it does not depend on the installed ml_dtypes:
    subnormals round like any other value (bfloat16 shares float32's exponent range), overflow
    gives infinity, and every NaN becomes the canonical NaN 0x7FFF that NVIDIA hardware
    produces (ml_dtypes' own cast agrees on all non-NaN inputs but keeps the NaN's sign).
    """
    f = np.asarray(values_f32)
    if f.dtype != np.float32:
        raise TypeError(f"bf16_rne expects float32, got {f.dtype}")
    u = f.view(np.uint32)  # same item size: a view works for any strides
    lsb = (u >> 16) & 1
    rounded = ((u + (0x7FFF + lsb)) >> 16).astype(np.uint16)  # NaN lanes may wrap: replaced
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.asarray(np.where(nan, _CANONICAL_NAN_BF16, rounded), dtype=np.uint16).view(BFLOAT16)


def _bf16_to_f32(values_bf16: np.ndarray) -> np.ndarray:
    """Widen bfloat16 to float32 exactly (a 16-bit shift: NaN payloads and signed zeros kept)."""
    u = np.asarray(values_bf16).view(np.uint16)
    return (u.astype(np.uint32) << 16).view(np.float32)


def round_to_dtype(values64: np.ndarray, dtype) -> np.ndarray:
    """Round float64 values once to ``dtype``, to nearest even.

    For float32 this is NumPy's own (correct) cast. For float16 and bfloat16, casting through
    float32 would round twice and can land one ulp off, so the float32 step rounds to odd and
    the final step to nearest even: together, one correct rounding of the float64 value
    (ml_dtypes' direct float64 -> bfloat16 cast double-rounds; this does not).

    The GPU computes in FP32 and rounds that FP32 result once; this helper rounds the float64
    value instead, so it mirrors "compute in FP32, round once" only approximately (the two can
    differ by an ulp where FP32 arithmetic error crosses a rounding boundary). It produces the
    NumPy backend's output; GPU results are checked with :func:`assert_rope_close`, not
    compared with this bit for bit.
    """
    dt = _float_dtype(dtype, "dtype")
    v = np.asarray(values64, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        if dt == np.float64:
            return v.copy()
        if dt == np.float32:
            return v.astype(np.float32)
        odd = _round_to_odd_f32(v)
        if dt == np.float16:
            return odd.astype(np.float16)
        return bf16_rne(odd)


# --------------------------------------------------------------------------------------------
# Correctly rounded FP32 fused multiply-add
# --------------------------------------------------------------------------------------------


def fma_f32(a, b, c) -> np.ndarray:
    """Correctly rounded float32 ``a * b + c`` (one rounding, to nearest even), elementwise.

    Parameters
    ----------
    a, b, c : float32 array_like
        Broadcast against each other. Other dtypes are refused rather than silently rounded.

    Returns
    -------
    numpy.ndarray of float32
        What IEEE 754 fusedMultiplyAdd (CUDA ``__fmaf_rn``) returns: subnormals kept (no
        flush to zero), overflow to infinity, ``inf * 0`` and ``inf - inf`` give NaN, and an
        exact zero result takes the IEEE sign (opposite-signed zeros and exact cancellation give
        +0; ``-0 + -0`` gives -0). NaN results are the canonical NaN 0x7FFFFFFF, as on NVIDIA
        hardware.

    Notes
    -----
    A float32 x float32 product has at most 48 significant bits and an exponent in
    [-298, 256], so it is exact in float64. The float64 sum ``p + c`` is then rounded once,
    and TwoSum recovers its exact error ``e`` (``p + c == s + e`` exactly). Rounding ``s`` to
    odd (moving it one ulp toward ``e`` when ``e != 0`` and its last bit is even) keeps enough
    information that the final float64 -> float32 cast rounds the exact sum correctly, where a
    plain ``float32(p + c)`` can round twice and land one float32 ulp off.
    """
    arrays = [np.asarray(v) for v in (a, b, c)]
    for name, arr in zip("abc", arrays):
        if arr.dtype != np.float32:
            raise TypeError(f"fma_f32: {name} must be float32, got {arr.dtype}")
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf inputs are legitimate
        a64, b64, c64 = (arr.astype(np.float64) for arr in np.broadcast_arrays(*arrays))
        p = a64 * b64  # exact
        s = p + c64
        # TwoSum (Knuth): e is the exact rounding error of s, for any order of magnitudes.
        c_part = s - p
        e = (p - (s - c_part)) + (c64 - c_part)
        # s == 0 implies e == 0 (a float64 sum that cancels to zero is exact), so the nudge
        # never touches a zero and the IEEE sign of an exact zero result is float64's own.
        nudge = (e != 0) & np.isfinite(s) & ((s.view(np.uint64) & 1) == 0)
        if np.any(nudge):
            s = np.where(nudge, np.nextafter(s, np.copysign(np.inf, e)), s)
        r = np.asarray(s.astype(np.float32))
    nan = np.isnan(r)
    if np.any(nan):
        r.view(np.uint32)[nan] = _CANONICAL_NAN_F32
    return r


def _mul_f32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 product rounded once (RNE): exact in float64, then one cast (``__fmul_rn``)."""
    with np.errstate(invalid="ignore", over="ignore"):
        r = np.asarray((a.astype(np.float64) * b.astype(np.float64)).astype(np.float32))
    nan = np.isnan(r)
    if np.any(nan):
        r.view(np.uint32)[nan] = _CANONICAL_NAN_F32
    return r


# --------------------------------------------------------------------------------------------
# Tail RoPE: bit-exact
# --------------------------------------------------------------------------------------------


def _check_tail_inputs(x, cosine, sine) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = np.asarray(x)
    cosine = np.asarray(cosine)
    sine = np.asarray(sine)
    if x.dtype != BFLOAT16:
        raise TypeError(f"tail RoPE: x must be bfloat16 (ml_dtypes.bfloat16), got {x.dtype}")
    for name, table in (("cosine", cosine), ("sine", sine)):
        if table.dtype != np.float32:
            raise TypeError(f"tail RoPE: {name} must be float32, got {table.dtype}")
    if x.ndim not in (2, 3):
        raise ValueError(f"tail RoPE: x must be [T, D] or [T, H, D], got shape {x.shape}")
    if x.ndim == 3 and x.shape[1] < 1:
        raise ValueError(f"tail RoPE: H must be positive, got shape {x.shape}")
    d = x.shape[-1]
    if d not in TAIL_HEAD_DIMS:
        raise ValueError(f"tail RoPE: D must be one of {TAIL_HEAD_DIMS}, got {d} (shape {x.shape})")
    expected = (x.shape[0], TAIL_TABLE_COLUMNS)
    for name, table in (("cosine", cosine), ("sine", sine)):
        if table.shape != expected:
            raise ValueError(
                f"tail RoPE: {name} must have shape [T, {TAIL_TABLE_COLUMNS}] = {expected} "
                f"for x of shape {x.shape}, got {table.shape}"
            )
    return x, cosine, sine


def tail_rope_reference(x, cosine, sine) -> np.ndarray:
    """Bit-exact tail RoPE: the prepared BF16 tail seed's contract, in NumPy.

    Parameters
    ----------
    x : bfloat16 array, shape [T, D] or [T, H, D], D in {128, 512}
    cosine, sine : float32 arrays, shape [T, 32]
        Column j rotates the pair j of the tail. The contract requires finite values; this
        reference does not scan them (neither does the GPU) and returns whatever IEEE
        arithmetic gives.

    Returns
    -------
    numpy.ndarray
        A new C-contiguous bfloat16 array of ``x``'s shape. The first D - 64 channels of every
        head are copied bit for bit. For each adjacent tail pair ``(a, b) = (x[..., D-64+2j],
        x[..., D-64+2j+1])`` with ``c = cosine[t, j]``, ``s = sine[t, j]``::

            real = bf16_rne(fma_f32(a, c, -fp32_rne(b * s)))
            imag = bf16_rne(fma_f32(b, c,  fp32_rne(a * s)))

        which is CUDA's ``__fmaf_rn(a, c, -__fmul_rn(b, s))``. The order of the multiply and
        the FMA is part of the contract: a reassociated expression (two rounded products, or the
        FMA taken over the other product) rounds differently near BF16 rounding boundaries.
        Negating ``sine`` applies the opposite angle. NaN results are the canonical 0x7FFF.
    """
    x, cosine, sine = _check_tail_inputs(x, cosine, sine)
    out = np.array(x, order="C", copy=True)
    start = x.shape[-1] - TAIL_CHANNELS
    tail = _bf16_to_f32(x[..., start:])
    a = tail[..., 0::2]
    b = tail[..., 1::2]
    if x.ndim == 3:  # one table row per token, shared by its heads
        cosine = cosine[:, None, :]
        sine = sine[:, None, :]
    real = fma_f32(a, cosine, -_mul_f32(b, sine))
    imag = fma_f32(b, cosine, _mul_f32(a, sine))
    out[..., start::2] = bf16_rne(real)
    out[..., start + 1 :: 2] = bf16_rne(imag)
    return out


# --------------------------------------------------------------------------------------------
# General RoPE: float64 reference and its error bound
# --------------------------------------------------------------------------------------------


def _rotary_span(d: int, rotary_dim: int | None, rotary_offset: int) -> tuple[int, int]:
    r = d if rotary_dim is None else int(rotary_dim)
    ro = int(rotary_offset)
    if r <= 0 or r % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {r}")
    if ro < 0 or ro + r > d:
        raise ValueError(
            f"rotary channels [{ro}, {ro + r}) must lie inside the head dim {d} "
            f"(rotary_offset={ro}, rotary_dim={r})"
        )
    return r, ro


def _split_pairs(rot: np.ndarray, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """(x0, x1) views of the rotated channels: adjacent pairs or the two halves."""
    if interleaved:
        return rot[..., 0::2], rot[..., 1::2]
    half = rot.shape[-1] // 2
    return rot[..., :half], rot[..., half:]


def _merge_pairs(p0: np.ndarray, p1: np.ndarray, interleaved: bool) -> np.ndarray:
    """Inverse of :func:`_split_pairs`: lay per-pair values back out as channels."""
    if interleaved:
        return np.stack([p0, p1], axis=-1).reshape(*p0.shape[:-1], 2 * p0.shape[-1])
    return np.concatenate([p0, p1], axis=-1)


def rope_reference(
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    positions: np.ndarray,
    *,
    interleaved: bool,
    rotary_dim: int | None = None,
    rotary_offset: int = 0,
    inverse: bool = False,
) -> np.ndarray:
    """General RoPE in float64, the reference every backend is compared with.

    Parameters
    ----------
    x : array, shape [N, H, D], float16, bfloat16, float32 or float64
    cos, sin : float32 arrays, shape [P, R/2]
        The same FP32 tables the GPU reads; their values are upcast to float64 exactly.
        R is ``rotary_dim``.
    positions : integer array, shape [N]
        Token n uses table row ``positions[n]``. A position outside ``[0, P)`` produces NaN in
        that token's rotated channels (as the GPU kernel does); nothing is read out of bounds.
    interleaved : bool
        ``False``: half-split pairs ``(x[ro+i], x[ro+i+R/2])`` (GPT-NeoX, Hugging Face
        ``rotate_half``, vLLM ``is_neox_style=True``). ``True``: adjacent pairs
        ``(x[ro+2i], x[ro+2i+1])`` (RoFormer, GPT-J, Meta's original LLaMA, MLX
        ``traditional=True``). Pair i uses table column i either way.
    rotary_dim : int, optional
        R, the number of rotated channels (even); default D.
    rotary_offset : int
        ro, the first rotated channel; channels outside ``[ro, ro + R)`` are copied.
    inverse : bool
        Rotate by the opposite angle (``-sin``), undoing a forward rotation.

    Returns
    -------
    numpy.ndarray of float64, shape [N, H, D]
        ``o0 = x0*c - x1*s`` and ``o1 = x1*c + x0*s`` in the rotated channels, ``float64(x)``
        elsewhere.
    """
    x = np.asarray(x)
    _float_dtype(x.dtype, "x")
    if x.ndim != 3:
        raise ValueError(f"x must have shape [N, H, D], got {x.shape}")
    n, _, d = x.shape
    r, ro = _rotary_span(d, rotary_dim, rotary_offset)
    cos = np.asarray(cos)
    sin = np.asarray(sin)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != np.float32:
            raise TypeError(
                f"{name} must be float32 (the table the GPU reads), got {table.dtype}; "
                "round a float64 table with .astype(np.float32) first"
            )
        if table.ndim != 2 or table.shape[1] != r // 2:
            raise ValueError(f"{name} must have shape [P, {r // 2}] (rotary_dim={r}), got {table.shape}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {cos.shape} and {sin.shape}")
    positions = np.asarray(positions)
    if not np.issubdtype(positions.dtype, np.integer):
        raise TypeError(f"positions must be an integer array, got {positions.dtype}")
    if positions.shape != (n,):
        raise ValueError(f"positions must have shape [N] = ({n},), got {positions.shape}")

    num_rows = cos.shape[0]
    valid = (positions >= 0) & (positions < num_rows)
    rows = np.where(valid, positions, 0)
    if num_rows == 0:
        c = np.full((n, r // 2), np.nan)
        s = np.full((n, r // 2), np.nan)
    else:
        c = cos[rows].astype(np.float64)
        s = sin[rows].astype(np.float64)
        c[~valid] = np.nan
        s[~valid] = np.nan
    if inverse:
        s = -s
    c = c[:, None, :]  # shared by every head of the token
    s = s[:, None, :]

    out = x.astype(np.float64)
    x0, x1 = _split_pairs(out[..., ro : ro + r], interleaved)
    o0 = x0 * c - x1 * s
    o1 = x1 * c + x0 * s
    out[..., ro : ro + r] = _merge_pairs(o0, o1, interleaved)
    return out


def _ulp(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Spacing of ``dtype`` at each value's magnitude (the subnormal spacing at and near 0)."""
    precision, emin = _FORMATS[dtype]
    v = np.asarray(values, dtype=np.float64)
    _, e = np.frexp(np.where(np.isfinite(v), v, 0.0))  # |v| in [2^(e-1), 2^e)
    exponent = np.where(v == 0, emin, np.maximum(e - 1, emin))
    return np.ldexp(1.0, exponent - (precision - 1))


def rope_error_bound(x_pairs_abs_sum: np.ndarray, out_dtype, result: np.ndarray) -> np.ndarray:
    """How far a correct general-RoPE output may be from the float64 reference.

    Parameters
    ----------
    x_pairs_abs_sum : array
        ``|x0| + |x1|`` of the pair each output element belongs to. The bound scales with the
        pair, not with the result, because a rotated value may cancel to nearly zero while its
        FP32 rounding errors stay proportional to the inputs.
    out_dtype : float32, float16 or bfloat16 (float64 is treated like float32)
    result : array
        The value whose output-dtype ulp is added (the result actually produced, finite).

    Returns
    -------
    numpy.ndarray of float64
        FP32: ``2^-22 * (|x0| + |x1|)``. FP16/BF16: one output-dtype ulp of ``result`` plus the
        same FP32 term. Assumes ``|cos|, |sin| <= 1``.
    """
    dt = _float_dtype(out_dtype, "out_dtype")
    bound = _FP32_PAIR_REL_BOUND * np.asarray(x_pairs_abs_sum, dtype=np.float64)
    if dt in _ROUNDED_OUTPUTS:
        bound = bound + _ulp(result, dt)
    return bound


def _max_finite(dtype: np.dtype) -> float:
    return float(ml_dtypes.finfo(dtype).max)


def _same_bits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise bit equality of two arrays of one dtype."""
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return a.view(view) == b.view(view)


def assert_rope_close(
    actual: np.ndarray,
    expected64: np.ndarray,
    x: np.ndarray,
    *,
    interleaved: bool,
    rotary_dim: int | None = None,
    rotary_offset: int = 0,
    dtype=None,
) -> None:
    """Assert a general-RoPE output meets the bound of docs/design.md against the float64 reference.

    Parameters
    ----------
    actual : array [..., D]
        The output under test (host copy), in its output dtype.
    expected64 : float64 array of the same shape
        :func:`rope_reference` of ``x`` with the same tables and pair layout.
    x : array of the same shape
        The input that was rotated: it supplies each pair's ``|x0| + |x1|``, and the copied
        channels must equal it exactly.
    interleaved, rotary_dim, rotary_offset
        As for :func:`rope_reference`.
    dtype : optional
        The output dtype whose ulp the bound uses; default ``actual.dtype``.

    Raises
    ------
    AssertionError
        Naming how many elements fail, and the worst one (relative to its bound): its index,
        actual and expected values, bound, and the pair's inputs.

    Notes
    -----
    Rotated channels pass when ``|actual - expected| <= rope_error_bound(...)``, with the ulp
    taken at the actual value; NaN must meet NaN (out-of-range positions); an infinity passes
    only where the expected value overflows the output dtype within the bound. Copied channels
    must be bit-identical to ``x`` when the dtypes match (equal in value otherwise). Works in
    chunks of rows, so ~10^7 elements cost a few hundred MB at most.
    """
    actual = np.asarray(actual)
    expected64 = np.asarray(expected64)
    x = np.asarray(x)
    if not (actual.shape == expected64.shape == x.shape) or actual.ndim < 1:
        raise ValueError(
            f"actual, expected64 and x must share one shape [..., D]: "
            f"{actual.shape}, {expected64.shape}, {x.shape}"
        )
    out_dtype = _float_dtype(actual.dtype if dtype is None else dtype, "dtype")
    _float_dtype(x.dtype, "x")
    d = x.shape[-1]
    r, ro = _rotary_span(d, rotary_dim, rotary_offset)
    shape = x.shape

    act2 = actual.reshape(-1, d)
    exp2 = expected64.reshape(-1, d)
    x2 = x.reshape(-1, d)
    rows = act2.shape[0]
    chunk = max(1, (1 << 21) // d)
    max_finite = _max_finite(out_dtype)
    bad_total = 0
    worst = None  # (score, flat index, actual, expected, bound, x0, x1)

    for start in range(0, rows, chunk):
        sl = slice(start, min(rows, start + chunk))

        # Copied channels: exactly the input.
        for lo, hi in ((0, ro), (ro + r, d)):
            if hi <= lo:
                continue
            a_c, x_c = act2[sl, lo:hi], x2[sl, lo:hi]
            if a_c.dtype == x_c.dtype:
                same = _same_bits(a_c, x_c)
            else:
                a64, x64 = a_c.astype(np.float64), x_c.astype(np.float64)
                same = (a64 == x64) | (np.isnan(a64) & np.isnan(x64))
            if not same.all():
                i, j = np.argwhere(~same)[0]
                idx = np.unravel_index((start + i) * d + lo + j, shape)
                raise AssertionError(
                    f"copied channel changed at index {tuple(int(k) for k in idx)}: "
                    f"actual {a_c[i, j]!r}, input {x_c[i, j]!r} "
                    f"({int((~same).sum())} copied elements differ in rows {sl.start}..{sl.stop - 1}; "
                    f"channels outside [{ro}, {ro + r}) must be copied bit for bit)"
                )

        # Rotated channels: within the bound, scaled by each element's pair.
        act = act2[sl, ro : ro + r].astype(np.float64)
        exp = exp2[sl, ro : ro + r]
        x0, x1 = _split_pairs(x2[sl, ro : ro + r].astype(np.float64), interleaved)
        pair_abs = np.abs(x0) + np.abs(x1)
        pair_abs = _merge_pairs(pair_abs, pair_abs, interleaved)
        with np.errstate(invalid="ignore", over="ignore"):
            finite_act = np.where(np.isinf(act), np.copysign(max_finite, act), act)
            bound = rope_error_bound(pair_abs, out_dtype, finite_act)
            err = np.abs(act - exp)
            ok = err <= bound
            ok |= np.isnan(act) & np.isnan(exp)
            ok |= np.isinf(exp) & (act == exp)
            # An infinity is right where the expected value rounds past the largest finite.
            overflow = np.isinf(act) & np.isfinite(exp) & (np.sign(act) == np.sign(exp))
            ok |= overflow & (np.abs(exp) + bound >= max_finite)
        if ok.all():
            continue
        bad = ~ok
        bad_total += int(bad.sum())
        with np.errstate(invalid="ignore", divide="ignore"):
            score = np.where(bad, err / bound, -np.inf)
        score = np.where(bad & np.isnan(score), np.inf, score)  # NaN mismatches rank first
        i, j = np.unravel_index(int(np.argmax(score)), score.shape)
        if worst is None or score[i, j] > worst[0]:
            pair = j // 2 if interleaved else j % (r // 2)
            x0v, x1v = x0[i, pair], x1[i, pair]
            flat = (start + i) * d + ro + j
            worst = (score[i, j], flat, act[i, j], exp[i, j], bound[i, j], x0v, x1v)

    if worst is not None:
        score, flat, a_v, e_v, b_v, x0v, x1v = worst
        idx = tuple(int(k) for k in np.unravel_index(flat, shape))
        raise AssertionError(
            f"{bad_total} of {rows * r} rotated elements exceed the RoPE error bound "
            f"({out_dtype}, {'interleaved' if interleaved else 'half-split'}, "
            f"rotary_dim={r}, rotary_offset={ro}). Worst at index {idx}: "
            f"actual {a_v!r}, expected {e_v!r}, |diff| {abs(a_v - e_v)!r} > bound {b_v!r} "
            f"({score:.3g}x the bound); pair inputs x0={x0v!r}, x1={x1v!r}"
        )


# --------------------------------------------------------------------------------------------
# The general kernels' arithmetic, bit for bit; RoPE fused with the paged KV-cache write
# --------------------------------------------------------------------------------------------

# Largest finite value of each FP8 format (what __NV_SATFINITE saturates to).
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def rope_kernel_arithmetic(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray, *,
                           interleaved: bool, rotary_dim: int | None = None) -> np.ndarray:
    """What the GPU kernels compute, bit for bit (no NaN positions): each pair in FP32,
    ``re = fmaf(x0, c, -fp32(x1 * s))``, ``im = fmaf(x1, c, fp32(x0 * s))``, rounded once to
    ``x``'s dtype (to nearest even). ``x`` is ``[T, H, D]``; the window starts at channel 0."""
    x = np.asarray(x)
    dt = x.dtype
    r, _ = _rotary_span(x.shape[-1], rotary_dim, 0)
    xf = _bf16_to_f32(x) if dt == BFLOAT16 else x.astype(np.float32)
    pos = np.asarray(positions).astype(np.int64).reshape(-1)
    c = np.asarray(cos, np.float32)[pos][:, None, :]
    s = np.asarray(sin, np.float32)[pos][:, None, :]
    x0, x1 = _split_pairs(xf[..., :r], interleaved)
    c, s = np.broadcast_to(c, x0.shape), np.broadcast_to(s, x0.shape)
    re = fma_f32(x0, c, -_mul_f32(x1, s))
    im = fma_f32(x1, c, _mul_f32(x0, s))
    rot = _merge_pairs(re, im, interleaved)
    out = x.copy()
    if dt == BFLOAT16:
        out[..., :r] = bf16_rne(np.ascontiguousarray(rot))
    else:
        out[..., :r] = rot.astype(dt)
    return out


def fp8_quantize(values: np.ndarray, scale, kind: str) -> np.ndarray:
    """FP8 cache entries (as uint8) of ``values`` (in the input dtype): ``value / scale`` in FP32,
    saturated to the format's finite range, rounded to nearest even (``kind``: ``"fp8_e4m3"``
    for e4m3fn or ``"fp8_e5m2"``)."""
    import ml_dtypes

    v = np.asarray(values)
    vf = _bf16_to_f32(v) if v.dtype == BFLOAT16 else v.astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # a zero scale, inf and NaN are legitimate
        q = np.clip(vf / np.float32(scale), -FP8_MAX[kind], FP8_MAX[kind])
    fmt = ml_dtypes.float8_e4m3fn if kind == "fp8_e4m3" else ml_dtypes.float8_e5m2
    return q.astype(fmt).view(np.uint8)


# kv_cache_dtype -> ml_dtypes' name of the format, the dtype of a cache typed as FP8
FP8_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _cache_copy(cache, name: str, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """A copy of ``cache`` (its dtype kept) and the view of it that entries are written through:
    for FP8, its uint8 bytes, since :func:`fp8_quantize` gives encodings and assigning those to an
    array typed as FP8 would convert each byte's integer value instead (0xE0 stored as 224.0)."""
    copy = np.array(cache, copy=True)
    if kind == "auto":
        if copy.dtype.name in FP8_DTYPES.values():
            raise TypeError(f"{name}: an FP8 cache ({copy.dtype.name}) with kv_cache_dtype='auto'; pass "
                            f"kv_cache_dtype={next(k for k, v in FP8_DTYPES.items() if v == copy.dtype.name)!r}")
        return copy, copy
    if copy.dtype != np.uint8 and copy.dtype.name != FP8_DTYPES[kind]:
        raise TypeError(f"{name}: dtype {copy.dtype.name} does not hold kv_cache_dtype={kind!r}; expected uint8 "
                        f"storage or {FP8_DTYPES[kind]}")
    return copy, copy.view(np.uint8)


def rope_and_cache_reference(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, *, kv_layout: str = "nhd",
                             kv_cache_dtype: str = "auto", k_scale=None, v_scale=None, interleaved: bool = False,
                             rotary_dim: int | None = None):
    """``(q_out, k_out, k_cache, v_cache)`` after :func:`rope_rtc.ops.kv_cache.rope_and_cache`, bit for
    bit, on host arrays (new arrays; the inputs are not modified). ``positions``: one absolute
    position per token; caches as the API takes them (uint8 for FP8), or FP8 caches typed as
    ``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2`` (the format ``kv_cache_dtype`` names), returned
    with the same dtype and the same bytes as uint8 storage would hold."""
    if kv_cache_dtype != "auto" and kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of 'auto', {', '.join(map(repr, FP8_DTYPES))}, got "
                         f"{kv_cache_dtype!r}")
    kc, k_entries = _cache_copy(k_cache, "k_cache", kv_cache_dtype)
    vc, v_entries = _cache_copy(v_cache, "v_cache", kv_cache_dtype)
    q_out = rope_kernel_arithmetic(q, cos, sin, positions, interleaved=interleaved, rotary_dim=rotary_dim)
    k_out = rope_kernel_arithmetic(k, cos, sin, positions, interleaved=interleaved, rotary_dim=rotary_dim)
    block_size = kc.shape[1] if kv_layout == "nhd" else kc.shape[2]
    num_slots = kc.shape[0] * block_size
    for t, slot in enumerate(np.asarray(slot_mapping).astype(np.int64).reshape(-1)):
        if slot < 0 or slot >= num_slots:
            continue
        blk, off = divmod(int(slot), block_size)
        for cache, values, scale in ((k_entries, k_out[t], k_scale), (v_entries, np.asarray(v)[t], v_scale)):
            entry = values if kv_cache_dtype == "auto" else fp8_quantize(values, scale, kv_cache_dtype)
            if kv_layout == "nhd":
                cache[blk, off] = entry
            else:
                cache[blk, :, off] = entry
    return q_out, k_out, kc, vc


# --------------------------------------------------------------------------------------------
# Multimodal RoPE (MRoPE): three position streams, one per section of the frequencies
# --------------------------------------------------------------------------------------------


def mrope_streams(mrope_section, rotary_dim: int, *, interleaved_sections: bool = False) -> np.ndarray:
    """The position stream (0: temporal, 1: height, 2: width) of each frequency (pair) index.

    ``mrope_section = [t, h, w]`` sums to ``rotary_dim / 2``. Contiguous sections (Qwen2-VL,
    Qwen2.5-VL): the first ``t`` frequencies take the temporal position, the next ``h`` the
    height, the last ``w`` the width. Interleaved (Qwen3-VL): T, H, W, T, H, W, ... with the
    remainder to T, that is index i takes H when ``i % 3 == 1`` and ``i < 3 h``, W when
    ``i % 3 == 2`` and ``i < 3 w``, T otherwise. As in transformers, a height or width section
    larger than the pattern has room for (``len(range(1, R/2, 3))`` and ``len(range(2, R/2, 3))``
    pairs) is not refused: its excess pairs take T.
    """
    sec = (list(mrope_section) if isinstance(mrope_section, (list, tuple))
           or isinstance(mrope_section, np.ndarray) and mrope_section.ndim == 1 else None)
    if sec is None or len(sec) != 3 or any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))
                                            or v < 0 for v in sec):
        raise TypeError(f"mrope_section: expected three non-negative ints [t, h, w], got {mrope_section!r}")
    t, h, w = (int(v) for v in sec)  # Python ints: a NumPy sum can wrap
    half = int(rotary_dim) // 2
    if t + h + w != half:
        raise ValueError(f"mrope_section: {[t, h, w]} sums to {t + h + w}; it must sum to rotary_dim / 2 = {half}")
    i = np.arange(half)
    if not interleaved_sections:
        return np.where(i < t, 0, np.where(i < t + h, 1, 2))
    return np.where((i % 3 == 1) & (i < 3 * h), 1, np.where((i % 3 == 2) & (i < 3 * w), 2, 0))


def mrope_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray, mrope_section, *,
                    interleaved_sections: bool = False, rotary_dim: int | None = None) -> np.ndarray:
    """Multimodal RoPE in float64 (half-split pairs, the window at channel 0): pair i of token n
    uses table row ``positions[stream(i), n]`` (:func:`mrope_streams`). ``x`` is ``[N, H, D]``,
    ``positions`` ``[3, N]``, the tables ``[P, R/2]`` float32. With three equal streams this is
    :func:`rope_reference`."""
    x = np.asarray(x)
    _float_dtype(x.dtype, "x")
    if x.ndim != 3:
        raise ValueError(f"x must have shape [N, H, D], got {x.shape}")
    n, _, d = x.shape
    r, _ = _rotary_span(d, rotary_dim, 0)
    positions = np.asarray(positions)
    if positions.shape != (3, n) or not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(f"positions must be an integer array of shape [3, N] = (3, {n}), got {positions.dtype} "
                         f"{positions.shape}")
    cos, sin = np.asarray(cos), np.asarray(sin)
    if cos.dtype != np.float32 or sin.dtype != np.float32 or cos.shape != sin.shape or cos.shape[-1] != r // 2:
        raise ValueError(f"cos and sin must be float32 [P, {r // 2}], got {cos.dtype} {cos.shape} and {sin.dtype} "
                         f"{sin.shape}")
    stream = mrope_streams(mrope_section, r, interleaved_sections=interleaved_sections)
    rows = positions[stream, :].T  # [N, R/2]: the row each pair of each token reads
    valid = (rows >= 0) & (rows < cos.shape[0])
    safe = np.where(valid, rows, 0)
    cols = np.arange(r // 2)[None, :]
    c = np.where(valid, cos[safe, cols].astype(np.float64), np.nan)[:, None, :]
    s = np.where(valid, sin[safe, cols].astype(np.float64), np.nan)[:, None, :]
    out = x.astype(np.float64)
    x0, x1 = _split_pairs(out[..., :r], False)
    out[..., :r] = _merge_pairs(x0 * c - x1 * s, x1 * c + x0 * s, False)
    return out


def mrope_kernel_arithmetic(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray, mrope_section,
                            *, interleaved_sections: bool = False, rotary_dim: int | None = None) -> np.ndarray:
    """What the GPU's multimodal RoPE computes, bit for bit (positions inside the table): the
    arithmetic of :func:`rope_kernel_arithmetic` with pair i of token n taking its cos/sin from
    row ``positions[stream(i), n]`` (:func:`mrope_streams`). ``x`` is ``[N, H, D]``, ``positions``
    ``[3, N]``."""
    x = np.asarray(x)
    r, _ = _rotary_span(x.shape[-1], rotary_dim, 0)
    stream = mrope_streams(mrope_section, r, interleaved_sections=interleaved_sections)
    rows = np.asarray(positions).astype(np.int64)[stream, :].T  # [N, R/2]
    cols = np.arange(r // 2)[None, :]
    per_token_cos = np.asarray(cos, np.float32)[rows, cols]  # one table row per token
    per_token_sin = np.asarray(sin, np.float32)[rows, cols]
    return rope_kernel_arithmetic(x, per_token_cos, per_token_sin, np.arange(x.shape[0]), interleaved=False,
                                  rotary_dim=rotary_dim)


# --------------------------------------------------------------------------------------------
# Per-head RMSNorm fused with RoPE (QK-norm)

def qk_norm_reference(x: np.ndarray, weight: np.ndarray, *, eps: float) -> np.ndarray:
    """Each head of ``x`` (``[N, H, D]``) normalised by its root mean square and scaled by
    ``weight`` (``[D]``), in float64: ``x / sqrt(mean(x^2) + eps) * weight``."""
    x = np.asarray(x)
    xf = _bf16_to_f32(x).astype(np.float64) if x.dtype == BFLOAT16 else x.astype(np.float64)
    w = np.asarray(weight)
    wf = _bf16_to_f32(w).astype(np.float64) if w.dtype == BFLOAT16 else w.astype(np.float64)
    ms = np.mean(xf * xf, axis=-1, keepdims=True)
    return xf / np.sqrt(ms + float(np.float32(eps))) * wf


def qk_norm_rope_reference(x: np.ndarray, weight: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                           positions: np.ndarray, *, eps: float, interleaved: bool, rotary_dim: int | None = None,
                           rotary_offset: int = 0, inverse: bool = False) -> np.ndarray:
    """What :func:`rope_rtc.apply_qk_norm_rope` computes, in float64: :func:`qk_norm_reference`,
    then :func:`rope_reference` of the result (channels outside the window normalised only)."""
    return rope_reference(qk_norm_reference(x, weight, eps=eps), cos, sin, positions, interleaved=interleaved,
                          rotary_dim=rotary_dim, rotary_offset=rotary_offset, inverse=inverse)


def _round_f32_to(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float32 values rounded to ``dtype`` (to nearest even) and widened back to float32 exactly:
    the kernel's ``round_to_dtype``."""
    if dtype == np.float32:
        return values
    if dtype == np.float16:
        return values.astype(np.float16).astype(np.float32)
    return _bf16_to_f32(bf16_rne(np.ascontiguousarray(values, dtype=np.float32)))


def _as_f32(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values)
    return _bf16_to_f32(v) if v.dtype == BFLOAT16 else v.astype(np.float32)


def qk_norm_rope_transformers_reference(x: np.ndarray, weight: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                                        positions: np.ndarray, *, eps: float, interleaved: bool,
                                        rotary_dim: int | None = None, rotary_offset: int = 0,
                                        inverse: bool = False) -> np.ndarray:
    """What :func:`rope_rtc.apply_qk_norm_rope` computes with ``numerics="transformers"``, in
    ``x``'s dtype: Hugging Face's ``Qwen3RMSNorm`` on each head of ``x`` (``[N, H, D]``), then
    ``apply_rotary_pos_emb`` in the input dtype, rounded where they round (cuda_src/qk_norm_rope.cu).

    In FP32, with ``rnd`` a rounding to ``x``'s dtype (nearest even): ``r = 1 / sqrt(ss * (1 / D)
    + eps)`` (``ss`` the head's sum of squares), ``y = rnd(w * rnd(x * r))``; each pair then
    ``rnd(rnd(y0 * c) + rnd(-y1 * s))`` and ``rnd(rnd(y1 * c) + rnd(y0 * s))`` with ``c`` and ``s``
    the table entries rounded to the dtype (``-s`` with ``inverse``); channels outside the window
    are ``y``. ``ss`` and ``r`` are correctly rounded here; the kernel sums in its own order and
    takes ``rsqrtf``, so their last FP32 bit can differ, and an output with it by one ulp of its
    dtype. ``positions`` ``[N]`` lie inside the tables.
    """
    x = np.asarray(x)
    dt = _float_dtype(x.dtype, "x")
    if x.ndim != 3:
        raise ValueError(f"x must have shape [N, H, D], got {x.shape}")
    d = x.shape[-1]
    r, ro = _rotary_span(d, rotary_dim, rotary_offset)
    xf = _as_f32(x)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        ss = np.sum(np.square(xf.astype(np.float64)), axis=-1, keepdims=True).astype(np.float32)
        var = ss * (np.float32(1) / np.float32(d))
        scale = (1.0 / np.sqrt((var + np.float32(eps)).astype(np.float64))).astype(np.float32)
        y = _round_f32_to(_as_f32(weight) * _round_f32_to(xf * scale, dt), dt)
        pos = np.asarray(positions).astype(np.int64).reshape(-1)
        c = _round_f32_to(np.asarray(cos, np.float32)[pos], dt)[:, None, :]
        s = _round_f32_to(np.asarray(sin, np.float32)[pos], dt)[:, None, :]
        if inverse:
            s = -s
        y0, y1 = _split_pairs(y[..., ro:ro + r], interleaved)
        re = _round_f32_to(_round_f32_to(y0 * c, dt) + _round_f32_to(-y1 * s, dt), dt)
        im = _round_f32_to(_round_f32_to(y1 * c, dt) + _round_f32_to(y0 * s, dt), dt)
    out = y.copy()
    out[..., ro:ro + r] = _merge_pairs(re, im, interleaved)
    return bf16_rne(out) if dt == BFLOAT16 else out.astype(dt)  # every value is the dtype's: exact


# The FP32 error of the norm relative to the normalised value: the mean square (a sum of D
# squares) and the scaling add at most (D / 2 + 4) float32 roundings' worth.
def qk_norm_error_bound(normalized: np.ndarray, out_dtype, result: np.ndarray, *, interleaved: bool,
                        rotary_dim: int | None = None, rotary_offset: int = 0) -> np.ndarray:
    """How far a correct ``numerics="exact"`` output may be from :func:`qk_norm_rope_reference`.

    ``normalized``: :func:`qk_norm_reference` of the input (float64, ``[N, H, D]``). Each output
    element may be off by ``(2^-22 + (D / 2 + 4) * 2^-24) * m``, with ``m`` the ``|y0| + |y1|``
    of its pair (``|y|`` outside the window), plus one output-dtype ulp of ``result`` for
    float16 and bfloat16 outputs (their one rounding)."""
    dt = _float_dtype(out_dtype, "out_dtype")
    y = np.abs(np.asarray(normalized, dtype=np.float64))
    d = y.shape[-1]
    r, ro = _rotary_span(d, rotary_dim, rotary_offset)
    mag = y.copy()
    y0, y1 = _split_pairs(y[..., ro:ro + r], interleaved)
    mag[..., ro:ro + r] = _merge_pairs(y0 + y1, y0 + y1, interleaved)
    bound = (_FP32_PAIR_REL_BOUND + (d / 2 + 4) * 2.0**-24) * mag
    if dt in _ROUNDED_OUTPUTS:
        bound = bound + _ulp(result, dt)
    return bound
