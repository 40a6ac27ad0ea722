"""Hugging Face transformers' rotary embeddings as the installed version builds them, for the
comparisons of test_transformers_refs.py (CPU, our ops on ``backend="numpy"``) and of
test_gpu_axial.py / test_gpu_mla.py (the kernels): one construction for both.

Versions differ: transformers 4.4x gives the vision towers' angles through the tower's
``rot_pos_emb(grid_thw)`` and Pixtral's through ``PixtralRotaryEmbedding`` (a flat
``[side * side, D]`` angle table read at ``h * side + w``); 5.x has
``Qwen2_5_VLVisionRotaryEmbedding`` / ``Qwen3VLVisionRotaryEmbedding`` /
``PixtralVisionRotaryEmbedding`` (config in, ``(x, position_ids [N, 2])`` to cos/sin ``[N, D]``)
and ``transformers.vision_utils.get_vision_position_ids``. Each builder returns the same thing
whichever it found; a class this transformers cannot build skips the test, naming the version
and the error (an API difference is never a failure)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

VISION_FAMILIES = {  # family -> (config class, 4.x tower class, 5.x rotary class)
    "qwen2_5_vl": ("Qwen2_5_VLVisionConfig", "Qwen2_5_VisionTransformerPretrainedModel", "Qwen2_5_VLVisionRotaryEmbedding"),
    "qwen3_vl": ("Qwen3VLVisionConfig", "Qwen3VLVisionModel", "Qwen3VLVisionRotaryEmbedding"),
}


def imports():
    """(torch, transformers), skipping the test where either is missing."""
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


def _build(what: str, fn: Callable):
    transformers = importlib.import_module("transformers")
    try:
        return fn()
    except Exception as exc:  # an API this transformers does not have
        pytest.skip(f"transformers {transformers.__version__} cannot build {what}: {type(exc).__name__}: {exc}"[:400])


@dataclass
class VisionRotary:
    """A vision tower's rotary inputs as transformers computes them.

    positions: int64 ``[2, N]``, transformers' own (h, w) of each patch in its order (before
    Qwen2.5-VL's window permutation). cos, sin: float32 torch ``[N, D]``, what the tower hands its
    attention (``cat(f, f)`` layout, ``f`` = h's columns then w's). inv_freq: float32 ``[D/2]``,
    h's frequencies then w's. window_index: Qwen2.5-VL's block permutation (torch), else None.
    apply: transformers' rotation as the attention calls it, ``(q, k, cos, sin) -> (q, k)``."""

    positions: np.ndarray
    cos: Any
    sin: Any
    inv_freq: np.ndarray
    window_index: Any
    apply: Callable
    source: str


