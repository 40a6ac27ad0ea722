"""Cache trust: nobody but its owner can plant a binary this process will run.

A cached CUBIN runs with the process's access to all of its GPU memory, so the cache never
follows a symbolic link, refuses directories and entries that other users can write (unless
``ROPE_RTC_TRUST_SHARED_CACHE=1``), creates only private directories, and never loads an
entry whose header names another architecture, NVRTC or rope_rtc. CI runs as root: ownership
checks by uid still work (root can chown to another uid) and so do mode checks.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from rope_rtc.build import kernels as build, cache, registry
from rope_rtc._version import __version__
from rope_rtc.build.cache import Entry, decode_entry, encode_entry
from rope_rtc.build.cache import maintenance as maintenance_mod
from rope_rtc.build.cache.store import CacheWarning
from rope_rtc.cli import main as cli_main
from rope_rtc.build.toolchain import Target, nvrtc_version
from cache_fixtures import CAN_SWITCH_USER, as_other_user, compiles, fresh_store, isolated  # noqa: F401 (fixtures)

SM90 = Target(90, "cubin")
SPEC = registry.tail_spec(1, 128)
OTHER_UID = 4242


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True)
    path.chmod(0o700)
    return path


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def valid_entry(tmp_path):
    """A genuine entry for SPEC/sm_90, built in a directory of its own."""
    d = private_dir(tmp_path / "genuine")
    b = build.get_binary(SPEC, SM90, store=fresh_store(d), announce=False)
    return d / f"{b.key}.bin", b


# -- symbolic links ----------------------------------------------------------------------------

def test_a_symlinked_entry_is_never_followed(tmp_path, valid_entry, compiles):
    target, genuine = valid_entry
    before = (target.read_bytes(), target.stat().st_ino)
    d = private_dir(tmp_path / "cache")
    link = d / target.name
    link.symlink_to(target)  # points out of the directory, at a valid entry for this very key
    with pytest.warns(CacheWarning, match="symbolic link"):
        b = build.get_binary(SPEC, SM90, store=fresh_store(d), announce=False)
    assert b.source == "compiled" and compiles == [SPEC.name]
    # Publishing replaced the link itself; what it pointed at is untouched.
    assert not link.is_symlink() and link.is_file()
    assert (target.read_bytes(), target.stat().st_ino) == before
    assert decode_entry(link.read_bytes(), expect_key=genuine.key).payload == genuine.data


def test_a_symlinked_entry_fails_verify(tmp_path, valid_entry, capsys):
    target, _ = valid_entry
    root = tmp_path / "root"
    d = cache.versioned_cache_dir(root)
    private_dir(d)
    (d / target.name).symlink_to(target)
    assert cli_main(["cache", "verify", "--cache-dir", str(root)]) == 1
    err = capsys.readouterr().err
    assert target.name in err and "symbolic link" in err
    # The remedy given is one that works: the next publish replaces the link (never following it).
    assert "1 of them is replaced when next compiled" in err and "rebuilds it now" in err and "by hand" not in err
    assert build.get_binary(SPEC, SM90, store=fresh_store(d), announce=False).source == "compiled"
    assert cli_main(["cache", "verify", "--cache-dir", str(root)]) == 0


def test_a_directory_at_an_entry_name_fails_verify_with_a_remedy_that_works(tmp_path, capsys, compiles):
    root = tmp_path / "root"
    d = private_dir(cache.versioned_cache_dir(root))
    (d / f"{build.spec_key(SPEC, SM90)}.bin").mkdir()  # the cache never deletes a directory
    assert cli_main(["cache", "verify", "--cache-dir", str(root)]) == 1
    err = capsys.readouterr().err
    assert "1 of them is not a file, which the cache never deletes or replaces" in err and "remove it by hand" in err
    with pytest.warns(CacheWarning, match="not a cache entry; left alone"):
        assert build.get_binary(SPEC, SM90, store=fresh_store(d), announce=False).source == "compiled"
    assert cli_main(["cache", "verify", "--cache-dir", str(root)]) == 1  # still there: only a person removes it


def test_a_dangling_symlink_is_a_miss(tmp_path, compiles):
    d = private_dir(tmp_path / "cache")
    key = build.spec_key(SPEC, SM90)
    (d / f"{key}.bin").symlink_to(tmp_path / "nowhere.bin")
    with pytest.warns(CacheWarning, match="symbolic link"):
        assert build.get_binary(SPEC, SM90, store=fresh_store(d), announce=False).source == "compiled"


# -- writable by others -------------------------------------------------------------------------

@pytest.mark.parametrize("dir_mode", [0o770, 0o707, 0o777, 0o720])
def test_directory_writable_by_others_is_refused_and_work_stays_in_memory(tmp_path, dir_mode, compiles):
    d = private_dir(tmp_path / "shared")
    d.chmod(dir_mode)
    with pytest.warns(CacheWarning, match=r"writable by other users.*ROPE_RTC_TRUST_SHARED_CACHE"):
        store = cache.open_store(d)
    b = build.get_binary(SPEC, SM90, store=store, announce=False)
    assert b.source == "compiled"
    assert list(d.iterdir()) == [], "nothing may be published into an untrusted directory"
    assert build.get_binary(SPEC, SM90, store=store, announce=False).source == "memory"


def test_entries_in_an_untrusted_directory_are_never_read(tmp_path, valid_entry, compiles):
    target, _ = valid_entry
    target.parent.chmod(0o777)
    with pytest.warns(CacheWarning, match="writable by other users"):
        store = cache.open_store(target.parent)
    assert build.get_binary(SPEC, SM90, store=store, announce=False).source == "compiled"
    assert compiles == [SPEC.name]


def test_shared_directory_is_used_when_trusted_explicitly(tmp_path, monkeypatch, compiles):
    d = private_dir(tmp_path / "team")
    d.chmod(0o775)
    monkeypatch.setenv("ROPE_RTC_TRUST_SHARED_CACHE", "1")
    first = build.get_binary(SPEC, SM90, store=cache.open_store(d), announce=False)
    assert first.source == "compiled" and (d / f"{first.key}.bin").is_file()
    assert build.get_binary(SPEC, SM90, store=fresh_store(d, trust_shared=True), announce=False).source == "disk"


@pytest.mark.parametrize("entry_mode", [0o620, 0o602, 0o666])
def test_entry_writable_by_others_is_refused(valid_entry, entry_mode, compiles):
    path, genuine = valid_entry
    path.chmod(entry_mode)
    with pytest.warns(CacheWarning, match="writable by other users"):
        b = build.get_binary(SPEC, SM90, store=fresh_store(path.parent), announce=False)
    assert b.source == "compiled" and compiles == [SPEC.name]
    # The replacement this process published is private again.
    assert mode(path) == 0o600


def test_entry_writable_by_others_is_used_when_trusted(valid_entry, compiles):
    path, _ = valid_entry
    path.chmod(0o664)
    assert build.get_binary(SPEC, SM90, store=fresh_store(path.parent, trust_shared=True), announce=False).source == "disk"
    assert compiles == []


needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="chown to another uid needs root")


@needs_root
def test_entry_owned_by_another_user_is_refused(valid_entry, compiles):
    path, _ = valid_entry
    os.chown(path, OTHER_UID, -1)
    with pytest.warns(CacheWarning, match=f"owned by uid {OTHER_UID}"):
        assert build.get_binary(SPEC, SM90, store=fresh_store(path.parent), announce=False).source == "compiled"


@needs_root
def test_directory_owned_by_another_user_is_refused(tmp_path, compiles):
    d = private_dir(tmp_path / "theirs")
    os.chown(d, OTHER_UID, -1)
    with pytest.warns(CacheWarning, match=f"owned by uid {OTHER_UID}"):
        store = cache.open_store(d)
    assert build.get_binary(SPEC, SM90, store=store, announce=False).source == "compiled"
    assert list(d.iterdir()) == []


@pytest.mark.skipif(not CAN_SWITCH_USER, reason="acting as another user needs root")
def test_a_cache_root_warmed_into_an_image_serves_other_users(tmp_path):
    """An image's cache is warmed by root at build time, then opened by an unprivileged server:
    root's entries are trusted (root can write anything the server runs), and served."""
    root = tmp_path / "image-cache"
    d = private_dir(cache.versioned_cache_dir(root))
    b = build.get_binary(SPEC, SM90, store=fresh_store(d), announce=False)
    for p in (tmp_path, root, d):
        p.chmod(0o755)  # `chmod a+rX`, as an image build does
    (d / f"{b.key}.bin").chmod(0o644)
    rel = d.relative_to(tmp_path)

    def served() -> str:
        import warnings

        os.environ["ROPE_RTC_NO_COMPILE"] = "1"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            source = build.get_binary(SPEC, SM90, store=fresh_store(rel), announce=False).source
        return source, [str(w.message) for w in seen]

    source, said = as_other_user(served, cwd=tmp_path)
    assert source == "disk"
    assert len(said) == 1 and "is not writable; serving its entries read-only" in said[0], said


