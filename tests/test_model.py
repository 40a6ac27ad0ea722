"""A model's RoPE geometry from its Hugging Face config, and ``rope-rtc warm --model``: exactly
the kernels a plan for that model loads, for each architecture, on a machine without a GPU."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import ml_dtypes
import pytest

from rope_rtc import RopePlan, TensorDesc, cli
from rope_rtc.ops import rope_plan
from rope_rtc.errors import KernelNotCachedError
from rope_rtc.numerics.model import ModelRope, from_config
from rope_rtc.build.registry import rope_spec
from rope_rtc.ops.rope_params import POS_POSITIONS

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


# As published on the Hub (the fields the reader looks at): GPT-2's names for the geometry, and
# rotary_dim the rotated width of each head.
GPTJ_6B = {"architectures": ["GPTJForCausalLM"], "model_type": "gptj", "n_embd": 4096, "n_head": 16,
           "n_layer": 28, "n_positions": 2048, "rotary_dim": 64, "torch_dtype": "float32"}
CODEGEN_350M = {"architectures": ["CodeGenForCausalLM"], "model_type": "codegen", "n_embd": 1024, "n_head": 16,
                "n_layer": 20, "n_positions": 2048, "rotary_dim": 32, "torch_dtype": "float16"}


def test_gptj_and_codegen_configs_are_read_as_published():
    """transformers maps num_attention_heads and hidden_size to GPT-J's and CodeGen's n_head and
    n_embd, and rotates the first rotary_dim channels of each head (64 without the key):
    both configs raised ValueError (num_attention_heads missing, then rotary_dim 'disagreeing'
    with a partial_rotary_factor they do not have)."""
    assert from_config(GPTJ_6B) == ModelRope(256, 16, 16, 64, "float32", True)
    assert from_config(CODEGEN_350M) == ModelRope(64, 16, 16, 32, "float16", True)
    assert from_config({k: v for k, v in GPTJ_6B.items() if k != "rotary_dim"}).rotary_dim == 64  # its default
    with pytest.raises(ValueError, match=r"config: rotary_dim is null.*not 16.*--rotary-dim"):
        from_config({**GPTJ_6B, "rotary_dim": None})
    assert from_config({**GPTJ_6B, "n_head": 1, "rotary_dim": None}).rotary_dim == 4096  # one head: all of it
    for bad in (65, 512):
        with pytest.raises(ValueError, match=rf"config: rotary_dim {bad} must be even and at most head_dim 256"):
            from_config({**GPTJ_6B, "rotary_dim": bad})


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


@pytest.mark.parametrize("change,pattern", [
    ({"num_attention_heads": 10**9, "hidden_size": 128 * 10**9},
     r"config: num_attention_heads must be in 1\.\.4096, got 1000000000"),
    ({"num_key_value_heads": 10**9}, r"config: num_key_value_heads must be in 1\.\.4096, got 1000000000"),
    ({"head_dim": 10**9}, r"config: head_dim must be in 1\.\.65536, got 1000000000"),
    ({"hidden_size": 32 * 10**9}, r"config: hidden_size / num_attention_heads \(the head dim\) must be in 1\.\.65536, "
                                  r"got 1000000000"),
    ({"head_dim": 10**400}, r"config: head_dim must be in 1\.\.65536, got an int of 1329 bits"),
    ({"num_attention_heads": 32.0}, r"config: num_attention_heads must be a positive int, got 32\.0"),
    ({"head_dim": 1e9}, r"config: head_dim must be a positive int, got 1000000000\.0"),
])
def test_geometry_beyond_any_model_is_refused_naming_the_field_and_range(change, pattern):
    """Before: 10**9 heads (or a head dim of 10**9) was read, its builds went into the cache and
    NVRTC failed on each ("value exceeds range of int"); a head dim of 10**400 overflowed a float."""
    with pytest.raises(ValueError, match=pattern):
        from_config({**LLAMA3_8B, **change})


@pytest.mark.parametrize("kw,pattern", [
    ({"q_heads": 10**9}, r"q_heads \(--heads\) must be in 1\.\.4096"),
    ({"kv_heads": 4097}, r"kv_heads \(--kv-heads\) must be in 1\.\.4096"),
    ({"head_dim": 10**400}, r"head_dim \(--head-dim\) must be in 1\.\.65536, got an int of 1329 bits"),
    ({"rotary_dim": 2**16 + 2}, r"rotary_dim \(--rotary-dim\) must be in 1\.\.65536"),
])
def test_geometry_given_beyond_any_model_is_refused(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_config(LLAMA3_8B, **kw)
    with pytest.raises(ValueError, match=pattern):
        ModelRope(**{**dict(head_dim=128, q_heads=32, kv_heads=8, rotary_dim=128, dtype="bfloat16"), **kw})


def test_the_largest_geometry_is_read_and_its_builds_compile(tmp_path):
    from rope_rtc.build import cache
    from rope_rtc.build.kernels import get_binary
    from rope_rtc.numerics.model import MAX_HEAD_DIM, MAX_HEADS
    from rope_rtc.build.toolchain import Target

    model = from_config({"num_attention_heads": MAX_HEADS, "head_dim": MAX_HEAD_DIM, "torch_dtype": "bfloat16"})
    assert (model.q_heads, model.kv_heads, model.head_dim, model.rotary_dim) == (MAX_HEADS, MAX_HEADS, MAX_HEAD_DIM,
                                                                                  MAX_HEAD_DIM)
    fixed = next(s for s in model.specs() if s.family == "rope_fixed")
    store = cache.CacheStore(cache.DiskStore(cache.versioned_cache_dir(str(tmp_path))))
    assert get_binary(fixed, Target(90, "cubin"), store=store, announce=False).source == "compiled"


def test_warm_model_with_absurd_heads_exits_2_naming_the_field(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA3_8B, "num_attention_heads": 10**9, "hidden_size": 128 * 10**9}))
    assert cli.main(["warm", "--arch", "sm_90", "--model", str(config), "--cache-dir", str(tmp_path / "c"),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "num_attention_heads must be in 1..4096, got 1000000000" in err
    assert cli.main(["warm", "--arch", "sm_90", "--head-dim", "128", "--heads", "1000000000", "--dtype", "bf16",
                     "--cache-dir", str(tmp_path / "c"), "--no-progress"]) == 2
    assert "q_heads (--heads) must be in 1..4096" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


HUGE = "x" * (1 << 20)


@pytest.mark.parametrize("change,field", [
    ({"torch_dtype": HUGE}, "torch_dtype"),
    ({"num_attention_heads": HUGE}, "num_attention_heads"),
    ({"head_dim": HUGE}, "head_dim"),
    ({"num_key_value_heads": [HUGE]}, "num_key_value_heads"),
    ({"partial_rotary_factor": HUGE}, "partial_rotary_factor"),
    ({"rotary_dim": HUGE}, "rotary_dim"),
    ({"position_embedding_type": HUGE}, "position_embedding_type"),
    ({"num_key_value_heads": None, "num_kv_heads": HUGE}, "num_kv_heads"),
    ({"kv_lora_rank": 512, "qk_rope_head_dim": HUGE}, "qk_rope_head_dim"),
    ({"rope_scaling": {"mrope_section": HUGE}}, "mrope_section"),
    ({"rope_scaling": {"mrope_section": [10**400, 1, 2]}}, "mrope_section"),
    ({"rope_scaling": {"mrope_section": [16, 24, 24], "mrope_interleaved": HUGE}}, "mrope_interleaved"),
    ({"model_type": HUGE, "alibi": True}, "alibi"),
])
def test_errors_echo_a_value_shortened(change, field):
    """Before: the whole value went into the message (a 30 MiB torch_dtype: a 31 MB error line)."""
    config = {k: v for k, v in {**LLAMA3_8B, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=field) as info:
        from_config(config)
    assert len(str(info.value)) < 1000 and "x" * 100 not in str(info.value), str(info.value)[:1000]


def test_warm_model_with_a_30_mib_dtype_prints_a_short_error(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA3_8B, "torch_dtype": "b" * (30 << 20)}))
    assert cli.main(["warm", "--arch", "sm_90", "--model", str(config), "--cache-dir", str(tmp_path / "c"),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err) < 500 and f"({30 << 20} characters) is not a RoPE dtype" in err, err[:600]


def test_a_config_nested_deeper_than_the_parser_goes_is_a_usage_error(tmp_path, capsys):
    """Before: json.loads raised RecursionError, and ``warm --model`` ended in its traceback (rc 1)."""
    config = tmp_path / "config.json"
    config.write_text("[" * 100_000 + "]" * 100_000)  # past every Python version's C recursion limit
    with pytest.raises(ValueError, match=rf"--model: {re.escape(str(config))} is JSON nested too deeply"):
        from_config(config)
    assert cli.main(["warm", "--arch", "sm_90", "--model", str(config), "--cache-dir", str(tmp_path / "c"),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(config) in err and "nested too deeply" in err and "Traceback" not in err
    # A value nested deeper than repr() goes (a dict given directly, not read from JSON) is still shown.
    value: list = []
    for _ in range(5000):
        value = [value]
    with pytest.raises(ValueError, match=r"torch_dtype: \[\[\[\[\.\.\.\]\]\]\] is not a RoPE dtype"):
        from_config({**LLAMA3_8B, "torch_dtype": value})


def test_a_config_with_an_int_too_long_to_convert_is_named(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"num_attention_heads": ' + "1" * 5000 + "}")
    with pytest.raises(ValueError, match=rf"--model: {re.escape(str(config))} is not JSON"):
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

    def record(dtype, interleaved, vec, head_batch, device, pdl=False):
        loaded.append(rope_spec(dtype, interleaved, vec, head_batch))
        return ("rope_apply", "rope_apply_wide")

    def record_fixed(g, device, pdl=False):
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


# Slow (a hundred kernels for two architectures): CI runs it under -m slow.
@pytest.mark.slow
def test_warm_model_compiles_exactly_the_models_kernels(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B))
    root = tmp_path / "cache"
    assert cli.main(["warm", "--arch", "sm_90", "--arch", "sm_80", "--model", str(config), "--cache-dir", str(root),
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "model: head_dim 128, 32 q heads, 8 kv heads, rotary_dim 128, bfloat16, half-split pairs" in out
    assert "warmed 106 kernels for sm_90, sm_80" in out
    from rope_rtc.build.cache import open_store
    from rope_rtc.build.cache.location import versioned_cache_dir

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
    from rope_rtc.build.kernels import get_binary
    from rope_rtc.build.toolchain import target_for

    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path))
    with pytest.raises(KernelNotCachedError, match=r"rope-rtc warm --arch sm_90 --model config\.json"):
        get_binary(rope_spec("bfloat16", False, 8, 2), target_for(90))


@pytest.mark.parametrize("family,flag", [("rope_fixed", ""), ("rope_cache", ""), ("qk_norm_rope", " --qk-norm")])
def test_a_missing_specialised_kernel_names_the_model_command(tmp_path, monkeypatch, family, flag):
    """The command named builds the kernel: the family is in the model's set with that flag."""
    from rope_rtc.build.kernels import get_binary
    from rope_rtc.build.toolchain import target_for

    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path))
    spec = next(s for s in from_config(LLAMA3_8B, qk_norm=bool(flag)).specs() if s.family == family)
    assert family != "qk_norm_rope" or all(s.family != family for s in from_config(LLAMA3_8B).specs())
    with pytest.raises(KernelNotCachedError,
                       match=rf"rope-rtc warm --arch sm_90 --model config\.json{flag} --cache-dir .*--kv-heads"):
        get_binary(spec, target_for(90))


