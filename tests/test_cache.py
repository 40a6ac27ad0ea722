"""The kernel cache: key, entry format, disk store, switches, and warming it from many processes.

CPU only. Every test gets its own cache root (``ROPE_RTC_CACHE_DIR`` under tmp_path) and a
process with no stores or warnings remembered from other tests. The subprocess tests run the
real command line (``python -m rope_rtc.cli warm`` and ``scripts/warm_cache.py``).
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from rope_rtc.build import kernels as build, cache, registry, sources
from rope_rtc.build.cache import Entry, EntryError, decode_entry, encode_entry
from rope_rtc.build.cache import safety, store as store_mod
from rope_rtc.build.cache.store import CacheWarning, DiskStore
from rope_rtc.cli import main as cli_main
from rope_rtc.errors import KernelNotCachedError
from rope_rtc.build.toolchain import Target
from cache_fixtures import compiles, fresh_store, isolated  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[1]
SM90 = Target(90, "cubin")


def flip_byte(path: Path, offset_from_end: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_RTC_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return env


def warm_cmd(root: Path, *args: str, script: bool = False) -> list[str]:
    head = [sys.executable, str(REPO / "scripts" / "warm_cache.py")] if script else [
        sys.executable, "-m", "rope_rtc.cli", "warm"]
    return [*head, "--cache-dir", str(root), "--no-progress", *args]


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def snapshot(directory: Path) -> dict[str, tuple[int, int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size) for p in directory.iterdir()}


def assert_complete_and_verified(directory: Path, expected_kernels: list[str] | None = None) -> None:
    listed = DiskStore(directory, create=False).list()
    bad = [(e.path.name, e.error) for e in listed if e.error]
    assert not bad, f"entries failing verification: {bad}"
    names = sorted(p.name for p in directory.iterdir())
    assert all(n.endswith(".bin") for n in names), f"unexpected files (temporary?): {names}"
    if expected_kernels is not None:
        assert sorted(e.entry.kernel for e in listed) == sorted(expected_kernels)


# -- the key ----------------------------------------------------------------------------------

KEY_INPUTS = dict(
    package_version="0.1.0",
    nvrtc_version=(13, 5),
    cuda_headers_version=13050,
    target="sm_90",
    kind="cubin",
    source_name="rope.cu",
    sources=(("common.cuh", b"#pragma once\n"), ("rope.cu", b"kernel body\n")),
    options=("-arch=sm_90", "-std=c++17", "-DROPE_VEC=4"),
)


def test_key_is_a_full_sha256_and_deterministic():
    k = cache.cache_key(**KEY_INPUTS)
    assert len(k) == 64 and int(k, 16) >= 0
    assert cache.cache_key(**KEY_INPUTS) == k


@pytest.mark.parametrize(
    "field, value",
    [
        ("package_version", "0.1.1"),
        ("nvrtc_version", (13, 6)),
        ("nvrtc_version", (12, 5)),
        ("cuda_headers_version", 13060),
        ("target", "sm_80"),
        ("target", "sm_100"),
        ("kind", "ptx"),
        ("source_name", "tail_rope.cu"),
        ("sources", (("common.cuh", b"#pragma once\n "), ("rope.cu", b"kernel body\n"))),  # a header byte
        ("sources", (("common.cuh", b"#pragma once\n"), ("rope.cu", b"kernel body!\n"))),
        ("sources", (("common.cuh", b"#pragma once\n"), ("rope2.cu", b"kernel body\n"))),  # a rename
        ("sources", (("common.cuh", b"#pragma once\n"), ("rope.cu", b"kernel body\n"), ("new.cuh", b""))),
        ("sources", (("common.cuh", b"#pragma once\nkernel body\n"), ("rope.cu", b""))),  # bytes moved between files
        ("options", ("-arch=sm_90", "-std=c++17", "-DROPE_VEC=2")),
        ("options", ("-arch=sm_90", "-std=c++17", "-DROPE_VEC=4", "-lineinfo")),
        ("options", ("-arch=sm_90", "-std=c++17")),
        ("options", ("-arch=sm_90", "-std=c++17 -DROPE_VEC=4")),  # joining two options is another input
        ("options", ("-std=c++17", "-arch=sm_90", "-DROPE_VEC=4")),
    ],
)
def test_key_changes_with_every_input(field, value):
    assert cache.cache_key(**{**KEY_INPUTS, field: value}) != cache.cache_key(**KEY_INPUTS)


def test_spec_key_changes_with_toolchain_sources_version_target_and_specialisation(monkeypatch):
    spec = registry.rope_spec("float16", False, 8)
    base = build.spec_key(spec, SM90)
    assert build.spec_key(spec, SM90) == base
    seen = {base}

    def differs(key: str) -> None:
        assert key not in seen
        seen.add(key)

    differs(build.spec_key(spec, Target(80)))
    differs(build.spec_key(spec, Target(100)))
    differs(build.spec_key(spec, Target(90, "ptx")))
    differs(build.spec_key(registry.rope_spec("float16", False, 4), SM90))
    differs(build.spec_key(registry.rope_spec("float16", True, 8), SM90))
    differs(build.spec_key(registry.rope_spec("bfloat16", False, 8), SM90))

    with monkeypatch.context() as m:
        m.setattr(build, "nvrtc_version", lambda: (13, 9))
        differs(build.spec_key(spec, SM90))
    with monkeypatch.context() as m:
        real = build.cuda_headers()
        m.setattr(build, "cuda_headers", lambda: type(real)(real.path, real.cuda_version + 10, real.origin))
        differs(build.spec_key(spec, SM90))
    with monkeypatch.context() as m:
        m.setattr(build, "__version__", "99.0")
        differs(build.spec_key(spec, SM90))
    with monkeypatch.context() as m:
        # An edited header that rope.cu includes: an editable install must not serve the old binary.
        edited = tuple((n, d + b"\n// edited\n" if n == "common.cuh" else d) for n, d in sources.all_sources())
        m.setattr(sources, "all_sources", lambda: edited)
        differs(build.spec_key(spec, SM90))
    with monkeypatch.context() as m:
        # A file under cuda_src/ that rope.cu does not include is not an input.
        extra = (*sources.all_sources(), ("zz_new.cuh", b"// new\n"))
        m.setattr(sources, "all_sources", lambda: extra)
        assert build.spec_key(spec, SM90) == base


def test_spec_key_ignores_where_the_headers_live(monkeypatch):
    """A cache warmed on a build machine must hit on a server whose headers sit elsewhere."""
    spec = registry.blog_spec()
    base = build.spec_key(spec, SM90)
    real = build.cuda_headers()
    monkeypatch.setattr(build, "cuda_headers", lambda: type(real)("/elsewhere/include", real.cuda_version, "system"))
    assert build.spec_key(spec, SM90) == base


def test_spec_key_follows_the_bytes_of_an_overridden_header_folder(tmp_path, monkeypatch):
    """ROPE_RTC_CUDA_INCLUDE names headers nobody versioned: a hand-edited copy must never share
    entries with the headers it was copied from, whatever CUDA_VERSION it still declares."""
    import shutil

    from rope_rtc.build import toolchain

    spec = registry.rope_spec("bfloat16", False, 8)
    default = build.spec_key(spec, SM90)
    wheel = Path(toolchain.cuda_headers().path)
    copies = {}
    for name, edit in (("copy", None), ("edited", "cuda_bf16.hpp"), ("unread", "cudaGL.h")):
        copies[name] = tmp_path / name
        shutil.copytree(wheel, copies[name])
        if edit is not None:
            with open(copies[name] / edit, "ab") as f:
                f.write(b"\n/* edited by hand */\n")
    keys = {}
    for name, folder in copies.items():
        monkeypatch.setenv("ROPE_RTC_CUDA_INCLUDE", str(folder))
        keys[name] = build.spec_key(spec, SM90)
        assert build.spec_key(spec, SM90) == keys[name]
    assert keys["edited"] != keys["copy"] and keys["edited"] != default
    # A header no source includes, directly or through another header, is not an input.
    assert keys["unread"] == keys["copy"]
    # The folder is hashed once per process, not on every key.
    info = toolchain.headers_digest.cache_info()
    monkeypatch.setenv("ROPE_RTC_CUDA_INCLUDE", str(copies["edited"]))
    for _ in range(3):
        assert build.spec_key(spec, SM90) == keys["edited"]
    assert toolchain.headers_digest.cache_info().misses == info.misses


# -- the entry format -------------------------------------------------------------------------

def sample_entry(key: str = "ab" * 32, payload: bytes = bytes(range(256)) * 4) -> Entry:
    return Entry(key, "tail[TAIL_HEADS=1,TAIL_DIM=128]", "sm_90", "cubin", "13.5", "0.1.0", payload, 1700000000.5)


def test_entry_round_trip():
    e = sample_entry()
    assert decode_entry(encode_entry(e), expect_key=e.key) == e
    empty = sample_entry(payload=b"")
    assert decode_entry(encode_entry(empty)) == empty


@pytest.mark.parametrize("cut", [0, 1, 8, 15, 16, 20, -300, -1])
def test_truncated_entry_is_rejected(cut):
    data = encode_entry(sample_entry())
    with pytest.raises(EntryError):
        decode_entry(data[:cut] if cut else b"")


@pytest.mark.parametrize("offset", [1, 100, 1024])
def test_flipped_payload_byte_is_rejected(offset):
    data = bytearray(encode_entry(sample_entry()))
    data[-offset] ^= 0x01
    with pytest.raises(EntryError, match="checksum"):
        decode_entry(bytes(data))


def test_bad_magic_other_key_extra_bytes_and_broken_header_are_rejected():
    e = sample_entry()
    data = encode_entry(e)
    with pytest.raises(EntryError, match="magic"):
        decode_entry(b"RRTCBIN0" + data[8:])
    with pytest.raises(EntryError, match="magic"):
        decode_entry(b"\x7fELF" + data[4:])
    with pytest.raises(EntryError, match="another key"):
        decode_entry(data, expect_key="cd" * 32)
    with pytest.raises(EntryError):
        decode_entry(data + b"\0")
    header_start = 16
    broken = bytearray(data)
    broken[header_start] = ord("[")  # the JSON header no longer parses as an object
    with pytest.raises(EntryError):
        decode_entry(bytes(broken))
    huge = bytearray(data)
    huge[8:16] = (1 << 40).to_bytes(8, "little")
    with pytest.raises(EntryError, match="header length"):
        decode_entry(bytes(huge))


# -- the disk store ---------------------------------------------------------------------------

def test_publish_is_atomic_and_leaves_no_temporary_files(tmp_path):
    d = tmp_path / "c"
    disk = DiskStore(d)
    entries = [sample_entry(key=f"{i:064x}", payload=os.urandom(1000 + i)) for i in range(5)]
    for e in entries:
        assert disk.put(e)
    assert disk.put(entries[0])  # republishing replaces in place
    assert sorted(p.name for p in d.iterdir()) == sorted(f"{e.key}.bin" for e in entries)
    assert disk.temp_files() == []
    for e in entries:
        assert disk.get(e.key) == e
        assert (d / f"{e.key}.bin").stat().st_mode & 0o777 == 0o600


def test_publish_writes_and_fsyncs_a_temporary_file_before_renaming_it_into_place(tmp_path, monkeypatch):
    d = tmp_path / "c"
    disk = DiskStore(d)
    e = sample_entry(key="3" * 64)
    final = d / f"{e.key}.bin"
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else "?"))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        assert not final.exists(), "the final name must not exist before the complete file is renamed onto it"
        # Both names are relative to the cache directory's descriptor: the rename stays inside it.
        assert os.path.samefile(f"/proc/self/fd/{kw['src_dir_fd']}", d) and kw["dst_dir_fd"] == kw["src_dir_fd"]
        assert Path(src).name == src and src.startswith(".tmp-") and src.endswith(".part")
        assert decode_entry((d / src).read_bytes()) == e, "renamed a file that was not complete"
        events.append(("replace", str(d / dst)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(store_mod.os, "fsync", fsync)
    monkeypatch.setattr(store_mod.os, "replace", replace)
    assert disk.put(e)
    kinds = [k for k, _ in events]
    assert kinds.index("fsync") < kinds.index("replace"), events
    first_synced = events[kinds.index("fsync")][1]
    assert first_synced == "?" or Path(first_synced).name.startswith(".tmp-"), events
    assert events[kinds.index("replace")][1] == str(final)
    assert disk.temp_files() == []


def test_publish_interrupted_before_the_rename_leaves_no_entry(tmp_path, monkeypatch):
    d = tmp_path / "c"
    disk = DiskStore(d)

    def killed(src, dst, **kw):
        raise KeyboardInterrupt  # stands in for any interruption between write and rename

    monkeypatch.setattr(store_mod.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        disk.put(sample_entry(key="4" * 64))
    assert list(d.iterdir()) == []


def test_failed_publish_removes_its_temporary_file_and_warns_once(tmp_path, monkeypatch):
    d = tmp_path / "c"
    disk = DiskStore(d)

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod.os, "fsync", no_space)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not disk.put(sample_entry(key="1" * 64))
        assert not disk.put(sample_entry(key="2" * 64))
    assert [str(w.message) for w in caught if issubclass(w.category, CacheWarning)] == [
        f"rope_rtc: cannot write to cache directory {d} (No space left on device); "
        "compiled kernels are kept in memory for this process"
    ]
    assert list(d.iterdir()) == []


def test_corrupt_entry_warns_is_deleted_and_recompiled(tmp_path, monkeypatch, compiles):
    d = tmp_path / "c"
    spec = registry.tail_spec(1, 128)
    first = build.get_binary(spec, SM90, store=fresh_store(d), announce=False)
    assert first.source == "compiled" and compiles == [spec.name]
    path = d / f"{first.key}.bin"
    flip_byte(path)

    deleted = []
    real_unlink = os.unlink

    def unlink(p, **kw):
        deleted.append(d / p)
        real_unlink(p, **kw)

    with monkeypatch.context() as m:
        m.setattr(store_mod.os, "unlink", unlink)
        with pytest.warns(CacheWarning, match=r"corrupt cache entry .*checksum.*deleted, recompiling"):
            again = build.get_binary(spec, SM90, store=fresh_store(d), announce=False)
    assert path in deleted
    assert again.source == "compiled" and compiles == [spec.name, spec.name]
    assert again.data == first.data
    assert decode_entry(path.read_bytes(), expect_key=first.key).payload == first.data
    # The rebuilt entry now serves a new process without a compile.
    assert build.get_binary(spec, SM90, store=fresh_store(d), announce=False).source == "disk"
    assert len(compiles) == 2


def test_truncated_entry_reads_as_a_miss_not_a_crash(tmp_path, compiles):
    d = tmp_path / "c"
    spec = registry.tail_spec(2, 128)
    first = build.get_binary(spec, SM90, store=fresh_store(d), announce=False)
    path = d / f"{first.key}.bin"
    path.write_bytes(path.read_bytes()[:100])  # a torn file, as a crash without atomic publish would leave
    with pytest.warns(CacheWarning, match="corrupt"):
        again = build.get_binary(spec, SM90, store=fresh_store(d), announce=False)
    assert again.source == "compiled" and again.data == first.data


def _count_cache_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]


def test_unwritable_directory_chmod_degrades_to_memory_with_one_warning(tmp_path, compiles):
    d = tmp_path / "ro"
    d.mkdir(mode=0o700)
    d.chmod(0o500)
    try:
        if os.access(d, os.W_OK):
            pytest.skip("running as root: chmod does not stop writes (the monkeypatched test covers it)")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store = cache.open_store(d)
            specs = [registry.tail_spec(1, 128), registry.tail_spec(2, 128)]
            binaries = [build.get_binary(s, SM90, store=store, announce=False) for s in specs]
            assert build.get_binary(specs[0], SM90, store=store, announce=False).source == "memory"
        assert [b.source for b in binaries] == ["compiled", "compiled"]
        assert len(_count_cache_warnings(caught)) == 1, _count_cache_warnings(caught)
        assert list(d.iterdir()) == []
    finally:
        d.chmod(0o700)


def test_unwritable_directory_degrades_to_memory_with_one_warning(tmp_path, monkeypatch, compiles):
    """As root (CI) chmod cannot make a directory unwritable; make os.access say so instead."""
    d = tmp_path / "ro"
    d.mkdir(mode=0o700)
    real_access = os.access
    monkeypatch.setattr(store_mod.os, "access",
                        lambda p, mode, **kw: False if Path(p) == d else real_access(p, mode, **kw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = cache.open_store(d)
        specs = [registry.tail_spec(1, 128), registry.tail_spec(2, 128), registry.tail_spec(4, 128)]
        binaries = [build.get_binary(s, SM90, store=store, announce=False) for s in specs]
        assert build.get_binary(specs[0], SM90, store=store, announce=False).source == "memory"
        assert cache.open_store(d) is store
    messages = _count_cache_warnings(caught)
    assert len(messages) == 1 and "not writable" in messages[0] and str(d) in messages[0], messages
    assert [b.source for b in binaries] == ["compiled"] * 3 and len(compiles) == 3
    assert all(b.data[:4] == b"\x7fELF" for b in binaries)
    assert list(d.iterdir()) == []


def test_directory_that_fails_writes_later_degrades_with_one_warning(tmp_path, monkeypatch, compiles):
    """A read-only filesystem can look writable (os.access) and refuse the first write."""
    d = tmp_path / "rofs"

    def read_only_fs(self, final, data):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(DiskStore, "_atomic_write", read_only_fs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = cache.open_store(d)
        binaries = [build.get_binary(registry.tail_spec(h, 128), SM90, store=store, announce=False) for h in (1, 2, 4)]
    messages = _count_cache_warnings(caught)
    assert len(messages) == 1 and "Read-only file system" in messages[0], messages
    assert [b.source for b in binaries] == ["compiled"] * 3
    assert store.disk is not None and not store.disk.writable


def test_read_only_shipped_cache_serves_its_hits(tmp_path, monkeypatch, compiles):
    d = tmp_path / "shipped"
    specs = [registry.blog_spec(), registry.tail_spec(8, 512)]
    built = [build.get_binary(s, SM90, store=fresh_store(d), announce=False) for s in specs]
    assert len(compiles) == 2
    d.chmod(0o500)
    real_access = os.access
    monkeypatch.setattr(store_mod.os, "access",
                        lambda p, mode, **kw: False if Path(p) == d else real_access(p, mode, **kw))
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")  # a production image: a miss would raise
    try:
        with pytest.warns(CacheWarning, match="read-only"):
            store = cache.open_store(d)
        assert store.disk is not None and store.disk.usable and not store.disk.writable
        served = [build.get_binary(s, SM90, store=store, announce=False) for s in specs]
    finally:
        d.chmod(0o700)
    assert [b.source for b in served] == ["disk", "disk"]
    assert [b.data for b in served] == [b.data for b in built]
    assert len(compiles) == 2


def test_no_compile_miss_names_kernel_arch_and_the_warm_command(tmp_path, monkeypatch, compiles):
    root = tmp_path / "prod-cache"
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(root))
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    spec = registry.rope_spec("bfloat16", True, 8)
    with pytest.raises(KernelNotCachedError) as info:
        build.get_binary(spec, SM90, announce=False)
    text = str(info.value)
    assert spec.name in text
    assert "sm_90" in text and "ROPE_RTC_NO_COMPILE=1" in text
    assert f"rope-rtc warm --arch sm_90 --cache-dir {root}" in text
    assert compiles == []
    # Following the advice fills exactly the cache the server reads.
    monkeypatch.delenv("ROPE_RTC_NO_COMPILE")
    assert cli_main(["warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress",
                     "--kernels", spec.name]) == 0
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    monkeypatch.setattr(store_mod, "_stores", {})
    assert build.get_binary(spec, SM90, announce=False).source == "disk"


def test_a_corrupt_entry_under_no_compile_warns_what_happens_not_recompiling(tmp_path, monkeypatch, compiles):
    d = tmp_path / "c"
    spec = registry.tail_spec(1, 128)
    first = build.get_binary(spec, SM90, store=fresh_store(d), announce=False)
    path = d / f"{first.key}.bin"
    flip_byte(path)
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    with pytest.warns(CacheWarning) as seen, pytest.raises(KernelNotCachedError, match="rope-rtc warm --arch sm_90"):
        build.get_binary(spec, SM90, store=fresh_store(d), announce=False)
    said = " ".join(str(w.message) for w in seen)
    assert "recompiling" not in said.replace("forbids recompiling", ""), said
    assert "deleted; ROPE_RTC_NO_COMPILE=1 forbids recompiling it" in said and "not cached" in said, said
    assert "KernelNotCachedError" in said, said
    assert not path.exists() and compiles == [spec.name]


def test_disable_disk_cache_writes_nothing(tmp_path, monkeypatch, compiles):
    root = tmp_path / "never"
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(root))
    monkeypatch.setenv("ROPE_RTC_DISABLE_DISK_CACHE", "1")
    monkeypatch.setenv("ROPE_RTC_SAVE_SOURCE", "1")
    spec = registry.tail_spec(1, 512)
    assert build.get_binary(spec, SM90, announce=False).source == "compiled"
    assert build.get_binary(spec, SM90, announce=False).source == "memory"
    assert not root.exists()
    assert cache.open_store().disk is None


def test_save_source_writes_the_compiled_source_beside_the_entry(tmp_path, monkeypatch):
    root = tmp_path / "dbg"
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(root))
    spec = registry.rope_spec("float32", True, 4)
    plain = build.get_binary(spec, SM90, announce=False)
    d = cache.versioned_cache_dir(root)
    assert sorted(p.name for p in d.iterdir()) == [f"{plain.key}.bin"]

    monkeypatch.setenv("ROPE_RTC_SAVE_SOURCE", "1")
    monkeypatch.setattr(store_mod, "_stores", {})
    spec2 = registry.rope_spec("float32", True, 2)
    saved = build.get_binary(spec2, SM90, announce=False)
    text = (d / f"{saved.key}.cu").read_text()
    assert "// option: -arch=sm_90" in text and "// option: -DROPE_VEC=2" in text
    assert sources.read_source("rope.cu").decode() in text
    # A debugging dump is not an entry: listing and verifying ignore it.
    assert len(DiskStore(d).list()) == 2


def test_save_source_leaves_a_file_at_its_name_that_is_not_a_saved_source(tmp_path, monkeypatch):
    # A file at a saved source's name that does not begin as one is someone else's (safety.py); the
    # writer replaced it all the same.
    root = tmp_path / "dbg"
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(root))
    monkeypatch.setenv("ROPE_RTC_SAVE_SOURCE", "1")
    spec = registry.rope_spec("float32", True, 2)
    d = cache.versioned_cache_dir(root)
    d.mkdir(parents=True, mode=0o700)
    theirs = d / f"{build.spec_key(spec, SM90)}.cu"
    theirs.write_bytes(b"my notes\n")
    assert build.get_binary(spec, SM90, announce=False).source == "compiled"
    assert theirs.read_bytes() == b"my notes\n"
    assert (d / f"{build.spec_key(spec, SM90)}.bin").is_file()  # the entry itself is written
    # A saved source of an earlier compile is the cache's own: the next compile replaces it.
    theirs.write_bytes(b"// option: an older compile\n")
    (d / f"{build.spec_key(spec, SM90)}.bin").unlink()
    monkeypatch.setattr(store_mod, "_stores", {})
    assert build.get_binary(spec, SM90, announce=False).source == "compiled"
    assert theirs.read_text().startswith("// option: -arch=sm_90"), theirs.read_text()[:80]


# -- warming from the command line ------------------------------------------------------------

WARM_TWICE_ARGS = ("--arch", "sm_90", "--arch", "sm_80", "--tail-heads", "1")


@pytest.fixture(scope="module")
def warmed_root(tmp_path_factory):
    """One cold `rope-rtc warm --arch sm_90 --arch sm_80` in a fresh process."""
    root = tmp_path_factory.mktemp("warm-twice")
    r = run(warm_cmd(root, *WARM_TWICE_ARGS))
    assert r.returncode == 0, r.stderr
    n = 2 * len(registry.warm_specs((1,)))
    assert f"compiled {n}, already cached 0, failed 0" in r.stdout
    return root, n


def test_second_warm_compiles_nothing_and_rewrites_no_file(warmed_root):
    root, n = warmed_root
    d = cache.versioned_cache_dir(root)
    before, dir_mtime = snapshot(d), d.stat().st_mtime_ns
    assert len(before) == n
    r = run(warm_cmd(root, *WARM_TWICE_ARGS))
    assert r.returncode == 0, r.stderr
    assert f"compiled 0, already cached {n}, failed 0" in r.stdout
    assert snapshot(d) == before, "a warm of a complete cache rewrote an entry"
    assert d.stat().st_mtime_ns == dir_mtime, "a warm of a complete cache created or removed a file"


def test_corrupt_entry_fails_verify_and_is_rebuilt_by_the_next_warm(warmed_root, capsys):
    root, n = warmed_root
    d = cache.versioned_cache_dir(root)
    victim = sorted(d.glob("*.bin"))[3]
    good = victim.read_bytes()
    flip_byte(victim, 50)

    assert cli_main(["cache", "verify", "--cache-dir", str(root)]) == 1
    err = capsys.readouterr().err
    assert victim.name[:12] in err and "checksum" in err
    assert "1 of them is replaced when next compiled" in err and "by hand" not in err

    r = run(warm_cmd(root, *WARM_TWICE_ARGS))
    assert r.returncode == 0, r.stderr
    assert f"compiled 1, already cached {n - 1}, failed 0" in r.stdout
    assert "corrupt" in r.stderr  # the warning said what happened
    assert decode_entry(victim.read_bytes()).payload == decode_entry(good).payload
    assert cli_main(["cache", "verify", "--cache-dir", str(root)]) == 0
    assert f"all {n} entries" in capsys.readouterr().out


# -- many processes at once -------------------------------------------------------------------

# Few kernels, so that every process compiles and publishes the same keys at about the same time.
SMALL_SET = ("--kernels", "blog", "--kernels", "tail", "--tail-heads", "1,2")
BF16_ROPE = ("--kernels", "rope[ROPE_DTYPE=2,ROPE_INTERLEAVED=1,*")


def selected_specs(args: tuple[str, ...]) -> list[registry.KernelSpec]:
    from rope_rtc.warm import select_specs

    kernels = [args[i + 1] for i, a in enumerate(args) if a == "--kernels"]
    return select_specs((1, 2), kernels)


@pytest.mark.parametrize("processes, kernels", [(4, SMALL_SET + BF16_ROPE), (8, SMALL_SET)])
def test_processes_warming_one_directory_at_once_all_succeed(tmp_path, processes, kernels):
    root = tmp_path / "shared"
    specs = selected_specs(kernels)
    cmds = [warm_cmd(root, "--arch", "sm_90", "--jobs", "1", *kernels, script=i % 2 == 1)
            for i in range(processes)]
    procs = [subprocess.Popen(c, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in cmds]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "failed 0" in out, out
    compiled = sum(int(out.split("compiled ")[1].split(",")[0]) for out, _ in outs)
    assert compiled >= len(specs)  # each kernel compiled at least once, by whoever got there
    # One entry per kernel (keys are not recomputed here: the subprocesses read cuda_src/ themselves).
    assert_complete_and_verified(cache.versioned_cache_dir(root), [s.name for s in specs])


def test_warm_killed_at_random_moments_leaves_a_cache_that_verifies(tmp_path, capsys):
    """SIGKILL a real `rope-rtc warm` while it compiles and publishes, three times over one
    directory (each warm resumes what the last left), then complete it."""
    root = tmp_path / "killed"
    d = cache.versioned_cache_dir(root)
    kernels = ("--kernels", "blog", "--kernels", "tail", "--kernels", "rope[ROPE_DTYPE=2,*", "--tail-heads", "1,2")
    cmd = warm_cmd(root, "--arch", "sm_90", "--jobs", "1", *kernels)
    rng = random.Random(20240611)
    killed_mid_warm = 0
    for _ in range(3):
        before = len(list(d.glob("*.bin"))) if d.is_dir() else 0
        p = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        # Once this warm has published an entry it is compiling and publishing the rest.
        deadline = time.monotonic() + 120
        while p.poll() is None and time.monotonic() < deadline and (
                (len(list(d.glob("*.bin"))) if d.is_dir() else 0) <= before):
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.25))
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        killed_mid_warm += p.returncode == -signal.SIGKILL
        bad = [(e.path.name, e.error) for e in DiskStore(d, create=False).list() if e.error]
        assert not bad, f"a killed warm left entries that fail verification: {bad}"
        assert cli_main(["cache", "verify", "--cache-dir", str(root)]) == 0
    assert killed_mid_warm >= 2, "the warms finished before they were killed; give them more to do"
    # Whatever the kills left, the next warm completes the cache from it.
    r = run(warm_cmd(root, "--arch", "sm_90", *kernels))
    assert r.returncode == 0 and "failed 0" in r.stdout, r.stderr
    compiled = int(r.stdout.split("compiled ")[1].split(",")[0])
    assert 0 < compiled < len(selected_specs(kernels)), r.stdout  # it resumed: some were there, some not
    # clear takes every entry; a killed publish's temporary file stays until it is an hour old (a
    # live publish may be writing one that young), and the stale sweep takes it then.
    assert cli_main(["cache", "clear", "--cache-dir", str(root)]) == 0
    capsys.readouterr()
    left = list(d.iterdir())
    assert all(safety.TEMP_NAME.fullmatch(p.name) for p in left), left
    DiskStore(d, create=False).remove_stale_temporaries(max_age_s=0)
    assert list(d.iterdir()) == []


_PUBLISHER = """
import sys, os
from rope_rtc.build.cache import DiskStore, Entry
disk = DiskStore(sys.argv[1])
i = 0
while True:
    payload = os.urandom(64 * 1024 + 4096 * (i % 64))
    assert disk.put(Entry(f"{i % 16:064x}", "k", "sm_90", "cubin", "13.0", "0", payload, 1.0))
    if i == 0:
        print("ready", flush=True)
    i += 1
