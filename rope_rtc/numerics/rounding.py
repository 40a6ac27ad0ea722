"""The floating-point arithmetic the references share: NVIDIA's rounding of FP32, FP16 and BF16
(canonical NaNs included), a correctly rounded FP32 fused multiply-add, and ulps."""

from __future__ import annotations

import ml_dtypes
import numpy as np


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


# The canonical NaN NVIDIA hardware produces: FP32 arithmetic returns 0x7FFFFFFF for any NaN
# result, and cvt.rn.bf16.f32 (what __float2bfloat16_rn compiles to) returns 0x7FFF for any NaN
# input. Emitting the same bits keeps GPU outputs bit-comparable even where a NaN appears.
_CANONICAL_NAN_F32 = np.uint32(0x7FFFFFFF)
_CANONICAL_NAN_BF16 = np.uint16(0x7FFF)


_FORMATS = {
    np.dtype(np.float16): (11, -14),
    BFLOAT16: (8, -126),
    np.dtype(np.float32): (24, -126),
    np.dtype(np.float64): (53, -1022),
}
ROUNDED_OUTPUTS = (np.dtype(np.float16), BFLOAT16)  # dtypes whose rounding adds one ulp


def float_dtype(dtype, what: str) -> np.dtype:
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


def bf16_to_f32(values_bf16: np.ndarray) -> np.ndarray:
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
    dt = float_dtype(dtype, "dtype")
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


def mul_f32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 product rounded once (RNE): exact in float64, then one cast (``__fmul_rn``)."""
    with np.errstate(invalid="ignore", over="ignore"):
        r = np.asarray((a.astype(np.float64) * b.astype(np.float64)).astype(np.float32))
    nan = np.isnan(r)
    if np.any(nan):
        r.view(np.uint32)[nan] = _CANONICAL_NAN_F32
    return r


def ulp(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Spacing of ``dtype`` at each value's magnitude (the subnormal spacing at and near 0)."""
    precision, emin = _FORMATS[dtype]
    v = np.asarray(values, dtype=np.float64)
    _, e = np.frexp(np.where(np.isfinite(v), v, 0.0))  # |v| in [2^(e-1), 2^e)
    exponent = np.where(v == 0, emin, np.maximum(e - 1, emin))
    return np.ldexp(1.0, exponent - (precision - 1))


def largest_finite(dtype: np.dtype) -> float:
    return float(ml_dtypes.finfo(dtype).max)


def same_bits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise bit equality of two arrays of one dtype."""
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return a.view(view) == b.view(view)


def round_f32_to(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float32 values rounded to ``dtype`` (to nearest even) and widened back to float32 exactly:
    the kernel's ``round_to_dtype``."""
    if dtype == np.float32:
        return values
    if dtype == np.float16:
        return values.astype(np.float16).astype(np.float32)
    return bf16_to_f32(bf16_rne(np.ascontiguousarray(values, dtype=np.float32)))


def as_f32(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values)
    return bf16_to_f32(v) if v.dtype == BFLOAT16 else v.astype(np.float32)