# -- what the library creates is private --------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_directories_created_are_private_at_every_level(tmp_path, monkeypatch, umask):
    root = tmp_path / "new" / "cache-root"
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(root))
    old = os.umask(umask)
    try:
        b = build.get_binary(SPEC, SM90, announce=False)
    finally:
        os.umask(old)
    d = cache.versioned_cache_dir()
    assert d.parent == root
    for level in (tmp_path / "new", root, d):
        assert mode(level) == 0o700, f"{level} is {mode(level):o}"
    assert mode(d / f"{b.key}.bin") == 0o600


@pytest.mark.parametrize("umask, dir_mode, file_mode", [(0o002, 0o775, 0o664), (0o007, 0o770, 0o660),
                                                        (0o022, 0o755, 0o644)])
def test_a_trusted_shared_cache_creates_what_the_umask_allows(tmp_path, monkeypatch, umask, dir_mode, file_mode):
    """A team's cache: its members must read (and replace) each other's entries, so under
    ROPE_RTC_TRUST_SHARED_CACHE=1 the umask decides, and a setgid group directory stays one."""
    team = private_dir(tmp_path / "team")
    team.chmod(0o2770)
    root = team / "new-root"
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(root))
    monkeypatch.setenv("ROPE_RTC_TRUST_SHARED_CACHE", "1")
    old = os.umask(umask)
    try:
        b = build.get_binary(SPEC, SM90, announce=False)
        cache.open_store().disk.put_text(b.key, ".cu", "// option: saved source\n")
    finally:
        os.umask(old)
    d = cache.versioned_cache_dir()
    for level in (root, d):
        st = level.lstat()
        assert stat.S_IMODE(st.st_mode) & 0o777 == dir_mode, f"{level} is {stat.S_IMODE(st.st_mode):o}"
        assert st.st_mode & stat.S_ISGID, f"{level} lost the setgid bit of its group directory"
    assert {p.name: mode(p) for p in d.iterdir()} == {f"{b.key}.bin": file_mode, f"{b.key}.cu": file_mode}


