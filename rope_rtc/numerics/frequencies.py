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

The cos/sin tables built from these frequencies are in rope_rtc/numerics/tables.py.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import shown

__all__ = ["MAX_POSITIONS", "MAX_ROTARY_DIM", "MAX_TABLE_ENTRIES", "NUMERICS", "ROPE_TYPES", "inverse_frequencies"]

#: The table numerics, in the order of preference for accuracy.
NUMERICS = ("exact", "transformers")

_DEFAULT_BASE = 10000.0

# Upper bounds, so that a mistaken size (a byte count passed as a row count) is named here
# instead of surfacing as NumPy's MemoryError or "array is too big":
#: Entries of one table, max_positions * rotary_dim // 2: 2**31 float32 entries are 8 GiB per
#: table, 16 GiB for cos and sin, built on the host. The longest contexts models are trained for
#: (about 10 million positions) need under a third of it at rotary_dim 128.
MAX_TABLE_ENTRIES = 2**31 - 1
#: Context lengths (max_positions, original_max_position_embeddings, max_position_embeddings):
#: no context is longer than the largest table has rows.
MAX_POSITIONS = MAX_TABLE_ENTRIES
#: Head dimensions are at most a few hundred channels (DeepSeek's MLA caches 512); 2**16 leaves
#: ample room and keeps every ``2i / rotary_dim`` exact in float32 (integers to 2**24).
MAX_ROTARY_DIM = 2**16


# --------------------------------------------------------------------------- arguments


_F32_MAX = float(np.finfo(np.float32).max)


