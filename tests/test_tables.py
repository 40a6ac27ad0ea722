"""Tests of rope_rtc.tables: frequencies and cos/sin tables, both numerics, every rope_type.

Three kinds of reference:
- hand-computed values for small cases;
- independent re-computations written here element by element: the published formulas in
  float64 (``exact`` must be within 1e-6 of them) and Hugging Face's float32 operation
  sequence (``transformers`` must equal it bit for bit);
- transformers itself, in test_gpu_tables.py (``@pytest.mark.device``: needs torch and
  transformers, which only the device machine has).
"""

from __future__ import annotations

import math
import re
import types
import warnings

import numpy as np
import pytest

from rope_rtc import tables
from rope_rtc.tables import NUMERICS, ROPE_TYPES, inverse_frequencies, rope_tables

f32 = np.float32

# Scaling dicts as they appear in real config.json files (shapes of Llama 2/3.1, Qwen YaRN,
# DeepSeek YaRN with mscale, Phi-3 LongRoPE), at sizes small enough for fast tests.
_SHORT = [1.0 + 0.05 * i for i in range(48)]
_LONG = [1.0 + 0.4 * i for i in range(48)]
CASES = {
    "default": ({"rope_type": "default"}, 64, 10000.0, 3000),
    # A base that float32 cannot hold: torch rounds it before the power.
    "default-odd-base": ({"rope_type": "default"}, 64, 12345678.5, 3000),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 80, 10000.0, 3000),
    "dynamic-short": (
        {"rope_type": "dynamic", "factor": 2.5, "original_max_position_embeddings": 3000}, 64, 10000.0, 3000),
    "dynamic-long": (
        {"rope_type": "dynamic", "factor": 2.5, "original_max_position_embeddings": 3000}, 64, 10000.0, 5000),
    # Both lengths in the dict: transformers rescales past the model's max_position_embeddings and
    # ignores original_max_position_embeddings for this rope_type.
    "dynamic-both": (
        {"rope_type": "dynamic", "factor": 2.5, "original_max_position_embeddings": 1000,
         "max_position_embeddings": 3000}, 64, 10000.0, 5000),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 64, 1000000.0, 3000),
    "yarn-mscale": (
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}, 64, 10000.0, 3000),
    "yarn-untruncated": (
        {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "truncate": False,
         "beta_fast": 16.0, "beta_slow": 2.0}, 64, 500000.0, 3000),
    # A small base: the correction range 11 .. 36 is clamped at dim - 1 = 31.
    "yarn-clamped": (
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}, 32, 10.0, 3000),
    "longrope-short": (
        {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG,
         "original_max_position_embeddings": 2048, "factor": 16.0}, 96, 10000.0, 2048),
    "longrope-long": (
        {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG,
         "original_max_position_embeddings": 2048, "factor": 16.0}, 96, 10000.0, 3000),
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 1024}, 64, 500000.0, 3000),
    # A wide blending band: its float32 arithmetic (`2 * pi / inv_freq` is a reciprocal, then
    # a product, in torch) shows in the result.
    "llama3-wide-band": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0,
         "original_max_position_embeddings": 1024}, 128, 10000.0, 3000),
}


# --------------------------------------------------------------------------- float64 formulas
# The published formulas, one pair at a time, in the algebra of the papers (not the module's).


def dynamic_length(params: dict) -> int:
    """The length past which dynamic NTK rescales the base: transformers reads the model's
    max_position_embeddings; a dict without it gives original_max_position_embeddings."""
    return params.get("max_position_embeddings") or params["original_max_position_embeddings"]


def formula_frequencies(params: dict, dim: int, base: float, seq_len: int) -> tuple[list[float], float]:
    kind = params.get("rope_type", params.get("type", "default"))
    half = dim // 2
    theta = [base ** (-2.0 * i / dim) for i in range(half)]
    if kind == "default":
        return theta, 1.0
    if kind == "linear":
        return [t / params["factor"] for t in theta], 1.0
    if kind == "dynamic":
        s, L0 = params["factor"], dynamic_length(params)
        if seq_len > L0:
            base = base * (s * seq_len / L0 - (s - 1)) ** (dim / (dim - 2))
        return [base ** (-2.0 * i / dim) for i in range(half)], 1.0
    if kind == "yarn":
        s, L0 = params["factor"], params["original_max_position_embeddings"]

        def dim_of(rotations):  # the dimension index whose wavelength is L0 / rotations
            return dim * math.log(L0 / (2 * math.pi * rotations)) / (2 * math.log(base))

        lo, hi = dim_of(params.get("beta_fast", 32)), dim_of(params.get("beta_slow", 1))
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        inv = []
        for i, t in enumerate(theta):
            gamma = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: keep, 1: interpolate
            inv.append(t * (1 - gamma) + t / s * gamma)
        if "mscale" in params and "mscale_all_dim" in params:
            att = (1 + 0.1 * params["mscale"] * math.log(s)) / (1 + 0.1 * params["mscale_all_dim"] * math.log(s))
        else:
            att = 1 + 0.1 * math.log(s)
        return inv, att
    if kind == "longrope":
        L0 = params["original_max_position_embeddings"]
        ext = params["long_factor"] if seq_len > L0 else params["short_factor"]
        att = math.sqrt(1 + math.log(params["factor"]) / math.log(L0))
        return [t / e for t, e in zip(theta, ext)], att
    if kind == "llama3":
        s, L0 = params["factor"], params["original_max_position_embeddings"]
        lo_f, hi_f = params["low_freq_factor"], params["high_freq_factor"]
        inv = []
        for t in theta:
            wavelength = 2 * math.pi / t
            if wavelength < L0 / hi_f:
                inv.append(t)
            elif wavelength > L0 / lo_f:
                inv.append(t / s)
            else:
                mix = (L0 / wavelength - lo_f) / (hi_f - lo_f)
                inv.append((1 - mix) * t / s + mix * t)
        return inv, 1.0
    raise AssertionError(kind)


