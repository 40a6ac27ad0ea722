"""``rope_rtc.jax`` inside ``jax.jit`` beside the same RoPE written in jnp and fused by XLA and beside
a same-size copy: the engine records ``engine/jax-prefill/...`` and ``engine/jax-decode/...``.

They are measured in a child process (``python -m rope_rtc.benchmark.engine_jax OUT.json``), so that
JAX's allocator and CUDA libraries never share a process with the benchmark's torch and CuPy pools;
:func:`jax_records` runs it and reads its records back.

GPU time: CUDA events recorded on XLA's own stream from inside the program (two small buffer
callbacks, :class:`Window`), around a chain of calls queued behind a spinning kernel, so that the
calls run back to back whatever the host's speed; µs per call is the window over the chain's
length, median of ``RUNS``. Consecutive calls are kept apart by ``jax.lax.optimization_barrier``
(XLA would otherwise fuse a chain of jnp rotations into one kernel); q and k are rotated in place.

- prefill: bf16 ``bshd`` q and k ``[4, 4096, 32, 128]``, positions 0..4095, against a copy of the
  bytes moved (cold L2);
- decode: bf16 q ``[B, 1, 32, 128]``, k ``[B, 1, 8, 128]``, one offset per sequence (traced),
  against a CUDA graph of copy nodes of the bytes moved; each row's note gives the host µs per
  call inside a jitted step of ``LAYERS`` chained calls.

``benchmarks/probes/jax_cost.py`` uses the same pieces for its command-buffer comparisons.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..measure import CopyRunner, gpu_us, graph_us
from .cases import COPY, JAX_OURS, JAX_XLA
from .timing import settle

SPIN = r"""extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}"""
SPIN_CYCLES = 400_000_000  # about 0.2 s: longer than the host takes to queue a chain
RUNS = 5
PREFILL = (4, 4096, 32, 128)  # B, S, H (q and k), D
DECODE_HEADS = (32, 8, 128)  # Hq, Hkv, D
DECODE_B, DECODE_B_QUICK = (1, 8, 64), (8,)
PREFILL_CHAIN, DECODE_CHAIN = 10, 200
LAYERS = 32  # calls per jitted step in the host figure
TABLE_ROWS = 4096
CHILD_TIMEOUT_S = 300
NO_JAX = 3  # the child's exit status when JAX or its CUDA backend is missing


class Window:
    """CUDA events on XLA's stream, recorded by buffer callbacks: ``begin`` queues a spinning
    kernel then the start event, ``end`` the end event; both pass their arrays through
    (aliased, no copy)."""

    def __init__(self, jax, cp) -> None:
        from jax.experimental.buffer_callback import buffer_callback

        self.cp = cp
        self.start, self.stop = cp.cuda.Event(), cp.cuda.Event()
        kernel = cp.RawKernel(SPIN, "spin")

        def stream_of(ctx, buffer):
            cp.cuda.runtime.setDevice(buffer.__dlpack_device__()[1])  # XLA's thread: the device current
            return cp.cuda.ExternalStream(ctx.stream)

        def begin(ctx, outs, *xs):
            stream = stream_of(ctx, xs[0])
            with stream:
                kernel((1,), (1,), (np.int64(SPIN_CYCLES),))
            self.start.record(stream)

        def end(ctx, outs, *xs):
            self.stop.record(stream_of(ctx, xs[0]))

        def passing(fn):
            def call(*xs):
                results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs)
                return buffer_callback(fn, results, input_output_aliases={i: i for i in range(len(xs))})(*xs)
            return call

        self.begin, self.end = passing(begin), passing(end)

    def ms(self) -> float:
        self.stop.synchronize()
        return self.cp.cuda.get_elapsed_time(self.start, self.stop)


def chain_fn(jax, rj, window: Window, backend: str, length: int, offset):
    """A jitted chain of ``length`` in-place rotations of (q, k) inside the event window (``offset``
    None: the traced offsets argument)."""

    def chain(q, k, cos, sin, offsets):
        q, k = window.begin(q, k)
        for _ in range(length):
            q, k = rj.apply_rope_qk(q, k, cos, sin, offset=offsets if offset is None else offset, layout="bshd",
                                    backend=backend)
            q, k = jax.lax.optimization_barrier((q, k))
        return window.end(q, k)

    return jax.jit(chain)


def chain_us(jax, fn, args, window: Window, length: int) -> float:
    """GPU µs per call of a chain made by :func:`chain_fn`, median of ``RUNS`` runs."""
    jax.block_until_ready(fn(*args))  # compiled, kernels loaded
    times = []
    for _ in range(RUNS):
        jax.block_until_ready(fn(*args))
        times.append(window.ms() * 1e3 / length)
    return statistics.median(times)


def inputs(jnp, rng, b: int, s: int, hq: int, hk: int, d: int, rows: int):
    """bf16 q [b, s, hq, d] and k [b, s, hk, d], float32 tables of ``rows`` rows, an offset per sequence."""
    import ml_dtypes

    import rope_rtc

    bf16 = ml_dtypes.bfloat16
    q = jnp.asarray(rng.standard_normal((b, s, hq, d)).astype(bf16))
    k = jnp.asarray(rng.standard_normal((b, s, hk, d)).astype(bf16))
    cos, sin = (jnp.asarray(t) for t in rope_rtc.rope_tables(rows, d))
    offsets = jnp.asarray(rng.integers(0, max(rows - s, 1), b).astype(np.int32))
    return q, k, cos, sin, offsets


@contextlib.contextmanager
def command_buffers(on: bool):
    """buffer_callback's ``command_buffer_compatible`` for the calls staged inside."""
    from rope_rtc.jax import kernel_call

    before, kernel_call.COMMAND_BUFFER = kernel_call.COMMAND_BUFFER, on
    try:
        yield
    finally:
        kernel_call.COMMAND_BUFFER = before


