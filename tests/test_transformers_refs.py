"""The GPU tests' comparisons with Hugging Face transformers, run on the CPU: the same
constructions and checks (tests/transformers_refs.py) with our ops on ``backend="numpy"``, and
again with the kernels' exact arithmetic (``mrope_kernel_arithmetic``, what the GPU computes bit
for bit) standing in for the GPU. Needs torch and transformers: skipped where either is missing
(the project's venv, CI)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import transformers_refs as R  # noqa: E402
from helpers import bits  # noqa: E402

import rope_rtc  # noqa: E402
from rope_rtc.numerics.axial import axial_frequencies  # noqa: E402
from rope_rtc.reference import assert_rope_close, mrope_kernel_arithmetic, mrope_reference  # noqa: E402


def _tokens(a: np.ndarray, layout: str) -> np.ndarray:
    """thd [N, H, D] as is; bhsd [1, H, N, D] as [N, H, D]."""
    return a if layout == "thd" else np.transpose(a[0], (1, 0, 2))


def _from_tokens(a: np.ndarray, layout: str) -> np.ndarray:
    return a if layout == "thd" else np.transpose(a, (1, 0, 2))[None]


def numpy_rotate(q, k, cos, sin, pos, section, layout):
    return rope_rtc.apply_mrope_qk(q, k, cos, sin, pos, section, layout=layout, backend="numpy")


def kernel_arithmetic_rotate(q, k, cos, sin, pos, section, layout):
    """What the GPU kernel computes, bit for bit: the GPU tests' stand-in on the CPU."""
    flat = pos.reshape(len(section), -1)
    return tuple(_from_tokens(mrope_kernel_arithmetic(_tokens(x, layout), cos, sin, flat, section), layout)
                 for x in (q, k))


def _exact_check(res: dict, layout: str, dtype: str) -> None:
    """The NumPy backend's output is the float64 reference rounded once: within the general bound."""
    flat = res["positions"].reshape(2, -1)
    for got, x in zip(res["got"], res["x"]):
        xt = _tokens(x, layout)
        ref = mrope_reference(xt, res["cos"], res["sin"], flat, res["section"])
        assert_rope_close(_tokens(got, layout), ref, xt, interleaved=False, dtype=np.dtype(x.dtype))


@pytest.mark.parametrize("rotate", [numpy_rotate, kernel_arithmetic_rotate], ids=["numpy", "kernel-arithmetic"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family,heads,head_dim", [("qwen2_5_vl", 16, 80), ("qwen2_5_vl", 16, 72),
                                                   ("qwen3_vl", 16, 72), ("qwen3_vl", 16, 64)])
def test_qwen_vision_rotation(family, heads, head_dim, dtype, rotate):
    res = R.check_qwen_vision(family, heads, head_dim, dtype, rotate)
    _exact_check(res, "thd", dtype)
    print(f"{res['ref'].source}: worst {res['worst']:.3f} of the bound")


