"""The benchmark's targets never pass by what a run failed to measure: our rows that failed their
output check, selected cases with no record, engine jobs that raised, a figure of one regime set
against another's, and the hot regime of the peer target. CPU only, on synthetic results."""

from __future__ import annotations

import types

import pytest

from rope_rtc.benchmark import arguments, engine, figures, report, runner
from rope_rtc.benchmark import cases as bcases
from test_bench import _timings, synthetic_result

PEER = "never slower than the fastest peer on its inputs (within 1%)"
PREFILL = "prefill >= 97% of copy, 32 MiB+ moved"
DECODE_RATIO = "decode GPU time under graph replay <= 1.1x the copy node"
DECODE_US = "decode GPU time under graph replay <= 1.4 µs"
TAIL = "tail >= 97% of copy, cold L2, every shape measured cold"
MROPE_DECODE = "MRoPE decode <= plain RoPE + 0.1 µs"


def _targets(res: dict) -> dict:
    return {x["target"]: x for x in report.evaluate_targets(res)}


def _case(res: dict, ident: str) -> dict:
    return next(c for c in res["cases"] if c["id"] == ident)


def _wrong(case: dict, *impls: str) -> None:
    """As runner.run_impl records an implementation whose output failed its check: no timings."""
    by = figures.rows_by_impl(case)
    for impl in impls:
        by[impl]["check"] = "WRONG: 12 of 4096 values differ"
        by[impl]["timings"] = {}


@pytest.mark.parametrize("case_id, impls, target", [
    ("general/bf16/half/bshd/S=16384", (bcases.OURS,), PREFILL),
    ("decode/bf16/T=64", (bcases.OURS, bcases.STEP_TABLES), DECODE_RATIO),
    ("decode/bf16/T=64", (bcases.OURS, bcases.STEP_TABLES), DECODE_US),
    ("decode/bf16/T=64", (bcases.OURS, bcases.STEP_TABLES), PEER),
    ("tail/T=16384/H=64/D=512", (bcases.OURS,), TAIL),
])
def test_our_row_failing_its_check_misses_the_core_targets(case_id, impls, target):
    res = synthetic_result(False)
    assert _targets(res)[target]["status"] == "PASS"
    _wrong(_case(res, case_id), *impls)
    t = _targets(res)[target]
    assert t["status"] == "MISS" and t["where"].startswith(case_id) and "WRONG" in t["where"], t


def test_our_row_without_a_figure_misses():
    # Timing failed after the check passed (runner.run_impl: "timing failed" in the note).
    res = synthetic_result(False)
    figures.rows_by_impl(_case(res, "decode/bf16/T=4"))[bcases.OURS]["timings"] = {}
    t = _targets(res)
    for name in (DECODE_US, DECODE_RATIO):
        assert t[name]["status"] == "MISS" and t[name]["where"] == "decode/bf16/T=4 (not measured)", t[name]


@pytest.mark.parametrize("target, drop", [
    (PREFILL, "general/bf16/half/bshd/S=16384"),
    (DECODE_RATIO, "decode/fp16/T=64"),
    (DECODE_US, "decode/fp16/T=64"),
    (TAIL, "tail/T=16384/H=64/D=512"),
])
def test_a_selected_case_the_run_could_not_measure_is_a_miss(target, drop):
    res = synthetic_result(False)
    case = next(c for c in bcases.all_cases(False) if c.id == drop)
    res["cases"] = [c for c in res["cases"] if c["id"] != drop]
    res["unmeasured"] = []
    runner._record_unmeasured(res, case, 50 * bcases.MiB, "CUDARuntimeError: cudaErrorIllegalAddress",
                              f"case {drop} failed: ")
    assert res["skips"][-1] == f"case {drop} failed: CUDARuntimeError: cudaErrorIllegalAddress"
    t = _targets(res)[target]
    assert t["status"] == "MISS" and t["where"].startswith(drop) and "cudaErrorIllegalAddress" in t["where"], t


