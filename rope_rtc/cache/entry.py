"""The on-disk entry format: a checked header, then the binary.

Layout: ``MAGIC`` (8 bytes), header length (8 bytes, little endian), a JSON header, payload.
The header names the key, the kernel, the target and the versions it was built with, and the
payload's SHA-256 and size, so a torn, truncated or foreign file is detected before it is
loaded and reads as a miss.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

MAGIC = b"RRTCBIN1"


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


def decode_entry(data: bytes, *, expect_key: str | None = None) -> Entry:
    """Parse and verify; raises :class:`EntryError` on any mismatch."""
    if len(data) < 16 or data[:8] != MAGIC:
        raise EntryError("not a rope_rtc cache entry (bad magic)")
    n = int.from_bytes(data[8:16], "little")
    if n <= 0 or 16 + n > len(data):
        raise EntryError("truncated header")
    try:
        h = json.loads(data[16 : 16 + n])
    except ValueError as exc:
        raise EntryError(f"corrupt header ({exc})") from None
    payload = data[16 + n :]
    if not isinstance(h, dict) or len(payload) != h.get("size"):
        raise EntryError(f"payload is {len(payload)} bytes, header says {h.get('size') if isinstance(h, dict) else '?'}")
    fields = {k: v for k, v in h.items() if k != "sha256"}
    if _digest(fields, payload) != h.get("sha256"):
        raise EntryError("checksum mismatch (header or payload)")
    if expect_key is not None and h.get("key") != expect_key:
        raise EntryError("entry belongs to another key")
    try:
        return Entry(h["key"], h["kernel"], h["target"], h["kind"], h["nvrtc"], h["rope_rtc"], payload,
                     float(h.get("created", 0.0)))
    except KeyError as exc:
        raise EntryError(f"header lacks {exc}") from None
