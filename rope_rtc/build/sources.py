"""The device sources under ``cuda_src/``: where they live and what each kernel includes.

``cuda_src/`` sits beside the package in a checkout or editable install, and inside it
(``rope_rtc/cuda_src``) in a wheel. A specialisation's cache key holds the bytes of its ``.cu``
file and of every project header it includes, followed transitively through
``#include "name"`` lines (:func:`included_sources`): an edited header can never be served a
binary built from the old one, and editing one kernel (a benchmark-only one, say) leaves the
binaries of the others valid. NVRTC is handed exactly those headers and no others, so a compile
cannot read a project file its key does not hold.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

SOURCE_SUFFIXES = (".cu", ".cuh")

# An include on a line of its own, quoted or <angled>. Conditional includes count whether or not
# the condition holds (keying one file too many is harmless). Quoted ones name project headers,
# keyed by their bytes; <angle> ones are CUDA's headers, keyed by their version
# (rope_rtc/build/toolchain.py), and by their bytes too when ROPE_RTC_CUDA_INCLUDE names them.
_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*(?:"([^"\r\n]+)"|<([^>\r\n]+)>)', re.MULTILINE)


def includes(data: bytes) -> list[tuple[bool, str]]:
    """``(quoted, name)`` for each include line of a source or header, in order."""
    return [(bool(q), (q or a).decode(errors="replace")) for q, a in _INCLUDE.findall(data)]


@functools.lru_cache(maxsize=1)
def source_dir() -> Path:
    here = Path(__file__).resolve().parents[1]  # the package: this module is in its build/ folder
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


def included_sources(name: str) -> tuple[tuple[str, bytes], ...]:
    """``name`` and every project header it includes, transitively, as sorted (name, bytes) pairs.

    A quoted include that names no file in ``cuda_src/`` is not ours and is left to NVRTC's
    include path; cycles end because each file is visited once.
    """
    files = dict(all_sources())
    if name not in files:
        raise FileNotFoundError(f"no device source {name!r} in {source_dir()}")
    seen = {name}
    pending = [name]
    while pending:
        for quoted, header in includes(files[pending.pop()]):
            if quoted and header in files and header not in seen:
                seen.add(header)
                pending.append(header)
    return tuple((n, files[n]) for n in sorted(seen))


def included_headers(name: str) -> dict[str, bytes]:
    """The project headers ``name`` includes, handed to NVRTC by name (no include path into the install)."""
    return {n: data for n, data in included_sources(name) if n != name}


@functools.lru_cache(maxsize=1)
def cuda_includes() -> tuple[str, ...]:
    """The CUDA headers (``<name>`` includes) the device sources include, sorted."""
    return tuple(sorted({name for _, data in all_sources() for quoted, name in includes(data) if not quoted}))