def test_a_merged_record_of_an_unmeasured_case_clears_it():
    base = synthetic_result(False)
    drop = "decode/fp16/T=64"
    later = {"cases": [_case(base, drop)], "created": "later", "command": "bench --cases decode", "env": {}}
    base["cases"] = [c for c in base["cases"] if c["id"] != drop]
    base["unmeasured"] = [{"id": drop, "group": "decode", "bytes_moved": 1, "cold_exact": True, "why": "budget"}]
    assert _targets(base)[DECODE_RATIO]["status"] == "MISS"
    merged = report.merge_results(base, later)
    assert merged["unmeasured"] == [] and _targets(merged)[DECODE_RATIO]["status"] == "PASS"
    # a later run that could not measure a case leaves the earlier run's record of it standing
    first = synthetic_result(False)
    failed = {"cases": [], "unmeasured": base["unmeasured"], "created": "later", "command": "-", "env": {}}
    merged = report.merge_results(first, failed)
    assert merged["unmeasured"] == [] and _targets(merged)[DECODE_RATIO]["status"] == "PASS"
    # and a case neither run measured stays a miss
    merged = report.merge_results(base, failed)
    assert [u["id"] for u in merged["unmeasured"]] == [drop]


def test_the_peer_target_judges_the_hot_regime_of_large_cases():
    # Issue #44: "not behind any peer by more than 1% on any row, cold or hot".
    res = synthetic_result(False)
    case = _case(res, "general/bf16/half/bshd/S=512")
    assert not case["small"]
    by = figures.rows_by_impl(case)
    by["liger"]["timings"]["hot"]["us"] = figures.timing(by[bcases.OURS], "hot") / 1.05
    t = _targets(res)[PEER]
    assert t["status"] == "MISS" and t["where"] == f"{case['id']} (hot) vs liger", t


def test_a_failed_graph_capture_is_not_replaced_by_the_event_loop():
    # The copy's cold graph failed: our graph replay set against the copy's event loop read 240%.
    res = synthetic_result(False)
    case = _case(res, "tail/T=4096/H=1/D=128")
    by = figures.rows_by_impl(case)
    by[bcases.COPY]["timings"] = {"hot": {"us": 3.0}, "cold": {"us": 3.0}, "graph": {"us": 1.0},
                                  "graph_cold": {"error": "CUDARuntimeError: capture invalidated"}}
    by[bcases.OURS]["timings"] = {"hot": {"us": 3.1}, "cold": {"us": 3.1}, "graph": {"us": 1.25},
                                  "graph_cold": {"us": 1.25}}
    assert figures.timing(by[bcases.COPY], "cold*") is None
    assert figures.pct_of_copy(case, by[bcases.OURS], "cold*") is None
    t = _targets(res)[TAIL]
    assert t["status"] == "MISS" and t["where"] == "tail/T=4096/H=1/D=128 (not measured)", t
    # A peer whose cold graph failed is left out of the peer target, not timed by its loop
    res = synthetic_result(False)
    dec = _case(res, "decode/bf16/T=1")
    liger = figures.rows_by_impl(dec)["liger"]
    liger["timings"]["graph_cold"] = {"error": "capture failed"}
    liger["timings"]["cold"] = {"us": 0.01}  # a launch-rate loop far below any GPU time
    assert _targets(res)[PEER]["status"] == "PASS"


def _fake_mrope(ctx, measure, copy_runner, T, interleaved):
    """The MRoPE job: the interleaved decode raises, the others record plausible rows."""
    small = T <= 64
    if small and interleaved:
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")

    def row(impl, us, graph):
        return {"impl": impl, "layout": "-", "note": "", "timings": _timings(us, small=small, graph=graph),
                "check": "ok (bound of the general API)" if impl == bcases.MROPE_OP else "-"}

    return {"id": engine.mrope_ident(T, interleaved), "group": "engine", "params": {},
            "bytes_moved": 10**5 if small else 10**9,
            "rows": [row(bcases.COPY, 4.0 if small else 100.0, 1.0), row(bcases.MROPE_OP, 5.0 if small else 103.0, 1.62),
                     row(bcases.MROPE_PLAIN, 5.0 if small else 103.0, 1.60)]}


