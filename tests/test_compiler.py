"""NVRTC compilation (compiler.py) and the toolchain facts it relies on (toolchain.py). CPU only."""

from __future__ import annotations

import threading
import types
import time

import pytest

from rope_rtc.build import compiler, registry, sources, toolchain
from rope_rtc.errors import CompileError, ToolchainError
from rope_rtc.build.toolchain import Target

BROKEN_SOURCE = b"""#include "common.cuh"
extern "C" __global__ void broken_kernel(float* out) {
    out[0] = 1.0f;
    out[1] = undefined_symbol_xyz;
}
"""

BROKEN_HEADER = b"""#pragma once
static_assert(sizeof(int) == 3, "header_assert_fired");
"""

USES_BROKEN_HEADER = b"""#include "broken_header.cuh"
extern "C" __global__ void uses_header(float* out) { out[0] = 1.0f; }
"""


@pytest.fixture
def extra_sources(monkeypatch):
    """Add files to cuda_src/ as the compiler sees it, without touching the checkout."""

    def add(**files: bytes) -> None:
        current = dict(sources.all_sources())
        current.update({name.replace("__", "."): data for name, data in files.items()})
        monkeypatch.setattr(sources, "all_sources", lambda: tuple(sorted(current.items())))

    return add


# -- compile errors carry their evidence -------------------------------------------------------

def test_compile_error_names_the_bad_line_options_and_kernel(extra_sources):
    extra_sources(broken__cu=BROKEN_SOURCE)
    with pytest.raises(CompileError) as info:
        compiler.compile_source("broken[X=1]", "broken.cu", (("X", "1"),), Target(90))
    text = str(info.value)
    # NVRTC's log line for the bad source line, as NVRTC wrote it: file(line): error: ...
    assert "broken.cu(4): error" in text
    assert "undefined_symbol_xyz" in text
    assert "-arch=sm_90" in text and "-DX=1" in text
    assert "broken[X=1]" in text
    err = info.value
    assert "broken.cu(4)" in err.log
    assert "-arch=sm_90" in err.options and err.kernel == "broken[X=1]"


def test_compile_error_in_a_header_names_the_header_line(extra_sources):
    extra_sources(broken_header__cuh=BROKEN_HEADER, uses_header__cu=USES_BROKEN_HEADER)
    with pytest.raises(CompileError) as info:
        compiler.compile_source("uses_header", "uses_header.cu", (), Target(80))
    assert "broken_header.cuh(2)" in str(info.value)
    assert "header_assert_fired" in str(info.value)


def test_nvrtc_sees_only_the_headers_the_key_holds(extra_sources):
    """A header reached by a computed include is not in the key, so NVRTC must not find it either."""
    extra_sources(hidden__cuh=b"#pragma once\n#define HIDDEN_VALUE 7\n",
                  computed__cu=b'#define HEADER "hidden.cuh"\n#include HEADER\n'
                               b'extern "C" __global__ void k(int* out) { out[0] = HIDDEN_VALUE; }\n',
                  direct__cu=b'#include "hidden.cuh"\n'
                             b'extern "C" __global__ void k(int* out) { out[0] = HIDDEN_VALUE; }\n')
    assert [n for n, _ in sources.included_sources("computed.cu")] == ["computed.cu"]
    with pytest.raises(CompileError, match="hidden.cuh"):
        compiler.compile_source("computed", "computed.cu", (), Target(80))
    assert compiler.compile_source("direct", "direct.cu", (), Target(80)).binary[:4] == b"\x7fELF"


def test_empty_output_is_an_error(monkeypatch):
    real = toolchain._nvrtc()

    class EmptyCubin:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def nvrtcGetCUBINSize(prog):
            status, _ = real.nvrtcGetCUBINSize(prog)
            return status, 0

        @staticmethod
        def nvrtcGetCUBIN(prog, buf):
            return (real.nvrtcResult.NVRTC_SUCCESS,)

    monkeypatch.setattr(compiler, "_nvrtc", lambda: EmptyCubin())
    spec = registry.blog_spec()
    with pytest.raises(CompileError, match="empty cubin"):
        compiler.compile_source(spec.name, spec.source, spec.defines, Target(90))


