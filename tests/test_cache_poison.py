"""Cache poisoning: another local user (or a stray file) tries to make this process delete, write
or load what it must not.

The other user is real where the tests run as root: a forked child switches to uid/gid 65534
(``cache_fixtures.as_other_user``) and plants its files as that user. Elsewhere the same files
are planted by this user and the ownership checks are left to ``test_cache_trust.py``'s
root-only tests. Every test ends with the same assertion: outside the cache's own files
(entries, saved sources, its temporary files, in its own directory) nothing was created,
deleted, written or chmod'ed.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import stat
import warnings
from pathlib import Path

import pytest

from rope_rtc.build import kernels as build, cache, registry
from rope_rtc.build.cache import decode_entry
from rope_rtc.build.cache import store as store_mod
from rope_rtc.build.cache.entry import MAGIC, MAX_ENTRY_BYTES
from rope_rtc.build.cache.store import CacheWarning
from rope_rtc.cli import main as cli_main
from rope_rtc.build.toolchain import Target
from cache_fixtures import CAN_SWITCH_USER, as_other_user, compiles, isolated, tree_snapshot  # noqa: F401

SM90 = Target(90, "cubin")
SPECS = [registry.tail_spec(1, 128), registry.tail_spec(2, 128), registry.blog_spec()]
OWN_FILE = re.compile(r"[0-9a-f]{64}\.(bin|cu)|\.tmp-[0-9a-z_]{8,32}\.part")


def outside_the_cache(top: Path, version_dir: Path) -> dict:
    """Everything under ``top`` except the cache's own regular files in ``version_dir``."""
    snap = tree_snapshot(top)
    if version_dir.is_symlink() or not version_dir.is_dir():
        return snap
    rel = version_dir.relative_to(top)
    return {k: v for k, v in snap.items()
            if not (Path(k).parent == rel and OWN_FILE.fullmatch(Path(k).name) and stat.S_ISREG(v[0]))}


def as_attacker(fn, area: Path):
    """Run ``fn`` (relative paths, in ``area``) as the other user where possible, else as this one."""
    if CAN_SWITCH_USER:
        return as_other_user(fn, cwd=area)
    old = os.getcwd()
    os.chdir(area)
    try:
        return fn()
    finally:
        os.chdir(old)


def every_command(root: Path) -> dict[str, tuple]:
    """Every way a user touches a cache: a process's loads, warm, and the cache commands."""
    results: dict[str, tuple] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store_mod._stores.clear()
        store = cache.open_store(cache.versioned_cache_dir(root))
        results["load"] = tuple(build.get_binary(s, SM90, store=store, announce=False).source for s in SPECS)
        for argv in (["warm", "--arch", "sm_90", "--no-progress", "--kernels", "blog", "--kernels", "tail",
                      "--tail-heads", "1,2"], ["cache", "list"], ["cache", "verify"], ["info"], ["cache", "clear"]):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = cli_main([*argv, "--cache-dir", str(root)])
            text = out.getvalue() + err.getvalue()
            assert "Traceback" not in text, (argv, text)
            results[" ".join(argv[:2])] = (rc, text)
    results["warnings"] = tuple(str(w.message) for w in caught if issubclass(w.category, CacheWarning))
    return results


@pytest.fixture
def area(tmp_path):
    a = tmp_path / "area"
    a.mkdir()
    a.chmod(0o1777)  # a place both users can write, as /tmp is
    return a


# -- links above the entries ---------------------------------------------------------------------

def _their_files() -> None:
    os.mkdir("theirs", 0o755)
    for name, data in (("kernel.cu", b"// theirs\n"), ("model.bin", b"weights"), (".tmp-s", b"scratch"),
                       (f"{'a' * 64}.bin", MAGIC + b"looks like an entry")):
        with open(os.path.join("theirs", name), "wb") as f:
            f.write(data)