def test_an_engine_job_that_raised_misses_the_targets_of_its_record(monkeypatch):
    # The interleaved decode's failure left the contiguous record to pass the target alone.
    monkeypatch.setattr(engine, "_mrope_record", _fake_mrope)
    ctx = types.SimpleNamespace(quick=True, free=lambda: None, stream=types.SimpleNamespace(synchronize=lambda: None))
    res = synthetic_result(True)
    res["engine"] = engine.run_engine_section(ctx, None, None, ["engine/mrope"])
    failed = [r for r in res["engine"] if r.get("error")]
    assert [r["id"] for r in failed] == ["engine/mrope-decode/interleaved/bf16/thd/T=8"]
    t = _targets(res)
    assert t[MROPE_DECODE]["status"] == "MISS" and t[MROPE_DECODE]["where"].startswith(failed[0]["id"]), t[MROPE_DECODE]
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in t[MROPE_DECODE]["where"]
    assert t["MRoPE prefill >= 95% of copy"]["status"] == "PASS"


def test_every_engine_job_is_named_by_its_records_id():
    # A job's name is what --cases matches and what its error record is called.
    for name, fn, args in engine.engine_jobs(False):
        ident = {"_kv_record": lambda: engine.kv_ident(*args), "_onnx_record": lambda: engine.ONNX_IDENT,
                 "_mrope_record": lambda: engine.mrope_ident(*args),
                 "_vision_record": lambda: engine.vision_ident(engine.VISION_GRID[1] * engine.VISION_GRID[2]),
                 "_qk_norm_record": lambda: engine.qk_norm_ident(*args),
                 "_angles_record": lambda: engine.angles_ident(*args), "_mla_record": lambda: engine.mla_ident(*args),
                 "jax_records": lambda: "engine/jax"}[fn]()
        assert f"engine/{name}" == ident


@pytest.mark.parametrize("spec, chosen", [
    ("engine/*", None),
    ("engine/mrope*", {"_mrope_record"}),
    ("engine/mrope-decode", {"_mrope_record"}),  # the prefix the Targets table's "where" shows
    ("engine/angles-decode/bf16/thd/T=8", {"_angles_record"}),
    ("engine/*/T=8", {"_kv_record", "_mrope_record", "_qk_norm_record", "_angles_record"}),
])
def test_cases_globs_and_record_ids_select_engine_jobs(spec, chosen):
    tokens = arguments.parse_args(["--cases", spec]).case_tokens
    jobs = engine.engine_jobs(False)
    got = [fn for name, fn, _ in jobs if engine.engine_job_selected(name, tokens)]
    if chosen is None:
        assert len(got) == len(jobs)
    else:
        assert got and set(got) == chosen, got


def _unmeasured(res: dict, ident: str, why: str = "RuntimeError: boom") -> None:
    """As the runner records a selected case it could not measure."""
    case = next(c for q in (False, True) for c in bcases.all_cases(q) if c.id == ident)
    res["cases"] = [c for c in res["cases"] if c["id"] != ident]
    res.setdefault("unmeasured", [])
    runner._record_unmeasured(res, case, 50 * bcases.MiB, why, f"case {ident} failed: ")


