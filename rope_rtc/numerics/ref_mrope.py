"""Multimodal RoPE (MRoPE): 2, 3 or 4 position streams, one per section of the frequencies."""

from __future__ import annotations

import numpy as np

from .ref_rope import merge_pairs, rope_kernel_arithmetic, rotary_span, split_pairs
from .rounding import float_dtype


#: Position streams multimodal RoPE takes: 2 (axial RoPE of vision towers: height, width), 3
#: (Qwen2-VL, Qwen3-VL: temporal, height, width) or 4.
MROPE_STREAM_COUNTS = (2, 3, 4)


def mrope_sections(mrope_section) -> tuple[int, ...]:
    """``mrope_section`` as a tuple of Python ints, one per position stream; ``TypeError`` naming it
    unless it is 2, 3 or 4 non-negative ints (a list, tuple or one-dimensional NumPy array)."""
    sec = (list(mrope_section) if isinstance(mrope_section, (list, tuple))
           or isinstance(mrope_section, np.ndarray) and mrope_section.ndim == 1 else None)
    if (sec is None or len(sec) not in MROPE_STREAM_COUNTS
            or any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0 for v in sec)):
        raise TypeError(f"mrope_section: expected 2, 3 or 4 non-negative ints, one per position stream (Qwen2-VL's "
                        f"[t, h, w], a vision tower's [h, w]), got {mrope_section!r}")
    return tuple(int(v) for v in sec)  # Python ints: a NumPy sum can wrap


def mrope_streams(mrope_section, rotary_dim: int, *, interleaved_sections: bool = False) -> np.ndarray:
    """The position stream (0 .. n-1; for three: temporal, height, width) of each frequency (pair)
    index, for ``n = len(mrope_section)`` streams (2, 3 or 4).

    ``mrope_section`` sums to ``rotary_dim / 2``. Contiguous sections (Qwen2-VL, Qwen2.5-VL, the
    vision towers' axial RoPE): the first ``s0`` frequencies take stream 0, the next ``s1`` stream
    1, and so on. Interleaved (Qwen3-VL): the streams cycle 0, 1, .., n-1, 0, 1, ... with the
    remainder to stream 0, that is index i takes stream ``k = i % n`` when ``k > 0`` and
    ``i < n * s_k``, stream 0 otherwise (for three streams: H when ``i % 3 == 1`` and ``i < 3 h``,
    W when ``i % 3 == 2`` and ``i < 3 w``). As in transformers, a later section larger than the
    pattern has room for (``len(range(k, R/2, n))`` pairs) is not refused: its excess pairs take
    stream 0.
    """
    sec = mrope_sections(mrope_section)
    half = int(rotary_dim) // 2
    if sum(sec) != half:
        raise ValueError(f"mrope_section: {list(sec)} sums to {sum(sec)}; it must sum to rotary_dim / 2 = {half}")
    i = np.arange(half)
    n = len(sec)
    if not interleaved_sections:
        return np.searchsorted(np.cumsum(sec), i, side="right")
    k = i % n
    return np.where((k > 0) & (i < n * np.asarray(sec)[k]), k, 0)


def mrope_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray, mrope_section, *,
                    interleaved_sections: bool = False, rotary_dim: int | None = None) -> np.ndarray:
    """Multimodal RoPE in float64 (half-split pairs, the window at channel 0): pair i of token n
    uses table row ``positions[stream(i), n]`` (:func:`mrope_streams`). ``x`` is ``[N, H, D]``,
    ``positions`` ``[len(mrope_section), N]``, the tables ``[P, R/2]`` float32. With equal streams
    this is :func:`rope_reference`."""
    x = np.asarray(x)
    float_dtype(x.dtype, "x")
    if x.ndim != 3:
        raise ValueError(f"x must have shape [N, H, D], got {x.shape}")
    n, _, d = x.shape
    r, _ = rotary_span(d, rotary_dim, 0)
    streams = len(mrope_sections(mrope_section))
    positions = np.asarray(positions)
    if positions.shape != (streams, n) or not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(f"positions must be an integer array of shape [len(mrope_section), N] = ({streams}, {n}), "
                         f"got {positions.dtype} {positions.shape}")
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
    x0, x1 = split_pairs(out[..., :r], False)
    out[..., :r] = merge_pairs(x0 * c - x1 * s, x1 * c + x0 * s, False)
    return out


def mrope_kernel_arithmetic(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray, mrope_section,
                            *, interleaved_sections: bool = False, rotary_dim: int | None = None) -> np.ndarray:
    """What the GPU's multimodal RoPE computes, bit for bit (positions inside the table): the
    arithmetic of :func:`rope_kernel_arithmetic` with pair i of token n taking its cos/sin from
    row ``positions[stream(i), n]`` (:func:`mrope_streams`). ``x`` is ``[N, H, D]``, ``positions``
    ``[len(mrope_section), N]``."""
    x = np.asarray(x)
    r, _ = rotary_span(x.shape[-1], rotary_dim, 0)
    stream = mrope_streams(mrope_section, r, interleaved_sections=interleaved_sections)
    rows = np.asarray(positions).astype(np.int64)[stream, :].T  # [N, R/2]
    cols = np.arange(r // 2)[None, :]
    per_token_cos = np.asarray(cos, np.float32)[rows, cols]  # one table row per token
    per_token_sin = np.asarray(sin, np.float32)[rows, cols]
    return rope_kernel_arithmetic(x, per_token_cos, per_token_sin, np.arange(x.shape[0]), interleaved=False,
                                  rotary_dim=rotary_dim)