def test_an_untrusted_cache_stays_private_under_a_group_umask(tmp_path, monkeypatch):
    root = tmp_path / "mine"
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(root))
    old = os.umask(0o002)
    try:
        b = build.get_binary(SPEC, SM90, announce=False)
    finally:
        os.umask(old)
    assert mode(root) == mode(cache.versioned_cache_dir()) == 0o700
    assert mode(cache.versioned_cache_dir() / f"{b.key}.bin") == 0o600


ALICE, BOB, TEAM = 4301, 4302, 4300


@pytest.mark.skipif(not CAN_SWITCH_USER, reason="acting as two users needs root")
def test_two_members_of_a_team_share_one_cache(tmp_path):
    """Alice and Bob (own primary groups, both in TEAM) under umask 002 and the trust switch, with
    the setup the documentation gives: a setgid directory of the team, mode 2770. What one
    publishes the other is served, with compiling forbidden; neither replaces the other's entry."""
    tmp_path.chmod(0o711)  # the members work in it by relative paths (pytest's directories above are 0700)
    team = tmp_path / "team"
    team.mkdir()
    os.chown(team, ALICE, TEAM)
    team.chmod(0o2770)
    genuine = build.get_binary(SPEC, SM90, store=fresh_store(private_dir(tmp_path / "build")), announce=False)
    sm80 = Target(80, "cubin")
    other = build.get_binary(SPEC, sm80, store=fresh_store(tmp_path / "build"), announce=False)
    major, minor = nvrtc_version()

    def entry(b):
        return Entry(b.key, SPEC.name, b.target.name, b.kind, f"{major}.{minor}", __version__, b.data, time.time())

    rel = cache.versioned_cache_dir("team")  # relative: the members cannot traverse pytest's tmp_path

    def publish(b) -> bool:
        return fresh_store(rel, trust_shared=True).put(entry(b))

    def load(target) -> str:
        import warnings

        os.environ["ROPE_RTC_NO_COMPILE"] = "1"  # a miss raises: only the other member's entry can serve
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return build.get_binary(SPEC, target, store=fresh_store(rel, trust_shared=True), announce=False).source

    member = dict(cwd=tmp_path, groups=(TEAM,), umask=0o002)
    assert as_other_user(lambda: publish(genuine), uid=ALICE, **member)
    assert as_other_user(lambda: publish(other), uid=BOB, **member)
    assert as_other_user(lambda: load(sm80), uid=ALICE, **member) == "disk"
    assert as_other_user(lambda: load(SM90), uid=BOB, **member) == "disk"
    d = tmp_path / rel
    st = d.lstat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (ALICE, TEAM, 0o2775)
    owners = {p.name: (p.lstat().st_uid, p.lstat().st_gid, mode(p)) for p in d.iterdir()}
    assert owners == {f"{genuine.key}.bin": (ALICE, TEAM, 0o664), f"{other.key}.bin": (BOB, TEAM, 0o664)}
    assert decode_entry((d / f"{genuine.key}.bin").read_bytes()).payload == genuine.data