@pytest.mark.parametrize("drop, target", [
    ("tail/T=1/H=64/D=512", "tail T=1,4 H=64 D=512 GPU time under graph replay <= 1.6 µs"),
    ("tail/T=4/H=64/D=512", "TailRoPEForward.execute host time <= 5.0 µs"),
    ("blog/S=16", "blog's configuration: time <= 1.01x the blog's fused kernel"),
    ("blog/S=1", PEER),
    ("decode/bf16/T=1", "RopePlan.execute host time <= 5.0 µs"),
    ("general/bf16/half/bshd/S=16384", "one-call prefill within 1 point of the plan"),
])
def test_every_target_judging_a_case_misses_when_it_went_unmeasured(drop, target):
    res = synthetic_result(False)
    assert _targets(res)[target]["status"] == "PASS"
    _unmeasured(res, drop)
    t = _targets(res)[target]
    assert t["status"] == "MISS" and t["where"].startswith(drop), t


def test_a_run_killed_part_way_misses_the_cases_it_never_reached():
    # The runner writes its JSON after every case; the selected cases not reached yet are in
    # result["unmeasured"] from the start, so a partial JSON does not pass on the cases it has.
    res = synthetic_result(False)
    res["unmeasured"] = [runner._unmeasured_entry(c, 50 * bcases.MiB, runner.NOT_REACHED)
                         for c in bcases.all_cases(False) if c.id.startswith("tail/T=16384")]
    res["cases"] = [c for c in res["cases"] if not c["id"].startswith("tail/T=16384")]
    t = _targets(res)[TAIL]
    assert t["status"] == "MISS" and "not reached" in t["where"], t


def test_a_failed_host_section_misses_the_host_targets():
    res = synthetic_result(False)
    res["unmeasured"] = [{"id": "host", "group": "host", "why": "host section failed: RuntimeError: boom"}]
    t = _targets(res)
    for name in ("RopePlan.execute host time <= 5.0 µs", "TailRoPEForward.execute host time <= 5.0 µs",
                 "one-call host time in place, new arrays <= 5.0 µs"):
        assert t[name]["status"] == "MISS" and t[name]["where"].startswith("host ("), t[name]


def test_an_engine_row_of_ours_without_a_figure_misses():
    # Our MRoPE row's graph capture failed: the record sitting at the bound dropped out and the
    # target passed on the other one.
    monkey = synthetic_result(True)
    recs = [_fake_mrope(None, None, None, T, inter) for inter in (False, True) for T in (8, 16384) if (T, inter) != (8, True)]
    inter = _fake_mrope(None, None, None, 8, False)
    inter["id"] = engine.mrope_ident(8, True)
    figures.rows_by_impl(inter)[bcases.MROPE_OP]["timings"]["graph"] = {"error": "capture failed"}
    monkey["engine"] = recs + [inter]
    t = _targets(monkey)[MROPE_DECODE]
    assert t["status"] == "MISS" and t["where"] == f"{inter['id']} (not measured)", t


def test_a_failed_jax_job_misses_both_jax_targets(monkeypatch):
    def boom(*args):
        raise RuntimeError("exit 1: no CUDA plugin")

    monkeypatch.setattr(engine, "jax_records", boom)
    ctx = types.SimpleNamespace(quick=True, free=lambda: None, stream=types.SimpleNamespace(synchronize=lambda: None))
    res = synthetic_result(True)
    res["engine"] = engine.run_engine_section(ctx, None, None, ["engine/jax"])
    t = _targets(res)
    for name in ("rope_rtc.jax prefill >= 95% of copy",
                 "rope_rtc.jax decode GPU time <= XLA's fusion of the jnp RoPE (within 1%)"):
        assert t[name]["status"] == "MISS" and "no CUDA plugin" in t[name]["where"], t[name]


@pytest.mark.parametrize("spec", ["engine/jax", "engine/jax-*", "engine/jax-decode",
                                  "engine/jax-prefill/bf16/bshd/S=4096"])
def test_the_jax_job_is_chosen_by_its_records_ids(spec):
    tokens = arguments.parse_args(["--cases", spec]).case_tokens
    got = [fn for name, fn, _ in engine.engine_jobs(False) if engine.engine_job_selected(name, tokens)]
    assert got == ["jax_records"], got


