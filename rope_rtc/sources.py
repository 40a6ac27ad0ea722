"""The device sources under ``cuda_src/``: where they live and what they hold.

``cuda_src/`` sits beside the package in a checkout or editable install, and inside it
(``rope_rtc/cuda_src``) in a wheel. Every file there is part of every cache key, so an edited
header can never be served a binary built from the old one.
"""

from __future__ import annotations

import functools
from pathlib import Path

SOURCE_SUFFIXES = (".cu", ".cuh")


@functools.lru_cache(maxsize=1)
def source_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "cuda_src", here / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"rope_rtc's CUDA sources (cuda_src/) were not found beside or inside {here}")


@functools.lru_cache(maxsize=1)
def all_sources() -> tuple[tuple[str, bytes], ...]:
    """Every device source file, as sorted (name, bytes) pairs."""
    folder = source_dir()
    files = sorted(p for p in folder.iterdir() if p.suffix in SOURCE_SUFFIXES and p.is_file())
    return tuple((p.name, p.read_bytes()) for p in files)


def read_source(name: str) -> bytes:
    for fname, data in all_sources():
        if fname == name:
            return data
    raise FileNotFoundError(f"no device source {name!r} in {source_dir()}")


def headers() -> dict[str, bytes]:
    """The project's own headers, handed to NVRTC by name (no include path into the install)."""
    return {name: data for name, data in all_sources() if name.endswith(".cuh")}