def qwen_vision(family: str, grid, heads: int, head_dim: int, device: str = "cpu") -> VisionRotary:
    """Qwen2.5-VL's (``family="qwen2_5_vl"``) or Qwen3-VL's (``"qwen3_vl"``) vision rotary for the
    images ``grid`` (rows (t, h, w)), spatial merge size 2, rope_theta 1e4."""
    torch, transformers = imports()
    config_name, tower_name, rotary_name = VISION_FAMILIES[family]
    mod = _build(f"{family} modeling", lambda: importlib.import_module(f"transformers.models.{family}.modeling_{family}"))
    cfg_mod = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    extra = {"fullatt_block_indexes": [0]} if family == "qwen2_5_vl" else {}
    config = _build(f"{config_name}", lambda: getattr(cfg_mod, config_name)(
        depth=1, hidden_size=heads * head_dim, num_heads=heads, intermediate_size=64, out_hidden_size=64,
        spatial_merge_size=2, **extra))
    grid_t = torch.tensor(grid, device=device)
    half = head_dim // 2
    try:
        vu = importlib.import_module("transformers.vision_utils")
    except ImportError:
        vu = None
    # transformers 5.x: the rotary class on (h, w) position ids (4.x has a class of that name for
    # Qwen3-VL, taking (dim, theta), and no vision_utils)
    if hasattr(vu, "get_vision_position_ids") and hasattr(mod, rotary_name):
        rotary = _build(rotary_name, lambda: getattr(mod, rotary_name)(config).to(device))
        pid = vu.get_vision_position_ids(grid_t, 2)  # [N, 2]
        cos, sin = rotary(torch.zeros(1, device=device), pid)
        inv = rotary.inv_freq.float().cpu().numpy()
        positions = pid.T.cpu().numpy().astype(np.int64)
        window = None
        if family == "qwen2_5_vl":
            window = vu.get_vision_window_index(grid_t, spatial_merge_size=2, window_size=config.window_size,
                                                patch_size=config.patch_size)[0]
        source = f"transformers {transformers.__version__}: {rotary_name}, vision_utils.get_vision_position_ids"
    else:  # transformers 4.4x: the tower's rot_pos_emb gives the angles [N, D/2]
        tower = _build(tower_name, lambda: getattr(mod, tower_name)(config).to(device))
        angles = tower.rot_pos_emb(grid_t).float()
        inv = tower.rotary_pos_emb.inv_freq.float().cpu().numpy()
        # inv_freq[0] is 1.0 exactly, so column 0 holds h and column D/4 holds w, exactly
        assert inv[0] == 1.0
        a = angles.cpu().numpy()
        positions = np.stack([a[:, 0], a[:, half // 2]]).astype(np.int64)
        assert np.array_equal(positions.astype(np.float32), np.stack([a[:, 0], a[:, half // 2]]))
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        window = tower.get_window_index(grid_t)[0] if hasattr(tower, "get_window_index") else None
        source = f"transformers {transformers.__version__}: {tower_name}.rot_pos_emb"
    inv = np.concatenate([inv, inv]) if inv.size == half // 2 else inv
    return VisionRotary(positions, cos.float(), sin.float(), inv, window, mod.apply_rotary_pos_emb_vision, source)


def pixtral_vision(sizes, heads: int, head_dim: int, side: int, patch: int = 16, device: str = "cpu") -> VisionRotary:
    """Pixtral's vision rotary for images of ``sizes`` ((h, w) patches each), rope_theta 1e4, a
    tower of ``side`` patches per side at most; cos/sin in float32 (a float32 tower's)."""
    torch, transformers = imports()
    mod = _build("pixtral modeling", lambda: importlib.import_module("transformers.models.pixtral.modeling_pixtral"))
    cfg_mod = importlib.import_module("transformers.models.pixtral.configuration_pixtral")
    config = _build("PixtralVisionConfig", lambda: cfg_mod.PixtralVisionConfig(
        hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim, image_size=side * patch,
        patch_size=patch))
    x = torch.zeros(1, device=device)
    if hasattr(mod, "PixtralVisionRotaryEmbedding"):  # 5.x: (h, w) position ids, as its forward builds them
        rotary = _build("PixtralVisionRotaryEmbedding", lambda: mod.PixtralVisionRotaryEmbedding(config).to(device))
        ids = []
        for h, w in sizes:
            hh, ww = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            ids.append(torch.stack([hh.flatten(), ww.flatten()], dim=-1))
        pid = torch.cat(ids)
        cos, sin = rotary(x, pid)
        positions = pid.T.cpu().numpy().astype(np.int64)
        inv = rotary.inv_freq.float().cpu().numpy()  # inv[0::2] then inv[1::2]
        source = f"transformers {transformers.__version__}: PixtralVisionRotaryEmbedding"
    else:  # 4.x: a flat [side * side, D] angle table read at h * side + w
        rotary = _build("PixtralRotaryEmbedding", lambda: mod.PixtralRotaryEmbedding(config).to(device))
        patches = [torch.zeros(1, h, w) for h, w in sizes]
        ids = mod.position_ids_in_meshgrid(patches, max_width=side).to(device)
        cos, sin = rotary(x, ids)
        positions = np.stack([ids.cpu().numpy() // side, ids.cpu().numpy() % side]).astype(np.int64)
        table = rotary.inv_freq.float().cpu().numpy()  # [side * side, D]: angles of (h, w), doubled
        # row (1, 1) holds 1.0 * the frequencies: h's in columns [0, D/4), w's in [D/4, D/2)
        inv = table[side + 1, : head_dim // 2]
        source = f"transformers {transformers.__version__}: PixtralRotaryEmbedding"

    def apply(q, k, c, s):  # as PixtralAttention calls it: q, k [B, H, N, D], cos/sin [N, D]
        return mod.apply_rotary_pos_emb(q, k, c, s, unsqueeze_dim=0)

    return VisionRotary(positions, cos.float(), sin.float(), inv, None, apply, source)


def axial_table_from_tokens(cos_tokens: np.ndarray, positions: np.ndarray, rows: int) -> np.ndarray:
    """transformers' per-token cos (or sin) ``[N, D]`` gathered back into an axial table
    ``[rows, D/2]``: h's columns at row h, w's at row w. Every token with the same h (or w) must
    carry the same values (asserted), so reading the table at ``positions`` gives back
    transformers' per-token values exactly."""
    n, d = cos_tokens.shape
    quarter = d // 4
    table = np.full((rows, d // 2), np.nan, np.float32)
    table[positions[0], :quarter] = cos_tokens[:, :quarter]
    table[positions[1], quarter: d // 2] = cos_tokens[:, quarter: d // 2]
    back = np.concatenate([table[positions[0], :quarter], table[positions[1], quarter:]], axis=-1)
    np.testing.assert_array_equal(back.view(np.uint32), np.ascontiguousarray(cos_tokens[:, : d // 2]).view(np.uint32))
    np.testing.assert_array_equal(cos_tokens[:, : d // 2], cos_tokens[:, d // 2:])  # rotate_half's cat(f, f)
    return np.nan_to_num(table, nan=0.0)  # rows no patch reads (never read)


# -- DeepSeek-V3 -----------------------------------------------------------------------------------

# DeepSeek-V3's rope_scaling (its mscale ratio is 1); the tests also run mscale_all_dim 0.707,
# whose attention factor is not 1: transformers multiplies cos and sin by it, as rope_tables does.
DEEPSEEK_V3_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def deepseek_v3(heads: int, nope: int, rope: int, kv_lora: int, scaling: dict, device: str = "cpu"):
    """(modeling module, DeepseekV3RotaryEmbedding) for ``scaling`` (rope_theta 1e4, rotary dim
    ``rope``: the config's head_dim is qk_rope_head_dim). max_position_embeddings is the original
    length times the factor, as DeepSeek-V3's config (4.x warns when they disagree; both use the
    explicit factor)."""
    torch, transformers = imports()
    ds = _build("deepseek_v3 modeling",
                lambda: importlib.import_module("transformers.models.deepseek_v3.modeling_deepseek_v3"))
    common = dict(hidden_size=1024, num_attention_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                  kv_lora_rank=kv_lora, v_head_dim=nope,
                  max_position_embeddings=int(scaling["original_max_position_embeddings"] * scaling["factor"]))

    def build():
        if int(transformers.__version__.split(".")[0]) >= 5:
            config = ds.DeepseekV3Config(**common, rope_parameters={**scaling, "rope_theta": 10000.0})
        else:
            config = ds.DeepseekV3Config(**common, rope_theta=10000.0, rope_scaling=dict(scaling))
        return ds.DeepseekV3RotaryEmbedding(config=config).to(device)

    rotary = _build("DeepSeek-V3's YaRN rotary embedding", build)
    if not hasattr(ds, "apply_rotary_pos_emb_interleave"):
        pytest.skip(f"transformers {transformers.__version__} has no apply_rotary_pos_emb_interleave")
    return ds, rotary


def deinterleave(x: np.ndarray) -> np.ndarray:
    """transformers' DeepSeek permutation of each head's rotary channels: x[2i] -> i, x[2i+1] -> R/2 + i."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


# -- comparisons -----------------------------------------------------------------------------------

def ulps32(a, b) -> np.ndarray:
    """float32 ulps between a and b (on the ordered integer line)."""
    ia, ib = (np.asarray(v, np.float32).view(np.int32).astype(np.int64) for v in (a, b))
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return np.abs(ia - ib)


def close_to_transformers(got: np.ndarray, want: np.ndarray, x: np.ndarray, dtype: str, table_max: float = 1.0) -> float:
    """Our rotation against transformers' on the same cos/sin tables, ``[..., D]`` half-split.

    float32: within ``2^-22 (|x0| + |x1|)`` of transformers' result (both FP32 rotations: ours one
    rounding, or a fused multiply-add and one product rounding; transformers' two products and a
    sum, each rounded). 16-bit: both round an FP32 rotation once, so within one output ulp of
    transformers' plus that FP32 term. ``table_max``: the largest |cos|, |sin| where it passes 1
    (YaRN's attention factor scales both); the FP32 term scales with it. Returns the largest
    |difference| relative to the bound."""
    from rope_rtc.reference import rope_error_bound

    g = np.asarray(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    xs = np.asarray(x).astype(np.float64)
    assert np.isfinite(g).all()
    h = xs.shape[-1] // 2
    pair = np.abs(xs[..., :h]) + np.abs(xs[..., h:])
    pair = np.concatenate([pair, pair], axis=-1) * max(1.0, table_max)
    bound = rope_error_bound(pair, np.dtype(dtype) if dtype != "bfloat16" else _bf16(), w)
    diff = np.abs(g - w)
    worst = float((diff / bound).max())
    assert worst <= 1.0, f"{int((diff > bound).sum())} elements past the bound; worst at {worst:.3g} of it"
    return worst


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def inv_freq_noise_bound(inv_ref, inv_hf, att, n):
    """How far a table built from ``inv_ref`` may be from transformers' built from ``inv_hf``
    (positions ``0 .. n-1``): angles differ by ``p * |inv_ref - inv_hf|`` plus one float32 rounding
    of the angle; cos and sin move by at most that (times the attention factor), plus two float32
    roundings."""
    p = np.arange(n, dtype=np.float64)[:, None]
    angle = np.abs(p * inv_hf.astype(np.float64)).astype(np.float32)
    d_inv = np.abs(inv_ref.astype(np.float64) - inv_hf.astype(np.float64))
    return att * (p * d_inv + np.spacing(angle) + 2.0**-23)


# -- the comparisons, shared by the CPU and the GPU tests --------------------------------------------
#
# ``rotate(q, k, cos, sin, positions, section, layout)`` runs our apply_mrope_qk on host arrays and
# returns host (q_out, k_out): the NumPy backend on the CPU, the kernel (outputs poisoned first) on
# the GPU. Each check returns what the caller needs for its own bit-for-bit promise.

QWEN_GRID = [[1, 16, 20], [2, 8, 6]]  # two frames of the second: positions repeat per frame
PIXTRAL_SIZES, PIXTRAL_SIDE = [(12, 24), (7, 5)], 24


def _inputs(shape, dtype: str, seed: int):
    import ml_dtypes

    dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 2).astype(dt), (rng.standard_normal(shape) * 2).astype(dt)


def _torch(torch, a: np.ndarray, device: str):
    """A torch copy of host array ``a`` (bfloat16 through float32, exactly)."""
    t = torch.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to(device)
    return t.to(torch.bfloat16) if a.dtype.name == "bfloat16" else t.to(torch.float16 if a.dtype == np.float16 else t.dtype)


def check_qwen_vision(family: str, heads: int, head_dim: int, dtype: str, rotate, device: str = "cpu") -> dict:
    """Qwen2.5-VL / Qwen3-VL vision: our vision_positions are transformers' position ids (t > 1
    frames included); transformers' per-token cos/sin gathered into axial tables read back
    exactly; on those tables our rotation of [N, H, D] q and k (thd) against
    apply_rotary_pos_emb_vision within :func:`close_to_transformers`."""
    import rope_rtc

    torch, _ = imports()
    ref = qwen_vision(family, QWEN_GRID, heads, head_dim, device)
    pos = rope_rtc.vision_positions(QWEN_GRID, spatial_merge_size=2)
    np.testing.assert_array_equal(pos, ref.positions)
    rows = int(max(max(r[1], r[2]) for r in QWEN_GRID))
    cos = axial_table_from_tokens(ref.cos.cpu().numpy(), pos, rows)
    sin = axial_table_from_tokens(ref.sin.cpu().numpy(), pos, rows)
    q, k = _inputs((pos.shape[1], heads, head_dim), dtype, 5)
    want = ref.apply(_torch(torch, q, device), _torch(torch, k, device), ref.cos, ref.sin)
    section = [head_dim // 4, head_dim // 4]
    got = rotate(q, k, cos, sin, pos, section, "thd")
    worst = [close_to_transformers(g, w.float().cpu().numpy(), x, dtype) for g, w, x in zip(got, want, (q, k))]
    return dict(ref=ref, got=got, x=(q, k), cos=cos, sin=sin, positions=pos, section=section, worst=max(worst))


def check_pixtral(heads: int, head_dim: int, dtype: str, rotate, device: str = "cpu") -> dict:
    """Pixtral: our row-major vision_positions (merge size 1) are transformers' (h, w); its
    per-token float32 cos/sin gathered into axial tables; our rotation of [1, H, N, D] q and k
    (bhsd) against apply_rotary_pos_emb(..., unsqueeze_dim=0) as PixtralAttention calls it. bf16
    q/k: transformers' function on the float32 upcast, rounded once to bf16 (transformers' own
    bf16 tower casts cos/sin to bf16 first and rotates in bf16, which is no reference)."""
    import rope_rtc

    torch, _ = imports()
    ref = pixtral_vision(PIXTRAL_SIZES, heads, head_dim, PIXTRAL_SIDE, device=device)
    pos = rope_rtc.vision_positions([[1, h, w] for h, w in PIXTRAL_SIZES], spatial_merge_size=1)
    np.testing.assert_array_equal(pos, ref.positions)
    cos = axial_table_from_tokens(ref.cos.cpu().numpy(), pos, PIXTRAL_SIDE)
    sin = axial_table_from_tokens(ref.sin.cpu().numpy(), pos, PIXTRAL_SIDE)
    q, k = _inputs((1, heads, pos.shape[1], head_dim), dtype, 6)
    tq, tk = _torch(torch, q, device), _torch(torch, k, device)
    wq, wk = ref.apply(tq.float(), tk.float(), ref.cos, ref.sin)
    want = (wq.to(tq.dtype), wk.to(tk.dtype))
    section = [head_dim // 4, head_dim // 4]
    got = rotate(q, k, cos, sin, pos[:, None, :], section, "bhsd")
    worst = [close_to_transformers(g, w.float().cpu().numpy(), x, dtype) for g, w, x in zip(got, want, (q, k))]
    return dict(ref=ref, got=got, x=(q, k), cos=cos, sin=sin, positions=pos, section=section, worst=max(worst))


MLA_SHAPE = dict(T=37, H=16, NOPE=128, R=64, L=512, P=256, NB=8, BS=16)


def check_deepseek_v3(mscale_all_dim: float, mla, device: str = "cpu") -> dict:
    """DeepSeek-V3 (modeling_deepseek_v3.py): DeepseekV3RotaryEmbedding's cos/sin (``cat(f, f)``
    times attention_scaling, YaRN's ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``)
    against our ``rope_tables(numerics="transformers")`` (the attention factor equal, the tables
    within the inv_freq noise bound, counted in ulps); then, fed our tables, transformers'
    ``apply_rotary_pos_emb_interleave(q_rot [1, H, T, R], k_rot [1, 1, T, R], cos, sin,
    unsqueeze_dim=1)`` against our interleaved rotation (``mla(...)``: mla_rope_and_cache on
    host arrays, returning host (q_out, k_pe)) after transformers' de-interleaving permutation,
    float32, within :func:`close_to_transformers` (the attention factor as the tables' largest
    entry); and the q.k scores attention takes, which the permutation leaves alone."""
    import rope_rtc

    torch, _ = imports()
    s = MLA_SHAPE
    T, H, NOPE, R, L, P = s["T"], s["H"], s["NOPE"], s["R"], s["L"], s["P"]
    scaling = {**DEEPSEEK_V3_YARN, "mscale_all_dim": mscale_all_dim}
    inv, att = rope_rtc.inverse_frequencies(R, base=10000.0, scaling=scaling, max_positions=P, numerics="transformers")
    cos_t, sin_t = rope_rtc.rope_tables(P, R, base=10000.0, scaling=scaling, numerics="transformers")
    ds, rotary = deepseek_v3(H, NOPE, R, L, scaling, device)
    assert float(rotary.attention_scaling) == pytest.approx(att, rel=1e-12)
    assert (att == 1.0) == (mscale_all_dim == 1.0)
    hf_cos, hf_sin = rotary(torch.zeros(1, device=device), torch.arange(P, device=device)[None])
    hf_cos, hf_sin = hf_cos[0].float().cpu().numpy(), hf_sin[0].float().cpu().numpy()  # [P, R]
    np.testing.assert_array_equal(hf_cos[:, : R // 2], hf_cos[:, R // 2:])
    inv_hf = rotary.inv_freq.float().cpu().numpy()
    bound = inv_freq_noise_bound(inv, inv_hf, att, P)
    assert np.all(np.abs(cos_t - hf_cos[:, : R // 2]) <= bound) and np.all(np.abs(sin_t - hf_sin[:, : R // 2]) <= bound)
    table_ulps = int(max(ulps32(cos_t, hf_cos[:, : R // 2]).max(), ulps32(sin_t, hf_sin[:, : R // 2]).max()))
    inv_ulps = int(ulps32(inv, inv_hf).max())

    rng = np.random.default_rng(21)
    q = (rng.standard_normal((T, H, NOPE + R)) * 2).astype(np.float32)
    k_pe = (rng.standard_normal((T, R)) * 2).astype(np.float32)
    kv_c = (rng.standard_normal((T, L)) * 3).astype(np.float32)
    positions = rng.integers(0, P, T).astype(np.int64)
    slots = rng.permutation(s["NB"] * s["BS"])[:T].astype(np.int64)
    slots[3] = -1
    cache = rng.standard_normal((s["NB"], s["BS"], L + R)).astype(np.float32)
    ours_q, ours_k = mla(q.copy(), k_pe.copy(), kv_c, cos_t, sin_t, positions, slots, cache)  # q, k_pe rotate in place
    tpos = torch.as_tensor(positions, device=device)
    cos = torch.as_tensor(np.concatenate([cos_t, cos_t], -1), device=device)[tpos][None]  # [1, T, R], as the module
    sin = torch.as_tensor(np.concatenate([sin_t, sin_t], -1), device=device)[tpos][None]
    tq = torch.as_tensor(q[..., NOPE:], device=device).permute(1, 0, 2)[None]  # q_rot [1, H, T, R]
    tk = torch.as_tensor(k_pe, device=device)[None, None]  # k_rot [1, 1, T, R]
    q_embed, k_embed = ds.apply_rotary_pos_emb_interleave(tq, tk, cos, sin, unsqueeze_dim=1)
    hf_q, hf_k = q_embed[0].cpu().numpy(), k_embed[0, 0].cpu().numpy()  # [H, T, R], [T, R]
    mine_q = ours_q[..., NOPE:].transpose(1, 0, 2)  # [H, T, R]
    np.testing.assert_array_equal(ours_q[..., :NOPE], q[..., :NOPE])  # the nope part copied
    worst = max(close_to_transformers(deinterleave(mine_q), hf_q, deinterleave(q[..., NOPE:].transpose(1, 0, 2)),
                                      "float32", table_max=att),
                close_to_transformers(deinterleave(ours_k), hf_k, deinterleave(k_pe), "float32", table_max=att))
    scores = np.einsum("htr,sr->hts", mine_q.astype(np.float64), ours_k.astype(np.float64))
    hf_scores = np.einsum("htr,sr->hts", hf_q.astype(np.float64), hf_k.astype(np.float64))
    qa, ka = np.abs(hf_q).sum(-1), np.abs(hf_k).sum(-1)
    tol = 2.0**-21 * max(1.0, att)
    assert np.all(np.abs(scores - hf_scores) <= tol * (qa[..., None] * np.abs(hf_k).max() + ka[None, None, :]
                                                       * np.abs(hf_q).max()) + 1e-9)
    return dict(worst=worst, table_ulps=table_ulps, inv_ulps=inv_ulps, att=att, q=q, k_pe=k_pe, got=(ours_q, ours_k),
                cos=cos_t, sin=sin_t, positions=positions,
                max_abs=float(max(np.abs(deinterleave(mine_q) - hf_q).max(), np.abs(deinterleave(ours_k) - hf_k).max())))
