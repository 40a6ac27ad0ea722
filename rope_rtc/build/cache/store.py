"""Cache stores: a disk store that needs no lock to be correct, and a memory store. Listing and
clearing a disk store are in maintenance.py; the safety rules' mechanics in safety.py.

Disk rules (docs/design.md, "The kernel cache"):
- publish = write a temporary file in the same directory, fsync, ``os.replace``: a reader sees
  the old entry or the new one, never part of one; a process that loses a race keeps the bytes
  it compiled. There is no lock, so nothing can be left holding one.
- every entry is verified (``entry.decode_entry``) before use; a corrupt one is deleted and
  reported once with a warning, and reads as a miss. A file larger than any entry
  (``MAX_ENTRY_BYTES``) is corrupt and never read.
- trust: the store never follows a symbolic link, neither at an entry nor at the version
  directory nor at the cache root above it (each is opened with ``O_NOFOLLOW``, and every file
  operation goes through the directory's descriptor), and refuses a directory or entry that
  other users can write, or that a user other than this one or root owns, unless
  ``ROPE_RTC_TRUST_SHARED_CACHE=1`` (root's files are trusted: root can write anything this process
  runs, and a cache warmed into an image is root's).
- modes: by default what the store creates is private: directories 0700, files 0600, whatever
  the umask. Under ``ROPE_RTC_TRUST_SHARED_CACHE=1`` the umask decides (directories 0777, files
  0666, less the umask), so the team can read, and replace, each other's entries; a directory
  created inside a setgid directory keeps the setgid bit (the kernel sets it; nothing here
  clears it). A team sets its cache up once:

  - a group with every member, and the cache root owned by it, group-writable and setgid, with
    no sticky bit (``chgrp team /srv/rope-cache && chmod 2770 /srv/rope-cache``): whatever is
    created inside belongs to the group, and a member may replace another's entry;
  - every process that uses it, ``rope-rtc warm`` and ``rope-rtc cache`` included, runs with
    ``ROPE_RTC_CACHE_DIR=/srv/rope-cache ROPE_RTC_TRUST_SHARED_CACHE=1`` and umask 002 (or 007;
    systemd: ``UMask=0002``). Under umask 022 entries are still readable by the group, but the
    version directory its first user creates is not group-writable: the others then serve it
    read-only and keep what they compile in memory.

  Every member can then plant a binary that the others' processes run, and ``cache clear``
  by one removes the entries of all.
- the store deletes or writes only its own files: entries (``<64 hex>.bin`` in the entry
  format), saved sources (``<64 hex>.cu``) and its temporary files (``.tmp-<random>.part``),
  and only regular files. Whatever else sits in the directory, or at an entry's name (a
  directory, a socket, a FIFO), is left alone.
- a failure that belongs to one entry (something else at its name, a file size limit) affects
  that entry only; a failure of the directory (unwritable, full, unreadable) makes the store
  serve what it can: an unwritable directory still serves its hits (a cache shipped read-only
  in an image), and new kernels then live in memory, with one warning. No ``OSError`` escapes.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .entry import MAX_ENTRY_BYTES, Entry, EntryError, decode_entry, encode_entry
from .maintenance import Cleared, ListedEntry, Maintenance  # noqa: F401 - part of this module's interface
from .safety import SOURCE_SUFFIX  # noqa: F401 - part of this module's interface
from .safety import (CREATE_FLAGS, ENTRY_SUFFIX, READ_FLAGS, SOURCE_HEAD, TEMP_PREFIX, TEMP_SUFFIX, NotAFile, Refused,
                     create_dirs, kind_of, lstat_at, open_dir_no_follow, untrusted_reason)

# Errors of the directory or the filesystem, not of one entry: publishing stops for the process.
_DIRECTORY_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}

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


class _DirectoryError(Exception):
    """Publishing failed because of the directory, not the entry; wraps the OSError."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


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


