"""JAX stays optional: ``import rope_rtc`` never imports it, and ``import rope_rtc.jax`` without JAX
says what to install. Needs no JAX (each check runs in a fresh interpreter, with JAX hidden where
the check is about its absence)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ``sys.modules["jax"] = None`` makes ``import jax`` raise ImportError, as it does where JAX is
# not installed, whether or not this environment has it.
WITHOUT_JAX = """
import json, sys
sys.modules["jax"] = None
try:
    import rope_rtc.jax
except ImportError as exc:
    print(json.dumps({"raised": True, "message": str(exc)}))
else:
    print(json.dumps({"raised": False, "message": ""}))
"""

NO_JAX_LOADED = """
import json, sys
import rope_rtc, rope_rtc.reference, rope_rtc.ops.rope, rope_rtc.ops.kv_cache
print(json.dumps(sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib")))))
"""


def _run(code: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_RTC_")}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_without_jax_the_import_error_names_the_extra():
    result = _run(WITHOUT_JAX)
    assert result["raised"]
    assert 'pip install "rope-rtc[jax]"' in result["message"]


def test_rope_rtc_and_its_ops_do_not_import_jax():
    assert _run(NO_JAX_LOADED) == []
