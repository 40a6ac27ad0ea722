"""``rope-rtc demo``: quick on a machine without a GPU, with or without the CUDA toolchain;
compiling only when ``--warm`` asks (the demo on a GPU: test_gpu_demo.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rope_rtc import cli, demo
from rope_rtc.build import registry, toolchain
from rope_rtc import warm as _warm  # noqa: F401 - imported before any test patches the toolchain it binds
from rope_rtc.errors import ToolchainError

REPO = Path(__file__).resolve().parents[1]
# The demo's promise on a CPU machine, cold (a fresh process, an empty cache).
CPU_DEMO_SECONDS = 10.0


@pytest.fixture
def no_toolchain(monkeypatch):
    """An installation without the cuda extra: no cuda-bindings, no NVRTC, no CuPy."""
    def missing(*args, **kwargs):
        raise ToolchainError("cuda-python's bindings are missing (simulated): " + toolchain.install_hint())

    for name in ("cuda", "cuda.bindings", "cuda.bindings.nvrtc", "cuda.bindings.driver", "cupy"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    for name in ("_nvrtc", "nvrtc_version", "supported_archs"):
        monkeypatch.setattr(toolchain, name, missing)


def test_demo_without_a_gpu_is_quick_cold_and_compiles_nothing(tmp_path):
    cache_root = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_RTC_")}
    env.update(PYTHONPATH=str(REPO), ROPE_RTC_CACHE_DIR=str(cache_root), CUDA_VISIBLE_DEVICES="")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", "import sys; from rope_rtc import demo; sys.exit(demo.main([]))"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert seconds < CPU_DEMO_SECONDS, f"the demo took {seconds:.1f} s on a machine without a GPU"
    assert "no GPU found" in r.stdout
    assert "the blog's worked example" in r.stdout and "rotate_half" in r.stdout
    assert "FAILED" not in r.stdout
    assert "rope-rtc demo --warm" in r.stdout, r.stdout
    assert not any(cache_root.rglob("*.bin")), "the demo compiled kernels without --warm"


def test_demo_without_the_cuda_toolchain_still_succeeds(capsys, tmp_path, no_device, no_toolchain):
    rc = demo.main(["--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAILED" not in out and "ToolchainError" not in out
    assert "no CUDA toolchain here" in out and "rope-rtc[cuda" in out, out
    assert not (tmp_path / "cache").exists()


def test_demo_warm_without_the_toolchain_fails_and_says_why(capsys, tmp_path, no_device, no_toolchain):
    rc = demo.main(["--warm", "--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert rc == 1
    assert "cannot compile here" in out and "rope-rtc[cuda" in out, out
    assert "the blog's worked example" in out  # the examples still ran
    assert not (tmp_path / "cache").exists()


def test_demo_warm_compiles_the_library_kernels_and_the_demos_own(capsys, tmp_path, monkeypatch, no_device):
    """--warm builds every registered kernel, the blog's included (the GPU demo runs them),
    which a plain `rope-rtc warm` leaves out."""
    few = [registry.blog_spec(), registry.tail_spec(1, 128)]
    monkeypatch.setattr(registry, "all_specs", lambda *a, **k: list(few))
    rc = demo.main(["--warm", "--arch", "sm_80", "--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "warming the kernel cache for sm_80" in out and "2 compiled, 0 already cached, 0 failed" in out, out
    assert len(list((tmp_path / "cache").rglob("*.bin"))) == 2


def test_demo_help_offers_warm(capsys):
    assert cli.main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--warm" in out and "--arch" in out and "--cache-dir" in out
    assert "NumPy reference" in out


def test_demo_parses_its_arguments_as_the_command_line_does():
    ns = demo.parse_args(["--warm", "--arch", "sm_80"])
    assert ns.warm is True and ns.arch == "sm_80" and ns.cache_dir is None
    assert demo.parse_args([]).warm is False
    with pytest.raises(SystemExit):
        demo.parse_args(["--arch", "volta"])


def test_the_blog_case_moves_what_the_benchmark_counts():
    from rope_rtc.benchmark.cases import Case

    B, H, S, D = (demo.BLOG_SHAPE[k] for k in ("B", "H", "S", "D"))
    assert demo.blog_bytes_moved(B, H, S, D) == Case("blog", "float32", "bhsd", True, B, S, H, H, D).bytes_moved()


def test_gpu_us_times_bursts_by_events_and_returns_the_median_per_call():
    """rope_rtc.measure.gpu_us on a fake CuPy whose GPU takes 2 µs per call: the untimed lead
    call stays outside the window, and a sample makes enough calls to last ``sample_s``."""
    import types

    from rope_rtc.measure import gpu_us

    clock = {"now": 0.0, "calls": 0}
    per_call_ms = 0.002

    class Event:
        def record(self, stream):
            self.at = clock["now"]

        def synchronize(self):
            pass

    def fn():
        clock["now"] += per_call_ms
        clock["calls"] += 1

    cuda = types.SimpleNamespace(Event=Event, get_elapsed_time=lambda a, b: b.at - a.at)
    cp = types.SimpleNamespace(cuda=cuda)
    stream = types.SimpleNamespace(synchronize=lambda: None)
    us = gpu_us(cp, stream, fn, reps=5, sample_s=1e-4)
    assert abs(us - 2.0) < 1e-9
    # 3 warm-up calls, an estimate of 1 + 3, then 5 samples of 1 + n calls, n * 2 µs >= 100 µs.
    n = (clock["calls"] - 3 - 4) / 5 - 1
    assert n in (50, 51), clock["calls"]
