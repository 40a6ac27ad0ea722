"""The DeepSeek-style MLA kernel's specialisations (cuda_src/mla_rope_cache.cu): RoPE on q's rotary
part and k_pe with the latent cache row, its widths and a model's builds (``warm --model``). Beside
the registry, which lists the specialisations the library warms without a model."""

from __future__ import annotations

from .registry import CACHE_KIND_NAMES, DTYPE_CODES, KernelSpec, rope_vector_widths

MLA_ENTRIES = ("mla_rope_cache",)


def mla_vector_widths(dtype: str, interleaved: bool, fp8: bool = False) -> tuple[int, ...]:
    """Elements per access of the MLA kernel, widest first (16-byte vectors where the arrays allow);
    with FP8 entries (cache or q) an even count, since they are converted in pairs."""
    return tuple(w for w in rope_vector_widths(dtype, interleaved) if not fp8 or w % 2 == 0)


def mla_spec(dtype: str, interleaved: bool, vec: int, kind: int, q_fp8: int, heads: int, nope_dim: int,
             rope_dim: int, lora_rank: int) -> KernelSpec:
    """The MLA kernel for one geometry (q heads, q's unrotated and rotated channels, kv_c's
    channels), vector width, cache kind and FP8 q kind (0: none; else a ``CACHE_KIND_NAMES`` code)."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype!r} has no kernel; supported: {sorted(DTYPE_CODES)}")
    for what, value in (("cache kind", kind), ("FP8 q kind", q_fp8)):
        if value not in CACHE_KIND_NAMES:
            raise ValueError(f"{what} {value!r}: expected one of {sorted(CACHE_KIND_NAMES)}")
    return KernelSpec(
        "mla_rope_cache", "mla_rope_cache.cu", MLA_ENTRIES,
        (("ROPE_DTYPE", str(DTYPE_CODES[dtype])), ("ROPE_INTERLEAVED", str(int(interleaved))), ("ROPE_VEC", str(vec)),
         ("CACHE_KIND", str(kind)), ("MLA_QFP8", str(q_fp8)), ("MLA_H", str(heads)), ("MLA_NOPE", str(nope_dim)),
         ("MLA_RD", str(rope_dim)), ("MLA_LORA", str(lora_rank))))


def mla_first_vector(dtype: str, interleaved: bool, fp8: bool, nope_dim: int, rope_dim: int,
                     lora_rank: int) -> int | None:
    """The widest vector of :func:`mla_vector_widths` that tiles q's parts and the cache row (what
    aligned arrays get), or None when none does."""
    span = rope_dim if interleaved else rope_dim // 2
    return next((v for v in mla_vector_widths(dtype, interleaved, fp8)
                 if span % v == 0 and nope_dim % v == 0 and lora_rank % v == 0), None)


def mla_model_specs(dtype: str, interleaved: bool, heads: int, nope_dim: int, rope_dim: int,
                    lora_rank: int) -> list[KernelSpec]:
    """The MLA builds a model's aligned calls launch: the cache in the model's dtype, FP8 e4m3 and
    FP8 e5m2, each without an FP8 q and with one of the cache's format (e4m3 beside the model's
    dtype)."""
    out = []
    for kind in (0, 1, 2):
        for q_fp8 in (0, kind or 1):
            vec = mla_first_vector(dtype, interleaved, bool(kind or q_fp8), nope_dim, rope_dim, lora_rank)
            if vec is not None:
                out.append(mla_spec(dtype, interleaved, vec, kind, q_fp8, heads, nope_dim, rope_dim, lora_rank))
    return out
