"""Running the benchmark: one case (check, then every regime of the copy, the copy kernel and each
implementation), the host-cost and cold-start sections, the GPU context and environment, and
:func:`run_benchmark`, the whole run."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from ..measure import CopyRunner
from .arguments import default_json_path, regenerate_command
from .buffers import SetBuffers, _bits, _subsample_indices, general_sample, to_host, tolerance_check
from .cases import (BIG_COPY_MOVED, COLD_FACTOR, COPY, COPY_KERNEL, DECODE_POSITIONS,
                    GRAPH_HOT_CALLS, HOST_PROCESSES, ONE_CALL, ONE_CALL_POOL, OURS, PEER_COLD_GRAPH_FACTOR, PEERS,
                    SCHEMA, SMALL_BYTES, TAIL_CHECK_TOKENS, TAIL_COLS, Case, MiB, Skip, Wrong, all_cases, cold_sets, selected)
from .device_state import DeviceMonitor
from .figures import timing
from .impls import Impl, Peers, Runner, _cupy_capture, _dist_version, impls_for
from .report import ROW_HEADER, format_row, write_json
from .timing import SETTLE_S, Clock, settle


# =============================================================================================
# running one case


def check_runner(ctx, case: Case, bufs: SetBuffers, runner: Runner) -> str:
    """Run the first call of set 0 and compare it with the reference; raises Wrong."""
    if case.group == "tail":
        return _check_tail(ctx, case, bufs, runner)
    from ..numerics.reference import assert_rope_close, rope_reference

    heads = (case.H, case.Hkv)
    inputs = [general_sample(case, a, bufs.layout, h) for a, h in ((bufs.q(0, False), heads[0]),
                                                                     (bufs.k(0, False), heads[1]))]
    cos, sin = ctx.cp.asnumpy(bufs.cos(0)), ctx.cp.asnumpy(bufs.sin(0))
    pos_all = ctx.cp.asnumpy(bufs.pos(0)).astype(np.int64) if case.group == "decode" else None
    outs = runner.run_once()
    ctx.stream.synchronize()
    worst = 0.0
    for (x, bi, si), out, h in zip(inputs, outs, heads):
        actual, _, _ = general_sample(case, out, runner.out_layout, h)
        spos = np.asarray(si, np.int64) if pos_all is None else pos_all[si]
        positions = np.tile(spos, len(bi))
        ref = rope_reference(x, cos, sin, positions, interleaved=runner.interleaved)
        if runner.strict:
            try:
                assert_rope_close(actual, ref, x, interleaved=runner.interleaved, dtype=np.dtype(actual.dtype))
            except AssertionError as exc:
                raise Wrong(str(exc).splitlines()[0][:300]) from None
        else:
            worst = max(worst, tolerance_check(actual, ref, x, runner.interleaved, case.dtype))
    return "ok" if runner.strict else f"ok ({worst:.2f} of tol)"


def _check_tail(ctx, case: Case, bufs: SetBuffers, runner: Runner) -> str:
    from ..numerics.reference import tail_rope_reference

    cp = ctx.cp
    ti = _subsample_indices(case.T, TAIL_CHECK_TOKENS)
    x = to_host(bufs.q(0, native=False)[ti], "bfloat16")
    cos, sin = cp.asnumpy(bufs.cos(0)[ti]), cp.asnumpy(bufs.sin(0)[ti])
    (out,) = runner.run_once()
    ctx.stream.synchronize()
    actual = to_host(_bits(out)[ti], "bfloat16")
    ref = tail_rope_reference(x, cos, sin)
    differ = int(np.count_nonzero(actual.view(np.uint16) != ref.view(np.uint16)))
    if runner.strict:
        if differ:
            raise Wrong(f"{differ} of {ref.size} values differ from the bit-exact reference")
        return "bit-exact"
    lo = case.D - 2 * TAIL_COLS
    if not np.array_equal(actual[..., :lo].view(np.uint16), x[..., :lo].view(np.uint16)):
        raise Wrong("the unrotated prefix was changed")
    from ..numerics.reference import rope_reference

    n, h, d = x.shape
    xt = x[..., lo:].reshape(n, h, 2 * TAIL_COLS)
    ref64 = rope_reference(xt, cos, sin, np.arange(n), interleaved=True)
    tolerance_check(actual[..., lo:], ref64, xt, True, "bfloat16")
    return "ok (bit-exact)" if not differ else f"ok ({differ}/{ref.size} not bit-exact)"


def measure(ctx, runner_fns: list, capture, small: bool, cold_n: int, cold_graph_over_us: float | None = None) -> dict:
    """Every regime for one implementation (or the copy). ``cold_graph_over_us``: the cold graph
    is left out (a ``skipped`` entry, no figure) when the hot graph replay takes longer."""
    clock = ctx.clock
    t: dict = {"hot": clock.events(runner_fns[:1])}
    if cold_n > 1:
        t["cold"] = clock.events(runner_fns[:cold_n])
    else:
        t["cold"] = dict(t["hot"], same_as="hot")
    if small and capture is not None:
        for regime, indices in (("graph", [0] * GRAPH_HOT_CALLS), ("graph_cold", list(range(cold_n)))):
            if regime == "graph_cold" and cold_n == 1:
                t[regime] = dict(t["graph"], same_as="graph")
                continue
            hot = t["graph"].get("us") if regime == "graph_cold" else None
            if hot is not None and cold_graph_over_us is not None and hot > cold_graph_over_us:
                t[regime] = {"skipped": f"hot graph replay {hot:.2f} µs is over {cold_graph_over_us:.2f} µs: "
                                        f"it cannot be faster than ours cold"}
                continue
            try:
                launch, keep = capture(indices)
                t[regime] = clock.events([launch], divisor=len(indices), sets=len(set(indices)))
                del launch, keep
            except Exception as exc:
                t[regime] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                with contextlib.suppress(Exception):
                    ctx.stream.synchronize()
    if small:
        t["host"] = clock.host(runner_fns[:1])
    return t


def _bench_kernels(device: int):
    """``cuda_src/bench_copy.cu`` loaded on ``device``: the copy and spin kernels."""
    from ..core.launcher import load_kernel
    from ..build.registry import KernelSpec

    return load_kernel(KernelSpec("bench_copy", "bench_copy.cu", ("bench_copy_16b", "bench_spin")), device)


def _plain_launcher(device: int, fields: list) -> tuple:
    """``(args, launcher)`` for a benchmark kernel: its own argument pack, launched plainly (no
    graph replay), as a caller's kernel would be."""
    from ..core.launcher import ArgPack, Launcher

    args = ArgPack(fields)
    launcher = Launcher(args.address, device)
    launcher.replay = False
    return args, launcher