def test_a_gap_of_zero_points_passes():
    # A floor's miss was 0.0, which is also a real gap of the angle target (bound -1 point).
    pts = []
    report._worst(lambda *a: pts.append(a), "gap", [(0.0, "engine/angles-prefill")], -1.0, " points", floor=True)
    assert pts[0][1] == "PASS", pts


def test_the_regenerate_command_reparses_to_the_same_options():
    argv = ["--seed", "1000000", "--time-budget", "1234567.5", "--compile-budget", "0.25"]
    cmd = arguments.regenerate_command(arguments.parse_args(argv))
    again = arguments.parse_args(cmd.split()[3:-1])
    assert (again.seed, again.time_budget, again.compile_budget) == (1000000, 1234567.5, 0.25), cmd


def test_tables_mark_a_row_timed_by_its_loop_and_pick_peers_timed_as_the_copy():
    res = synthetic_result(False)
    case = _case(res, "blog/S=1")
    by = figures.rows_by_impl(case)
    del by["cupy"]["timings"]["graph_cold"]  # no capture: its cold figure is its event loop
    row = next(r for r in report.blog_table(res) if r[0] == "1")
    assert row[report.blog_table(res)[0].index("cupy")].endswith(" (loop)")
    by["cupy"]["timings"]["cold"]["us"] = 1e-3  # a loop far below any graph time
    assert figures.fastest_peer(case, "cold*")[0] != "cupy"


def _host_rows(res: dict) -> dict:
    """The one-call host record of a synthetic result, its rows by name (added to it)."""
    names = [f"apply_rope_qk ({bcases.ONE_CALL_POOL} array sets cycled, in place, offset array)",
             f"apply_rope_qk, engines' convention (flat q/k, cos_sin_cache, positions; {bcases.ONE_CALL_POOL} array "
             "sets cycled, in place)",
             f"apply_rope ({bcases.ONE_CALL_POOL} array sets cycled, allocates the output, offset=7)",
             "RopePlan.execute (same arrays)"]
    rows = [{"impl": n, "layout": "thd", "check": "-", "timings": {"host": {"us": 4.0}}} for n in names]
    res["host"].append({"id": "host/one-call-decode-bf16-B=8", "group": "host", "params": {}, "bytes_moved": 1,
                        "rows": rows})
    return {r["impl"]: r for r in rows}


def test_a_host_row_that_errored_misses_its_targets():
    res = synthetic_result(False)
    rows = _host_rows(res)
    t = _targets(res)
    assert t["one-call host time in place, new arrays <= 5.0 µs"]["status"] == "PASS"
    assert t["one-call host time <= 2x RopePlan.execute"]["status"] == "PASS"
    bad = next(n for n in rows if n.startswith("apply_rope_qk, engines'"))
    rows[bad].update(check="error: RuntimeError: boom", timings={})
    t = _targets(res)
    assert t["one-call host time in place, new arrays <= 5.0 µs"]["status"] == "MISS"
    rows[bad].update(check="-", timings={"host": {"us": 4.0}})
    rows["RopePlan.execute (same arrays)"].update(check="error: RuntimeError: boom", timings={})
    t = _targets(res)
    for name in ("one-call host time <= 2x RopePlan.execute", "RopePlan.execute host time <= 5.0 µs"):
        assert t[name]["status"] == "MISS", t[name]


def test_a_cold_start_scenario_that_failed_misses():
    res = synthetic_result(False)
    res["coldstart"].append({"scenario": "tail", "cache": "warm", "error": "exit 1: boom"})
    res["coldstart"].append({"scenario": "tail", "cache": "empty", "error": "exit 1: boom"})
    t = _targets(res)
    for name in ("warm cache: first result <= 150 ms beyond imports", "cold compile of one kernel <= 2 s"):
        name = next(n for n in t if n.startswith(name.split(" <=")[0]))
        assert t[name]["status"] == "MISS" and t[name]["where"].startswith("tail (exit 1: boom"), t[name]