def test_a_miss_says_when_the_disk_cache_was_not_read(tmp_path, monkeypatch):
    from rope_rtc.build.kernels import get_binary
    from rope_rtc.build.cache.location import versioned_cache_dir
    from rope_rtc.build.registry import tail_spec
    from rope_rtc.build.toolchain import target_for

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


def test_a_miss_names_a_command_that_runs_as_written(tmp_path, monkeypatch):
    # A cache path with a space was pasted into the warm command unquoted (argparse: "unrecognized
    # arguments"); with the disk cache off, warming cannot help, and the message said to warm.
    import shlex

    from rope_rtc.build.kernels import get_binary
    from rope_rtc.build.registry import tail_spec
    from rope_rtc.build.toolchain import target_for
    from rope_rtc.cli import build_parser

    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path / "my cache"))
    with pytest.raises(KernelNotCachedError) as info:
        get_binary(tail_spec(3, 128), target_for(90))
    command = str(info.value).split("fill the cache on a build machine with: ")[1]
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.cache_dir == str(tmp_path / "my cache") and args.tail_heads == [3]
    monkeypatch.setenv("ROPE_RTC_DISABLE_DISK_CACHE", "1")
    with pytest.raises(KernelNotCachedError) as info:
        get_binary(tail_spec(3, 128), target_for(90))
    said = str(info.value)
    assert "rope-rtc warm" not in said and "unset ROPE_RTC_NO_COMPILE or ROPE_RTC_DISABLE_DISK_CACHE" in said, said


