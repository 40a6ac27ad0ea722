"""Reporting: the text and Markdown tables, the targets (PASS / MISS / N/A / INFO), the stdout
summary, the JSON file, the plot, docs/benchmarks.md, merging runs, and :func:`report`."""

from __future__ import annotations

import argparse
import json
import math
import operator
import os
import re
from pathlib import Path

from .cases import (ANGLES_OP, ANGLES_PREFILL_POINTS, ANGLES_TABLE, BLOG_FUSED_RATIO, BLOG_VARIANTS, COMPILE_ONE_S, COPY, COPY_FP8, COPY_KERNEL, DECODE_COPY_RATIO, DECODE_GPU_US, KV_FUSED, KV_FUSED_FP8,
                    JAX_OURS, JAX_PREFILL_PCT, JAX_XLA, KV_FUSED_PREFILL_PCT, QKNORM_OP, QKNORM_PREFILL_PCT, QKNORM_TWO_STEP, QKNORM_TWO_STEP_RATIO,
                    KV_TWO_STEP, MLA_DECODE_COPY_RATIO, MLA_FUSED, MLA_FUSED_FP8, MLA_PREFILL_PCT, MLA_TWO_STEP,
                    MLA_TWO_STEP_FP8, OWN_COPY_FP8, MROPE_DECODE_EXTRA_US, MROPE_OP, MROPE_PLAIN, MROPE_PREFILL_PCT, NOISE,
                    VISION_COMPILE, VISION_COMPILE_SPEEDUP, VISION_COPY_PCT,
                    ONE_CALL, ONE_CALL_ALLOC_HOST_US, ONE_CALL_HOST_US, ENGINE, ONE_CALL_PLAN_RATIO, ONE_CALL_POOL, ONE_CALL_PREFILL_POINTS, OURS, PEERS, PLAN_HOST_US, STEP_TABLES,
                    TAIL_ONE_CALL_HOST_US,
                    PREFILL_RULES, TAIL_COPY_PCT, TAIL_GPU_US, TAIL_HOST_US, WARM_FIRST_S, MiB)
from .device_state import collect as collect_device_states
from .device_state import describe as describe_device_state
from .device_state import run_summary as run_device_summary
from .figures import fastest_peer, gbps, ok, pct_of_copy, resolved, rows_by_impl, timing


# =============================================================================================
# reporting: tables


ROW_HEADER = (f"  {'impl':<14}{'layout':<11}{'check':<22}{'hot µs':>10}{'cold µs':>10}{'GB/s':>9}{'%copy':>7}"
              f"{'graph µs':>10}{'gr.cold':>9}{'host µs':>9}")


def _f(v, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}{fmt}}"


def format_row(case_rec: dict, row: dict) -> str:
    check = str(row.get("check", ""))
    if len(check) > 21:
        check = check[:20] + "…"
    return (f"  {row['impl']:<14}{row.get('layout', ''):<11}{check:<22}"
            f"{_f(timing(row, 'hot'), '.2f', 10)}{_f(timing(row, 'cold'), '.2f', 10)}"
            f"{_f(gbps(case_rec, row, 'cold'), '.0f', 9)}{_f(pct_of_copy(case_rec, row, 'cold'), '.1f', 7)}"
            f"{_f(timing(row, 'graph'), '.2f', 10)}{_f(timing(row, 'graph_cold'), '.2f', 9)}"
            f"{_f(timing(row, 'host'), '.2f', 9)}")


def _cell(case_rec: dict, row: dict | None, regime: str = "cold*") -> str:
    if row is None:
        return "-"
    if not ok(row):
        chk = str(row.get("check", ""))
        return "WRONG" if chk.startswith("WRONG") else ("skip" if chk.startswith("skip") else "error")
    return _cell_reference(case_rec, row, regime)


def blog_table(result: dict) -> list[list[str]]:
    impls = list(BLOG_VARIANTS) + [OURS] + list(PEERS)
    head = ["S", "MB moved", "copy GB/s"] + [("auto" if i == OURS else i) for i in impls]
    rows = [head]
    for c in result["cases"]:
        if c["group"] != "blog":
            continue
        by = rows_by_impl(c)
        rows.append([str(c["params"]["S"]), f"{c['bytes_moved'] / 1e6:.1f}", _cell_copy(c)]
                    + [_cell(c, by.get(i)) for i in impls])
    return rows


def _short_id(c: dict) -> str:
    """The case id without its group (each table is one group)."""
    return c["id"].split("/", 1)[1] if "/" in c["id"] else c["id"]


def _cell_copy(c: dict) -> str:
    g = gbps(c, rows_by_impl(c).get(COPY), "cold*")
    return "-" if g is None else f"{g:.0f}"


def prefill_table(result: dict, group: str, one_call: bool = True) -> list[list[str]]:
    """``one_call``: with the one-call function's column (the docs; the device summary leaves it out)."""
    rows = [["case", "MB moved", "copy GB/s", "rope_rtc GB/s (%copy)"] + (["one call"] if one_call else [])
            + ["fastest peer", "cupy"]]
    for c in result["cases"]:
        if c["group"] != group:
            continue
        by = rows_by_impl(c)
        best = fastest_peer(c, "cold*")
        best_txt = "-"
        if best:
            best_txt = f"{best[0]} {_cell(c, by[best[0]])}"
        rows.append([_short_id(c), f"{c['bytes_moved'] / 1e6:.1f}", _cell_copy(c), _cell(c, by.get(OURS))]
                    + ([_cell(c, by.get(ONE_CALL))] if one_call else []) + [best_txt, _cell(c, by.get("cupy"))])
    return rows


def latency_table(result: dict, group: str) -> list[list[str]]:
    """Small cases: GPU µs under graph replay (hot / cold) and host µs per call, ours and peers."""
    impls = [COPY, OURS] + ([ENGINE, STEP_TABLES] if group == "decode" else []) + list(PEERS)
    rows = [["case"] + impls]
    for c in result["cases"]:
        if c["group"] != group or not c.get("small"):
            continue
        by = rows_by_impl(c)
        cells = [_short_id(c)]
        for i in impls:
            r = by.get(i)
            if r is None:
                cells.append("-")
            elif i != COPY and not ok(r):
                cells.append(_cell(c, r))
            else:
                cells.append("/".join("-" if timing(r, g) is None else f"{timing(r, g):.2f}"
                                      for g in ("graph", "graph_cold", "host")))
        rows.append(cells)
    return rows


def tail_table(result: dict, copy_kernel: bool = True) -> list[list[str]]:
    """The tail cases; ``copy_kernel=False`` leaves out the reference kernel's column (the printed
    summary must fit the device tool's output tail)."""
    rows = [["case", "MB moved", "copy GB/s", "copy kernel GB/s (%copy)", "rope_rtc GB/s (%copy)", "graph µs",
             "host µs", "fastest peer"]]
    for c in result["cases"]:
        if c["group"] != "tail":
            continue
        by = rows_by_impl(c)
        ours = by.get(OURS)
        best = fastest_peer(c, "cold*")
        rows.append([_short_id(c) + ("" if c.get("cold_exact") else " *"), f"{c['bytes_moved'] / 1e6:.3f}", _cell_copy(c),
                     _cell_reference(c, by.get(COPY_KERNEL)), _cell(c, ours),
                     _f(timing(ours, "graph"), ".2f", 0).strip(), _f(timing(ours, "host"), ".2f", 0).strip(),
                     f"{best[0]} {_cell(c, by[best[0]])}" if best else "-"])
    if not copy_kernel:
        rows = [r[:3] + r[4:] for r in rows]
    return rows


