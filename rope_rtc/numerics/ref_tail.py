"""Tail RoPE (the prepared BF16 tail seed): a bit-exact reference."""

from __future__ import annotations

import numpy as np

from ..build.registry import TAIL_DIMS as TAIL_HEAD_DIMS  # D values the contract allows (named once)

from .rounding import BFLOAT16, bf16_rne, bf16_to_f32, fma_f32, mul_f32




#: Channels rotated by tail RoPE: the last 64 of every head, fixed by the seed's contract.
TAIL_CHANNELS = 64
#: One table column per rotated pair.
TAIL_TABLE_COLUMNS = TAIL_CHANNELS // 2


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
    tail = bf16_to_f32(x[..., start:])
    a = tail[..., 0::2]
    b = tail[..., 1::2]
    if x.ndim == 3:  # one table row per token, shared by its heads
        cosine = cosine[:, None, :]
        sine = sine[:, None, :]
    real = fma_f32(a, cosine, -mul_f32(b, sine))
    imag = fma_f32(b, cosine, mul_f32(a, sine))
    out[..., start::2] = bf16_rne(real)
    out[..., start + 1 :: 2] = bf16_rne(imag)
    return out
