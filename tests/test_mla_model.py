"""``rope-rtc warm --model`` on multi-head latent attention configs (DeepSeek-V2/V3, Kimi K2): the
geometry read from their fields, the builds listed, and a second warm compiling nothing."""

from __future__ import annotations

import json

import pytest

from rope_rtc import cli
from rope_rtc.build import registry, registry_mla
from rope_rtc.numerics.model import ModelRope, from_config

DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
               "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 128, "v_head_dim": 128, "rope_theta": 10000, "max_position_embeddings": 163840,
               "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 40,
                                "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                                "mscale": 1.0, "mscale_all_dim": 1.0},
               "torch_dtype": "bfloat16"}


def test_a_deepseek_v3_config_reads_as_mla():
    m = from_config(DEEPSEEK_V3)
    assert m == ModelRope(64, 128, 1, 64, "bfloat16", True, mla=(512, 128))
    assert from_config({**DEEPSEEK_V3, "model_type": "kimi_k2"}) == m
    v2_lite = {**DEEPSEEK_V3, "model_type": "deepseek_v2", "num_attention_heads": 16, "q_lora_rank": None}
    assert from_config(v2_lite).q_heads == 16
    # transformers' rope_interleave says the pair style of any MLA model
    other = {**DEEPSEEK_V3, "model_type": "some_mla", "rope_interleave": False}
    assert from_config(other).interleaved is False and from_config({**other, "rope_interleave": True}).interleaved


def test_the_mla_builds_are_listed_for_its_geometry():
    specs = from_config(DEEPSEEK_V3).specs()
    mla = [s for s in specs if s.family == "mla_rope_cache"]
    assert mla == registry_mla.mla_model_specs("bfloat16", True, 128, 128, 64, 512)
    assert {(dict(s.defines)["CACHE_KIND"], dict(s.defines)["MLA_QFP8"]) for s in mla} == {
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1"), ("2", "0"), ("2", "2")}
    assert all(dict(s.defines)["ROPE_VEC"] == "8" and dict(s.defines)["MLA_H"] == "128" for s in mla)
    # the plain kv-cache builds do not serve an MLA model; its rotary part's RoPE builds stay
    assert not [s for s in specs if s.family == "rope_cache"]
    assert any(s.family == "rope_fixed" and ("FIX_HQ", "128") in s.defines for s in specs)


@pytest.mark.parametrize("change,match", [
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim 63 is odd"),
    ({"qk_nope_head_dim": None}, "qk_nope_head_dim must be a positive int"),
    ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive int"),
    ({"rope_interleave": "yes"}, "rope_interleave must be true or false"),
])
def test_mla_configs_it_cannot_serve_are_refused_naming_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        from_config({**DEEPSEEK_V3, **change})


def test_warm_model_on_a_deepseek_v3_config_then_a_second_warm_compiles_nothing(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(DEEPSEEK_V3))
    args = ["warm", "--arch", "sm_90", "--model", str(config), "--kernels", "mla_rope_cache", "--cache-dir",
            str(tmp_path / "cache"), "--no-progress"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "model: head_dim 64, 128 q heads, 1 kv heads, rotary_dim 64, bfloat16, interleaved pairs" in out
    assert "multi-head latent attention (kv_lora_rank 512, qk_nope_head_dim 128)" in out
    assert "warmed 6 kernels for sm_90" in out
    from rope_rtc.build.cache import open_store
    from rope_rtc.build.cache.location import versioned_cache_dir

    listed = sorted(e.entry.kernel for e in open_store(versioned_cache_dir(tmp_path / "cache")).disk.list())
    assert listed == sorted(s.name for s in registry_mla.mla_model_specs("bfloat16", True, 128, 128, 64, 512))
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "compiled 0" in out or "compiled" not in out, out
    assert "already cached 6" in out, out


def test_a_missing_mla_build_names_the_warm_that_adds_it(tmp_path, monkeypatch, capsys):
    """Under ROPE_RTC_NO_COMPILE a missing MLA build names ``warm --model``: the plain warm never
    builds MLA kernels (their geometry comes from the model's config)."""
    import shlex

    from rope_rtc.build.cache import store
    from rope_rtc.build.kernels import get_binary
    from rope_rtc.build.toolchain import target_for
    from rope_rtc.errors import KernelNotCachedError

    spec = registry_mla.mla_model_specs("bfloat16", True, 128, 128, 64, 512)[0]
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(store, "_stores", {})
    with pytest.raises(KernelNotCachedError) as info:
        get_binary(spec, target_for(90), announce=False)
    command = str(info.value).split("fill the cache on a build machine with: ")[1].split(" (the model")[0]
    assert "--model config.json" in command, command
    config = tmp_path / "config.json"
    config.write_text(json.dumps(DEEPSEEK_V3))
    argv = [str(config) if a == "config.json" else a for a in shlex.split(command)[1:]]
    monkeypatch.delenv("ROPE_RTC_NO_COMPILE")
    assert cli.main(argv + ["--kernels", "mla_rope_cache", "--no-progress"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setattr(store, "_stores", {})
    assert get_binary(spec, target_for(90), announce=False).source == "disk"