def test_a_missing_tail_kernel_names_its_head_count(tmp_path, monkeypatch):
    # The default warm builds a fixed list of tail head counts; the command must build this one.
    from rope_rtc.build.kernels import get_binary
    from rope_rtc.build.registry import tail_spec
    from rope_rtc.build.toolchain import target_for

    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path))
    with pytest.raises(KernelNotCachedError, match=r"rope-rtc warm --arch sm_90 --cache-dir \S+ --tail-heads 3$"):
        get_binary(tail_spec(3, 128), target_for(90))


def test_cache_builds_of_an_odd_geometry_all_compile(tmp_path):
    """rotary_dim / 2 odd: no FP8 build (its entries need 2-byte stores), and what is listed compiles."""
    from rope_rtc.build.kernels import get_binary
    from rope_rtc.build.cache import open_store
    from rope_rtc.build.toolchain import target_for

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
    from rope_rtc.numerics.model import from_config

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

    from rope_rtc.build.registry import fixed_geometry, mrope_head_batch

    g = fixed_geometry("bfloat16", False, 28, 4, 128, 0, 128, False)
    for small in (True, False):
        want = dataclasses.replace(g, mrope=(2 if interleaved else 1,) + section,
                                   head_batch=mrope_head_batch(28, 4, interleaved, small, gathered=interleaved)).spec()
        assert want.name in {s.name for s in specs}


