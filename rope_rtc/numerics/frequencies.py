"""Inverse frequencies of rotary embeddings for every Hugging Face ``rope_type``, with their scaling.

Two numerics, named by the API (docs/design.md, "Numerical contracts"):

``"exact"``
    Frequencies, scaling and angles in float64 from the published formulas; cos/sin in
    float64, rounded once to float32. The most accurate table.
``"transformers"``
    Hugging Face transformers' own float32 arithmetic (``modeling_rope_utils.py`` and the
    models' ``RotaryEmbedding.forward`` as they run on the CPU): every tensor operation is one
    float32 operation here, in the same order, with Python scalars rounded to float32 where
    torch rounds them. cos/sin of each float32 angle are correctly rounded.

The scaling formulas are written once, parametrised by the float type ``ft`` (``np.float64``
or ``np.float32``); the few places where torch's float32 evaluation is not the formula's
(``scalar / tensor``, a run-time recomputation) say so where they happen.

The checks of the arguments and of the scaling parameters are in rope_rtc/numerics/frequency_checks.py;
the cos/sin tables built from these frequencies are in rope_rtc/numerics/tables.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import shown
from .frequency_checks import (_DEFAULT_BASE, _F32_MAX, MAX_POSITIONS, MAX_ROTARY_DIM, MAX_TABLE_ENTRIES, NUMERICS,
                               _attention_param, _dynamic_length, _factor_or_implied, _finite_positive, _float_type,
                               _longrope_factors, _non_negative, _original_max, _positive_int, _positive_param,
                               _resolve_base, _rotary_dim, _scaling_params, _unset_or)

__all__ = ["MAX_POSITIONS", "MAX_ROTARY_DIM", "MAX_TABLE_ENTRIES", "NUMERICS", "ROPE_TYPES", "inverse_frequencies"]


# --------------------------------------------------------------------------- float primitives


def _exponents(dim: int, ft: type) -> np.ndarray:
    """``2i / dim`` for each pair i, as ``arange(0, dim, 2).float() / dim`` rounds it."""
    return np.arange(0, dim, 2, dtype=np.int64).astype(ft) / ft(dim)


def _pow(base: float, exponents: np.ndarray, ft: type) -> np.ndarray:
    """``base ** exponents`` with ``base`` rounded to ``ft`` and the result rounded once.

    torch rounds a Python base to float32 first. Its own float32 pow (SLEEF on x86) is
    faithful, not correctly rounded: about one entry in a hundred differs from this by an ulp.
    """
    return (np.float64(ft(base)) ** exponents.astype(np.float64)).astype(ft)


def _rdiv(numerator: float, x: np.ndarray, ft: type) -> np.ndarray:
    """``numerator / x`` for a Python scalar over an array."""
    if ft is np.float32:
        # torch evaluates `scalar / tensor` as `tensor.reciprocal() * scalar`: two roundings.
        return (ft(1.0) / x) * ft(numerator)
    return numerator / x


def _default_inv_freq(dim: int, base: float, ft: type) -> np.ndarray:
    return _rdiv(1.0, _pow(base, _exponents(dim, ft), ft), ft)


# --------------------------------------------------------------------------- scaling formulas
# Each returns (inv_freq of dtype ft, attention factor as a Python float). The attention
# factor is computed in double by transformers too (it is a Python float there).


def _default(params: Mapping, dim: int, base: float, seq_len: int | None, ft: type) -> tuple[np.ndarray, float]:
    return _default_inv_freq(dim, base, ft), 1.0


def _linear(params: Mapping, dim: int, base: float, seq_len: int | None, ft: type) -> tuple[np.ndarray, float]:
    # Dividing the frequencies by the factor is dividing the positions by it (position interpolation).
    factor = _positive_param(params, "factor", "linear")
    return _default_inv_freq(dim, base, ft) / ft(factor), 1.0


def _dynamic_base(base: float, factor: float, seq_len: int | None, original: int, dim: int, ft: type) -> float:
    """NTK-aware base for a context of `seq_len` positions: unchanged up to `original`."""
    exponent = dim / (dim - 2)
    if ft is np.float32 and seq_len is not None and seq_len > original:
        # transformers recomputes here at run time with `seq_len` a torch tensor, so the
        # ratio is float32 tensor arithmetic; pow with a Python exponent runs in double.
        ratio = ft(factor) * ft(seq_len) / ft(original) - ft(factor - 1.0)
        return ft(base) * ft(np.float64(ratio) ** exponent)
    # Exact mode, and transformers' init-time value (Python ints: double arithmetic).
    length = original if seq_len is None else max(seq_len, original)
    try:
        return base * (factor * length / original - (factor - 1.0)) ** exponent
    except OverflowError:  # Python's float ** raises where NumPy's gives inf
        return math.inf


def _dynamic(params: Mapping, dim: int, base: float, seq_len: int | None, ft: type) -> tuple[np.ndarray, float]:
    if dim <= 2:
        raise ValueError(f"rope_type 'dynamic' needs rotary_dim > 2 (its exponent is dim / (dim - 2)), got {dim}")
    factor = _positive_param(params, "factor", "dynamic")
    original = _dynamic_length(params)
    rescaled = _dynamic_base(base, factor, seq_len, original, dim, ft)
    if not math.isfinite(rescaled) or (ft is np.float32 and not rescaled <= _F32_MAX):
        raise ValueError(
            f"scaling['factor']={factor} rescales the base (base or scaling['rope_theta'], {base}) past the "
            f"float range at max_positions={seq_len} "
            f"(base * (factor * max_positions / original - factor + 1) ** (rotary_dim / (rotary_dim - 2)))"
        )
    return _default_inv_freq(dim, rescaled, ft), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: Mapping, dim: int, base: float, seq_len: int | None, ft: type) -> tuple[np.ndarray, float]:
    if base == 1.0:
        raise ValueError("rope_type 'yarn' needs base != 1 (its correction range divides by log(base))")
    original = _original_max(params, "yarn")
    factor = _factor_or_implied(params, "yarn", original)

    attention = _attention_param(params)
    # Both mscales are checked whenever present, though transformers uses them only together.
    mscale = _unset_or(params, "mscale", None, _non_negative)
    mscale_all_dim = _unset_or(params, "mscale_all_dim", None, _non_negative)
    if attention is None:
        if mscale and mscale_all_dim:  # DeepSeek's variant: a ratio of two mscales
            # Both mscales are >= 1 here, so the ratio can only overflow through `mscale`.
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            if not attention <= _F32_MAX:
                raise ValueError(f"scaling['mscale']={mscale} makes the attention factor {attention} exceed "
                                 f"float32's range ({_F32_MAX:.4g}): it multiplies the float32 cos/sin tables")
        else:
            attention = _yarn_mscale(factor)

    # transformers treats 0 like "unset" here (`or`), so this does too.
    beta_fast = _unset_or(params, "beta_fast", 32, _finite_positive)
    beta_slow = _unset_or(params, "beta_slow", 1, _finite_positive)
    truncate = params.get("truncate", True)
    if truncate is not None and not isinstance(truncate, (bool, np.bool_)):
        raise TypeError(f"scaling['truncate'] must be a bool, got {type(truncate).__name__} {shown(truncate)}")

    def correction_dim(key: str, rotations: float) -> float:
        # The (fractional) dimension whose wavelength fits `rotations` times in `original`.
        ratio = original / (rotations * 2 * math.pi)
        if not 0.0 < ratio < math.inf:
            raise ValueError(
                f"scaling[{key!r}]={rotations} is not a usable number of rotations: "
                f"original_max_position_embeddings / (2 pi {key}) = {ratio} overflows (typical values: 1 to 32)"
            )
        return dim * math.log(ratio) / (2 * math.log(base))

    low, high = correction_dim("beta_fast", beta_fast), correction_dim("beta_slow", beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp's width must not be zero

    pos_freqs = _pow(base, _exponents(dim, ft), ft)
    extrapolation = _rdiv(1.0, pos_freqs, ft)
    interpolation = _rdiv(1.0, ft(factor) * pos_freqs, ft)
    ramp = np.clip((np.arange(dim // 2, dtype=ft) - ft(low)) / ft(high - low), 0, 1)
    # 1 keeps a pair's original frequency (high frequencies), 0 interpolates it fully.
    extrapolation_weight = ft(1.0) - ramp
    inv_freq = interpolation * (ft(1.0) - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention)


def _longrope(params: Mapping, dim: int, base: float, seq_len: int | None, ft: type) -> tuple[np.ndarray, float]:
    original = _original_max(params, "longrope")
    # Both lists are checked, though one is used: a config with a broken one is broken.
    ext = {key: _longrope_factors(params, key, dim) for key in ("short_factor", "long_factor")}
    # A context longer than pretraining uses the long factors, as transformers' forward does
    # when max(position_ids) + 1 exceeds original_max_position_embeddings.
    ext = ext["long_factor" if seq_len is not None and seq_len > original else "short_factor"]

    attention = _attention_param(params)
    if attention is None:
        factor = _factor_or_implied(params, "longrope", original)
        if factor <= 1.0:
            attention = 1.0
        elif original < 2:
            raise ValueError(
                f"scaling['original_max_position_embeddings'] must be at least 2 for rope_type 'longrope' "
                f"with factor {factor} > 1: its attention factor divides by log(original_max_position_embeddings)"
            )
        else:
            attention = math.sqrt(1.0 + math.log(factor) / math.log(original))

    inv_freq = _rdiv(1.0, ext.astype(ft) * _pow(base, _exponents(dim, ft), ft), ft)
    return inv_freq, float(attention)


def _llama3(params: Mapping, dim: int, base: float, seq_len: int | None, ft: type) -> tuple[np.ndarray, float]:
    factor = _positive_param(params, "factor", "llama3")
    low_freq_factor = _positive_param(params, "low_freq_factor", "llama3")
    high_freq_factor = _positive_param(params, "high_freq_factor", "llama3")
    original = _original_max(params, "llama3")
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor

    inv_freq = _default_inv_freq(dim, base, ft)
    wavelen = _rdiv(2 * math.pi, inv_freq, ft)
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = np.where(wavelen > ft(low_freq_wavelen), inv_freq / ft(factor), inv_freq)
    if high_freq_factor <= low_freq_factor:
        # No band between: equal factors (Llama 4 Scout's configs), or reversed ones, which transformers
        # computes the same way (it only warns).
        return scaled.astype(ft), 1.0
    smooth = (_rdiv(original, wavelen, ft) - ft(low_freq_factor)) / ft(high_freq_factor - low_freq_factor)
    smoothed = (ft(1.0) - smooth) * scaled / ft(factor) + smooth * scaled
    medium = ~(wavelen < ft(high_freq_wavelen)) & ~(wavelen > ft(low_freq_wavelen))
    return np.where(medium, smoothed, scaled).astype(ft), 1.0


_INIT_FUNCTIONS: dict[str, Callable[..., tuple[np.ndarray, float]]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "longrope": _longrope,
    "llama3": _llama3,
}

#: The ``rope_type`` values of a Hugging Face ``rope_scaling`` dict that are supported.
ROPE_TYPES = tuple(_INIT_FUNCTIONS)


# --------------------------------------------------------------------------- public API


def inverse_frequencies(
    rotary_dim: int,
    *,
    base: float = _DEFAULT_BASE,
    scaling: Mapping | None = None,
    max_positions: int | None = None,
    numerics: str = "exact",
) -> tuple[np.ndarray, float]:
    """Inverse frequencies of each rotary pair, and the attention factor of the scaling.

    Parameters
    ----------
    rotary_dim : int
        Number of rotated channels (even); there are ``rotary_dim // 2`` pairs.
    base : float, default 10000.0
        RoPE base (theta). ``scaling['rope_theta']``, when present, takes precedence; a
        ``base`` other than the default that disagrees with it raises ``ValueError``.
    scaling : Mapping or None
        A Hugging Face ``rope_scaling`` / ``rope_parameters`` dict; see :func:`rope_tables`.
    max_positions : int or None
        Length of the context the frequencies serve. Only ``"dynamic"`` (base rescaled past
        the model's ``max_position_embeddings``) and ``"longrope"`` (long factors past
        ``original_max_position_embeddings``) use it; None means "within the original
        context", transformers' value at model creation.
    numerics : {"exact", "transformers"}
        See :func:`rope_tables`.

    Returns
    -------
    inv_freq : numpy.ndarray
        Shape ``[rotary_dim // 2]``, float64 for ``"exact"``, float32 for ``"transformers"``.
        Before scaling, ``inv_freq[i] = base ** (-2 i / rotary_dim)``.
    attention_factor : float
        Factor that multiplies cos and sin (``"yarn"`` and ``"longrope"``; 1.0 otherwise).
    """
    dim = _rotary_dim(rotary_dim)
    if max_positions is not None:
        max_positions = _positive_int("max_positions", max_positions, MAX_POSITIONS)
    return _frequencies(dim, base, scaling, max_positions, numerics)


#: The parameters that scale each rope_type's frequencies: named when those overflow.
_SCALES = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


def table_overflow(inv_freq: np.ndarray, rows: int, ft: type) -> str | None:
    """Why a table of `rows` positions at these frequencies would not be finite, or None.

    Positions and frequencies are non-negative, so the largest angle is the last position
    times the largest frequency; cos and sin of every finite angle are finite."""
    with np.errstate(all="ignore"):
        if not np.all(np.isfinite(inv_freq)):
            return f"an inverse frequency of {inv_freq[~np.isfinite(inv_freq)][0]}"
        top = inv_freq.max()
        if rows > 1 and not np.isfinite(ft(rows - 1) * top):
            return f"an angle that overflows at position {rows - 1} (frequency {top:.4g})"
    return None


def _frequencies(dim: int, base: Any, scaling: Any, max_positions: int | None, numerics: Any,
                 ) -> tuple[np.ndarray, float]:
    """inv_freq and attention factor, checked to give a finite table of `max_positions` rows."""
    ft = _float_type(numerics)
    rope_type, params = _scaling_params(scaling, ROPE_TYPES)
    base_name, theta = _resolve_base(base, params, ft)
    # `partial_rotary_factor` is not applied: `rotary_dim` is already the rotated width,
    # int(head_dim * partial_rotary_factor), which is the `dim` transformers' formulas use.
    with np.errstate(all="ignore"):  # an overflow is found below and named
        inv_freq, attention = _INIT_FUNCTIONS[rope_type](params, dim, theta, max_positions, ft)
        inv_freq = np.ascontiguousarray(inv_freq, dtype=ft)
        rows = max_positions or 1
        why = table_overflow(inv_freq, rows, ft)
        if why is not None:
            # The base alone, or the scaling on top of it?
            if table_overflow(_default_inv_freq(dim, theta, ft), rows, ft) is not None or not _SCALES[rope_type]:
                culprit = f"{base_name}={theta}"
            else:
                culprit = " / ".join(f"scaling[{k!r}]" + ("" if isinstance(params[k], (list, tuple, np.ndarray))
                                                           else f"={shown(params[k])}")
                                     for k in _SCALES[rope_type] if params.get(k) is not None)
            raise ValueError(
                f"{culprit} gives {why} with rope_type {rope_type!r}, numerics {numerics!r} and rotary_dim {dim}: "
                "the table would not be finite (typical bases are 1e4 to 1e7, scaling factors 1 to 100)"
            )
    return inv_freq, attention

