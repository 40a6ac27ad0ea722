"""The benchmark's JAX records (rope_rtc/benchmark/engine_jax.py), on the CPU: the child process's
records read back, its failure recorded in their place, and the targets they are judged by."""

from __future__ import annotations

import json
import subprocess
import types

import pytest

from rope_rtc.benchmark import cases as bcases
from rope_rtc.benchmark import engine, engine_jax, report
from test_bench import synthetic_result

PREFILL_ID, DECODE_ID = "engine/jax-prefill/bf16/bshd/S=4096", "engine/jax-decode/bf16/bshd/B=8"


def _row(impl, us, regime, check="-"):
    return {"impl": impl, "layout": "bshd", "check": check, "note": "", "timings": {regime: {"us": us}}}


def _records(ours_prefill=100.0, ours_decode=1.3, check="bit-exact (= the CuPy API)"):
    return [{"id": PREFILL_ID, "group": "engine", "params": {}, "bytes_moved": 540_000_000, "rows": [
                _row(bcases.COPY, 98.0, "cold"), _row(bcases.JAX_OURS, ours_prefill, "cold", check),
                _row(bcases.JAX_XLA, 101.0, "cold")]},
            {"id": DECODE_ID, "group": "engine", "params": {}, "bytes_moved": 330_000, "rows": [
                _row(bcases.COPY, 1.2, "graph_cold"), _row(bcases.JAX_OURS, ours_decode, "graph_cold", check),
                _row(bcases.JAX_XLA, 1.65, "graph_cold")]}]


def _fake_child(monkeypatch, returncode=0, records=None, stderr=""):
    calls = []

    def run(cmd, env, capture_output, text, timeout):
        calls.append(cmd)
        if records is not None:
            with open(cmd[3], "w") as f:
                json.dump(records, f)
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr(engine_jax.subprocess, "run", run)
    return calls


@pytest.mark.parametrize("quick", [False, True])
def test_the_childs_records_are_read_back(monkeypatch, quick):
    recs = _records()
    calls = _fake_child(monkeypatch, records=recs)
    got = engine_jax.jax_records(types.SimpleNamespace(seed=3, quick=quick), None, None)
    assert got == recs
    assert calls[0][1:3] == ["-m", "rope_rtc.benchmark.engine_jax"] and calls[0][4:6] == ["--seed", "3"]
    assert ("--quick" in calls[0]) is quick


def test_a_failing_child_raises_with_its_exit_and_its_words(monkeypatch):
    _fake_child(monkeypatch, returncode=1, stderr="Traceback ...\nRuntimeError: Unknown backend cuda")
    with pytest.raises(RuntimeError, match="exit 1: .*Unknown backend cuda"):
        engine_jax.jax_records(types.SimpleNamespace(seed=0), None, None)


def test_the_engine_section_keeps_every_record_of_the_jax_job_or_its_failure(monkeypatch):
    ctx = types.SimpleNamespace(seed=0, quick=True, free=lambda: None, stream=None)
    monkeypatch.setattr(engine, "jax_records", lambda ctx, measure, copy_runner: _records())
    assert [r["id"] for r in engine.run_engine_section(ctx, None, None, ["engine/jax"])] == [PREFILL_ID, DECODE_ID]

    def fails(ctx, measure, copy_runner):
        raise RuntimeError("exit 1: no JAX")

    monkeypatch.setattr(engine, "jax_records", fails)
    recs = engine.run_engine_section(ctx, None, None, ["engine/jax"])
    # one failure record per kind of record the job writes, so that the targets judging each see it
    assert [r["id"] for r in recs] == ["engine/jax-prefill", "engine/jax-decode"]
    assert all("no JAX" in r["error"] and r["rows"] == [] for r in recs)


def test_the_jax_targets():
    names = ("rope_rtc.jax prefill >= 95% of copy", "rope_rtc.jax decode GPU time <= XLA's fusion of the jnp RoPE "
                                                    "(within 1%)")

    def targets(**kw):
        res = synthetic_result(True)
        res["engine"] = _records(**kw)
        return res, {x["target"]: x for x in report.evaluate_targets(res)}

    res, t = targets()  # 98% of the copy; 0.79x XLA's time
    assert [t[n]["status"] for n in names] == ["PASS", "PASS"]
    md = report.render_markdown(res)
    assert "jax-prefill/bf16/bshd/S=4096" in md and bcases.JAX_XLA in md
    _, t = targets(ours_prefill=110.0, ours_decode=1.7)  # 89% and 1.03x
    assert [t[n]["status"] for n in names] == ["MISS", "MISS"]
    assert t[names[0]]["where"] == PREFILL_ID and t[names[1]]["where"] == DECODE_ID
    _, t = targets(check="WRONG: differs from the CuPy API")  # a wrong output misses however fast
    assert [t[n]["status"] for n in names] == ["MISS", "MISS"]
