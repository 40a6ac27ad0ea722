"""The multimodal RoPE reference (rope_rtc.reference.mrope_reference), checked against cases
worked by hand: which position stream each frequency takes, contiguous (Qwen2-VL, Qwen2.5-VL) and
interleaved (Qwen3-VL), and one rotation computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from rope_rtc.reference import mrope_reference, mrope_streams, rope_reference


@pytest.mark.parametrize("section,interleaved,want", [
    ([2, 1, 1], False, [0, 0, 1, 2]),
    ([2, 1, 1], True, [0, 1, 2, 0]),
    ([16, 24, 24], False, [0] * 16 + [1] * 24 + [2] * 24),  # Qwen2-VL's [16, 24, 24] at head dim 128
    # Qwen3-VL's [24, 20, 20]: T H W repeated 20 times (indices 0..59), then T for 60..63
    ([24, 20, 20], True, [0, 1, 2] * 20 + [0] * 4),
])
def test_streams_by_hand(section, interleaved, want):
    assert mrope_streams(section, 2 * len(want), interleaved_sections=interleaved).tolist() == want


@pytest.mark.parametrize("section,exc,match", [
    ([2, 1], ValueError, "sums to 3"),
    ([2, 1, 2], ValueError, "sums to 5"),
    ([2, -1, 3], TypeError, "2, 3 or 4 non-negative ints"),
    ((2.0, 1, 1), TypeError, "2, 3 or 4 non-negative ints"),
    ([4], TypeError, "2, 3 or 4 non-negative ints"),
    ([1, 1, 1, 0, 1], TypeError, "2, 3 or 4 non-negative ints"),
    ([2, True, 1], TypeError, "2, 3 or 4 non-negative ints"),
])
def test_bad_sections(section, exc, match):
    with pytest.raises(exc, match=match):
        mrope_streams(section, 8)


def test_one_rotation_by_hand():
    # D = 8, sections [2, 1, 1]: pairs (x0, x4) and (x1, x5) take stream T, (x2, x6) H, (x3, x7) W.
    x = np.arange(1, 9, dtype=np.float64).reshape(1, 1, 8)
    positions = np.array([[0], [1], [2]])  # T = 0, H = 1, W = 2
    ang = np.array([[0.1, 0.2, 0.3, 0.4], [1.1, 1.2, 1.3, 1.4], [2.1, 2.2, 2.3, 2.4]])
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    got = mrope_reference(x, cos, sin, positions, [2, 1, 1])[0, 0]
    c = [cos[0, 0], cos[0, 1], cos[1, 2], cos[2, 3]]
    s = [sin[0, 0], sin[0, 1], sin[1, 2], sin[2, 3]]
    for i in range(4):
        x0, x1 = i + 1.0, i + 5.0
        assert got[i] == pytest.approx(x0 * float(c[i]) - x1 * float(s[i]), abs=1e-12)
        assert got[i + 4] == pytest.approx(x1 * float(c[i]) + x0 * float(s[i]), abs=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_equal_streams_are_plain_rope(interleaved):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 3, 64))
    ang = rng.uniform(-9, 9, (50, 32))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = rng.integers(0, 50, 7)
    got = mrope_reference(x, cos, sin, np.stack([pos, pos, pos]), [8, 12, 12], interleaved_sections=interleaved)
    np.testing.assert_array_equal(got, rope_reference(x, cos, sin, pos, interleaved=False))


def test_a_position_outside_the_table_gives_nan_for_its_pairs_only():
    x = np.ones((1, 1, 8))
    cos = sin = np.full((4, 4), 0.5, np.float32)
    got = mrope_reference(x, cos, sin, np.array([[0], [9], [1]]), [2, 1, 1])[0, 0]  # H = 9: outside
    assert np.isnan(got[[2, 6]]).all() and not np.isnan(got[[0, 1, 3, 4, 5, 7]]).any()


@pytest.mark.parametrize("interleaved", [False, True])
def test_kernel_arithmetic_is_within_the_bound_and_plain_rope_for_equal_streams(interleaved):
    import ml_dtypes

    from rope_rtc.reference import assert_rope_close, mrope_kernel_arithmetic, rope_kernel_arithmetic

    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 2, 64)).astype(ml_dtypes.bfloat16)
    ang = rng.uniform(-9, 9, (40, 32))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = rng.integers(0, 40, (3, 6))
    got = mrope_kernel_arithmetic(x, cos, sin, pos, [8, 12, 12], interleaved_sections=interleaved)
    ref = mrope_reference(x, cos, sin, pos, [8, 12, 12], interleaved_sections=interleaved)
    assert_rope_close(got, ref, x, interleaved=False, dtype=np.dtype(ml_dtypes.bfloat16))
    same = np.stack([pos[0]] * 3)
    np.testing.assert_array_equal(
        mrope_kernel_arithmetic(x, cos, sin, same, [8, 12, 12], interleaved_sections=interleaved).view(np.uint16),
        rope_kernel_arithmetic(x, cos, sin, pos[0], interleaved=False).view(np.uint16))
