"""cProfile of the plans' slow path: new arrays of a known signature on every call.

On a GPU machine, from the repository root:

    PYTHONPATH=. python3 benchmarks/probes/profile_host.py

Prints µs per call of RopePlan.execute and TailRoPEForward.execute with fresh arrays each call,
then the 14 functions with the most own time, to show where validation spends the host's time.
"""
import cProfile
import pstats
import time

import cupy as cp
import ml_dtypes

import rope_rtc

rng = cp.random.default_rng(0)
N = 400
qs = [rng.standard_normal((1, 1, 32, 128), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(N)]
ks = [rng.standard_normal((1, 1, 8, 128), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(N)]
cos, sin = rope_rtc.rope_tables(4096, 128, xp=cp)
plan = rope_rtc.RopePlan(qs[0], ks[0], cos, sin, layout="bshd").compile()
xs = [rng.standard_normal((1, 64, 512), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(N)]
cs = [cp.ones((1, 32), cp.float32) for _ in range(N)]
os_ = [cp.empty_like(x) for x in xs]
tplan = rope_rtc.TailRoPEForward(xs[0], cs[0], cs[0], os_[0]).check_support().compile()


def rope_slow():
    for i in range(N):
        plan.execute(qs[i], ks[i], cos, sin)


def tail_slow():
    for i in range(N):
        tplan.execute(xs[i], cs[i], cs[i], os_[i])


for f in (rope_slow, tail_slow):
    f()
    cp.cuda.runtime.deviceSynchronize()
    t = time.perf_counter()
    f()
    cp.cuda.runtime.deviceSynchronize()
    print(f"{f.__name__}: {(time.perf_counter() - t) / N * 1e6:.1f} us/call (new arrays every call)")
    pr = cProfile.Profile()
    pr.enable()
    f()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
