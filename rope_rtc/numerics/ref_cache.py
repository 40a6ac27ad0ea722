"""RoPE fused with the paged KV-cache write: the cache write's arithmetic and its FP8 bytes."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .cache_options import FP8_DTYPES, check_cache_options, check_scale_given
from .ref_rope import rope_kernel_arithmetic
from .rounding import BFLOAT16, bf16_to_f32


# Largest finite value of each FP8 format (what __NV_SATFINITE saturates to).
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def fp8_quantize(values: np.ndarray, scale, kind: str) -> np.ndarray:
    """FP8 cache entries (as uint8) of ``values`` (in the input dtype): ``value / scale`` in FP32,
    saturated to the format's finite range, rounded to nearest even (``kind``: ``"fp8_e4m3"``
    for e4m3fn or ``"fp8_e5m2"``)."""
    v = np.asarray(values)
    vf = bf16_to_f32(v) if v.dtype == BFLOAT16 else v.astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # a zero scale, inf and NaN are legitimate
        q = np.clip(vf / np.float32(scale), -FP8_MAX[kind], FP8_MAX[kind])
    fmt = ml_dtypes.float8_e4m3fn if kind == "fp8_e4m3" else ml_dtypes.float8_e5m2
    return q.astype(fmt).view(np.uint8)


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
    check_cache_options(kv_layout, kv_cache_dtype)
    check_scale_given(kv_cache_dtype, k_scale, "k_scale")
    check_scale_given(kv_cache_dtype, v_scale, "v_scale")
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