def _cell_reference(case_rec: dict, row: dict | None, regime: str = "cold*") -> str:
    """GB/s and % of the copy, with no correctness check to show (the copy kernel's row)."""
    if row is None:
        return "-"
    g, p = gbps(case_rec, row, regime), pct_of_copy(case_rec, row, regime)
    if g is None:
        return "-"
    copy = rows_by_impl(case_rec).get(COPY)
    if p is None and resolved(row, regime) == "cold" and resolved(copy, regime) != "cold":
        return f"{g:.0f} (loop)"  # the copy under graph replay, this row by its event loop: no ratio
    return f"{g:.0f} ({p:.0f}%)" if p is not None else f"{g:.0f}"


def host_table(result: dict) -> list[list[str]]:
    """The host-cost rows: the median process's µs per call, and each process's where several
    measured it (runner.run_host_processes)."""
    several = any(rec.get("processes", 1) > 1 for rec in result.get("host", []))
    rows = [["shape", "call", "host µs/call"] + (["each process"] if several else [])]
    for rec in result.get("host", []):
        for r in rec["rows"]:
            us = timing(r, "host")
            each = (r["timings"].get("host") or {}).get("processes_us", [])
            rows.append([rec["id"].removeprefix("host/"), r["impl"], "-" if us is None else f"{us:.2f}"]
                        + ([", ".join(f"{u:.2f}" for u in each) or "-"] if several else []))
    return rows


def engine_table(result: dict) -> list[list[str]]:
    """The engine-interface records: every implementation's device time (decode: under graph
    replay; prefill: a loop over buffers larger than the L2), GB/s and % of the copy of the bytes."""
    rows = [["case", "implementation", "MB moved", "µs", "GB/s (% of copy)", "check", "note"]]
    for rec in result.get("engine", []):
        if rec.get("error"):
            rows.append([rec["id"].removeprefix("engine/"), "-", "-", "-", "-", rec["error"][:120], ""])
        by = rows_by_impl(rec)
        copy_gbps = gbps(rec, by.get(COPY), "cold*")
        copy8 = by.get(COPY_FP8)  # the FP8 row's own same-size copy, where measured
        copy8_gbps = copy8["bytes_moved"] / timing(copy8, "cold*") / 1e3 if copy8 and timing(copy8, "cold*") else None
        for r in rec["rows"]:
            us = timing(r, "cold*")
            moved = r.get("bytes_moved", rec["bytes_moved"])  # a row may move fewer bytes (FP8 entries)
            g = moved / us / 1e3 if us else None
            base = copy8_gbps if r["impl"] in OWN_COPY_FP8 and copy8_gbps else copy_gbps
            cell = "-" if g is None else (f"{g:.0f}" if r["impl"] in (COPY, COPY_FP8) or not base
                                          else f"{g:.0f} ({100 * g / base:.1f}%)")
            rows.append([rec["id"].removeprefix("engine/"), r["impl"], f"{moved / 1e6:.2f}",
                         "-" if us is None else f"{us:.2f}", cell, r.get("check", "-"), r.get("note", "")])
    return rows


def _failed(row: dict | None) -> bool:
    """Whether ``row`` failed its output check (or could not run): "-" marks a row not checked."""
    return bool(row) and not ok(row) and not str(row.get("check", "")).startswith("-")


def _miss(floor: bool) -> float:
    """The value of a point that misses whatever the bound: -inf against a floor, inf against a
    ceiling (``_worst`` reports it as "no valid figure")."""
    return -math.inf if floor else math.inf


def _ours(row: dict | None, value, where: str, *, floor: bool = True) -> tuple:
    """``_judged`` for a row of ours in an engine record; ``(None, where)`` (no point) when the
    record has no such row, as a run without the FP8 rows has none."""
    return (None, where) if row is None else _judged(row, value, where, floor=floor)


def _judged(row: dict | None, value, where: str, *, floor: bool) -> tuple:
    """``(value, where)`` for our row of a case a target judges. A row that failed its check, is
    absent or has no figure misses, saying why: a selected case never passes by going unmeasured."""
    if _failed(row):
        return _miss(floor), f"{where} ({str(row['check'])[:80]})"
    if value is None:
        return _miss(floor), f"{where} (not measured)"
    return value, where


def _our_time(c: dict, regime: str) -> tuple:
    """``_judged`` of our row's µs per call in ``regime`` (a ceiling)."""
    row = rows_by_impl(c).get(OURS)
    return _judged(row, timing(row, regime), c["id"], floor=False)


def _our_pct(c: dict) -> tuple:
    """``_judged`` of our row's % of the copy, cold L2 (a floor)."""
    row = rows_by_impl(c).get(OURS)
    return _judged(row, pct_of_copy(c, row, "cold*"), c["id"], floor=True)


def _unmeasured(result: dict, group: str, *, floor: bool, judged=lambda case: True) -> list:
    """Failing points for the selected cases of ``group`` the run has no record of (the case
    failed, or the time budget skipped it): ``result["unmeasured"]``, where ``judged`` keeps it."""
    return [(_miss(floor), f"{u['id']} ({u['why'][:80]})") for u in result.get("unmeasured", [])
            if u["group"] == group and judged(u)]


def _paired(recs: list, prefix: str, ours: str, other: str, regime: str, combine) -> list:
    """``(combine(our µs, other µs), id)`` for each record whose id starts with ``prefix`` and has
    our row (both ours: ``other`` is the reference the record measures beside it); infinity where
    our row failed its output check or either has no figure in ``regime``."""
    pts = []
    for r in recs:
        if r["id"].startswith(prefix):
            by = _rows(r)
            us, them = timing(by.get(ours), regime), timing(by.get(other), regime)
            if by.get(ours) is not None:
                pts.append(_judged(by.get(ours), us and them and combine(us, them), r["id"], floor=False))
    return pts


def _rows(rec: dict) -> dict:
    """``rows_by_impl`` of an engine record; for a record whose job failed, every row as failed
    (the targets that judge its prefix miss, naming the error, instead of passing without it)."""
    if not rec.get("error"):
        return rows_by_impl(rec)

    class Failed(dict):
        def get(self, impl, default=None):
            return {"impl": impl, "check": f"error: {rec['error'].split(' failed: ', 1)[-1]}"[:200], "timings": {}}

    return Failed()


