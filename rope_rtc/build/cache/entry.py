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
import re
from dataclasses import dataclass

MAGIC = b"RRTCBIN1"
PREFIX_BYTES = 16  # MAGIC and the header length

# An entry is one CUBIN or PTX of a few kernels: tens of KB, a few hundred at most. A file
# larger than this at an entry's path is not one of ours, and is never read into memory.
MAX_ENTRY_BYTES = 8 << 20
# The header is a dozen short fields (a few hundred bytes).
MAX_HEADER_BYTES = 16 << 10

_TEXT_FIELDS = ("key", "kernel", "target", "kind", "nvrtc", "rope_rtc")
_KEY = re.compile(r"[0-9a-f]{64}")
KINDS = ("cubin", "ptx")
# "created" is a time.time() of the build. The bound is the last day datetime can show in any
# time zone: a larger number is no time at all, and every reader of the field (``cache list``)
# may convert it.
MAX_CREATED = 253402214400  # 9999-12-31 00:00 UTC
# How much of a header value a message quotes: a header may hold kilobytes of text.
SHOWN_CHARS = 60


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


def terminal_text(value: object, limit: int = SHOWN_CHARS) -> str:
    """``value`` fit for a terminal: text with every character that is not printable (escape
    sequences, other control and format characters) and the backslash written as Python writes
    them in a string literal, a number as its repr, and at most ``limit`` characters of that,
    the rest counted. A header's text is written by whoever wrote the file, so a message
    quotes it through this and never raw."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"  # its repr is hundreds of digits, or raises
    if isinstance(value, (list, dict)):
        return f"a JSON {'array' if isinstance(value, list) else 'object'}"  # its repr may recurse too deep
    text = value if isinstance(value, str) else repr(value)
    out: list[str] = []
    used = 0
    for ch in text:
        # repr of one non-printable character is its escape: \x1b, \u202e, \n.
        piece = "\\\\" if ch == "\\" else ch if ch.isprintable() else repr(ch)[1:-1]
        if used + len(piece) > limit:
            return "".join(out) + f"… ({len(text)} characters)"
        out.append(piece)
        used += len(piece)
    return "".join(out)


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
    if type(size) is not int or not 0 <= size <= MAX_ENTRY_BYTES:
        raise EntryError(f"corrupt header (size {terminal_text(size)}, not 0 to {MAX_ENTRY_BYTES} bytes)")
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
    # Past the checksum every field is still what its writer chose: a value out of range is as
    # corrupt as a flipped byte, and is told here, so that no reader of an Entry meets it.
    for name in _TEXT_FIELDS:
        if name not in h:
            raise EntryError(f"header lacks {name!r}")
        if not isinstance(h[name], str):
            raise EntryError(f"corrupt header ({name} is {type(h[name]).__name__}, not text)")
        if not h[name].isprintable():
            raise EntryError(f"corrupt header ({name} {terminal_text(h[name])} holds characters that are not printable)")
    if not _KEY.fullmatch(h["key"]):
        raise EntryError(f"corrupt header (key {terminal_text(h['key'])} is not 64 hex digits)")
    if h["kind"] not in KINDS:
        raise EntryError(f"corrupt header (kind {terminal_text(h['kind'])} is neither {' nor '.join(KINDS)})")
    created = h.get("created", 0.0)
    # Compared before any conversion: an integer of 400 digits is valid JSON, and float() of it
    # raises OverflowError, which is not an EntryError.
    if type(created) not in (int, float) or not 0 <= created <= MAX_CREATED:
        raise EntryError(f"corrupt header (created {terminal_text(created)} is not a time between 1970 and 9999)")
    if expect_key is not None and h["key"] != expect_key:
        raise EntryError("entry belongs to another key")
    return Entry(h["key"], h["kernel"], h["target"], h["kind"], h["nvrtc"], h["rope_rtc"], payload,
                 float(created))
