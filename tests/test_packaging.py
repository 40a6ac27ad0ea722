"""The wheel ships the CUDA sources and the installed package finds them.

Builds a wheel from a copy of the checkout (so no build/ or egg-info lands in it), installs it
into a scratch folder with pip, and asks the installed package where its sources are.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rope_rtc._version import __version__

REPO = Path(__file__).resolve().parents[1]
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
    assert "cuda-bindings" in metadata and "nvidia-cuda-nvrtc" in metadata
    entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    assert "rope-rtc = rope_rtc.cli:main" in entry_points


def test_installed_package_finds_its_sources_inside_itself(wheel, tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
                        "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    code = ("import json, rope_rtc, rope_rtc.sources as s; "
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
