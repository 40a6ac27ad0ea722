"""The JAX functions written in ``jax.numpy``: what they run where no kernel can (no GPU, a CPU
device, ``backend="jnp"``), and the same contracts as the kernels.

Numerics (docs/design.md, "Numerical contracts"): each pair is converted to FP32, rotated as
``o0 = x0*c - x1*s``, ``o1 = x1*c + x0*s`` in FP32 and rounded once to the input dtype; channels
outside the window are the input's. XLA may contract a product and a sum into one FMA, as the
kernels do, so results agree within the general RoPE bound (not bit for bit). A position outside
the table gives NaN for its token, as on the GPU. The cache write stores the rotated k as
rounded and v as given, or their FP8 encodings: ``value / scale`` in FP32, saturated to the
format's largest finite value, rounded to nearest even (``rope_rtc.reference.fp8_quantize``).

Everything here is differentiable by JAX itself, in every mode: where it runs alone
(``backend="jnp"``, or no usable GPU) JAX does so; where a kernel may run instead, the public
functions give it the inverse rotation as its backward (``rope_rtc.jax.ops``).
"""

from __future__ import annotations

from .checks import CacheCall, RopeCall

# Largest finite value of each FP8 format (what the kernels' saturating conversion stops at).
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def batch_and_sequence(shape: tuple, layout: str) -> tuple[int, int]:
    """(B, S) of an array of ``layout``; ``thd`` is one sequence of T tokens."""
    return {"bshd": (shape[0], shape[1]), "bhsd": (shape[0], shape[2]), "sbhd": (shape[1], shape[0]),
            "thd": (1, shape[0])}[layout]


def token_positions(call: RopeCall, B: int, S: int, positions, offsets, cu_seqlens):
    """The position of every token, ``[B, S]``, by the call's scheme (as
    ``rope_rtc.core.backends.token_positions``): given positions; ``offset + s`` with a scalar
    or per-sequence offset; or, with ``cu_seqlens``, the index within each packed sequence plus
    that sequence's offset. In the index arrays' own integer type: int64 ones (under
    ``jax_enable_x64``) are not cut to 32 bits, so a position past 2^31 stays outside the table,
    as the kernels read it."""
    import jax.numpy as jnp

    if positions is not None:
        return positions.reshape(B, S)
    s = jnp.arange(S, dtype=jnp.int32)
    if cu_seqlens is not None:
        seq = jnp.clip(jnp.searchsorted(cu_seqlens, s, side="right") - 1, 0, cu_seqlens.shape[0] - 2)
        base = offsets[seq] if offsets is not None else call.offset
        return (s - cu_seqlens[seq] + base).reshape(1, S)
    if offsets is not None:
        return offsets[:, None] + s[None, :]
    return jnp.broadcast_to(call.offset + s, (B, S))


def table_rows(table, positions):
    """``table[positions]`` (float32), NaN where a position lies outside the table: the kernels
    give NaN there, and reading past the table is never done."""
    import jax.numpy as jnp

    rows = table.shape[0]
    if rows == 0:  # every position is outside (jnp.take refuses an empty axis)
        return jnp.full(positions.shape + table.shape[1:], jnp.nan, jnp.float32)
    inside = (positions >= 0) & (positions < rows)
    # jnp's "fill" mode wraps negative indices first: send every outside position past the end.
    index = jnp.where(inside, positions, rows)
    return jnp.take(table, index, axis=0, mode="fill", fill_value=jnp.nan)


def cos_and_sin(call: RopeCall, tables: tuple):
    """(cos, sin): the two tables, or the halves of the combined ``cos_sin_cache``."""
    if not call.combined:
        return tables
    half = tables[0].shape[1] // 2
    return tables[0][:, :half], tables[0][:, half:]


def _per_token(rows, layout: str):
    """Rows ``[B, S, R/2]`` broadcastable against an array of ``layout`` (its heads share them)."""
    if layout == "bshd":
        return rows[:, :, None, :]
    if layout == "bhsd":
        return rows[:, None, :, :]
    if layout == "sbhd":
        return rows.transpose(1, 0, 2)[:, :, None, :]
    return rows.reshape(-1, rows.shape[-1])[:, None, :]  # thd: [T, 1, R/2]


