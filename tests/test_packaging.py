"""The wheel ships the CUDA sources and the installed package finds them.

Builds a wheel from a copy of the checkout (so no build/ or egg-info lands in it), installs it
into a scratch folder with pip, and asks the installed package where its sources are.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rope_rtc import cli
from rope_rtc.build import toolchain
from rope_rtc._version import __version__
from rope_rtc.errors import ToolchainError

REPO = Path(__file__).resolve().parents[1]
# What each CUDA extra must install: one CUDA major throughout (NVRTC, its headers, the bindings, CuPy).
EXTRA_TOOLCHAINS = {
    "cuda12": ("cuda-bindings", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12", "cupy-cuda12x"),
    "cuda13": ("cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "cupy-cuda13x"),
}
NETWORK_TROUBLE = ("Could not find a version", "No matching distribution", "Failed to establish a new connection",
                   "Temporary failure in name resolution", "Network is unreachable", "ProxyError")


def _local_setuptools_can_build() -> bool:
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return major >= 77  # pyproject's build requirement; bdist_wheel is built in since 70.1


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("rope_rtc", "cuda_src"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE", "LICENSE.txt"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    out = tmp / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-w", str(out), str(src)]
    if _local_setuptools_can_build():
        cmd.insert(4, "--no-build-isolation")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and any(s in r.stdout + r.stderr for s in NETWORK_TROUBLE):
        pytest.skip(f"cannot fetch the build backend (setuptools>=77) without network: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheels = list(out.glob("rope_rtc-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contains_every_cuda_source_and_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (REPO / "cuda_src").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sources and any(s.endswith(".cuh") for s in sources) and any(s.endswith(".cu") for s in sources)
    for s in sources:
        assert f"rope_rtc/cuda_src/{s}" in names, f"{s} is not shipped"
    for py in (REPO / "rope_rtc").rglob("*.py"):
        rel = py.relative_to(REPO).as_posix()
        assert rel in names, f"{rel} is not shipped (a subpackage missing from pyproject's package list?)"
    assert not any(n.startswith(("tests/", "cuda_src/", "scripts/")) for n in names), "files outside the package"


def test_wheel_metadata(wheel):
    z = zipfile.ZipFile(wheel)
    dist_info = f"rope_rtc-{__version__}.dist-info"
    metadata = z.read(f"{dist_info}/METADATA").decode()
    assert f"\nVersion: {__version__}\n" in metadata
    for extra, packages in EXTRA_TOOLCHAINS.items():
        for package in packages:
            assert any(line.startswith(f"Requires-Dist: {package}") and f'extra == "{extra}"' in line
                       for line in metadata.splitlines()), f"{package} is not in the {extra} extra's metadata"
    entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    assert "rope-rtc = rope_rtc.cli:main" in entry_points


def test_installed_package_finds_its_sources_inside_itself(wheel, tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
                        "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    code = ("import json, rope_rtc, rope_rtc.build.sources as s; "
            "print(json.dumps({'package': rope_rtc.__file__, 'dir': str(s.source_dir()), "
            "'names': [n for n, _ in s.all_sources()], 'version': rope_rtc.__version__}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_RTC_")}
    env["PYTHONPATH"] = str(site)  # and not the checkout: run from elsewhere
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    package = Path(got["package"]).resolve().parent
    assert package == (site / "rope_rtc").resolve()
    assert Path(got["dir"]).resolve() == package / "cuda_src"
    assert got["names"] == sorted(p.name for p in (REPO / "cuda_src").iterdir() if p.suffix in (".cu", ".cuh"))
    assert got["version"] == __version__


# -- one coherent CUDA toolchain per extra --------------------------------------------------------

def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirements(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*(.*?)\s*", line)
        assert m, line
        out[m.group(1).lower()] = m.group(2)
    return out


def test_each_cuda_extra_pins_one_cuda_major_throughout():
    project = _pyproject()["project"]
    base = _requirements(project["dependencies"])
    assert not [n for n in base if n.startswith(("cuda-", "nvidia-", "cupy"))], (
        "a CUDA package in the base dependencies rides along into every extra")
    extras = project["optional-dependencies"]
    assert {f"cuda{m}" for m in toolchain.EXTRAS} == {e for e in extras if e.startswith("cuda")}
    for major, extra in toolchain.EXTRAS.items():
        reqs = _requirements(extras[extra])
        assert tuple(reqs) == EXTRA_TOOLCHAINS[extra]
        assert toolchain.NVRTC_PACKAGES[major] in reqs and toolchain.RUNTIME_PACKAGES[major] in reqs
        for name, spec in reqs.items():
            if name.startswith("cupy"):
                continue  # cupy-cudaNNx: the major is in the name
            assert re.search(rf">={major}\.\d", spec) and f"<{major + 1}" in spec, f"{extra}: {name}{spec}"


def _info_rows(capsys, tmp_path) -> dict[str, str]:
    assert cli.main(["info", "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    return {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip() for line in out.splitlines() if "  " in line}


def test_info_names_the_toolchain_it_found(capsys, tmp_path):
    rows = _info_rows(capsys, tmp_path)
    major, minor = toolchain.nvrtc_version()
    assert rows["toolchain"] == f"CUDA {major} (the rope-rtc[{toolchain.EXTRAS[major]}] set)"
    assert rows["NVRTC"].startswith(f"{major}.{minor} (")
    lib = toolchain.nvrtc_library()
    assert lib and lib in rows["NVRTC"]
    if toolchain.installed_from(lib, toolchain.NVRTC_PACKAGES.values()):  # not a system CUDA's NVRTC
        assert toolchain.NVRTC_PACKAGES[major] in rows["NVRTC"]
    assert rows["cuda-bindings"] == toolchain.bindings_version() and toolchain.bindings_major() == major
    h = toolchain.cuda_headers()
    if h.origin == "wheel":
        assert f"from the {toolchain.RUNTIME_PACKAGES[major]} " in rows["CUDA headers"]


def test_info_flags_parts_of_two_cuda_versions(capsys, tmp_path, monkeypatch):
    major, _ = toolchain.nvrtc_version()
    other = 12 if major == 13 else 13
    monkeypatch.setattr(toolchain, "bindings_major", lambda: other)
    rows = _info_rows(capsys, tmp_path)
    assert rows["toolchain"].startswith("mixed CUDA versions (")
    assert f"NVRTC {major}" in rows["toolchain"] and f"cuda-bindings {other}" in rows["toolchain"]
    assert 'pip install "rope-rtc[' in rows["toolchain"]


def test_info_without_nvrtc_says_what_to_install(capsys, tmp_path, monkeypatch):
    def missing():
        raise ToolchainError("NVRTC could not be loaded (simulated)")

    monkeypatch.setattr(toolchain, "nvrtc_version", missing)
    rows = _info_rows(capsys, tmp_path)
    assert rows["toolchain"].startswith('no CUDA toolchain: pip install "rope-rtc[')
    assert "simulated" in rows["NVRTC"]