def _engine_targets(add, result: dict) -> None:
    """RoPE fused with the KV-cache write: prefill against a copy of its bytes, decode against the
    two-step sequence (our RoPE, then a separate cache write)."""
    recs = result.get("engine", [])
    prefill = [r for r in recs if r["id"].startswith("engine/kv-cache-prefill")]
    _worst(add, f"RoPE + KV-cache write, prefill >= {KV_FUSED_PREFILL_PCT:.0f}% of copy",
           [_ours(_rows(r).get(KV_FUSED), pct_of_copy(r, _rows(r).get(KV_FUSED), "cold*"), r["id"])
            for r in prefill], KV_FUSED_PREFILL_PCT, "%", floor=True)
    fp8 = []  # FP8 entries: % of a same-size copy of the FP8 launch's own (fewer) bytes
    for r in prefill:
        by = _rows(r)
        row8 = by.get(KV_FUSED_FP8)
        # Runs without the FP8 copy row: the record's copy, at its bandwidth.
        copy8 = by.get(COPY_FP8) or by.get(COPY)
        cu = timing(copy8, "cold*")
        us8 = timing(row8, "cold*")
        if row8 is not None:
            copy_moved = copy8.get("bytes_moved", r["bytes_moved"]) if copy8 else None
            pct = 100.0 * (row8["bytes_moved"] / us8) / (copy_moved / cu) if cu and us8 else None
            fp8.append(_judged(row8, pct, r["id"], floor=True))
    _worst(add, f"RoPE + FP8 KV-cache write, prefill >= {KV_FUSED_PREFILL_PCT:.0f}% of copy", fp8,
           KV_FUSED_PREFILL_PCT, "%", floor=True)
    qk = [r for r in recs if r["id"].startswith("engine/qk-norm-prefill")]
    _worst(add, f"QK-norm + RoPE, prefill >= {QKNORM_PREFILL_PCT:.0f}% of copy",
           [_ours(_rows(r).get(QKNORM_OP), pct_of_copy(r, _rows(r).get(QKNORM_OP), "cold*"), r["id"])
            for r in qk], QKNORM_PREFILL_PCT, "%", floor=True)
    two = []
    for r in qk:
        by = _rows(r)
        ours, seq = timing(by.get(QKNORM_OP), "cold*"), timing(by.get(QKNORM_TWO_STEP), "cold*")
        if by.get(QKNORM_OP) is not None:
            two.append(_judged(by.get(QKNORM_OP), ours and seq and ours / seq, r["id"], floor=False))
    _worst(add, f"QK-norm + RoPE, prefill <= {QKNORM_TWO_STEP_RATIO:g}x the two-step sequence", two,
           QKNORM_TWO_STEP_RATIO, "x", floor=False)
    # "faster": a ratio of exactly 1 misses
    _worst(add, "RoPE + KV-cache write, decode faster than two steps",
           _paired(recs, "engine/kv-cache-decode", KV_FUSED, KV_TWO_STEP, "graph", operator.truediv),
           1.0 - 1e-9, "x", floor=False)
    mrope = [r for r in recs if r["id"].startswith("engine/mrope-")]
    _worst(add, f"MRoPE prefill >= {MROPE_PREFILL_PCT:.0f}% of copy",
           [_ours(_rows(r).get(MROPE_OP), pct_of_copy(r, _rows(r).get(MROPE_OP), "cold*"), r["id"])
            for r in mrope if r["id"].startswith("engine/mrope-prefill")], MROPE_PREFILL_PCT, "%",
           floor=True)
    _worst(add, f"MRoPE decode <= plain RoPE + {MROPE_DECODE_EXTRA_US} µs",
           _paired(mrope, "engine/mrope-decode", MROPE_OP, MROPE_PLAIN, "graph", operator.sub),
           MROPE_DECODE_EXTRA_US, " µs", floor=False)
    _vision_targets(add, [r for r in recs if r["id"].startswith("engine/vision-axial")])
    _angle_targets(add, [r for r in recs if r["id"].startswith("engine/angles-")])
    _mla_targets(add, [r for r in recs if r["id"].startswith("engine/mla-")])
    _jax_targets(add, [r for r in recs if r["id"].startswith("engine/jax-")])


def _jax_targets(add, recs: list) -> None:
    """rope_rtc.jax inside jit: prefill against a copy of its bytes, decode against the same RoPE
    in jnp fused by XLA (within the peers' 1% of noise)."""
    _worst(add, f"rope_rtc.jax prefill >= {JAX_PREFILL_PCT:.0f}% of copy",
           [_ours(_rows(r).get(JAX_OURS), pct_of_copy(r, _rows(r).get(JAX_OURS), "cold*"), r["id"])
            for r in recs if r["id"].startswith("engine/jax-prefill")], JAX_PREFILL_PCT, "%", floor=True)
    _worst(add, "rope_rtc.jax decode GPU time <= XLA's fusion of the jnp RoPE (within 1%)",
           _paired(recs, "engine/jax-decode", JAX_OURS, JAX_XLA, "cold*", operator.truediv), NOISE, "x", floor=False)


def _vision_targets(add, recs: list) -> None:
    """A vision tower's axial RoPE (two position streams): against a copy of its bytes, and against
    torch.compile of transformers' vision rotary path (its time over ours)."""
    _worst(add, f"vision axial RoPE >= {VISION_COPY_PCT:.0f}% of copy",
           [_ours(_rows(r).get(MROPE_OP), pct_of_copy(r, _rows(r).get(MROPE_OP), "cold*"), r["id"])
            for r in recs], VISION_COPY_PCT, "%", floor=True)
    speedups = []
    for r in recs:
        by = _rows(r)
        ours, peer = timing(by.get(MROPE_OP), "cold*"), timing(by.get(VISION_COMPILE), "cold*")
        if _failed(by.get(MROPE_OP)) or (peer and not ours):  # ours failed or has no figure: a miss
            speedups.append(_judged(by.get(MROPE_OP), None, r["id"], floor=True))
        elif ours and peer:  # (a peer that could not run, torch missing, leaves the target unjudged)
            speedups.append((peer / ours, r["id"]))
    _worst(add, f"vision axial RoPE >= {VISION_COMPILE_SPEEDUP:g}x faster than torch.compile of transformers' path",
           speedups, VISION_COMPILE_SPEEDUP, "x", floor=True)


def _pct_of_own_copy(rec: dict, row: dict | None) -> float | None:
    """% of a copy of the row's own bytes: the record's copy of the FP8 bytes for an FP8 row where
    the run measured one, else the record's copy at its rate."""
    by = _rows(rec)
    copy = by.get(COPY_FP8) if row and row["impl"] in OWN_COPY_FP8 and by.get(COPY_FP8) else by.get(COPY)
    us, cu = timing(row, "cold*"), timing(copy, "cold*")
    if not (row and us and cu):
        return None
    moved, copy_moved = row.get("bytes_moved", rec["bytes_moved"]), copy.get("bytes_moved", rec["bytes_moved"])
    return 100.0 * (moved / us) / (copy_moved / cu)