def formula_tables(params, dim, base, n):
    inv, att = formula_frequencies(params, dim, base, n)
    angles = np.multiply.outer(np.arange(n, dtype=np.float64), np.array(inv))
    return att * np.cos(angles), att * np.sin(angles)


# --------------------------------------------------------------------------- float32 emulation
# Hugging Face's float32 operation sequence, written element by element with NumPy float32
# scalars (each operation rounds once). torch evaluates `python_scalar / tensor` as
# `reciprocal(tensor) * scalar`; float32 pow is taken correctly rounded.


def pow32(b, e):
    return f32(math.pow(float(f32(b)), float(e)))


def rdiv32(numerator, x):
    return (f32(1) / x) * f32(numerator)


def hf32_frequencies(params: dict, dim: int, base: float, seq_len: int) -> tuple[np.ndarray, float]:
    kind = params.get("rope_type", params.get("type", "default"))
    half = dim // 2
    expo = [f32(2 * i) / f32(dim) for i in range(half)]
    att = 1.0
    if kind == "dynamic" and seq_len > dynamic_length(params):
        s, L0 = params["factor"], dynamic_length(params)
        ratio = f32(s) * f32(seq_len) / f32(L0) - f32(s - 1)
        base = f32(base) * f32(float(ratio) ** (dim / (dim - 2)))
    if kind in ("default", "linear", "dynamic"):
        inv = [rdiv32(1.0, pow32(base, e)) for e in expo]
        if kind == "linear":
            inv = [v / f32(params["factor"]) for v in inv]
    elif kind == "yarn":
        s, L0 = params["factor"], params["original_max_position_embeddings"]
        bf, bs = params.get("beta_fast", 32), params.get("beta_slow", 1)
        lo = dim * math.log(L0 / (bf * 2 * math.pi)) / (2 * math.log(base))
        hi = dim * math.log(L0 / (bs * 2 * math.pi)) / (2 * math.log(base))
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        inv = []
        for i, e in enumerate(expo):
            p = pow32(base, e)
            ramp = min(max((f32(i) - f32(lo)) / f32(hi - lo), f32(0)), f32(1))
            w = f32(1) - ramp
            inv.append(rdiv32(1.0, f32(s) * p) * (f32(1) - w) + rdiv32(1.0, p) * w)
        att = formula_frequencies(params, dim, base, seq_len)[1]
    elif kind == "longrope":
        L0 = params["original_max_position_embeddings"]
        ext = params["long_factor"] if seq_len > L0 else params["short_factor"]
        inv = [rdiv32(1.0, f32(x) * pow32(base, e)) for x, e in zip(ext, expo)]
        att = formula_frequencies(params, dim, base, seq_len)[1]
    elif kind == "llama3":
        s, L0 = params["factor"], params["original_max_position_embeddings"]
        lo_f, hi_f = params["low_freq_factor"], params["high_freq_factor"]
        inv = []
        for e in expo:
            t = rdiv32(1.0, pow32(base, e))
            wl = rdiv32(2 * math.pi, t)
            kept = t / f32(s) if wl > f32(L0 / lo_f) else t
            if wl < f32(L0 / hi_f) or wl > f32(L0 / lo_f):
                inv.append(kept)
            else:
                mix = (rdiv32(L0, wl) - f32(lo_f)) / f32(hi_f - lo_f)
                inv.append((f32(1) - mix) * kept / f32(s) + mix * kept)
    else:
        raise AssertionError(kind)
    return np.array(inv, dtype=np.float32), att


