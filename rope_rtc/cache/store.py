"""Cache stores: a disk store that needs no lock to be correct, and a memory store.

Disk rules (DESIGN.md, "Compilation and the cache"):
- publish = write a temporary file in the same directory, fsync, ``os.replace``: a reader sees
  the old entry or the new one, never part of one; a process that loses a race keeps the bytes
  it compiled. There is no lock, so nothing can be left holding one.
- every entry is verified (``entry.decode_entry``) before use; a corrupt one is deleted and
  reported once with a warning, and reads as a miss.
- trust: the store never opens an entry through a symbolic link, and refuses a directory or
  entry that other users can write, or that another user owns, unless
  ``ROPE_RTC_TRUST_SHARED_CACHE=1``. Directories it creates are private (0700).
- an unwritable directory still serves its hits (a cache shipped read-only in an image);
  new kernels then live in memory, with one warning.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from .entry import Entry, EntryError, decode_entry, encode_entry

ENTRY_SUFFIX = ".bin"
SOURCE_SUFFIX = ".cu"
TEMP_PREFIX = ".tmp-"

_warned: set[tuple[str, str]] = set()
_warn_lock = threading.Lock()


class CacheWarning(UserWarning):
    """Something about the kernel cache deserves attention but did not stop the work."""


def _warn_once(topic: str, where: str, message: str) -> None:
    with _warn_lock:
        if (topic, where) in _warned:
            return
        _warned.add((topic, where))
    warnings.warn(message, CacheWarning, stacklevel=4)


def _untrusted_reason(st: os.stat_result, what: str) -> str | None:
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _makedirs_private(directory: Path) -> None:
    # os.makedirs gives only the last level its mode; every level created here must be private.
    missing = []
    d = directory
    while not d.is_dir():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            if not d.is_dir():
                raise


class MemoryStore:
    """Entries kept for the life of the process."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def put(self, entry: Entry) -> None:
        with self._lock:
            self._entries[entry.key] = entry


@dataclass
class ListedEntry:
    path: Path
    size: int
    entry: Entry | None
    error: str | None