class CopyKernelRunner:
    """The naive copy kernel (one thread per 16 bytes, ``cuda_src/bench_copy.cu``) over a
    :class:`CopyRunner`'s buffers: at small sizes, the floor of any kernel against the memcpy."""

    BLOCK = 256

    def __init__(self, stream, copy: CopyRunner, device: int) -> None:
        import ctypes

        from ..core.launcher import launch_prefix

        fn = _bench_kernels(device).functions["bench_copy_16b"]
        n16 = copy.half // 16
        prefix = launch_prefix(fn, (-(-n16 // self.BLOCK), 1, 1), (self.BLOCK, 1, 1))
        self._keep, self.fns = [], []
        for src, dst in copy.pairs:
            args, launcher = _plain_launcher(device, [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64),
                                                      ("n", ctypes.c_int64)])
            args.values.src, args.values.dst, args.values.n = src, dst, n16
            self._keep.append(args)
            self.fns.append(partial(launcher, prefix, stream.ptr))


class GpuHold:
    """``hold(us)``: enqueue on ``stream`` a one-thread kernel that keeps the GPU busy for ``us``
    microseconds (``bench_spin``), so that calls timed on the host right after it queue behind
    it and never wait for the GPU (:meth:`Clock.host`)."""

    def __init__(self, stream, device: int) -> None:
        import ctypes

        from ..core.launcher import launch_prefix

        self._args, self._launch = _plain_launcher(device, [("ns", ctypes.c_int64)])
        self._prefix = launch_prefix(_bench_kernels(device).functions["bench_spin"], (1, 1, 1), (1, 1, 1))
        self._stream = stream.ptr

    def __call__(self, us: float) -> None:
        self._args.values.ns = int(us * 1e3)
        self._launch(self._prefix, self._stream)


def run_case(ctx, case: Case) -> dict:
    cp = ctx.cp
    moved, foot = case.bytes_moved(), case.footprint()
    n = cold_sets(foot, ctx.l2)
    small = moved <= SMALL_BYTES
    if small:
        ctx.settle()
    rec = {"id": case.id, "group": case.group, "params": case.params(), "bytes_moved": moved, "footprint": foot,
           "sets": {"cold": n, "graph_cold": n},
           "cold_exact": n * foot >= COLD_FACTOR * ctx.l2, "small": small, "rows": []}
    print(f"\n[{case.id}] {moved / 1e6:.3f} MB moved, {n} cold set(s) of {foot / 1e6:.3f} MB"
          + ("" if rec["cold_exact"] else f" (partial: {n * foot / 1e6:.0f} MB < {COLD_FACTOR}x L2)"), flush=True)
    print(ROW_HEADER, flush=True)
    copy = CopyRunner(cp, ctx.stream, moved, n)
    row = {"impl": COPY, "layout": "-", "check": "-", "note": f"cudaMemcpyAsync of {copy.half} bytes"}
    row["timings"] = measure(ctx, copy.fns, _cupy_capture(ctx, copy.fns), small, n)
    rec["rows"].append(row)
    print(format_row(rec, row), flush=True)
    if case.group == "tail":
        kern = CopyKernelRunner(ctx.stream, copy, ctx.device)
        row = {"impl": COPY_KERNEL, "layout": "-", "check": "reference", "note": f"one thread per 16 B, {copy.half} bytes"}
        row["timings"] = measure(ctx, kern.fns, _cupy_capture(ctx, kern.fns), small, n)
        rec["rows"].append(row)
        print(format_row(rec, row), flush=True)
        del kern
    del copy
    buffers: dict[str, SetBuffers] = {}
    paired: dict[str, tuple] = {}
    for impl in impls_for(case):
        row = run_impl(ctx, case, impl, buffers, n, small, rec, paired)
        if row is not None:
            rec["rows"].append(row)
            print(format_row(rec, row), flush=True)
    pair_one_call(ctx, paired, n)
    paired.clear()
    buffers.clear()
    ctx.free()
    return rec


# The rows whose cold samples are also taken in turns (pair_one_call).
PAIRED = (OURS, ONE_CALL)


def pair_one_call(ctx, paired: dict, n: int) -> None:
    """The plan and the one-call function on the same buffers, their cold samples taken again in
    turns (``cold_paired``): the one-call prefill target judges a difference of a point or less,
    which two measurements taken one after the other do not resolve (the clocks drift by as much
    between them)."""
    if len(paired) != len(PAIRED):
        return
    rows = [paired[name] for name in PAIRED]
    try:
        stats = ctx.clock.events_in_turns([runner.fns[:n] for _, runner in rows])
    except Exception as exc:
        rows[0][0]["note"] += f"; paired timing failed: {type(exc).__name__}: {exc}"[:300]
        _recover(ctx)
        return
    for (row, _), t in zip(rows, stats):
        row["timings"]["cold_paired"] = t


def run_impl(ctx, case: Case, impl: Impl, buffers: dict, n: int, small: bool, rec: dict,
             paired: dict | None = None) -> dict | None:
    """One implementation's row. ``paired``: where the rows of PAIRED on large general cases
    leave (row, runner) for :func:`pair_one_call`."""
    layout = impl.layout_for(case)
    if layout is None or (impl.peer is not None and impl.peer not in ctx.peers.wanted):
        return None
    row = {"impl": impl.name, "layout": layout, "check": "", "note": "", "timings": {}}
    if impl.peer is not None and not ctx.peers.available(impl.peer):
        row["check"] = "skip: unavailable (see the skip lines)"
        return row
    runner = None
    try:
        if layout not in buffers:
            buffers[layout] = SetBuffers(cp=ctx.cp, case=case, layout=layout, n=n, seed=ctx.seed)
        runner = impl.setup(ctx, case, buffers[layout])
        row["layout"], row["note"] = runner.layout_note, runner.note
        row["check"] = check_runner(ctx, case, buffers[layout], runner)
    except Skip as exc:
        row["check"] = f"skip: {exc}"
        return row
    except Wrong as exc:
        row["check"] = f"WRONG: {exc}"
        return row
    except Exception as exc:
        row["check"] = f"error: {type(exc).__name__}: {exc}"[:400]
        _recover(ctx)
        return row
    try:
        row["timings"] = measure(ctx, runner.fns, runner.capture, small, n,
                                 _peer_cold_graph_bound(rec["rows"]) if impl.peer is not None else None)
    except Exception as exc:
        row["note"] += f"; timing failed: {type(exc).__name__}: {exc}"[:300]
        _recover(ctx)
        return row
    if paired is not None and impl.name in PAIRED and case.group == "general" and not small:
        paired[impl.name] = (row, runner)
    return row


def _peer_cold_graph_bound(rows: list[dict]) -> float | None:
    """The hot graph time over which a peer is not replayed cold: PEER_COLD_GRAPH_FACTOR times the
    slowest cold graph replay of the rows measured before it that are not peers (the copy's and
    ours), None if any of them has none."""
    cold = [timing(r, "graph_cold") for r in rows if r["impl"] not in PEERS]
    if not cold or any(us is None for us in cold):
        return None
    return PEER_COLD_GRAPH_FACTOR * max(cold)


def _recover(ctx) -> None:
    with contextlib.suppress(Exception):
        if ctx.stream.is_capturing():
            ctx.stream.end_capture()
    with contextlib.suppress(Exception):
        ctx.stream.synchronize()


# --- host cost and cold start ------------------------------------------------------------------


def run_host_section(ctx) -> list[dict]:
    """Host µs per call of the prepared plans and the one-call APIs (small shapes, same arrays)."""
    from ..ops.rope import RopePlan, apply_rope_qk
    from ..ops.tail import TailRoPEForward, tail_rope

    cp = ctx.cp
    recs = []
    dcase = Case("decode", "bfloat16", "thd", False, 1, 1, 32, 8, 128)
    b = SetBuffers(ctx.cp, dcase, "thd", 2, ctx.seed)
    qk = [(b.q(i), b.k(i), b.cos(i), b.sin(i), b.pos(i)) for i in range(2)]
    one = partial(apply_rope_qk, b.q(0), b.k(0), b.cos(0), b.sin(0), positions=b.pos(0), layout="thd",
                  q_out=b.q(0), k_out=b.k(0))
    copy = CopyRunner(cp, ctx.stream, dcase.bytes_moved(), 1)
    recs.append(_host_record(ctx, "host/decode-bf16-T=1", dcase, plan_host_rows(
        "RopePlan.execute", lambda: RopePlan(*qk[0][:4], positions=b.pos(0), layout="thd").compile(), qk) + [
        ("apply_rope_qk (one call, in place)", [one]),
        ("cudaMemcpyAsync (reference)", copy.fns[:1]),
    ]))
    tcase = Case("tail", "bfloat16", "thd", True, 1, 1, 64, 0, 512)
    tb = SetBuffers(ctx.cp, tcase, "thd", 2, ctx.seed)
    tsets = [(tb.q(i), tb.cos(i), tb.sin(i), tb.out(i)) for i in range(2)]
    tone = partial(tail_rope, tb.q(0), tb.cos(0), tb.sin(0))
    recs.append(_host_record(ctx, "host/tail-T=1-H=64-D=512", tcase, plan_host_rows(
        "TailRoPEForward.execute", lambda: TailRoPEForward(*tsets[0]).check_support().compile(), tsets) + [
        ("tail_rope (one call, allocates the output)", [tone]),
    ]))
    recs += one_call_host_records(ctx)
    ctx.free()
    return recs


def one_call_host_records(ctx) -> list[dict]:
    """Host µs per call of the one-call functions with new arrays of a seen signature on every
    call (ONE_CALL_POOL array sets made beforehand and cycled, so neither CuPy's slicing nor an
    identity cache is in the figure), beside the same arrays every call, RopePlan.execute, a
    bare cudaMemcpyAsync and CuPy's ``x * 2``. Run on the measuring stream made current."""
    from ..ops.rope import RopePlan, apply_rope, apply_rope_qk
    from ..ops.tail import TailRoPEForward, tail_rope

    cp = ctx.cp
    recs = []
    with ctx.stream:
        dcase = Case("decode", "bfloat16", "bshd", False, 8, 1, 32, 8, 128)
        b = SetBuffers(cp, dcase, "bshd", ONE_CALL_POOL, ctx.seed)
        cos, sin = b.cos(0), b.sin(0)
        starts = cp.random.RandomState(ctx.seed).randint(0, DECODE_POSITIONS - 1, size=(ONE_CALL_POOL, dcase.B),
                                                         dtype=cp.int32)
        sets = [(b.q(i), b.k(i), starts[i]) for i in range(ONE_CALL_POOL)]
        outs = [cp.empty_like(b.q(i)) for i in range(ONE_CALL_POOL)]
        q0, k0, o0 = sets[0]
        plan = RopePlan(q0, k0, cos, sin, offset=o0, layout="bshd").compile()
        qk = [partial(apply_rope_qk, q, k, cos, sin, offset=o, q_out=q, k_out=k, layout="bshd") for q, k, o in sets]
        one = [partial(apply_rope, q, cos, sin, offset=7, layout="bshd") for q, _, _ in sets]
        one_out = [partial(apply_rope, q, cos, sin, offset=7, out=out, layout="bshd")
                   for (q, _, _), out in zip(sets, outs)]
        # The engines' convention on the same buffers: flat [T, H * D] q/k (views made beforehand), one
        # combined cos_sin_cache, int64 positions.
        cache = cp.ascontiguousarray(cp.concatenate([cos, sin], axis=1))
        positions = cp.random.RandomState(ctx.seed + 1).randint(0, DECODE_POSITIONS, size=(ONE_CALL_POOL, dcase.B),
                                                                dtype=cp.int64)
        flat = [(q.reshape(dcase.B, -1), k.reshape(dcase.B, -1), positions[i]) for i, (q, k, _) in enumerate(sets)]
        conv = dict(cos_sin_cache=cache, layout="thd", head_dim=dcase.D)
        engine = [partial(apply_rope_qk, q, k, positions=p, q_out=q, k_out=k, **conv) for q, k, p in flat]
        cplan = RopePlan(flat[0][0], flat[0][1], positions=flat[0][2], **conv).compile()
        cplan_new = [partial(cplan.execute, q, k, positions=p, cos_sin_cache=cache) for q, k, p in flat]
        copy = CopyRunner(cp, ctx.stream, dcase.bytes_moved(), 1)
        x = b.q(0).view(cp.uint16).astype(cp.float32)
        recs.append(_host_record(ctx, "host/one-call-decode-bf16-B=8", dcase, [
            ("RopePlan.execute (same arrays)", [partial(plan.execute, q0, k0, cos, sin, offset=o0)]),
            ("apply_rope_qk (same arrays, in place, offset array)", qk[:1]),
            (f"apply_rope_qk ({ONE_CALL_POOL} array sets cycled, in place, offset array)", qk),
            (f"apply_rope_qk, engines' convention (flat q/k, cos_sin_cache, positions; {ONE_CALL_POOL} array sets "
             "cycled, in place)", engine),
            (f"RopePlan.execute, engines' convention ({ONE_CALL_POOL} array sets cycled, in place)", cplan_new),
            ("apply_rope (same arrays, allocates the output, offset=7)", one[:1]),
            (f"apply_rope ({ONE_CALL_POOL} array sets cycled, allocates the output, offset=7)", one),
            (f"apply_rope ({ONE_CALL_POOL} array sets cycled, out=, offset=7)", one_out),
            ("cudaMemcpyAsync (reference)", copy.fns[:1]),
            ("CuPy x * 2 (reference)", [partial(cp.multiply, x, 2)]),
        ]))
        tcase = Case("tail", "bfloat16", "thd", True, 1, 4, 64, 0, 512)
        tb = SetBuffers(cp, tcase, "thd", ONE_CALL_POOL, ctx.seed)
        tsets = [(tb.q(i), tb.cos(i), tb.sin(i)) for i in range(ONE_CALL_POOL)]
        tplan = TailRoPEForward(*tsets[0], tb.out(0)).check_support().compile()
        tone = [partial(tail_rope, *t) for t in tsets]
        recs.append(_host_record(ctx, "host/one-call-tail-T=4-H=64-D=512", tcase, [
            ("TailRoPEForward.execute (same arrays)", [partial(tplan.execute, *tsets[0], tb.out(0))]),
            ("tail_rope (same arrays, allocates the output)", tone[:1]),
            (f"tail_rope ({ONE_CALL_POOL} array sets cycled, allocates the output)", tone),
        ]))
    return recs


def plan_host_rows(label: str, make_plan, sets: list) -> list:
    """The host rows of one prepared plan, from ``make_plan()`` (a compiled plan) and two argument
    sets: the same arrays with graph replay on and off, the two sets alternating, and new views
    of the first set every call (the pointer checks; the slicing is included)."""
    plan, plain = make_plan(), make_plan()
    plain._core.launcher.replay = False  # what ROPE_RTC_NO_GRAPH_REPLAY=1 gives
    same, other = (partial(plan.execute, *args) for args in sets)
    first = sets[0]
    fresh = lambda: plan.execute(*(a[:] for a in first))  # noqa: E731 - new view objects
    return [
        (f"{label} (same arrays)", [same]),
        (f"{label} (same arrays, graph replay off: cuLaunchKernel)", [partial(plain.execute, *first)]),
        (f"{label} (2 remembered array sets alternating)", [same, other]),
        (f"{label} (new views each call: pointer checks; incl. {len(first)} slicings)", [fresh]),
    ]


def _host_record(ctx, ident: str, case: Case, items: list) -> dict:
    rec = {"id": ident, "group": "host", "params": case.params(), "bytes_moved": case.bytes_moved(),
           "footprint": case.footprint(), "sets": {}, "cold_exact": False, "small": True, "rows": []}
    print(f"\n[{ident}]", flush=True)
    # The rows' samples in turns (Clock.host_rows): their ratios compare calls, not stretches of time.
    results = ctx.clock.host_rows([fns for _, fns in items])
    for (name, _), res in zip(items, results):
        row = {"impl": name, "layout": case.layout, "check": "-", "note": "", "timings": {}}
        if isinstance(res, BaseException):
            row["check"] = f"error: {type(res).__name__}: {res}"[:300]
            print(f"  {name:<66} {row['check']}", flush=True)
            _recover(ctx)
        else:
            row["timings"]["host"] = res
            print(f"  {name:<66} {res['us']:8.2f} µs/call", flush=True)
        rec["rows"].append(row)
    return rec


HOST_CHILD_ENV = "ROPE_RTC_BENCH_HOST_CHILD"  # set in the processes run_host_processes starts


def run_host_processes(args: argparse.Namespace, skips: list, n: int = HOST_PROCESSES) -> list[dict]:
    """The host-cost section measured in ``n`` fresh processes, one after the other (each runs
    ``--cases host`` with ``HOST_CHILD_ENV`` set); per row, the figures of the process with the
    median time, and every process's time beside them (``processes_us``).

    Why processes: on a shared host the same rows, their samples taken in turns, can run much
    slower in one process than in the next, so one process's figures are a draw."""
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p))
    env[HOST_CHILD_ENV] = "1"
    runs = []
    print(f"\n[host] the host-cost section in {n} fresh processes", flush=True)
    for i in range(n):
        with tempfile.TemporaryDirectory(prefix="rope_rtc_bench_host_") as tmp:
            out = Path(tmp) / "host.json"
            cmd = [sys.executable, "-c", "from rope_rtc.bench import main; raise SystemExit(main())", "--cases", "host",
                   "--peers", "none", "--no-plot", "--json", str(out), "--device", str(args.device),
                   "--seed", str(args.seed)] + (["--quick"] if args.quick else [])
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
                host = json.loads(out.read_text()).get("host") if out.exists() else None
                if proc.returncode != 0 or not host:
                    raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}")
                runs.append(host)
                print(f"  process {i + 1}: done", flush=True)
            except Exception as exc:  # noqa: BLE001 - recorded
                skips.append(f"host process {i + 1} failed: {type(exc).__name__}: {exc}"[:400])
                print(f"  {skips[-1]}", flush=True)
    combined = combine_host_runs(runs)
    for rec in combined:
        print(f"\n[{rec['id']}]", flush=True)
        for row in rec["rows"]:
            h = row["timings"].get("host")
            each = ", ".join(f"{u:.2f}" for u in h.get("processes_us", [])) if h else ""
            print(f"  {row['impl']:<66} {'-' if not h else format(h['us'], '8.2f')} µs/call  ({each})", flush=True)
    return combined