def test_warm_creates_private_directories(tmp_path, capsys):
    root = tmp_path / "warm-root"
    assert cli_main(["warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", "--kernels", "blog"]) == 0
    d = cache.versioned_cache_dir(root)
    assert mode(root) == 0o700 and mode(d) == 0o700
    assert all(mode(p) == 0o600 for p in d.iterdir())


def test_warm_refuses_an_untrusted_directory(tmp_path, capsys):
    root = private_dir(tmp_path / "open")
    d = private_dir(cache.versioned_cache_dir(root))
    d.chmod(0o777)
    assert cli_main(["warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", "--kernels", "blog"]) == 2
    assert "writable by other users" in capsys.readouterr().err
    assert list(d.iterdir()) == []


# -- foreign entries ----------------------------------------------------------------------------

def _nvrtc_text() -> str:
    major, minor = nvrtc_version()
    return f"{major}.{minor}"


@pytest.mark.parametrize(
    "field, value",
    [("target", "sm_80"), ("target", "compute_90"), ("kind", "ptx"), ("nvrtc", "12.0"), ("rope_rtc", "0.0.1"),
     ("kernel", "tail_rope")],  # another kernel's binary under this key: its entry points may match
)
def test_entry_built_for_another_target_nvrtc_or_version_is_never_loaded(tmp_path, compiles, field, value):
    d = private_dir(tmp_path / "cache")
    key = build.spec_key(SPEC, SM90)
    genuine = dict(key=key, kernel=SPEC.name, target="sm_90", kind="cubin", nvrtc=_nvrtc_text(),
                   rope_rtc=__version__, payload=b"\x7fELF forged payload", created=time.time())
    forged = Entry(**{**genuine, field: value})
    path = d / f"{key}.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(encode_entry(forged))  # checksum valid: only the header's claim gives it away
    with pytest.warns(CacheWarning, match=" built for "):
        b = build.get_binary(SPEC, SM90, store=fresh_store(d), announce=False)
    assert b.source == "compiled" and compiles == [SPEC.name]
    assert b"forged" not in b.data
    rebuilt = decode_entry(path.read_bytes(), expect_key=key)
    assert (rebuilt.kernel, rebuilt.target, rebuilt.kind, rebuilt.nvrtc, rebuilt.rope_rtc) == (
        SPEC.name, "sm_90", "cubin", _nvrtc_text(), __version__)