def rotate(x, c, s, *, interleaved: bool, rotary_dim: int, rotary_offset: int, inverse: bool):
    """``x`` with its window rotated by per-token ``c``, ``s`` (float32, broadcastable against
    the pairs), in FP32, rounded once to ``x``'s dtype; the other channels are ``x``'s."""
    import jax.numpy as jnp

    lo, hi = rotary_offset, rotary_offset + rotary_dim
    window = x[..., lo:hi].astype(jnp.float32)
    if interleaved:
        x0, x1 = window[..., 0::2], window[..., 1::2]
    else:
        x0, x1 = window[..., : rotary_dim // 2], window[..., rotary_dim // 2:]
    if inverse:
        s = -s
    o0 = x0 * c - x1 * s
    o1 = x1 * c + x0 * s
    if interleaved:
        rot = jnp.stack([o0, o1], axis=-1).reshape(window.shape)
    else:
        rot = jnp.concatenate([o0, o1], axis=-1)
    rot = rot.astype(x.dtype)
    if lo == 0 and hi == x.shape[-1]:
        return rot
    return jnp.concatenate([x[..., :lo], rot, x[..., hi:]], axis=-1)


def rope(call: RopeCall, q, k, tables: tuple, index: tuple):
    """``(q, k)`` rotated (``k`` None for ``apply_rope``)."""
    B, S = batch_and_sequence(q.shape, call.layout)
    pos = token_positions(call, B, S, *index)
    cos, sin = cos_and_sin(call, tables)
    c = _per_token(table_rows(cos, pos), call.layout)
    s = _per_token(table_rows(sin, pos), call.layout)
    opts = dict(interleaved=call.interleaved, rotary_dim=call.rotary_dim, rotary_offset=call.rotary_offset,
                inverse=call.inverse)
    return rotate(q, c, s, **opts), (None if k is None else rotate(k, c, s, **opts))


def fp8_encode(values, scale, kind: str):
    """FP8 cache entries (uint8) of ``values``: ``value / scale`` in FP32, saturated to the
    format's finite range, rounded to nearest even."""
    import jax
    import jax.numpy as jnp

    fmt = jnp.float8_e4m3fn if kind == "fp8_e4m3" else jnp.float8_e5m2
    scaled = jnp.clip(values.astype(jnp.float32) / scale.reshape(()), -FP8_MAX[kind], FP8_MAX[kind])
    return jax.lax.bitcast_convert_type(scaled.astype(fmt), jnp.uint8)


def slot_index(call: CacheCall, slots, cache_shape: tuple):
    """``(block, offset)`` of each token's slot; a slot outside the cache (negative: skipped by
    the caller's choice; past the end: skipped by the kernel) gets a block past the last, which
    ``mode="drop"`` writes nowhere and ``mode="fill"`` reads as zeros."""
    import jax.numpy as jnp

    blocks = cache_shape[0]
    block_size = cache_shape[1] if call.kv_layout == "nhd" else cache_shape[2]
    # In their own integer type: an int64 slot past 2^31 (jax_enable_x64) stays past the cache.
    inside = (slots >= 0) & (slots < blocks * block_size)
    return jnp.where(inside, slots // block_size, blocks), jnp.where(inside, slots % block_size, 0)


def at_slots(call: CacheCall, cache, block, offset):
    """The ``.at[...]`` of the cache entries of the tokens' slots (``[T, H, D]`` either layout)."""
    return cache.at[block, offset] if call.kv_layout == "nhd" else cache.at[block, :, offset]


def rope_and_cache(call: CacheCall, q, k, v, tables: tuple, index: tuple, slots, caches: tuple, scales: tuple):
    """``(q, k, k_cache, v_cache)`` after the fused RoPE and cache write."""
    q_rot, k_rot = rope(call.rope, q, k, tables, index)
    k_entries, v_entries = k_rot, v
    if call.kv_cache_dtype != "auto":
        k_entries = fp8_encode(k_rot, scales[0], call.kv_cache_dtype)
        v_entries = fp8_encode(v, scales[1], call.kv_cache_dtype)
    block, offset = slot_index(call, slots, caches[0].shape)
    k_cache = at_slots(call, caches[0], block, offset).set(k_entries, mode="drop")
    v_cache = at_slots(call, caches[1], block, offset).set(v_entries, mode="drop")
    return q_rot, k_rot, k_cache, v_cache
