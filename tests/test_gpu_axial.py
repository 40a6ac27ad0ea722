"""Multimodal RoPE with 2 and 4 position streams, and vision towers' axial RoPE, on the GPU: bit
for bit against the kernel-arithmetic reference over dtypes, section styles and layouts (outputs
poisoned with NaN first); three streams unchanged; ``axial_tables`` and ``vision_positions``
against Hugging Face transformers' Qwen2.5-VL vision rotary embedding (``rot_pos_emb``,
``apply_rotary_pos_emb_vision``) and Pixtral's (``PixtralRotaryEmbedding``,
``apply_rotary_pos_emb``)."""

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

def _device_copy(cp, t, dtype):
    """A CuPy copy of torch tensor ``t`` (bfloat16 through the host: CuPy has no bfloat16 of its
    own, and the value round-trips through float32 exactly)."""
    return cp.asarray(t.float().cpu().numpy().astype(DTYPES[dtype]))


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 ulps between a and b."""
    ia, ib = (np.asarray(v, np.float32).view(np.int32).astype(np.int64) for v in (a, b))
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return np.abs(ia - ib)


def _close_to_transformers(cp, got, want_t, x_t, dtype):
    """Our result against transformers' on the same cos/sin: float32 within the rotation's bound
    (transformers multiplies and adds separately); 16-bit within one ulp of transformers' result
    (both round an FP32 rotation once), and within the documented bound of the float64 rotation."""
    g = cp.asnumpy(got)
    w = want_t.float().cpu().numpy().astype(np.float64)
    x = x_t.float().cpu().numpy().astype(np.float32)
    g32 = g.astype(np.float32)
    assert np.isfinite(g32).all()
    if dtype == "float32":
        assert_rope_close(g.reshape(-1, *g.shape[-2:]), w.reshape(-1, *w.shape[-2:]), x.reshape(-1, *x.shape[-2:]),
                          interleaved=False, dtype=np.dtype(np.float32))
    else:
        _, exponent = np.frexp(np.abs(w))
        ulp = np.ldexp(1.0, exponent.astype(np.int64) - 8)  # bfloat16: 8 significant bits
        assert (np.abs(g32 - w) <= ulp + 2.0**-22 * np.abs(x).max()).all()


@pytest.mark.device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,head_dim", [(16, 80), (16, 72)])
def test_against_qwen2_5_vl_vision(dtype, heads, head_dim):
    """Qwen2.5-VL's vision tower: transformers' ``rot_pos_emb`` angles at our
    ``vision_positions`` (merge size 2) are its own angles in its own order, bit for bit; our
    "transformers" table's frequencies are its ``inv_freq`` within an ulp (torch's pow), its cos/sin
    within two ulps; ``apply_mrope_qk`` on the tower's own cos/sin table matches
    ``apply_rotary_pos_emb_vision``."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import cupy as cp

    import rope_rtc
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    grid = [[1, 16, 20], [2, 8, 6]]
    config = Qwen2_5_VLVisionConfig(depth=1, hidden_size=heads * head_dim, num_heads=heads, intermediate_size=64,
                                    out_hidden_size=64, spatial_merge_size=2, fullatt_block_indexes=[0])
    tower = hf.Qwen2_5_VisionTransformerPretrainedModel(config).cuda()
    grid_t = torch.tensor(grid, device="cuda")
    angles_hf = tower.rot_pos_emb(grid_t).float()  # [N, D/2]: h angles then w angles
    pos = rope_rtc.vision_positions(grid, spatial_merge_size=2)
    side = int(max(max(r[1], r[2]) for r in grid))
    full = tower.rotary_pos_emb(side).float()  # [side, D/4]: transformers' float32 angles
    full_np = full.cpu().numpy()
    ours = np.concatenate([full_np[pos[0]], full_np[pos[1]]], axis=-1)
    np.testing.assert_array_equal(ours.view(np.uint32), angles_hf.cpu().numpy().view(np.uint32))
    # our frequencies and table against the tower's: the frequencies within an ulp (torch's pow);
    # where they agree, the table within two ulps of torch's cos/sin (the design page's bound)
    freqs = axial_frequencies(head_dim, style="same", numerics="transformers")
    inv = tower.rotary_pos_emb.inv_freq.float().cpu().numpy()
    assert _ulps(freqs[: head_dim // 4], inv).max() <= 1
    same = freqs[: head_dim // 4] == inv
    cos_t, sin_t = rope_rtc.axial_tables(side, head_dim, style="same", numerics="transformers")
    assert _ulps(cos_t[:, : head_dim // 4][:, same], full.cos().cpu().numpy()[:, same]).max() <= 2
    assert _ulps(sin_t[:, head_dim // 4:][:, same], full.sin().cpu().numpy()[:, same]).max() <= 2
    # the rotation: the tower's own cos/sin as our table (both axes share its frequencies)
    cos = cp.asarray(torch.cat([full.cos(), full.cos()], -1).contiguous())
    sin = cp.asarray(torch.cat([full.sin(), full.sin()], -1).contiguous())
    n = pos.shape[1]
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    g = torch.Generator("cuda").manual_seed(5)
    q = torch.randn(n, heads, head_dim, device="cuda", generator=g).to(tdt)
    k = torch.randn(n, heads, head_dim, device="cuda", generator=g).to(tdt)
    emb = torch.cat([angles_hf, angles_hf], -1)
    want_q, want_k = hf.apply_rotary_pos_emb_vision(q, k, emb.cos(), emb.sin())
    q_out = poisoned(cp, (n, heads, head_dim), DTYPES[dtype])
    k_out = poisoned(cp, (n, heads, head_dim), DTYPES[dtype])
    quarter = head_dim // 4
    rope_rtc.apply_mrope_qk(_device_copy(cp, q, dtype), _device_copy(cp, k, dtype), cos, sin, cp.asarray(pos),
                            [quarter, quarter], q_out=q_out, k_out=k_out)
    _close_to_transformers(cp, q_out, want_q, q, dtype)
    _close_to_transformers(cp, k_out, want_k, k, dtype)


@pytest.mark.device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_against_pixtral(dtype):
    """Pixtral's tower: its ``inv_freq`` table (angles per (h, w) index, h's frequencies
    ``inv[0::2]``, w's ``inv[1::2]``) at our row-major ``vision_positions`` is our "split" angles;
    ``apply_mrope_qk`` on its cos/sin (float32) matches ``apply_rotary_pos_emb`` for float32 q/k
    within the rotation's bound, and bf16 within the documented bound of the float64 rotation
    (transformers casts cos/sin to bf16 first, so its bf16 result is not the reference)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import cupy as cp

    import rope_rtc
    from transformers.models.pixtral import modeling_pixtral as hf
    from transformers.models.pixtral.configuration_pixtral import PixtralVisionConfig

    heads, head_dim, patch, side = 16, 64, 16, 24
    config = PixtralVisionConfig(hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim,
                                 image_size=side * patch, patch_size=patch)
    rotary = hf.PixtralRotaryEmbedding(config).cuda()
    sizes = [(12, 24), (7, 5)]
    pos = rope_rtc.vision_positions([[1, h, w] for h, w in sizes], spatial_merge_size=1)
    ids = torch.as_tensor(pos[0] * side + pos[1], device="cuda")
    table = rotary.inv_freq.float()  # [side * side, D]: the angles of each (h, w), doubled
    half = head_dim // 2
    freqs = axial_frequencies(head_dim, style="split", numerics="transformers")
    ours = (np.arange(side, dtype=np.float32)[:, None] * freqs[None, :]).astype(np.float32)
    mine = np.concatenate([ours[pos[0], : half // 2], ours[pos[1], half // 2:]], axis=-1)
    theirs = table[ids, :half].cpu().numpy()
    assert _ulps(mine, theirs).max() <= 2  # torch's pow: about one frequency in a hundred an ulp off
    # the rotation on Pixtral's own float32 cos/sin, gathered back into axial tables
    angles = table[:, :half].reshape(side, side, half)
    cos = cp.asarray(torch.cat([angles[:, 0, : half // 2].cos(), angles[0, :, half // 2:].cos()], -1).contiguous())
    sin = cp.asarray(torch.cat([angles[:, 0, : half // 2].sin(), angles[0, :, half // 2:].sin()], -1).contiguous())
    n = pos.shape[1]
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    g = torch.Generator("cuda").manual_seed(6)
    q = torch.randn(1, heads, n, head_dim, device="cuda", generator=g).to(tdt)
    k = torch.randn(1, heads, n, head_dim, device="cuda", generator=g).to(tdt)
    q_out, k_out = (poisoned(cp, (1, heads, n, head_dim), DTYPES[dtype]) for _ in range(2))
    rope_rtc.apply_mrope_qk(_device_copy(cp, q, dtype), _device_copy(cp, k, dtype), cos, sin,
                            cp.asarray(pos[:, None, :]),
                            [head_dim // 4, head_dim // 4], layout="bhsd", q_out=q_out, k_out=k_out)
    c_t, s_t = table[ids].cos(), table[ids].sin()
    if dtype == "float32":
        want_q, want_k = hf.apply_rotary_pos_emb(q, k, c_t, s_t, unsqueeze_dim=0)
        _close_to_transformers(cp, q_out, want_q, q, dtype)
        _close_to_transformers(cp, k_out, want_k, k, dtype)
    for out, x in ((q_out, q), (k_out, k)):
        xs = np.transpose(x.float().cpu().numpy(), (0, 2, 1, 3)).reshape(n, heads, head_dim).astype(DTYPES[dtype])
        got = np.transpose(cp.asnumpy(out), (0, 2, 1, 3)).reshape(n, heads, head_dim)
        ref = mrope_reference(xs, cp.asnumpy(cos), cp.asnumpy(sin), pos, [head_dim // 4, head_dim // 4])
        assert_rope_close(got, ref, xs, interleaved=False, dtype=np.dtype(DTYPES[dtype]))


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