def test_an_engine_section_that_failed_misses_every_selected_engine_target():
    res = synthetic_result(True)
    res["engine"] = engine.engine_failures("engine section failed: RuntimeError: boom", ["engine/mrope"], True)
    assert {r["id"] for r in res["engine"]} == {engine.mrope_ident(T, i) for T in (8, 16384) for i in (False, True)}
    t = _targets(res)
    assert t[MROPE_DECODE]["status"] == "MISS" and t["MRoPE prefill >= 95% of copy"]["status"] == "MISS"
    assert t["MLA prefill >= 95% of copy"]["status"] == "N/A"  # not selected: not judged


def test_the_blogs_fused_kernel_failing_misses_the_blog_target():
    res = synthetic_result(False)
    _wrong(_case(res, "blog/S=1"), "fused")
    t = _targets(res)["blog's configuration: time <= 1.01x the blog's fused kernel"]
    assert t["status"] == "MISS" and t["where"].startswith("blog/S=1 (the blog's fused kernel: WRONG"), t


def test_merging_clears_a_failed_host_section_and_a_failed_jobs_records():
    base = synthetic_result(True)
    base["unmeasured"] = [{"id": "host", "group": "host", "why": "host section failed: boom"}]
    base["engine"] = engine.engine_failures("engine/jax failed: boom", ["engine/jax"], True)
    later = {"cases": [], "host": list(base["host"]), "created": "later", "command": "-", "env": {},
             "engine": [{"id": "engine/jax-prefill/bf16/bshd/S=4096", "group": "engine", "rows": []},
                        {"id": "engine/jax-decode/bf16/bshd/B=8", "group": "engine", "rows": []}]}
    merged = report.merge_results(base, later)
    assert merged["unmeasured"] == []
    assert [r["id"] for r in merged["engine"]] == [r["id"] for r in later["engine"]]


def test_without_jax_its_records_are_not_run(tmp_path):
    pytest.importorskip("numpy")
    try:
        import jax  # noqa: F401
        pytest.skip("JAX is installed here")
    except ImportError:
        pass
    from rope_rtc.benchmark import engine_jax

    assert engine_jax.jax_records(types.SimpleNamespace(seed=0, quick=True), None, None) == []
    res = synthetic_result(True)
    res["engine"] = []
    assert _targets(res)["rope_rtc.jax prefill >= 95% of copy"]["status"] == "N/A"


def test_an_older_runs_unmeasured_tail_entry_without_params_is_judged_by_its_id():
    res = synthetic_result(False)
    res["cases"] = [c for c in res["cases"] if c["id"] != "tail/T=4/H=64/D=512"]
    res["unmeasured"] = [{"id": "tail/T=4/H=64/D=512", "group": "tail", "cold_exact": False, "why": "budget"}]
    t = _targets(res)["tail T=1,4 H=64 D=512 GPU time under graph replay <= 1.6 µs"]
    assert t["status"] == "MISS" and t["where"].startswith("tail/T=4/H=64/D=512"), t


def test_loop_marks_only_a_row_timed_by_its_loop():
    res = synthetic_result(False)
    case = _case(res, "blog/S=1")
    by = figures.rows_by_impl(case)
    del by[bcases.COPY]["timings"]["graph_cold"]  # the copy timed by its loop, ours under graph replay
    row = next(r for r in report.blog_table(res) if r[0] == "1")
    assert "(loop)" not in row[report.blog_table(res)[0].index("auto")]


def test_from_json_of_a_file_that_is_not_a_run_is_a_usage_error(tmp_path, capsys):
    from rope_rtc.benchmark import cli as bench_cli

    path = tmp_path / "other.json"
    path.write_text('{"rows": []}')
    assert bench_cli.main(["--from-json", str(path), "--no-plot"]) == 2
    assert "is not a benchmark run" in capsys.readouterr().err
