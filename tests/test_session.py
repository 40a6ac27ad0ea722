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