def _mla_targets(add, recs: list) -> None:
    """DeepSeek-style MLA (RoPE on q's rotary part and k_pe, the latent cache row): prefill against a
    copy of its bytes (each cache kind its own), decode under graph replay against the copy node,
    and both against the two-step sequence (our RoPE, then a separate cache write)."""
    prefill = [r for r in recs if r["id"].startswith("engine/mla-prefill")]
    for impl, name in ((MLA_FUSED, f"MLA prefill >= {MLA_PREFILL_PCT:.0f}% of copy"),
                       (MLA_FUSED_FP8, f"MLA prefill, FP8 cache >= {MLA_PREFILL_PCT:.0f}% of copy")):
        _worst(add, name, [_ours(_rows(r).get(impl), _pct_of_own_copy(r, _rows(r).get(impl)), r["id"])
                           for r in prefill], MLA_PREFILL_PCT, "%", floor=True)
    copy_ratios, two_ratios = [], []
    for r in recs:
        by = _rows(r)
        decode = r["id"].startswith("engine/mla-decode")
        regime = "graph" if decode else "cold*"
        for fused, two, cache in ((MLA_FUSED, MLA_TWO_STEP, "bf16"), (MLA_FUSED_FP8, MLA_TWO_STEP_FP8, "FP8")):
            row = by.get(fused)
            if row is None:  # (a run without the FP8 rows)
                continue
            ours, copy, seq = timing(row, regime), timing(by.get(COPY), regime), timing(by.get(two), regime)
            where = f"{r['id']} ({cache} cache)"
            if decode:
                copy_ratios.append(_judged(row, ours and copy and ours / copy, where, floor=False))
            two_ratios.append(_judged(row, ours and seq and ours / seq, where, floor=False))
    _worst(add, f"MLA decode under graph replay <= {MLA_DECODE_COPY_RATIO:g}x the copy node", copy_ratios,
           MLA_DECODE_COPY_RATIO, "x", floor=False)
    # "faster": a ratio of exactly 1 misses
    _worst(add, "MLA faster than two steps, prefill and decode", two_ratios, 1.0 - 1e-9, "x", floor=False)


def _row_pct(rec: dict, row: dict | None) -> float | None:
    """% of the record's copy for a row moving its own bytes (``bytes_moved``), at the copy's rate."""
    copy, us = _rows(rec).get(COPY), timing(row, "cold*")
    cu = timing(copy, "cold*")
    if not (row and us and cu):
        return None
    return 100.0 * (row.get("bytes_moved", rec["bytes_moved"]) / us) / (rec["bytes_moved"] / cu)


def _angle_targets(add, recs: list) -> None:
    """Angles computed in the kernel: prefill within ANGLES_PREFILL_POINTS of the table kernel's %
    of copy (each of its own bytes); decode GPU time at most the table kernel's."""
    gaps = []
    for r in recs:
        if r["id"].startswith("engine/angles-prefill"):
            by = _rows(r)
            ours, table = by.get(ANGLES_OP), by.get(ANGLES_TABLE)
            a, b = _row_pct(r, ours), _row_pct(r, table)
            if ours is not None:
                gaps.append(_judged(ours, None if a is None or b is None else a - b, r["id"], floor=True))
    _worst(add, f"inv_freq prefill within {ANGLES_PREFILL_POINTS:g} point of the tables", gaps,
           -ANGLES_PREFILL_POINTS, " points", floor=True)
    _worst(add, "inv_freq decode GPU time <= the tables",
           _paired(recs, "engine/angles-decode", ANGLES_OP, ANGLES_TABLE, "graph", operator.truediv), 1.0, "x",
           floor=False)


def coldstart_table(result: dict) -> list[list[str]]:
    rows = [["API", "cache", "import s", "context s", "first result ms", "compiles"]]
    for r in result.get("coldstart", []):
        if r.get("error"):
            rows.append([r["scenario"], r["cache"], "error", "", "", r["error"][:60]])
            continue
        comp = "; ".join(f"{c['kernel']} {c['seconds']:.3f} s" for c in r.get("compiles", [])) or "none"
        rows.append([r["scenario"], r["cache"], f"{r['import_s']:.3f}", f"{r['context_s']:.3f}",
                     f"{r['first_result_s'] * 1e3:.1f}", comp])
    return rows


