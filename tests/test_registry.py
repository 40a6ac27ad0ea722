"""The registry is one enumerable list, and every kernel in it compiles for the supported GPUs.

CPU only: NVRTC runs without a GPU. Compiling every spec for three architectures is the
slowest CPU test (about a hundred compiles), so the compiles of one architecture run in a
thread pool (NVRTC releases the GIL; see test_compiler.py).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from rope_rtc.build import kernels as build, registry, registry_mla, sources
from rope_rtc.build.compiler import compile_source
from rope_rtc.build.toolchain import Target

ELF_MAGIC = b"\x7fELF"


def test_specs_are_unique_and_named_after_their_defines():
    specs = registry.all_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names)), "two specs share a name (and would share a cache entry label)"
    for s in specs:
        for k, v in s.defines:
            assert f"{k}={v}" in s.name


def test_every_spec_names_an_existing_source_that_defines_its_entries():
    for spec in registry.all_specs():
        text = sources.read_source(spec.source).decode()
        for entry in spec.entries:
            assert re.search(rf'extern\s+"C"\s+__global__\b[^;{{]*?\b{entry}\s*\(', text), (
                f'{entry} is not an extern "C" kernel of {spec.source}')


def test_all_specs_covers_every_dtype_layout_width_and_tail_shape():
    specs = registry.all_specs(tail_heads=(4, 1, 4))
    rope = {dict(s.defines)["ROPE_DTYPE"] + dict(s.defines)["ROPE_INTERLEAVED"] + "/" + dict(s.defines)["ROPE_VEC"]
            for s in specs if s.family == "rope"}
    for dtype, code in registry.DTYPE_CODES.items():
        for interleaved in (False, True):
            for vec in registry.rope_vector_widths(dtype, interleaved):
                assert f"{code}{int(interleaved)}/{vec}" in rope
    tails = sorted((dict(s.defines)["TAIL_HEADS"], dict(s.defines)["TAIL_DIM"]) for s in specs if s.family == "tail")
    # Repeated head counts are warmed once.
    assert tails == sorted((str(h), str(d)) for h in (1, 4) for d in registry.TAIL_DIMS)
    assert sum(s.family == "blog" for s in specs) == 1


@pytest.mark.parametrize("dtype", sorted(registry.DTYPE_CODES))
@pytest.mark.parametrize("interleaved", [False, True])
def test_vector_widths_fit_a_16_byte_access_and_keep_pairs_whole(dtype, interleaved):
    widths = registry.rope_vector_widths(dtype, interleaved)
    assert widths == tuple(sorted(widths, reverse=True)), "widest first"
    assert widths[0] * registry.ITEMSIZE[dtype] == 16
    for w in widths:
        assert w * registry.ITEMSIZE[dtype] in registry.VECTOR_BYTES
        if interleaved:
            assert w % 2 == 0, "an interleaved pair must not straddle two accesses"


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="float64"):
        registry.rope_spec("float64", False, 2)


# Slow (every kernel for three architectures): CI runs it under -m slow. The default suite still
# compiles every kernel `rope-rtc warm` builds for sm_80 and sm_90 (test_cache.py's warmed_root).
@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90, 100])
def test_every_registered_kernel_compiles(arch):
    specs = registry.all_specs()
    target = Target(arch, "cubin")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda s: compile_source(s.name, s.source, s.defines, target), specs))
    for spec, result in zip(specs, results):
        assert result.kind == "cubin"
        assert result.binary[:4] == ELF_MAGIC, f"{spec.name} for sm_{arch} is not an ELF CUBIN"
        assert f"-arch=sm_{arch}" in result.options
        for entry in spec.entries:
            # The entry points a launch looks up by name must be in the binary, unmangled.
            assert entry.encode() in result.binary, f"{entry} missing from {spec.name} for sm_{arch}"


@pytest.mark.parametrize("interleaved", [False, True])
def test_every_head_batch_the_launch_can_choose_is_built(interleaved):
    """A plan loads rope_head_batches(); every choice of rope_head_batch must be among them."""
    built = registry.rope_head_batches(interleaved)
    for small in (False, True):
        for inner in (False, True):
            assert registry.rope_head_batch(interleaved, small, inner) in built
    names = {s.name for s in registry.all_specs()}
    for hb in built:
        assert registry.rope_spec("bfloat16", interleaved, 8, hb).name in names


# -- each specialisation is keyed on the sources it includes ------------------------------------

# The benchmark's copy kernel (rope_rtc/benchmark/runner.py builds the same spec).
BENCH_COPY = registry.KernelSpec("bench_copy", "bench_copy.cu", ("bench_copy_16b", "bench_spin"))
KEYED = [BENCH_COPY, registry.blog_spec(), registry.rope_spec("float16", False, 8),
         registry.rope_spec("bfloat16", True, 8), registry.tail_spec(8, 128)]


def _set_sources(monkeypatch, files: dict[str, bytes]) -> None:
    monkeypatch.setattr(sources, "all_sources", lambda: tuple(sorted(files.items())))


def _edit(monkeypatch, name: str) -> None:
    files = dict(sources.all_sources())
    assert name in files, f"cuda_src/{name} is gone: update this test"
    files[name] = files[name] + b"\n// edited\n"
    _set_sources(monkeypatch, files)


def _keys(specs=KEYED) -> dict[str, str]:
    return {s.name: build.spec_key(s, Target(90)) for s in specs}


@pytest.mark.parametrize("edited, family", [("bench_copy.cu", "bench_copy"), ("blog_kernels.cu", "blog"),
                                            ("rope.cu", "rope"), ("tail_rope.cu", "tail")])
def test_editing_one_kernel_source_changes_only_its_own_keys(monkeypatch, edited, family):
    """Editing a benchmark-only kernel must not invalidate a production binary (and vice versa)."""
    before = _keys()
    _edit(monkeypatch, edited)
    after = _keys()
    for spec in KEYED:
        if spec.family == family:
            assert after[spec.name] != before[spec.name], f"editing {edited} left {spec.name}'s key unchanged"
        else:
            assert after[spec.name] == before[spec.name], f"editing {edited} changed {spec.name}'s key"


def test_editing_common_header_changes_every_key_that_includes_it(monkeypatch):
    specs = [*registry.all_specs(tail_heads=(1, 8)), BENCH_COPY]
    including = [s for s in specs if "common.cuh" in dict(sources.included_sources(s.source))]
    assert including == specs, "every kernel includes common.cuh"
    before = _keys(specs)
    _edit(monkeypatch, "common.cuh")
    after = _keys(specs)
    assert all(after[s.name] != before[s.name] for s in specs)


# -- one rotation for every kernel (cuda_src/rotation.cuh) ------------------------------------------

# Every family that rotates pairs, with one build of each that all_specs() leaves out.
_NORM = registry.NormGeometry("bfloat16", False, 8, 2, 128, 0, 128, 8, False, "exact", 2)
ROTATING = {"rope", "rope_fixed", "rope_cache", "qk_norm_rope", "tail", "mla_rope_cache"}
ALL_FAMILIES = [*registry.all_specs(tail_heads=(8,)), BENCH_COPY, _NORM.spec(),
                registry.cache_spec("float16", True, 8, 1, 8, 2, 128, 128),
                registry_mla.mla_spec("bfloat16", True, 8, 1, 1, 16, 128, 64, 512)]


def test_every_kernel_that_rotates_includes_the_rotation_header_and_is_keyed_on_it(monkeypatch):
    """An edit of the rotation must reach every kernel that rotates (and no other): a kernel
    that did not include rotation.cuh would be served a binary of the old rotation."""
    assert {s.family for s in ALL_FAMILIES} >= ROTATING
    for s in ALL_FAMILIES:
        assert ("rotation.cuh" in dict(sources.included_sources(s.source))) == (s.family in ROTATING), s.name
    before = _keys(ALL_FAMILIES)
    _edit(monkeypatch, "rotation.cuh")
    after = _keys(ALL_FAMILIES)
    assert {s.name for s in ALL_FAMILIES if after[s.name] != before[s.name]} == {
        s.name for s in ALL_FAMILIES if s.family in ROTATING}


def test_the_rotation_is_written_only_in_the_rotation_header():
    """A pair rotated as the contract says (an FMA of a product rounded by __fmul_rn) appears in
    rotation.cuh alone: every kernel calls it, so no two kernels can round a rotation differently."""
    rotation = re.compile(rb"__fmaf_rn\([^;]*__fmul_rn\(")
    assert [name for name, data in sources.all_sources() if rotation.search(data)] == ["rotation.cuh"]


def test_the_general_builds_share_their_element_and_vector_types():
    """The generic, specialised and cache-write builds read and round their elements through one
    definition (rope_types.cuh), not each its own."""
    typedef = re.compile(rb"typedef\s+Scalar<elem_t>\s+conv\s*;")
    for name in ("rope.cu", "rope_fixed.cu", "rope_cache.cu"):
        assert "rope_types.cuh" in dict(sources.included_sources(name)), name
        assert not typedef.search(sources.read_source(name)), f"{name} defines its own element types"


@pytest.mark.parametrize("dtype", sorted(registry.DTYPE_CODES))
def test_the_cache_write_builds_compile(dtype):
    """Every cache kind and pair style of the fused RoPE + KV-cache write compiles (all_specs()
    leaves them to `warm --model`): both pair styles, the widest and narrowest widths each kind
    builds, a window shorter than the head."""
    specs = []
    for interleaved in (False, True):
        for kind in registry.CACHE_KIND_NAMES:
            widths = [w for w in registry.cache_vector_widths(dtype, interleaved, kind) if kind == 0 or w >= 2]
            specs += [registry.cache_spec(dtype, interleaved, w, kind, 8, 2, 128, 128) for w in {widths[0], widths[-1]}]
        specs.append(registry.cache_spec(dtype, interleaved, registry.cache_vector_widths(dtype, interleaved)[0], 0,
                                         8, 2, 128, 64))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda s: compile_source(s.name, s.source, s.defines, Target(90, "cubin")), specs))
    for spec, result in zip(specs, results):
        assert result.binary[:4] == ELF_MAGIC and b"rope_cache" in result.binary, spec.name


def test_a_file_no_kernel_includes_changes_no_key(monkeypatch):
    before = _keys()
    _set_sources(monkeypatch, {**dict(sources.all_sources()), "zz_unused.cuh": b"// nobody includes this\n"})
    assert _keys() == before


def test_headers_are_followed_transitively_and_cycles_end(monkeypatch):
    files = {
        "k.cu": b'#include "a.cuh"\nextern "C" __global__ void k() {}\n',
        "a.cuh": b'#pragma once\n  #  include "b.cuh"\n#include <cuda_fp16.h>\n// #include "commented.cuh"\n',
        "b.cuh": b'#pragma once\n#include "a.cuh"\n#include "not_ours.h"\n',
        "commented.cuh": b"// only named in a comment\n",
        "other.cuh": b"// unrelated\n",
    }
    _set_sources(monkeypatch, files)
    assert [n for n, _ in sources.included_sources("k.cu")] == ["a.cuh", "b.cuh", "k.cu"]
    spec = registry.KernelSpec("k", "k.cu", ("k",))
    before = build.spec_key(spec, Target(90))
    _set_sources(monkeypatch, {**files, "b.cuh": files["b.cuh"] + b"// edited two levels down\n"})
    assert build.spec_key(spec, Target(90)) != before


# -- what `rope-rtc warm` compiles ---------------------------------------------------------------

def test_default_warm_selection_holds_no_demo_or_benchmark_kernel():
    """The blog's kernels serve the demo and the benchmark only: a production cache warmed with
    the defaults holds none of them (they compile where they are used)."""
    from rope_rtc.warm import select_specs

    families = {s.family for s in select_specs()}
    assert "blog" not in families
    assert families >= {"rope", "rope_fixed", "tail"}
    assert all(s.family not in registry.DEMO_FAMILIES for s in registry.warm_specs())
    # Still registered, and still reachable by naming them.
    assert sum(s.family == "blog" for s in registry.all_specs()) == 1
    assert [s.family for s in select_specs(kernels=["blog"])] == ["blog"]


def test_a_model_warm_holds_no_blog_kernel():
    from rope_rtc.numerics.model import from_config

    model = from_config({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
                                   "num_key_value_heads": 8, "torch_dtype": "bfloat16"})
    assert all(s.family != "blog" for s in model.specs())


def test_cache_verify_still_recognises_a_blog_entry():
    """`rope-rtc cache verify` maps an entry to its build by name and key, not through the warm
    list, so a blog entry the demo or the benchmark compiled is still known."""
    from rope_rtc.warm import build_of

    spec, target = registry.blog_spec(), Target(90)
    found = build_of(spec.name, build.spec_key(spec, target), target)
    assert found is not None
    assert (found[0].family, found[0].source, found[0].defines, found[1]) == ("blog", spec.source, (), target)