"""


def test_publishes_killed_at_random_moments_never_leave_a_torn_entry(tmp_path):
    """Kills that land inside publishes: a process that does nothing but publish, killed at
    random; every entry it leaves verifies (an abandoned temporary file is allowed)."""
    d = tmp_path / "storm"
    rng = random.Random(7)
    for _ in range(8):
        p = subprocess.Popen([sys.executable, "-c", _PUBLISHER, str(d)], cwd=REPO, env=subprocess_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "ready\n", p.stderr.read()
        time.sleep(rng.uniform(0.0, 0.15))
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
        assert p.returncode == -signal.SIGKILL
        listed = DiskStore(d, create=False).list()
        assert listed and not [(e.path.name, e.error) for e in listed if e.error]
        assert all(n.endswith(".bin") or (n.startswith(".tmp-") and n.endswith(".part")) for n in os.listdir(d))


# -- hardening: what a hostile test found ------------------------------------------------------

SPEC = registry.tail_spec(1, 128)


def planted(directory: Path, key: str, data: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"{key}.bin"
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def header_entry(fields: dict, payload: bytes = b"\x7fELF payload") -> bytes:
    """An entry whose header carries ``fields`` as given, with a checksum that matches them."""
    import json

    from rope_rtc.build.cache.entry import MAGIC, _digest

    fields = dict(fields, size=len(payload))
    header = json.dumps(dict(fields, sha256=_digest(fields, payload)), sort_keys=True).encode()
    return MAGIC + len(header).to_bytes(8, "little") + header + payload


def good_fields(key: str = "ab" * 32) -> dict:
    return dict(key=key, kernel=SPEC.name, target="sm_90", kind="cubin", nvrtc="13.0", rope_rtc="0.1.0",
                created=1700000000.5)


def test_an_entry_larger_than_any_entry_is_corrupt_and_never_read_whole(tmp_path, monkeypatch, compiles):
    from rope_rtc.build.cache.entry import MAX_ENTRY_BYTES

    d = tmp_path / "c"
    key = build.spec_key(SPEC, SM90)
    path = planted(d, key, b"")
    with open(path, "r+b") as f:  # sparse: costs no disk
        f.truncate(4 * MAX_ENTRY_BYTES)
    read = []
    real_read = os.read
    monkeypatch.setattr(store_mod.os, "read", lambda fd, n: read.append(n) or real_read(fd, n))
    with pytest.warns(CacheWarning, match=r"corrupt cache entry .*larger than"):
        b = build.get_binary(SPEC, SM90, store=fresh_store(d), announce=False)
    assert sum(read) <= MAX_ENTRY_BYTES + 1, f"read {sum(read)} bytes of an oversize file"
    assert b.source == "compiled" and compiles == [SPEC.name]
    assert decode_entry(path.read_bytes(), expect_key=key).payload == b.data


@pytest.mark.parametrize("header", [
    b"[" * 100_000,
    b"[" * 5_000 + b"]" * 5_000,
    b'{"key": ' * 3000,
    b"\xff\xfe not utf-8",
    b"null",
    b"3",
])
def test_an_unparsable_header_is_an_entry_error(header):
    from rope_rtc.build.cache.entry import MAGIC

    data = MAGIC + len(header).to_bytes(8, "little") + header + b"payload"
    with pytest.raises(EntryError):
        decode_entry(data)


@pytest.mark.parametrize("field, value", [
    ("created", "x"), ("created", None), ("created", [1]), ("created", float("nan")), ("created", True),
    ("kernel", 5), ("target", None), ("kind", ["cubin"]), ("nvrtc", 13.0), ("rope_rtc", {}), ("key", 7),
])
def test_a_checksummed_header_with_a_malformed_field_is_an_entry_error(field, value):
    data = header_entry(dict(good_fields(), **{field: value}))
    with pytest.raises(EntryError, match=field):
        decode_entry(data)


@pytest.mark.parametrize("field, value", [
    pytest.param("created", 10**400, id="created-10**400"), ("created", 1e20), ("created", 10**20),
    ("created", -1.0), ("created", 1e308), ("key", "not a key"), ("key", "AB" * 32), ("kind", "elf"),
    ("kernel", "tail\x1b[2J"), ("target", "sm_90\u202e"), ("nvrtc", "13.0\n"),
])
def test_a_checksummed_header_with_a_field_out_of_range_is_an_entry_error_and_nothing_else(field, value):
    """decode_entry raises EntryError and nothing else: a checksum matches whatever its writer
    chose, so a value no rope_rtc writes (a time past the year 9999, a 400-digit integer, text
    with control characters) is corrupt, and an OverflowError must never escape."""
    data = header_entry(dict(good_fields(), **{field: value}))
    with pytest.raises(EntryError, match=field) as info:
        decode_entry(data)
    assert len(str(info.value)) < 200 and "\x1b" not in str(info.value), str(info.value)
    if field == "created":  # control: the bounds' own values are times
        assert decode_entry(header_entry(dict(good_fields(), created=0))).created == 0.0
        assert decode_entry(header_entry(dict(good_fields(), created=253402214400))).created == 253402214400.0


@pytest.mark.parametrize("size", [pytest.param(10**400, id="10**400"), 1 << 40])
def test_a_header_whose_size_no_entry_has_is_an_entry_error_in_a_short_message(size):
    import json

    from rope_rtc.build.cache.entry import MAGIC, _digest

    fields = dict(good_fields(), size=size)
    header = json.dumps(dict(fields, sha256=_digest(fields, b"x")), sort_keys=True).encode()
    with pytest.raises(EntryError, match="size") as info:
        decode_entry(MAGIC + len(header).to_bytes(8, "little") + header + b"x")
    assert len(str(info.value)) < 120, str(info.value)


def test_a_header_missing_a_field_or_with_a_bad_size_is_an_entry_error():
    fields = good_fields()
    del fields["kernel"]
    with pytest.raises(EntryError, match="kernel"):
        decode_entry(header_entry(fields))
    assert decode_entry(header_entry(good_fields())).created == 1700000000.5  # control


@pytest.mark.parametrize("bad", ["deep", "created", "unbounded", "far"])
def test_a_malformed_header_is_removed_and_recompiled_not_raised(tmp_path, compiles, bad):
    from rope_rtc.build.cache.entry import MAGIC

    d = tmp_path / "c"
    key = build.spec_key(SPEC, SM90)
    created = {"created": "x", "unbounded": 10**400, "far": 1e20}.get(bad)
    data = (MAGIC + (100_000).to_bytes(8, "little") + b"[" * 100_000 if bad == "deep"
            else header_entry(dict(good_fields(key), created=created)))
    path = planted(d, key, data)
    with pytest.warns(CacheWarning, match="corrupt cache entry"):
        b = build.get_binary(SPEC, SM90, store=fresh_store(d), announce=False)
    assert b.source == "compiled" and compiles == [SPEC.name]
    assert decode_entry(path.read_bytes(), expect_key=key).payload == b.data


@pytest.mark.parametrize("what", ["directory", "fifo", "socket"])
def test_something_that_is_not_a_file_at_one_entry_path_affects_that_entry_only(tmp_path, compiles, what):
    import stat as stat_mod

    d = tmp_path / "c"
    d.mkdir(mode=0o700)
    key = build.spec_key(SPEC, SM90)
    bad = d / f"{key}.bin"
    if what == "directory":
        bad.mkdir()
        (bad / "inside").write_bytes(b"someone's file")
    elif what == "fifo":
        os.mkfifo(bad, 0o600)
    else:
        os.mknod(bad, 0o600 | stat_mod.S_IFSOCK)
    before = bad.lstat()
    store = fresh_store(d)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = build.get_binary(SPEC, SM90, store=store, announce=False)
        others = [build.get_binary(registry.tail_spec(h, 128), SM90, store=store, announce=False) for h in (2, 4)]
    assert b.source == "compiled"
    assert [o.source for o in others] == ["compiled", "compiled"]
    assert store.disk is not None and store.disk.writable, "one bad path disabled the whole disk store"
    for o in others:  # the other entries were published
        assert decode_entry((d / f"{o.key}.bin").read_bytes(), expect_key=o.key).payload == o.data
    after = bad.lstat()
    assert (stat_mod.S_IFMT(after.st_mode), after.st_ino) == (stat_mod.S_IFMT(before.st_mode), before.st_ino), \
        "what sat at the entry path was replaced or removed"
    if what == "directory":
        assert (bad / "inside").read_bytes() == b"someone's file"
    messages = _count_cache_warnings(caught)
    assert messages and all(key[:16] in m or bad.name in m for m in messages), messages
    assert not any(p.name.startswith(".tmp-") for p in d.iterdir())


def test_a_file_size_limit_fails_only_the_entries_that_exceed_it(tmp_path):
    """``ulimit -f 20``: a big entry cannot be written (EFBIG); the small ones still reach the disk."""
    root = tmp_path / "limited"
    limit = 20 * 1024
    code = ("import resource, sys; from rope_rtc.cli import main; "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); sys.exit(main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, "warm", "--cache-dir", str(root), "--no-progress", "--arch", "sm_90",
           "--kernels", "tail", "--kernels", "rope[ROPE_DTYPE=2,ROPE_INTERLEAVED=1,ROPE_VEC=8,*",
           "--tail-heads", "1,2"]
    r = run(cmd)
    d = cache.versioned_cache_dir(root)
    written = {e.entry.kernel: e.size for e in DiskStore(d, create=False).list() if e.entry is not None}
    tails = {s.name for s in registry.all_specs((1, 2)) if s.family == "tail"}
    assert tails <= set(written), (written, r.stdout, r.stderr)
    assert all(size <= limit for size in written.values())
    assert r.returncode == 1 and "File too large" in r.stderr, r.stderr
    assert not any(p.name.startswith(".tmp-") for p in d.iterdir())


def test_warm_removes_its_own_temporary_files_older_than_an_hour(tmp_path, capsys):
    root = tmp_path / "r"
    assert cli_main(["warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", "--kernels", "blog"]) == 0
    d = cache.versioned_cache_dir(root)
    old, fresh = d / ".tmp-abcdefgh.part", d / ".tmp-ijklmnop.part"
    theirs = d / ".tmp-s"  # not a name the cache writes
    for p in (old, fresh, theirs):
        p.write_bytes(b"half an entry")
    two_hours_ago = time.time() - 7200
    for p in (old, theirs):
        os.utime(p, (two_hours_ago, two_hours_ago))
    assert cli_main(["warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", "--kernels", "blog"]) == 0
    capsys.readouterr()
    assert not old.exists(), "an abandoned temporary file survived a warm"
    assert fresh.exists(), "a temporary file younger than an hour may belong to a warm that is running"
    assert theirs.exists(), "a file the cache did not write was removed"


def _unenterable_scenario(root: str) -> dict:
    """Everything a user does with a cache under a directory they cannot search."""
    import contextlib
    import io

    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store_mod._stores.clear()
        store_mod._warned.clear()
        store = cache.open_store(cache.versioned_cache_dir(root))
        out["sources"] = [build.get_binary(SPEC, SM90, store=store, announce=False).source for _ in range(2)]
    out["warnings"] = _count_cache_warnings(caught)
    for argv in (["cache", "verify"], ["cache", "list"], ["cache", "clear"], ["info"],
                 ["warm", "--arch", "sm_90", "--no-progress", "--kernels", "blog"]):
        o, e = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            try:
                rc = cli_main([*argv, "--cache-dir", root])
            except BaseException as exc:  # noqa: BLE001 - the point: nothing may escape
                rc = f"raised {type(exc).__name__}: {exc}"
        out[" ".join(argv[:2])] = (rc, o.getvalue() + e.getvalue())
    return out


def test_a_cache_directory_the_user_cannot_enter_degrades_everywhere(tmp_path):
    from cache_fixtures import CAN_SWITCH_USER, as_other_user

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    root = str(locked / "cache")
    if CAN_SWITCH_USER:  # root can enter anything: another uid meets the EACCES
        # Import what the commands import, here: the child may not read the interpreter's files.
        _unenterable_scenario(str(tmp_path / "warm-up"))
        got = as_other_user(lambda: _unenterable_scenario(root))
    else:
        locked.chmod(0o000)
        try:
            got = _unenterable_scenario(root)
        finally:
            locked.chmod(0o700)
    assert got["sources"] == ["compiled", "memory"]
    assert len(got["warnings"]) == 1 and "Permission denied" in got["warnings"][0], got["warnings"]
    for command in ("cache verify", "cache list", "cache clear", "info", "warm --arch"):
        rc, text = got[command]
        assert isinstance(rc, int) and "Traceback" not in text, (command, rc, text)
        assert "Permission denied" in text, (command, text)
    assert got["cache verify"][0] == 1 and got["cache clear"][0] == 1 and got["warm --arch"][0] == 2
    assert got["cache list"][0] == 1
    assert got["info"][0] == 0
    assert list(locked.iterdir()) == []
