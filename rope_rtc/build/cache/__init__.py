"""The kernel cache: a key that cannot collide by accident, an entry format that verifies
itself, a disk store that publishes atomically, and an in-memory store for when the disk
cannot be used. Bytes only: nothing here imports CuPy or touches a GPU."""

from .entry import MAX_ENTRY_BYTES, Entry, EntryError, decode_entry, encode_entry
from .key import KEY_FORMAT, cache_key
from .location import cache_root, versioned_cache_dir
from .store import CacheStore, Cleared, DiskStore, ListedEntry, MemoryStore, open_store

__all__ = [
    "MAX_ENTRY_BYTES", "Entry", "EntryError", "decode_entry", "encode_entry", "KEY_FORMAT", "cache_key",
    "cache_root", "versioned_cache_dir", "CacheStore", "Cleared", "DiskStore", "ListedEntry", "MemoryStore",
    "open_store",
]