def test_a_source_that_does_not_exist_is_named():
    with pytest.raises(FileNotFoundError, match="no_such_file.cu"):
        compiler.compile_source("x", "no_such_file.cu", (), Target(90))


# -- options ----------------------------------------------------------------------------------

def test_options_are_fixed_ordered_and_never_fast_math():
    opts = compiler.compile_options((("A", "1"), ("B", "2")), Target(90))
    assert opts == ("-arch=sm_90", "-std=c++17", "-DA=1", "-DB=2")
    assert compiler.compile_options((("A", "1"),), Target(90, "ptx"))[0] == "-arch=compute_90"
    for spec in registry.all_specs((1,)):
        for o in compiler.compile_options(spec.defines, Target(90)):
            assert "fast" not in o.lower() and "ftz" not in o.lower(), o


def test_ptx_target_produces_ptx_for_that_virtual_architecture():
    spec = registry.tail_spec(1, 128)
    result = compiler.compile_source(spec.name, spec.source, spec.defines, Target(90, "ptx"))
    text = result.binary.rstrip(b"\0").decode()
    assert result.kind == "ptx"
    assert ".target sm_90" in text
    for entry in spec.entries:
        assert f".entry {entry}" in text


def test_assembled_source_records_options_and_source():
    spec = registry.blog_spec()
    text = compiler.assembled_source(spec.source, spec.defines, Target(80))
    assert "// option: -arch=sm_80" in text
    assert sources.read_source(spec.source).decode() in text


def test_nvrtc_releases_the_gil_during_a_compile():
    """warm runs compiles in threads; that only overlaps if the GIL is free while NVRTC works."""
    spec = registry.rope_spec("float32", False, 4)
    compiler.compile_source(spec.name, spec.source, spec.defines, Target(90))  # load NVRTC first
    done = threading.Event()
    started = time.perf_counter()

    def work():
        compiler.compile_source(spec.name, spec.source, spec.defines, Target(90))
        done.set()

    t = threading.Thread(target=work)
    t.start()
    last, gap = time.perf_counter(), 0.0
    while not done.is_set():
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    t.join()
    compile_time = time.perf_counter() - started
    # Holding the GIL would freeze this loop for the whole compile (~0.2 s).
    assert gap < 0.5 * compile_time, f"main thread stalled {gap * 1e3:.0f} ms of a {compile_time * 1e3:.0f} ms compile"


# -- targets ----------------------------------------------------------------------------------

@pytest.fixture
def fake_nvrtc(monkeypatch):
    """An NVRTC 13.0 that knows sm_75..sm_90 only."""
    monkeypatch.setattr(toolchain, "supported_archs", lambda: (75, 80, 86, 89, 90))
    monkeypatch.setattr(toolchain, "nvrtc_version", lambda: (13, 0))


def test_target_is_cubin_for_a_known_arch(fake_nvrtc):
    assert toolchain.target_for(90) == Target(90, "cubin")
    assert toolchain.target_for(86, driver_version=12000) == Target(86, "cubin")


def test_too_new_device_gets_ptx_of_newest_arch_when_driver_can_jit_it(fake_nvrtc):
    t = toolchain.target_for(120, driver_version=13000)
    assert t == Target(90, "ptx") and t.option == "-arch=compute_90"
    assert toolchain.target_for(100, driver_version=13020) == Target(90, "ptx")


@pytest.mark.parametrize("driver_version", [None, 12080, 12090])
def test_too_new_device_with_old_driver_names_the_package_to_upgrade(fake_nvrtc, driver_version):
    with pytest.raises(ToolchainError) as info:
        toolchain.target_for(120, driver_version=driver_version)
    text = str(info.value)
    assert "nvidia-cuda-nvrtc" in text and "sm_120" in text and "13.0" in text


def test_arch_older_than_supported_or_unknown_is_refused(fake_nvrtc):
    with pytest.raises(ToolchainError, match="sm_80 or newer"):
        toolchain.target_for(75, driver_version=13000)
    with pytest.raises(ToolchainError, match="sm_87"):
        toolchain.target_for(87, driver_version=13000)  # between known archs: no PTX fallback