def step_fn(jax, rj, backend: str, layers: int):
    """A jitted decode step of ``layers`` chained rotations (no event window)."""

    def step(q, k, cos, sin, offsets):
        for _ in range(layers):
            q, k = rj.apply_rope_qk(q, k, cos, sin, offset=offsets, layout="bshd", backend=backend)
            q, k = jax.lax.optimization_barrier((q, k))
        return q, k

    return jax.jit(step)


def wall_us_per_call(jax, fn, args, layers: int, steps: int = 200) -> float:
    """Host wall µs per call of a jitted step of ``layers`` calls, each step waited for (median)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 / layers


def _row(impl: str, us: float, regimes: tuple, note: str = "", check: str = "-") -> dict:
    timings = {regimes[0]: {"us": us}}
    for other in regimes[1:]:
        timings[other] = {"us": us, "same_as": regimes[0]}
    return {"impl": impl, "layout": "bshd", "check": check, "note": note, "timings": timings}


def _copy_graph_us(cp, moved: int) -> float:
    """GPU µs per copy node of ``moved // 2`` bytes, in a CUDA graph of such nodes."""
    half = moved // 2
    src, dst = cp.empty(half, cp.uint8), cp.empty(half, cp.uint8)
    return graph_us(cp, lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, half, 3,
                                                            cp.cuda.get_current_stream().ptr))


def _check(jax, cp, rj, args) -> str:
    """One jitted call's outputs against the CuPy API's on the same inputs, bit for bit."""
    import rope_rtc

    q, k, cos, sin, offsets = args
    got = jax.jit(lambda *a: rj.apply_rope_qk(*a[:4], offset=a[4], layout="bshd"))(*args)
    want_q, want_k = cp.asarray(np.asarray(q)), cp.asarray(np.asarray(k))
    rope_rtc.apply_rope_qk(want_q, want_k, cp.asarray(np.asarray(cos)), cp.asarray(np.asarray(sin)),
                           offset=cp.asarray(np.asarray(offsets)), layout="bshd", q_out=want_q, k_out=want_k)
    same = all(np.array_equal(np.asarray(g).view(np.uint16), cp.asnumpy(w).view(np.uint16))
               for g, w in zip(got, (want_q, want_k)))
    return "bit-exact (= the CuPy API)" if same else "WRONG: differs from the CuPy API"


