"""A model's RoPE geometry from its Hugging Face config, and ``rope-rtc warm --model``: exactly
the kernels a plan for that model loads, for each architecture, on a machine without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import pytest

from rope_rtc import RopePlan, TensorDesc, cli, rope_plan
from rope_rtc.errors import KernelNotCachedError
from rope_rtc.model import ModelRope, from_config
from rope_rtc.registry import rope_spec

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}


def test_llama3_8b_geometry():
    assert from_config(LLAMA3_8B) == ModelRope(128, 32, 8, 128, "bfloat16", False)


def test_partial_rotary_factor_explicit_head_dim_and_nested_text_config():
    phi = {"hidden_size": 2560, "num_attention_heads": 32, "partial_rotary_factor": 0.4, "torch_dtype": "float16"}
    assert from_config(phi) == ModelRope(80, 32, 32, 32, "float16", False)
    qwen3 = {"hidden_size": 2048, "head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 8,
             "dtype": "bfloat16"}
    assert from_config(qwen3).head_dim == 128
    vl = {"architectures": ["Qwen2VLForConditionalGeneration"], "torch_dtype": "bfloat16",
          "text_config": {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4}}
    assert from_config(vl) == ModelRope(128, 28, 4, 128, "bfloat16", False)
    assert from_config(LLAMA3_8B, dtype="fp16", interleaved=True).dtype == "float16"


def test_fields_a_config_reading_took_wrongly():
    """GPT-NeoX's rotary_pct was ignored (the whole head rotated); a null in text_config erased the
    outer value; mrope_interleaved "false" read as true; a text_config that is not an object."""
    neox = {"hidden_size": 2560, "num_attention_heads": 32, "rotary_pct": 0.25, "torch_dtype": "float16"}
    assert from_config(neox).rotary_dim == 20
    vl = {"head_dim": 256, "torch_dtype": "bfloat16", "rope_scaling": {"mrope_section": [64, 32, 32]},
          "text_config": {"hidden_size": 4096, "num_attention_heads": 32, "head_dim": None, "rope_scaling": None}}
    got = from_config(vl)
    assert got.head_dim == 256 and got.mrope_section == (64, 32, 32)
    with pytest.raises(ValueError, match="mrope_interleaved must be true or false"):
        from_config({**LLAMA3_8B, "rope_scaling": {"mrope_section": [16, 24, 24], "mrope_interleaved": "false"}})
    with pytest.raises(ValueError, match="text_config must be a JSON object"):
        from_config({**LLAMA3_8B, "text_config": "oops"})


@pytest.mark.parametrize("change,pattern", [
    ({"torch_dtype": None}, r"no torch_dtype \(or dtype\)"),
    ({"torch_dtype": "int8"}, r"torch_dtype: 'int8' is not a RoPE dtype"),
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor must be in \(0, 1\]"),
    ({"hidden_size": 4095}, r"hidden_size 4095 is not a multiple of num_attention_heads 32"),
    ({"num_attention_heads": "32"}, r"num_attention_heads must be a positive int"),
    ({"head_dim": 0}, r"head_dim must be a positive int"),
])
def test_config_errors_name_the_field(change, pattern):
    config = {k: v for k, v in {**LLAMA3_8B, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=pattern):
        from_config(config)


def test_partial_rotary_factor_inside_rope_parameters():
    # transformers 5 keeps the fraction in rope_parameters (GLM, Qwen3.5); a top-level one wins.
    glm = {**LLAMA3_8B, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    assert from_config(glm).rotary_dim == 64
    assert from_config({**glm, "partial_rotary_factor": 0.25}).rotary_dim == 32
    qwen35 = {"torch_dtype": "bfloat16", "text_config": {
        "hidden_size": 4096, "head_dim": 256, "num_attention_heads": 16, "num_key_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                            "mrope_interleaved": True}}}
    model = from_config(qwen35)
    assert (model.rotary_dim, model.mrope_section, model.mrope_interleaved) == (64, (11, 11, 10), True)
    with pytest.raises(ValueError, match=r"rope_parameters\.partial_rotary_factor must be in \(0, 1\]"):
        from_config({**LLAMA3_8B, "rope_parameters": {"partial_rotary_factor": 2}})


@pytest.mark.parametrize("change,pattern", [
    ({"num_key_value_heads": 0}, r"num_key_value_heads must be a positive int, got 0"),
    ({"partial_rotary_factor": 0.01}, r"partial_rotary_factor 0\.01 of head_dim 128 rotates no channel pair"),
])
def test_config_values_that_name_no_geometry_are_refused(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_config({**LLAMA3_8B, **change})


def test_each_build_is_listed_once_when_q_and_kv_heads_are_equal():
    # "q alone" and "k alone" are one build then (with mrope, the QK-norm and the inv_freq builds too).
    config = {**LLAMA3_8B, "num_key_value_heads": 32, "model_type": "qwen3", "rope_scaling": {"mrope_section": [16, 24, 24]}}
    names = [s.name for s in from_config(config, inv_freq=("float64",)).specs()]
    assert len(names) == len(set(names)) and len(names) > 40


def test_a_config_file_that_is_not_text_is_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe{\x00")
    with pytest.raises(ValueError, match=rf"--model: {path} is not JSON"):
        from_config(path)


def test_specs_are_what_a_plan_for_the_model_loads(monkeypatch):
    loaded = []

    def record(dtype, interleaved, vec, head_batch, device):
        loaded.append(rope_spec(dtype, interleaved, vec, head_batch))
        return ("rope_apply", "rope_apply_wide")

    def record_fixed(g, device):
        loaded.append(g.spec())
        return "rope_fixed"

    monkeypatch.setattr(rope_plan, "load_rope_functions", record)
    monkeypatch.setattr(rope_plan, "load_fixed_function", record_fixed)
    monkeypatch.setattr(rope_plan.Prepared, "_new_launcher", staticmethod(lambda address, device: None))
    bf16 = ml_dtypes.bfloat16
    cos = TensorDesc("float32", (4096, 64), device=0)
    for interleaved in (False, True):
        model = from_config(LLAMA3_8B, interleaved=interleaved)
        every = []
        shapes = {"bshd": ((8, 1, 32, 128), (8, 1, 8, 128)), "bhsd": ((8, 32, 1, 128), (8, 8, 1, 128)),
                  "thd": ((8, 32, 128), (8, 8, 128))}
        index = TensorDesc("int32", (8,), device=0)
        # Each position scheme (the specialised build fixes it): an offset, per-sequence offsets,
        # positions, and (packed tokens) cu_seqlens.
        schemes = {"bshd": ({}, {"offset": index}, {"positions": TensorDesc("int32", (8, 1), device=0)}),
                   "bhsd": ({}, {"offset": index}, {"positions": TensorDesc("int32", (8, 1), device=0)}), "thd": ({"cu_seqlens": TensorDesc("int32", (3,), device=0)},)}
        for layout, (qs, ks) in shapes.items():
            for q, k in ((qs, ks), (qs, None), (ks, None)):
                for scheme in schemes[layout]:
                    loaded.clear()
                    RopePlan(TensorDesc(bf16, q, device=0), k and TensorDesc(bf16, k, device=0), cos, cos,
                             interleaved=interleaved, layout=layout, **scheme).compile()
                    assert {s.name for s in loaded} <= {s.name for s in model.specs()}
                    assert sum(s.family == "rope_fixed" for s in loaded) == 2  # its own specialisation, strided and dense
                    every += loaded
        # Together the plans load every kernel the model warms but the fused cache-write builds
        # (loaded by rope_and_cache's plans).
        assert {s.name for s in every} == {s.name for s in model.specs() if s.family != "rope_cache"}
        assert {s.family for s in model.cache_specs()} == {"rope_cache"} and len(model.cache_specs()) == 3


def test_warm_model_compiles_exactly_the_models_kernels(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B))
    root = tmp_path / "cache"
    assert cli.main(["warm", "--arch", "sm_90", "--arch", "sm_80", "--model", str(config), "--cache-dir", str(root),
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "model: head_dim 128, 32 q heads, 8 kv heads, rotary_dim 128, bfloat16, half-split pairs" in out
    assert "warmed 106 kernels for sm_90, sm_80" in out
    from rope_rtc.cache import open_store
    from rope_rtc.cache.location import versioned_cache_dir

    listed = sorted((e.entry.kernel, e.entry.target) for e in open_store(versioned_cache_dir(root)).disk.list())
    want = sorted((s.name, t) for s in from_config(LLAMA3_8B).specs() for t in ("sm_90", "sm_80"))
    assert listed == want
    # The same fields as flags, without a config file.
    assert cli.main(["warm", "--arch", "sm_90", "--dtype", "bf16", "--head-dim", "128", "--heads", "32",
                     "--cache-dir", str(root), "--no-progress"]) == 0
    # (32, 32) shares its q-alone builds with (32, 8): new are its q-with-k specialisations (four
    # position schemes token-major, three for bhsd, each strided and dense) and three cache builds.
    assert "compiled 17, already cached 22" in capsys.readouterr().out
    assert cli.main(["warm", "--arch", "sm_90", "--heads", "32", "--cache-dir", str(root), "--no-progress"]) != 0
    assert "needs --dtype, --head-dim (or --model config.json)" in capsys.readouterr().err


def test_a_missing_kernel_under_no_compile_names_the_model_command(tmp_path, monkeypatch):
    from rope_rtc.build import get_binary
    from rope_rtc.toolchain import target_for

    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path))
    with pytest.raises(KernelNotCachedError, match=r"rope-rtc warm --arch sm_90 --model config\.json"):
        get_binary(rope_spec("bfloat16", False, 8, 2), target_for(90))


@pytest.mark.parametrize("family,flag", [("rope_fixed", ""), ("rope_cache", ""), ("qk_norm_rope", " --qk-norm")])
def test_a_missing_specialised_kernel_names_the_model_command(tmp_path, monkeypatch, family, flag):
    """The command named builds the kernel: the family is in the model's set with that flag."""
    from rope_rtc.build import get_binary
    from rope_rtc.toolchain import target_for

    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path))
    spec = next(s for s in from_config(LLAMA3_8B, qk_norm=bool(flag)).specs() if s.family == family)
    assert family != "qk_norm_rope" or all(s.family != family for s in from_config(LLAMA3_8B).specs())
    with pytest.raises(KernelNotCachedError,
                       match=rf"rope-rtc warm --arch sm_90 --model config\.json{flag} --cache-dir .*--kv-heads"):
        get_binary(spec, target_for(90))


