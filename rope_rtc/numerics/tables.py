"""cos/sin tables of rotary embeddings, in exact or transformers numerics, from the inverse
frequencies of rope_rtc/numerics/frequencies.py (whose docstring describes the two numerics);
``cos_sin_cache``, the engines' combined table; ``angle_rows``, the rows the ``inv_freq=`` kernel
computes. ``rope_rtc.tables``, the public path, is this module: it names the frequency API too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .frequencies import ROPE_TYPES, _frequencies, inverse_frequencies
from .frequency_checks import (_DEFAULT_BASE, MAX_POSITIONS, MAX_ROTARY_DIM, MAX_TABLE_ENTRIES, NUMERICS, _array_module,
                               _positive_int, _rotary_dim)

__all__ = ["MAX_POSITIONS", "MAX_ROTARY_DIM", "MAX_TABLE_ENTRIES", "NUMERICS", "ROPE_TYPES", "inverse_frequencies",
           "rope_tables"]

# Rows computed per step: bounds the float64 temporaries (a few arrays of this many rows,
# 16 MiB each at rotary_dim 128) whatever `max_positions` is.
_ROWS_PER_CHUNK = 1 << 15


def rope_tables(
    max_positions: int,
    rotary_dim: int,
    *,
    base: float = _DEFAULT_BASE,
    scaling: Mapping | None = None,
    numerics: str = "exact",
    xp: Any = np,
) -> tuple[Any, Any]:
    """cos and sin tables of positions ``0 .. max_positions - 1``, one column per rotary pair.

    ``cos[p, i] = attention_factor * cos(p * inv_freq[i])`` (and likewise ``sin``), where
    ``inv_freq[i] = base ** (-2 i / rotary_dim)`` before scaling.

    Parameters
    ----------
    max_positions : int
        Number of rows (positions). For ``"dynamic"`` and ``"longrope"`` scaling it is also
        the context length that selects the frequencies, as ``max(position_ids) + 1`` does
        in transformers.
    rotary_dim : int
        Number of rotated channels, even. Column i belongs to pair i: channels
        ``(2i, 2i+1)`` in the interleaved layout, ``(i, i + rotary_dim/2)`` in the half-split one.
    base : float, default 10000.0
        RoPE base (theta). ``scaling['rope_theta']``, when present (transformers >= 5 keeps
        it in ``rope_parameters``), takes precedence; a ``base`` other than the default that
        disagrees with it raises ``ValueError``.
    scaling : Mapping or None
        The model's ``rope_scaling`` (or ``rope_parameters``) dict from ``config.json``, as
        it stands: ``rope_type`` (or the legacy ``type``) is one of ``"default"``,
        ``"linear"`` (``factor``), ``"dynamic"`` (``factor``, ``max_position_embeddings``),
        ``"yarn"`` (``factor``,
        ``original_max_position_embeddings``, optional ``beta_fast``, ``beta_slow``,
        ``attention_factor``, ``mscale``, ``mscale_all_dim``, ``truncate``), ``"longrope"``
        (``short_factor``, ``long_factor``, ``original_max_position_embeddings``, optional
        ``factor``, ``attention_factor``) or ``"llama3"`` (``factor``, ``low_freq_factor``,
        ``high_freq_factor``, ``original_max_position_embeddings``); ``"mrope"`` (Qwen2-VL's
        configs) is ``"default"``, as transformers reads it. Where transformers reads a value
        from the model config instead, add it to the dict: a missing
        ``original_max_position_embeddings`` is taken from ``max_position_embeddings`` in the
        dict, and a missing yarn/longrope ``factor`` is derived from it. ``"dynamic"``
        rescales past the model's ``max_position_embeddings``, as transformers (4.x and 5.x)
        does, which ignores ``original_max_position_embeddings`` for it; a dict without
        ``max_position_embeddings`` gives ``original_max_position_embeddings`` that role. A
        field that is needed and absent raises ``ValueError``. ``partial_rotary_factor`` is
        ignored: ``rotary_dim`` is already the rotated width.
    numerics : {"exact", "transformers"}
        ``"exact"`` (default): frequencies, scaling and angles in float64, cos/sin correctly
        rounded to float32 — the most accurate table, and what float64 references assume.
        Choose it unless you must match a Hugging Face model.
        ``"transformers"``: Hugging Face's float32 arithmetic — ``inv_freq`` computed in
        float32 as its initialisation functions do, angles ``float32(p) * inv_freq`` rounded
        to float32, then cos/sin (correctly rounded) times the attention factor in float32.
        Models were trained with these values, and comparing logits with transformers needs
        them: for Llama 2 (base 1e4, rotary_dim 128) the table differs from the exact one
        by 1e-4 to 2.4e-4 at positions below 4096, and the gap grows linearly with
        position (transformers issue #28685 reports such differences moving Llama logits by
        about 1.0). torch's float32 ``pow`` is not
        correctly rounded, so about one ``inv_freq`` in a hundred differs from transformers'
        by one ulp.
    xp : module, default numpy
        Array module of the result (``numpy`` or ``cupy``): the tables are built with NumPy
        and handed to ``xp.asarray``.

    Returns
    -------
    cos, sin : arrays of module ``xp``
        Shape ``[max_positions, rotary_dim // 2]``, float32. For ``"yarn"`` and
        ``"longrope"`` the attention factor MULTIPLIES both, as in transformers.

    Raises
    ------
    TypeError, ValueError
        Naming the argument or ``scaling`` key: a wrong type, a value out of range (sizes are
        bounded by ``MAX_POSITIONS``, ``MAX_ROTARY_DIM`` and ``MAX_TABLE_ENTRIES``), or finite
        inputs whose table would not be finite (a frequency, an angle or the attention factor
        that overflows).
    """
    rows = _positive_int("max_positions", max_positions, MAX_POSITIONS)
    dim = _rotary_dim(rotary_dim)
    if rows * (dim // 2) > MAX_TABLE_ENTRIES:
        raise ValueError(
            f"max_positions={rows} and rotary_dim={dim} ask for tables of {rows * (dim // 2)} entries each; "
            f"the limit is {MAX_TABLE_ENTRIES} (8 GiB of float32 per table)"
        )
    inv_freq, attention = _frequencies(dim, base, scaling, rows, numerics)
    _array_module(xp)
    return table_rows(rows, inv_freq, attention, xp)


def table_rows(rows: int, inv_freq: np.ndarray, attention: float, xp: Any = np) -> tuple[Any, Any]:
    """``(cos, sin)`` of positions ``0..rows-1`` (:func:`angle_rows`, a chunk of rows at a time),
    as arrays of ``xp``."""
    cos = np.empty((rows, inv_freq.size), dtype=np.float32)
    sin = np.empty_like(cos)
    for start in range(0, rows, _ROWS_PER_CHUNK):
        stop = min(start + _ROWS_PER_CHUNK, rows)
        cos[start:stop], sin[start:stop] = angle_rows(np.arange(start, stop), inv_freq, attention)
    return xp.asarray(cos), xp.asarray(sin)


def angle_rows(positions: np.ndarray, inv_freq: np.ndarray, attention: float) -> tuple[np.ndarray, np.ndarray]:
    """The table rows of ``positions`` (float32 ``[len(positions), inv_freq.size]`` each): what
    :func:`rope_tables` holds at those rows, and what the kernel computes from ``inv_freq``
    (``apply_rope(..., inv_freq=)``; cuda_src/angles.cuh). ``inv_freq``'s dtype selects the
    numerics: float64 "exact" (the product ``position * inv_freq`` rounded once in float64, cos/sin
    in float64 times the factor, one rounding to float32), float32 "transformers" (``float32(p) *
    inv_freq`` rounded to float32, cos/sin rounded to float32, times ``float32(attention)``)."""
    ft = np.dtype(inv_freq.dtype).type
    angles = np.multiply.outer(np.asarray(positions).astype(ft), inv_freq)
    out = []
    for fn in (np.cos, np.sin):
        values = fn(angles.astype(np.float64))
        if ft is np.float64:
            out.append((values * attention).astype(np.float32))  # one rounding
        else:
            out.append(values.astype(np.float32) * np.float32(attention))
    return out[0], out[1]


def cos_sin_cache(
    max_positions: int,
    rotary_dim: int,
    *,
    base: float = _DEFAULT_BASE,
    scaling: Mapping | None = None,
    numerics: str = "exact",
    xp: Any = np,
) -> Any:
    """The combined table inference engines keep (vLLM's, SGLang's and FlashInfer's
    ``cos_sin_cache``): float32 ``[max_positions, rotary_dim]``, each row cos then sin, that is
    ``concatenate([cos, sin], axis=-1)`` of :func:`rope_tables` with the same arguments (every
    ``rope_type`` and both numerics). Pass it to the general API as ``cos_sin_cache=``; the
    kernels read the two halves in place."""
    _array_module(xp)
    cos, sin = rope_tables(max_positions, rotary_dim, base=base, scaling=scaling, numerics=numerics)
    return xp.asarray(np.concatenate([cos, sin], axis=-1))