class DiskStore:
    """One versioned cache directory."""

    def __init__(self, directory: str | os.PathLike, *, trust_shared: bool = False, create: bool = True) -> None:
        self.directory = Path(directory)
        self.trust_shared = trust_shared
        self.usable = True      # entries may be read
        self.writable = True    # entries may be published
        self.problem: str | None = None
        if create:
            try:
                _makedirs_private(self.directory)
            except OSError as exc:
                self.writable = False
                if not self.directory.is_dir():
                    self.usable = False
                    self.problem = f"cannot create cache directory {self.directory}: {exc.strerror}"
        if self.usable:
            try:
                st = os.stat(self.directory)
            except OSError as exc:
                self.usable = self.writable = False
                self.problem = f"cannot read cache directory {self.directory}: {exc.strerror}"
            else:
                reason = None if trust_shared else _untrusted_reason(st, f"cache directory {self.directory}")
                if reason:
                    self.usable = self.writable = False
                    self.problem = (f"{reason}; refusing to use it (set ROPE_RTC_TRUST_SHARED_CACHE=1 for a "
                                    "deliberately shared team cache)")
                elif not os.access(self.directory, os.W_OK | os.X_OK):
                    self.writable = False
                    self.problem = f"cache directory {self.directory} is not writable; serving its entries read-only"

    # -- paths -------------------------------------------------------------------------
    def path_for(self, key: str) -> Path:
        return self.directory / f"{key}{ENTRY_SUFFIX}"

    # -- reading -----------------------------------------------------------------------
    def _read_bytes(self, path: Path) -> bytes:
        # O_NOFOLLOW: an entry that is a symbolic link is refused, never followed elsewhere.
        # O_NONBLOCK: a FIFO planted under an entry's name must not hang the reader (it then
        # fails the regular-file check below).
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise EntryError("not a regular file")
            reason = None if self.trust_shared else _untrusted_reason(st, f"cache entry {path.name}")
            if reason:
                raise PermissionError(reason)
            chunks = []
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def get(self, key: str) -> Entry | None:
        if not self.usable:
            return None
        path = self.path_for(key)
        try:
            data = self._read_bytes(path)
            return decode_entry(data, expect_key=key)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                _warn_once("symlink", str(path), f"rope_rtc: cache entry {path} is a symbolic link; ignored")
                return None
            if isinstance(exc, PermissionError):
                _warn_once("untrusted", str(path), f"rope_rtc: {exc}; ignored (compiling instead)")
                return None
            raise
        except EntryError as exc:
            self.discard(key, f"corrupt cache entry {path.name} ({exc})")
            return None

    def discard(self, key: str, why: str) -> None:
        """Delete a bad entry (when we may) and say so once."""
        removed = False
        if self.writable:
            try:
                os.unlink(self.path_for(key))
                removed = True
            except OSError:
                pass
        _warn_once("corrupt", key, f"rope_rtc: {why}; {'deleted, ' if removed else ''}recompiling")

    # -- writing -----------------------------------------------------------------------
    def put(self, entry: Entry) -> bool:
        """Publish atomically. False (and one warning) when the directory cannot take it."""
        if not self.writable:
            return False
        try:
            self._atomic_write(self.path_for(entry.key), encode_entry(entry))
            return True
        except OSError as exc:
            self.writable = False
            _warn_once("unwritable", str(self.directory),
                       f"rope_rtc: cannot write to cache directory {self.directory} ({exc.strerror}); "
                       "compiled kernels are kept in memory for this process")
            return False

    def put_text(self, key: str, suffix: str, text: str) -> None:
        if self.writable:
            try:
                self._atomic_write(self.directory / f"{key}{suffix}", text.encode())
            except OSError:
                pass

    def _atomic_write(self, final: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=TEMP_PREFIX, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        try:  # make the rename itself durable; best effort (not every filesystem allows it)
            dfd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass

    # -- maintenance ---------------------------------------------------------------------
    def list(self) -> list[ListedEntry]:
        out: list[ListedEntry] = []
        if not self.directory.is_dir():
            return out
        for path in sorted(self.directory.glob(f"*{ENTRY_SUFFIX}")):
            try:
                size = path.lstat().st_size
                entry = decode_entry(self._read_bytes(path), expect_key=path.name[: -len(ENTRY_SUFFIX)])
                out.append(ListedEntry(path, size, entry, None))
            except (OSError, EntryError) as exc:
                out.append(ListedEntry(path, path.lstat().st_size if path.exists() else 0, None, str(exc)))
        return out

    def temp_files(self) -> list[Path]:
        return sorted(self.directory.glob(f"{TEMP_PREFIX}*")) if self.directory.is_dir() else []

    def clear(self) -> int:
        n = 0
        if not self.directory.is_dir():
            return 0
        for pattern in (f"*{ENTRY_SUFFIX}", f"*{SOURCE_SUFFIX}", f"{TEMP_PREFIX}*"):
            for path in self.directory.glob(pattern):
                try:
                    path.unlink()
                    n += 1
                except OSError:
                    pass
        return n


class CacheStore:
    """Memory in front of disk: what the build lifecycle talks to."""

    def __init__(self, disk: DiskStore | None) -> None:
        self.disk = disk
        self.memory = MemoryStore()
        if disk is not None and disk.problem:
            _warn_once("problem", str(disk.directory), f"rope_rtc: {disk.problem}")

    def get(self, key: str) -> Entry | None:
        entry = self.memory.get(key)
        if entry is None and self.disk is not None:
            entry = self.disk.get(key)
            if entry is not None:
                self.memory.put(entry)
        return entry

    def put(self, entry: Entry) -> bool:
        """Remember; publish to disk when possible. True when it reached the disk."""
        self.memory.put(entry)
        return self.disk.put(entry) if self.disk is not None else False


_stores: dict[tuple, CacheStore] = {}
_stores_lock = threading.Lock()


def open_store(directory: str | os.PathLike | None = None) -> CacheStore:
    """The process's store for ``directory`` (default: the configured versioned directory)."""
    from ..env import settings
    from .location import versioned_cache_dir

    s = settings()
    d = None if s.disable_disk_cache and directory is None else Path(directory or versioned_cache_dir())
    ident = (str(d), s.trust_shared_cache)
    with _stores_lock:
        store = _stores.get(ident)
        if store is None:
            store = CacheStore(DiskStore(d, trust_shared=s.trust_shared_cache) if d is not None else None)
            _stores[ident] = store
        return store
