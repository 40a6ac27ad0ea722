"""``rope-rtc info``: versions, the CUDA toolchain and where each part came from, devices, the
cache and the ``ROPE_RTC_*`` switches set. Works without a GPU."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path

from .._version import __version__
from ..errors import count
from .common import EXIT_OK, disk_store, size


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cmd_info(args: argparse.Namespace) -> int:
    """Print one line per part of the installation; exit 0."""
    from ..core import driver
    from ..build import toolchain
    from ..env import settings

    rows: list[tuple[str, str]] = [
        ("rope_rtc", f"{__version__} ({Path(__file__).resolve().parents[1]})"),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
    ]
    # Which CUDA toolchain this is: each part's version, where it came from, and its CUDA major
    # (one extra installs one coherent set; parts of two majors cannot work on one driver).
    majors: dict[str, int] = {}
    try:
        major, minor = toolchain.nvrtc_version()
        majors["NVRTC"] = major
        lib = toolchain.nvrtc_library()
        wheel = toolchain.installed_from(lib, toolchain.NVRTC_PACKAGES.values()) if lib else None
        where = ", ".join(x for x in (wheel, lib) if x)
        rows.append(("NVRTC", f"{major}.{minor}" + (f" ({where})" if where else "")))
    except Exception as exc:
        rows.append(("NVRTC", f"unavailable: {exc}"))
    bindings = toolchain.bindings_version()
    if toolchain.bindings_major() is not None:
        majors["cuda-bindings"] = toolchain.bindings_major()
    rows.append(("cuda-bindings", bindings or f"not installed: {toolchain.install_hint()}"))
    cupy_dist = next((n for n in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if _dist_version(n)), None)
    cupy_version = _dist_version(cupy_dist) if cupy_dist else None
    if cupy_dist and cupy_dist != "cupy":
        majors["CuPy"] = int(cupy_dist[len("cupy-cuda"):-1])
        cupy_version = f"{cupy_version} ({cupy_dist})"
    if cupy_version is None and importlib.util.find_spec("cupy") is not None:
        cupy_version = "installed (version unknown)"
    rows.append(("CuPy", cupy_version or f"not installed: {toolchain.install_hint()}"))
    rows.append(("NumPy", _dist_version("numpy") or "not installed"))
    rows.append(("ml_dtypes", _dist_version("ml_dtypes", "ml-dtypes") or "not installed"))

    gpu = driver.available()
    driver_major = None
    if gpu:
        try:
            v = driver.driver_version()
            driver_major = v // 1000
            rows.append(("CUDA driver", f"{v // 1000}.{(v % 1000) // 10}"))
        except Exception as exc:
            rows.append(("CUDA driver", f"unknown: {exc}"))
    else:
        rows.append(("CUDA driver", "none"))

    try:
        h = toolchain.cuda_headers()
        majors["CUDA headers"] = h.cuda_version // 1000
        origin = h.origin
        if h.origin == "wheel":
            wheel = toolchain.installed_from(Path(h.path) / "cuda_fp16.h", toolchain.RUNTIME_PACKAGES.values())
            origin = f"the {wheel} wheel" if wheel else "a wheel"
        elif h.origin == "system":
            origin = "a system CUDA"
        rows.append(("CUDA headers", f"{h.path} (CUDA {h.version_text}, from {origin})"))
    except Exception as exc:
        rows.append(("CUDA headers", f"not found: {exc}"))

    found = sorted(set(majors.values()))
    if "NVRTC" not in majors:
        summary = f"no CUDA toolchain: {toolchain.install_hint(driver_major)}"
    elif len(found) == 1:
        extra = toolchain.EXTRAS.get(found[0])
        summary = f"CUDA {found[0]}" + (f" (the rope-rtc[{extra}] set)" if extra else "")
        if driver_major is not None and driver_major < found[0]:
            summary += f"; the CUDA {driver_major} driver needs the CUDA {driver_major} one: " \
                       f"{toolchain.install_hint(driver_major)}"
    else:
        parts = ", ".join(f"{name} {m}" for name, m in majors.items())
        summary = (f"mixed CUDA versions ({parts}): install one set, "
                   f"{toolchain.install_hint(driver_major)}")
    rows.insert(2, ("toolchain", summary))
    try:
        archs = toolchain.supported_archs()
        rows.append(("NVRTC archs", " ".join(f"sm_{a}" for a in archs)
                     + f" (rope_rtc builds sm_{toolchain.MIN_ARCH} and newer)"))
    except Exception as exc:
        rows.append(("NVRTC archs", f"unknown: {exc}"))

    if gpu:
        for i in range(driver.device_count()):
            try:
                arch = driver.device_arch(i)
                try:
                    t = toolchain.target_for(arch, driver_version=driver.driver_version())
                    how = f"builds {t.name} {'CUBIN' if t.kind == 'cubin' else 'PTX (JIT by the driver)'}"
                except Exception as exc:
                    how = f"cannot build: {exc}"
                rows.append((f"device {i}", f"{driver.device_name(i)}, sm_{arch}; {how}"))
            except Exception as exc:
                rows.append((f"device {i}", f"unreadable: {exc}"))
    else:
        rows.append(("devices", f"no GPU found: {driver.unavailable_reason() or 'no CUDA device'}"))

    s = settings()
    store = disk_store(args.cache_dir)
    listed = store.list()
    bad = sum(1 for e in listed if e.error)
    where = f"{store.directory}"
    if s.disable_disk_cache and args.cache_dir is None:
        where += " (disabled by ROPE_RTC_DISABLE_DISK_CACHE)"
    rows.append(("cache", where))
    contents = f"{count(len(listed), 'entry', 'entries')}, {size(sum(e.size for e in listed))}"
    if bad:
        contents += f", {bad} unusable (rope-rtc cache verify names them)"
    try:
        created = store.directory.exists()
    except OSError:  # a parent directory this user cannot search: store.problem says so
        created = True
    if not created and (store.missing or not store.problem):
        contents = "empty (not created yet)"
    elif not created:  # it can never be created where it is (a path through a regular file)
        contents = f"none; {store.problem}"
    elif store.problem:
        contents += f"; {store.problem}"
    rows.append(("cache entries", contents))

    switches = sorted((k, v) for k, v in os.environ.items() if k.startswith("ROPE_RTC_"))
    rows.append(("switches", ", ".join(f"{k}={v}" for k, v in switches) if switches else "none set"))

    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return EXIT_OK