def text_table(rows: list[list[str]]) -> str:
    if not rows:
        return ""
    widths = [max(len(str(r[i])) for r in rows if i < len(r)) for i in range(len(rows[0]))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[list[str]]) -> str:
    if len(rows) < 2:
        return "_no cases in this run_"
    esc = [[str(v).replace("|", "\\|") for v in r] for r in rows]
    out = ["| " + " | ".join(esc[0]) + " |", "|" + "|".join(" --- " for _ in esc[0]) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(out)


# =============================================================================================
# reporting: targets


def _host_points(result: dict, cases: list, host_row: str) -> list:
    """(µs, where) host times of our rows in ``cases`` plus the host-cost section's ``host_row``;
    the host section's failure (``result["unmeasured"]``) misses."""
    return ([_our_time(c, "host") for c in cases]
            + [_judged(r, timing(r, "host"), rec["id"], floor=False) for rec in result.get("host", [])
               for r in rec["rows"] if r["impl"] == host_row] + _unmeasured(result, "host", floor=False))


def evaluate_targets(result: dict) -> list[dict]:
    """Each of the product's performance targets: PASS / MISS (with the gap) / N/A ("not run": not measured in this run)."""
    cases = result.get("cases", [])
    out: list[dict] = []

    def add(name, status, measured, gap="", where=""):
        out.append({"target": name, "status": status, "measured": measured, "gap": gap, "where": where})

    # prefill fraction of the same-size copy (cold)
    prefill = [c for c in cases if c["group"] in ("general", "blog")]
    for i, (floor, need) in enumerate(PREFILL_RULES):
        ceiling = PREFILL_RULES[i - 1][0] if i else None
        name = (f"prefill >= {need:.0f}% of copy, {floor // MiB} MiB+ moved" if ceiling is None
                else f"prefill >= {need:.0f}% of copy, {floor // MiB}-{ceiling // MiB} MiB moved")
        def judged(c, floor=floor, ceiling=ceiling):
            return c["bytes_moved"] >= floor and (ceiling is None or c["bytes_moved"] < ceiling)

        pts = [_our_pct(c) for c in prefill if judged(c)]
        pts += [p for g in ("general", "blog") for p in _unmeasured(result, g, floor=True, judged=judged)]
        _worst(add, name, pts, need, "%", floor=True)
    # the blog's configuration: the production kernel against the blog's own fused kernel
    blog = [c for c in cases if c["group"] == "blog"]
    ratios = []
    for c in blog:
        by = rows_by_impl(c)
        ours, fused = timing(by.get(OURS), "cold*"), timing(by.get("fused"), "cold*")
        if _failed(by.get("fused")) or not fused:  # the blog's kernel is ours to build: its failure misses too
            said = str((by.get("fused") or {}).get("check") or "not measured")[:60]
            ratios.append((math.inf, f"{c['id']} (the blog's fused kernel: {said})"))
        else:
            ratios.append(_judged(by.get(OURS), ours and ours / fused, c["id"], floor=False))
    _worst(add, f"blog's configuration: time <= {BLOG_FUSED_RATIO:g}x the blog's fused kernel",
           ratios + _unmeasured(result, "blog", floor=False), BLOG_FUSED_RATIO, "x", floor=False)
    # never slower than the fastest peer, on the inputs the peers get: at decode they get cos and
    # sin gathered once per step, so ours is the row on those tables where it was measured. Cold
    # and hot: a small case's hot GPU time is its graph replay (a loop measures the launch rate).
    worst = None
    for c in cases:
        if c["group"] not in ("general", "blog", "decode", "tail"):
            continue
        by = rows_by_impl(c)
        ours = by.get(STEP_TABLES) if c["group"] == "decode" and ok(by.get(STEP_TABLES)) else by.get(OURS)
        for regime in ("cold*", "graph" if c.get("small") else "hot"):
            best = fastest_peer(c, regime, like=ours)  # each peer timed as ours was
            if not best:
                continue
            peer, them = best
            us = timing(ours, regime)
            ratio, where = _judged(ours, us and us / them, f"{c['id']} ({regime}) vs {peer}", floor=False)
            if worst is None or ratio > worst[0]:
                worst = (ratio, where)
    for group in ("general", "blog", "decode", "tail"):  # a case not measured is behind on every row
        for point in _unmeasured(result, group, floor=False):
            worst = point if worst is None or point[0] > worst[0] else worst
    if worst is None:
        add("never slower than the fastest peer on its inputs (within 1%)", "N/A", "no peer measured")
    elif math.isinf(worst[0]):
        add("never slower than the fastest peer on its inputs (within 1%)", "MISS", "no valid figure", "", worst[1])
    else:
        st = "PASS" if worst[0] <= NOISE else "MISS"
        add("never slower than the fastest peer on its inputs (within 1%)", st, f"worst time ratio {worst[0]:.3f}",
            "" if st == "PASS" else f"{(worst[0] - 1) * 100:.1f}% slower", worst[1])
    # decode
    dec = [c for c in cases if c["group"] == "decode"]
    unmeasured = _unmeasured(result, "decode", floor=False)
    _worst(add, f"decode GPU time under graph replay <= {DECODE_GPU_US} µs",
           [_our_time(c, "graph") for c in dec] + unmeasured, DECODE_GPU_US, " µs", floor=False)
    ratios = []
    for c in dec:
        ours, copy = timing(rows_by_impl(c).get(OURS), "graph"), timing(rows_by_impl(c).get(COPY), "graph")
        ratios.append(_judged(rows_by_impl(c).get(OURS), ours and copy and ours / copy, c["id"], floor=False))
    ratios += unmeasured
    _worst(add, f"decode GPU time under graph replay <= {DECODE_COPY_RATIO:g}x the copy node", ratios,
           DECODE_COPY_RATIO, "x", floor=False)
    _worst(add, f"RopePlan.execute host time <= {PLAN_HOST_US} µs",
           _host_points(result, dec, "RopePlan.execute (same arrays)") + unmeasured, PLAN_HOST_US, " µs",
           floor=False)
    # tail
    tail = [c for c in cases if c["group"] == "tail"]
    # The target's condition is a cold L2. A shape too small to be measured cold (MAX_COLD_SETS
    # sets of it still fit the L2) is reported beside the target rather than judged by it.
    cold = [c for c in tail if c.get("cold_exact")]
    warm = [c for c in tail if not c.get("cold_exact")]
    _worst(add, f"tail >= {TAIL_COPY_PCT:.0f}% of copy, cold L2, every shape measured cold",
           [_our_pct(c) for c in cold] + _unmeasured(result, "tail", floor=True, judged=lambda u: u.get("cold_exact")),
           TAIL_COPY_PCT, "%", floor=True)
    _tail_too_small(add, warm)
    def is_key(c: dict) -> bool:  # (an entry of an older run has no params: its id says them)
        p = c.get("params") or dict(kv.split("=") for kv in c["id"].split("/")[1:] if "=" in kv)
        return int(p.get("T", 0)) in (1, 4) and (int(p.get("H", 0)), int(p.get("D", 0))) == (64, 512)

    key = [c for c in tail if is_key(c)]
    key_unmeasured = _unmeasured(result, "tail", floor=False, judged=is_key)
    _worst(add, f"tail T=1,4 H=64 D=512 GPU time under graph replay <= {TAIL_GPU_US} µs",
           [_our_time(c, "graph") for c in key] + key_unmeasured, TAIL_GPU_US, " µs", floor=False)
    _worst(add, f"TailRoPEForward.execute host time <= {TAIL_HOST_US} µs",
           _host_points(result, key, "TailRoPEForward.execute (same arrays)") + key_unmeasured, TAIL_HOST_US,
           " µs", floor=False)
    _one_call_targets(add, result, prefill)
    _engine_targets(add, result)
    # cold start
    every = result.get("coldstart", [])
    cs = [r for r in every if not r.get("error")]
    failed = {cache: [(math.inf, f"{r['scenario']} ({str(r['error'])[:60]})") for r in every
                      if r.get("error") and r["cache"] == cache] for cache in ("warm", "empty")}
    _worst(add, f"warm cache: first result <= {WARM_FIRST_S * 1e3:.0f} ms beyond imports",
           [(r["first_result_s"] * 1e3, r["scenario"]) for r in cs if r["cache"] == "warm"] + failed["warm"],
           WARM_FIRST_S * 1e3, " ms", floor=False)
    _worst(add, f"cold compile of one kernel <= {COMPILE_ONE_S:.0f} s",
           [(c["seconds"], c["kernel"]) for r in cs for c in r.get("compiles", [])] + failed["empty"],
           COMPILE_ONE_S, " s", floor=False)
    return out


def _host_row(result: dict, record: str, impl: str) -> dict | None:
    """Row ``impl`` of host record ``record`` (None when the run has no such row)."""
    for rec in result.get("host", []):
        if rec["id"] == record:
            for r in rec["rows"]:
                if r["impl"] == impl:
                    return r
    return None


def _host_point(row: dict | None, where: str) -> tuple:
    """(host µs, where) of a host row: a miss when the row failed or has no figure."""
    return _ours(row, timing(row, "host"), where, floor=False)


def _one_call_targets(add, result: dict, prefill: list) -> None:
    """The one-call functions: host time with new arrays of a seen signature every call, against
    a bound and against RopePlan.execute; and prefill GPU time against the plan's."""
    rec = "host/one-call-decode-bf16-B=8"
    plan = _host_point(_host_row(result, rec, "RopePlan.execute (same arrays)"), "RopePlan.execute")
    calls = [_host_point(_host_row(result, rec, f"apply_rope_qk ({ONE_CALL_POOL} array sets cycled, in place, "
                                                "offset array)"), "apply_rope_qk"),
             _host_point(_host_row(result, rec, f"apply_rope_qk, engines' convention (flat q/k, cos_sin_cache, "
                                                f"positions; {ONE_CALL_POOL} array sets cycled, in place)"),
                         "apply_rope_qk, engines' convention")]
    allocating = [_host_point(_host_row(result, rec, f"apply_rope ({ONE_CALL_POOL} array sets cycled, allocates "
                                                     "the output, offset=7)"), "apply_rope")]
    failed = _unmeasured(result, "host", floor=False)  # the host section did not run to its end
    _worst(add, f"one-call host time in place, new arrays <= {ONE_CALL_HOST_US} µs", calls + failed,
           ONE_CALL_HOST_US, " µs", floor=False)
    _worst(add, f"one-call host time allocating the output, new arrays <= {ONE_CALL_ALLOC_HOST_US} µs",
           allocating + failed, ONE_CALL_ALLOC_HOST_US, " µs", floor=False)
    calls = calls + allocating
    plan_us, plan_where = plan
    if plan_us is not None:  # the run has the plan's row: a ratio to it, or a miss where it failed
        ratios = ([(plan_us, plan_where)] if math.isinf(plan_us) else
                  [(None if us is None else us / plan_us, w) for us, w in calls])
        _worst(add, f"one-call host time <= {ONE_CALL_PLAN_RATIO:g}x RopePlan.execute", ratios + failed,
               ONE_CALL_PLAN_RATIO, "x", floor=False)
    tail = _host_point(_host_row(result, "host/one-call-tail-T=4-H=64-D=512",
                                 f"tail_rope ({ONE_CALL_POOL} array sets cycled, allocates the output)"),
                       "tail_rope T=4 H=64 D=512")
    _worst(add, f"tail_rope host time, new arrays <= {TAIL_ONE_CALL_HOST_US} µs",
           [tail] + failed, TAIL_ONE_CALL_HOST_US, " µs", floor=False)
    gaps = []
    for c in prefill:
        by = rows_by_impl(c)
        # The samples taken in turns where the run has them (runner.pair_one_call).
        regime = "cold_paired" if all(timing(by.get(i), "cold_paired") for i in (OURS, ONE_CALL)) else "cold*"
        copy = timing(by.get(COPY), "cold*")
        ours, one = timing(by.get(OURS), regime), timing(by.get(ONE_CALL), regime)
        if by.get(ONE_CALL) is not None:
            gap = 100.0 * copy / ours - 100.0 * copy / one if copy and ours and one else None
            gaps.append(_judged(by.get(ONE_CALL), gap, c["id"], floor=False))
    gaps += [p for g in ("general", "blog") for p in _unmeasured(result, g, floor=False)]
    _worst(add, f"one-call prefill within {ONE_CALL_PREFILL_POINTS:g} point of the plan",
           gaps, ONE_CALL_PREFILL_POINTS, " points", floor=False)


def _tail_too_small(add, cases: list) -> None:
    """INFO: the tail kernel and the naive copy kernel, as % of the memcpy, on shapes too small for a cold L2."""
    pts = [(pct_of_copy(c, rows_by_impl(c).get(OURS), "cold*"), c["id"]) for c in cases]
    pts = [(v, w) for v, w in pts if v is not None]
    if not pts:
        return
    ref = [pct_of_copy(c, rows_by_impl(c).get(COPY_KERNEL), "cold*") for c in cases]
    ref = [v for v in ref if v is not None]
    v, where = min(pts)
    measured = f"worst {v:.1f}%" + (f"; copy kernel worst {min(ref):.1f}%" if ref else "")
    add(f"tail, {len(cases)} shapes too small for a cold L2, % of copy", "INFO", measured, "", where)


def _worst(add, name, pts, bound, unit, *, floor: bool) -> None:
    """PASS/MISS on the worst point: the smallest against a floor, or the largest against a ceiling."""
    pts = [(v, w) for v, w in pts if v is not None]
    if not pts:
        add(name, "N/A", "not run")
        return
    v, where = min(pts) if floor else max(pts)
    if math.isinf(v):  # a row that failed or has no figure (_miss)
        add(name, "MISS", "no valid figure", "", where)
        return
    passed = v >= bound * (1 - 1e-12) if floor else v <= bound * (1 + 1e-12)
    digits = 1 if floor else 2
    gap = "" if passed else (f"{bound - v:.1f}{unit} short" if floor else f"{v - bound:.2f}{unit} over")
    add(name, "PASS" if passed else "MISS", f"worst {v:.{digits}f}{unit}", gap, where)


def targets_table(result: dict) -> list[list[str]]:
    rows = [["status", "target", "measured", "gap", "where"]]
    for t in evaluate_targets(result):
        rows.append([t["status"], t["target"], t["measured"], t["gap"], t["where"]])
    return rows


# =============================================================================================
# reporting: stdout, JSON, plot, docs


def _without_cupy(rows: list) -> list:
    """A table without its last column when that is CuPy's (the naive baseline, on the page): the
    summary, printed last, must fit the device tool's 12,000-character tail."""
    return [r[:-1] for r in rows] if rows and rows[0][-1] == "cupy" else rows


def summary_text(result: dict, targets_only: bool = False) -> str:
    parts = []
    if not targets_only:
        env = result.get("env", {})
        big = result.get("big_copy") or {}
        parts.append(f"=== summary: {env.get('gpu', '?')}, {result.get('created', '')}, "
                     f"{'quick' if result.get('quick') else 'full'} run, {result.get('elapsed_s', '?')} s; "
                     f"4 GiB copy {big.get('gbps', float('nan')):.0f} GB/s; GB/s and % of the size-matched copy, cold L2")
        for title, rows in (("blog configuration (FP32 interleaved bhsd, fused q+k in place; peers: half-split)", blog_table(result)),
                            ("general kernel (fused q+k in place)", _without_cupy(prefill_table(result, "general",
                                                                                                  one_call=False))),
                            ("decode (thd, Hq=32 Hkv=8): GPU µs graph / graph cold / host µs", latency_table(result, "decode")),
                            ("tail RoPE (* partial cold footprint)", tail_table(result, copy_kernel=False)),
                            ("host cost", host_table(result)), ("cold start", coldstart_table(result))):
            if len(rows) > 1:
                parts.append(f"--- {title}\n{text_table(rows)}")
        if result.get("skips"):
            parts.append("--- skipped\n" + "\n".join(result["skips"]))
    rows = targets_table(result)
    # The targets this run did not measure, on one line (the page's table has a row each): the
    # summary, printed last, must fit the device tool's 12,000-character tail.
    na = [r[1] for r in rows[1:] if r[0] == "N/A"]
    shown = [rows[0]] + [r for r in rows[1:] if r[0] != "N/A"]
    lines = [f"N/A (not measured in this run): {'; '.join(na)}"] if na else []
    if len(shown) > 1:
        lines.append(text_table(shown))
    parts.append("=== targets\n" + "\n".join(lines))
    return "\n\n".join(parts)


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)


