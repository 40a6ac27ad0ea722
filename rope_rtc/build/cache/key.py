"""The cache key: SHA-256 over labelled, length-prefixed fields.

A ``"|".join`` key is not injective and a truncated hash can collide; so every field is fed as
``label, length, bytes`` and the full 64-hex digest names the entry. Only inputs are hashed,
never compiler output. The key changes whenever the binary could: every source file the
specialisation includes (rope_rtc/build/sources.py), the specialisation, every option, the NVRTC
version, the CUDA headers' version, the target architecture and output kind, rope_rtc's
version, and KEY_FORMAT. Headers from a folder ROPE_RTC_CUDA_INCLUDE names are keyed by their
bytes as well, through an option (rope_rtc/build/compiler.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

# Bump when the key's fields or the entry format change.
KEY_FORMAT = 1


def _feed(h: "hashlib._Hash", label: str, value: bytes) -> None:
    lb = label.encode()
    h.update(len(lb).to_bytes(8, "little"))
    h.update(lb)
    h.update(len(value).to_bytes(8, "little"))
    h.update(value)


def cache_key(
    *,
    package_version: str,
    nvrtc_version: tuple[int, int],
    cuda_headers_version: int,
    target: str,
    kind: str,
    source_name: str,
    sources: Iterable[tuple[str, bytes]],
    options: Iterable[str],
) -> str:
    """Full-length hex SHA-256 of every input that can change the compiled binary."""
    h = hashlib.sha256()
    _feed(h, "key_format", str(KEY_FORMAT).encode())
    _feed(h, "rope_rtc", package_version.encode())
    _feed(h, "nvrtc", f"{nvrtc_version[0]}.{nvrtc_version[1]}".encode())
    _feed(h, "cuda_headers", str(cuda_headers_version).encode())
    _feed(h, "target", target.encode())
    _feed(h, "kind", kind.encode())
    _feed(h, "entry_source", source_name.encode())
    srcs = list(sources)
    _feed(h, "source_count", str(len(srcs)).encode())
    for name, data in srcs:
        _feed(h, "source_name", name.encode())
        _feed(h, "source_bytes", data)
    opts = list(options)
    _feed(h, "option_count", str(len(opts)).encode())
    for opt in opts:
        _feed(h, "option", opt.encode())
    return h.hexdigest()
