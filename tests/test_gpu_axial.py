"""Multimodal RoPE with 2 and 4 position streams, and vision towers' axial RoPE, on the GPU: bit
for bit against the kernel-arithmetic reference over dtypes, section styles and layouts (outputs
poisoned with NaN first); three streams unchanged; ``axial_tables`` and ``vision_positions``
against Hugging Face transformers' Qwen2.5-VL / Qwen3-VL vision rotary embeddings
(``apply_rotary_pos_emb_vision``) and Pixtral's (``apply_rotary_pos_emb``), built by
tests/transformers_refs.py as the installed version builds them (the same checks run on the CPU in
test_transformers_refs.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gpu_util import DTYPES, bits, host_random, host_tables, poisoned
from rope_rtc.numerics.axial import axial_frequencies
from rope_rtc.reference import assert_rope_close, mrope_kernel_arithmetic, mrope_reference

pytestmark = pytest.mark.gpu

P = 96
# (sections, head dim): two streams at Qwen2.5-VL's head dim 80 and Qwen3-VL's 72 (sections not
# whole vectors), Pixtral's 64; four streams, whole and not whole vectors.
CASES = [((20, 20), 80), ((18, 18), 72), ((16, 16), 64), ((8, 8, 8, 8), 64), ((10, 6, 9, 7), 64)]


def _to_layout(x, layout):
    """``x`` [B, S, H, D] in ``layout`` (thd: B = 1)."""
    return x[0] if layout == "thd" else np.ascontiguousarray(np.transpose(x, (0, 2, 1, 3)))


def _from_layout(y, layout):
    return y[None] if layout == "thd" else np.transpose(y, (0, 2, 1, 3))


@pytest.mark.parametrize("dtype,case,interleaved,layout,in_place", list(itertools.product(
    ["bfloat16", "float16", "float32"], CASES, [False, True], ["thd", "bhsd"], [False, True])))
def test_bit_exact_against_the_kernel_arithmetic(dtype, case, interleaved, layout, in_place):
    import cupy as cp

    import rope_rtc

    section, D = case
    n, HQ, HK = len(section), 4, 2
    B, S = (1, 37) if layout == "thd" else (2, 9)
    qh = host_random((B, S, HQ, D), DTYPES[dtype], 11, 2.0)
    kh = host_random((B, S, HK, D), DTYPES[dtype], 12, 2.0)
    cos, sin = host_tables(P, D // 2, 13)
    pos = np.random.default_rng(14).integers(0, P, (n, B, S)).astype(np.int32)
    q, k = cp.asarray(_to_layout(qh, layout)), cp.asarray(_to_layout(kh, layout))
    q_out = q if in_place else poisoned(cp, q.shape, DTYPES[dtype])
    k_out = k if in_place else poisoned(cp, k.shape, DTYPES[dtype])
    dpos = cp.asarray(pos[:, 0] if layout == "thd" else pos)
    rope_rtc.apply_mrope_qk(q, k, cp.asarray(cos), cp.asarray(sin), dpos, list(section),
                            interleaved_sections=interleaved, layout=layout, q_out=q_out, k_out=k_out)
    flat = pos.reshape(n, -1)
    for out, host, h in ((q_out, qh, HQ), (k_out, kh, HK)):
        x = host.reshape(B * S, h, D)
        actual = _from_layout(cp.asnumpy(out), layout).reshape(B * S, h, D)
        want = mrope_kernel_arithmetic(x, cos, sin, flat, section, interleaved_sections=interleaved)
        np.testing.assert_array_equal(bits(actual), bits(want))
        ref = mrope_reference(x, cos, sin, flat, section, interleaved_sections=interleaved)
        assert_rope_close(actual, ref, x, interleaved=False, dtype=np.dtype(DTYPES[dtype]))


@pytest.mark.parametrize("case", CASES)
def test_a_large_launch_and_numpy_backend_agree(case):
    """A prefill-sized call (heads shared per thread) against the NumPy backend's reference, and
    the GPU result through host arrays."""
    import cupy as cp

    import rope_rtc

    section, D = case
    n, T, H = len(section), 4096, 16
    qh, kh = host_random((T, H, D), DTYPES["bfloat16"], 21, 2.0), host_random((T, H, D), DTYPES["bfloat16"], 22, 2.0)
    cos, sin = host_tables(P, D // 2, 23)
    pos = np.random.default_rng(24).integers(0, P, (n, T)).astype(np.int64)
    got = rope_rtc.apply_mrope_qk(cp.asarray(qh), cp.asarray(kh), cp.asarray(cos), cp.asarray(sin), cp.asarray(pos),
                                  list(section))
    for out, x in zip(got, (qh, kh)):
        want = mrope_kernel_arithmetic(x, cos, sin, pos, section)
        np.testing.assert_array_equal(bits(cp.asnumpy(out)), bits(want))
    host = rope_rtc.apply_mrope_qk(qh, kh, cos, sin, pos, list(section), backend="nvrtc")
    np.testing.assert_array_equal(bits(host[0]), bits(cp.asnumpy(got[0])))


@pytest.mark.parametrize("interleaved,section", [(False, [16, 24, 24]), (True, [24, 20, 20]), (False, [10, 27, 27])])
def test_three_streams_unchanged(interleaved, section):
    """Three streams run the builds they always did: bit for bit the kernel arithmetic."""
    import cupy as cp

    import rope_rtc

    D, T = 128, 300
    qh = host_random((T, 8, D), DTYPES["bfloat16"], 31, 2.0)
    cos, sin = host_tables(P, D // 2, 32)
    pos = np.random.default_rng(33).integers(0, P, (3, T)).astype(np.int64)
    out = poisoned(cp, qh.shape, DTYPES["bfloat16"])
    rope_rtc.apply_mrope(cp.asarray(qh), cp.asarray(cos), cp.asarray(sin), cp.asarray(pos), section,
                         interleaved_sections=interleaved, out=out)
    want = mrope_kernel_arithmetic(qh, cos, sin, pos, section, interleaved_sections=interleaved)
    np.testing.assert_array_equal(bits(cp.asnumpy(out)), bits(want))


# -- against transformers ----------------------------------------------------------------------
# The constructions and checks are tests/transformers_refs.py's, run on the CPU with the NumPy
# backend and the kernels' arithmetic by test_transformers_refs.py; here the kernel runs them.

def _kernel_rotate(q, k, cos, sin, pos, section, layout):
    """apply_mrope_qk on the GPU into NaN-poisoned outputs; host results, checked bit for bit
    against the kernel arithmetic on the same tables."""
    import cupy as cp

    import rope_rtc

    q_out, k_out = poisoned(cp, q.shape, q.dtype), poisoned(cp, k.shape, k.dtype)
    rope_rtc.apply_mrope_qk(cp.asarray(q), cp.asarray(k), cp.asarray(cos), cp.asarray(sin), cp.asarray(pos),
                            list(section), layout=layout, q_out=q_out, k_out=k_out)
    got = cp.asnumpy(q_out), cp.asnumpy(k_out)
    flat = np.asarray(pos).reshape(len(section), -1)
    for out, x in zip(got, (q, k)):
        tok = x if layout == "thd" else np.transpose(x[0], (1, 0, 2))
        want = mrope_kernel_arithmetic(tok, cos, sin, flat, section)
        actual = out if layout == "thd" else np.transpose(out[0], (1, 0, 2))
        np.testing.assert_array_equal(bits(actual), bits(want))
    return got


@pytest.mark.device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family,heads,head_dim", [("qwen2_5_vl", 16, 80), ("qwen2_5_vl", 16, 72),
                                                   ("qwen3_vl", 16, 72)])
def test_against_qwen2_5_vl_vision(family, heads, head_dim, dtype):
    """Qwen2.5-VL's (and Qwen3-VL's) vision tower, as transformers builds it (4.4x: the tower's
    ``rot_pos_emb``; 5.x: the vision rotary embedding on ``get_vision_position_ids``): our
    ``vision_positions`` are its position ids; its cos/sin gathered into axial tables;
    ``apply_mrope_qk`` on them bit for bit the kernel arithmetic, and within the bound of
    ``apply_rotary_pos_emb_vision`` run on the GPU."""
    import transformers_refs as refs

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    refs.check_qwen_vision(family, heads, head_dim, dtype, _kernel_rotate, device="cuda")


@pytest.mark.device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_against_pixtral(dtype):
    """Pixtral's tower (4.x ``PixtralRotaryEmbedding``, 5.x ``PixtralVisionRotaryEmbedding``): our
    row-major ``vision_positions`` are its (h, w); its float32 cos/sin gathered into "split" axial
    tables; ``apply_mrope_qk`` (bhsd) bit for bit the kernel arithmetic and within the bound of
    transformers' ``apply_rotary_pos_emb`` (bf16: on the float32 upcast, rounded once)."""
    import transformers_refs as refs

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    refs.check_pixtral(16, 64, dtype, _kernel_rotate, device="cuda")


