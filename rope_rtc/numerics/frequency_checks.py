"""The checks of the frequency API's arguments (rotary_dim, max_positions, numerics, base) and of
the parameters of a Hugging Face ``rope_scaling`` dict, for frequencies.py and tables.py: each
raises a TypeError or ValueError naming the argument (``scaling['key']`` for a parameter) before
anything is computed, and reads a parameter as transformers reads it (``type`` for ``rope_type``,
0 as unset where transformers writes ``or``, a length implied by another)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import shown

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


def _array_module(xp: Any) -> Any:
    """``xp`` when it is an array module (anything with ``asarray``: numpy, cupy), else the
    TypeError naming it."""
    if not callable(getattr(xp, "asarray", None)):
        raise TypeError(f"xp must be an array module with asarray (numpy or cupy), got {xp!r}")
    return xp


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


def _scaling_params(scaling: Any, rope_types: tuple[str, ...]) -> tuple[str, Mapping]:
    """The rope_type of ``scaling`` (one of ``rope_types``, the supported ones) and its parameters."""
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
    if rope_type == "su" or (rope_type == "yarn" and "short_factor" in scaling and "long_factor" in scaling):
        # Phi-3's configs saved before the rename: transformers' Phi3Config reads both as longrope.
        rope_type = "longrope"
    if rope_type == "mrope":
        # Qwen2-VL's and Qwen2.5-VL's configs: transformers reads this type as default RoPE
        # (mrope_section only splits the pairs between position streams).
        rope_type = "default"
    if not isinstance(rope_type, str) or rope_type not in rope_types:
        raise ValueError(
            f"scaling['rope_type'] = {rope_type!r} is not supported; supported: {', '.join(rope_types)}"
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


def _length(name: str, value: Any) -> int:
    """A context length; an integral float (JSON's 8192.0) is read as the int, as transformers computes with it."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return _positive_int(name, value, MAX_POSITIONS)


def _original_max(params: Mapping, rope_type: str) -> int:
    # transformers fills a missing `original_max_position_embeddings` from the model's
    # `max_position_embeddings`; a dict copied from config.json may carry either.
    for key in ("original_max_position_embeddings", "max_position_embeddings"):
        if params.get(key) is not None:
            return _length(f"scaling[{key!r}]", params[key])
    raise ValueError(
        f"scaling['original_max_position_embeddings'] is required for rope_type {rope_type!r} (the pretraining "
        "context length): add the config's own, which some configs (Phi-3) keep at the top level, with its "
        "'max_position_embeddings'; only a config without one gives 'max_position_embeddings' alone"
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
    expanded = _length("scaling['max_position_embeddings']", params["max_position_embeddings"])
    return expanded / original


# --------------------------------------------------------------------------- scaling parameters


def _dynamic_length(params: Mapping) -> int:
    """The length past which dynamic NTK rescales the base. transformers (4.x and 5.x alike,
    ``_compute_dynamic_ntk_parameters``) reads the model's ``max_position_embeddings`` and ignores
    ``original_max_position_embeddings`` for this rope_type (5.x warns that it is unrecognised), so
    a dict holding both is read as transformers reads the model; a dict with the original length
    alone gives that one (the length the caller means, as no model's is given)."""
    for key in ("max_position_embeddings", "original_max_position_embeddings"):
        if params.get(key) is not None:
            return _length(f"scaling[{key!r}]", params[key])
    raise ValueError(
        "scaling['max_position_embeddings'] is required for rope_type 'dynamic' (the model's context length, "
        "past which transformers rescales the base; scaling['original_max_position_embeddings'] is taken when it "
        "is absent)"
    )


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
