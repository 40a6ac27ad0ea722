"""DeepSeek-style MLA on the GPU: q's rotary part and k_pe within the library's rotation contract
(bit for bit with the NumPy reference, which is that arithmetic), every byte of the cache bit for
bit (model dtype, FP8 e4m3 and e5m2, poisoned with random bytes first, so a write at a skipped
slot shows), the two-step path (apply_rope on the rotary part, then the library's FP8 cast), and
transformers' DeepSeek-V3 rotation."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_util import DTYPES, host_random, host_tables, poisoned
from rope_rtc.reference import assert_rope_close, fp8_quantize, mla_rope_and_cache_reference, rope_reference

pytestmark = pytest.mark.gpu

T, H, NOPE, R, L, NB, BS, P = 37, 16, 128, 64, 512, 8, 16, 256


def _host(dtype, kind, seed=0):
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    h = dict(q=host_random((T, H, NOPE + R), dt, seed + 1, 2.0), k_pe=host_random((T, R), dt, seed + 2, 2.0),
             kv_c=host_random((T, L), dt, seed + 3, 3.0))
    h["cos"], h["sin"] = host_tables(P, R // 2, seed + 4)
    h["positions"] = rng.integers(0, P, T).astype(np.int64)
    slots = rng.permutation(NB * BS)[:T].astype(np.int64)
    slots[3], slots[7] = -1, -5  # tokens that write no row
    h["slot_mapping"] = slots
    cache_dt = np.uint8 if kind != "auto" else dt
    shape = (NB, BS, L + R)
    raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(cache_dt).itemsize, dtype=np.uint8)
    h["kv_cache"] = raw.view(cache_dt).reshape(shape)  # random bytes: every byte not written stays
    return h


def _bytes(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_mla_matches_the_reference_bit_for_bit(cp, dtype, kind, interleaved):
    import rope_rtc

    h = _host(dtype, kind)
    d = {n: cp.asarray(a) for n, a in h.items()}
    scale = dict(kv_scale=cp.asarray(np.array([0.01], np.float32))) if kind != "auto" else {}
    q_scale = np.array([0.02], np.float32)
    q_out = poisoned(cp, h["q"].shape, d["q"].dtype)
    q_fp8 = cp.full(h["q"].shape, 0xFF, np.uint8)
    out = rope_rtc.mla_rope_and_cache(d["q"], d["k_pe"], d["kv_c"], d["cos"], d["sin"], d["positions"],
                                      d["slot_mapping"], d["kv_cache"], kv_cache_dtype=kind, q_out=q_out,
                                      q_fp8_out=q_fp8, q_fp8_scale=cp.asarray(q_scale), interleaved=interleaved,
                                      **scale)
    assert out[0] is q_out and out[2] is q_fp8
    want = mla_rope_and_cache_reference(*(h[n] for n in ("q", "k_pe", "kv_c", "cos", "sin", "positions",
                                                         "slot_mapping", "kv_cache")),
                                        kv_cache_dtype=kind, kv_scale=0.01 if kind != "auto" else None,
                                        q_fp8_scale=q_scale[0], interleaved=interleaved)
    np.testing.assert_array_equal(_bytes(cp.asnumpy(q_out)), _bytes(want[0]))
    np.testing.assert_array_equal(_bytes(cp.asnumpy(d["k_pe"])), _bytes(want[1]))
    np.testing.assert_array_equal(_bytes(cp.asnumpy(d["kv_cache"])), _bytes(want[2]))  # skipped rows untouched
    np.testing.assert_array_equal(cp.asnumpy(q_fp8), want[3])
    np.testing.assert_array_equal(_bytes(cp.asnumpy(d["q"])), _bytes(h["q"]))  # q itself untouched with q_out
    # the rotation within the library's bound of the float64 reference
    ref = rope_reference(h["q"][..., NOPE:], h["cos"], h["sin"], h["positions"], interleaved=interleaved)
    assert_rope_close(cp.asnumpy(q_out)[..., NOPE:], ref, h["q"][..., NOPE:], interleaved=interleaved,
                      dtype=np.dtype(DTYPES[dtype]))


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_mla_equals_the_two_step_path(cp, kind):
    """apply_rope on q's rotary part and on k_pe, then the library's FP8 cast of [kv_c | k_pe]: the
    same bytes as the one launch (in place, DeepSeek's adjacent pairs, bf16)."""
    import rope_rtc

    h = _host("bfloat16", kind, seed=11)
    d = {n: cp.asarray(a) for n, a in h.items()}
    two = {n: cp.asarray(a) for n, a in h.items()}
    scale = cp.asarray(np.array([0.03], np.float32))
    rope_rtc.mla_rope_and_cache(d["q"], d["k_pe"], d["kv_c"], d["cos"], d["sin"], d["positions"], d["slot_mapping"],
                                d["kv_cache"], kv_cache_dtype=kind, kv_scale=scale)
    rope_rtc.apply_rope(two["q"], two["cos"], two["sin"], positions=two["positions"], layout="thd", interleaved=True,
                        rotary_offset=NOPE, out=two["q"])
    k3 = two["k_pe"].reshape(T, 1, R)
    rope_rtc.apply_rope(k3, two["cos"], two["sin"], positions=two["positions"], layout="thd", interleaved=True, out=k3)
    cp.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(_bytes(cp.asnumpy(d["q"])), _bytes(cp.asnumpy(two["q"])))
    np.testing.assert_array_equal(_bytes(cp.asnumpy(d["k_pe"])), _bytes(cp.asnumpy(two["k_pe"])))
    cache = h["kv_cache"].copy()
    k_host, kv_host = cp.asnumpy(two["k_pe"]), h["kv_c"]
    for t, slot in enumerate(h["slot_mapping"]):
        if slot >= 0:
            cache[slot // BS, slot % BS] = fp8_quantize(np.concatenate([kv_host[t], k_host[t]]), np.float32(0.03), kind)
    np.testing.assert_array_equal(cp.asnumpy(d["kv_cache"]), cache)


def test_a_plan_relaunches_with_a_new_scale_and_in_graph_capture(cp):
    import rope_rtc

    h = _host("bfloat16", "fp8_e4m3", seed=5)
    d = {n: cp.asarray(a) for n, a in h.items()}
    scale = cp.asarray(np.array([0.01], np.float32))
    args = [d[n] for n in ("q", "k_pe", "kv_c", "cos", "sin", "positions", "slot_mapping", "kv_cache")]
    plan = rope_rtc.MlaRopeCachePlan(*args, kv_cache_dtype="fp8_e4m3", kv_scale=scale)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        plan.execute(*args, kv_scale=scale, stream=stream)
        graph = stream.end_capture()
    scale[...] = 0.05
    graph.launch(stream)
    stream.synchronize()
    want = mla_rope_and_cache_reference(*(h[n] for n in ("q", "k_pe", "kv_c", "cos", "sin", "positions",
                                                         "slot_mapping", "kv_cache")),
                                        kv_cache_dtype="fp8_e4m3", kv_scale=0.05)
    np.testing.assert_array_equal(cp.asnumpy(d["kv_cache"]), want[2])


# DeepSeek-V3's rope_scaling (its mscale ratio is 1), and the same with mscale_all_dim 0.707, whose
# attention factor is not 1: transformers multiplies cos and sin by it, as rope_tables does.
DEEPSEEK_V3_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _deepseek_v3_rotary(torch, transformers, ds, scaling: dict):
    """transformers' DeepseekV3RotaryEmbedding for ``scaling`` (rope_theta 1e4, rotary dim R: its
    config sets head_dim = qk_rope_head_dim); the model length is the original one, which
    versions that read only max_position_embeddings for YaRN agree on."""
    common = dict(hidden_size=1024, num_attention_heads=H, qk_nope_head_dim=NOPE, qk_rope_head_dim=R,
                  kv_lora_rank=L, v_head_dim=NOPE, max_position_embeddings=scaling["original_max_position_embeddings"])
    try:
        if int(transformers.__version__.split(".")[0]) >= 5:
            config = ds.DeepseekV3Config(**common, rope_parameters={**scaling, "rope_theta": 10000.0})
        else:
            config = ds.DeepseekV3Config(**common, rope_theta=10000.0, rope_scaling=dict(scaling))
        return ds.DeepseekV3RotaryEmbedding(config=config).to("cuda")
    except Exception as exc:  # a transformers without DeepSeek-V3's YaRN keys
        pytest.skip(f"transformers {transformers.__version__} cannot build DeepSeek-V3's rotary embedding: {exc!r}")


@pytest.mark.device
@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.707])
def test_the_rotation_matches_transformers_deepseek_v3(cp, mscale_all_dim):
    """transformers' DeepSeek-V3 attention (modeling_deepseek_v3.py): DeepseekV3RotaryEmbedding gives
    cos/sin [B, S, R], cat(freqs, freqs).cos() / .sin() times attention_scaling (YaRN's
    mscale(factor, mscale) / mscale(factor, mscale_all_dim)); with config.rope_interleave,
    apply_rotary_pos_emb_interleave(q_rot [B, H, S, R], k_rot [B, 1, S, R], cos, sin,
    position_ids=None, unsqueeze_dim=1) unsqueezes cos/sin at dim 1, de-interleaves each head
    (view(b, h, s, R/2, 2).transpose(4, 3): x[2i] -> i, x[2i+1] -> R/2 + i) and rotates half-split.

    Our tables (rope_tables, numerics="transformers") stand within float32 noise of the module's;
    fed the same tables, our interleaved rotation equals transformers' after that permutation
    (float32, within FP32 rounding), and so do the q.k products attention takes from them."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from test_gpu_tables import _inv_freq_noise_bound

    import rope_rtc

    scaling = {**DEEPSEEK_V3_YARN, "mscale_all_dim": mscale_all_dim}
    inv, att = rope_rtc.inverse_frequencies(R, base=10000.0, scaling=scaling, max_positions=P, numerics="transformers")
    cos_t, sin_t = rope_rtc.rope_tables(P, R, base=10000.0, scaling=scaling, numerics="transformers")
    rotary = _deepseek_v3_rotary(torch, transformers, ds, scaling)
    assert float(rotary.attention_scaling) == pytest.approx(att, rel=1e-12)
    assert (att == 1.0) == (mscale_all_dim == 1.0)
    hf_cos, hf_sin = rotary(torch.zeros(1, device="cuda"), torch.arange(P, device="cuda")[None])
    hf_cos, hf_sin = hf_cos[0].cpu().numpy(), hf_sin[0].cpu().numpy()  # [P, R]: both halves the same
    np.testing.assert_array_equal(hf_cos[:, :R // 2], hf_cos[:, R // 2:])
    bound = _inv_freq_noise_bound(inv, rotary.inv_freq.cpu().numpy().astype(np.float32), att, P)
    assert np.all(np.abs(cos_t - hf_cos[:, :R // 2]) <= bound) and np.all(np.abs(sin_t - hf_sin[:, :R // 2]) <= bound)

    h = _host("float32", "auto", seed=21)
    h["cos"], h["sin"] = cos_t, sin_t
    d = {n: cp.asarray(a) for n, a in h.items()}
    rope_rtc.mla_rope_and_cache(d["q"], d["k_pe"], d["kv_c"], d["cos"], d["sin"], d["positions"], d["slot_mapping"],
                                d["kv_cache"])  # interleaved=True, DeepSeek's pairs, the default
    pos = torch.as_tensor(h["positions"], device="cuda")
    cos = torch.as_tensor(np.concatenate([cos_t, cos_t], -1), device="cuda")[pos][None]  # [1, T, R], as the module
    sin = torch.as_tensor(np.concatenate([sin_t, sin_t], -1), device="cuda")[pos][None]
    tq = torch.as_tensor(h["q"][..., NOPE:], device="cuda").permute(1, 0, 2)[None]  # q_rot [1, H, T, R]
    tk = torch.as_tensor(h["k_pe"], device="cuda")[None, None]  # k_rot [1, 1, T, R]
    q_embed, k_embed = ds.apply_rotary_pos_emb_interleave(tq, tk, cos, sin, unsqueeze_dim=1)
    hf_q, hf_k = q_embed[0].cpu().numpy(), k_embed[0, 0].cpu().numpy()  # [H, T, R], [T, R]

    def deinterleave(x):  # transformers' permutation of each head's channels
        return np.concatenate([x[..., 0::2], x[..., 1::2]], -1)

    ours_q, ours_k = cp.asnumpy(d["q"])[..., NOPE:].transpose(1, 0, 2), cp.asnumpy(d["k_pe"])  # [H, T, R], [T, R]
    tol = 4e-6 * 8  # a few float32 ulps of |x0 c| + |x1 s| (values of a few units, |cos|, |sin| <= 1.2)
    np.testing.assert_allclose(deinterleave(ours_q), hf_q, rtol=0, atol=tol)
    np.testing.assert_allclose(deinterleave(ours_k), hf_k, rtol=0, atol=tol)
    # q.k per head and token pair, ours in our layout: the permutation leaves them unchanged
    scores = np.einsum("htr,sr->hts", ours_q.astype(np.float64), ours_k.astype(np.float64))
    hf_scores = np.einsum("htr,sr->hts", hf_q.astype(np.float64), hf_k.astype(np.float64))
    qa, ka = np.abs(hf_q).sum(-1), np.abs(hf_k).sum(-1)
    assert np.all(np.abs(scores - hf_scores) <= tol * (qa[..., None] + ka[None, None, :]) + 1e-9)
    # FP8 bytes against torch's own float8 cast of the same quotient
    vals = torch.as_tensor(np.concatenate([h["kv_c"][:4], cp.asnumpy(d["k_pe"])[:4]], -1), device="cuda") / 0.5
    torch_e4m3 = vals.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy()
    np.testing.assert_array_equal(torch_e4m3, fp8_quantize(vals.cpu().numpy() * 0.5, np.float32(0.5), "fp8_e4m3"))
