"""The host layer's own cost per call, on any machine (no GPU needed): the one-call functions and
the plans with new arrays of a seen signature, driven on fake device arrays (tests/fakes.py) with
the launch stubbed out, so the figures are the Python work of the checks and the block writes
alone, without the driver's launch: the part of a call's host time that is rope_rtc's own
(docs/performance.md, "Host cost").

From the repository root:

    PYTHONPATH=.:tests python3 benchmarks/probes/host_python_cost.py

Prints µs per call (best of 9 passes over 64 array sets, cycled) for bf16 decode arrays: Hq=32,
Hkv=8, D=128, 8 tokens, int64 positions, in place.
"""
import timeit

import ml_dtypes
import numpy as np

import rope_rtc
from fakes import FakeGPU, fake_cupy
from rope_rtc.core import prepared

BF16 = np.dtype(ml_dtypes.bfloat16)
T, HQ, HK, D, ROWS, SETS = 8, 32, 8, 128, 4096, 64


class _NoLaunch:
    """A launcher that launches nothing: what is left is the host layer's own work."""

    replay = True

    def __init__(self, *args) -> None:
        pass

    def __call__(self, *args, **kwargs) -> None:
        pass

    def launch(self, *args) -> None:
        pass

    def launch_on(self, *args) -> None:
        pass


def per_call(fn, sets) -> float:
    for args in sets[:3]:  # the signature's first calls: validation, then the repeat path
        fn(*args)

    def loop():
        for args in sets:
            fn(*args)

    return min(timeit.repeat(loop, number=30, repeat=9)) / (30 * len(sets)) * 1e6


def main() -> None:
    with FakeGPU(fixed=True):
        prepared.Prepared._new_launcher = staticmethod(lambda address, device: _NoLaunch())
        cos, sin = fake_cupy((ROWS, D // 2), np.float32), fake_cupy((ROWS, D // 2), np.float32)
        cache = fake_cupy((ROWS, D), np.float32)
        qw, kw = fake_cupy((D,), BF16), fake_cupy((D,), BF16)
        kc, vc = fake_cupy((64, 16, HK, D), BF16), fake_cupy((64, 16, HK, D), BF16)
        sets = [(fake_cupy((T, HQ, D), BF16), fake_cupy((T, HK, D), BF16), fake_cupy((T,), np.int64))
                for _ in range(SETS)]
        flat = [(q.reshape(T, -1), k.reshape(T, -1), p) for q, k, p in sets]
        mrope = [(q, k, fake_cupy((3, T), np.int64)) for q, k, _ in sets]
        cached = [(q, k, fake_cupy((T, HK, D), BF16), p, fake_cupy((T,), np.int64)) for q, k, p in sets]
        plan = rope_rtc.RopePlan(*sets[0][:2], cos, sin, positions=sets[0][2], layout="thd")
        cplan = rope_rtc.RopePlan(*flat[0][:2], cos_sin_cache=cache, positions=flat[0][2], layout="thd", head_dim=D)
        nplan = rope_rtc.QKNormRopePlan(*sets[0][:2], qw, kw, cos, sin, positions=sets[0][2], layout="thd")
        xs = [(fake_cupy((4, 64, 512), BF16),) for _ in range(SETS)]
        tc, ts = fake_cupy((4, 32), np.float32), fake_cupy((4, 32), np.float32)
        offs = [(q.reshape(T, 1, HQ, D), k.reshape(T, 1, HK, D), fake_cupy((T,), np.int32)) for q, k, _ in sets]
        rows = [
            ("apply_rope_qk, tables", lambda q, k, p: rope_rtc.apply_rope_qk(
                q, k, cos, sin, positions=p, layout="thd", q_out=q, k_out=k), sets),
            ("apply_rope_qk, cos_sin_cache and flat [T, H*D] arrays", lambda q, k, p: rope_rtc.apply_rope_qk(
                q, k, cos_sin_cache=cache, positions=p, layout="thd", head_dim=D, q_out=q, k_out=k), flat),
            ("apply_rope_qk, offset array, layout given", lambda q, k, o: rope_rtc.apply_rope_qk(
                q, k, cos, sin, offset=o, layout="bshd", q_out=q, k_out=k), offs),
            ("apply_rope, out=", lambda q, k, p: rope_rtc.apply_rope(q, cos, sin, positions=p, out=q), sets),
            ("apply_rope, allocates the output", lambda q, k, p: rope_rtc.apply_rope(q, cos, sin, positions=p), sets),
            ("tail_rope, allocates the output", lambda x: rope_rtc.tail_rope(x, tc, ts), xs),
            ("apply_qk_norm_rope", lambda q, k, p: rope_rtc.apply_qk_norm_rope(
                q, k, qw, kw, cos, sin, positions=p, layout="thd", q_out=q, k_out=k), sets),
            ("apply_mrope_qk", lambda q, k, p: rope_rtc.apply_mrope_qk(
                q, k, cos, sin, p, [16, 24, 24], q_out=q, k_out=k), mrope),
            ("rope_and_cache", lambda q, k, v, p, s: rope_rtc.rope_and_cache(q, k, v, cos, sin, p, s, kc, vc), cached),
            ("RopePlan.execute, new arrays", lambda q, k, p: plan.execute(q, k, cos, sin, p), sets),
            ("RopePlan.execute, the same arrays", lambda q, k, p: plan.execute(*sets[0][:2], cos, sin, sets[0][2]),
             sets),
            ("RopePlan.execute, cos_sin_cache and new flat arrays", lambda q, k, p: cplan.execute(
                q, k, positions=p, cos_sin_cache=cache), flat),
            ("QKNormRopePlan.execute, new arrays", lambda q, k, p: nplan.execute(q, k, qw, kw, cos, sin, p), sets),
        ]
        for label, fn, args in rows:
            print(f"{label:<56} {per_call(fn, args):6.2f} us")


if __name__ == "__main__":
    main()