@pytest.mark.parametrize("level", ["version", "root"])
def test_a_planted_link_at_the_version_or_root_directory_is_refused(tmp_path, area, level):
    root = area / "R"
    version = cache.versioned_cache_dir(root)

    def plant():
        _their_files()
        if level == "version":
            os.mkdir("R", 0o777)  # the other user's root, or one a user left open
            os.symlink(os.path.abspath("theirs"), os.path.join("R", version.name))
        else:
            os.symlink(os.path.abspath("theirs"), "R")

    as_attacker(plant, area)
    before = tree_snapshot(tmp_path)
    got = every_command(root)
    assert got["load"] == ("compiled",) * 3
    assert any("symbolic link" in w for w in got["warnings"]), got["warnings"]
    assert got["warm --arch"][0] == 2 and got["cache clear"][0] == 1 and got["cache verify"][0] == 1
    assert tree_snapshot(tmp_path) == before


# -- files at entry paths --------------------------------------------------------------------------

def _plant_at_entry_paths(names: dict[str, str]) -> None:
    for what, name in names.items():
        if what == "directory":
            os.mkdir(name, 0o755)
            with open(os.path.join(name, "inside"), "wb") as f:
                f.write(b"theirs")
        elif what == "fifo":
            os.mkfifo(name, 0o644)
        elif what == "socket":
            os.mknod(name, 0o644 | stat.S_IFSOCK)


def test_things_that_are_not_entries_at_entry_paths_are_left_alone(tmp_path, area, monkeypatch, compiles):
    """In a team cache (ROPE_RTC_TRUST_SHARED_CACHE=1, the only place another user can write),
    the other user puts a directory, a FIFO and a socket at three kernels' entry paths."""
    root = area / "team"
    d = cache.versioned_cache_dir(root)
    d.mkdir(parents=True, mode=0o777)
    root.chmod(0o777)
    d.chmod(0o777)
    keys = [build.spec_key(s, SM90) for s in SPECS]
    names = {"directory": f"{keys[0]}.bin", "fifo": f"{keys[1]}.bin", "socket": f"{keys[2]}.bin"}
    as_attacker(lambda: _plant_at_entry_paths(names), d)
    before = tree_snapshot(tmp_path)
    monkeypatch.setenv("ROPE_RTC_TRUST_SHARED_CACHE", "1")
    got = every_command(root)
    assert got["load"] == ("compiled",) * 3 and len(compiles) >= 3
    assert all("left alone" in w or "not a cache entry" in w for w in got["warnings"]), got["warnings"]
    assert got["cache verify"][0] == 1 and "a FIFO" in got["cache verify"][1] and "a socket" in got["cache verify"][1]
    assert got["cache clear"][0] == 0 and "left 3 files" in got["cache clear"][1]
    assert tree_snapshot(tmp_path) == before


def test_an_oversize_sparse_file_at_an_entry_path_is_never_read(tmp_path, monkeypatch, compiles):
    d = cache.versioned_cache_dir(tmp_path / "root")
    d.mkdir(parents=True, mode=0o700)
    key = build.spec_key(SPECS[0], SM90)
    big = d / f"{key}.bin"
    with open(big, "wb") as f:  # sparse: 12 GiB of nothing, costing no disk
        f.truncate(12 << 30)
    read: list[int] = []
    real_read = os.read
    monkeypatch.setattr(store_mod.os, "read", lambda fd, n: read.append(n) or real_read(fd, n))
    before = outside_the_cache(tmp_path, d)
    rc = cli_main(["cache", "verify", "--cache-dir", str(tmp_path / "root")])
    assert rc == 1 and sum(read) == 0
    with pytest.warns(CacheWarning, match="larger than any entry"):
        b = build.get_binary(SPECS[0], SM90, store=cache.open_store(d), announce=False)
    assert b.source == "compiled" and sum(read) <= MAX_ENTRY_BYTES + 1
    assert decode_entry(big.read_bytes(), expect_key=key).payload == b.data  # ours to replace: it was deleted
    assert outside_the_cache(tmp_path, d) == before


