"""Multimodal RoPE with 2 and 4 position streams on the CPU: the n-stream reference against a
straightforward loop written here, the NumPy backend against the reference, the checks that name
the argument, the build a call gets and its block (fake device arrays, recorded launches), and
the new builds compiled with NVRTC for sm_90. Three streams: test_mrope.py."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from fakes import BF16, fake_cupy
from rope_rtc import MRopePlan, apply_mrope, apply_mrope_qk
from rope_rtc.build import registry
from rope_rtc.reference import assert_rope_close, mrope_kernel_arithmetic, mrope_reference, mrope_streams


def streams_by_loop(section, interleaved: bool) -> list[int]:
    """The stream of each pair column, written as transformers assigns them: contiguous sections
    one after another; interleaved, stream k > 0 takes columns k, k + n, ... below n * s_k (the
    slice ``k : n * s_k : n`` of Qwen3-VL's ``apply_interleaved_mrope``), the rest stream 0."""
    n, half = len(section), sum(section)
    out = [0] * half
    if not interleaved:
        at = 0
        for k, s in enumerate(section):
            for i in range(at, at + s):
                out[i] = k
            at += s
        return out
    for k in range(1, n):
        for i in range(k, min(n * section[k], half), n):
            out[i] = k
    return out


def rotate_by_loop(x, cos, sin, positions, section, interleaved):
    """Half-split rotation in float64, one pair at a time: pair i of token t reads the table at
    row ``positions[stream(i), t]``."""
    streams = streams_by_loop(section, interleaved)
    half = len(streams)
    out = x.astype(np.float64).copy()
    for t in range(x.shape[0]):
        for i in range(half):
            row = positions[streams[i], t]
            c, s = float(cos[row, i]), float(sin[row, i])
            x0, x1 = x[t, :, i].astype(np.float64), x[t, :, i + half].astype(np.float64)
            out[t, :, i] = x0 * c - x1 * s
            out[t, :, i + half] = x1 * c + x0 * s
    return out


SECTIONS = [(20, 20), (7, 9), (8, 8, 8, 8), (10, 7, 8, 7), (16, 24, 24), (11, 0, 21)]


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_streams_match_the_loop(section, interleaved):
    got = mrope_streams(list(section), 2 * sum(section), interleaved_sections=interleaved)
    assert got.tolist() == streams_by_loop(section, interleaved)


def test_streams_by_hand():
    assert mrope_streams([2, 2], 8).tolist() == [0, 0, 1, 1]
    assert mrope_streams([2, 2], 8, interleaved_sections=True).tolist() == [0, 1, 0, 1]
    # four streams interleaved: 0 1 2 3 0 1 2 3, then the remainder to stream 0
    assert mrope_streams([3, 2, 2, 1], 16, interleaved_sections=True).tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert mrope_streams([1, 1, 1, 1], 8).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_matches_the_loop(section, interleaved):
    rng = np.random.default_rng(sum(section) + interleaved)
    n, half = len(section), sum(section)
    x = rng.standard_normal((5, 3, 2 * half))
    ang = rng.uniform(-9, 9, (30, half))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = rng.integers(0, 30, (n, 5))
    got = mrope_reference(x, cos, sin, pos, list(section), interleaved_sections=interleaved)
    np.testing.assert_allclose(got, rotate_by_loop(x, cos, sin, pos, section, interleaved), rtol=0, atol=1e-12)
    bits = mrope_kernel_arithmetic(x.astype(np.float32), cos, sin, pos, list(section),
                                   interleaved_sections=interleaved)
    assert_rope_close(bits, got, x.astype(np.float32), interleaved=False, dtype=np.dtype(np.float32))


def test_reference_refuses_positions_of_another_stream_count():
    x = np.ones((4, 1, 16))
    cos = sin = np.ones((8, 8), np.float32)
    with pytest.raises(ValueError, match=r"\[len\(mrope_section\), N\] = \(2, 4\)"):
        mrope_reference(x, cos, sin, np.zeros((3, 4), np.int64), [4, 4])


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("section,interleaved", [((20, 20), False), ((20, 20), True), ((8, 12, 12, 8), False),
                                                 ((8, 12, 12, 8), True)])
def test_numpy_backend_against_the_reference(dtype, section, interleaved):
    rng = np.random.default_rng(3)
    n, d, T = len(section), 2 * sum(section), 13
    q = rng.standard_normal((T, 4, d)).astype(dtype)
    k = rng.standard_normal((T, 2, d)).astype(dtype)
    ang = rng.uniform(-20, 20, (50, d // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = rng.integers(0, 50, (n, T)).astype(np.int32)
    oq, ok = apply_mrope_qk(q, k, cos, sin, pos, list(section), interleaved_sections=interleaved, backend="numpy")
    for out, x in ((oq, q), (ok, k)):
        want = mrope_reference(x, cos, sin, pos, section, interleaved_sections=interleaved)
        assert out.dtype == x.dtype
        assert_rope_close(out, want, x, interleaved=False, dtype=np.dtype(dtype))
    # batched layout: [n, B, S] positions
    qb = q.reshape(1, T, 4, d)
    out = apply_mrope(qb, cos, sin, pos.reshape(n, 1, T), section, interleaved_sections=interleaved,
                      layout="bshd", backend="numpy")
    np.testing.assert_array_equal(out.reshape(T, 4, d).view(np.uint8), oq.view(np.uint8))


@pytest.mark.parametrize("section,positions,exc,match", [
    ([20, 20], (3, 6), ValueError, r"positions: expected shape \(2, 6\).*first axis \(3 streams\) disagrees with "
                                   r"mrope_section's 2 sections"),
    ([10, 10, 10, 10], (3, 6), ValueError, r"positions: expected shape \(4, 6\).*disagrees with mrope_section's 4"),
    ([16, 24, 24], (2, 6), ValueError, r"positions: expected shape \(3, 6\).*disagrees with mrope_section's 3"),
    ([20, 21], (2, 6), ValueError, r"mrope_section: \[20, 21\] sums to 41; it must sum to rotary_dim / 2 = 40"),
    ([10, 10, 10, 11], (4, 6), ValueError, "sums to 41"),
    ([40], (1, 6), TypeError, "mrope_section: expected 2, 3 or 4 non-negative ints"),
    ([8, 8, 8, 8, 8], (5, 6), TypeError, "mrope_section: expected 2, 3 or 4 non-negative ints"),
    ([20, -20, 40], (3, 6), TypeError, "mrope_section: expected 2, 3 or 4 non-negative ints"),
])
@pytest.mark.parametrize("backend", ["numpy", "nvrtc"])
def test_bad_calls_name_the_argument(gpu, section, positions, exc, match, backend):
    rng = np.random.default_rng(4)
    if backend == "numpy":
        q, k = (rng.standard_normal((6, h, 80)).astype(np.float32) for h in (4, 2))
        cos = sin = np.ones((8, 40), np.float32)
        pos = rng.integers(0, 8, positions).astype(np.int64)
    else:
        q, k = fake_cupy((6, 4, 80), BF16), fake_cupy((6, 2, 80), BF16)
        cos = sin = fake_cupy((8, 40), np.float32)
        pos = fake_cupy(positions, np.int64)
    with pytest.raises(exc, match=match):
        apply_mrope_qk(q, k, cos, sin, pos, section, backend=backend)
    assert gpu.launches == []


def test_a_plan_names_a_stream_count_mismatch(gpu):
    q, k = fake_cupy((6, 4, 80), BF16), fake_cupy((6, 2, 80), BF16)
    cos = sin = fake_cupy((8, 40), np.float32)
    with pytest.raises(ValueError, match="disagrees with mrope_section's 2 sections"):
        MRopePlan(q, k, cos, sin, fake_cupy((3, 6), np.int64), [20, 20])
    plan = MRopePlan(q, k, cos, sin, fake_cupy((2, 6), np.int64), [20, 20])
    with pytest.raises(ValueError, match="disagrees with mrope_section's 2 sections"):
        plan.execute(q, k, cos, sin, fake_cupy((3, 6), np.int64))
    assert gpu.launches == []


@pytest.mark.parametrize("section,interleaved,D", [((20, 20), False, 80), ((18, 18), False, 72),
                                                   ((20, 20), True, 80), ((8, 8, 8, 8), False, 64),
                                                   ((10, 7, 8, 7), True, 64)])
@pytest.mark.parametrize("tokens", [6, 4096])
def test_the_specialised_build_serves_2_and_4_streams(gpu, section, interleaved, D, tokens):
    """Head dims that are not powers of two (80, 72) take the specialised build too, with the
    stream count compiled in (FIX_MN) and the block's positions and stream stride."""
    n, H = len(section), 16
    q, k = fake_cupy((tokens, H, D), BF16), fake_cupy((tokens, H, D), BF16)
    cos = sin = fake_cupy((64, D // 2), np.float32)
    pos = fake_cupy((n, tokens), np.int32)
    apply_mrope_qk(q, k, cos, sin, pos, list(section), interleaved_sections=interleaved, q_out=q, k_out=k)
    (rec,) = gpu.launches
    g, p = rec["geometry"], rec["fixed"]
    assert rec["fn"][0] == "rope_fixed"  # the specialised build, as for every MRoPE call
    assert g.mrope == ((2 if interleaved else 1),) + section and (g.head_dim, g.rotary_dim) == (D, D)
    assert (g.q_heads, g.k_heads, g.interleaved, g.dense) == (H, H, False, True)
    defines = dict(g.spec().defines)
    assert defines["FIX_MN"] == str(n) and defines["FIX_D"] == str(D) and defines["FIX_MROPE"] == str(g.mrope[0])
    assert [defines.get(name) for name in registry.MROPE_SECTION_DEFINES[:n]] == [str(v) for v in section]
    assert not any(name in defines for name in registry.MROPE_SECTION_DEFINES[n:])
    assert g.spec().family == "rope_fixed"
    assert p.positions == pos.data.ptr and p.mrope_stride == tokens and not p.index_flags & 1
    assert (p.in_[0], p.in_[1]) == (q.data.ptr, k.data.ptr)
    # large launches share the table slice across heads, small ones do not
    assert g.head_batch == (1 if tokens == 6 else 2)


def test_three_streams_keep_their_defines():
    """The three-stream builds' defines are what they were: no FIX_MN, so their kernels compile
    the same source (and keep their cache keys' defines)."""
    for interleaved, sec in ((False, (16, 24, 24)), (True, (24, 20, 20))):
        for g in registry.mrope_geometries("bfloat16", 28, 4, 128, 128, sec, interleaved, False):
            names = [k for k, _ in g.spec().defines]
            assert names[-4:] == ["FIX_MROPE", "FIX_MT", "FIX_MH", "FIX_MW"] and "FIX_MN" not in names


def test_a_batched_layout_with_two_streams(gpu):
    B, S, H, D = 2, 5, 16, 64
    q = fake_cupy((B, H, S, D), BF16)
    pos = fake_cupy((2, B, S), np.int64)
    cos = sin = fake_cupy((32, D // 2), np.float32)
    out, _ = apply_mrope_qk(q, fake_cupy((B, H, S, D), BF16), cos, sin, pos, [16, 16], layout="bhsd")
    rec = gpu.launches[-1]
    assert rec["geometry"].order == 1 and rec["fixed"].mrope_stride == B * S and out.shape == q.shape
    with pytest.raises(ValueError, match=r"positions: expected shape \(2, 2, 5\) \(\[2, B, S\]"):
        apply_mrope_qk(q, q, cos, sin, fake_cupy((3, B, S), np.int64), [16, 16], layout="bhsd")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_two_and_four_stream_builds_compile_for_sm_90(dtype, tmp_path, monkeypatch):
    from rope_rtc.build.kernels import get_binary
    from rope_rtc.build.toolchain import target_for

    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path))
    for section, style in (((20, 20), 1), ((20, 20), 2), ((18, 18), 1), ((10, 6, 8, 8), 1), ((10, 6, 8, 8), 2)):
        d = 2 * sum(section)
        for order in (False, True):
            g = dataclasses.replace(registry.fixed_geometry(dtype, False, 16, 16, d, 0, d, order),
                                    mrope=(style,) + section)
            for build in registry.both_strides([g]):
                assert get_binary(build.spec(), target_for(90)).data