def _positive_int(name: str, value: Any, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {shown(value)}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {shown(value)}")
    if value > limit:
        raise ValueError(f"{name} must be at most {limit}, got {shown(value)}")
    return int(value)


def _rotary_dim(value: Any) -> int:
    dim = _positive_int("rotary_dim", value, MAX_ROTARY_DIM)
    if dim % 2:
        raise ValueError(f"rotary_dim must be even (it rotates pairs of channels), got {dim}")
    return dim


def _real(name: str, value: Any, what: str = "finite and positive") -> float:
    """``value`` as a finite float; TypeError unless it is a real number (bool is not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {shown(value)}")
    try:
        result = float(value)
    except OverflowError:  # an int beyond the float range
        raise ValueError(f"{name} must be {what}, got {shown(value)}") from None
    if not math.isfinite(result):
        raise ValueError(f"{name} must be {what}, got {result}")
    return result


def _finite_positive(name: str, value: Any) -> float:
    result = _real(name, value)
    if not result > 0.0:
        raise ValueError(f"{name} must be finite and positive, got {result}")
    return result


def _float_type(numerics: Any) -> type:
    if not isinstance(numerics, str) or numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(map(repr, NUMERICS))}, got {numerics!r}")
    return np.float64 if numerics == "exact" else np.float32


def _scaling_params(scaling: Any) -> tuple[str, Mapping]:
    if scaling is None:
        return "default", {}
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be a mapping (a rope_scaling dict) or None, got {type(scaling).__name__}")
    # transformers 5 keeps one parameter dict per layer type where they differ (Gemma 3:
    # {"full_attention": {...}, "sliding_attention": {...}}); read as one dict it would be
    # default RoPE at the default base.
    layers = [key for key, value in scaling.items() if isinstance(value, Mapping)]
    if layers and "rope_type" not in scaling and "type" not in scaling:
        raise ValueError(f"scaling holds one parameter dict per layer type ({', '.join(map(repr, layers))}); pass "
                         f"the one of the layers the table is for, e.g. scaling=rope_parameters[{layers[0]!r}]")
    # `rope_type` is the current key; configs saved before transformers 4.42 use `type`.
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in _INIT_FUNCTIONS:
        raise ValueError(
            f"scaling['rope_type'] = {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    return rope_type, scaling


def _resolve_base(base: Any, params: Mapping, ft: type) -> tuple[str, float]:
    """The base and the name it was given by: ``scaling['rope_theta']`` (transformers >= 5
    keeps it there) wins over ``base``."""
    base = _finite_positive("base", base)
    name, theta = "base", params.get("rope_theta")
    if theta is None:
        theta = base
    else:
        name, theta = "scaling['rope_theta']", _finite_positive("scaling['rope_theta']", theta)
        if base != _DEFAULT_BASE and base != theta:
            raise ValueError(f"base={base} conflicts with scaling['rope_theta']={theta}; pass one of them")
    _check_base(name, theta, ft)
    return name, theta


def _check_base(name: str, base: float, ft: type) -> None:
    # "transformers" rounds the base to float32 as torch does: past float32's range it would be
    # infinite, and every pair but the first would never rotate.
    if ft is np.float32 and not base <= _F32_MAX:
        raise ValueError(f"{name}={base} exceeds float32's range, to which numerics='transformers' rounds it "
                         f"(as torch does); use a base below {_F32_MAX:.4g}")


def _param(params: Mapping, key: str, rope_type: str, default: Any = None) -> Any:
    value = params.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"scaling[{key!r}] is required for rope_type {rope_type!r}")
        return default
    return value


def _positive_param(params: Mapping, key: str, rope_type: str, default: Any = None) -> float:
    return _finite_positive(f"scaling[{key!r}]", _param(params, key, rope_type, default))


def _original_max(params: Mapping, rope_type: str) -> int:
    # transformers fills a missing `original_max_position_embeddings` from the model's
    # `max_position_embeddings`; a dict copied from config.json may carry either.
    for key in ("original_max_position_embeddings", "max_position_embeddings"):
        if params.get(key) is not None:
            return _positive_int(f"scaling[{key!r}]", params[key], MAX_POSITIONS)
    raise ValueError(
        f"scaling['original_max_position_embeddings'] is required for rope_type {rope_type!r} "
        "(the pretraining context length: add it, or the model's 'max_position_embeddings', to the dict)"
    )


def _factor_or_implied(params: Mapping, rope_type: str, original: int) -> float:
    """`factor`, or (as transformers does) max_position_embeddings / original when it is absent."""
    if params.get("factor") is not None:
        return _positive_param(params, "factor", rope_type)
    if params.get("max_position_embeddings") is None:
        raise ValueError(
            f"scaling['factor'] is required for rope_type {rope_type!r} "
            "(or the model's 'max_position_embeddings', from which transformers derives it)"
        )
    expanded = _positive_int("scaling['max_position_embeddings']", params["max_position_embeddings"], MAX_POSITIONS)
    return expanded / original


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


def _dynamic_length(params: Mapping) -> int:
    """The length past which dynamic NTK rescales the base. transformers (4.x and 5.x alike,
    ``_compute_dynamic_ntk_parameters``) reads the model's ``max_position_embeddings`` and ignores
    ``original_max_position_embeddings`` for this rope_type (5.x warns that it is unrecognised), so
    a dict holding both is read as transformers reads the model; a dict with the original length
    alone gives that one (the length the caller means, as no model's is given)."""
    for key in ("max_position_embeddings", "original_max_position_embeddings"):
        if params.get(key) is not None:
            return _positive_int(f"scaling[{key!r}]", params[key], MAX_POSITIONS)
    raise ValueError(
        "scaling['max_position_embeddings'] is required for rope_type 'dynamic' (the model's context length, "
        "past which transformers rescales the base; scaling['original_max_position_embeddings'] is taken when it "
        "is absent)"
    )


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


def _attention_param(params: Mapping) -> float | None:
    """``scaling['attention_factor']``, when given: it multiplies float32 tables, so it must fit one."""
    value = params.get("attention_factor")
    if value is None:
        return None
    value = _finite_positive("scaling['attention_factor']", value)
    if value > _F32_MAX:
        raise ValueError(f"scaling['attention_factor']={value} exceeds float32's range ({_F32_MAX:.4g}): "
                         "it multiplies the float32 cos/sin tables")
    return value


def _unset_or(params: Mapping, key: str, default: Any, check: Callable[[str, Any], float]) -> Any:
    """``params[key] or default`` as transformers reads it (0 and None mean unset), checked
    before its truth value is taken."""
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"scaling[{key!r}] must be a real number, got {type(value).__name__} {shown(value)}")
    return check(f"scaling[{key!r}]", value) or default


def _non_negative(name: str, value: Any) -> float:
    result = _real(name, value, "finite and non-negative (0 means unset)")
    if result < 0.0:
        raise ValueError(f"{name} must be finite and non-negative (0 means unset), got {result}")
    return result


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


def _longrope_factors(params: Mapping, key: str, dim: int) -> np.ndarray:
    factors = _param(params, key, "longrope")
    try:
        raw = np.asarray(factors)
        numbers_only = raw.dtype.kind in "iuf" or (
            raw.dtype.kind == "O"
            and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in raw.reshape(-1)))
        ext = raw.astype(np.float64) if numbers_only else None
    except OverflowError:  # an int beyond the float range
        raise ValueError(f"scaling[{key!r}] must hold finite positive numbers") from None
    except (TypeError, ValueError):
        ext = None
    if ext is None:
        raise TypeError(f"scaling[{key!r}] must be a list of numbers, got {shown(factors)}")
    if ext.shape != (dim // 2,):
        raise ValueError(f"scaling[{key!r}] must have rotary_dim // 2 = {dim // 2} entries, got shape {ext.shape}")
    if not np.all(np.isfinite(ext) & (ext > 0)):
        raise ValueError(f"scaling[{key!r}] must hold finite positive numbers")
    return ext


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
    if high_freq_factor <= low_freq_factor:
        raise ValueError(
            f"scaling['high_freq_factor'] ({high_freq_factor}) must exceed "
            f"scaling['low_freq_factor'] ({low_freq_factor}) for rope_type 'llama3'"
        )
    original = _original_max(params, "llama3")
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor

    inv_freq = _default_inv_freq(dim, base, ft)
    wavelen = _rdiv(2 * math.pi, inv_freq, ft)
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = np.where(wavelen > ft(low_freq_wavelen), inv_freq / ft(factor), inv_freq)
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


def _overflow(inv_freq: np.ndarray, rows: int, ft: type) -> str | None:
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
    rope_type, params = _scaling_params(scaling)
    base_name, theta = _resolve_base(base, params, ft)
    # `partial_rotary_factor` is not applied: `rotary_dim` is already the rotated width,
    # int(head_dim * partial_rotary_factor), which is the `dim` transformers' formulas use.
    with np.errstate(all="ignore"):  # an overflow is found below and named
        inv_freq, attention = _INIT_FUNCTIONS[rope_type](params, dim, theta, max_positions, ft)
        inv_freq = np.ascontiguousarray(inv_freq, dtype=ft)
        rows = max_positions or 1
        why = _overflow(inv_freq, rows, ft)
        if why is not None:
            # The base alone, or the scaling on top of it?
            if _overflow(_default_inv_freq(dim, theta, ft), rows, ft) is not None or not _SCALES[rope_type]:
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

