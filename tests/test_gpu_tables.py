"""rope_rtc.tables against transformers itself: its Llama rotary embedding on the CPU and on a
CUDA device, for every scaling case of test_tables.py (``@pytest.mark.device``: needs torch and
transformers, which only the device machine has)."""

from __future__ import annotations

import numpy as np
import pytest
from test_tables import CASES, ulp_distance
from transformers_refs import inv_freq_noise_bound as _inv_freq_noise_bound

from rope_rtc.tables import inverse_frequencies, rope_tables

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def hf_rotary():
    """A function running transformers' Llama rotary embedding for a rope dict on a device."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    major = int(transformers.__version__.split(".")[0])

    def run(params: dict, dim: int, base: float, n: int, device: str):
        params = dict(params)
        kind = params.get("rope_type", params.get("type"))
        # transformers reads dynamic NTK's length from the model's max_position_embeddings (and
        # ignores an original_max_position_embeddings in the dict, which stays in to show it).
        if kind == "dynamic":
            model_max = params.pop("max_position_embeddings", None) or params["original_max_position_embeddings"]
        else:
            model_max = max(n, params.get("original_max_position_embeddings", n))
        common = dict(hidden_size=2 * dim, num_attention_heads=2, head_dim=dim, max_position_embeddings=model_max)
        try:
            if major >= 5:
                config = LlamaConfig(**common, rope_parameters={**params, "rope_theta": base})
            else:
                config = LlamaConfig(**common, rope_theta=base, rope_scaling=params)
            rotary = LlamaRotaryEmbedding(config).to(device)
        except Exception as exc:  # a rope_type or key this transformers does not know
            pytest.skip(f"transformers {transformers.__version__} cannot build {kind!r}: {exc!r}")
        x = torch.zeros(1, dtype=torch.float32, device=device)
        cos, sin = rotary(x, torch.arange(n, device=device)[None])
        half = dim // 2
        cos, sin = cos[0].cpu().numpy(), sin[0].cpu().numpy()
        np.testing.assert_array_equal(cos[:, :half], cos[:, half:])  # rotate_half layout
        return (rotary.inv_freq.detach().cpu().numpy().astype(np.float32), float(rotary.attention_scaling),
                cos[:, :half], sin[:, :half])

    run.version = transformers.__version__
    run.cuda = torch.cuda.is_available()
    return run


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_against_transformers(hf_rotary, case, device):
    if device == "cuda" and not hf_rotary.cuda:
        pytest.skip("torch has no CUDA device")
    params, dim, base, n = CASES[case]
    n = max(n, 4096)
    if case.endswith("-short"):
        n = params["original_max_position_embeddings"]
    inv_hf, att_hf, cos_hf, sin_hf = hf_rotary(params, dim, base, n, device)

    inv, att = inverse_frequencies(dim, base=base, scaling=params, max_positions=n, numerics="transformers")
    assert att == pytest.approx(att_hf, rel=1e-12)
    d_inv = ulp_distance(inv, inv_hf)
    if device == "cuda" and case in ("dynamic-long", "longrope-long"):
        # transformers recomputes these frequencies at run time on the input's device, and
        # CUDA's float32 pow is up to ~10 ulps off; this module reproduces the CPU arithmetic
        # of model creation, so only the noise bounds below apply.
        assert d_inv.max() <= 32, (hf_rotary.version, d_inv)
    else:
        # torch's CPU float32 pow is faithful, not correctly rounded: a few entries may be an
        # ulp off (two after longrope's product and reciprocal); the others are bit-identical.
        assert d_inv.max() <= 2, (hf_rotary.version, d_inv)
        assert np.count_nonzero(d_inv) <= max(2, dim // 16), (hf_rotary.version, d_inv)

    cos, sin = rope_tables(n, dim, base=base, scaling=params, numerics="transformers")
    same = d_inv == 0
    assert ulp_distance(cos, cos_hf)[:, same].max() <= 2
    assert ulp_distance(sin, sin_hf)[:, same].max() <= 2
    bound = _inv_freq_noise_bound(inv, inv_hf, att, n)
    assert np.all(np.abs(cos - cos_hf) <= bound) and np.all(np.abs(sin - sin_hf) <= bound)

    # The exact table stands from transformers' by the float32 rounding of inv_freq, no more.
    inv64 = inverse_frequencies(dim, base=base, scaling=params, max_positions=n)[0]
    cos_x, sin_x = rope_tables(n, dim, base=base, scaling=params)
    bound = _inv_freq_noise_bound(inv64, inv_hf, att, n)
    assert np.all(np.abs(cos_x - cos_hf) <= bound) and np.all(np.abs(sin_x - sin_hf) <= bound)
    assert np.max(np.abs(cos_x - cos_hf)) > 0  # the two numerics are really different
