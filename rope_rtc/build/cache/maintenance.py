"""Listing, clearing and temporary-file cleanup of a DiskStore (``DiskStore.list``, ``clear``,
``temp_files``, ``saved_sources``, ``remove_stale_temporaries``), under the rules in store.py's
docstring: only the store's own files (named and made as it makes them, regular, ours) are
removed, and no ``OSError`` escapes a listing."""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from .entry import MAGIC, Entry, EntryError, decode_entry, peek_header
from .safety import (ENTRY_NAME, ENTRY_SUFFIX, READ_FLAGS, SOURCE_HEAD, SOURCE_NAME, TEMP_NAME, NotAFile, Refused,
                     lstat_at)

# A temporary file this old belongs to no running publish (one takes milliseconds): a process
# was killed between writing it and renaming it. `warm` removes such files when it starts.
STALE_TEMP_SECONDS = 3600


class _OtherOwner(Exception):
    """A file named and made as the store's own that another user owns: not ours to remove."""

    def __init__(self, uid: int) -> None:
        super().__init__(f"owned by uid {uid}")
        self.uid = uid


@dataclass
class ListedEntry:
    """One file at an entry's name: its entry when it verifies, else the error (and the header's
    fields when they parse, so that a message can name the kernel of a damaged entry)."""

    path: Path
    size: int
    entry: Entry | None
    error: str | None
    header: dict | None = None
    #: something other than a file or a link sits at the name (a directory, a FIFO, a socket):
    #: the store never deletes or replaces it, so only a person can remove it (a link or an
    #: untrusted file is replaced by the next publish of its kernel)
    foreign: bool = False

    @property
    def key(self) -> str:
        return self.path.name[: -len(ENTRY_SUFFIX)]

    def _field(self, name: str) -> str | None:
        """A field of the verified entry, else of the header when it parsed (a damaged entry)."""
        if self.entry is not None:
            return getattr(self.entry, name)
        value = (self.header or {}).get(name)
        return value if isinstance(value, str) else None

    @property
    def kernel(self) -> str | None:
        return self._field("kernel")

    @property
    def target(self) -> str | None:
        return self._field("target")


@dataclass
class Cleared:
    """What :meth:`DiskStore.clear` did: files removed by kind, names left because they are not
    the cache's, and removals that failed (name, reason)."""

    entries: int = 0
    sources: int = 0
    temporary: int = 0
    left: list[str] = field(default_factory=list)
    #: temporary files younger than STALE_TEMP_SECONDS: a publish may be writing them now
    in_progress: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def removed(self) -> int:
        return self.entries + self.sources + self.temporary


