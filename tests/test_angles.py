"""cos and sin computed in the kernel from inv_freq (``apply_rope(..., inv_freq=)``) on the CPU:
the NumPy backend against table calls, the host checks, which build a call gets and the block the
plan writes (fake device arrays); the kernels' accuracy is test_gpu_angles.py's."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import BF16, FakeGPU, fake_cupy
from rope_rtc import RopePlan, apply_rope, apply_rope_qk, inverse_frequencies, rope_tables
from rope_rtc.build.registry import ANGLE_MODES, angle_geometries, angle_head_batch
from rope_rtc.ops.rope_request import ANGLE_POSITIONS
from rope_rtc.tables import angle_rows

SCALINGS = [None, {"rope_type": "linear", "factor": 4.0},
            {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64},
            {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096},
            {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [3.0 + i for i in range(16)],
             "original_max_position_embeddings": 32, "max_position_embeddings": 256},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}]


@pytest.mark.parametrize("numerics", ["exact", "transformers"])
@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: "default" if s is None else s["rope_type"])
def test_angle_rows_are_the_table_rows(numerics, scaling):
    rows = 200
    cos, sin = rope_tables(rows, 32, base=5e5, scaling=scaling, numerics=numerics)
    f, att = inverse_frequencies(32, base=5e5, scaling=scaling, max_positions=rows, numerics=numerics)
    assert f.dtype == (np.float64 if numerics == "exact" else np.float32)
    pos = np.random.default_rng(0).permutation(rows)
    c, s = angle_rows(pos, f, att)
    assert np.array_equal(c, cos[pos]) and np.array_equal(s, sin[pos])


@pytest.mark.parametrize("numerics", ["exact", "transformers"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_numpy_backend_with_inv_freq_is_the_table_call(numerics, interleaved):
    rng = np.random.default_rng(1)
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    cos, sin = rope_tables(512, 64, base=1e4, scaling=scaling, numerics=numerics)
    f, att = inverse_frequencies(64, base=1e4, scaling=scaling, numerics=numerics)
    q = rng.standard_normal((2, 7, 4, 64)).astype(np.float32)
    k = rng.standard_normal((2, 7, 2, 64)).astype(np.float32)
    pos = rng.integers(0, 512, (2, 7))
    want = apply_rope_qk(q, k, cos, sin, positions=pos, interleaved=interleaved, backend="numpy", layout="bshd")
    got = apply_rope_qk(q, k, inv_freq=f, attention_scaling=att, positions=pos, interleaved=interleaved,
                        backend="numpy", layout="bshd")
    for a, b in zip(got, want):
        assert np.array_equal(a, b)
    # Offsets, cu_seqlens and a partial window (in place) too.
    x = rng.standard_normal((9, 3, 64)).astype(np.float32)
    cu = np.array([0, 4, 9])
    a = apply_rope(x.copy(), inv_freq=f[:16], attention_scaling=att, cu_seqlens=cu, offset=np.array([3, 100]),
                   layout="thd", rotary_dim=32, interleaved=interleaved, backend="numpy")
    b = apply_rope(x.copy(), cos[:, :16], sin[:, :16], cu_seqlens=cu, offset=np.array([3, 100]), layout="thd",
                   rotary_dim=32, interleaved=interleaved, backend="numpy")
    assert np.array_equal(a, b)


def test_positions_past_any_table_are_accepted_up_to_2_31():
    f, _ = inverse_frequencies(16)
    x = np.random.default_rng(2).standard_normal((1, 2, 1, 16)).astype(np.float32)
    out = apply_rope(x, inv_freq=f, positions=np.array([[ANGLE_POSITIONS - 1, 2**20]]), backend="numpy", layout="bshd")
    c, s = angle_rows(np.array([ANGLE_POSITIONS - 1, 2**20]), f, 1.0)
    x0, x1 = x[0, :, 0, :8].astype(np.float64), x[0, :, 0, 8:].astype(np.float64)
    assert np.allclose(out[0, :, 0, :8], x0 * c - x1 * s, atol=1e-6)
    with pytest.raises(ValueError, match=r"positions: entry 1 is 2147483648, outside the positions inv_freq serves \(0..2147483647\)"):
        apply_rope(x, inv_freq=f, positions=np.array([[0, ANGLE_POSITIONS]]), backend="numpy", layout="bshd")
    with pytest.raises(ValueError, match="offset"):
        apply_rope(x, inv_freq=f, offset=-1, backend="numpy", layout="bshd")


def test_bad_inv_freq_calls_raise_naming_the_argument():
    f, _ = inverse_frequencies(16)
    cos, sin = rope_tables(8, 16)
    x = np.random.default_rng(3).standard_normal((1, 2, 1, 16)).astype(np.float32)
    before = x.copy()
    cases = [
        (dict(inv_freq=f, cos=cos, sin=sin), TypeError, "cos/sin: pass inv_freq"),
        (dict(inv_freq=f, cos_sin_cache=np.concatenate([cos, sin], 1)), TypeError, "cos_sin_cache: pass inv_freq"),
        (dict(cos=cos, sin=sin, attention_scaling=2.0), TypeError, "attention_scaling: only with inv_freq"),
        (dict(inv_freq=f.astype(np.float16)), TypeError, "inv_freq: .*float64"),
        (dict(inv_freq=f[:4]), ValueError, "inv_freq: has 4 entries but rotary_dim 16 needs 8"),
        (dict(inv_freq=f.reshape(2, 4)), ValueError, "inv_freq"),
        (dict(inv_freq=np.repeat(f, 2)[::2]), ValueError, "inv_freq"),  # strided
        (dict(inv_freq=f, attention_scaling=True), TypeError, "attention_scaling: expected a float"),
        (dict(inv_freq=f, attention_scaling="2"), TypeError, "attention_scaling: expected a float"),
        (dict(inv_freq=f, attention_scaling=-1.0), ValueError, "attention_scaling: expected a finite positive"),
        (dict(inv_freq=f, attention_scaling=float("inf")), ValueError, "attention_scaling"),
        (dict(inv_freq=f, attention_scaling=1e39), ValueError, "attention_scaling"),
        # past float's range as an int (OverflowError before), and below float32's normal range
        # (every cos and sin rounded to zero)
        (dict(inv_freq=f, attention_scaling=10**400), ValueError, "attention_scaling"),
        (dict(inv_freq=f, attention_scaling=1e-50), ValueError, "attention_scaling: .*normal range"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            apply_rope(x, out=x, backend="numpy", layout="bshd", **kw)
        assert np.array_equal(x, before)


def test_head_batches_of_the_angle_builds():
    assert angle_head_batch(32, 8, small=True) == 1
    assert angle_head_batch(32, 8, small=False) == 4
    assert angle_head_batch(28, 4, small=False) == 4
    assert angle_head_batch(6, 0, small=False) == 2
    assert angle_head_batch(7, 1, small=False) == 1
    small, large = angle_geometries("bfloat16", False, 32, 8, 128, 0, 128, "float64", False)
    assert (small.angles, large.angles) == (ANGLE_MODES["float64"],) * 2
    assert (small.head_batch, large.head_batch) == (1, 4)
    assert (small.vec, large.vec) == (2, 4)  # decode: half the pairs per thread
    small, large = angle_geometries("float32", True, 32, 8, 128, 0, 128, "float64", False)
    assert (small.vec, large.vec) == (2, 4)  # interleaved: a whole pair at least
    assert dict(large.spec().defines)["FIX_ANGLES"] == "1"
    assert "FIX_ANGLES" not in dict(small.__class__(**{**small.__dict__, "angles": 0}).spec().defines)
    assert angle_geometries("bfloat16", False, 32, 8, 128, 0, 12, "float32", False) == []


@pytest.fixture
def gpu():
    with FakeGPU(fixed=True) as g:
        yield g


def test_a_call_runs_the_angle_build_with_its_block(gpu):
    f = fake_cupy((64,), np.float64)
    q, k = fake_cupy((2, 5, 32, 128), BF16), fake_cupy((2, 5, 8, 128), BF16)
    pos = fake_cupy((2, 5), np.int64)
    apply_rope_qk(q, k, inv_freq=f, attention_scaling=1.5, positions=pos, q_out=q, k_out=k, layout="bshd")
    rec = gpu.launches[-1]
    g, p = rec["geometry"], rec["fixed"]
    assert rec["fn"][0] == "rope_fixed" and g.angles == ANGLE_MODES["float64"] and g.head_batch == 1  # small
    assert (p.cos, p.attention, p.table_rows, p.table_stride) == (f.data.ptr, 1.5, ANGLE_POSITIONS, 0)
    # A large launch takes 4 heads per thread; float32 inv_freq the "transformers" build.
    q, k = fake_cupy((4, 4096, 32, 128), BF16), fake_cupy((4, 4096, 8, 128), BF16)
    f32 = fake_cupy((64,), np.float32)
    apply_rope_qk(q, k, inv_freq=f32, offset=3, q_out=q, k_out=k, layout="bshd")
    g, p = gpu.launches[-1]["geometry"], gpu.launches[-1]["fixed"]
    assert (g.angles, g.head_batch, p.attention, p.offset) == (ANGLE_MODES["float32"], 4, 1.0, 3)
    assert p.total == 4 * 4096 * 10 * (64 // g.vec)  # tokens, head groups, vector units


def test_the_repeat_path_rebinds_inv_freq_and_a_new_factor_is_a_new_plan(gpu):
    f1, f2 = fake_cupy((64,), np.float64), fake_cupy((64,), np.float64)
    q = fake_cupy((8, 1, 32, 128), BF16)
    apply_rope(q, inv_freq=f1, out=q, offset=5, layout="bshd")
    apply_rope(q, inv_freq=f2, out=q, offset=6, layout="bshd")
    assert gpu.launches[-1]["fixed"].cos == f2.data.ptr and gpu.launches[-1]["fixed"].offset == 6
    apply_rope(q, inv_freq=f2, attention_scaling=2.0, out=q, layout="bshd")
    assert gpu.launches[-1]["fixed"].attention == 2.0
    apply_rope(q, inv_freq=f2, out=q, layout="bshd")
    assert gpu.launches[-1]["fixed"].attention == 1.0


def test_plans_with_inv_freq(gpu):
    f = fake_cupy((64,), np.float64)
    q, k = fake_cupy((3, 32, 128), BF16), fake_cupy((3, 8, 128), BF16)
    pos = fake_cupy((3,), np.int32)
    plan = RopePlan(q, k, inv_freq=f, attention_scaling=0.5, positions=pos, layout="thd").compile()
    assert plan.inv_freq_dtype == "float64" and plan.attention == 0.5
    plan.execute(q, k, positions=pos, inv_freq=f)
    assert gpu.launches[-1]["fixed"].cos == f.data.ptr and gpu.launches[-1]["fixed"].attention == 0.5
    n = len(gpu.launches)
    cos, sin = fake_cupy((8, 64), np.float32), fake_cupy((8, 64), np.float32)
    with pytest.raises(TypeError, match="this plan computes cos and sin from inv_freq"):
        plan.execute(q, k, cos, sin, positions=pos)
    with pytest.raises(ValueError, match="inv_freq dtype float32"):
        plan.execute(q, k, positions=pos, inv_freq=fake_cupy((64,), np.float32))
    with pytest.raises(TypeError, match="cos: pass inv_freq"):
        plan.execute(q, k, cos, positions=pos, inv_freq=f)
    table_plan = RopePlan(q, k, cos, sin, positions=pos, layout="thd")
    with pytest.raises(TypeError, match="this plan reads cos/sin tables"):
        table_plan.execute(q, k, positions=pos, inv_freq=f)
    assert len(gpu.launches) == n


def test_what_the_angle_kernel_cannot_serve_is_refused_before_launch(gpu):
    f = fake_cupy((32,), np.float64)
    x, y = fake_cupy((1, 5, 4, 128), BF16), fake_cupy((1, 5, 4, 128), BF16)
    with pytest.raises(NotImplementedError, match="out of place"):
        apply_rope(x, inv_freq=f, rotary_dim=64, out=y, layout="bshd")
    apply_rope(x, inv_freq=f, rotary_dim=64, out=x, layout="bshd")  # in place: served
    with pytest.raises(NotImplementedError, match="whole number"):
        apply_rope(x, inv_freq=fake_cupy((3,), np.float64), rotary_dim=6, out=x, layout="bshd")
    n = len(gpu.launches)
    z = fake_cupy((1, 5, 4, 128), BF16, byte_offset=2)
    with pytest.raises(ValueError, match="not aligned"):
        apply_rope(z, inv_freq=fake_cupy((64,), np.float64), out=z, layout="bshd")
    assert len(gpu.launches) == n


def test_alignment_is_checked_for_the_build_the_call_runs(gpu):
    # 4-byte aligned: enough for the decode build's 4-byte vectors, not the prefill build's 8.
    f = fake_cupy((64,), np.float64)
    small = fake_cupy((8, 1, 32, 128), BF16, byte_offset=4)
    apply_rope(small, inv_freq=f, out=small, layout="bshd")
    assert gpu.launches[-1]["geometry"].vec == 2
    n = len(gpu.launches)
    large = fake_cupy((1, 4096, 32, 128), BF16, byte_offset=4)
    with pytest.raises(ValueError, match="not aligned to 8 bytes"):
        apply_rope(large, inv_freq=f, out=large, layout="bshd")
    assert len(gpu.launches) == n


def test_a_table_plan_missing_sin_names_sin(gpu):
    # Regression: the inv_freq check named inv_freq for a table plan's call that forgot sin.
    cos, sin = fake_cupy((8, 64), np.float32), fake_cupy((8, 64), np.float32)
    q, k = fake_cupy((3, 32, 128), BF16), fake_cupy((3, 8, 128), BF16)
    plan = RopePlan(q, k, cos, sin, layout="thd")
    with pytest.raises(TypeError, match="^sin: "):
        plan.execute(q, k, cos)
    with pytest.raises(TypeError, match="inv_freq: this plan reads cos/sin tables"):
        plan.execute(q, k, inv_freq=fake_cupy((64,), np.float64))


def test_an_inv_freq_plan_no_build_serves_is_refused_when_built(gpu):
    f = fake_cupy((32,), np.float64)
    q, k = fake_cupy((3, 4, 128), BF16), fake_cupy((3, 2, 128), BF16)
    qo, ko = fake_cupy((3, 4, 128), BF16), fake_cupy((3, 2, 128), BF16)
    with pytest.raises(NotImplementedError, match="out of place"):
        RopePlan(q, k, inv_freq=f, rotary_dim=64, q_out=qo, k_out=ko, layout="thd")
    with pytest.raises(NotImplementedError, match="whole number"):
        RopePlan(q, k, inv_freq=fake_cupy((3,), np.float64), rotary_dim=6, layout="thd")
    plan = RopePlan(q, k, inv_freq=f, rotary_dim=64, layout="thd")  # in place: served
    plan.execute(q, k, inv_freq=f)
    assert gpu.launches[-1]["geometry"].angles
    with pytest.raises(TypeError, match="cos_sin_cache: this plan computes cos and sin from inv_freq"):
        plan.execute(q, k, cos_sin_cache=fake_cupy((8, 64), np.float32))


def test_host_inv_freq_values_are_checked():
    f, _ = inverse_frequencies(16)
    x = np.random.default_rng(5).standard_normal((1, 2, 1, 16)).astype(np.float32)
    for bad in (np.nan, np.inf, 2.0**21):
        g = f.copy()
        g[3] = bad
        with pytest.raises(ValueError, match="inv_freq: entry 3"):
            apply_rope(x, inv_freq=g, backend="numpy", layout="bshd")