def plot_series(result: dict) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """{panel: {label: [(bytes moved, GB/s cold)]}} for the plot (testable without matplotlib)."""
    panels: dict[str, dict[str, list]] = {"RoPE (blog, general, decode)": {}, "tail RoPE": {}}
    for c in result.get("cases", []):
        panel = "tail RoPE" if c["group"] == "tail" else "RoPE (blog, general, decode)"
        for r in c["rows"]:
            if r["impl"] != COPY and not ok(r):
                continue
            g = gbps(c, r, "cold*")
            if g is None:
                continue
            label = "size-matched copy" if r["impl"] == COPY else (
                f"rope_rtc {c['group']}" if r["impl"] == OURS else r["impl"])
            panels[panel].setdefault(label, []).append((float(c["bytes_moved"]), g))
    for series in panels.values():
        for label in series:
            series[label].sort()
    return panels


def write_plot(result: dict, path: Path) -> str | None:
    """Bandwidth against bytes moved; returns None on success, else why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"matplotlib unavailable ({type(exc).__name__}: {exc}); pip install 'rope-rtc[plot]'"
    panels = plot_series(result)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    big = (result.get("big_copy") or {}).get("gbps")
    for ax, (title, series) in zip(axes, panels.items()):
        for label, pts in sorted(series.items()):
            xs, ys = zip(*pts)
            if label == "size-matched copy":
                ax.plot(xs, ys, color="black", linewidth=2, label=label, zorder=1)
            else:   # markers only: one implementation's points span dtypes and layouts
                ax.plot(xs, ys, marker="o", markersize=4, linestyle="none", label=label, zorder=2)
        if big:
            ax.axhline(big, color="grey", linestyle="--", linewidth=1, label=f"4 GiB copy ({big:.0f} GB/s)")
        ax.set_xscale("log")
        ax.set_xlabel("bytes moved per call")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("effective bandwidth, GB/s (cold L2)")
    env = result.get("env", {})
    fig.suptitle(f"rope_rtc on {env.get('gpu', '?')} ({result.get('created', '')})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _safe_plot(result: dict, path: Path) -> str | None:
    try:
        return write_plot(result, path)
    except Exception as exc:   # a plot is never worth losing the run's report
        return f"{type(exc).__name__}: {exc}"


def gpu_slug(result: dict) -> str:
    name = str(result.get("env", {}).get("gpu", "gpu"))
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Za-z]*)\b", name)
    slug = m.group(1) if m else name
    return re.sub(r"[^a-z0-9]+", "-", slug.lower()).strip("-") or "gpu"


METHOD_MD = """\
- **Bytes moved** (the numerator of every GB/s figure) is a property of the case: input read +
  output written + the cos/sin table rows the positions use (FP32) + position indices. A peer
  that reads a wider table is not credited for it.