class Maintenance:
    """The listing and clearing half of :class:`~rope_rtc.build.cache.store.DiskStore`, which
    supplies ``directory``, ``usable``, ``writable``, the directory's descriptor (``_dir``), the
    trusted read (``_read_at``), the ownership test (``_ours``) and ``_unusable``."""

    directory: Path
    usable: bool
    writable: bool

    def _names(self, dfd: int) -> list[str]:
        return sorted(os.listdir(dfd))

    def list(self) -> list[ListedEntry]:
        """Every file at an entry's name, verified. Never raises: when the directory cannot be
        read, ``problem`` says why and the list is empty."""
        out: list[ListedEntry] = []
        if not self.usable:
            return out
        try:
            with self._dir() as dfd:
                for name in self._names(dfd):
                    if ENTRY_NAME.fullmatch(name):
                        listed = self._listed(dfd, name)
                        if listed is not None:
                            out.append(listed)
        except Refused as exc:
            self._unusable(str(exc))
        except OSError as exc:
            self._unusable(f"cannot read cache directory {self.directory}: {exc.strerror}")
        return out

    def _listed(self, dfd: int, name: str) -> ListedEntry | None:
        """The file at ``name``, verified; None when it is gone (removed since the directory was
        read: by a `cache clear`, or a load that found it corrupt)."""
        path = self.directory / name
        try:
            size = lstat_at(name, dfd).st_size
        except FileNotFoundError:
            return None
        except OSError:
            size = 0
        data = b""
        try:
            data = self._read_at(dfd, name)
            return ListedEntry(path, size, decode_entry(data, expect_key=name[: -len(ENTRY_SUFFIX)]), None)
        except FileNotFoundError:
            return None
        except EntryError as exc:
            return ListedEntry(path, size, None, str(exc), peek_header(data))
        except NotAFile as exc:
            return ListedEntry(path, size, None, f"is {exc}, not a cache entry", foreign=True)
        except Refused as exc:
            return ListedEntry(path, size, None, str(exc))
        except OSError as exc:
            return ListedEntry(path, size, None, f"cannot be read ({exc.strerror})")

    def temp_files(self) -> list[Path]:
        """Temporary files of interrupted publishes (or of one in progress)."""
        if not self.usable:
            return []
        found = []
        try:
            with self._dir() as dfd:
                for n in self._names(dfd):
                    if not TEMP_NAME.fullmatch(n):
                        continue
                    try:
                        if stat.S_ISREG(lstat_at(n, dfd).st_mode):
                            found.append(self.directory / n)
                    except FileNotFoundError:  # published (renamed) or removed since the listing
                        continue
        except (OSError, Refused):
            return []
        return found

    def saved_sources(self) -> list[Path]:
        if not self.usable:
            return []
        try:
            with self._dir() as dfd:
                return [self.directory / n for n in self._names(dfd) if SOURCE_NAME.fullmatch(n)]
        except (OSError, Refused):
            return []

    def _own_kind(self, dfd: int, name: str) -> str | None:
        """"entries", "sources" or "temporary" when ``name`` is one of the store's own files
        (a regular file we own, named as the store names them, an entry in the entry format);
        None for anything else. Raises _OtherOwner for a file that looks like one of them but
        that another user owns (this user may not remove it)."""
        if ENTRY_NAME.fullmatch(name):
            kind = "entries"
        elif SOURCE_NAME.fullmatch(name):
            kind = "sources"
        elif TEMP_NAME.fullmatch(name):
            kind = "temporary"
        else:
            return None
        st = lstat_at(name, dfd)
        if not stat.S_ISREG(st.st_mode):
            return None
        head = {"entries": MAGIC, "sources": SOURCE_HEAD}.get(kind)
        if head is not None:
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=dfd)
            except PermissionError:
                if self._ours(st):
                    raise
                raise _OtherOwner(st.st_uid) from None
            try:
                if os.read(fd, len(head)) != head:
                    return None
            finally:
                os.close(fd)
        if not self._ours(st):
            raise _OtherOwner(st.st_uid)
        return kind

    def clear(self) -> Cleared:
        """Remove the store's own files (entries, saved sources, temporary files); leave the rest,
        and the temporary files a publish may be writing now (younger than STALE_TEMP_SECONDS:
        removing one would fail that publish). A file of the cache that another user owns is not
        removed, and is reported as a failure. Raises Refused, removing nothing, when this user
        may not remove files from the directory (a cache warmed by root into an image)."""
        done = Cleared()
        cutoff = time.time() - STALE_TEMP_SECONDS
        with self._dir() as dfd:
            if not os.access(self.directory, os.W_OK | os.X_OK):
                raise Refused(self._not_writable_reason(dfd, "clear it"))
            for name in self._names(dfd):
                # A file may go between the listing and its removal: a publish renames its
                # temporary file onto an entry, another clear or a load removes an entry. Gone is
                # what a clear wants, so that is no failure, whichever step finds it gone.
                try:
                    kind = self._own_kind(dfd, name)
                    if kind == "temporary" and lstat_at(name, dfd).st_mtime >= cutoff:
                        done.in_progress.append(name)
                        continue
                except FileNotFoundError:
                    continue
                except _OtherOwner as exc:
                    done.failed.append((name, f"owned by uid {exc.uid}, not this user (uid {os.getuid()}): "
                                              "only its owner may remove it"))
                    continue
                except OSError as exc:
                    done.failed.append((name, exc.strerror or str(exc)))
                    continue
                if kind is None:
                    done.left.append(name)
                    continue
                try:
                    os.unlink(name, dir_fd=dfd)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    done.failed.append((name, exc.strerror or str(exc)))
                else:
                    setattr(done, kind, getattr(done, kind) + 1)
        return done

    def not_writable_reason(self, action: str) -> str | None:
        """Why this user cannot write the directory and what to do (``action``, such as "warm
        it", done as its owner), or None when it can (or it cannot be opened: that has its own
        message)."""
        if os.access(self.directory, os.W_OK | os.X_OK):
            return None
        try:
            with self._dir() as dfd:
                return self._not_writable_reason(dfd, action)
        except (OSError, Refused):
            return None

    def _not_writable_reason(self, dfd: int, action: str) -> str:
        st = os.fstat(dfd)
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            why = (f"it belongs to uid {st.st_uid} and this user (uid {os.getuid()}) may not write to it: "
                   f"{action} as uid {st.st_uid}, or give --cache-dir a cache of your own")
        else:
            why = f"mode {stat.S_IMODE(st.st_mode):o}, or a read-only filesystem"
        return f"cache directory {self.directory} is not writable ({why})"

    def remove_stale_temporaries(self, max_age_s: float = STALE_TEMP_SECONDS) -> int:
        """Remove our temporary files older than ``max_age_s`` (left by killed processes); a
        younger one may belong to a publish in progress. Returns how many were removed."""
        if not self.writable:
            return 0
        removed = 0
        cutoff = time.time() - max_age_s
        try:
            with self._dir() as dfd:
                for name in self._names(dfd):
                    if not TEMP_NAME.fullmatch(name):
                        continue
                    try:
                        st = lstat_at(name, dfd)
                        if self._ours(st) and st.st_mtime < cutoff:
                            os.unlink(name, dir_fd=dfd)
                            removed += 1
                    except OSError:
                        continue
        except (OSError, Refused):
            pass
        return removed

