"""The ``rope-rtc`` command line. CPU only: devices are simulated where a test needs one."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_rtc.build import kernels as build, cache, registry, toolchain
from rope_rtc import cli
from rope_rtc.core import driver
from rope_rtc._version import __version__
from rope_rtc.build.cache import store as store_mod
from rope_rtc.errors import CompileError
from rope_rtc.warm import _Glob, select_specs
from cache_fixtures import isolated  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def two_devices(monkeypatch):
    """An H200 and a device newer than this NVRTC knows."""
    newest = max(toolchain.supported_archs())
    archs = {0: 90, 1: newest + 10}
    monkeypatch.setattr(driver, "available", lambda: True)
    monkeypatch.setattr(driver, "unavailable_reason", lambda: None)
    monkeypatch.setattr(driver, "device_count", lambda: 2)
    monkeypatch.setattr(driver, "device_name", lambda i: ["NVIDIA H200", "NVIDIA Future"][i])
    monkeypatch.setattr(driver, "device_arch", lambda i: archs[i])
    # A driver one minor release older than this NVRTC: it cannot JIT NVRTC's PTX.
    major, minor = toolchain.nvrtc_version()
    old = major * 1000 + minor * 10 - 10 if minor else (major - 1) * 1000 + 90
    monkeypatch.setattr(driver, "driver_version", lambda: old)
    archs["driver"] = old
    return archs


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def warm_small(root: Path, capsys, *extra: str) -> str:
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress",
                            "--kernels", "blog", "--kernels", "tail", "--tail-heads", "1", *extra)
    assert rc == 0, err
    return out


# -- info ---------------------------------------------------------------------------------------

def test_info_with_no_device(capsys, no_device, monkeypatch, tmp_path):
    monkeypatch.setenv("ROPE_RTC_LOG_COMPILES", "1")
    rc, out, err = run_main(capsys, "info")
    assert rc == 0, err
    lines = {line.split("  ", 1)[0]: line for line in out.splitlines()}
    # The reason follows a colon: its own parenthetical is not wrapped in another.
    assert "no GPU found: no CUDA driver found (libcuda.so.1: simulated)" in lines["devices"]
    assert __version__ in lines["rope_rtc"]
    major, minor = toolchain.nvrtc_version()
    assert f"{major}.{minor}" in lines["NVRTC"]
    assert "sm_90" in lines["NVRTC archs"] and "sm_80" in lines["NVRTC archs"]
    h = toolchain.cuda_headers()
    assert h.path in lines["CUDA headers"] and h.version_text in lines["CUDA headers"]
    assert lines["CUDA driver"].endswith("none")
    for name in ("Python", "cuda-bindings", "CuPy", "NumPy", "ml_dtypes"):
        assert name in lines
    assert str(cache.versioned_cache_dir(tmp_path / "default-cache")) in lines["cache"]
    assert "ROPE_RTC_LOG_COMPILES=1" in lines["switches"]
    assert f"ROPE_RTC_CACHE_DIR={tmp_path / 'default-cache'}" in lines["switches"]
    assert not (tmp_path / "default-cache").exists(), "info must not create the cache"


def test_info_lists_devices_and_how_each_is_served(capsys, two_devices):
    rc, out, _ = run_main(capsys, "info")
    assert rc == 0
    assert "NVIDIA H200, sm_90; builds sm_90 CUBIN" in out
    # The driver (13.0) cannot JIT PTX from a newer NVRTC: say so instead of failing later.
    assert f"NVIDIA Future, sm_{two_devices[1]}; cannot build" in out and "nvidia-cuda-nvrtc" in out
    old = two_devices["driver"]
    assert [line for line in out.splitlines() if line.startswith("CUDA driver")][0].endswith(
        f" {old // 1000}.{(old % 1000) // 10}")
    assert "no GPU found" not in out


def test_info_counts_entries_and_size(capsys, no_device, tmp_path):
    root = tmp_path / "c"
    warm_small(root, capsys)
    d = cache.versioned_cache_dir(root)
    total = sum(p.stat().st_size for p in d.glob("*.bin"))
    rc, out, _ = run_main(capsys, "info", "--cache-dir", str(root))
    assert rc == 0
    assert f"3 entries, {total / 1024:.1f} KiB" in out


def test_info_names_why_a_cache_under_a_file_can_never_be_created(capsys, no_device, tmp_path):
    """A cache root below a regular file is not "empty (not created yet)": it can never be created,
    and info says why, as for any directory it cannot open."""
    (tmp_path / "afile").write_text("")
    rc, out, _ = run_main(capsys, "info", "--cache-dir", str(tmp_path / "afile" / "cache"))
    assert rc == 0
    line = [x for x in out.splitlines() if x.startswith("cache entries")][0]
    assert "not created yet" not in line and "cannot open cache directory" in line and "Not a directory" in line
    rc, out, _ = run_main(capsys, "info", "--cache-dir", str(tmp_path / "new"))
    assert [x for x in out.splitlines() if x.startswith("cache entries")][0].endswith("empty (not created yet)")


def test_info_in_a_fresh_process_never_imports_cupy():
    code = ("import sys; from rope_rtc.cli import main; rc = main(['info']); "
            "print('CUPY-IMPORTED' if 'cupy' in sys.modules else 'CUPY-NOT-IMPORTED'); sys.exit(rc)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_RTC_")}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "CUPY-NOT-IMPORTED" in r.stdout
    assert "devices" in r.stdout or "device 0" in r.stdout


# -- warm ---------------------------------------------------------------------------------------

def test_warm_prints_a_summary_and_compiles_only_what_is_missing(capsys, tmp_path):
    root = tmp_path / "c"
    out = warm_small(root, capsys)
    assert "compiled 3, already cached 0, failed 0 in" in out
    assert str(cache.versioned_cache_dir(root)) in out
    out = warm_small(root, capsys, "--arch", "sm_80")
    assert "compiled 3, already cached 3, failed 0" in out


def test_warm_unknown_arch_is_a_clear_error(capsys, tmp_path):
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--arch", "sm_999", "--cache-dir", str(tmp_path))
    assert rc == 2
    assert "sm_999" in err and "nvidia-cuda-nvrtc" in err and "sm_90" in err
    assert not cache.versioned_cache_dir(tmp_path).exists(), "nothing is built when an arch is refused"


@pytest.mark.parametrize("arch, message", [("sm_70", "sm_80 or newer"), ("volta", "not an architecture")])
def test_warm_refuses_old_or_malformed_archs(capsys, tmp_path, arch, message):
    rc, _, err = run_main(capsys, "warm", "--arch", arch, "--cache-dir", str(tmp_path))
    assert rc == 2 and message in err


@pytest.mark.parametrize("bad", [["--tail-heads", "0"], ["--tail-heads", "a,b"], ["--jobs", "0"],
                                 ["--kernels", "no_such_kernel"]])
def test_warm_bad_options_exit_2(capsys, tmp_path, bad):
    rc, _, err = run_main(capsys, "warm", "--arch", "sm_90", "--cache-dir", str(tmp_path), *bad)
    assert rc == 2 and err


# Brackets are literal in --kernels (kernel names hold them); fnmatch writes a literal "[" as "[[]".
GLOB_ALPHABET = "ab[]=*?"


@settings(max_examples=400, deadline=None)
@given(pattern=st.text(GLOB_ALPHABET, max_size=10), name=st.text("ab[]=", max_size=12))
def test_kernel_globs_match_as_fnmatch_does_with_literal_brackets(pattern, name):
    assert _Glob(pattern).matches(name) == fnmatch.fnmatchcase(name, pattern.replace("[", "[[]"))


def test_kernel_globs_take_bracketed_kernel_names_literally():
    spec = registry.rope_spec("bfloat16", True, 8, 1)
    assert _Glob(spec.name).matches(spec.name)  # a name copied from `rope-rtc cache list` selects itself
    assert _Glob("rope[ROPE_DTYPE=2,ROPE_INTERLEAVED=1,*").matches(spec.name)
    assert not _Glob("rope[ROPE_DTYPE=1,*").matches(spec.name)
    assert _Glob("ro?e").matches(spec.family) and not _Glob("rope?").matches(spec.family)


def test_a_kernels_pattern_that_matches_nothing_is_refused_at_once(capsys, tmp_path):
    """Before: each star became a ".*" of one regular expression, which backtracked exponentially
    over every registered name on this pattern (about 34 s a name: the warm seemed to hang)."""
    pattern = "?*?*?*?*?*?*=]"
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=re.escape(f"no registered kernel matches [{pattern!r}]")):
        select_specs(registry.DEFAULT_TAIL_HEADS, [pattern])
    assert time.perf_counter() - t0 < 0.5
    rc, _, err = run_main(capsys, "warm", "--arch", "sm_90", "--cache-dir", str(tmp_path), "--kernels", pattern)
    assert rc == 2 and pattern in err


def test_a_long_kernels_pattern_is_shortened_in_the_error(capsys, tmp_path):
    """Before: the whole pattern was echoed (a 100 kB argument, a 100 kB error line)."""
    rc, _, err = run_main(capsys, "warm", "--arch", "sm_90", "--cache-dir", str(tmp_path), "--kernels", "x" * 100_000)
    assert rc == 2 and len(err) < 300 and "(100000 characters)" in err, err[:300]


def test_warm_compile_failure_exits_1_and_lists_it(capsys, tmp_path, monkeypatch):
    victim = registry.tail_spec(1, 128).name
    real = build.compile_source

    def failing(kernel, *args, **kwargs):
        if kernel == victim:
            raise CompileError(f"NVRTC failed to compile kernel {kernel}\n--- compile log ---\n"
                               "tail_rope.cu(12): error: simulated", kernel=kernel, options=[], log="")
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(build, "compile_source", failing)
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--cache-dir", str(tmp_path), "--no-progress",
                            "--kernels", "tail", "--tail-heads", "1")
    assert rc == 1
    assert "compiled 1, already cached 0, failed 1" in out
    assert f"{victim} for sm_90" in err and "tail_rope.cu(12): error: simulated" in err


def test_warm_without_arch_and_with_no_device_asks_for_arch(capsys, no_device, tmp_path):
    rc, out, err = run_main(capsys, "warm", "--cache-dir", str(tmp_path))
    assert rc == 2
    assert "no GPU found: no CUDA driver found (libcuda.so.1: simulated); say which" in err and "--arch sm_90" in err


def test_warm_without_arch_builds_for_the_devices_present(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(driver, "available", lambda: True)
    monkeypatch.setattr(driver, "device_count", lambda: 2)
    monkeypatch.setattr(driver, "device_arch", lambda i: 90)
    rc, out, err = run_main(capsys, "warm", "--cache-dir", str(tmp_path), "--no-progress", "--kernels", "blog")
    assert rc == 0, err
    assert "for sm_90 in" in out and "compiled 1, already cached 0, failed 0" in out


def test_warm_comma_separated_archs(capsys, tmp_path):
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_80,9.0", "--cache-dir", str(tmp_path), "--no-progress",
                            "--kernels", "blog")
    assert rc == 0, err
    assert "for sm_80, sm_90 in" in out and "compiled 2" in out


def test_warm_with_no_compile_checks_completeness(capsys, tmp_path, monkeypatch):
    root = tmp_path / "c"
    warm_small(root, capsys)
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    store_mod._stores.clear()
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--arch", "sm_80", "--cache-dir", str(root),
                            "--no-progress", "--kernels", "blog", "--kernels", "tail", "--tail-heads", "1")
    assert rc == 1
    assert "compiled 0, already cached 3, failed 3" in out and "3 of 6 kernels ready" in out
    assert err.splitlines() == [
        "3 kernels are not in the cache and ROPE_RTC_NO_COMPILE=1 forbids compiling them: unset it to compile "
        f"them (rope-rtc warm --arch sm_80 --tail-heads 1 --kernels blog --kernels tail --cache-dir {root})"]


def test_warm_into_a_disabled_disk_cache_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("ROPE_RTC_DISABLE_DISK_CACHE", "1")
    rc, _, err = run_main(capsys, "warm", "--arch", "sm_90", "--kernels", "blog")
    assert rc == 2 and "ROPE_RTC_DISABLE_DISK_CACHE" in err


def test_warm_cache_script_runs_from_any_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_RTC_") and k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "warm_cache.py"), "--arch", "sm_999",
                        "--cache-dir", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "sm_999" in r.stderr, r.stderr


# -- cache list / verify / clear --------------------------------------------------------------------

def test_cache_list_verify_clear(capsys, tmp_path):
    root = tmp_path / "c"
    d = cache.versioned_cache_dir(root)
    rc, out, _ = run_main(capsys, "cache", "list", "--cache-dir", str(root))
    assert rc == 0 and "0 entries" in out

    warm_small(root, capsys)
    (d / ".tmp-abandoned.part").write_bytes(b"half an entry")
    hours_ago = time.time() - 2 * 3600
    os.utime(d / ".tmp-abandoned.part", (hours_ago, hours_ago))  # from a process killed long ago
    rc, out, _ = run_main(capsys, "cache", "list", "--cache-dir", str(root))
    assert rc == 0
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and "temporary" not in line
            and line.split()[0] != "kernel"]
    assert sorted(r[0] for r in rows) == sorted(s.name for s in registry.all_specs((1,))
                                                 if s.family in ("blog", "tail"))
    assert all(r[1] == "sm_90" and r[2] == "cubin" and r[4] == "KiB" for r in rows)
    assert ".tmp-abandoned.part" in out and "interrupted write" in out
    assert "3 entries" in out and "1 temporary file;" in out

    rc, out, _ = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 0 and "all 3 entries" in out and "1 temporary file left" in out

    victim = sorted(d.glob("*.bin"))[0]
    victim.write_bytes(victim.read_bytes()[:-1])
    rc, out, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 1 and victim.name[:12] in err and "1 of 3 entries" in err
    rc, out, _ = run_main(capsys, "cache", "list", "--cache-dir", str(root))
    unusable = [line for line in out.splitlines() if "UNUSABLE" in line]
    assert len(unusable) == 1 and victim.name[:12] in unusable[0] and "truncated" in unusable[0], out

    rc, out, _ = run_main(capsys, "cache", "clear", "--cache-dir", str(root))
    assert rc == 0
    assert "removed 4 files" in out and "3 entries" in out and "1 temporary file)" in out
    assert list(d.iterdir()) == []
    rc, out, _ = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 0 and "all 0 entries" in out


def test_cache_verify_flags_an_entry_from_another_rope_rtc(capsys, tmp_path):
    from rope_rtc.build.cache import Entry, encode_entry

    root = tmp_path / "c"
    d = cache.versioned_cache_dir(root)
    d.mkdir(parents=True, mode=0o700)
    key = "f" * 64
    (d / f"{key}.bin").write_bytes(encode_entry(Entry(key, "blog", "sm_90", "cubin", "13.0", "0.0.1", b"x", 1.0)))
    rc, _, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 1 and "rope_rtc 0.0.1" in err


def test_cache_without_action_prints_help(capsys):
    rc, _, err = run_main(capsys, "cache")
    assert rc == 2 and "list" in err and "verify" in err and "clear" in err


# -- demo, bench, top level -----------------------------------------------------------------------

def test_demo_and_bench_dispatch(capsys, monkeypatch):
    seen = {}

    def demo_main(args):
        seen["demo"] = args  # returns None: success

    def bench_main(argv):
        seen["bench"] = argv
        return 3

    demo = types.ModuleType("rope_rtc.demo")
    demo.main = demo_main
    bench = types.ModuleType("rope_rtc.bench")
    bench.main = bench_main
    monkeypatch.setitem(sys.modules, "rope_rtc.demo", demo)
    monkeypatch.setitem(sys.modules, "rope_rtc.bench", bench)
    assert cli.main(["demo", "--cache-dir", "/x"]) == 0
    assert seen["demo"].cache_dir == "/x" and seen["demo"].command == "demo"
    assert cli.main(["bench", "--iters", "5", "--shape", "4,32,4096,128"]) == 3
    assert seen["bench"] == ["--iters", "5", "--shape", "4,32,4096,128"]


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_missing_demo_or_bench_module_says_so(capsys, monkeypatch, command):
    monkeypatch.setitem(sys.modules, f"rope_rtc.{command}", None)  # makes the import fail as if absent
    rc, _, err = run_main(capsys, command)
    assert rc == 2 and f"rope-rtc {command}" in err and "not available" in err


def test_version_and_help(capsys):
    rc, out, _ = run_main(capsys, "--version")
    assert rc == 0 and __version__ in out
    rc, _, err = run_main(capsys)
    assert rc == 2 and "warm" in err and "info" in err
    rc, _, err = run_main(capsys, "frobnicate")
    assert rc == 2 and "invalid choice" in err


# -- what a new user met ------------------------------------------------------------------------------

def test_cache_list_is_sorted_aligned_and_names_kernel_and_architecture(capsys, tmp_path):
    root = tmp_path / "c"
    warm_small(root, capsys, "--arch", "sm_80")
    rc, out, _ = run_main(capsys, "cache", "list", "--cache-dir", str(root))
    assert rc == 0
    header = out.splitlines()[1]
    assert header.split() == ["kernel", "arch", "kind", "size", "created", "key"], out
    rows = [line for line in out.splitlines()[2:] if line.startswith("  ")]
    assert len(rows) == 6
    names = [(r.split()[0], r.split()[1]) for r in rows]
    assert names == sorted(names), "rows are not sorted by kernel, then architecture"
    assert {a for _, a in names} == {"sm_80", "sm_90"}
    # Aligned: every column starts where its heading does.
    arch_at = header.index("arch")
    assert all(r[arch_at:arch_at + 3] == "sm_" for r in rows), rows
    key_at = header.index("key")
    d = cache.versioned_cache_dir(root)
    on_disk = {p.name[:12] for p in d.glob("*.bin")}
    assert {r[key_at:key_at + 12] for r in rows} == on_disk


def test_cache_verify_names_the_kernel_and_says_truncated(capsys, tmp_path):
    root = tmp_path / "c"
    warm_small(root, capsys)
    d = cache.versioned_cache_dir(root)
    by_kernel = {e.entry.kernel: e.path for e in cache.DiskStore(d, create=False).list()}
    blog, tail = by_kernel["blog"], by_kernel[registry.tail_spec(1, 128).name]
    blog.write_bytes(blog.read_bytes()[:-100])   # cut inside the payload
    tail.write_bytes(tail.read_bytes()[:12])      # cut inside the length field
    rc, _, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 1
    lines = [line for line in err.splitlines() if line.startswith("- ")]
    blog_line = [line for line in lines if blog.name[:12] in line][0]
    assert "blog" in blog_line and "sm_90" in blog_line and "truncated" in blog_line, blog_line
    tail_line = [line for line in lines if tail.name[:12] in line][0]
    assert "truncated" in tail_line and "magic" not in tail_line, tail_line


def test_a_cache_this_user_cannot_write_gets_advice_that_works(capsys, tmp_path, monkeypatch):
    # An image warmed by root, checked by another user: verify said a bad entry is "replaced when
    # next compiled" (the loader leaves it, and every process recompiles) and that warm rebuilds it;
    # warm itself said only "not writable; serving its entries read-only". Both now name the owner
    # and what to do. (As root, chmod cannot refuse writes: os.access and getuid say so instead.)
    root = tmp_path / "image"
    warm_small(root, capsys)
    d = cache.versioned_cache_dir(root)
    blog = next(e.path for e in cache.DiskStore(d, create=False).list() if e.entry.kernel == "blog")
    data = bytearray(blog.read_bytes())
    data[-1] ^= 0xFF
    blog.write_bytes(bytes(data))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == d else real_access(p, mode, **kw))
    owner = os.stat(d).st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    rc, out, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 1 and blog.name[:12] in err, out + err
    assert "replaced when next compiled" not in err and "rebuilds" not in err, err
    assert f"this user cannot replace it: cache directory {d} is not writable (it belongs to uid {owner}" in err, err
    assert f"warm or clear it as uid {owner}, or give --cache-dir a cache of your own" in err, err
    # Once the entry is sound, an old temporary file left there is not advised as removable either.
    blog.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 0xFF]))
    (d / ".tmp-abandoned.part").write_bytes(b"half an entry")
    rc, out, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 0 and "remove those older than an hour" not in out, out + err
    assert f"this user cannot remove it: cache directory {d} is not writable (it belongs to uid {owner}" in out, out
    assert f"warm or clear it as uid {owner}" in out, out
    # Entries this installation never loads: only clear removes entries, so only clear is named.
    from rope_rtc.build.cache import Entry, encode_entry

    major, minor = toolchain.nvrtc_version()
    (d / f"{'f' * 64}.bin").write_bytes(encode_entry(Entry("f" * 64, "blog", "sm_90", "cubin", f"{major}.{minor}",
                                                           __version__, b"\x7fELF old", 1.0)))
    for p in d.glob("*.bin"):
        if p.name != f"{'f' * 64}.bin":
            p.unlink()
    rc, out, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 0 and "never loaded" in out, out + err
    assert f"this user cannot remove it: cache directory {d} is not writable" in out.split("never loaded")[1], out
    assert f"clear it as uid {owner}" in out.split("never loaded")[1] and "warm or clear" not in out.split(
        "never loaded")[1], out
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--kernels", "blog", "--no-progress", "--cache-dir",
                            str(root))
    assert rc != 0 and "serving its entries read-only" not in out + err, out + err
    assert f"warm it as uid {owner}, or give --cache-dir a cache of your own" in out + err, out + err


def _planted_header(path: Path, **fields) -> None:
    """Rewrite the entry at ``path`` with header ``fields`` as given (no checks) and a checksum
    that matches: a file anyone who can write the directory could leave."""
    import json

    from rope_rtc.build.cache.entry import MAGIC, _digest, decode_entry

    e = decode_entry(path.read_bytes())
    f = dict(key=e.key, kernel=e.kernel, target=e.target, kind=e.kind, nvrtc=e.nvrtc, rope_rtc=e.rope_rtc,
             created=e.created, size=len(e.payload))
    f.update(fields)
    header = json.dumps(dict(f, sha256=_digest(f, e.payload)), sort_keys=True).encode()
    path.write_bytes(MAGIC + len(header).to_bytes(8, "little") + header + e.payload)


@pytest.mark.parametrize("created", [pytest.param(10**400, id="10**400"), 1e20])
def test_an_unbounded_timestamp_is_a_corrupt_entry_listed_verified_and_rebuilt(capsys, tmp_path, created):
    root = tmp_path / "c"
    warm_small(root, capsys)
    d = cache.versioned_cache_dir(root)
    blog = next(e.path for e in cache.DiskStore(d, create=False).list() if e.entry.kernel == "blog")
    _planted_header(blog, created=created)
    rc, out, err = run_main(capsys, "cache", "list", "--cache-dir", str(root))
    assert rc == 0, err
    line = next(line for line in out.splitlines() if blog.name[:12] in line)
    assert "UNUSABLE" in line and "created" in line and "blog" in line, line
    rc, out, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 1 and blog.name[:12] in err and "created" in err, out + err
    warm_small(root, capsys)  # a corrupt entry is rebuilt, like any other
    rc, out, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 0 and "all 3 entries" in out, out + err


def test_cache_list_and_verify_show_header_text_escaped_and_shortened(capsys, tmp_path):
    root = tmp_path / "c"
    warm_small(root, capsys)
    d = cache.versioned_cache_dir(root)
    listed = {e.entry.kernel: e.path for e in cache.DiskStore(d, create=False).list()}
    paths = sorted(listed.values())
    # A terminal's escape sequences (clear the screen, set the title, reverse the text) in a header
    # that checks out, in a torn one, and a kernel name of 10 000 characters.
    _planted_header(paths[0], kernel="blog\x1b[2J\x1b]0;owned\x07", target="sm_90\u202e")
    _planted_header(paths[1], kernel="tail\x1b[31m" + "x" * 10_000)
    data = bytearray(paths[1].read_bytes())
    data[-3] ^= 1
    paths[1].write_bytes(bytes(data))
    _planted_header(paths[2], nvrtc="9" * 5000)
    for command in ("list", "verify"):
        rc, out, err = run_main(capsys, "cache", command, "--cache-dir", str(root))
        text = out + err
        assert rc == (0 if command == "list" else 1), text
        assert not any(c in text for c in "\x1b\x07\u202e"), f"raw control characters reached the terminal: {text!r}"
        assert "blog\\x1b[2J\\x1b]0;owned\\x07" in text and "sm_90\\u202e" in text, text
        assert "tail\\x1b[31mxxx" in text and "(10009 characters)" in text, text
        assert max(len(line) for line in text.splitlines()) < 600, text


@pytest.mark.parametrize("where", ["typo", "root without this version", "a file"])
def test_cache_verify_of_a_missing_directory_fails_naming_it(capsys, tmp_path, where):
    root = tmp_path / "a" / "typo"
    if where != "typo":
        root.parent.mkdir()
        root.mkdir() if where == "root without this version" else root.write_text("not a cache")
    rc, out, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 1, out + err
    assert "verified" not in out and str(root) in err, out + err
    assert ("is a regular file, not a directory" if where == "a file" else "does not exist") in err, err
    assert "Traceback" not in err
    if where == "typo":
        assert not root.parent.exists()
        rc, out, err = run_main(capsys, "cache", "list", "--cache-dir", str(root))
        assert rc == 0 and "does not exist" in out and "0 entries" in out, out + err


def test_warm_check_of_a_corrupt_entry_says_what_happens_and_keeps_the_models_flags(capsys, tmp_path, monkeypatch):
    import json

    config = tmp_path / "my model" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 64, "torch_dtype": "bfloat16"}))
    root = tmp_path / "c"
    flags = ("--model", str(config), "--qk-norm", "--kernels", "rope_cache*")
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", *flags)
    assert rc == 0, err
    d = cache.versioned_cache_dir(root)
    victim = sorted(d.glob("*.bin"))[0]
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0x40
    victim.write_bytes(bytes(data))
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    store_mod._stores.clear()
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", *flags)
    assert rc == 1, out + err
    warning = next(line for line in err.splitlines() if "corrupt cache entry" in line)
    assert "left in place" in warning and "forbids recompiling it" in warning and "not cached" in warning, warning
    assert ", recompiling" not in warning and not warning.endswith("recompiling"), warning
    assert victim.exists()  # a check writes nothing
    assert (f"1 kernel is not in the cache and ROPE_RTC_NO_COMPILE=1 forbids compiling it: unset it to compile it "
            f"(rope-rtc warm --arch sm_90 --model '{config}' --qk-norm --kernels 'rope_cache*' --cache-dir {root})"
            ) in err, err


def test_warm_from_python_of_a_models_specs_suggests_the_model_placeholder(tmp_path, monkeypatch):
    from rope_rtc import warm as warming
    from rope_rtc.numerics.model import from_config

    model = from_config({}, dtype="bfloat16", head_dim=64, q_heads=4, kv_heads=2)
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    report = warming.warm(["sm_90"], cache_dir=tmp_path / "c", specs=model.specs(), kernels=["rope_cache*"],
                          progress=False)
    lines = report.failure_lines()
    assert len(lines) == 1 and "(rope-rtc warm --arch sm_90 --model <your config> --kernels 'rope_cache*' " \
        f"--cache-dir {tmp_path / 'c'})" in lines[0], lines


def test_warm_under_no_compile_prints_one_line_per_failure_class(capsys, tmp_path, monkeypatch):
    root = tmp_path / "c"
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress",
                            "--kernels", "blog", "--kernels", "tail", "--tail-heads", "1,2")
    assert rc == 1
    assert "warmed" not in out, out
    assert "0 of 5 kernels ready" in out and "failed 5" in out
    assert "WarmFailure" not in out + err
    assert err.count("\n") <= 3, err
    assert "5 kernels are not in the cache" in err and "ROPE_RTC_NO_COMPILE=1" in err, err


def test_demo_under_no_compile_prints_one_line_per_failure_class(capsys, tmp_path, monkeypatch, no_device):
    from rope_rtc import demo

    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    rc = demo.main(["--warm", "--cache-dir", str(tmp_path / "c")])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "WarmFailure" not in out + err and "FAILED: WarmFailure" not in out
    n = len(registry.all_specs())
    assert f"{n} kernels are not in the cache" in out + err, out + err
    assert "warmed" not in out


def test_warm_with_every_kernel_failed_does_not_say_warmed(capsys, tmp_path, monkeypatch):
    def failing(kernel, *args, **kwargs):
        raise CompileError(f"NVRTC failed to compile kernel {kernel}\n--- compile log ---\nsimulated",
                           kernel=kernel, options=[], log="")

    monkeypatch.setattr(build, "compile_source", failing)
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--cache-dir", str(tmp_path), "--no-progress",
                            "--kernels", "tail", "--tail-heads", "1")
    assert rc == 1 and "warmed" not in out and "0 of 2 kernels ready" in out, out
    assert "2 kernels failed to compile" in err and "simulated" in err, err


def test_warm_cache_script_help_shows_its_own_name():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_RTC_")}
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "warm_cache.py"), "--help"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    usage = r.stdout.splitlines()[0]
    assert usage.startswith("usage: warm_cache.py [") and "rope-rtc" not in usage, usage
    assert "--arch" in r.stdout


def test_cache_list_into_a_closed_pipe_exits_quietly(tmp_path, capsys):
    root = tmp_path / "c"
    warm_small(root, capsys)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_RTC_")}
    env["PYTHONPATH"] = str(REPO)
    # The child writes one byte, waits until the reader has gone (its stdin closes), then lists.
    code = ("import sys; from rope_rtc.cli import main; sys.stdout.write('x'); sys.stdout.flush(); "
            "sys.stdin.read(); sys.exit(main(sys.argv[1:]))")
    p = subprocess.Popen([sys.executable, "-c", code, "cache", "list", "--cache-dir", str(root)], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(1) == b"x"
    p.stdout.close()  # as `| head -1` does once it has its line
    p.stdin.close()
    err = p.stderr.read().decode()
    p.wait(timeout=60)
    p.stderr.close()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err == "", err


@pytest.mark.parametrize("variable,value,command", [
    *(("ROPE_RTC_CACHE_DIR", "relative/dir", c) for c in (["info"], ["cache", "list"], ["cache", "verify"],
                                                          ["cache", "clear"], ["warm", "--arch", "sm_90", "--kernels", "blog"])),
    # The cache commands manage the disk whatever this switch says; the others read it.
    *(("ROPE_RTC_DISABLE_DISK_CACHE", "maybe", c) for c in (["info"], ["warm", "--arch", "sm_90", "--kernels", "blog"])),
    # Switches the build reads for each kernel: warm reads them once, before the first compile.
    *((v, "yes please", ["warm", "--arch", "sm_90", "--kernels", "blog", "--no-progress"])
      for v in ("ROPE_RTC_NO_COMPILE", "ROPE_RTC_SAVE_SOURCE", "ROPE_RTC_LOG_COMPILES")),
])
def test_a_bad_switch_value_is_one_line_naming_the_variable(monkeypatch, capsys, no_device, variable, value, command):
    monkeypatch.setenv(variable, value)
    assert cli.main(command) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{variable}={value!r}" in err and len(err.strip().splitlines()) == 1, err


# -- verify knows every entry the library builds ------------------------------------------------------

# A model's specialised builds (QK-norm and KV-cache), as `warm --model` writes them; few, to stay quick.
MODEL_WARM = ("--dtype", "bfloat16", "--head-dim", "64", "--heads", "4", "--kv-heads", "2", "--qk-norm",
              "--kernels", "qk_norm_rope*", "--kernels", "rope_cache*")


def _rewrite_header(path: Path, **fields) -> None:
    """Rewrite an entry's header fields with a checksum that matches: only the loader's own
    comparison of header and key can tell."""
    from dataclasses import replace

    from rope_rtc.build.cache import decode_entry, encode_entry

    path.write_bytes(encode_entry(replace(decode_entry(path.read_bytes()), **fields)))


def test_cache_verify_checks_model_builds_as_current_and_finds_a_tampered_one(capsys, tmp_path):
    from cache_fixtures import fresh_store

    root = tmp_path / "c"
    d = cache.versioned_cache_dir(root)
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress", *MODEL_WARM)
    assert rc == 0, err
    # The benchmark's copy kernel is an entry the library writes too (rope-rtc bench).
    bench = registry.KernelSpec("bench_copy", "bench_copy.cu", ("bench_copy_16b", "bench_spin"))
    build.get_binary(bench, toolchain.Target(90), store=fresh_store(d), announce=False)
    listed = cache.DiskStore(d, create=False).list()
    families = {e.entry.kernel.split("[")[0] for e in listed}
    assert families == {"qk_norm_rope", "rope_cache", "bench_copy"}, families
    rc, out, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 0, err
    assert f"all {len(listed)} entries" in out
    assert "never loaded" not in out and "cache clear" not in out, out

    victim = next(e for e in listed if e.entry.kernel.startswith("qk_norm_rope"))
    _rewrite_header(victim.path, target="sm_80")
    rc, out, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 1, out
    line = next(line for line in err.splitlines() if victim.key[:12] in line)
    assert victim.entry.kernel in line and "sm_80" in line and "loader refuses" in line, line


@pytest.mark.parametrize("pdl, target", [(False, None), (True, None), (False, "sm_80")])
def test_cache_verify_refuses_an_entry_whose_header_names_another_kernel(capsys, tmp_path, pdl, target):
    # The loader refuses it (build._expected compares the kernel too); verify called it stale,
    # "never loaded", and passed, because it looked the key up by the header's own kernel name.
    root = tmp_path / "c"
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress",
                            "--kernels", "rope[*", *(["--pdl"] if pdl else []))
    assert rc == 0, err
    listed = cache.DiskStore(cache.versioned_cache_dir(root), create=False).list()
    waits = [e for e in listed if "ROPE_PDL=1" in e.entry.kernel]
    assert bool(waits) == pdl
    victim = (waits or listed)[0]
    _rewrite_header(victim.path, kernel="tail_rope[TAIL_HEADS=32]", **({"target": target} if target else {}))
    rc, out, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 1, out
    line = next(line for line in err.splitlines() if victim.key[:12] in line)
    assert victim.entry.kernel in line and f"tail_rope[TAIL_HEADS=32] for {target or 'sm_90'}" in line, line
    assert "loader refuses" in line, line


def test_cache_verify_never_advises_clearing_entries_in_use(capsys, tmp_path):
    from rope_rtc.build.cache import Entry, encode_entry

    root = tmp_path / "c"
    warm_small(root, capsys)
    d = cache.versioned_cache_dir(root)
    major, minor = toolchain.nvrtc_version()
    # A blog entry whose key this installation never computes (built from other sources).
    stale = d / f"{'f' * 64}.bin"
    stale.write_bytes(encode_entry(Entry("f" * 64, "blog", "sm_90", "cubin", f"{major}.{minor}", __version__,
                                         b"\x7fELF old", 1.0)))
    rc, out, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 0, err
    assert "all 4 entries" in out and "1 of them is never loaded" in out and "it only takes disk space" in out, out
    assert "cache clear" not in out, out  # it would remove the 3 entries in use as well
    for p in d.glob("*.bin"):
        if p != stale:
            p.unlink()
    rc, out, err = run_main(capsys, "cache", "verify", "--cache-dir", str(root))
    assert rc == 0 and "the 1 entry in" in out and "1 of them is never loaded" in out, out
    assert "`rope-rtc cache clear` removes it" in out, out


# -- warm under ROPE_RTC_NO_COMPILE checks, and writes nothing ------------------------------------------

def test_warm_under_no_compile_checks_a_read_only_cache_and_writes_nothing(capsys, tmp_path, monkeypatch):
    from cache_fixtures import tree_snapshot

    root = tmp_path / "image"
    warm_small(root, capsys)
    d = cache.versioned_cache_dir(root)
    old = d / ".tmp-abandoned.part"
    old.write_bytes(b"half an entry")
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    # A read-only image (as root, chmod cannot refuse writes: os.access says so instead).
    real_access = os.access
    monkeypatch.setattr(store_mod.os, "access",
                        lambda p, mode, **kw: False if Path(p) == d else real_access(p, mode, **kw))
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    before = tree_snapshot(tmp_path)
    args = ("--cache-dir", str(root), "--no-progress", "--kernels", "blog", "--kernels", "tail", "--tail-heads", "1")
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", *args)
    assert rc == 0, err
    assert "all 3 kernels present for sm_90" in out and "compiled 0, already cached 3, failed 0" in out, out
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--arch", "sm_80", *args)
    assert rc == 1, out
    assert "3 of 6 kernels ready" in out, out
    missing = [line for line in out.splitlines() if line.startswith("missing: ")]
    assert sorted(missing) == sorted(f"missing: {s.name} for sm_80" for s in registry.all_specs((1,))
                                     if s.family in ("blog", "tail")), out
    assert "3 kernels are not in the cache" in err, err
    assert tree_snapshot(tmp_path) == before, "a no-compile warm wrote, removed or created a file"


def test_warm_under_no_compile_of_a_missing_cache_creates_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    root = tmp_path / "nowhere"
    rc, out, err = run_main(capsys, "warm", "--arch", "sm_90", "--cache-dir", str(root), "--no-progress",
                            "--kernels", "blog")
    assert rc == 1 and "0 of 1 kernel" in out and "does not exist" in out, out
    assert not root.exists()


# -- --cache-dir follows ROPE_RTC_CACHE_DIR's rule -----------------------------------------------------

@pytest.mark.parametrize("command", [["info"], ["cache", "list"], ["cache", "verify"], ["cache", "clear"],
                                     ["warm", "--arch", "sm_90", "--kernels", "blog", "--no-progress"], ["demo"]])
def test_a_relative_cache_dir_option_is_refused_as_the_variable_is(capsys, monkeypatch, tmp_path, no_device, command):
    demo = types.ModuleType("rope_rtc.demo")
    demo.main = lambda args: 0
    monkeypatch.setitem(sys.modules, "rope_rtc.demo", demo)
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_main(capsys, *command, "--cache-dir", "relative/dir")
    assert rc == 2, out + err
    assert "--cache-dir" in err and "'relative/dir' is a relative path" in err and "absolute path" in err, err
    assert not (tmp_path / "relative").exists()
    # The same rule, in the same words, as the variable's.
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", "relative/dir")
    from rope_rtc.errors import SettingError
    from rope_rtc.env import settings

    with pytest.raises(SettingError, match="'relative/dir' is a relative path; .*absolute path"):
        settings().cache_dir


# -- demo --arch --------------------------------------------------------------------------------------

def test_demo_passes_arch_and_warm_to_the_demo(capsys, monkeypatch):
    seen = []
    demo = types.ModuleType("rope_rtc.demo")
    demo.main = lambda args: seen.append(args) and None
    monkeypatch.setitem(sys.modules, "rope_rtc.demo", demo)
    assert cli.main(["demo", "--arch", "sm_80", "--warm"]) == 0
    assert seen[-1].arch == "sm_80" and seen[-1].warm is True
    assert cli.main(["demo", "--no-warm"]) == 0 and seen[-1].warm is False
    assert cli.main(["demo"]) == 0 and seen[-1].warm is False, "the demo warms only when asked"
    rc, _, err = run_main(capsys, "demo", "--arch", "volta")
    assert rc == 2 and "--arch" in err and "not an architecture" in err, err
    # An architecture older than the library builds is a usage error too, as for warm (the demo
    # took it, ran its examples, and then failed to warm it or advised compiling for it).
    n = len(seen)
    rc, _, err = run_main(capsys, "demo", "--arch", "sm_50", "--warm")
    assert rc == 2 and "--arch" in err and "'sm_50': rope_rtc needs sm_80 or newer" in err, err
    assert len(seen) == n, "the demo does not run"


def test_demo_without_a_gpu_warms_the_arch_given(capsys, tmp_path, monkeypatch, no_device):
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")  # the check is enough: which arch it looked for
    rc, out, err = run_main(capsys, "demo", "--warm", "--arch", "sm_80", "--cache-dir", str(tmp_path / "c"))
    assert rc == 1, out + err
    assert "warming the kernel cache for sm_80" in out and "--arch sm_80" in out, out
    assert "sm_90" not in out, out
