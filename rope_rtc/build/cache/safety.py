"""The cache directory's safety rules, for the stores in store.py and maintenance.py: descriptors
opened without following a link (``O_NOFOLLOW``, ``O_CLOEXEC``, and ``O_NONBLOCK`` for reads), the
owner and mode a trusted directory or file has, directories created with the store's mode at every
level, and the names of the store's own files (the only ones it writes or deletes). The rules
themselves are in store.py's docstring ("trust", "modes")."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC
# O_NONBLOCK: a FIFO planted under an entry's name must not hang the reader.
READ_FLAGS = os.O_RDONLY | NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC

ENTRY_SUFFIX = ".bin"
SOURCE_SUFFIX = ".cu"
TEMP_PREFIX = ".tmp-"
TEMP_SUFFIX = ".part"
ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.bin")
SOURCE_NAME = re.compile(r"[0-9a-f]{64}\.cu")
# Also the names tempfile.mkstemp gives (8 characters of [a-z0-9_]).
TEMP_NAME = re.compile(r"\.tmp-[0-9a-z_]{8,32}\.part")

# What a saved source (ROPE_RTC_SAVE_SOURCE, compiler.assembled_source) begins with: a file at a
# saved source's name that does not is someone else's, and is left alone.
SOURCE_HEAD = b"// option: "


class Refused(Exception):
    """A directory or file the store will not use (a link, untrusted, not a directory): the
    text says why and what to do."""


class NotAFile(Exception):
    """Something other than a regular file or a link sits at an entry's name."""



def untrusted_reason(st: os.stat_result, what: str) -> str | None:
    """Why ``what`` (its ``lstat``) is not to be trusted: another owner than this user or root, or
    writable by others; None when it is."""
    # Root may own what this user trusts: root can already write anything this process runs, and
    # a cache warmed into an image at build time (as root, then `chmod a+rX`) is root's.
    if hasattr(os, "getuid") and st.st_uid not in (os.getuid(), 0):
        return f"{what} is owned by uid {st.st_uid}, neither this user (uid {os.getuid()}) nor root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def kind_of(mode: int) -> str:
    """What a file of this mode is, in words ('a directory', 'a FIFO', ...)."""
    for test, text in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return text
    return "not a regular file"


def lstat_at(name: str, dir_fd: int | None) -> os.stat_result:
    """``name``'s own status under ``dir_fd``, a link not followed."""
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def open_dir_no_follow(path: str | os.PathLike, dir_fd: int | None, what: str, shown: Path) -> int:
    """A descriptor on the directory ``path`` (under ``dir_fd``); Refused, naming ``what`` at
    ``shown``, when a link or something other than a directory is there."""
    try:
        return os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        try:
            st = lstat_at(os.fspath(path), dir_fd)
        except OSError:
            raise exc from None
        if stat.S_ISLNK(st.st_mode):
            raise Refused(f"{what} {shown} is a symbolic link; rope_rtc never follows links in its cache: "
                          "point ROPE_RTC_CACHE_DIR or --cache-dir at the real directory") from None
        raise Refused(f"{what} {shown} is {kind_of(st.st_mode)}, not a directory") from None


def makedirs(directory: Path, mode: int) -> None:
    """Create ``directory`` and the missing levels above it, each with ``mode`` (less the umask)."""
    # os.makedirs gives only the last level its mode; every level created here gets ``mode``.
    missing = []
    d = directory
    while True:
        try:
            os.lstat(d)
            break
        except FileNotFoundError:
            missing.append(d)
            if d.parent == d:
                break
            d = d.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            pass


def create_dirs(directory: Path, mode: int) -> None:
    """Create the cache root (and levels above it) and the version directory with ``mode``
    (less the umask). The version directory is made through the root's descriptor, so a link
    at the root is never followed to create it elsewhere."""
    makedirs(directory.parent, mode)
    root_fd = os.open(directory.parent, DIR_FLAGS)
    try:
        os.mkdir(directory.name, mode, dir_fd=root_fd)
    except FileExistsError:
        pass
    finally:
        os.close(root_fd)
