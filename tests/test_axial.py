"""Axial RoPE of vision towers on the CPU: ``axial_tables`` in both styles against the formulas
written here (exact) and against float32 arithmetic (transformers numerics), ``vision_positions``
against a NumPy re-implementation of transformers' patch orders (Qwen2-VL/2.5-VL's
``rot_pos_emb`` reshape and permute, Pixtral's meshgrid), the NumPy backend of a vision call
against the rotation written out, and ``warm --model`` of a vision-language config. On the GPU:
test_gpu_axial.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import rope_rtc
from rope_rtc import apply_mrope_qk, axial_tables, vision_positions
from rope_rtc.numerics.axial import axial_frequencies
from rope_rtc.reference import assert_rope_close


def formula_frequencies(head_dim: int, base: float, style: str) -> np.ndarray:
    """Column j's frequency, from the issue's formulas in float64."""
    if style == "same":
        a = base ** (-4.0 * np.arange(head_dim // 4) / head_dim)
        return np.concatenate([a, a])
    inv = base ** (-2.0 * np.arange(head_dim // 2) / head_dim)
    return np.concatenate([inv[0::2], inv[1::2]])


@pytest.mark.parametrize("style", ["same", "split"])
@pytest.mark.parametrize("head_dim,base", [(80, 10000.0), (64, 10000.0), (72, 1e6), (128, 500.0)])
def test_exact_tables_follow_the_formulas(style, head_dim, base):
    cos, sin = axial_tables(300, head_dim, base=base, style=style)
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == (300, head_dim // 2)
    angles = np.arange(300)[:, None] * formula_frequencies(head_dim, base, style)[None, :]
    np.testing.assert_allclose(cos, np.cos(angles), rtol=0, atol=1e-7)
    np.testing.assert_allclose(sin, np.sin(angles), rtol=0, atol=1e-7)


def test_the_styles_by_hand():
    # head dim 8: "same" has a = [1, base^-1/2]; "split" a = [1, base^-1/2], b = [base^-1/4, base^-3/4]
    np.testing.assert_allclose(axial_frequencies(8, base=16.0, style="same"), [1, 0.25, 1, 0.25])
    np.testing.assert_allclose(axial_frequencies(8, base=16.0, style="split"), [1, 0.25, 0.5, 0.125])


def transformers_frequencies(head_dim: int, base: float, style: str) -> np.ndarray:
    """``1.0 / base ** (arange(0, dim, 2).float() / dim)`` in float32 steps (dim = D/2 for the
    Qwen towers' "same", D for Pixtral's "split"); the power rounded once from float64."""
    dim = head_dim // 2 if style == "same" else head_dim
    exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    inv = np.float32(1.0) / (np.float64(np.float32(base)) ** exponent.astype(np.float64)).astype(np.float32)
    return np.concatenate([inv, inv]) if style == "same" else np.concatenate([inv[0::2], inv[1::2]])


@pytest.mark.parametrize("style", ["same", "split"])
@pytest.mark.parametrize("head_dim", [80, 64, 72])
def test_transformers_tables_are_float32_arithmetic(style, head_dim):
    freqs = axial_frequencies(head_dim, base=10000.0, style=style, numerics="transformers")
    assert freqs.dtype == np.float32
    np.testing.assert_array_equal(freqs, transformers_frequencies(head_dim, 10000.0, style))
    cos, sin = axial_tables(200, head_dim, style=style, numerics="transformers")
    # torch.outer of float32 positions and frequencies: each angle one float32 product
    angles = np.arange(200, dtype=np.float32)[:, None] * freqs[None, :]
    assert angles.dtype == np.float32
    np.testing.assert_array_equal(cos, np.cos(angles.astype(np.float64)).astype(np.float32))
    np.testing.assert_array_equal(sin, np.sin(angles.astype(np.float64)).astype(np.float32))
    exact = axial_tables(200, head_dim, style=style)[0]
    assert 0 < np.abs(cos - exact).max() < 1e-4  # the two numerics differ, a little


def test_xp_and_chunked_rows():
    class Module:
        @staticmethod
        def asarray(a):
            return ("wrapped", a)

    cos, sin = axial_tables(3, 8, xp=Module)
    assert cos[0] == "wrapped" and cos[1].shape == (3, 4)
    big_cos, _ = axial_tables(40000, 16, style="split")  # past one chunk of rows
    np.testing.assert_array_equal(big_cos[39990:], axial_tables(40000, 16, style="split")[0][39990:])
    small = axial_tables(10, 16, style="split")[0]
    np.testing.assert_array_equal(big_cos[:10], small)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(max_positions=0, head_dim=80), ValueError, "max_positions must be positive"),
    (dict(max_positions=8.0, head_dim=80), TypeError, "max_positions must be an int"),
    (dict(max_positions=8, head_dim=78), ValueError, "head_dim must be a multiple of 4"),
    (dict(max_positions=8, head_dim=True), TypeError, "head_dim must be an int"),
    (dict(max_positions=8, head_dim=80, style="axial"), ValueError, "style must be one of 'same', 'split'"),
    (dict(max_positions=8, head_dim=80, numerics="torch"), ValueError, "numerics must be one of"),
    (dict(max_positions=8, head_dim=80, base=float("nan")), ValueError, "base"),
    (dict(max_positions=8, head_dim=80, xp=object()), TypeError, "xp must be an array module"),
    (dict(max_positions=2**30, head_dim=80), ValueError, "the limit is"),
])
def test_bad_table_arguments_are_named(kw, exc, match):
    with pytest.raises(exc, match=match):
        axial_tables(**kw)


def hf_patch_order(grid_thw, m: int) -> np.ndarray:
    """transformers' Qwen2-VL/2.5-VL ``rot_pos_emb`` positions, in NumPy: per image, h positions
    ``arange(h)[:, None]`` expanded to (h, w), reshaped (h/m, m, w/m, m), permuted (0, 2, 1, 3) and
    flattened; w likewise; stacked, repeated t times; images concatenated. ``[2, N]``."""
    out = []
    for t, h, w in grid_thw:
        hpos = np.broadcast_to(np.arange(h)[:, None], (h, w)).reshape(h // m, m, w // m, m)
        wpos = np.broadcast_to(np.arange(w)[None, :], (h, w)).reshape(h // m, m, w // m, m)
        pair = np.stack([hpos.transpose(0, 2, 1, 3).ravel(), wpos.transpose(0, 2, 1, 3).ravel()], axis=-1)
        out.append(np.tile(pair, (t, 1)))
    return np.concatenate(out).T


def pixtral_order(sizes, max_width: int) -> np.ndarray:
    """Pixtral's ``position_ids_in_meshgrid``: ``h * max_width + w`` over an ``ij`` meshgrid of each
    image, read back as (h, w)."""
    ids = np.concatenate([(np.arange(h)[:, None] * max_width + np.arange(w)[None, :]).ravel() for h, w in sizes])
    return np.stack([ids // max_width, ids % max_width])


@pytest.mark.parametrize("grid,m", [([[1, 4, 6]], 2), ([[2, 6, 4], [1, 2, 2], [3, 8, 10]], 2), ([[1, 9, 6]], 3),
                                    ([[1, 36, 52]], 2), ([[4, 4, 4]], 4)])
def test_qwen_order_matches_transformers_reshape_and_permute(grid, m):
    got = vision_positions(np.array(grid), spatial_merge_size=m)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, hf_patch_order(grid, m))


def test_merge_order_by_hand():
    # a 2 x 4 grid, 2 x 2 blocks: block (0, 0) then block (0, 1), each row-major inside
    got = vision_positions([[1, 2, 4]], spatial_merge_size=2)
    assert got.tolist() == [[0, 0, 1, 1, 0, 0, 1, 1], [0, 1, 0, 1, 2, 3, 2, 3]]


def test_merge_size_one_is_pixtrals_row_major_order():
    sizes = [(3, 5), (4, 2), (1, 7)]
    got = vision_positions([[1, h, w] for h, w in sizes], spatial_merge_size=1)
    np.testing.assert_array_equal(got, pixtral_order(sizes, max_width=64))


def test_random_grids_with_a_fixed_seed():
    rng = np.random.default_rng(45)
    for _ in range(20):
        m = int(rng.integers(1, 4))
        grid = [[int(rng.integers(1, 4)), m * int(rng.integers(1, 6)), m * int(rng.integers(1, 6))]
                for _ in range(int(rng.integers(1, 4)))]
        np.testing.assert_array_equal(vision_positions(grid, spatial_merge_size=m), hf_patch_order(grid, m))


@pytest.mark.parametrize("grid,kw,exc,match", [
    ([[1, 5, 4]], dict(spatial_merge_size=2), ValueError, r"grid_thw: row 0 is \(t, h, w\) = \(1, 5, 4\); h and w "
                                                          "must be multiples of spatial_merge_size 2"),
    ([[1, 4]], dict(spatial_merge_size=2), TypeError, r"grid_thw: expected an integer array \[images, 3\]"),
    ([[1.0, 4, 4]], dict(spatial_merge_size=2), TypeError, "grid_thw: expected an integer array"),
    ([[0, 4, 4]], dict(spatial_merge_size=2), ValueError, "grid_thw: every t, h and w must be positive"),
    ([[1, 4, 4]], dict(spatial_merge_size=0), ValueError, "spatial_merge_size must be positive"),
    ([[1, 4, 4]], dict(spatial_merge_size=2.0), TypeError, "spatial_merge_size must be an int"),
    ([[1, 4, 4]], dict(spatial_merge_size=2, xp=None), TypeError, "xp must be an array module"),
])
def test_bad_position_arguments_are_named(grid, kw, exc, match):
    with pytest.raises(exc, match=match):
        vision_positions(grid, **kw)


def test_a_single_grid_row_and_the_missing_merge_size():
    np.testing.assert_array_equal(vision_positions([1, 2, 2], spatial_merge_size=1), [[0, 0, 1, 1], [0, 1, 0, 1]])
    with pytest.raises(TypeError, match="spatial_merge_size"):
        vision_positions([[1, 2, 2]])  # keyword-only and required: the order depends on it


def vision_rotary_written_out(x, cos, sin, positions):
    """transformers' ``apply_rotary_pos_emb_vision`` in float64 with the table's values: the
    angle table of each patch is ``cat(f_h, f_w)`` (h's columns, then w's), doubled for the whole
    head, and ``x * cos + rotate_half(x) * sin``."""
    h, w = positions
    quarter = cos.shape[1] // 2
    c = np.concatenate([cos[h, :quarter], cos[w, quarter:]], axis=-1).astype(np.float64)
    s = np.concatenate([sin[h, :quarter], sin[w, quarter:]], axis=-1).astype(np.float64)
    c, s = np.concatenate([c, c], -1)[:, None, :], np.concatenate([s, s], -1)[:, None, :]
    x = x.astype(np.float64)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * c + rotated * s


@pytest.mark.parametrize("style,head_dim,grid,m", [("same", 80, [[1, 8, 12], [2, 4, 4]], 2),
                                                   ("split", 64, [[1, 6, 5]], 1), ("same", 72, [[1, 6, 6]], 2)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_a_vision_call_on_the_numpy_backend(style, head_dim, grid, m, dtype):
    pos = vision_positions(grid, spatial_merge_size=m)
    n = pos.shape[1]
    rng = np.random.default_rng(7)
    q = (rng.standard_normal((n, 4, head_dim)) * 2).astype(dtype)
    k = (rng.standard_normal((n, 4, head_dim)) * 2).astype(dtype)
    cos, sin = axial_tables(int(pos.max()) + 1, head_dim, style=style)
    quarter = head_dim // 4
    oq, ok = apply_mrope_qk(q, k, cos, sin, pos, [quarter, quarter], backend="numpy")
    for out, x in ((oq, q), (ok, k)):
        assert_rope_close(out, vision_rotary_written_out(x, cos, sin, pos), x, interleaved=False,
                          dtype=np.dtype(dtype))


def test_public_names():
    assert "axial_tables" in rope_rtc.__all__ and "vision_positions" in rope_rtc.__all__
    assert rope_rtc.axial_tables.__module__ == "rope_rtc.numerics.axial"


# -- warm --model of a vision-language config -----------------------------------------------------

QWEN25_VL = {"model_type": "qwen2_5_vl", "torch_dtype": "bfloat16", "hidden_size": 2048, "num_attention_heads": 16,
             "num_key_value_heads": 2, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
             "vision_config": {"depth": 32, "hidden_size": 1280, "num_heads": 16, "out_hidden_size": 2048,
                               "spatial_merge_size": 2, "window_size": 112}}
PIXTRAL = {"model_type": "llava", "torch_dtype": "bfloat16",
           "text_config": {"model_type": "mistral", "hidden_size": 5120, "head_dim": 128, "num_attention_heads": 32,
                           "num_key_value_heads": 8},
           "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "num_attention_heads": 16,
                             "head_dim": 64, "rope_theta": 10000.0}}
QWEN2_VL = {"model_type": "qwen2_vl", "torch_dtype": "bfloat16", "hidden_size": 1536, "num_attention_heads": 12,
            "num_key_value_heads": 2, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "vision_config": {"embed_dim": 1280, "hidden_size": 1536, "num_heads": 16}}


@pytest.mark.parametrize("config,want", [(QWEN25_VL, (80, 16)), (PIXTRAL, (64, 16)), (QWEN2_VL, (80, 16)),
                                         ({**QWEN25_VL, "vision_config": {**QWEN25_VL["vision_config"],
                                                                          "hidden_size": 1152}}, (72, 16))])
def test_a_vision_language_config_reads_its_vision_tower(config, want):
    from rope_rtc.numerics.model import from_config

    model = from_config(config)
    assert model.vision == want
    d, heads = want
    specs = model.vision_specs()
    defines = [dict(s.defines) for s in specs]
    assert specs and set(s.name for s in specs) <= set(s.name for s in model.specs())
    assert all(x["FIX_MN"] == "2" and x["FIX_MROPE"] == "1" and (x["FIX_MT"], x["FIX_MH"]) == (str(d // 4),) * 2
               and x["FIX_D"] == x["FIX_RD"] == str(d) for x in defines)
    assert {(x["FIX_HQ"], x["FIX_HK"]) for x in defines} == {(str(heads), str(heads)), (str(heads), "0")}
    assert {x["FIX_ORDER"] for x in defines} == {"0", "1"} and {x.get("FIX_DENSE") for x in defines} == {None, "1"}


def test_the_builds_a_vision_plan_loads_are_warmed(monkeypatch):
    from fakes import BF16, FakeGPU, fake_cupy
    from rope_rtc.numerics.model import from_config
    from rope_rtc.ops import rope_plan

    model = from_config(QWEN25_VL)
    loaded = []

    def record_fixed(g, device, pdl=False):
        loaded.append(g.spec().name)
        return "rope_fixed"

    with FakeGPU() as gpu:
        gpu.patch(rope_plan, "load_fixed_function", record_fixed)
        for layout, shape, pos in (("thd", (64, 16, 80), (2, 64)), ("bhsd", (1, 16, 64, 80), (2, 1, 64))):
            cos = fake_cupy((64, 40), np.float32)
            for k in (fake_cupy(shape, BF16), None):
                rope_rtc.MRopePlan(fake_cupy(shape, BF16), k, cos, cos, fake_cupy(pos, np.int64), [20, 20],
                                   layout=layout).compile()
    # every vision build a plan loads is warmed, and every warmed one is loaded by some plan
    assert set(loaded) == {s.name for s in model.vision_specs()}


@pytest.mark.parametrize("vision,match", [
    ({"hidden_size": 1280}, "vision_config: num_attention_heads must be a positive int"),
    ({"hidden_size": 1280, "num_heads": 3}, "vision_config: hidden_size 1280 is not a multiple of num_heads 3"),
    ({"hidden_size": 1260, "num_heads": 14}, "vision head_dim: 90 is not a multiple of 4"),
    ({"hidden_size": 1280, "num_heads": 10**6}, "vision_config: num_heads must be in 1.."),
    ([], "vision_config must be a JSON object"),
])
def test_a_bad_vision_config_is_named(vision, match):
    from rope_rtc.numerics.model import from_config

    with pytest.raises(ValueError, match=match):
        from_config({**QWEN25_VL, "vision_config": vision})


def test_towers_without_rope_warm_nothing_for_vision():
    from rope_rtc.numerics.model import from_config

    gemma3 = {"model_type": "gemma3", "torch_dtype": "bfloat16",
              "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "head_dim": 256,
                              "num_attention_heads": 8, "num_key_value_heads": 4},
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "num_attention_heads": 16}}
    assert from_config(gemma3).vision == () and from_config(gemma3).vision_specs() == []


def test_warm_model_warms_the_vision_tower_and_a_second_run_compiles_nothing(tmp_path, capsys, monkeypatch):
    """``rope-rtc warm --model`` on a vision-language config compiles the tower's builds with the
    text model's; a second run finds every one cached. The text model's own builds are left out
    here (``ModelRope.specs`` is narrowed to the vision builds), which the slow test of
    test_model.py warms."""
    import json

    from rope_rtc import cli
    from rope_rtc.numerics import model as model_module

    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN25_VL))
    monkeypatch.setattr(model_module.ModelRope, "specs", model_module.ModelRope.vision_specs)
    argv = ["warm", "--arch", "sm_90", "--model", str(config), "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    count = len(model_module.from_config(QWEN25_VL).vision_specs())
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "vision tower: head_dim 80, 16 heads (axial RoPE)" in out
    assert f"compiled {count}, already cached 0, failed 0" in out
    assert cli.main(argv) == 0
    assert f"compiled 0, already cached {count}, failed 0" in capsys.readouterr().out


@pytest.mark.parametrize("numerics,base", [("transformers", 1e-37), ("exact", 1e-312)])
def test_a_base_whose_angles_overflow_is_refused_as_rope_tables_refuses_it(numerics, base):
    # axial_tables checked the frequencies at one position only and returned tables holding NaN.
    import warnings

    with pytest.raises(ValueError, match=r"base=.* gives an angle that overflows at position 999"):
        rope_rtc.rope_tables(1000, 128, base=base, numerics=numerics)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning from the attempt either
        with pytest.raises(ValueError, match=r"base=.* gives an angle that overflows at position 999 .*with head_dim "
                                             r"256 and numerics") as info:
            rope_rtc.axial_tables(1000, 256, base=base, numerics=numerics)
    assert "rotary_dim" not in str(info.value)  # not an argument of axial_tables