class DiskStore(Maintenance):
    """One versioned cache directory.

    ``usable``: entries may be read; ``writable``: entries may be published; ``problem``: why
    not, in a sentence; ``missing``: the directory does not exist (and was not created).
    ``read_only``: never create, write or delete anything (a check of what a cache holds).
    """

    def __init__(self, directory: str | os.PathLike, *, trust_shared: bool = False, create: bool = True,
                 read_only: bool = False) -> None:
        create = create and not read_only
        self.directory = Path(directory)
        self.trust_shared = trust_shared
        self.read_only = read_only
        self.usable = True
        self.writable = True
        self.missing = False
        self.problem: str | None = None
        #: why publishing an entry failed, by key, when it failed for that entry alone
        self.write_errors: dict[str, str] = {}
        create_error: OSError | None = None
        # Private unless the cache is a team's: then the umask decides, as for any shared file.
        self._dir_mode, self._file_mode = (0o777, 0o666) if trust_shared else (0o700, 0o600)
        if create:
            try:
                create_dirs(self.directory, self._dir_mode)
            except OSError as exc:
                create_error = exc
        try:
            fd = self._open_directory()
        except FileNotFoundError:
            self.missing = True
            self._unusable(None if create_error is None else
                           f"cannot create cache directory {self.directory}: {create_error.strerror}")
        except Refused as exc:
            self._unusable(str(exc))
        except OSError as exc:
            self._unusable(f"cannot open cache directory {self.directory}: {exc.strerror}")
        else:
            os.close(fd)
            if read_only:
                self.writable = False
            elif not os.access(self.directory, os.W_OK | os.X_OK):
                self.writable = False
                self.problem = f"cache directory {self.directory} is not writable; serving its entries read-only"

    def _unusable(self, problem: str | None) -> None:
        self.usable = self.writable = False
        self.problem = problem

    # -- the directory -------------------------------------------------------------------
    def _open_directory(self) -> int:
        """A descriptor on the version directory, reached without following a link at the root or
        at the version level, and trusted. Raises Refused or OSError."""
        root_fd = open_dir_no_follow(self.directory.parent, None, "cache root", self.directory.parent)
        try:
            fd = open_dir_no_follow(self.directory.name, root_fd, "cache directory", self.directory)
        finally:
            os.close(root_fd)
        try:
            reason = None if self.trust_shared else untrusted_reason(os.fstat(fd), f"cache directory {self.directory}")
        except OSError:
            os.close(fd)
            raise
        if reason:
            os.close(fd)
            raise Refused(f"{reason}; refusing to use it (set ROPE_RTC_TRUST_SHARED_CACHE=1 for a deliberately "
                          "shared team cache)")
        return fd

    @contextmanager
    def _dir(self) -> Iterator[int]:
        # Opened for each operation: a directory swapped for a link, or made writable by others,
        # after this store was created is refused as it would have been then.
        fd = self._open_directory()
        try:
            yield fd
        finally:
            os.close(fd)

    def _ours(self, st: os.stat_result) -> bool:
        return stat.S_ISREG(st.st_mode) and (self.trust_shared or not hasattr(os, "getuid")
                                              or st.st_uid == os.getuid())

    # -- paths -------------------------------------------------------------------------
    def path_for(self, key: str) -> Path:
        return self.directory / f"{key}{ENTRY_SUFFIX}"

    # -- reading -----------------------------------------------------------------------
    def _read_at(self, dir_fd: int, name: str) -> bytes:
        """The bytes of the regular file ``name``; raises FileNotFoundError, NotAFile, Refused
        (a link or an untrusted file), EntryError (larger than any entry) or OSError."""
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            try:
                st = lstat_at(name, dir_fd)
            except OSError:
                raise exc from None
            if stat.S_ISLNK(st.st_mode):
                raise Refused("is a symbolic link (never followed)") from None
            if not stat.S_ISREG(st.st_mode):  # a socket gives ENXIO
                raise NotAFile(kind_of(st.st_mode)) from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotAFile(kind_of(st.st_mode))
            reason = None if self.trust_shared else untrusted_reason(st, f"cache entry {name}")
            if reason:
                raise Refused(reason)
            if st.st_size > MAX_ENTRY_BYTES:
                raise EntryError(f"{st.st_size} bytes, larger than any entry ({MAX_ENTRY_BYTES} at most)")
            chunks, left = [], MAX_ENTRY_BYTES + 1  # the file may grow after fstat
            while left > 0:
                chunk = os.read(fd, min(1 << 20, left))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def get(self, key: str) -> Entry | None:
        if not self.usable:
            return None
        name = f"{key}{ENTRY_SUFFIX}"
        path = self.directory / name
        try:
            with self._dir() as dfd:
                data = self._read_at(dfd, name)
            return decode_entry(data, expect_key=key)
        except FileNotFoundError:
            return None
        except EntryError as exc:
            self.discard(key, f"corrupt cache entry {name} ({exc})")
        except NotAFile as exc:
            _warn_once("not a file", str(path), f"rope_rtc: {path} is {exc}, not a cache entry; left alone "
                                                "(compiling instead)")
        except Refused as exc:
            if "symbolic link" in str(exc):
                _warn_once("symlink", str(path), f"rope_rtc: cache entry {path} is a symbolic link; ignored")
            else:
                _warn_once("untrusted", str(path), f"rope_rtc: {exc}; ignored (compiling instead)")
        except OSError as exc:
            _warn_once("unreadable", str(path), f"rope_rtc: cannot read cache entry {path} ({exc.strerror}); "
                                                "compiling instead")
        return None

    def discard(self, key: str, why: str) -> None:
        """Delete a bad entry (when it is ours to delete: a regular file we own, in a directory we
        may write) and say once what was done with it and what follows."""
        name = f"{key}{ENTRY_SUFFIX}"
        removed = False
        if self.writable:
            try:
                with self._dir() as dfd:
                    if self._ours(lstat_at(name, dfd)):
                        os.unlink(name, dir_fd=dfd)
                        removed = True
            except (OSError, Refused):
                pass
        _warn_once("corrupt", key, f"rope_rtc: {why}; {self._discarded(removed)}")

    def _discarded(self, removed: bool) -> str:
        """What became of a bad entry, and of its kernel, in words."""
        from ...env import settings

        try:
            no_compile = settings().no_compile
        except ValueError:  # a malformed switch: the build reads it next and says so
            no_compile = False
        if removed:
            done = "deleted"
        elif self.read_only:
            done = "left in place (this check writes nothing)"
        elif not self.writable:
            done = "left in place (the cache directory is read-only)"
        else:
            done = "left in place (it could not be deleted)"
        if no_compile:
            # Nothing will compile it: a load raises, a warm check counts it missing.
            then = ("it counts as missing, and the check names the `rope-rtc warm` command that rebuilds it"
                    if self.read_only else
                    "KernelNotCachedError follows, naming the `rope-rtc warm` command that rebuilds it")
            return f"{done}; ROPE_RTC_NO_COMPILE=1 forbids recompiling it, so its kernel is not cached: {then}"
        return f"{done}, recompiling" + ("" if self.writable else " (kept in memory for this process)")

    # -- writing -----------------------------------------------------------------------
    def put(self, entry: Entry) -> bool:
        """Publish atomically. False (and one warning) when the entry cannot reach the disk."""
        if not self.writable:
            return False
        name = f"{entry.key}{ENTRY_SUFFIX}"
        path = self.directory / name
        try:
            self._atomic_write(name, encode_entry(entry))
            self.write_errors.pop(entry.key, None)
            return True
        except NotAFile as exc:
            why = f"{path} is {exc}, not a cache entry; left alone"
            topic = "not a file"
        except _DirectoryError as exc:
            return self._stop_writing(exc.error.strerror or str(exc.error))
        except Refused as exc:
            return self._stop_writing(str(exc))
        except OSError as exc:
            if exc.errno in _DIRECTORY_ERRNOS:
                return self._stop_writing(exc.strerror)
            why = f"cannot write cache entry {path} ({exc.strerror})"
            topic = "unpublished"
        # This entry only: the others still go to the disk.
        self.write_errors[entry.key] = why
        _warn_once(topic, str(path), f"rope_rtc: {why}; kernel {entry.kernel} is kept in memory for this process")
        return False

    def _stop_writing(self, why: str) -> bool:
        # The directory (or its filesystem) cannot take entries: stop trying, say so once.
        self.writable = False
        self.problem = f"cannot write to cache directory {self.directory} ({why})"
        _warn_once("unwritable", str(self.directory),
                   f"rope_rtc: {self.problem}; compiled kernels are kept in memory for this process")
        return False

    def put_text(self, key: str, suffix: str, text: str) -> None:
        """A saved source (``ROPE_RTC_SAVE_SOURCE``) at ``key`` + ``suffix``, best effort; a file
        there that is not a saved source is left alone."""
        if self.writable:
            try:
                self._atomic_write(f"{key}{suffix}", text.encode(), SOURCE_HEAD)
            except (OSError, NotAFile, _DirectoryError, Refused):
                pass

    def _atomic_write(self, name: str, data: bytes, head: bytes = b"") -> None:
        """Write ``data`` to a new temporary file, fsync it, rename it onto ``name``. Raises
        _DirectoryError or Refused when the directory is at fault, NotAFile when something
        that is not ours sits at ``name`` (with ``head``, also a file that does not begin with
        it), OSError when this one file failed."""
        try:
            dfd = self._open_directory()
        except OSError as exc:
            raise _DirectoryError(exc) from None
        try:
            try:
                mode = lstat_at(name, dfd).st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):  # a link is replaced, never followed
                    raise NotAFile(kind_of(mode))
                if head and stat.S_ISREG(mode):
                    fd = os.open(name, READ_FLAGS, dir_fd=dfd)
                    try:
                        if os.read(fd, len(head)) != head:
                            raise NotAFile("a file that is not a saved source")
                    finally:
                        os.close(fd)
            except FileNotFoundError:
                pass
            tmp = f"{TEMP_PREFIX}{secrets.token_hex(8)}{TEMP_SUFFIX}"
            try:
                fd = os.open(tmp, CREATE_FLAGS, self._file_mode, dir_fd=dfd)
            except OSError as exc:
                raise _DirectoryError(exc) from None
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException as exc:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                if isinstance(exc, OSError) and exc.errno in _DIRECTORY_ERRNOS:
                    raise _DirectoryError(exc) from None
                raise
            try:  # make the rename itself durable; best effort (not every filesystem allows it)
                os.fsync(dfd)
            except OSError:
                pass
        finally:
            os.close(dfd)


class CacheStore:
    """Memory in front of disk: what the build lifecycle talks to."""

    def __init__(self, disk: DiskStore | None) -> None:
        self.disk = disk
        self.memory = MemoryStore()
        if disk is not None and disk.problem:
            memory = "" if disk.usable else "; compiled kernels are kept in memory for this process"
            _warn_once("problem", str(disk.directory), f"rope_rtc: {disk.problem}{memory}")

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
    from ...env import settings
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
