"""The test session cleans up after itself: the private kernel cache each session makes and the
temporary directories of passing tests are gone when it ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_test_session_leaves_no_temporary_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    probe = tmp_path / "test_probe.py"
    probe.write_text("def test_uses_tmp_path(tmp_path):\n    (tmp_path / 'f').write_text('x')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ROPE_RTC_CACHE_DIR", "ROPE_RTC_TEST_SHARD")}
    env.update(TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
                          "-c", str(ROOT / "pyproject.toml"), "--confcutdir", str(ROOT / "tests"),
                          "-p", "conftest", str(probe)],
                         cwd=ROOT / "tests", env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    left = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*"))
    assert not [p for p in left if "rope_rtc_test_cache_" in p], left
    assert not [p for p in left if p.endswith("test_uses_tmp_path0")], left


def _unsharded_env() -> dict[str, str]:
    """This process's environment without the suite's own switches: a probe session run from a
    shard of scripts/device_check.sh must not inherit that shard's selection."""
    return {k: v for k, v in os.environ.items()
            if k not in ("ROPE_RTC_CACHE_DIR", "ROPE_RTC_TEST_SHARD", "ROPE_RTC_STRESS")}


def _session(tmp_path, shard: str | None, *args: str, stress: bool = False) -> subprocess.CompletedProcess:
    """A ``--collect-only`` session of the probe modules under ``tmp_path`` with
    ROPE_RTC_TEST_SHARD=shard (and ROPE_RTC_STRESS=1 with ``stress``)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ROPE_RTC_CACHE_DIR", "ROPE_RTC_TEST_SHARD", "ROPE_RTC_STRESS")}
    env.update(PYTHONPATH=str(ROOT))
    if stress:
        env["ROPE_RTC_STRESS"] = "1"
    if shard is not None:
        env["ROPE_RTC_TEST_SHARD"] = shard
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                           "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), "--confcutdir",
                           str(ROOT / "tests"), "-p", "conftest", *args, str(tmp_path)],
                          cwd=ROOT / "tests", env=env, capture_output=True, text=True, timeout=120)


def _collect(tmp_path, shard: str | None, *args: str, stress: bool = False) -> tuple[int, list[str]]:
    """The tests a session of the probe modules under ``tmp_path`` keeps with ROPE_RTC_TEST_SHARD=shard
    (and ROPE_RTC_STRESS=1 with ``stress``)."""
    run = _session(tmp_path, shard, *args, stress=stress)
    return run.returncode, [line.split("::", 1)[1] for line in run.stdout.splitlines() if "::" in line]


def test_shards_split_the_suite_once_and_keep_small_modules_whole(tmp_path):
    """ROPE_RTC_TEST_SHARD=i/n (scripts/device_check.sh --shards n): every test in exactly one
    shard; a module of a few tests (one that may end by reading what its other tests recorded)
    in one shard; a long parametrised module spread over all of them."""
    (tmp_path / "test_small.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n\n\n"
                                            "def test_reads_the_others():\n    pass\n")
    (tmp_path / "test_big.py").write_text("import pytest\n\n\n@pytest.mark.parametrize('i', range(120))\n"
                                          "def test_p(i):\n    pass\n")
    rc, everything = _collect(tmp_path, None)
    assert rc == 0 and len(everything) == 123, everything
    shards = []
    for i in range(3):
        rc, kept = _collect(tmp_path, f"{i}/3")
        assert rc == 0, kept
        shards.append(kept)
    assert sorted(sum(shards, [])) == sorted(everything)  # each test once
    assert sum(1 for kept in shards if "test_a" in kept and "test_reads_the_others" in kept) == 1
    assert all(30 <= sum(1 for t in kept if t.startswith("test_p")) <= 45 for kept in shards), [len(s) for s in shards]
    for bad in ("3/3", "x", "1/0", "-1/2"):
        rc, _ = _collect(tmp_path, bad)
        assert rc == 4, bad  # pytest's usage error


def test_shards_split_what_a_filter_selected(tmp_path):
    """The split is made after ``-k``/``-m``/``--deselect`` have chosen: two small modules that
    a split of the whole collection would put in one shard go to one shard each, and no shard
    is left with nothing to run (pytest's exit code 5).

    ``-k`` also matches the directories above a test, and a temporary directory's random name
    (``tmp.ojRTNv5S1Q``) once matched ``s1``: the names matched here have underscores, which no
    random suffix of ``mktemp`` or pytest has."""
    (tmp_path / "test_big.py").write_text("import pytest\n\n\n@pytest.mark.parametrize('i', range(120))\n"
                                          "def test_p(i):\n    pass\n")
    for name, count in (("only_s1", 3), ("only_s2", 10), ("only_s3", 3)):
        (tmp_path / f"test_{name}.py").write_text("".join(f"def test_{name}_{j}():\n    pass\n\n\n" for j in range(count)))
    shards = []
    for i in range(2):
        rc, kept = _collect(tmp_path, f"{i}/2", "-k", "only_s1 or only_s3")
        assert rc == 0, (i, kept)
        shards.append(kept)
    assert sorted(sum(shards, [])) == sorted(f"test_{n}_{j}" for n in ("only_s1", "only_s3") for j in range(3))
    assert all(len(kept) == 3 for kept in shards), shards


def test_stress_tests_run_only_when_asked_for(tmp_path):
    """A test marked ``stress`` is deselected (not skipped: under ROPE_RTC_REQUIRE_GPU=1 a skipped
    GPU test fails) unless ROPE_RTC_STRESS=1; then shards split it with the rest."""
    (tmp_path / "test_mixed.py").write_text("import pytest\n\n\ndef test_plain():\n    pass\n\n\n"
                                            "@pytest.mark.stress\n@pytest.mark.parametrize('r', range(3))\n"
                                            "def test_loaded(r):\n    pass\n")
    rc, kept = _collect(tmp_path, None)
    assert rc == 0 and kept == ["test_plain"], kept
    rc, kept = _collect(tmp_path, None, "-m", "stress")
    assert rc == 5 and kept == [], kept  # pytest's "no tests collected"
    rc, kept = _collect(tmp_path, None, "-m", "stress", stress=True)
    assert rc == 0 and kept == [f"test_loaded[{r}]" for r in range(3)], kept
    rc, everything = _collect(tmp_path, None, stress=True)
    assert rc == 0 and len(everything) == 4, everything
    assert sorted(_collect(tmp_path, "0/2", stress=True)[1] + _collect(tmp_path, "1/2", stress=True)[1]) == \
        sorted(everything)


def test_gpu_tests_live_in_test_gpu_files_and_only_there(tmp_path):
    """The file name tells a CPU test from a GPU test: a test marked gpu, device or multigpu
    outside a ``test_gpu_*.py`` file, or an unmarked test in one, stops the collection with an
    error naming each such test, whatever ``-k`` selects."""
    (tmp_path / "test_cpu_side.py").write_text("import pytest\n\n\ndef test_plain():\n    pass\n\n\n"
                                               "@pytest.mark.device\ndef test_needs_torch():\n    pass\n")
    (tmp_path / "test_gpu_side.py").write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_kernel():\n    pass\n"
                                               "\n\ndef test_unmarked():\n    pass\n")
    run = _session(tmp_path, None, "-k", "plain")
    assert run.returncode == 4, run.stdout + run.stderr  # pytest's usage error
    assert "test_cpu_side.py::test_needs_torch: marked 'device' outside a test_gpu_*.py file" in run.stderr
    assert "test_gpu_side.py::test_unmarked: a test in a test_gpu_*.py file without a gpu" in run.stderr
    assert "test_plain" not in run.stderr and "test_kernel" not in run.stderr
    (tmp_path / "test_cpu_side.py").write_text("def test_plain():\n    pass\n")
    (tmp_path / "test_gpu_side.py").write_text("import pytest\n\npytestmark = pytest.mark.gpu\n\n\n"
                                               "def test_kernel():\n    pass\n\n\n"
                                               "@pytest.mark.multigpu\ndef test_two():\n    pass\n")
    rc, kept = _collect(tmp_path, None)
    assert rc == 0 and sorted(kept) == ["test_kernel", "test_plain", "test_two"], kept


def test_slow_tests_run_under_a_marker_expression_or_by_name(tmp_path):
    """A test marked ``slow`` is deselected by default (``python -m pytest -q`` stays quick); ``-m
    slow`` (CI's second command) runs only them, and naming one by its node id runs it."""
    (tmp_path / "test_mixed.py").write_text("import pytest\n\n\ndef test_quick():\n    pass\n\n\n"
                                            "@pytest.mark.slow\n@pytest.mark.parametrize('r', range(2))\n"
                                            "def test_long(r):\n    pass\n")
    rc, kept = _collect(tmp_path, None)
    assert rc == 0 and kept == ["test_quick"], kept
    rc, kept = _collect(tmp_path, None, "-m", "slow")
    assert rc == 0 and kept == ["test_long[0]", "test_long[1]"], kept
    rc, kept = _collect(tmp_path, None, "-m", "slow or not slow")
    assert rc == 0 and len(kept) == 3, kept
    probe = tmp_path / "test_mixed.py"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                          "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), "--confcutdir",
                          str(ROOT / "tests"), "-p", "conftest", f"{probe}::test_long[1]", f"{probe}::test_quick"],
                         cwd=ROOT / "tests", env={**_unsharded_env(), "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [line.split("::", 1)[1] for line in run.stdout.splitlines() if "::" in line] == ["test_long[1]", "test_quick"]