def test_a_bad_mrope_section_is_named():
    from rope_rtc.numerics.model import from_config

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
    builds a QKNormRopePlan loads (every vector width and the staged twin, both numerics)."""
    from rope_rtc.build.registry import NormGeometry, norm_vector_widths

    base = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "torch_dtype": "bfloat16"}
    model = from_config({**base, **config})
    assert model.qk_norm is want
    specs = model.qk_norm_specs()
    if not want:
        assert specs == [] and from_config({**base, **config}, qk_norm=True).qk_norm_specs()
        return
    widths = norm_vector_widths("bfloat16", False, 128, 0, 128)
    # float32 weights: exact alone; the widest vector (16 bytes) has a staged twin for large launches
    assert len(specs) == 3 * (len(widths) + 1) and all(s in model.specs() for s in specs)
    assert NormGeometry("bfloat16", False, 32, 8, 128, 0, 128, widths[0], False, "exact", 4).spec() in specs
    assert NormGeometry("bfloat16", False, 32, 8, 128, 0, 128, 8, False, "exact", 4, staged=True).spec() in specs


# Slow (compiles every in-kernel angle build of a model): CI runs it under -m slow.
@pytest.mark.slow
def test_warm_inv_freq_builds_what_an_inv_freq_plan_loads(tmp_path, monkeypatch, capsys):
    """``--inv-freq``: the builds that compute cos and sin in the kernel, for q with k, q alone and
    k alone, both thread orders, decode and prefill; a missing one under ROPE_RTC_NO_COMPILE
    names the flag; what is listed compiles and is then found by a plan's build choice."""
    from rope_rtc.build.kernels import get_binary
    from rope_rtc.build.registry import angle_geometries
    from rope_rtc.build.toolchain import target_for

    base = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "torch_dtype": "bfloat16"}
    assert from_config(base).angle_specs() == []
    model = from_config(base, inv_freq=("float64", "float64"))
    specs = model.angle_specs()
    # Per head set (q with k, q alone, k alone), strided and dense: token-major order a small build
    # for each of the 4 position schemes and a large one, bhsd 3 and 1 (no cu_seqlens there).
    assert model.inv_freq == ("float64",) and len(specs) == 3 * 2 * (5 + 4) and all(s in model.specs() for s in specs)
    assert len(set(specs)) == len(specs)
    assert {s for s in specs} >= {g.spec() for g in angle_geometries("bfloat16", False, 32, 8, 128, 0, 128,
                                                                       "float64", False, POS_POSITIONS)}
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