def test_real_nvrtc_knows_the_tested_archs():
    known = toolchain.supported_archs()
    assert {80, 90, 100} <= set(known)
    assert toolchain.target_for(90) == Target(90, "cubin")
    major, minor = toolchain.nvrtc_version()
    assert major >= 12 and minor >= 0


def test_cuda_headers_match_nvrtc_major_version():
    h = toolchain.cuda_headers()
    assert h.cuda_version // 1000 == toolchain.nvrtc_version()[0]
    assert h.origin in ("wheel", "system", "ROPE_RTC_CUDA_INCLUDE")


@pytest.mark.parametrize(
    "text, arch",
    [("sm_90", 90), ("compute_90", 90), ("90", 90), ("9.0", 90), (90, 90), (9, 90), (" sm_86 ", 86),
     ("sm_100", 100), ("10.0", 100), ("12.1", 121), ("sm_90a", 90), ("sm_100f", 100), ("8.9", 89)],
)
def test_parse_arch_forms(text, arch):
    assert toolchain.parse_arch(text) == arch


@pytest.mark.parametrize("text", ["gfx90a", "sm_", "", "sm90x", "ampere", "sm_9.0.1"])
def test_parse_arch_rejects_what_is_not_an_architecture(text):
    with pytest.raises(ValueError, match="sm_90"):
        toolchain.parse_arch(text)


def test_target_names():
    assert Target(90).name == "sm_90" and Target(90).option == "-arch=sm_90"
    assert Target(120, "ptx").name == "compute_120"


# -- the CUDA 12 and CUDA 13 wheel layouts ------------------------------------------------------

def _fake_headers(folder, cuda_version: int) -> None:
    folder.mkdir(parents=True)
    (folder / "cuda.h").write_text(f"#define CUDA_VERSION {cuda_version}\n")
    (folder / "cuda_fp16.h").write_text("// fp16\n")
    (folder / "cuda_bf16.h").write_text("// bf16\n")


@pytest.mark.parametrize("major, layout", [(12, "cuda_runtime/include"), (13, "cu13/include")])
def test_headers_of_nvrtcs_major_are_found_in_either_wheel_layout(monkeypatch, tmp_path, major, layout):
    """CUDA 12 wheels have a folder per component (nvidia/cuda_runtime); CUDA 13 one per major (nvidia/cu13).

    Both majors' headers are present, as after a switch of extras: the one matching NVRTC wins.
    """
    root = tmp_path / "site" / "nvidia"
    _fake_headers(root / "cuda_runtime" / "include", 12090)
    _fake_headers(root / "cu13" / "include", 13050)
    real_find_spec = toolchain.importlib.util.find_spec

    def find_spec(name, *args):
        if name == "nvidia":
            return types.SimpleNamespace(submodule_search_locations=[str(root)])
        return real_find_spec(name, *args)

    monkeypatch.setattr(toolchain.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(toolchain, "nvrtc_version", lambda: (major, 9))
    monkeypatch.setattr(toolchain, "_system_include_dirs", lambda: [])
    toolchain._find_headers.cache_clear()
    try:
        h = toolchain._find_headers(None)
    finally:
        toolchain._find_headers.cache_clear()
    assert h.path == str(root / layout) and h.origin == "wheel" and h.cuda_version // 1000 == major


def test_missing_headers_name_the_runtime_wheel_of_nvrtcs_major(monkeypatch):
    monkeypatch.setattr(toolchain, "_wheel_include_dirs", lambda major: [])
    monkeypatch.setattr(toolchain, "_system_include_dirs", lambda: [])
    monkeypatch.setattr(toolchain, "nvrtc_version", lambda: (12, 9))
    toolchain._find_headers.cache_clear()
    try:
        with pytest.raises(ToolchainError, match="nvidia-cuda-runtime-cu12>=12.0,<13"):
            toolchain._find_headers(None)
    finally:
        toolchain._find_headers.cache_clear()


@pytest.mark.parametrize("major, extra", [(12, "cuda12"), (13, "cuda13"), (None, "cuda13")])
def test_install_hint_names_an_extra(major, extra):
    hint = toolchain.install_hint(major)
    assert f'pip install "rope-rtc[{extra}]"' in hint
    assert ("cuda12" in hint) == (major != 13)
