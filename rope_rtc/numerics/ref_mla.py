"""DeepSeek-style MLA (rope_rtc.ops.mla): RoPE on q's rotary part and k_pe, the latent cache row
``[kv_c | rotated k_pe]``, and their FP8 bytes, bit for bit."""

from __future__ import annotations

import numpy as np

from .cache_options import check_cache_dtype, check_scale_given
from .ref_cache import _cache_copy, fp8_quantize
from .ref_rope import rope_kernel_arithmetic


def mla_rope_and_cache_reference(q, k_pe, kv_c, cos, sin, positions, slot_mapping, kv_cache, *,
                                 kv_cache_dtype: str = "auto", kv_scale=None, q_fp8_scale=None,
                                 q_fp8_dtype: str = "fp8_e4m3", interleaved: bool = True):
    """``(q_out, k_pe_out, kv_cache, q_fp8)`` after :func:`rope_rtc.mla_rope_and_cache`, bit for bit,
    on host arrays (new arrays; the inputs are not modified).

    q ``[T, H, nope + R]`` (its last R channels rotated, the rest as they are), k_pe ``[T, R]`` or
    ``[T, 1, R]`` (returned in its shape), kv_c ``[T, L]``, cos/sin ``[rows, R / 2]``, one absolute
    position and one slot per token (a negative slot, or one past the cache, writes no row). The
    cache ``[num_blocks, block_size, L + R]`` is q's dtype, or FP8 as uint8 storage (or typed as the
    ``ml_dtypes`` format ``kv_cache_dtype`` names, returned with that dtype). ``q_fp8``: with
    ``q_fp8_scale``, the rotated q's FP8 bytes (uint8) in ``q_fp8_dtype``; else None. FP8 bytes are
    :func:`fp8_quantize` of the values as rounded to q's dtype."""
    check_cache_dtype(kv_cache_dtype)
    check_scale_given(kv_cache_dtype, kv_scale, "kv_scale")
    q, k_pe, kv_c = np.asarray(q), np.asarray(k_pe), np.asarray(kv_c)
    R = k_pe.shape[-1]
    nope = q.shape[-1] - R
    cache, entries = _cache_copy(kv_cache, "kv_cache", kv_cache_dtype)
    q_out = q.copy()
    q_out[..., nope:] = rope_kernel_arithmetic(q[..., nope:], cos, sin, positions, interleaved=interleaved)
    k = k_pe.reshape(k_pe.shape[0], 1, R)
    k_out = rope_kernel_arithmetic(k, cos, sin, positions, interleaved=interleaved)[:, 0]
    slots = np.asarray(slot_mapping).astype(np.int64).reshape(-1)
    block_size = cache.shape[1]
    written = np.flatnonzero((slots >= 0) & (slots < cache.shape[0] * block_size))
    if written.size:
        rows = np.concatenate([kv_c[written], k_out[written]], axis=-1)
        if kv_cache_dtype != "auto":
            rows = fp8_quantize(rows, kv_scale, kv_cache_dtype)
        blk, off = np.divmod(slots[written], block_size)
        entries[blk, off] = rows
    q_fp8 = None if q_fp8_scale is None else fp8_quantize(q_out, q_fp8_scale, q_fp8_dtype)
    return q_out, k_out.reshape(k_pe.shape), cache, q_fp8
