"""The KV-cache ops' options, checked the same way by the ops (``rope_and_cache``,
``mla_rope_and_cache``) and by their NumPy references."""

from __future__ import annotations

# kv_cache_dtype -> CACHE_KIND of the cache kernels (rope_cache.cu, mla_rope_cache.cu; 0: the input dtype)
CACHE_KINDS = {"auto": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}
KV_LAYOUTS = ("nhd", "hnd")
# kv_cache_dtype -> ml_dtypes' name of the format, the dtype of a cache typed as FP8
FP8_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def check_cache_dtype(kv_cache_dtype) -> None:
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in CACHE_KINDS:
        raise ValueError(f"kv_cache_dtype: expected one of {', '.join(map(repr, CACHE_KINDS))}, got {kv_cache_dtype!r}")


def check_cache_options(kv_layout, kv_cache_dtype) -> None:
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected 'nhd' ([blocks, block_size, H_kv, D]) or 'hnd' ([blocks, H_kv, "
                         f"block_size, D]), got {kv_layout!r}")
    check_cache_dtype(kv_cache_dtype)


def check_scale_given(kv_cache_dtype: str, scale, name: str, form: str = "") -> None:
    """A scale for an FP8 cache (TypeError without: float32(None) is NaN, every entry NaN) and
    none for a cache of the input dtype (ValueError). ``form``: what the caller takes as a scale,
    said in the message (the ops: a device array of one element)."""
    if kv_cache_dtype == "auto":
        if scale is not None:
            raise ValueError(f"{name}: only FP8 caches take scales (kv_cache_dtype='auto')")
    elif scale is None:
        raise TypeError(f"{name}: an FP8 cache needs a float32 scale{form} (kv_cache_dtype={kv_cache_dtype!r})")
