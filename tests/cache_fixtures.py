"""Fixtures shared by the cache, cache-trust and CLI tests (import them into a test module).

``isolated`` (autouse where imported): no ROPE_RTC_* switch leaks in from the environment, a
private default cache directory, and fresh process-wide store and warning memories.
``compiles``: the kernel names of every NVRTC compile the build lifecycle makes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rope_rtc.build import kernels as build
from rope_rtc.build.cache import store as store_mod
from rope_rtc.build.cache.store import CacheStore, DiskStore


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("ROPE_RTC_") and name != "ROPE_RTC_REQUIRE_GPU":
            monkeypatch.delenv(name)
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path / "default-cache"))
    monkeypatch.setattr(store_mod, "_stores", {})
    monkeypatch.setattr(store_mod, "_warned", set())


@pytest.fixture
def compiles(monkeypatch):
    """Count the NVRTC compiles the build lifecycle makes."""
    calls: list[str] = []
    real = build.compile_source

    def spy(kernel, *args, **kwargs):
        calls.append(kernel)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(build, "compile_source", spy)
    return calls


def fresh_store(directory: Path, **kw) -> CacheStore:
    """A store with an empty memory layer, as a new process would have."""
    return CacheStore(DiskStore(directory, **kw))


# -- another user -------------------------------------------------------------------------------

#: The unprivileged user a root test process becomes in a forked child (``nobody`` on Linux).
OTHER_UID = 65534
CAN_SWITCH_USER = hasattr(os, "geteuid") and os.geteuid() == 0 and hasattr(os, "fork")


def as_other_user(fn, *, cwd: Path | None = None, uid: int = OTHER_UID, gid: int | None = None,
                  groups: tuple[int, ...] = (), umask: int | None = None):
    """Run ``fn()`` in a forked child whose uid is ``uid`` (gid ``gid``, default the uid; also a
    member of ``groups``; under ``umask`` when given); return what it returned.

    Needs root (CAN_SWITCH_USER). The child inherits every imported module, so it reads no
    file it may not; ``cwd`` (entered before the switch) lets it work with relative paths under
    directories its new uid could not traverse. The result travels back as JSON; an exception in
    the child is re-raised here as an AssertionError carrying its traceback.
    """
    import json
    import traceback

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            os.close(read_fd)
            if cwd is not None:
                os.chdir(cwd)
            if umask is not None:
                os.umask(umask)
            os.setgroups(list(groups))
            os.setgid(uid if gid is None else gid)
            os.setuid(uid)
            payload = json.dumps({"ok": fn()})
        except BaseException:
            payload, code = json.dumps({"error": traceback.format_exc()}), 1
        try:
            with os.fdopen(write_fd, "w") as f:
                f.write(payload)
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        text = f.read()
    os.waitpid(pid, 0)
    result = json.loads(text) if text else {"error": "the child wrote nothing"}
    if "error" in result:
        raise AssertionError(f"in the child running as uid {uid}:\n{result['error']}")
    return result["ok"]


def tree_snapshot(top: Path, *, skip: Path | None = None) -> dict[str, tuple]:
    """Every path under ``top`` (not following links) with its type, mode, owner and content hash:
    two equal snapshots mean nothing there was created, deleted, written or chmod'ed.
    Paths under ``skip`` are left out."""
    import hashlib
    import stat as stat_mod

    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if skip is not None and (p == skip or skip in p.parents):
                continue
            st = p.lstat()
            if stat_mod.S_ISREG(st.st_mode):
                # Sparse giants are compared by size and inode: hashing them would read gigabytes.
                digest = hashlib.sha256(p.read_bytes()).hexdigest() if st.st_size < (1 << 24) else st.st_ino
            elif stat_mod.S_ISLNK(st.st_mode):
                digest = os.readlink(p)
            else:
                digest = None
            size = st.st_size if stat_mod.S_ISREG(st.st_mode) else None  # a directory's size follows its entries
            out[str(p.relative_to(top))] = (stat_mod.S_IFMT(st.st_mode), stat_mod.S_IMODE(st.st_mode), st.st_uid,
                                            size, digest)
    return out
