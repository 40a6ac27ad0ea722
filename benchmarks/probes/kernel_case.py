"""Run one general-kernel case twice (the first call compiles or loads, the second is the one to
profile), for Nsight Compute:

    ncu -k regex:rope_ --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats python3 benchmarks/probes/kernel_case.py blog

Cases: ``blog`` (FP32 interleaved bhsd [4,32,4096,128], q+k in place),
``prefill[-<bshd|bhsd>[-<half|inter>]]`` (bf16, B=4, S=4096, H=Hkv=32, D=128, in place; half-split
bshd by default), ``decode[-T]`` (bf16 thd, T=1 by default, Hq=32, Hkv=8, D=128, a positions array),
``decode-step[-T]`` (the same on cos/sin gathered at the positions once, no positions array: the
benchmark's peers' inputs). Cases that compare two builds
run each twice, the op's first: ``mrope-<contiguous|interleaved>`` (the benchmark's MRoPE decode
record: Qwen2-VL-7B's heads, T=8, three position streams; then plain RoPE on the same arrays) and
``angles-<T>`` (the angle record: Llama-3-8B's heads and rope scaling, float64 inv_freq; then the
exact table; T=8 random positions, larger T positions 0 .. T-1).
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
    elif case.split("-")[0] == "prefill":
        parts = case.split("-")
        layout = parts[1] if len(parts) > 1 else "bshd"
        pairing = parts[2] if len(parts) > 2 else "half"
        if layout not in ("bshd", "bhsd") or pairing not in ("half", "inter") or len(parts) > 3:
            raise SystemExit(f"unknown case {case!r}: prefill[-<bshd|bhsd>[-<half|inter>]]")
        shape = (4, 4096, 32, 128) if layout == "bshd" else (4, 32, 4096, 128)
        q = rng.standard_normal(shape, dtype=cp.float32).astype(bf16)
        k = rng.standard_normal(shape, dtype=cp.float32).astype(bf16)
        cos, sin = rope_rtc.rope_tables(4096, 128, xp=cp)
        kw = dict(layout=layout, interleaved=pairing == "inter")
    elif case.startswith("decode"):
        T = int(case.rsplit("-", 1)[1]) if case[-1].isdigit() else 1
        q = rng.standard_normal((T, 32, 128), dtype=cp.float32).astype(bf16)
        k = rng.standard_normal((T, 8, 128), dtype=cp.float32).astype(bf16)
        cos, sin = rope_rtc.rope_tables(8192, 128, xp=cp)
        pos = cp.asarray(np.random.default_rng(0).integers(0, 8192, T).astype(np.int32))
        if case.startswith("decode-step"):
            cos, sin = cp.ascontiguousarray(cos[pos]), cp.ascontiguousarray(sin[pos])
            kw = dict(layout="thd")
        else:
            kw = dict(layout="thd", positions=pos)
    elif case.startswith("mrope-"):
        return _pair(cp, *_mrope(cp, rng, case.split("-")[1] == "interleaved"))
    elif case.startswith("angles-"):
        return _pair(cp, *_angles(cp, rng, int(case.split("-")[1])))
    else:
        raise SystemExit(f"unknown case {case!r}: blog, prefill[-<bshd|bhsd>[-<half|inter>]], decode[-T], "
                         "decode-step[-T], mrope-<contiguous|interleaved> or angles-<T>")
    plan = rope_rtc.RopePlan(q, k, cos, sin, **kw).compile()
    pos = kw.get("positions")
    for _ in range(2):
        plan.execute(q, k, cos, sin, positions=pos)
    cp.cuda.runtime.deviceSynchronize()


def _pair(cp, first, second) -> None:
    for fn in (first, second):
        for _ in range(2):
            fn()
    cp.cuda.runtime.deviceSynchronize()


def _mrope(cp, rng, interleaved: bool):
    import rope_rtc

    T, rows = 8, 32768
    section = (24, 20, 20) if interleaved else (16, 24, 24)
    q = rng.standard_normal((T, 28, 128), dtype=cp.float32).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((T, 4, 128), dtype=cp.float32).astype(ml_dtypes.bfloat16)
    pos = cp.asarray(np.random.default_rng(0).integers(0, rows, (3, T)).astype(np.int64))
    cos, sin = rope_rtc.rope_tables(rows, 128, xp=cp)
    plan = rope_rtc.MRopePlan(q, k, cos, sin, pos, section, interleaved_sections=interleaved).compile()
    pos0 = pos[0]
    plain = rope_rtc.RopePlan(q, k, cos, sin, positions=pos0, layout="thd").compile()
    return (lambda: plan.execute(q, k, cos, sin, pos)), (lambda: plain.execute(q, k, cos, sin, positions=pos0))


def _angles(cp, rng, T: int):
    import rope_rtc

    rows = 131072
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    f, att = rope_rtc.inverse_frequencies(128, base=5e5, scaling=scaling)
    cos, sin = rope_rtc.rope_tables(rows, 128, base=5e5, scaling=scaling, xp=cp)
    inv = cp.asarray(f)
    q = rng.standard_normal((T, 32, 128), dtype=cp.float32).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((T, 8, 128), dtype=cp.float32).astype(ml_dtypes.bfloat16)
    pos = cp.asarray(np.random.default_rng(0).integers(0, rows, T) if T <= 64 else np.arange(T)).astype(cp.int64)
    angles = rope_rtc.RopePlan(q, k, inv_freq=inv, attention_scaling=att, positions=pos, layout="thd").compile()
    table = rope_rtc.RopePlan(q, k, cos, sin, positions=pos, layout="thd").compile()
    return (lambda: angles.execute(q, k, positions=pos, inv_freq=inv)), (lambda: table.execute(q, k, cos, sin,
                                                                                                  positions=pos))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "blog")