@pytest.mark.device
@pytest.mark.parametrize("numerics", ["transformers", "exact"])
def test_axial_tables_against_transformers_on_the_device(numerics):
    """``axial_tables`` against the cos/sin transformers computes on the GPU (CUDA's float32
    cos/sin and pow): "transformers" frequencies within an ulp of its inv_freq, the tables within
    the inv_freq noise bound plus CUDA's cos/sin error."""
    import transformers_refs as refs

    import rope_rtc

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    ref = refs.qwen_vision("qwen2_5_vl", refs.QWEN_GRID, 16, 80, device="cuda")
    freqs = axial_frequencies(80, style="same", numerics=numerics)
    assert refs.ulps32(axial_frequencies(80, style="same", numerics="transformers"), ref.inv_freq).max() <= 1
    cos, sin = rope_rtc.axial_tables(20, 80, style="same", numerics=numerics)
    pos = ref.positions
    p = np.concatenate([np.repeat(pos[:1], 20, 0), np.repeat(pos[1:], 20, 0)]).T.astype(np.float64)  # [N, D/2]
    angle = np.abs(p * ref.inv_freq.astype(np.float64)).astype(np.float32)
    # the frequencies' and the angle's float32 roundings, and CUDA's cosf/sinf (within 2 ulps)
    bound = p * np.abs(freqs - ref.inv_freq.astype(np.float64)) + np.spacing(angle) + 2.0**-22
    for table, hf in ((cos, ref.cos), (sin, ref.sin)):
        tok = np.concatenate([table[pos[0], :20], table[pos[1], 20:]], -1)
        assert np.all(np.abs(tok - hf.cpu().numpy()[:, :40]) <= bound)


@pytest.mark.parametrize("style,numerics", [("same", "exact"), ("split", "transformers")])
def test_axial_tables_on_the_device(style, numerics):
    """``xp=cupy`` tables are the NumPy ones, and a vision call on them is the NumPy backend's
    result within the bound."""
    import cupy as cp

    import rope_rtc

    D, grid = 80, [[1, 10, 14]]
    cos_d, sin_d = rope_rtc.axial_tables(32, D, style=style, numerics=numerics, xp=cp)
    cos_h, sin_h = rope_rtc.axial_tables(32, D, style=style, numerics=numerics)
    np.testing.assert_array_equal(cp.asnumpy(cos_d), cos_h)
    pos = rope_rtc.vision_positions(grid, spatial_merge_size=2, xp=cp)
    x = host_random((140, 16, D), DTYPES["bfloat16"], 41, 2.0)
    out = rope_rtc.apply_mrope(cp.asarray(x), cos_d, sin_d, pos, [20, 20])
    ref = mrope_reference(x, cos_h, sin_h, cp.asnumpy(pos), [20, 20])
    assert_rope_close(cp.asnumpy(out), ref, x, interleaved=False, dtype=np.dtype(DTYPES["bfloat16"]))
