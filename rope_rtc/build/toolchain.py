"""NVRTC and the CUDA headers it compiles against: versions, architectures, targets.

Bytes and strings only: nothing here touches a GPU, so every function works on a build
machine without one.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..env import settings
from ..errors import ToolchainError
from . import sources

# Architectures the project supports and tests (sm_80 and newer: 16-byte loads, bf16 math).
MIN_ARCH = 80


# The CUDA toolchain of each major version: the pyproject extra that installs it and the NVIDIA
# wheels that carry NVRTC and the runtime headers (their names change with the major).
EXTRAS = {13: "cuda13", 12: "cuda12"}
NVRTC_PACKAGES = {13: "nvidia-cuda-nvrtc", 12: "nvidia-cuda-nvrtc-cu12"}
RUNTIME_PACKAGES = {13: "nvidia-cuda-runtime", 12: "nvidia-cuda-runtime-cu12"}


def install_hint(major: int | None = None) -> str:
    """The pip command that installs a coherent CUDA toolchain: the extra for ``major`` when known."""
    if major in EXTRAS:
        return f'pip install "rope-rtc[{EXTRAS[major]}]"'
    return " or ".join(f'pip install "rope-rtc[{extra}]" (CUDA {m} driver)' for m, extra in sorted(EXTRAS.items(),
                                                                                                   reverse=True))


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise ToolchainError(f"cuda-python's bindings are missing ({exc}): {install_hint()}") from exc
    return nvrtc


def _ok(result, what: str):
    """Unpack an NVRTC call's (status, values...) tuple, raising on any non-success."""
    status = result[0]
    if int(status) != 0:
        nvrtc = _nvrtc()
        _, text = nvrtc.nvrtcGetErrorString(status)
        raise ToolchainError(f"{what} failed: {getattr(status, 'name', status)} ({text.decode(errors='replace')})")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


def bindings_version() -> str | None:
    """The installed cuda-bindings version ("12.9.10"), or None."""
    try:
        return importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        return None


def bindings_major() -> int | None:
    """cuda-bindings' CUDA major version: it loads the NVRTC and driver API of that major."""
    v = bindings_version()
    try:
        return int(v.split(".")[0]) if v else None
    except ValueError:
        return None


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor) version."""
    try:
        major, minor = _ok(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    except ToolchainError:
        raise
    except Exception as exc:  # library not found by cuda-pathfinder
        raise ToolchainError(
            f"NVRTC could not be loaded ({exc}); install it with the toolchain of the driver's CUDA version: "
            f"{install_hint(bindings_major())}"
        ) from exc
    return int(major), int(minor)


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    """The sm_XY numbers this NVRTC can generate code for (e.g. 75, 80, ..., 121)."""
    archs = _ok(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    return tuple(sorted(int(a) for a in archs))


def every_target() -> list["Target"]:
    """CUBIN and PTX for every architecture this NVRTC builds."""
    return [Target(arch, kind) for arch in supported_archs() for kind in ("cubin", "ptx")]


def parse_arch(text: str | int) -> int:
    """``"sm_90"``, ``"compute_90"``, ``"90"``, ``"9.0"`` or ``90`` -> 90. An ``a`` or ``f`` suffix
    (``sm_90a``) names the same GPUs, which the build without it serves: the kernels use no
    architecture-specific instruction, and a plan loads the build of the device's compute
    capability (``sm_90``), so that is what a warm for ``sm_90a`` must fill."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(?:sm_|compute_)?(\d+)(?:\.(\d))?([af]?)\s*", str(text))
        if not m:
            raise ValueError(f"arch {text!r} is not an architecture: use a form like 'sm_90'")
        value = int(m.group(1)) * 10 + int(m.group(2)) if m.group(2) is not None else int(m.group(1))
    if value < 10:
        value *= 10
    return value


@dataclass(frozen=True)
class Target:
    """What to compile for: CUBIN for one exact architecture, or PTX for a virtual one."""

    arch: int
    kind: str = "cubin"  # "cubin" or "ptx"

    @property
    def name(self) -> str:
        return f"{'sm' if self.kind == 'cubin' else 'compute'}_{self.arch}"

    @property
    def option(self) -> str:
        return f"-arch={self.name}"


def target_for(arch: int, *, driver_version: int | None = None) -> Target:
    """The target for a device of compute capability ``arch``.

    CUBIN for the exact architecture when NVRTC knows it: CUBIN from a newer NVRTC loads on an
    older driver of the same major version. A device newer than NVRTC gets PTX for the newest
    architecture NVRTC knows, but only when the driver can JIT PTX of this NVRTC's version.
    """
    known = supported_archs()
    if arch < MIN_ARCH:
        raise ToolchainError(f"sm_{arch} is not supported: rope_rtc needs sm_{MIN_ARCH} or newer")
    if arch in known:
        return Target(arch, "cubin")
    major, minor = nvrtc_version()
    if arch > known[-1]:
        needed = major * 1000 + minor * 10
        if driver_version is not None and driver_version >= needed:
            return Target(known[-1], "ptx")
        raise ToolchainError(
            f"this device is sm_{arch}, newer than NVRTC {major}.{minor} knows (up to sm_{known[-1]}), and the "
            f"driver ({_fmt_driver(driver_version)}) cannot JIT PTX from NVRTC {major}.{minor}: upgrade the "
            f"'{NVRTC_PACKAGES.get(major, 'nvidia-cuda-nvrtc')}' package to a version that knows sm_{arch}, "
            "or the driver"
        )
    raise ToolchainError(f"NVRTC {major}.{minor} cannot generate code for sm_{arch} (it knows {list(known)})")