@pytest.mark.parametrize("rotate", [numpy_rotate, kernel_arithmetic_rotate], ids=["numpy", "kernel-arithmetic"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pixtral_rotation(dtype, rotate):
    res = R.check_pixtral(16, 64, dtype, rotate)
    _exact_check(res, "bhsd", dtype)
    print(f"{res['ref'].source}: worst {res['worst']:.3f} of the bound")


def test_the_kernel_stand_in_is_the_gpu_contract():
    """kernel_arithmetic_rotate is the arithmetic the GPU tests hold the kernel to bit for bit:
    on transformers' Qwen2.5-VL tables it differs from the NumPy backend by at most an ulp."""
    a = R.check_qwen_vision("qwen2_5_vl", 4, 80, "bfloat16", numpy_rotate)
    b = R.check_qwen_vision("qwen2_5_vl", 4, 80, "bfloat16", kernel_arithmetic_rotate)
    for x, y in zip(a["got"], b["got"]):
        diff = np.abs(bits(x).astype(np.int32) - bits(y).astype(np.int32))
        assert diff.max() <= 1


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vision_positions_and_window_order(family):
    """vision_positions is transformers' own position ids (merge size 2, a two-frame video);
    Qwen2.5-VL's window permutation applied to our positions as docs/axial.md says gives the
    tower's permuted cos/sin, read from our tables."""
    ref = R.qwen_vision(family, R.QWEN_GRID, 16, 80)
    pos = rope_rtc.vision_positions(R.QWEN_GRID, spatial_merge_size=2)
    np.testing.assert_array_equal(pos, ref.positions)
    assert pos.shape[1] == 16 * 20 + 2 * 8 * 6
    if ref.window_index is None:
        return
    wi = ref.window_index.cpu().numpy()
    m2 = 4
    perm = pos.reshape(2, -1, m2)[:, wi].reshape(2, -1)  # the docs' recipe
    cos_tok = ref.cos.cpu().numpy()
    table = R.axial_table_from_tokens(cos_tok, pos, 20)
    hf_perm = cos_tok.reshape(-1, m2, cos_tok.shape[-1])[wi].reshape(cos_tok.shape)  # permute_input_for_window_attn
    ours = np.concatenate([table[perm[0], :20], table[perm[1], 20:]], -1)
    np.testing.assert_array_equal(ours.view(np.uint32), hf_perm[:, :40].view(np.uint32))
    assert not np.array_equal(wi, np.arange(wi.size))  # the permutation is not the identity here


@pytest.mark.parametrize("numerics", ["transformers", "exact"])
@pytest.mark.parametrize("which", ["qwen2_5_vl/80", "qwen3_vl/72", "pixtral/64"])
def test_axial_tables_against_transformers(which, numerics):
    """axial_tables: "transformers" frequencies are transformers' inv_freq bit for bit (CPU
    torch), its cos/sin within 1 ulp of torch's at every patch; "exact" within the float32
    rounding of transformers' frequencies and angles (the inv_freq noise bound)."""
    family, d = which.split("/")
    head_dim = int(d)
    if family == "pixtral":
        ref = R.pixtral_vision(R.PIXTRAL_SIZES, 16, head_dim, R.PIXTRAL_SIDE)
        style, rows = "split", R.PIXTRAL_SIDE
    else:
        ref = R.qwen_vision(family, R.QWEN_GRID, 16, head_dim)
        style, rows = "same", 20
    freqs = axial_frequencies(head_dim, style=style, numerics=numerics)
    cos, sin = rope_rtc.axial_tables(rows, head_dim, style=style, numerics=numerics)
    pos = ref.positions
    q = head_dim // 4
    tok_cos = np.concatenate([cos[pos[0], :q], cos[pos[1], q:]], -1)
    tok_sin = np.concatenate([sin[pos[0], :q], sin[pos[1], q:]], -1)
    hf_cos, hf_sin = ref.cos.cpu().numpy()[:, : 2 * q], ref.sin.cpu().numpy()[:, : 2 * q]
    if numerics == "transformers":
        assert R.ulps32(freqs, ref.inv_freq).max() == 0
        worst = max(R.ulps32(tok_cos, hf_cos).max(), R.ulps32(tok_sin, hf_sin).max())
        assert worst <= 1
    else:
        p = np.concatenate([np.repeat(pos[:1], q, 0), np.repeat(pos[1:], q, 0)]).T.astype(np.float64)  # [N, D/2]
        angle = np.abs(p * ref.inv_freq.astype(np.float64)).astype(np.float32)
        bound = p * np.abs(freqs - ref.inv_freq.astype(np.float64)) + np.spacing(angle) + 2.0**-23
        worst = max((np.abs(tok_cos - hf_cos) / bound).max(), (np.abs(tok_sin - hf_sin) / bound).max())
        assert worst <= 1
        assert np.abs(tok_cos - hf_cos).max() > 0  # the two numerics really differ
    print(f"{which} {numerics}: worst {worst:.3g}, max |cos diff| {np.abs(tok_cos - hf_cos).max():.3g}")


def _mla_numpy(q, k_pe, kv_c, cos, sin, positions, slots, cache):
    q_out, k_out, _ = rope_rtc.mla_rope_and_cache(q, k_pe, kv_c, cos, sin, positions, slots, cache, backend="numpy")
    return q_out, k_out


@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.707])
def test_deepseek_v3_rotation(mscale_all_dim):
    res = R.check_deepseek_v3(mscale_all_dim, _mla_numpy)
    print(f"att {res['att']:.6f}: tables {res['table_ulps']} ulp, inv_freq {res['inv_ulps']} ulp, rotation max |diff| "
          f"{res['max_abs']:.3g}, worst {res['worst']:.3f} of the bound")