def combine_host_runs(runs: list[list[dict]]) -> list[dict]:
    """Host-cost records of several processes as one: each row with the timings of the process
    whose time for that row is the median (the lower middle of an even count), plus every
    process's time in ``processes_us``; a row no process measured keeps the first run's row (its
    error)."""
    if not runs:
        return []
    out = []
    for rec in runs[0]:
        others = [next((r for r in run if r["id"] == rec["id"]), None) for run in runs]
        rows = []
        for row in rec["rows"]:
            found = []
            for other in others:
                match = None if other is None else next((r for r in other["rows"] if r["impl"] == row["impl"]), None)
                h = None if match is None else match["timings"].get("host")
                if h and h.get("us") is not None:
                    found.append((h["us"], match))
            if not found:
                rows.append(row)
                continue
            found.sort(key=lambda f: f[0])
            chosen = found[(len(found) - 1) // 2][1]
            rows.append(dict(chosen, timings=dict(chosen["timings"], host=dict(
                chosen["timings"]["host"], processes_us=[round(f[0], 4) for f in found]))))
        out.append(dict(rec, rows=rows, processes=len(runs)))
    return out


COLDSTART_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np, ml_dtypes, cupy as cp
import rope_rtc, rope_rtc.ops.rope, rope_rtc.ops.tail, rope_rtc.core.launcher, rope_rtc.build.kernels
from cuda.bindings import driver as _drv
t1 = time.perf_counter()
cp.cuda.Device(0).use(); cp.empty(1); cp.cuda.runtime.deviceSynchronize()
t2 = time.perf_counter()
rng = np.random.default_rng(0)
bf16 = ml_dtypes.bfloat16
if sys.argv[1] == "general":
    q = cp.asarray(rng.standard_normal((1, 16, 8, 128)).astype(bf16))
    k = cp.asarray(rng.standard_normal((1, 16, 2, 128)).astype(bf16))
    c, s = rope_rtc.rope_tables(16, 128, xp=cp)
else:
    x = cp.asarray(rng.standard_normal((4, 8, 512)).astype(bf16))
    ang = rng.uniform(-3, 3, (4, 32))
    c, s = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
cp.cuda.runtime.deviceSynchronize()
t3 = time.perf_counter()
if sys.argv[1] == "general":
    rope_rtc.apply_rope_qk(q, k, c, s, layout="bshd")
else:
    rope_rtc.tail_rope(x, c, s)
cp.cuda.runtime.deviceSynchronize()
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "context_s": t2 - t1, "first_result_s": t4 - t3}))
"""

_COMPILE_LOG = re.compile(r"compiled (\S+) for (\S+) in ([0-9.]+) s")


def run_coldstart(ctx) -> list[dict]:
    """First result in fresh processes: empty cache, then the same (now warm) cache."""
    rows = []
    repo = str(Path(__file__).resolve().parents[2])
    print("\n[coldstart] fresh processes, ROPE_RTC_CACHE_DIR = an empty temporary directory", flush=True)
    for scenario in ("general", "tail"):
        with tempfile.TemporaryDirectory(prefix="rope_rtc_bench_cache_") as cache:
            env = dict(os.environ, ROPE_RTC_CACHE_DIR=cache, ROPE_RTC_LOG_COMPILES="1",
                       PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p))
            env.pop("ROPE_RTC_NO_COMPILE", None)
            for state in ("empty", "warm"):
                rows.append(_coldstart_child(scenario, state, env))
                r = rows[-1]
                if r.get("error"):
                    print(f"  {scenario:<8} {state:<6} error: {r['error']}", flush=True)
                else:
                    comp = ", ".join(f"{c['kernel']} {c['seconds']:.3f} s" for c in r["compiles"]) or "none"
                    print(f"  {scenario:<8} {state:<6} import {r['import_s']:.3f} s, context {r['context_s']:.3f} s, "
                          f"first result {r['first_result_s'] * 1e3:.1f} ms; compiles: {comp}", flush=True)
    return rows


def _coldstart_child(scenario: str, state: str, env: dict) -> dict:
    row = {"scenario": scenario, "cache": state, "compiles": []}
    try:
        proc = subprocess.run([sys.executable, "-c", COLDSTART_CHILD, scenario], env=env, capture_output=True,
                              text=True, timeout=180)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            row["error"] = f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-400:]}"
            return row
        row.update(json.loads(lines[-1]))
        row["compiles"] = [{"kernel": m.group(1), "arch": m.group(2), "seconds": float(m.group(3))}
                           for m in _COMPILE_LOG.finditer(proc.stderr)]
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


# =============================================================================================
# the run


class Context:
    """The GPU, the stream every measurement uses, the clock, the peers."""

    def __init__(self, args: argparse.Namespace) -> None:
        import cupy as cp

        self.cp = cp
        self.settle_note: str | None = None  # what settling did, once it has run (Context.settle)
        self.device = args.device
        cp.cuda.Device(args.device).use()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.l2 = _l2_bytes(cp, args.device)
        self.clock = Clock(cp, self.stream, args.quick)
        self.clock.hold = GpuHold(self.stream, args.device)
        self.clock.monitor, self.monitor_note = DeviceMonitor.open(cp, args.device)
        self.seed = args.seed
        self.quick = args.quick  # the engine section measures fewer MLA decode sizes
        self.peers: Peers | None = None

    def settle(self) -> None:
        """Once per process, before the first small GPU timing: :func:`timing.settle`. A failure
        is said (``settle_note``, kept in the JSON) and not retried."""
        if self.settle_note is not None:
            return
        try:
            settle(self.cp, self.stream)
            self.settle_note = f"{SETTLE_S:g} s of small launches before the first small timing"
        except Exception as exc:
            self.settle_note = (f"settling failed, so small timings may include the process's first seconds: "
                                f"{type(exc).__name__}: {exc}")[:300]
            _recover(self)
        print(f"settling: {self.settle_note}", flush=True)

    def free(self) -> None:
        gc.collect()
        with contextlib.suppress(Exception):
            self.stream.synchronize()
            self.cp.get_default_memory_pool().free_all_blocks()
        if self.peers is not None and self.peers.torch is not None:
            with contextlib.suppress(Exception):
                self.peers.torch.cuda.empty_cache()


def _l2_bytes(cp, device: int) -> int:
    try:
        return int(cp.cuda.Device(device).attributes["L2CacheSize"])
    except Exception:
        try:
            return int(cp.cuda.runtime.getDeviceProperties(device)["l2CacheSize"])
        except Exception:
            return 60 * MiB


def gpu_unavailable_reason() -> str | None:
    try:
        import cupy as cp
    except Exception as exc:
        return f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        from ..core import driver

        reason = driver.unavailable_reason()
        if reason:
            return reason
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def environment(ctx) -> dict:
    from .._version import __version__

    cp = ctx.cp
    env: dict = {"python": sys.version.split()[0], "platform": platform.platform(), "rope_rtc": __version__,
                 "cupy": cp.__version__}
    with contextlib.suppress(Exception):
        props = cp.cuda.runtime.getDeviceProperties(ctx.device)
        name = props.get("name", b"")
        env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        env["compute_capability"] = f"{props.get('major')}.{props.get('minor')}"
        env["sm_count"] = props.get("multiProcessorCount")
        env["memory_bytes"] = props.get("totalGlobalMem")
        for key in ("clockRate", "memoryClockRate", "memoryBusWidth"):
            if props.get(key) is not None:
                env[key] = props.get(key)
    env["l2_bytes"] = ctx.l2
    with contextlib.suppress(Exception):
        env["cuda_runtime"] = _cuda_version_text(cp.cuda.runtime.runtimeGetVersion())
        env["cuda_driver"] = _cuda_version_text(cp.cuda.runtime.driverGetVersion())
    with contextlib.suppress(Exception):
        from ..build.toolchain import nvrtc_version

        env["nvrtc"] = "%d.%d" % nvrtc_version()
    for dist in ("cuda-bindings", "numpy", "ml_dtypes", "torch", "triton", "transformers", "liger-kernel", "matplotlib"):
        v = _dist_version(dist)
        if v:
            env[dist] = v
    env["nvidia_smi"] = _nvidia_smi()
    env["device_state"] = getattr(ctx, "monitor_note", "not read")
    return env


def _cuda_version_text(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _nvidia_smi() -> dict | str:
    fields = ("name", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
              "power.limit", "temperature.gpu", "persistence_mode")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
        if out.returncode != 0:
            return f"nvidia-smi exit {out.returncode}"
        first = out.stdout.strip().splitlines()[0]
        return dict(zip(fields, (v.strip() for v in first.split(","))))
    except Exception as exc:
        return f"unavailable ({type(exc).__name__})"


def measure_big_copy(ctx) -> dict | None:
    try:
        copy = CopyRunner(ctx.cp, ctx.stream, BIG_COPY_MOVED, 1)
        t = ctx.clock.events(copy.fns)
        del copy
        ctx.free()
        return {"bytes_moved": BIG_COPY_MOVED, "us": t["us"], "gbps": BIG_COPY_MOVED / t["us"] / 1e3, "timing": t}
    except Exception as exc:
        print(f"big copy failed: {type(exc).__name__}: {exc}", flush=True)
        _recover(ctx)
        ctx.free()
        return None


NOT_REACHED = "not reached: the run ended before it"


def _unmeasured_entry(case: Case, l2: int, why: str) -> dict:
    """A selected case without a record, as the targets that judge its group count it: a miss
    (report._unmeasured), never a case left out of the judgement."""
    foot = case.footprint()
    return {"id": case.id, "group": case.group, "params": case.params(), "bytes_moved": case.bytes_moved(),
            "cold_exact": cold_sets(foot, l2) * foot >= COLD_FACTOR * l2, "why": why[:300]}


def _record_unmeasured(result: dict, case: Case, l2: int, why: str, head: str) -> None:
    """``case`` could not be measured: a skip line, and its entry says why (it replaces the
    entry every selected case has until its record lands, run_benchmark)."""
    line = f"{head}{why}"[:400]
    result["skips"].append(line)
    result["unmeasured"] = [u for u in result["unmeasured"] if u["id"] != case.id] + [
        _unmeasured_entry(case, l2, why)]
    print(line, flush=True)


def run_benchmark(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    deadline = started + args.time_budget
    ctx = Context(args)
    json_path = default_json_path(args)
    result: dict = {"schema": SCHEMA, "tool": "rope_rtc.bench",
                    "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "command": regenerate_command(args), "argv": sys.argv[1:], "quick": args.quick,
                    "options": {"peers": args.peer_list, "cases": args.cases, "compile_budget_s": args.compile_budget,
                                "time_budget_s": args.time_budget, "seed": args.seed},
                    "skips": [], "unmeasured": [], "cases": [], "host": [], "engine": [], "coldstart": []}
    with ctx.stream:
        result["env"] = environment(ctx)
        result["l2_bytes"] = ctx.l2
        env = result["env"]
        print(f"{env.get('gpu', '?')}: L2 {ctx.l2 / MiB:.0f} MiB, CUDA driver {env.get('cuda_driver', '?')}, "
              f"NVRTC {env.get('nvrtc', '?')}, CuPy {env.get('cupy')}, torch {env.get('torch', '-')}, "
              f"Liger {env.get('liger-kernel', '-')}", flush=True)
        tokens = args.case_tokens
        if selected("coldstart", "coldstart", tokens):
            result["coldstart"] = run_coldstart(ctx)
        ctx.peers = Peers(args.peer_list, args.compile_budget, ctx.stream.ptr)
        result["skips"] = ctx.peers.skips
        result["env"].update({f"peer_{k}": v for k, v in ctx.peers.versions.items()})
        result["env"]["hf_apply"] = ctx.peers.hf_source
        if selected("host", "host", tokens):
            try:
                if os.environ.get(HOST_CHILD_ENV) == "1":
                    result["host"] = run_host_section(ctx)
                else:
                    result["host"] = run_host_processes(args, result["skips"])
                if not result["host"]:
                    raise RuntimeError("no host-cost process finished (see the skip lines)")
            except Exception as exc:
                result["skips"].append(f"host section failed: {type(exc).__name__}: {exc}")
                result["unmeasured"].append({"id": "host", "group": "host", "why": result["skips"][-1][:300]})
                print(result["skips"][-1], flush=True)
                _recover(ctx)
        if selected("engine", "engine", tokens) or any(t.startswith("engine/") for t in tokens or ()):
            from .engine import engine_failures, run_engine_section

            ctx.settle()  # its decode records time small calls
            try:
                result["engine"] = run_engine_section(ctx, measure, CopyRunner, tokens)
            except Exception as exc:
                result["skips"].append(f"engine section failed: {type(exc).__name__}: {exc}"[:400])
                # a failure record of every selected job, as for one job's failure: its targets miss
                result["engine"] = engine_failures(result["skips"][-1], tokens, args.quick)
                print(result["skips"][-1], flush=True)
                _recover(ctx)
                ctx.free()
        result["big_copy"] = measure_big_copy(ctx)
        chosen = [case for case in all_cases(args.quick) if selected(case.id, case.group, tokens)]
        # Every selected case counts as unmeasured until its record lands: a JSON written by a run
        # that was killed part way (below, after each case) judges the cases it never reached.
        result["unmeasured"] += [_unmeasured_entry(case, ctx.l2, NOT_REACHED) for case in chosen]
        for case in chosen:
            if time.monotonic() > deadline:
                _record_unmeasured(result, case, ctx.l2,
                                   f"time budget of {args.time_budget:.0f} s spent (--time-budget)", f"skip {case.id}: ")
                continue
            try:
                case_started = time.monotonic()
                result["cases"].append(run_case(ctx, case))
                # what a case costs the run, to size --time-budget by
                result["cases"][-1]["elapsed_s"] = round(time.monotonic() - case_started, 1)
                result["unmeasured"] = [u for u in result["unmeasured"] if u["id"] != case.id]
            except Exception as exc:
                _record_unmeasured(result, case, ctx.l2, f"{type(exc).__name__}: {exc}", f"case {case.id} failed: ")
                _recover(ctx)
                ctx.free()
            result["compile_log"] = ctx.peers.compile_log
            result["elapsed_s"] = round(time.monotonic() - started, 1)
            write_json(result, json_path)   # partial results survive a kill
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    result["compile_log"] = ctx.peers.compile_log if ctx.peers else []
    result["settle"] = ctx.settle_note  # None: nothing small was timed in this process
    return result