def test_a_miss_says_when_the_disk_cache_was_not_read(tmp_path, monkeypatch):
    from rope_rtc.build import get_binary
    from rope_rtc.cache.location import versioned_cache_dir
    from rope_rtc.registry import tail_spec
    from rope_rtc.toolchain import target_for

    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path))
    versioned = Path(versioned_cache_dir())
    versioned.mkdir(mode=0o700)
    versioned.chmod(0o777)  # writable by others: refused, so warming it again would not help
    with pytest.warns(UserWarning, match="writable by other users"):
        with pytest.raises(KernelNotCachedError, match=r"\(the disk cache was not read: cache directory .* is "
                                                       r"writable by other users"):
            get_binary(tail_spec(1, 128), target_for(90))
    monkeypatch.setenv("ROPE_RTC_DISABLE_DISK_CACHE", "1")
    with pytest.raises(KernelNotCachedError, match=r"\(the disk cache is off: ROPE_RTC_DISABLE_DISK_CACHE=1\)"):
        get_binary(tail_spec(1, 128), target_for(90))


def test_a_missing_tail_kernel_names_its_head_count(tmp_path, monkeypatch):
    # The default warm builds a fixed list of tail head counts; the command must build this one.
    from rope_rtc.build import get_binary
    from rope_rtc.registry import tail_spec
    from rope_rtc.toolchain import target_for

    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path))
    with pytest.raises(KernelNotCachedError, match=r"rope-rtc warm --arch sm_90 --cache-dir \S+ --tail-heads 3$"):
        get_binary(tail_spec(3, 128), target_for(90))