- **Ceiling**: a `cudaMemcpyAsync` device-to-device copy moving the same number of bytes (half
  read, half written), measured the same way in the same run; a 4 GiB copy is given for scale.
- **Regimes**: *hot* = CUDA events around back-to-back calls on the same buffers; *cold* =
  rotating among buffer sets totalling more than 4x the L2 (the same as hot when one set
  already does; marked * where the 32768-set cap leaves it partial); *graph* / *graph cold* =
  GPU time per call under CUDA-graph replay of captured calls (a peer's output of each buffer
  set kept alive with the graph, so that it writes a buffer per set as ours do; a small case's
  cold figure is its graph cold one, and a row that could not be captured shows its event loop
  marked *(loop)*, with no % of the copy, which is not comparable; a peer whose hot graph
  replay takes over twice the slowest cold one of the copy's and our rows is not replayed cold,
  since it cannot be faster than ours there); *host* = wall
  time per call of Python loops of 100 calls, each issued behind a GPU kernel that outlasts it
  (`bench_spin`, on a stream synchronised first, untimed), so that no call waits for the GPU;
  calls that synchronise with the GPU cannot be timed that way and are timed from an idle
  stream. The rows of a host-cost table take their samples in turns, so each row's median
  covers the same stretch of time, and the host-cost section runs in three fresh processes, each
  row reporting the median process (host speed differed by up to 1.8x between processes). Figures are medians of repeated samples after a warm-up, on
  random data (never zeros).
- **Device state**: after every timed burst of the GPU-time regimes (outside the timed window)
  the benchmark reads the SM and memory clocks, the GPU temperature, the power draw and the clock
  event reasons through NVML (`cuda.bindings.nvml`); each figure in the JSON keeps their range
  (`device`), and the line under the run's header gives them over the whole run.
- **Copy kernel** (tail cases): a one-thread-per-16-bytes copy kernel over the copy's buffers.
  At small sizes launch and memory latency, not bandwidth, set every kernel's time, and this
  column shows how close the simplest kernel comes to the memcpy there.
- **Checks**: every implementation's first call is compared with the reference before timing
  (rope_rtc: the project's contract, bit-exact for tail RoPE; peers: within 2 eps of their dtype
  times the pair magnitude). A wrong answer is reported and not timed.
- **Peers**: plain CuPy (FP32 elementwise, out of place); PyTorch eager with Hugging Face's
  `apply_rotary_pos_emb` (half-split, logical bhsd, out of place, cos/sin in the q dtype, as HF
  computes them once per step) and the tail seed's expression; `torch.compile(dynamic=False)` of
  the same functions; Liger's Triton `LigerRopeFunction` (half-split, in place on bshd memory
  seen as bhsd, its intended layout). On the blog's interleaved case the peers run half-split.