def measure_records(quick: bool, seed: int) -> list[dict]:
    """The JAX records, measured in this process (the child's work)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # CuPy's copy needs memory too
    import jax

    jax.devices("cuda")  # raises without JAX's CUDA backend
    import cupy as cp
    import jax.numpy as jnp

    import rope_rtc.jax as rj

    rng = np.random.default_rng(seed)
    recs = []
    with jax.default_device(jax.devices("cuda")[0]):
        window = Window(jax, cp)
        B, S, H, D = PREFILL
        args = inputs(jnp, rng, B, S, H, H, D, S)
        moved = 2 * (args[0].nbytes + args[1].nbytes) + B * S * (D // 2) * 4 * 2
        rec = {"id": f"engine/jax-prefill/bf16/bshd/S={S}", "group": "engine", "bytes_moved": moved, "rows": [],
               "params": {"B": B, "S": S, "H": H, "D": D, "dtype": "bfloat16", "layout": "bshd", "jax": jax.__version__}}
        stream = cp.cuda.Stream(non_blocking=True)
        runner = CopyRunner(cp, stream, moved, 1)
        rec["rows"].append(_row(COPY, gpu_us(cp, stream, runner.fns[0]), ("cold",),
                                f"cudaMemcpyAsync of {runner.half} bytes"))
        del runner
        check = _check(jax, cp, rj, args)
        for impl, backend in ((JAX_OURS, "nvrtc"), (JAX_XLA, "jnp")):
            us = chain_us(jax, chain_fn(jax, rj, window, backend, PREFILL_CHAIN, 0), args, window, PREFILL_CHAIN)
            rec["rows"].append(_row(impl, us, ("cold",), "in place, one jitted chain",
                                    check if backend == "nvrtc" else "-"))
        recs.append(rec)
        hq, hk, d = DECODE_HEADS
        settle(cp, stream)  # this process's first small timings follow
        for b in DECODE_B_QUICK if quick else DECODE_B:
            args = inputs(jnp, rng, b, 1, hq, hk, d, TABLE_ROWS)
            moved = 2 * (args[0].nbytes + args[1].nbytes) + b * (d // 2) * 4 * 2 + b * 4
            rec = {"id": f"engine/jax-decode/bf16/bshd/B={b}", "group": "engine", "bytes_moved": moved, "rows": [],
                   "params": {"B": b, "S": 1, "Hq": hq, "Hkv": hk, "D": d, "dtype": "bfloat16", "layout": "bshd",
                              "jax": jax.__version__}}
            copy = _copy_graph_us(cp, moved)
            rec["rows"].append(_row(COPY, copy, ("graph", "graph_cold"), "cudaMemcpyAsync nodes in a CUDA graph"))
            check = _check(jax, cp, rj, args)
            for impl, backend in ((JAX_OURS, "nvrtc"), (JAX_XLA, "jnp")):
                us = chain_us(jax, chain_fn(jax, rj, window, backend, DECODE_CHAIN, None), args, window, DECODE_CHAIN)
                host = wall_us_per_call(jax, step_fn(jax, rj, backend, LAYERS), args, LAYERS)
                rec["rows"].append(_row(impl, us, ("graph", "graph_cold"),
                                        f"{DECODE_CHAIN} chained in one program; host {host:.2f} µs per call in a "
                                        f"jitted step of {LAYERS}", check if backend == "nvrtc" else "-"))
            recs.append(rec)
    return recs


def jax_records(ctx, measure, copy_runner) -> list[dict]:
    """The JAX records, from a child process (see the module's docstring). Raises when the child
    fails; the engine section records the failure in place of the records."""
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p))
    with tempfile.TemporaryDirectory(prefix="rope_rtc_bench_jax_") as tmp:
        out = Path(tmp) / "jax.json"
        cmd = [sys.executable, "-m", "rope_rtc.benchmark.engine_jax", str(out), "--seed", str(ctx.seed)]
        if getattr(ctx, "quick", False):
            cmd.append("--quick")
        print("\n[engine/jax] rope_rtc.jax in a child process", flush=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        if proc.returncode == NO_JAX:  # not installed here: its targets are not run (N/A), not missed
            print(f"engine/jax skipped: no JAX with its CUDA backend ({proc.stderr.strip()[-200:]})", flush=True)
            return []
        if proc.returncode != 0 or not out.exists():
            said = " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])  # the traceback's end
            raise RuntimeError(f"exit {proc.returncode}: {said[-300:]}")
        recs = json.loads(out.read_text())
    for rec in recs:
        print(f"[{rec['id']}]", flush=True)
        for r in rec["rows"]:
            us = next(iter(r["timings"].values()))["us"]
            print(f"  {r['impl']:<40} {us:9.2f} µs  {r['check']}  {r['note']}", flush=True)
    return recs


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m rope_rtc.benchmark.engine_jax",
                                description="the benchmark's JAX records, written to OUT as JSON")
    p.add_argument("out")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:  # JAX is an optional extra: without it, or without its CUDA backend, there is nothing to judge
        import jax

        jax.devices("cuda")
    except (ImportError, RuntimeError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return NO_JAX
    Path(args.out).write_text(json.dumps(measure_records(args.quick, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