def test_cache_builds_of_an_odd_geometry_all_compile(tmp_path):
    """rotary_dim / 2 odd: no FP8 build (its entries need 2-byte stores), and what is listed compiles."""
    from rope_rtc.build import get_binary
    from rope_rtc.cache import open_store
    from rope_rtc.toolchain import target_for

    model = ModelRope(head_dim=100, q_heads=4, kv_heads=2, rotary_dim=50, dtype="bfloat16")
    specs = model.cache_specs()
    assert [dict(s.defines)["CACHE_KIND"] for s in specs] == ["0"]
    for spec in specs:
        get_binary(spec, target_for(90), store=open_store(tmp_path), announce=False)


@pytest.mark.parametrize("rope,section,interleaved", [
    ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, (16, 24, 24), False),  # Qwen2-VL
    ({"text_config": {"rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                       "rope_type": "default"}}}, (24, 20, 20), True),            # Qwen3-VL
])
def test_a_vision_language_config_warms_its_mrope_builds(rope, section, interleaved):
    from rope_rtc.model import from_config

    config = {"head_dim": 128, "num_attention_heads": 28, "num_key_value_heads": 4, "torch_dtype": "bfloat16", **rope}
    model = from_config(config)
    assert model.mrope_section == section and model.mrope_interleaved is interleaved
    specs = model.mrope_specs()
    defines = [dict(s.defines) for s in specs]
    assert len(specs) == 24 and all(d["FIX_MROPE"] == ("2" if interleaved else "1") for d in defines)
    assert {(d["FIX_HQ"], d["FIX_HK"]) for d in defines} == {("28", "4"), ("28", "0"), ("4", "0")}
    assert set(s.name for s in specs) <= set(s.name for s in model.specs())
    # the builds a plan of this model loads are among them
    import dataclasses

    from rope_rtc.registry import fixed_geometry, mrope_head_batch

    g = fixed_geometry("bfloat16", False, 28, 4, 128, 0, 128, False)
    for small in (True, False):
        want = dataclasses.replace(g, mrope=(2 if interleaved else 1,) + section,
                                   head_batch=mrope_head_batch(28, 4, interleaved, small, gathered=interleaved)).spec()
        assert want.name in {s.name for s in specs}


def test_a_bad_mrope_section_is_named():
    from rope_rtc.model import from_config

    config = {"head_dim": 128, "num_attention_heads": 28, "num_key_value_heads": 4, "torch_dtype": "bfloat16",
              "rope_scaling": {"mrope_section": [16, 24, 20]}}
    with pytest.raises(ValueError, match="rope_scaling.mrope_section .* sums to 60"):
        from_config(config)


@pytest.mark.parametrize("config,want", [
    ({"model_type": "qwen3"}, True), ({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}, True),
    ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}, True), ({"model_type": "qwen3_next"}, True),
    ({"model_type": "llama"}, False)])