def test_the_same_entry_with_honest_header_is_loaded(tmp_path, compiles):
    """Control for the test above: a well-formed entry for this build is served."""
    d = private_dir(tmp_path / "cache")
    key = build.spec_key(SPEC, SM90)
    honest = Entry(key, SPEC.name, "sm_90", "cubin", _nvrtc_text(), __version__, b"\x7fELF honest payload", 1.0)
    fd = os.open(d / f"{key}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(encode_entry(honest))
    b = build.get_binary(SPEC, SM90, store=fresh_store(d), announce=False)
    assert b.source == "disk" and b.data == honest.payload and compiles == []


def test_entries_for_other_architectures_live_under_other_keys(tmp_path, compiles):
    d = private_dir(tmp_path / "cache")
    a = build.get_binary(SPEC, Target(80), store=fresh_store(d), announce=False)
    b = build.get_binary(SPEC, SM90, store=fresh_store(d), announce=False)
    assert a.key != b.key and b.source == "compiled" and a.data != b.data
    assert decode_entry((d / f"{a.key}.bin").read_bytes()).target == "sm_80"


# -- symbolic links above the entries ------------------------------------------------------------

def user_files(directory: Path) -> dict[str, bytes]:
    """A user's own files that happen to look like the cache's (the names `clear` once globbed)."""
    files = {"kernel.cu": b"// my kernel\n", "model.bin": b"my weights", ".tmp-s": b"my scratch"}
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return files


@pytest.mark.parametrize("level", ["version", "root"])
def test_a_symlinked_cache_directory_is_refused_and_nothing_behind_it_is_touched(tmp_path, capsys, compiles,
                                                                                 level):
    from cache_fixtures import tree_snapshot

    mine = private_dir(tmp_path / "V")
    files = user_files(mine)
    root = tmp_path / "R"
    if level == "version":
        private_dir(root)
        cache.versioned_cache_dir(root).symlink_to(mine, target_is_directory=True)
    else:
        root.symlink_to(mine, target_is_directory=True)
    before = tree_snapshot(tmp_path)

    assert cli_main(["warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", "--kernels", "blog"]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert cli_main(["cache", "clear", "--cache-dir", str(root)]) == 1
    assert "symbolic link" in capsys.readouterr().err
    assert cli_main(["cache", "verify", "--cache-dir", str(root)]) == 1
    assert cli_main(["cache", "list", "--cache-dir", str(root)]) == 1
    capsys.readouterr()
    with pytest.warns(CacheWarning, match="symbolic link"):
        store = cache.open_store(cache.versioned_cache_dir(root))
    assert build.get_binary(SPEC, SM90, store=store, announce=False).source == "compiled"
    assert tree_snapshot(tmp_path) == before
    assert {n: (mine / n).read_bytes() for n in files} == files


def test_clear_removes_only_the_caches_own_files(tmp_path, capsys):
    from cache_fixtures import tree_snapshot

    root = tmp_path / "root"
    assert cli_main(["warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", "--kernels", "blog",
                     "--kernels", "tail", "--tail-heads", "1"]) == 0
    d = cache.versioned_cache_dir(root)
    ours = sorted(p.name for p in d.iterdir())
    (d / ".tmp-abcdefgh.part").write_bytes(b"torn")          # a temporary file the store writes,
    hours_ago = time.time() - 2 * 3600
    os.utime(d / ".tmp-abcdefgh.part", (hours_ago, hours_ago))  # left by a process killed long ago
    (d / ".tmp-ijklmnop.part").write_bytes(b"being written")  # one a publish may be writing now
    (d / f"{'c' * 64}.bin").write_bytes(b"not our format")    # an entry name, but not our entry
    (d / f"{'d' * 64}.cu").write_bytes(b"// my kernel\n")    # a saved source's name, but not one
    store = cache.open_store(d)
    store.disk.put_text("e" * 64, ".cu", build.assembled_source(SPEC.source, SPEC.defines, SM90))  # a saved source
    (d / "sub").mkdir()
    (d / "sub" / "x.bin").write_bytes(b"nested")
    files = user_files(d)
    (d / "link.bin").symlink_to(tmp_path / "elsewhere.bin")
    (tmp_path / "elsewhere.bin").write_bytes(b"theirs")
    keep = {n for n in os.listdir(d) if n not in ours and n not in (".tmp-abcdefgh.part", f"{'e' * 64}.cu")}
    before = tree_snapshot(tmp_path, skip=None)
    capsys.readouterr()
    rc = cli_main(["cache", "clear", "--cache-dir", str(root)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert set(os.listdir(d)) == keep
    assert f"removed {len(ours) + 2} files" in out and "not the cache's" in out
    assert "left 1 temporary file younger than an hour" in out and "publishing it;" in out and (d / ".tmp-ijklmnop.part").exists()
    after = tree_snapshot(tmp_path)
    assert {k: v for k, v in before.items() if Path(k).name in keep or "sub" in k or k == "elsewhere.bin"} == \
        {k: v for k, v in after.items() if Path(k).name in keep or "sub" in k or k == "elsewhere.bin"}
    assert {n: (d / n).read_bytes() for n in files} == files


def _clear(root: Path) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["cache", "clear", "--cache-dir", str(root)])
    return rc, out.getvalue(), err.getvalue()


def test_clear_of_a_cache_this_user_cannot_write_fails_naming_it_and_removes_nothing(tmp_path, monkeypatch):
    from cache_fixtures import tree_snapshot

    root = tmp_path / "root"
    assert cli_main(["warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", "--kernels", "blog"]) == 0
    d = cache.versioned_cache_dir(root)
    real_access = os.access
    monkeypatch.setattr(maintenance_mod.os, "access",
                        lambda p, m, **kw: False if Path(p) == d else real_access(p, m, **kw))
    before = tree_snapshot(tmp_path)
    rc, out, err = _clear(root)
    assert rc == 1, out + err
    assert str(d) in err and "not writable" in err and "nothing removed" in err, err
    assert "removed" not in out, out
    assert tree_snapshot(tmp_path) == before


@needs_root
def test_clear_leaves_entries_another_user_owns_and_says_so(tmp_path):
    root = tmp_path / "root"
    assert cli_main(["warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", "--kernels", "blog",
                     "--kernels", "tail", "--tail-heads", "1"]) == 0
    d = cache.versioned_cache_dir(root)
    theirs = sorted(d.glob("*.bin"))[0]
    os.chown(theirs, OTHER_UID, -1)
    rc, out, err = _clear(root)
    assert rc == 1, out + err
    assert "removed 2 files" in out and "not the cache's" not in out, out
    assert theirs.name in err and f"owned by uid {OTHER_UID}" in err, err
    assert [p.name for p in d.iterdir()] == [theirs.name]


def test_clear_skips_files_that_vanish_while_it_runs(tmp_path, monkeypatch):
    """`cache clear` during a warm: a temporary file is renamed onto its entry between the listing
    and its check, an entry is removed by someone else between its check and its removal. Gone is
    what clear wants: no failure."""
    root = tmp_path / "root"
    assert cli_main(["warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", "--kernels", "blog",
                     "--kernels", "tail", "--tail-heads", "1"]) == 0
    d = cache.versioned_cache_dir(root)
    entries = sorted(d.glob("*.bin"))
    published, removed_by_another = entries[0], entries[1]
    young = d / ".tmp-publish0.part"
    os.rename(published, young)  # a publish in progress: its entry not yet in place
    old = d / ".tmp-killed00.part"
    old.write_bytes(b"torn")
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    real_lstat, real_unlink = maintenance_mod.lstat_at, os.unlink

    def lstat_racing_a_publish(name, dir_fd):
        if name == young.name and young.exists():
            os.replace(young, published)  # the publish finishes first
        return real_lstat(name, dir_fd)

    def unlink_racing_another_clear(name, *args, dir_fd=None, **kw):
        if name in (removed_by_another.name, old.name):
            real_unlink(name, dir_fd=dir_fd)  # another process got there first
        return real_unlink(name, *args, dir_fd=dir_fd, **kw)

    monkeypatch.setattr(maintenance_mod, "lstat_at", lstat_racing_a_publish)
    monkeypatch.setattr(maintenance_mod.os, "unlink", unlink_racing_another_clear)
    rc, out, err = _clear(root)
    assert rc == 0, out + err
    assert "could not be removed" not in err and "No such file" not in out + err, err
    # Removed: the one entry that stayed put. The entry published after the listing is left.
    left = len(entries) - 2
    assert f"removed {left} {'file' if left == 1 else 'files'} " in out, out
    assert list(d.iterdir()) == [published]


@pytest.fixture
def image_area():
    """A directory every user can reach (pytest's own are root's, mode 0700), removed afterwards."""
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="rope_rtc-image-"))
    top.chmod(0o755)
    try:
        yield top
    finally:
        shutil.rmtree(top)


@pytest.mark.skipif(not CAN_SWITCH_USER, reason="acting as another user needs root")
def test_clear_by_a_user_who_does_not_own_an_image_cache_fails_naming_it(image_area):
    from cache_fixtures import tree_snapshot

    root = image_area / "image-cache"
    d = private_dir(cache.versioned_cache_dir(root))
    for spec in (SPEC, registry.blog_spec()):
        build.get_binary(spec, SM90, store=fresh_store(d), announce=False)
    for p in (root, d):
        p.chmod(0o755)  # `chmod a+rX`, as an image build does
    for p in d.iterdir():
        p.chmod(0o644)
    _clear(image_area / "warm-up")  # import here what clear imports: the child may not read every file
    before = tree_snapshot(image_area, skip=image_area / "warm-up")
    rc, out, err = as_other_user(lambda: _clear(root))
    assert rc == 1, out + err
    assert str(d) in err and "not writable" in err and "nothing removed" in err, err
    assert "removed 0" not in out and "not the cache's" not in out, out
    assert tree_snapshot(image_area, skip=image_area / "warm-up") == before


# -- verify agrees with the loader -----------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("target", "sm_80"), ("kind", "ptx"), ("nvrtc", "12.0")])
def test_verify_fails_an_entry_the_loader_would_refuse(tmp_path, capsys, field, value):
    root = tmp_path / "root"
    d = private_dir(cache.versioned_cache_dir(root))
    key = build.spec_key(SPEC, SM90)
    genuine = dict(key=key, kernel=SPEC.name, target="sm_90", kind="cubin", nvrtc=_nvrtc_text(),
                   rope_rtc=__version__, payload=b"\x7fELF forged payload", created=time.time())
    fd = os.open(d / f"{key}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(encode_entry(Entry(**{**genuine, field: value})))
    assert cli_main(["cache", "verify", "--cache-dir", str(root)]) == 1
    err = capsys.readouterr().err
    assert SPEC.name in err and value in err, err
    # Control: the honest entry verifies.
    os.unlink(d / f"{key}.bin")
    fd = os.open(d / f"{key}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(encode_entry(Entry(**genuine)))
    assert cli_main(["cache", "verify", "--cache-dir", str(root)]) == 0, capsys.readouterr().err


def test_verify_fails_a_directory_the_loader_refuses(tmp_path, capsys):
    root = tmp_path / "root"
    assert cli_main(["warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", "--kernels", "blog"]) == 0
    d = cache.versioned_cache_dir(root)
    d.chmod(0o777)
    capsys.readouterr()
    assert cli_main(["cache", "verify", "--cache-dir", str(root)]) == 1
    assert "writable by other users" in capsys.readouterr().err