MALFORMED = {
    "deep": MAGIC + (10_000).to_bytes(8, "little") + b"[" * 10_000,
    "huge header length": MAGIC + (1 << 62).to_bytes(8, "little") + b"{}",
    "not json": MAGIC + (9).to_bytes(8, "little") + b"\xff\xfe{}[]\x00x",
    "truncated": MAGIC[:5],
    "empty": b"",
}


def test_malformed_entries_are_corrupt_removed_and_recompiled(tmp_path, capsys, compiles):
    root = tmp_path / "root"
    d = cache.versioned_cache_dir(root)
    d.mkdir(parents=True, mode=0o700)
    specs = [registry.tail_spec(h, 128) for h in (1, 2, 4, 8, 16)]
    for spec, data in zip(specs, MALFORMED.values()):
        (d / f"{build.spec_key(spec, SM90)}.bin").write_bytes(data)
    before = outside_the_cache(tmp_path, d)
    assert cli_main(["cache", "verify", "--cache-dir", str(root)]) == 1
    assert cli_main(["cache", "list", "--cache-dir", str(root)]) == 0
    text = "".join(capsys.readouterr())
    assert "Traceback" not in text and text.count("UNUSABLE") == len(MALFORMED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = cache.open_store(d)
        built = [build.get_binary(s, SM90, store=store, announce=False) for s in specs]
    assert [b.source for b in built] == ["compiled"] * len(specs)
    assert sum("corrupt cache entry" in str(w.message) for w in caught) == len(specs)
    for b in built:
        assert decode_entry((d / f"{b.key}.bin").read_bytes(), expect_key=b.key).payload == b.data
    assert outside_the_cache(tmp_path, d) == before


# -- a parent this user cannot enter -----------------------------------------------------------------

@pytest.mark.skipif(not CAN_SWITCH_USER, reason="needs root to run as a second user (test_cache.py simulates it)")
def test_a_cache_under_another_users_private_directory(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)  # root's; uid 65534 cannot enter it
    (private / "secret").write_bytes(b"root's")
    before = tree_snapshot(tmp_path)
    every_command(tmp_path / "warm-up")  # load every module here: the child may not read the interpreter's files

    def victim():
        got = every_command(private / "cache")
        return {k: list(v) for k, v in got.items()}

    got = as_other_user(victim, cwd=Path("/"))
    assert got["load"] == ["compiled"] * 3
    assert len(got["warnings"]) == 1 and "Permission denied" in got["warnings"][0]
    for command in ("warm --arch", "cache list", "cache verify", "cache clear"):
        assert got[command][0] in (1, 2) and "Permission denied" in got[command][1], got[command]
    assert tree_snapshot(tmp_path, skip=tmp_path / "warm-up") == before


# -- a full disk ------------------------------------------------------------------------------------

def test_a_full_disk_writes_nothing_and_leaves_no_temporary_file(tmp_path, monkeypatch, compiles):
    d = cache.versioned_cache_dir(tmp_path / "root")
    store = cache.open_store(d)
    real_write = os.write
    full = {"on": True}

    def write(fd, data):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    before = outside_the_cache(tmp_path, d)
    monkeypatch.setattr(store_mod.os, "write", write)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = [build.get_binary(s, SM90, store=store, announce=False) for s in SPECS]
    full["on"] = False
    assert [b.source for b in built] == ["compiled"] * 3
    assert [str(w.message) for w in caught if issubclass(w.category, CacheWarning)] == [
        f"rope_rtc: cannot write to cache directory {d} (No space left on device); compiled kernels are kept in "
        "memory for this process"]
    assert list(d.iterdir()) == []
    assert build.get_binary(SPECS[0], SM90, store=store, announce=False).source == "memory"
    assert outside_the_cache(tmp_path, d) == before