# -- configs whose rotary geometry the reader cannot derive --------------------------------------

# Multi-head latent attention (DeepSeek-V3's fields): the rotary part is qk_rope_head_dim channels,
# not hidden_size / num_attention_heads, and k has one shared rotary head.
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128,
               "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128, "torch_dtype": "bfloat16"}
# DeepSeek-V2-Lite: no q compression (q_lora_rank null), the same latent kv.
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "hidden_size": 2048, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
                    "qk_nope_head_dim": 128, "torch_dtype": "bfloat16"}
# ChatGLM (remote code): kv heads in multi_query_group_num, the first kv_channels / 2 channels
# rotated in adjacent pairs.
CHATGLM = {"model_type": "chatglm", "hidden_size": 4096, "num_attention_heads": 32, "multi_query_attention": True,
           "multi_query_group_num": 2, "kv_channels": 128, "rope_ratio": 500, "torch_dtype": "bfloat16"}
# transformers' GLM-4 (rotate_half takes x[..., 0::2] and x[..., 1::2]: adjacent pairs), half the head.
GLM4 = {"model_type": "glm4", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 2,
        "head_dim": 128, "partial_rotary_factor": 0.5, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("config,kw,pattern", [
    ({**DEEPSEEK_V3, "model_type": "minicpm3"}, {}, r"config: model_type 'minicpm3' uses multi-head latent "
                                                     r"attention and says nothing of its rotary pairs.*--interleaved"),
    (DEEPSEEK_V3, {"interleaved": False}, r"config: the model rotates adjacent pairs"),
    (CHATGLM, {}, r"config: model_type 'chatglm'.*multi_query_group_num.*"
                  r"--head-dim 128 --heads 32 --kv-heads 2 --rotary-dim 64 --interleaved"),
    ({**CHATGLM, "model_type": None}, {}, r"multi_query_group_num"),
    ({"model_type": "falcon", "hidden_size": 4096, "num_attention_heads": 32, "num_kv_heads": 8,
      "new_decoder_architecture": True, "alibi": False, "torch_dtype": "bfloat16"}, {},
     r"config: num_kv_heads .*not num_key_value_heads.*--kv-heads"),
    ({**LLAMA3_8B, "model_type": "falcon", "alibi": True}, {}, r"config: alibi is true: .*no rotary embedding"),
    ({**LLAMA3_8B, "position_embedding_type": "absolute"}, {}, r"config: position_embedding_type 'absolute'"),
    ({**LLAMA3_8B, "rotary_dim": 64}, {}, r"config: rotary_dim 64 disagrees with .*128.*--rotary-dim"),
    (GLM4, {"interleaved": False}, r"config: model_type 'glm4' rotates adjacent pairs.*--interleaved"),
    ({**LLAMA3_8B, "model_type": "cohere2"}, {"interleaved": False}, r"model_type 'cohere2' rotates adjacent pairs"),
    ({"model_type": "glm4v", "torch_dtype": "bfloat16", "text_config": {
        "model_type": "glm4v_text", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 2,
        "partial_rotary_factor": 0.5, "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12]}}},
     {}, r"mrope_section: the multimodal RoPE builds rotate half-split pairs"),
])
def test_configs_whose_rotary_geometry_the_reader_cannot_derive_are_refused(config, kw, pattern):
    """Before: each was read as plain heads (or half-split pairs) and the wrong kernels warmed silently."""
    config = {k: v for k, v in config.items() if v is not None or k == "q_lora_rank"}
    with pytest.raises(ValueError, match=pattern):
        from_config(config, **kw)


def test_a_refused_config_serves_when_its_geometry_is_given():
    """The advice works: with the four geometry fields given, the config supplies only the dtype."""
    mla = dict(head_dim=64, q_heads=128, kv_heads=1, rotary_dim=64, interleaved=True)
    assert from_config(DEEPSEEK_V3, **mla) == ModelRope(64, 128, 1, 64, "bfloat16", True)
    glm = dict(head_dim=128, q_heads=32, kv_heads=2, rotary_dim=64, interleaved=True)
    assert from_config(CHATGLM, **glm) == ModelRope(128, 32, 2, 64, "bfloat16", True)


def test_adjacent_pair_models_are_read_as_interleaved():
    """transformers' GLM, Cohere, ERNIE 4.5, Helium and Llama 4 rotate adjacent pairs: left unsaid,
    ``interleaved`` follows the model type (before: always half-split)."""
    assert from_config(GLM4) == ModelRope(128, 32, 2, 64, "bfloat16", True)
    assert from_config({**GLM4, "model_type": "ernie4_5"}).interleaved is True
    llama4 = {"model_type": "llama4", "torch_dtype": "bfloat16", "text_config": {
        "model_type": "llama4_text", "hidden_size": 5120, "head_dim": 128, "num_attention_heads": 40,
        "num_key_value_heads": 8}}
    assert from_config(llama4) == ModelRope(128, 40, 8, 128, "bfloat16", True)
    assert from_config(GLM4, interleaved=True).interleaved is True
    assert from_config({**LLAMA3_8B, "model_type": "llama"}).interleaved is False


@pytest.mark.parametrize("config,want", [
    ({**LLAMA3_8B, "model_type": "llama"}, (128, 32, 8, 128)),
    ({"model_type": "mistral", "hidden_size": 4096, "head_dim": 128, "num_attention_heads": 32,
      "num_key_value_heads": 8, "torch_dtype": "bfloat16"}, (128, 32, 8, 128)),
    ({"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
      "torch_dtype": "bfloat16"}, (128, 28, 4, 128)),
    ({"model_type": "qwen2_5_vl", "torch_dtype": "bfloat16", "text_config": {
        "model_type": "qwen2_5_vl_text", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}}, (128, 28, 4, 128)),
    ({"model_type": "qwen3", "hidden_size": 4096, "head_dim": 128, "num_attention_heads": 32,
      "num_key_value_heads": 8, "torch_dtype": "bfloat16"}, (128, 32, 8, 128)),
    ({"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "head_dim": 256, "num_attention_heads": 8,
        "num_key_value_heads": 4}}, (256, 8, 4, 256)),
    ({"model_type": "olmo2", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
      "torch_dtype": "float32"}, (128, 32, 32, 128)),
    ({"model_type": "gpt_neox", "hidden_size": 2560, "num_attention_heads": 32, "rotary_pct": 0.25,
      "torch_dtype": "float16"}, (80, 32, 32, 20)),
    ({"model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
      "partial_rotary_factor": 0.75, "torch_dtype": "bfloat16"}, (128, 24, 8, 96)),
    ({"model_type": "glm4_moe", "hidden_size": 5120, "head_dim": 128, "num_attention_heads": 96,
      "num_key_value_heads": 8, "partial_rotary_factor": 0.5, "torch_dtype": "bfloat16"}, (128, 96, 8, 64)),
])
def test_the_configs_read_today_are_still_read(config, want):
    model = from_config(config)
    assert (model.head_dim, model.q_heads, model.kv_heads, model.rotary_dim) == want and model.interleaved is False


@pytest.mark.parametrize("config,kw", [
    ({**LLAMA3_8B, "num_key_value_heads": 5}, {}),
    ({**LLAMA3_8B, "num_key_value_heads": 64}, {}),
    (LLAMA3_8B, {"kv_heads": 3}),
])
def test_kv_heads_that_do_not_divide_q_heads_are_refused(config, kw):
    """Before: accepted, and kernels for a geometry no model has were warmed."""
    kv = kw.get("kv_heads", config["num_key_value_heads"])
    with pytest.raises(ValueError, match=rf"kv_heads: {kv} does not divide q_heads 32 .*num_key_value_heads"):
        from_config(config, **kw)
    with pytest.raises(ValueError, match=rf"kv_heads: {kv} does not divide q_heads 32"):
        ModelRope(128, 32, kv, 128, "bfloat16")


def test_warm_refuses_kv_heads_that_do_not_divide_q_heads_and_writes_nothing(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA3_8B, "num_key_value_heads": 5}))
    root = tmp_path / "cache"
    assert cli.main(["warm", "--arch", "sm_90", "--model", str(config), "--cache-dir", str(root),
                     "--no-progress"]) != 0
    assert "kv_heads: 5 does not divide q_heads 32" in capsys.readouterr().err
    assert not root.exists() or not any(p.is_file() for p in root.rglob("*"))


