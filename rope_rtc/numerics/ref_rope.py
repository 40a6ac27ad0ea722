"""General RoPE: the float64 reference, the error bound a correct FP32, FP16 or BF16 result
meets, the whole-tensor check that applies it, and the general kernels' arithmetic bit for bit."""

from __future__ import annotations

import numpy as np

from .rounding import (BFLOAT16, ROUNDED_OUTPUTS, bf16_rne, bf16_to_f32, float_dtype, fma_f32, largest_finite,
                       mul_f32, same_bits, ulp)


# Two rounded products and one rounded sum, each off by at most 2^-24 of its magnitude, give
# about 2^-23 * (|x0| + |x1|) when |cos|, |sin| <= 1; 2^-22 leaves a factor of two of margin.
FP32_PAIR_REL_BOUND = 2.0**-22


def rotary_span(d: int, rotary_dim: int | None, rotary_offset: int) -> tuple[int, int]:
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


def split_pairs(rot: np.ndarray, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """(x0, x1) views of the rotated channels: adjacent pairs or the two halves."""
    if interleaved:
        return rot[..., 0::2], rot[..., 1::2]
    half = rot.shape[-1] // 2
    return rot[..., :half], rot[..., half:]


def merge_pairs(p0: np.ndarray, p1: np.ndarray, interleaved: bool) -> np.ndarray:
    """Inverse of :func:`split_pairs`: lay per-pair values back out as channels."""
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
    float_dtype(x.dtype, "x")
    if x.ndim != 3:
        raise ValueError(f"x must have shape [N, H, D], got {x.shape}")
    n, _, d = x.shape
    r, ro = rotary_span(d, rotary_dim, rotary_offset)
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
    x0, x1 = split_pairs(out[..., ro : ro + r], interleaved)
    o0 = x0 * c - x1 * s
    o1 = x1 * c + x0 * s
    out[..., ro : ro + r] = merge_pairs(o0, o1, interleaved)
    return out


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
    dt = float_dtype(out_dtype, "out_dtype")
    bound = FP32_PAIR_REL_BOUND * np.asarray(x_pairs_abs_sum, dtype=np.float64)
    if dt in ROUNDED_OUTPUTS:
        bound = bound + ulp(result, dt)
    return bound


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
    out_dtype = float_dtype(actual.dtype if dtype is None else dtype, "dtype")
    float_dtype(x.dtype, "x")
    d = x.shape[-1]
    r, ro = rotary_span(d, rotary_dim, rotary_offset)
    shape = x.shape

    act2 = actual.reshape(-1, d)
    exp2 = expected64.reshape(-1, d)
    x2 = x.reshape(-1, d)
    rows = act2.shape[0]
    chunk = max(1, (1 << 21) // d)
    max_finite = largest_finite(out_dtype)
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
                same = same_bits(a_c, x_c)
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
        x0, x1 = split_pairs(x2[sl, ro : ro + r].astype(np.float64), interleaved)
        pair_abs = np.abs(x0) + np.abs(x1)
        pair_abs = merge_pairs(pair_abs, pair_abs, interleaved)
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


def rope_kernel_arithmetic(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray, *,
                           interleaved: bool, rotary_dim: int | None = None) -> np.ndarray:
    """What the GPU kernels compute, bit for bit (no NaN positions): each pair in FP32,
    ``re = fmaf(x0, c, -fp32(x1 * s))``, ``im = fmaf(x1, c, fp32(x0 * s))``, rounded once to
    ``x``'s dtype (to nearest even). ``x`` is ``[T, H, D]``; the window starts at channel 0."""
    x = np.asarray(x)
    dt = x.dtype
    r, _ = rotary_span(x.shape[-1], rotary_dim, 0)
    xf = bf16_to_f32(x) if dt == BFLOAT16 else x.astype(np.float32)
    pos = np.asarray(positions).astype(np.int64).reshape(-1)
    c = np.asarray(cos, np.float32)[pos][:, None, :]
    s = np.asarray(sin, np.float32)[pos][:, None, :]
    x0, x1 = split_pairs(xf[..., :r], interleaved)
    c, s = np.broadcast_to(c, x0.shape), np.broadcast_to(s, x0.shape)
    re = fma_f32(x0, c, -mul_f32(x1, s))
    im = fma_f32(x1, c, mul_f32(x0, s))
    rot = merge_pairs(re, im, interleaved)
    out = x.copy()
    if dt == BFLOAT16:
        out[..., :r] = bf16_rne(np.ascontiguousarray(rot))
    else:
        out[..., :r] = rot.astype(dt)
    return out