def _fmt_driver(v: int | None) -> str:
    return "unknown" if v is None else f"CUDA {v // 1000}.{(v % 1000) // 10}"


@dataclass(frozen=True)
class CudaHeaders:
    """The folder holding cuda_fp16.h / cuda_bf16.h, the CUDA version it declares, and why it was chosen."""

    path: str
    cuda_version: int  # CUDA_VERSION from cuda.h, e.g. 13000
    origin: str        # "ROPE_RTC_CUDA_INCLUDE", "wheel", "system"

    @property
    def version_text(self) -> str:
        return f"{self.cuda_version // 1000}.{(self.cuda_version % 1000) // 10}"


def _header_version(folder: Path) -> int | None:
    try:
        text = (folder / "cuda.h").read_text(errors="replace")
    except OSError:
        text = ""
    m = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", text)
    if m is None:
        try:
            text = (folder / "cuda_runtime_api.h").read_text(errors="replace")
        except OSError:
            return None
        m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    if m is None or not (folder / "cuda_fp16.h").is_file() or not (folder / "cuda_bf16.h").is_file():
        return None
    return int(m.group(1))


def _wheel_include_dirs(major: int) -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    out = []
    for root in spec.submodule_search_locations:
        # CUDA 13 wheels share one folder per major; CUDA 12 wheels have one per component.
        out += [Path(root) / f"cu{major}" / "include", Path(root) / "cuda_runtime" / "include"]
    return out


def _system_include_dirs() -> list[Path]:
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    return [Path(r) / "include" for r in roots if r]


@functools.lru_cache(maxsize=4)
def _find_headers(override: str | None) -> CudaHeaders:
    major, _ = nvrtc_version()
    if override:
        v = _header_version(Path(override))
        if v is None:
            raise ToolchainError(f"ROPE_RTC_CUDA_INCLUDE={override} holds no cuda.h/cuda_fp16.h/cuda_bf16.h")
        return CudaHeaders(override, v, "ROPE_RTC_CUDA_INCLUDE")
    seen = []
    for origin, dirs in (("wheel", _wheel_include_dirs(major)), ("system", _system_include_dirs())):
        for d in dirs:
            v = _header_version(d)
            if v is None:
                continue
            seen.append(f"{d} (CUDA {v // 1000})")
            # Headers of another major version than NVRTC's do not compile reliably.
            if v // 1000 == major:
                return CudaHeaders(str(d), v, origin)
    raise ToolchainError(
        f"no CUDA {major}.x headers (cuda_fp16.h, cuda_bf16.h) found for NVRTC {major}: install "
        f"'{RUNTIME_PACKAGES.get(major, 'nvidia-cuda-runtime')}>={major}.0,<{major + 1}' (seen: {seen or 'none'}), "
        "or set ROPE_RTC_CUDA_INCLUDE"
    )


def nvrtc_library() -> str | None:
    """Path of the NVRTC library the bindings loaded (through cuda-pathfinder), or None if unknown."""
    try:
        nvrtc_version()
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception:  # an older cuda-pathfinder, or no NVRTC: a courtesy for `rope-rtc info`
        return None


def installed_from(path: str | os.PathLike, packages: Iterable[str]) -> str | None:
    """``"name version"`` of the first of ``packages`` whose wheel installed ``path`` (a file), or None."""
    target = Path(path).resolve()
    for name in packages:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            if f.name == target.name and Path(dist.locate_file(f)).resolve() == target:
                return f"{name} {dist.version}"
    return None


def cuda_headers() -> CudaHeaders:
    """Where NVRTC's CUDA headers come from: the runtime wheel first, then a matching system CUDA."""
    return _find_headers(settings().cuda_include)


@functools.lru_cache(maxsize=8)
def headers_digest(folder: str, roots: tuple[str, ...]) -> str:
    """SHA-256 of the headers in ``folder`` that a compile including ``roots`` (``cuda_fp16.h``,
    ...) can read: each root and every header they include, transitively, looked up as NVRTC
    does (a quoted name beside the including file first, then in ``folder``), named by their
    path relative to ``folder``. A name not found there is NVRTC's own, keyed by its version.

    For a header folder nobody versioned (``ROPE_RTC_CUDA_INCLUDE``): a hand edit changes this
    even where ``CUDA_VERSION`` does not. Computed once per process and folder; the wheel's
    headers are keyed by their version instead and never hashed.
    """
    import hashlib

    base = os.path.abspath(folder)
    h = hashlib.sha256()
    seen: set[str] = set()
    pending = [os.path.join(base, r) for r in roots]
    while pending:
        path = os.path.normpath(pending.pop())
        if path in seen or not os.path.isfile(path):
            continue
        seen.add(path)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:  # NVRTC cannot read it either; its name and the failure still count
            data = f"unreadable: {exc.strerror}".encode()
        name = os.path.relpath(path, base).encode()
        h.update(len(name).to_bytes(8, "little") + name + len(data).to_bytes(8, "little") + data)
        for quoted, inc in sources.includes(data):
            if quoted:
                beside = os.path.join(os.path.dirname(path), inc)
                if os.path.isfile(beside):
                    pending.append(beside)
                    continue
            pending.append(os.path.join(base, inc))
    return h.hexdigest()