def _call_in_a_thread(call, fifo: Path, seconds: float = 10.0):
    """``(value, exception)`` of ``call()``, failing the test instead of hanging when it blocks
    (then the reader blocked on ``fifo`` is let go first: a writer opens and closes it)."""
    outcome: list = []

    def run():
        try:
            outcome.append((call(), None))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append((None, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY))  # the blocked reader sees end of file
        thread.join(seconds)
        pytest.fail(f"blocked for {seconds} s reading the FIFO {fifo}")
    return outcome[0]


def test_a_model_path_that_is_not_a_regular_file_is_refused_before_reading(tmp_path, capsys):
    """Before: a FIFO blocked forever (reading waits for a writer); /dev/zero would never end."""
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    _, exc = _call_in_a_thread(lambda: from_config(fifo), fifo)
    assert isinstance(exc, ValueError), exc
    assert re.search(rf"--model: {re.escape(str(fifo))} is a FIFO \(named pipe\), not a regular file", str(exc)), exc
    code, exc = _call_in_a_thread(lambda: cli.main(["warm", "--arch", "sm_90", "--model", str(fifo), "--cache-dir",
                                                   str(tmp_path / "cache"), "--no-progress"]), fifo)
    assert exc is None and code != 0
    assert "is a FIFO (named pipe), not a regular file" in capsys.readouterr().err
    for path, kind in ((tmp_path, "a directory"), (Path(os.devnull), "a character device")):
        with pytest.raises(ValueError, match=rf"--model: {re.escape(str(path))} is {kind}, not a regular file"):
            from_config(path)