"""


def merge_results(base: dict, later: dict) -> dict:
    """``base`` with each record that ``later`` measured replaced by ``later``'s record of it: a
    case (which holds its own copy ceiling and peers, measured beside it), a host-cost table or
    an engine record (each with its own references). The replacement is recorded in ``merged``
    so the rendered page says which rows come from which run."""
    out = dict(base)
    ids: list[str] = []
    for section in ("cases", "host", "engine"):
        new = {c["id"]: c for c in later.get(section) or []}
        if not new:
            continue
        # A failure record of a job (its id a prefix of the records it writes) gives way to them.
        kept = [c for c in base.get(section) or []
                if not (c.get("error") and any(i.startswith(c["id"] + "/") for i in new))]
        replaced = [c["id"] for c in kept if c["id"] in new]
        added = [i for i in new if i not in replaced]
        out[section] = [new.get(c["id"], c) for c in kept] + [new[i] for i in added]
        ids += replaced + added
    # A case either run could not measure stays a miss until a record of it is merged in (the
    # host section's failure, until a run's host records are).
    measured = {c["id"] for c in out.get("cases") or []} | ({"host"} if later.get("host") else set())
    out["unmeasured"] = list({u["id"]: u for u in (base.get("unmeasured") or []) + (later.get("unmeasured") or [])
                              if u["id"] not in measured}.values())
    out["merged"] = list(base.get("merged", [])) + [{
        "created": later.get("created"), "command": later.get("command"), "cases": ids,
        "gpu": later.get("env", {}).get("gpu")}]
    return out


def _merged_note(result: dict) -> list[str]:
    lines = []
    for m in result.get("merged", []):
        lines += [f"Rows of these records come from a later run, **{m.get('created')}** on {m.get('gpu')} "
                  f"(`{m.get('command')}`), each measured beside its own references (copy, peers): "
                  f"{', '.join(m.get('cases', []))}.", ""]
    return lines


def _device_state_note(result: dict) -> list[str]:
    """The device's clocks, temperature, power and slowdown reasons over the run's timed figures
    (benchmark/device_state.py); nothing for a run recorded without them."""
    text = describe_device_state(run_device_summary(collect_device_states(result)))
    return [text, ""] if text else []


def render_markdown(result: dict | None) -> str:
    head = ["# Benchmarks", "",
            "<!-- Generated by rope_rtc/benchmark/report.py (render_markdown); edit that, not this file. -->", ""]
    if result is None:
        return "\n".join(head + [
            "No run recorded yet. On the GPU machine, from the repository root:", "",
            "    PYTHONPATH=. python3 scripts/bench.py --write-docs", "",
            "writes this page, `docs/benchmarks/<gpu>.json` (every sample) and `docs/benchmarks/<gpu>.png`.",
            "A saved run re-renders without a GPU: `python3 scripts/bench.py --from-json bench.json --write-docs`.",
            "", "## Method", "", METHOD_MD])
    env = result.get("env", {})
    slug = gpu_slug(result)
    big = result.get("big_copy") or {}
    versions = ", ".join(f"{k} {env[k]}" for k in ("rope_rtc", "nvrtc", "cupy", "cuda-bindings", "torch", "triton",
                                                   "transformers", "liger-kernel") if env.get(k))
    smi = env.get("nvidia_smi") if isinstance(env.get("nvidia_smi"), dict) else {}
    lines = head + [
        f"Latest run: **{result.get('created', '?')}** on **{env.get('gpu', '?')}** "
        f"(driver {smi.get('driver_version', env.get('cuda_driver', '?'))}, CUDA driver API {env.get('cuda_driver', '?')}, "
        f"L2 {int(env.get('l2_bytes', 0)) // MiB} MiB, SM clock {smi.get('clocks.sm', '?')} of {smi.get('clocks.max.sm', '?')}); "
        f"{versions}. {'Quick' if result.get('quick') else 'Full'} run, {result.get('elapsed_s', '?')} s.", "",
        *_device_state_note(result),
        *_merged_note(result),
        "Regenerate on the GPU machine, from the repository root:", "",
        f"    {result.get('command', 'PYTHONPATH=. python3 scripts/bench.py --write-docs')}", "",
        f"Every sample and the environment: [benchmarks/{slug}.json](benchmarks/{slug}.json). "
        f"Reference copy: 4 GiB moved at **{big.get('gbps', float('nan')):.0f} GB/s**.", "",
        "What to expect per shape class, and how and why the kernels are built as they are: "
        "[performance.md](performance.md).", "",
        f"![bandwidth against bytes moved](benchmarks/{slug}.png)", "",
        "## Targets", "", "The product's performance targets, judged on this run: PASS, MISS (with the gap), INFO (shown "
        "beside a target, not judged by it) or N/A (not measured in this run).", "", markdown_table(targets_table(result)), "",
        "## The blog's configuration", "",
        "B=4, H=32, D=128, FP32, interleaved, bhsd, q and k rotated in place. GB/s (% of the "
        "size-matched copy), cold L2. `auto` is the production kernel (`RopePlan`).", "",
        markdown_table(blog_table(result)), "",
        "## General kernel", "", "Fused q+k in place, B=4, H=32, D=128. GB/s (% of copy), cold L2.", "",
        markdown_table(prefill_table(result, "general")), "",
        "## Decode", "", "bf16 and fp16, `thd` with positions, Hq=32, Hkv=8, D=128. Per implementation: GPU µs per call "
        "under graph replay, hot / cold, then host µs per call.", "",
        markdown_table(latency_table(result, "decode")), "",
        "## Tail RoPE", "", "BF16, the cuDNN benchmark's geometries, `TailRoPEForward`. GB/s (% of copy), cold L2; "
        "GPU µs under graph replay and host µs for small shapes; the copy kernel is the naive one-thread-per-16-bytes "
        "reference. * partial cold footprint.", "",
        markdown_table(tail_table(result)), "",
        "## Host cost", "", "Host µs per call, Python loops of 100 calls queued behind a GPU kernel, the rows "
        "of each table sampled in turns; measured in several fresh processes (median process, each process "
        "beside it) where the column says so.", "", markdown_table(host_table(result)), "",
        "## Engine interfaces", "",
        "RoPE fused with the paged KV-cache write (`RopeCachePlan`; Hq=32, Hkv=8, D=128, `nhd` cache, blocks "
        "of 16 tokens in a random order, random positions, q and k in place) beside the two-step sequence and "
        "a copy of the bytes moved (q and k read and written, v read, the k and v entries written, table rows, "
        "positions and slots); decode under graph replay, prefill over buffers larger than the L2. ONNX "
        "`RotaryEmbedding` (float16 X [4, 32, 4096, 128] with position_ids) beside `apply_rope` on the same X. "
        "Multimodal RoPE (Qwen2-VL-7B's heads: Hq=28, Hkv=4, D=128; Qwen2-VL's contiguous sections [16, 24, 24] "
        "and Qwen3-VL's interleaved [24, 20, 20]; bf16 `thd`, random positions per stream, in place) beside our "
        "plain RoPE on the same arrays, a copy and the peers. DeepSeek-style MLA (`MlaRopeCachePlan`; DeepSeek-V3's "
        "shapes: q [T, 128, 128 + 64] bf16 with its last 64 channels rotated in place, k_pe [T, 64] rotated in "
        "place, kv_c [T, 512], the cache [blocks, 16, 576] in bf16 and FP8 e4m3, adjacent pairs, YaRN tables, "
        "random positions) beside a copy of its bytes and the two-step sequence (one `RopePlan` on the rotary "
        "parts, then a CuPy kernel writing the cache rows).",
        "", markdown_table(engine_table(result)), "",
        "## Cold start", "", "Fresh processes with an empty `ROPE_RTC_CACHE_DIR`, then the same (warm) directory. "
        "First result excludes imports and CUDA context creation, reported separately.", "",
        markdown_table(coldstart_table(result)), "",
    ]
    if result.get("skips"):
        lines += ["## Skipped", ""] + [f"- {s}" for s in result["skips"]] + [""]
    lines += ["## Method", "", METHOD_MD]
    return "\n".join(lines)


def write_docs(result: dict, docs_dir: Path, mirror: Path | None) -> list[Path]:
    slug = gpu_slug(result)
    written = []
    for root in [docs_dir] + ([mirror] if mirror else []):
        md = root / "benchmarks.md"
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(render_markdown(result))
        write_json(result, root / "benchmarks" / f"{slug}.json")
        written += [md, root / "benchmarks" / f"{slug}.json"]
        why = _safe_plot(result, root / "benchmarks" / f"{slug}.png")
        if why:
            print(f"plot skipped: {why}", flush=True)
        else:
            written.append(root / "benchmarks" / f"{slug}.png")
    return written


def report(result: dict, args: argparse.Namespace, json_path: Path | None) -> None:
    if json_path is not None:
        write_json(result, json_path)
        print(f"\nJSON: {json_path}", flush=True)
    if not args.no_plot and (args.plot or json_path is not None):
        plot_path = Path(args.plot) if args.plot else json_path.with_name("bench.png")
        why = _safe_plot(result, plot_path)
        print(f"plot skipped: {why}" if why else f"plot: {plot_path}", flush=True)
    if args.write_docs:
        docs = Path(args.docs_dir) if args.docs_dir else Path(__file__).resolve().parents[2] / "docs"
        out = os.environ.get("OUT")
        for p in write_docs(result, docs, Path(out) / "docs" if out else None):
            print(f"docs: {p}", flush=True)
    print("\n" + summary_text(result, targets_only=args.targets), flush=True)