def test_a_qk_norm_model_warms_its_fused_builds(config, want):
    """Qwen3 and Gemma 3 normalise each q and k head: their warm set holds the fused QK-norm
    builds a QKNormRopePlan loads (every vector width, both numerics)."""
    from rope_rtc.registry import NormGeometry, norm_vector_widths

    base = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "torch_dtype": "bfloat16"}
    model = from_config({**base, **config})
    assert model.qk_norm is want
    specs = model.qk_norm_specs()
    if not want:
        assert specs == [] and from_config({**base, **config}, qk_norm=True).qk_norm_specs()
        return
    widths = norm_vector_widths("bfloat16", False, 128, 0, 128)
    assert len(specs) == 3 * len(widths) and all(s in model.specs() for s in specs)  # float32 weights: exact
    assert NormGeometry("bfloat16", False, 32, 8, 128, 0, 128, widths[0], False, "exact", 4).spec() in specs


def test_warm_inv_freq_builds_what_an_inv_freq_plan_loads(tmp_path, monkeypatch, capsys):
    """``--inv-freq``: the builds that compute cos and sin in the kernel, for q with k, q alone and
    k alone, both thread orders, decode and prefill; a missing one under ROPE_RTC_NO_COMPILE
    names the flag; what is listed compiles and is then found by a plan's build choice."""
    from rope_rtc.build import get_binary
    from rope_rtc.registry import angle_geometries
    from rope_rtc.toolchain import target_for

    base = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "torch_dtype": "bfloat16"}
    assert from_config(base).angle_specs() == []
    model = from_config(base, inv_freq=("float64", "float64"))
    specs = model.angle_specs()
    assert model.inv_freq == ("float64",) and len(specs) == 24 and all(s in model.specs() for s in specs)
    assert {s for s in specs} >= {g.spec() for g in angle_geometries("bfloat16", False, 32, 8, 128, 0, 128,
                                                                       "float64", False)}
    with pytest.raises(ValueError, match="inv_freq: 'float16'"):
        from_config(base, inv_freq=("float16",))
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path))
    with pytest.raises(KernelNotCachedError, match=r"--model config\.json --inv-freq float32"):
        get_binary(from_config(base, inv_freq=("float32",)).angle_specs()[0], target_for(90))
    monkeypatch.delenv("ROPE_RTC_NO_COMPILE")
    assert cli.main(["warm", "--arch", "sm_90", "--dtype", "bf16", "--head-dim", "128", "--heads", "32",
                     "--kv-heads", "8", "--inv-freq", "float32", "--kernels", "rope_fixed",
                     "--cache-dir", str(tmp_path / "c"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "cos/sin from float32 inv_freq" in out