def hf32_tables(params, dim, base, n):
    inv, att = hf32_frequencies(params, dim, base, n)
    cos = np.empty((n, dim // 2), np.float32)
    sin = np.empty_like(cos)
    for p in range(n):
        for i, v in enumerate(inv):
            angle = float(f32(p) * v)
            cos[p, i] = f32(math.cos(angle)) * f32(att)
            sin[p, i] = f32(math.sin(angle)) * f32(att)
    return cos, sin


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Number of float32 values between a and b (0 for identical bits, works across zero)."""

    def ordered(x):
        bits = np.ascontiguousarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
        return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return np.abs(ordered(a) - ordered(b))


# --------------------------------------------------------------------------- hand-computed


def test_a_dict_per_layer_type_is_refused_naming_the_layers():
    """transformers 5 keeps one rope_parameters dict per layer type where they differ (Gemma 3):
    taken as one dict it read as default RoPE at base 10000, silently."""
    from rope_rtc import inverse_frequencies

    per_layer = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="one parameter dict per layer type .*'full_attention'"):
        inverse_frequencies(128, scaling=per_layer)
    with pytest.raises(ValueError, match="per layer type"):
        rope_tables(16, 128, scaling=per_layer)
    want, _ = inverse_frequencies(128, scaling={"rope_type": "linear", "factor": 8.0}, base=1e6)
    got, _ = inverse_frequencies(128, scaling=per_layer["full_attention"])
    np.testing.assert_array_equal(got, want)


def test_default_small_case_by_hand():
    # position 2, dim 4, base 100: inv_freq = [1, 0.1], angles 2.0 and 0.2.
    cos, sin = rope_tables(3, 4, base=100.0)
    assert cos.shape == sin.shape == (3, 2)
    assert cos.dtype == sin.dtype == np.float32
    assert isinstance(cos, np.ndarray) and isinstance(sin, np.ndarray)
    np.testing.assert_array_equal(cos[2], [f32(math.cos(2.0)), f32(math.cos(0.2))])
    np.testing.assert_array_equal(sin[2], [f32(math.sin(2.0)), f32(math.sin(0.2))])
    np.testing.assert_array_equal(cos[0], [1, 1])
    np.testing.assert_array_equal(sin[0], [0, 0])
    inv, att = inverse_frequencies(4, base=100.0)
    assert inv.dtype == np.float64 and att == 1.0
    np.testing.assert_allclose(inv, [1.0, 0.1], rtol=1e-15)


def test_default_small_case_transformers_numerics():
    inv, att = inverse_frequencies(4, base=100.0, numerics="transformers")
    assert inv.dtype == np.float32 and att == 1.0
    np.testing.assert_array_equal(inv, [1.0, f32(1) / f32(10)])
    cos, sin = rope_tables(3, 4, base=100.0, numerics="transformers")
    angle = float(f32(2) * (f32(1) / f32(10)))  # float32(0.2), not 0.2
    assert angle != 0.2
    np.testing.assert_array_equal(cos[2], [f32(math.cos(2.0)), f32(math.cos(angle))])
    np.testing.assert_array_equal(sin[2], [f32(math.sin(2.0)), f32(math.sin(angle))])


def test_linear_halves_the_angles():
    cos, sin = rope_tables(3, 4, base=100.0, scaling={"rope_type": "linear", "factor": 2.0})
    np.testing.assert_array_equal(cos[2], [f32(math.cos(1.0)), f32(math.cos(0.1))])
    np.testing.assert_array_equal(sin[2], [f32(math.sin(1.0)), f32(math.sin(0.1))])


def test_dynamic_rescales_base_past_original_length():
    params = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4}
    # 8 positions, twice the original: base 100 * (2 * 8 / 4 - 1) ** (4 / 2) = 900.
    inv, _ = inverse_frequencies(4, base=100.0, scaling=params, max_positions=8)
    np.testing.assert_allclose(inv, [1.0, 1 / 30], rtol=1e-15)
    # Within the original length (or unknown length) the base is unchanged.
    for n in (None, 1, 4):
        inv, _ = inverse_frequencies(4, base=100.0, scaling=params, max_positions=n)
        np.testing.assert_allclose(inv, [1.0, 0.1], rtol=1e-15)
    # The legacy spelling of the model's length is accepted too.
    legacy = {"type": "dynamic", "factor": 2.0, "max_position_embeddings": 4}
    np.testing.assert_array_equal(
        inverse_frequencies(4, base=100.0, scaling=legacy, max_positions=8)[0],
        inverse_frequencies(4, base=100.0, scaling=params, max_positions=8)[0],
    )


def test_dynamic_rescales_past_the_models_max_position_embeddings_as_transformers_does():
    """A dict with both lengths: transformers 5 (``_compute_dynamic_ntk_parameters``) rescales past
    the model's ``max_position_embeddings`` and ignores ``original_max_position_embeddings``. The
    float32 values are what transformers 5.17's LlamaRotaryEmbedding gives for this config
    (max_position_embeddings 8, head_dim 4, base 100) at 16 positions. Before: the original
    length (4) was used, giving base 100 * (2 * 16 / 4 - 1) ** 2 = 4900."""
    params = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4,
              "max_position_embeddings": 8}
    # 16 positions, twice the model's 8: base 100 * (2 * 16 / 8 - 1) ** (4 / 2) = 900.
    inv, _ = inverse_frequencies(4, base=100.0, scaling=params, max_positions=16)
    np.testing.assert_allclose(inv, [1.0, 1 / 30], rtol=1e-15)
    inv32, _ = inverse_frequencies(4, base=100.0, scaling=params, max_positions=16, numerics="transformers")
    np.testing.assert_array_equal(inv32, np.array([1.0, 0.03333333507180214], np.float32))
    # Past the original length but within the model's: the base is unchanged.
    inv, _ = inverse_frequencies(4, base=100.0, scaling=params, max_positions=6)
    np.testing.assert_allclose(inv, [1.0, 0.1], rtol=1e-15)


def test_yarn_by_hand():
    # dim 8, base 1e4: theta = [1, .1, .01, .001]; with L0 = 64 the correction range is
    # floor(-0.497) -> 0 .. ceil(1.008) = 2, so the ramp is [0, .5, 1, 1].
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    inv, att = inverse_frequencies(8, scaling=params)
    np.testing.assert_allclose(inv, [1.0, 0.1 * (0.5 + 0.5 / 4), 0.01 / 4, 0.001 / 4], rtol=1e-14)
    assert att == pytest.approx(1 + 0.1 * math.log(4.0), rel=1e-15)
    # The attention factor multiplies cos and sin.
    cos, sin = rope_tables(2, 8, scaling=params)
    np.testing.assert_array_equal(cos[0], np.full(4, f32(att)))
    np.testing.assert_array_equal(sin[0], np.zeros(4))
    np.testing.assert_array_equal(cos[1, 0], f32(att * math.cos(1.0)))


def test_yarn_attention_factor_variants():
    base_params = {"rope_type": "yarn", "factor": math.e, "original_max_position_embeddings": 64}
    assert inverse_frequencies(8, scaling={**base_params, "attention_factor": 2.0})[1] == 2.0
    att = inverse_frequencies(8, scaling={**base_params, "mscale": 2.0, "mscale_all_dim": 1.0})[1]
    assert att == pytest.approx(1.2 / 1.1, rel=1e-15)
    assert inverse_frequencies(8, scaling={**base_params, "mscale": 1.0, "mscale_all_dim": 1.0})[1] == 1.0
    # A factor of at most 1 leaves cos and sin unscaled.
    assert inverse_frequencies(8, scaling={**base_params, "factor": 0.5})[1] == 1.0
    # Without `factor`, transformers derives it from max_position_embeddings / original.
    implied = {"rope_type": "yarn", "original_max_position_embeddings": 64, "max_position_embeddings": 256}
    np.testing.assert_array_equal(
        inverse_frequencies(8, scaling=implied)[0],
        inverse_frequencies(8, scaling={**implied, "factor": 4.0})[0],
    )


def test_yarn_truncate_option_changes_the_ramp():
    params = CASES["yarn-untruncated"][0]
    truncated = inverse_frequencies(64, base=500000.0, scaling={**params, "truncate": True})[0]
    untruncated = inverse_frequencies(64, base=500000.0, scaling=params)[0]
    assert not np.array_equal(truncated, untruncated)


def test_longrope_picks_factors_by_context_length():
    params = {"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [4.0, 8.0],
              "original_max_position_embeddings": 16, "factor": 4.0}
    short, att = inverse_frequencies(4, base=100.0, scaling=params, max_positions=16)
    np.testing.assert_allclose(short, [1.0, 0.05], rtol=1e-15)
    assert att == pytest.approx(math.sqrt(1.5), rel=1e-15)
    long, _ = inverse_frequencies(4, base=100.0, scaling=params, max_positions=17)
    np.testing.assert_allclose(long, [0.25, 0.0125], rtol=1e-15)
    cos, _ = rope_tables(17, 4, base=100.0, scaling=params)
    np.testing.assert_array_equal(cos[0], np.full(2, f32(math.sqrt(1.5))))
    # An explicit attention factor wins; no factor at all means none beyond the lengths ratio.
    assert inverse_frequencies(4, base=100.0, scaling={**params, "attention_factor": 1.25})[1] == 1.25
    no_factor = {k: v for k, v in params.items() if k != "factor"}
    assert inverse_frequencies(4, base=100.0, scaling={**no_factor, "max_position_embeddings": 16})[1] == 1.0


def test_llama3_bands():
    # dim 8, base 1e4: wavelengths 2pi * [1, 10, 100, 1000]; L0 = 1024, band [256, 1024].
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 1024}
    inv, att = inverse_frequencies(8, scaling=params)
    mix = (1024 / (200 * math.pi) - 1) / 3
    np.testing.assert_allclose(inv, [1.0, 0.1, (1 - mix) * 0.01 / 8 + mix * 0.01, 0.001 / 8], rtol=1e-14)
    assert att == 1.0


def test_rope_theta_in_dict_wins_over_default_base():
    params = {"rope_type": "default", "rope_theta": 100.0}
    np.testing.assert_allclose(inverse_frequencies(4, scaling=params)[0], [1.0, 0.1], rtol=1e-15)
    np.testing.assert_allclose(inverse_frequencies(4, base=100.0, scaling=params)[0], [1.0, 0.1], rtol=1e-15)
    with pytest.raises(ValueError, match="base"):
        inverse_frequencies(4, base=500.0, scaling=params)


def test_legacy_type_key_and_empty_dict():
    legacy = rope_tables(50, 16, scaling={"type": "linear", "factor": 2.0})
    current = rope_tables(50, 16, scaling={"rope_type": "linear", "factor": 2.0})
    np.testing.assert_array_equal(legacy[0], current[0])
    np.testing.assert_array_equal(rope_tables(50, 16, scaling={})[0], rope_tables(50, 16)[0])


def test_llama3_scaling_with_equal_band_factors_divides_the_long_wavelengths_only():
    """Llama 4 Scout ships llama3 scaling with low_freq_factor == high_freq_factor == 1.0: no band
    between, so transformers (which only warns) divides the pairs whose wavelength passes the
    original context by the factor and keeps the rest; the tables follow (they raised ValueError)."""
    scout = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
             "original_max_position_embeddings": 8192}
    inv, attention = inverse_frequencies(128, base=500000.0, scaling=scout)
    plain = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    long_wave = 2 * math.pi / plain > 8192
    assert attention == 1.0 and 0 < long_wave.sum() < 64
    np.testing.assert_allclose(inv, np.where(long_wave, plain / 16.0, plain), rtol=1e-15, atol=0)
    cos, sin = rope_tables(64, 128, base=500000.0, scaling=scout)
    assert np.isfinite(cos).all() and np.isfinite(sin).all()


def test_a_missing_original_context_names_the_config_field_beside_rope_scaling():
    """Phi-3's longrope dict lacks original_max_position_embeddings, which its config keeps at the
    top level; transformers reads that one (and max_position_embeddings only without it). The
    error said to add it "or the model's max_position_embeddings", which gives other tables
    silently (attention factor 1.0, the long factors past 131072 instead of 4096)."""
    phi3 = {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}
    with pytest.raises(ValueError, match=r"top level.*with its 'max_position_embeddings'") as err:
        inverse_frequencies(96, base=10000.0, scaling=phi3)
    assert "or the model's 'max_position_embeddings'" not in str(err.value)


@pytest.mark.parametrize("qwen2_vl", [
    {"type": "mrope", "mrope_section": [16, 24, 24]},                       # config.json as published
    {"rope_type": "mrope", "mrope_section": [16, 24, 24]},                  # transformers 5 maps it too
    {"type": "mrope", "rope_type": "mrope", "mrope_section": [16, 24, 24]},
])
def test_qwen2_vl_mrope_type_is_default_rope(qwen2_vl):
    """Qwen2-VL's and Qwen2.5-VL's config.json hold rope_scaling = {"type": "mrope", "mrope_section":
    [...]}, which transformers reads as default RoPE (the sections only split the pairs between
    position streams): the dict as it stands gives the default tables, not a ValueError."""
    for got, want in ((rope_tables(64, 128, base=1e6, scaling=qwen2_vl), rope_tables(64, 128, base=1e6)),
                      (inverse_frequencies(128, base=1e6, scaling=qwen2_vl), inverse_frequencies(128, base=1e6))):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("fn", [rope_tables, tables.cos_sin_cache])
@pytest.mark.parametrize("xp", ["cupy", None, object()])
def test_a_non_module_xp_is_a_type_error_naming_it_before_the_table_is_built(fn, xp, monkeypatch):
    """cos_sin_cache takes rope_tables' arguments and checks xp= as it does, before any row is
    computed (it built the whole table, then failed inside on xp.asarray with AttributeError)."""
    from rope_rtc.numerics import tables as impl

    def no_rows(*args, **kwargs):
        raise AssertionError("the table was built before xp= was checked")

    monkeypatch.setattr(impl, "table_rows", no_rows)
    monkeypatch.setattr(impl, "angle_rows", no_rows)
    with pytest.raises(TypeError, match="xp must be an array module"):
        fn(64, 16, xp=xp)


def test_xp_receives_the_tables():
    calls = []

    def asarray(a):
        calls.append(a)
        return ("wrapped", a)

    cos, sin = rope_tables(5, 8, xp=types.SimpleNamespace(asarray=asarray))
    assert cos[0] == "wrapped" and sin[0] == "wrapped" and len(calls) == 2
    assert calls[0].dtype == np.float32 and calls[0].shape == (5, 4)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_chunking_does_not_change_the_table(monkeypatch, numerics):
    params = CASES["yarn"][0]
    whole = rope_tables(100, 16, scaling=params, numerics=numerics)
    monkeypatch.setattr(tables, "_ROWS_PER_CHUNK", 7)
    chunked = rope_tables(100, 16, scaling=params, numerics=numerics)
    np.testing.assert_array_equal(whole[0], chunked[0])
    np.testing.assert_array_equal(whole[1], chunked[1])


# --------------------------------------------------------------------------- against the formulas


def test_cases_cover_every_rope_type():
    covered = {p.get("rope_type", p.get("type")) for p, *_ in CASES.values()}
    assert covered == set(ROPE_TYPES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_matches_float64_formulas(case):
    params, dim, base, n = CASES[case]
    inv, att = inverse_frequencies(dim, base=base, scaling=params, max_positions=n)
    want_inv, want_att = formula_frequencies(params, dim, base, n)
    np.testing.assert_allclose(inv, want_inv, rtol=1e-13, atol=0)
    assert att == pytest.approx(want_att, rel=1e-14)
    cos, sin = rope_tables(n, dim, base=base, scaling=params)
    assert cos.shape == sin.shape == (n, dim // 2) and cos.dtype == sin.dtype == np.float32
    want_cos, want_sin = formula_tables(params, dim, base, n)
    assert np.max(np.abs(cos - want_cos)) <= 1e-6
    assert np.max(np.abs(sin - want_sin)) <= 1e-6


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_numerics_match_float32_emulation(case):
    params, dim, base, n = CASES[case]
    n = min(n, 2100)  # the element-by-element emulation is slow; "-long" cases go just past the original
    if case.endswith("-long"):
        n = max(n, params["original_max_position_embeddings"] + 1)
    inv, att = inverse_frequencies(dim, base=base, scaling=params, max_positions=n, numerics="transformers")
    want_inv, want_att = hf32_frequencies(params, dim, base, n)
    assert inv.dtype == np.float32
    np.testing.assert_array_equal(inv, want_inv)
    assert att == pytest.approx(want_att, rel=1e-14)
    cos, sin = rope_tables(n, dim, base=base, scaling=params, numerics="transformers")
    want_cos, want_sin = hf32_tables(params, dim, base, n)
    np.testing.assert_array_equal(cos, want_cos)
    np.testing.assert_array_equal(sin, want_sin)


def test_exact_and_transformers_differ_by_a_growing_gap():
    # Llama 2's table: the float32 inverse frequencies and angles drift from the exact ones.
    dim, n = 128, 65536
    exact = rope_tables(n, dim)
    hf = rope_tables(n, dim, numerics="transformers")
    gap = np.maximum(np.abs(exact[0] - hf[0]), np.abs(exact[1] - hf[1]))
    early, late = gap[:4096].max(), gap[60000:].max()
    assert 1e-5 < early < 1e-3
    assert late > 8 * early  # grows about linearly with position

    inv64 = inverse_frequencies(dim)[0]
    inv32 = inverse_frequencies(dim, numerics="transformers")[0]
    positions = np.arange(n, dtype=np.float64)[:, None]
    angles32 = positions * inv32.astype(np.float64)
    bound = (positions * np.abs(inv64 - inv32) + np.spacing(np.abs(angles32).astype(np.float32)) + 2.0**-23)
    assert np.all(gap <= bound)


# --------------------------------------------------------------------------- argument errors

BAD_ARGUMENTS = [
    ({"max_positions": 0}, ValueError, "max_positions"),
    ({"max_positions": -3}, ValueError, "max_positions"),
    ({"max_positions": 8.0}, TypeError, "max_positions"),
    ({"max_positions": True}, TypeError, "max_positions"),
    ({"max_positions": "8"}, TypeError, "max_positions"),
    ({"rotary_dim": 0}, ValueError, "rotary_dim"),
    ({"rotary_dim": 7}, ValueError, "rotary_dim"),
    ({"rotary_dim": 8.0}, TypeError, "rotary_dim"),
    ({"base": 0.0}, ValueError, "base"),
    ({"base": -10.0}, ValueError, "base"),
    ({"base": math.inf}, ValueError, "base"),
    ({"base": math.nan}, ValueError, "base"),
    ({"base": "10000"}, TypeError, "base"),
    ({"numerics": "fast"}, ValueError, "numerics"),
    ({"numerics": None}, ValueError, "numerics"),
    ({"scaling": [("rope_type", "linear")]}, TypeError, "scaling"),
    ({"scaling": {"rope_type": "ntk"}}, ValueError, "default, linear, dynamic, yarn, longrope, llama3"),
    ({"scaling": {"rope_type": "linear"}}, ValueError, "factor"),
    ({"scaling": {"rope_type": "linear", "factor": -2.0}}, ValueError, "factor"),
    ({"scaling": {"rope_type": "dynamic", "factor": 2.0}}, ValueError, "original_max_position_embeddings"),
    ({"scaling": {"rope_type": "yarn", "original_max_position_embeddings": 64}}, ValueError, "factor"),
    ({"scaling": {"rope_type": "yarn", "factor": 4.0}}, ValueError, "original_max_position_embeddings"),
    ({"scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * 4,
                  "original_max_position_embeddings": 64, "factor": 2.0}}, ValueError, "short_factor"),
    ({"scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                  "original_max_position_embeddings": 64, "factor": 2.0}}, ValueError, "long_factor"),
    ({"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 64}}, ValueError, "high_freq_factor"),
    ({"scaling": {"rope_type": "default", "rope_theta": 0.0}}, ValueError, "rope_theta"),
    ({"xp": object()}, TypeError, "xp"),
]


@pytest.mark.parametrize(("override", "error", "name"), BAD_ARGUMENTS, ids=lambda v: repr(v)[:60])
def test_bad_argument_is_named(override, error, name):
    arguments = {"max_positions": 100, "rotary_dim": 8, **override}
    with pytest.raises(error, match=name):
        rope_tables(**arguments)


def test_inverse_frequencies_checks_max_positions():
    with pytest.raises(ValueError, match="max_positions"):
        inverse_frequencies(8, max_positions=0)
    with pytest.raises(TypeError, match="max_positions"):
        inverse_frequencies(8, max_positions=1.5)


# --------------------------------------------------------------------------- hostile parameters
# Every parameter out of range raises ValueError/TypeError naming it (never OverflowError,
# ZeroDivisionError, "math domain error" or MemoryError), and every accepted table is finite.

HUGE_INT = 10**400  # no float holds it
SCALING = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": True},
    "yarn-attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                       "attention_factor": 1.0},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                 "original_max_position_embeddings": 64, "factor": 4.0},
    "longrope-attention": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                           "original_max_position_embeddings": 64, "attention_factor": 1.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}
HOSTILE = [1e-308, 5e-324, 1e-30, [1, 2], math.nan, -math.nan, math.inf, -math.inf, -1, -1e-30, 0, 0.0, 1e30,
           1e38, 1e308, 2**63, 2**1000, HUGE_INT, "2", True, np.float64(np.nan), np.float32(1e-30),
           np.int64(2**62), np.array([1.0, 2.0])]


def _finite_table_or_named_error(name, call):
    """`call` returns a finite float32 table, or raises ValueError/TypeError whose message names `name`."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no overflow met on the way
        try:
            cos, sin = call()
        except (ValueError, TypeError) as exc:
            assert name in str(exc), f"{type(exc).__name__} does not name {name}: {exc}"
            return "raised"
    assert cos.dtype == np.float32 and sin.dtype == np.float32
    assert np.all(np.isfinite(cos)) and np.all(np.isfinite(sin)), f"non-finite table from {name}"
    return "accepted"


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("kind", sorted(SCALING))
def test_every_hostile_scaling_parameter_is_named_or_gives_a_finite_table(kind, numerics):
    params = SCALING[kind]
    outcomes = set()
    for key in [k for k in params if k != "rope_type"] + ["rope_theta", "max_position_embeddings"]:
        for value in HOSTILE:
            if key.endswith("_factor") and key.startswith(("short", "long")):
                value = [value] * 4 if not isinstance(value, (list, np.ndarray)) else value
            scaling = {**params, key: value}
            outcomes.add(_finite_table_or_named_error(
                key, lambda: rope_tables(100, 8, scaling=scaling, numerics=numerics)))
    for value in HOSTILE:
        outcomes.add(_finite_table_or_named_error(
            "base", lambda: rope_tables(100, 8, base=value, scaling=params, numerics=numerics)))
    assert outcomes == {"raised", "accepted"}


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("key", ["beta_fast", "beta_slow"])
@pytest.mark.parametrize("value", [1e-308, 5e-324, [1, 2], math.nan, math.inf, -math.inf, -1, 1e308, HUGE_INT,
                                   True, "32"])
def test_yarn_beta_is_validated(numerics, key, value):
    # Before: OverflowError (1e-308), "math domain error" (inf, -1), TypeError naming nothing ([1, 2]).
    scaling = {**SCALING["yarn"], key: value}
    with pytest.raises((ValueError, TypeError), match=re.escape(f"scaling['{key}']")):
        rope_tables(100, 8, scaling=scaling, numerics=numerics)


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("key", ["mscale", "mscale_all_dim"])
@pytest.mark.parametrize("value", [[1, 2], math.nan, math.inf, -1, -1e-3, HUGE_INT, True, "1"])
def test_yarn_mscale_is_validated(numerics, key, value):
    # Before: nan gave an all-NaN table, [1, 2] a TypeError naming nothing, -1 a negative gain.
    scaling = {**SCALING["yarn"], key: value}
    with pytest.raises((ValueError, TypeError), match=re.escape(f"scaling['{key}']")):
        rope_tables(100, 8, scaling=scaling, numerics=numerics)


def test_yarn_mscale_ratio_with_a_zero_denominator_is_named():
    # Before: ZeroDivisionError (0.1 * mscale_all_dim * log(factor) + 1 == 0).
    scaling = {**SCALING["yarn"], "factor": math.e**10, "mscale": 1.0, "mscale_all_dim": -1.0}
    with pytest.raises(ValueError, match=re.escape("scaling['mscale_all_dim']")):
        rope_tables(100, 8, scaling=scaling)


def test_yarn_truncate_must_be_a_bool():
    # Before: the string "no" counted as true.
    with pytest.raises(TypeError, match=re.escape("scaling['truncate']")):
        rope_tables(100, 8, scaling={**SCALING["yarn"], "truncate": "no"})
    a = rope_tables(100, 16, scaling={**SCALING["yarn"], "truncate": np.bool_(False)})
    b = rope_tables(100, 16, scaling={**SCALING["yarn"], "truncate": False})
    np.testing.assert_array_equal(a[0], b[0])


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("kind", ["yarn-attention", "longrope-attention"])
def test_attention_factor_past_float32_is_named(kind, numerics):
    # Before: 1e308 gave a table of infinities.
    with pytest.raises(ValueError, match=re.escape("scaling['attention_factor']")):
        rope_tables(100, 8, scaling={**SCALING[kind], "attention_factor": 1e308}, numerics=numerics)
    cos, _ = rope_tables(100, 8, scaling={**SCALING[kind], "attention_factor": 1e38}, numerics=numerics)
    assert np.isfinite(cos).all() and cos[0, 0] == np.float32(1e38)


@pytest.mark.parametrize(("base", "numerics"), [(5e-324, "exact"), (5e-324, "transformers"),
                                               (1e-308, "transformers")])
@pytest.mark.parametrize("kind", sorted(SCALING))
def test_base_whose_frequencies_overflow_is_named(kind, numerics, base):
    # Before: base=5e-324 gave tables of NaN (cos of an infinite angle). In float64, 1e-308 **
    # (-62 / 64) is finite, 5e-324 ** (-62 / 64) is not; float32 rounds both bases to zero.
    scaling = {**SCALING[kind]}
    for key in ("short_factor", "long_factor"):
        if key in scaling:
            scaling[key] = scaling[key] * 8
    with pytest.raises(ValueError, match=r"^base\b"):
        rope_tables(100, 64, base=base, scaling=scaling, numerics=numerics)
    with pytest.raises(ValueError, match=re.escape("scaling['rope_theta']")):
        rope_tables(100, 64, scaling={**scaling, "rope_theta": base}, numerics=numerics)


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("kind", ["linear", "yarn", "yarn-attention", "llama3"])
@pytest.mark.parametrize("factor", [1e-308, 5e-324])
def test_factor_whose_frequencies_overflow_is_named(kind, numerics, factor):
    # Before: linear factor=1e-308 gave an all-NaN table with numerics="transformers".
    with pytest.raises(ValueError, match=re.escape("scaling['factor']")):
        rope_tables(100, 8, scaling={**SCALING[kind], "factor": factor}, numerics=numerics)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_longrope_factor_lists_are_numbers_that_fit(numerics):
    base = SCALING["longrope"]
    with pytest.raises(ValueError, match=re.escape("scaling['short_factor']")):
        rope_tables(100, 8, scaling={**base, "short_factor": [1.0, 1.0, HUGE_INT, 1.0]}, numerics=numerics)
    with pytest.raises(TypeError, match=re.escape("scaling['long_factor']")):
        rope_tables(100, 8, scaling={**base, "long_factor": ["2"] * 4}, numerics=numerics)
    # 50 positions are within the original 64: the short factors apply.
    with pytest.raises(ValueError, match=re.escape("scaling['short_factor']")):
        rope_tables(50, 8, scaling={**base, "short_factor": [1e-308] * 4}, numerics=numerics)


def test_longrope_attention_needs_an_original_length_above_one():
    # Before: ZeroDivisionError (its attention factor divides by log(original)).
    scaling = {**SCALING["longrope"], "original_max_position_embeddings": 1}
    with pytest.raises(ValueError, match=re.escape("scaling['original_max_position_embeddings']")):
        rope_tables(100, 8, scaling=scaling)


@pytest.mark.parametrize("numerics", NUMERICS)
def test_dynamic_base_that_overflows_is_named(numerics):
    # Before: OverflowError (34, 'Numerical result out of range') from the rescaled base.
    scaling = {**SCALING["dynamic"], "factor": 2.0**1000}
    with pytest.raises(ValueError, match=re.escape("scaling['factor']")):
        rope_tables(100, 8, scaling=scaling, numerics=numerics)


@pytest.mark.parametrize("kind", ["dynamic", "yarn", "longrope", "llama3"])
@pytest.mark.parametrize("value", [2**31, 2**63, HUGE_INT])
def test_huge_original_length_is_named(kind, value):
    # Before: OverflowError "int too large to convert to float" (or a float32 overflow).
    scaling = {**SCALING[kind], "original_max_position_embeddings": value}
    with pytest.raises(ValueError, match=re.escape("scaling['original_max_position_embeddings']")):
        rope_tables(100, 8, scaling=scaling)


@pytest.mark.parametrize(("name", "value"), [("factor", HUGE_INT), ("factor", -HUGE_INT), ("base", HUGE_INT)])
def test_integer_beyond_float_range_is_named(name, value):
    # Before: OverflowError "int too large to convert to float".
    if name == "base":
        call = lambda: rope_tables(100, 8, base=value)  # noqa: E731
    else:
        call = lambda: rope_tables(100, 8, scaling={"rope_type": "linear", "factor": value})  # noqa: E731
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("value", [2**31, 2**31 + 1, 2**40, 2**63, 2**64, HUGE_INT])
def test_huge_max_positions_is_named(value):
    # Before: MemoryError (2**31) or NumPy's "Maximum allowed dimension exceeded" (2**63).
    with pytest.raises(ValueError, match=r"^max_positions\b"):
        rope_tables(value, 2)
    with pytest.raises(ValueError, match=r"^max_positions\b"):
        inverse_frequencies(8, max_positions=value)


@pytest.mark.parametrize("value", [2**17, 2**40, 2**62, 2**63, 2**64, HUGE_INT])
def test_huge_rotary_dim_is_named(value):
    # Before: MemoryError (2**40) or NumPy's "array is too big" (2**62 and up).
    with pytest.raises(ValueError, match=r"^rotary_dim\b"):
        rope_tables(4, value)
    with pytest.raises(ValueError, match=r"^rotary_dim\b"):
        inverse_frequencies(value)


def test_table_size_is_bounded():
    # Each bound alone is fine; the product asks for 2**32 entries (16 GiB per table).
    with pytest.raises(ValueError, match=r"max_positions.*rotary_dim"):
        rope_tables(2**26, 128)
    inverse_frequencies(128, max_positions=2**26)  # no table: only the context length counts


@pytest.mark.parametrize("numerics", NUMERICS)
def test_angles_that_overflow_are_named(numerics):
    # Frequencies that are finite, but whose angles at the last position are not.
    big = 1e36 if numerics == "transformers" else 1e306
    with pytest.raises(ValueError, match=re.escape("scaling['factor']")):
        rope_tables(1000, 8, scaling={"rope_type": "linear", "factor": 1 / big}, numerics=numerics)
    cos, sin = rope_tables(2, 8, scaling={"rope_type": "linear", "factor": 1 / big}, numerics=numerics)
    assert np.isfinite(cos).all() and np.isfinite(sin).all()


# -- configs transformers reads: Phi-3's legacy types, reversed llama3 factors, lengths as floats ----

_SHORT = [1.0 + 0.002 * i for i in range(48)]
_LONG = [1.0 + 1.2 * i for i in range(48)]
_PHI3 = {"short_factor": _SHORT, "long_factor": _LONG, "original_max_position_embeddings": 4096,
         "max_position_embeddings": 131072}


@pytest.mark.parametrize("legacy", ["su", "yarn"])
@pytest.mark.parametrize("rows,factors", [(4096, _SHORT), (4097, _LONG)])
def test_phi3_legacy_rope_types_are_longrope(legacy, rows, factors):
    # transformers' Phi3Config (convert_rope_params_to_dict in 5.x, _rope_scaling_adjustment in 4.x)
    # renames a Phi-3 rope_scaling of type "su" or "yarn" to "longrope".
    inv, att = inverse_frequencies(96, scaling={"type": legacy, **_PHI3}, max_positions=rows)
    want = 1.0 / (np.asarray(factors) * 10000.0 ** (np.arange(0, 96, 2) / 96))
    np.testing.assert_allclose(inv, want, rtol=1e-15)
    assert att == math.sqrt(1 + math.log(32) / math.log(4096))


def test_llama3_high_freq_factor_below_low_freq_factor_is_computed_as_transformers_does():
    # transformers only warns; its medium band is empty, so every wavelength above
    # original / low_freq_factor is divided by factor and the others are kept.
    inv, att = inverse_frequencies(128, base=500000.0, scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
        "original_max_position_embeddings": 8192})
    plain = 500000.0 ** -(np.arange(0, 128, 2) / 128)
    want = np.where(2 * np.pi / plain > 8192 / 4.0, plain / 8.0, plain)
    np.testing.assert_allclose(inv, want, rtol=1e-15)
    assert att == 1.0


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768.0},
    {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4096.0},
])
def test_integral_lengths_written_as_floats_are_read(scaling):
    as_int = {k: (int(v) if k.endswith("position_embeddings") else v) for k, v in scaling.items()}
    got = inverse_frequencies(128, base=500000.0, scaling=scaling, max_positions=9000)
    want = inverse_frequencies(128, base=500000.0, scaling=as_int, max_positions=9000)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]
