"""The on-disk entry format: a checked header, then the binary.

Layout: ``MAGIC`` (8 bytes), header length (8 bytes, little endian), a JSON header, payload.
The header names the key, the kernel, the target and the versions it was built with, and the
payload's SHA-256 and size, so a torn, truncated or foreign file is detected before it is
loaded and reads as a miss.

:func:`decode_entry` raises :class:`EntryError` and nothing else, whatever the bytes: every
file at an entry's path may have been written by anyone, and a parse failure of any kind means
"corrupt", never a crash.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

MAGIC = b"RRTCBIN1"
PREFIX_BYTES = 16  # MAGIC and the header length

# An entry is one CUBIN or PTX of a few kernels: tens of KB, a few hundred at most. A file
# larger than this at an entry's path is not one of ours, and is never read into memory.
MAX_ENTRY_BYTES = 8 << 20
# The header is a dozen short fields (a few hundred bytes).
MAX_HEADER_BYTES = 16 << 10

_TEXT_FIELDS = ("key", "kernel", "target", "kind", "nvrtc", "rope_rtc")


class EntryError(ValueError):
    """An entry failed verification (its text says which check)."""


@dataclass(frozen=True)
class Entry:
    key: str
    kernel: str
    target: str
    kind: str
    nvrtc: str
    rope_rtc: str
    payload: bytes
    created: float = 0.0


def _digest(fields: dict, payload: bytes) -> str:
    # The checksum covers the header's fields as well as the payload: no field can change unseen.
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    h.update(payload)
    return h.hexdigest()


def encode_entry(e: Entry) -> bytes:
    fields = {"key": e.key, "kernel": e.kernel, "target": e.target, "kind": e.kind, "nvrtc": e.nvrtc,
              "rope_rtc": e.rope_rtc, "created": e.created, "size": len(e.payload)}
    header = json.dumps(dict(fields, sha256=_digest(fields, e.payload)), sort_keys=True).encode()
    return MAGIC + len(header).to_bytes(8, "little") + header + e.payload


def _parse_header(data: bytes) -> tuple[dict, bytes]:
    """The header as a dict and the bytes after it; EntryError when they cannot be told apart."""
    if len(data) < len(MAGIC):
        if MAGIC.startswith(data):
            raise EntryError(f"truncated: {len(data)} bytes, not even the {PREFIX_BYTES}-byte prefix"
                             if data else "truncated: empty file")
        raise EntryError("not a rope_rtc cache entry (bad magic)")
    if data[:8] != MAGIC:
        raise EntryError("not a rope_rtc cache entry (bad magic)")
    if len(data) < PREFIX_BYTES:
        raise EntryError(f"truncated: {len(data)} bytes, not even the {PREFIX_BYTES}-byte prefix")
    n = int.from_bytes(data[8:PREFIX_BYTES], "little")
    if n <= 0 or n > MAX_HEADER_BYTES:
        raise EntryError(f"corrupt header length {n} (a header is 1 to {MAX_HEADER_BYTES} bytes)")
    if PREFIX_BYTES + n > len(data):
        raise EntryError(f"truncated: the header needs {PREFIX_BYTES + n} bytes, the file has {len(data)}")
    try:
        h = json.loads(data[PREFIX_BYTES : PREFIX_BYTES + n])
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise EntryError(f"corrupt header ({type(exc).__name__})") from None
    if not isinstance(h, dict):
        raise EntryError(f"corrupt header (a JSON {type(h).__name__}, not an object)")
    return h, data[PREFIX_BYTES + n :]


def peek_header(data: bytes) -> dict | None:
    """The header's fields when they parse, whether or not the entry verifies (for messages
    that name the kernel of a damaged entry); None when they do not."""
    try:
        return _parse_header(data)[0]
    except EntryError:
        return None


def decode_entry(data: bytes, *, expect_key: str | None = None) -> Entry:
    """Parse and verify; raises :class:`EntryError` on any mismatch, and only that."""
    if len(data) > MAX_ENTRY_BYTES:
        raise EntryError(f"{len(data)} bytes, larger than any entry ({MAX_ENTRY_BYTES} at most)")
    h, payload = _parse_header(data)
    size = h.get("size")
    if type(size) is not int or size < 0:
        raise EntryError(f"corrupt header (size {size!r})")
    if len(payload) < size:
        raise EntryError(f"truncated: {len(payload)} of the header's {size} payload bytes")
    if len(payload) > size:
        raise EntryError(f"{len(payload) - size} bytes after the {size}-byte payload")
    fields = {k: v for k, v in h.items() if k != "sha256"}
    try:
        digest = _digest(fields, payload)
    except (ValueError, TypeError, RecursionError) as exc:  # e.g. NaN is not re-encoded the same
        raise EntryError(f"corrupt header ({type(exc).__name__})") from None
    if digest != h.get("sha256"):
        raise EntryError("checksum mismatch (header or payload)")
    for name in _TEXT_FIELDS:
        if name not in h:
            raise EntryError(f"header lacks {name!r}")
        if not isinstance(h[name], str):
            raise EntryError(f"corrupt header ({name} is {type(h[name]).__name__}, not text)")
    created = h.get("created", 0.0)
    if type(created) not in (int, float) or not math.isfinite(created):
        raise EntryError(f"corrupt header (created {created!r} is not a time)")
    if expect_key is not None and h["key"] != expect_key:
        raise EntryError("entry belongs to another key")
    return Entry(h["key"], h["kernel"], h["target"], h["kind"], h["nvrtc"], h["rope_rtc"], payload,
                 float(created))
