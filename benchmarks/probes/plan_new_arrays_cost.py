"""Host µs per call of a plan with new arrays: RopePlan.execute with the same arrays, with 256
array sets cycled, with 2 sets alternating and with new views each call, beside apply_rope_qk
with 256 sets cycled and a cudaMemcpyAsync (bf16 decode q [8,1,32,128], k [8,1,8,128],
per-sequence offsets, in place); then TailRoPEForward.execute the same ways beside tail_rope
(T=4, H=64, D=512). Each pass is timed while the GPU is busy so the calls queue; the rows in
turns, three rounds, best of 15 passes of 1,000 calls each. An optional argument labels the
lines (to tell two trees apart).

    PYTHONPATH=. python3 benchmarks/probes/plan_new_arrays_cost.py [label]
"""

from __future__ import annotations

import gc
import sys
import time

import cupy as cp
import ml_dtypes

import rope_rtc

SETS = 256


def _bf16(rng, shape):
    return rng.standard_normal(shape, dtype=cp.float32).astype(ml_dtypes.bfloat16)


def per_call_us(fn, busy, n: int = 1000, reps: int = 15) -> float:
    """Best µs per call of ``fn`` over ``reps`` passes of ``n`` calls, each pass queued behind work
    on the GPU (so no call waits for the device)."""
    for _ in range(300):
        fn()
    stream = cp.cuda.get_current_stream()
    stream.synchronize()
    best = float("inf")
    gc.disable()
    try:
        for _ in range(reps):
            for _ in range(20):
                cp.multiply(busy, 1.0001, out=busy)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
            stream.synchronize()
    finally:
        gc.enable()
    return best


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else ""
    rng = cp.random.default_rng(0)
    sets = [(_bf16(rng, (8, 1, 32, 128)), _bf16(rng, (8, 1, 8, 128)), cp.arange(8, dtype=cp.int32))
            for _ in range(SETS)]
    cos, sin = rope_rtc.rope_tables(4096, 128, xp=cp)
    q0, k0, o0 = sets[0]
    plan = rope_rtc.RopePlan(q0, k0, cos, sin, offset=o0, layout="bshd").compile()
    busy = cp.zeros(1 << 28, cp.float32)
    turn = [0]

    def same():
        plan.execute(q0, k0, cos, sin, offset=o0)

    def cycled():
        turn[0] = (turn[0] + 1) % SETS
        q, k, o = sets[turn[0]]
        plan.execute(q, k, cos, sin, offset=o)

    def two():
        turn[0] = (turn[0] + 1) % 2
        q, k, o = sets[turn[0]]
        plan.execute(q, k, cos, sin, offset=o)

    def views():
        plan.execute(q0[:], k0[:], cos, sin, offset=o0)

    def one_call():
        turn[0] = (turn[0] + 1) % SETS
        q, k, o = sets[turn[0]]
        rope_rtc.apply_rope_qk(q, k, cos, sin, offset=o, q_out=q, k_out=k, layout="bshd")

    def memcpy():
        cp.cuda.runtime.memcpyAsync(o0.data.ptr, sets[1][2].data.ptr, 32, 3, cp.cuda.get_current_stream().ptr)

    xs = [(_bf16(rng, (4, 64, 512)), rng.standard_normal((4, 32), dtype=cp.float32),
           rng.standard_normal((4, 32), dtype=cp.float32), cp.empty((4, 64, 512), ml_dtypes.bfloat16))
          for _ in range(SETS)]
    tail = rope_rtc.TailRoPEForward(*xs[0]).compile()

    def tail_same():
        tail.execute(*xs[0])

    def tail_cycled():
        turn[0] = (turn[0] + 1) % SETS
        tail.execute(*xs[turn[0]])

    def tail_views():
        x, c, s, o = xs[0]
        tail.execute(x, c, s, o[:])

    def tail_one_call():
        turn[0] = (turn[0] + 1) % SETS
        rope_rtc.tail_rope(*xs[turn[0]][:3])

    rows = [("RopePlan.execute, same arrays", same), (f"RopePlan.execute, {SETS} sets cycled", cycled),
            ("RopePlan.execute, 2 sets alternating", two),
            ("RopePlan.execute, new views q[:], k[:] each call (incl. 2 slicings)", views),
            (f"apply_rope_qk, {SETS} sets cycled", one_call), ("cudaMemcpyAsync", memcpy),
            ("TailRoPEForward.execute, same arrays", tail_same),
            (f"TailRoPEForward.execute, {SETS} sets cycled", tail_cycled),
            ("TailRoPEForward.execute, a new view of out each call (incl. 1 slicing)", tail_views),
            (f"tail_rope, {SETS} sets cycled (allocates the output)", tail_one_call)]
    results: dict[str, list[float]] = {name: [] for name, _ in rows}
    for _ in range(3):  # the rows in turns: each row's best covers the same stretch of time
        for name, fn in rows:
            results[name].append(per_call_us(fn, busy))
    for name, values in results.items():
        print(f"{label} {name:<72} {min(values):6.2f} µs  ({', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
