"""Per-head RMSNorm fused with RoPE (QK-norm): in float64, with the transformers numerics'
roundings, and the error bound of the fused kernel."""

from __future__ import annotations

import numpy as np

from .ref_rope import FP32_PAIR_REL_BOUND, merge_pairs, rope_reference, rotary_span, split_pairs
from .rounding import BFLOAT16, ROUNDED_OUTPUTS, as_f32, bf16_rne, bf16_to_f32, float_dtype, round_f32_to, ulp


def qk_norm_reference(x: np.ndarray, weight: np.ndarray, *, eps: float) -> np.ndarray:
    """Each head of ``x`` (``[N, H, D]``) normalised by its root mean square and scaled by
    ``weight`` (``[D]``), in float64: ``x / sqrt(mean(x^2) + eps) * weight``."""
    x = np.asarray(x)
    xf = bf16_to_f32(x).astype(np.float64) if x.dtype == BFLOAT16 else x.astype(np.float64)
    w = np.asarray(weight)
    wf = bf16_to_f32(w).astype(np.float64) if w.dtype == BFLOAT16 else w.astype(np.float64)
    ms = np.mean(xf * xf, axis=-1, keepdims=True)
    return xf / np.sqrt(ms + float(np.float32(eps))) * wf


def qk_norm_rope_reference(x: np.ndarray, weight: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                           positions: np.ndarray, *, eps: float, interleaved: bool, rotary_dim: int | None = None,
                           rotary_offset: int = 0, inverse: bool = False) -> np.ndarray:
    """What :func:`rope_rtc.apply_qk_norm_rope` computes, in float64: :func:`qk_norm_reference`,
    then :func:`rope_reference` of the result (channels outside the window normalised only)."""
    return rope_reference(qk_norm_reference(x, weight, eps=eps), cos, sin, positions, interleaved=interleaved,
                          rotary_dim=rotary_dim, rotary_offset=rotary_offset, inverse=inverse)


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
    takes ``rsqrtf``, so their last FP32 bit can differ, a normalised value with it by one ulp of
    its dtype, and a rotated output that cancels by a few. ``positions`` ``[N]`` lie inside the
    tables.
    """
    x = np.asarray(x)
    dt = float_dtype(x.dtype, "x")
    if x.ndim != 3:
        raise ValueError(f"x must have shape [N, H, D], got {x.shape}")
    d = x.shape[-1]
    r, ro = rotary_span(d, rotary_dim, rotary_offset)
    xf = as_f32(x)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        ss = np.sum(np.square(xf.astype(np.float64)), axis=-1, keepdims=True).astype(np.float32)
        var = ss * (np.float32(1) / np.float32(d))
        scale = (1.0 / np.sqrt((var + np.float32(eps)).astype(np.float64))).astype(np.float32)
        y = round_f32_to(as_f32(weight) * round_f32_to(xf * scale, dt), dt)
        pos = np.asarray(positions).astype(np.int64).reshape(-1)
        c = round_f32_to(np.asarray(cos, np.float32)[pos], dt)[:, None, :]
        s = round_f32_to(np.asarray(sin, np.float32)[pos], dt)[:, None, :]
        if inverse:
            s = -s
        y0, y1 = split_pairs(y[..., ro:ro + r], interleaved)
        re = round_f32_to(round_f32_to(y0 * c, dt) + round_f32_to(-y1 * s, dt), dt)
        im = round_f32_to(round_f32_to(y1 * c, dt) + round_f32_to(y0 * s, dt), dt)
    out = y.copy()
    out[..., ro:ro + r] = merge_pairs(re, im, interleaved)
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
    dt = float_dtype(out_dtype, "out_dtype")
    y = np.abs(np.asarray(normalized, dtype=np.float64))
    d = y.shape[-1]
    r, ro = rotary_span(d, rotary_dim, rotary_offset)
    mag = y.copy()
    y0, y1 = split_pairs(y[..., ro:ro + r], interleaved)
    mag[..., ro:ro + r] = merge_pairs(y0 + y1, y0 + y1, interleaved)
    bound = (FP32_PAIR_REL_BOUND + (d / 2 + 4) * 2.0**-24) * mag
    if dt in ROUNDED_OUTPUTS:
        bound = bound + ulp(result, dt)
    return bound