def test_a_model_path_far_larger_than_any_config_is_refused(tmp_path, monkeypatch):
    """A weights file given by mistake is not read whole into memory; a config within the bound reads."""
    from rope_rtc.numerics import model

    monkeypatch.setattr(model, "MAX_CONFIG_BYTES", 100)
    path = tmp_path / "model.safetensors"
    path.write_bytes(b" " * 101)
    with pytest.raises(ValueError, match=r"holds more than 100 bytes, which no config\.json does"):
        from_config(path)
    path.write_text(json.dumps({"num_attention_heads": 2, "head_dim": 8, "torch_dtype": "bf16"}).ljust(100))
    assert from_config(path) == ModelRope(8, 2, 2, 8, "bfloat16")


def test_warm_model_of_an_adjacent_pair_model_needs_no_interleaved_flag(tmp_path):
    """``rope-rtc warm --model glm4.json``: without ``--interleaved`` the pair style follows the
    model type (the flag's absence was read as half-split, which the reader then refused)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GLM4))
    args = cli.build_parser().parse_args(["warm", "--model", str(config)])
    assert cli._model_from_args(args).interleaved is True
    args = cli.build_parser().parse_args(["warm", "--model", str(config), "--interleaved"])
    assert cli._model_from_args(args).interleaved is True
    config.write_text(json.dumps(LLAMA3_8B))
    args = cli.build_parser().parse_args(["warm", "--model", str(config)])
    assert cli._model_from_args(args).interleaved is False


def test_a_missing_ptx_build_is_added_by_the_warm_its_message_names(tmp_path, monkeypatch, capsys):
    """A GPU newer than NVRTC loads PTX (compute_XX); the miss names ``warm --arch compute_XX``,
    which must build PTX, not the CUBIN of the same number."""
    import shlex

    from rope_rtc.build.cache import store
    from rope_rtc.build.kernels import get_binary
    from rope_rtc.build.registry import tail_spec
    from rope_rtc.build.toolchain import Target
    from rope_rtc.cli import main as cli_main
    from rope_rtc.warm import resolve_targets

    assert resolve_targets(["compute_90", "sm_90", "compute_90"]) == [Target(90, "ptx"), Target(90, "cubin")]
    spec, ptx = tail_spec(3, 128), Target(90, "ptx")
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(store, "_stores", {})
    with pytest.raises(KernelNotCachedError) as info:
        get_binary(spec, ptx, announce=False)
    command = str(info.value).split("fill the cache on a build machine with: ")[1]
    assert "--arch compute_90" in command, command
    monkeypatch.delenv("ROPE_RTC_NO_COMPILE")
    assert cli_main(shlex.split(command)[1:] + ["--kernels", "tail*", "--no-progress"]) == 0
    assert "for compute_90" in capsys.readouterr().out
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setattr(store, "_stores", {})
    assert get_binary(spec, ptx, announce=False).source == "disk"


def test_a_missing_pdl_build_is_added_by_the_warm_its_message_names(tmp_path, monkeypatch, capsys):
    """A pdl=True plan loads the waiting build: the miss names ``warm --pdl``, which adds it (for
    sm_90 and newer only: older GPUs run the plain build)."""
    import shlex

    from rope_rtc.build.cache import store
    from rope_rtc.build.kernels import get_binary
    from rope_rtc.build.registry import rope_spec, waiting_for_producer
    from rope_rtc.build.toolchain import Target
    from rope_rtc.cli import main as cli_main

    plain = rope_spec("bfloat16", False, 8)
    spec = waiting_for_producer(plain)
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(store, "_stores", {})
    with pytest.raises(KernelNotCachedError) as info:
        get_binary(spec, Target(90), announce=False)
    command = str(info.value).split("fill the cache on a build machine with: ")[1]
    assert " --pdl " in command, command
    monkeypatch.delenv("ROPE_RTC_NO_COMPILE")
    argv = shlex.split(command)[1:]
    argv[argv.index("--arch") + 1] = "sm_80,sm_90"
    assert cli_main(argv + ["--no-progress"]) == 0
    assert "warmed 3 kernels for sm_80, sm_90" in capsys.readouterr().out  # no waiting build for sm_80
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setattr(store, "_stores", {})
    assert get_binary(spec, Target(90), announce=False).source == "disk"
    assert get_binary(plain, Target(80), announce=False).source == "disk"


def test_warm_pdl_adds_the_waiting_builds_of_a_models_rope_kernels_only(tmp_path):
    from rope_rtc.build.registry import PDL_FAMILIES, waiting_for_producer
    from rope_rtc.warm import warm

    specs = ModelRope(128, 32, 8, 128, "bfloat16", False).specs()
    fixed = [s for s in specs if s.family == "rope_fixed"][:2]
    others = [s for s in specs if s.family not in PDL_FAMILIES][:1]
    report = warm(["sm_90"], cache_dir=tmp_path, specs=fixed + others, pdl=True, progress=False)
    assert report.ok and report.compiled == 2 * len(fixed) + len(others), report.summary()
    from rope_rtc.build.cache import open_store
    from rope_rtc.build.cache.location import versioned_cache_dir

    listed = {e.entry.kernel for e in open_store(versioned_cache_dir(tmp_path)).disk.list()}
    assert listed == {s.name for s in fixed + others} | {waiting_for_producer(s).name for s in fixed}
