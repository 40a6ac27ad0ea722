"""Run one general-kernel case twice (the first call compiles or loads, the second is the one to
profile), for Nsight Compute:

    ncu -k regex:rope_ --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats python3 benchmarks/probes/kernel_case.py blog

Cases: ``blog`` (FP32 interleaved bhsd [4,32,4096,128], q+k in place), ``prefill`` (bf16
half-split bshd [4,4096,32,128], Hkv=32, in place), ``decode`` (bf16 thd T=1, Hq=32, Hkv=8, D=128,
a positions array).
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np


def main(case: str) -> None:
    import cupy as cp

    import rope_rtc

    rng = cp.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    if case == "blog":
        q = rng.standard_normal((4, 32, 4096, 128), dtype=cp.float32)
        k = rng.standard_normal((4, 32, 4096, 128), dtype=cp.float32)
        cos, sin = rope_rtc.rope_tables(4096, 128, xp=cp)
        kw = dict(layout="bhsd", interleaved=True)
    elif case == "prefill":
        q = rng.standard_normal((4, 4096, 32, 128), dtype=cp.float32).astype(bf16)
        k = rng.standard_normal((4, 4096, 32, 128), dtype=cp.float32).astype(bf16)
        cos, sin = rope_rtc.rope_tables(4096, 128, xp=cp)
        kw = dict(layout="bshd")
    elif case == "decode":
        q = rng.standard_normal((1, 32, 128), dtype=cp.float32).astype(bf16)
        k = rng.standard_normal((1, 8, 128), dtype=cp.float32).astype(bf16)
        cos, sin = rope_rtc.rope_tables(8192, 128, xp=cp)
        kw = dict(layout="thd", positions=cp.asarray(np.array([4097], np.int32)))
    else:
        raise SystemExit(f"unknown case {case!r}: blog, prefill or decode")
    plan = rope_rtc.RopePlan(q, k, cos, sin, **kw).compile()
    pos = kw.get("positions")
    for _ in range(2):
        plan.execute(q, k, cos, sin, positions=pos)
    cp.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "blog")
