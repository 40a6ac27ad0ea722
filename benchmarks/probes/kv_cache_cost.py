"""RoPE fused with the paged KV-cache write against the two-step sequence (our RoPE, then a
separate cache write: CuPy's scatter, one launch per cache), and against a same-size copy.

    PYTHONPATH=. python3 benchmarks/probes/kv_cache_cost.py

Decode: T=8 tokens (B=8 sequences, one token each), Hq=32, Hkv=8, D=128, bf16, nhd cache (blocks
of 16 tokens in a random order) of the input dtype and FP8 e4m3 (fused only: CuPy has no FP8
cast); GPU µs per call under graph replay.
Prefill: T=16384, the same heads; GB/s of the bytes moved (q and k read and written, v read, the k
and v cache entries written, table rows, positions and slots) and % of a copy of that many bytes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from probe_timing import event_us, graph_us


def main() -> None:
    import cupy as cp

    import rope_rtc

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)

    for T, label in ((8, "decode"), (16384, "prefill")):
        HQ, HK, D, BS = 32, 8, 128, 16
        NB = -(-T // BS) + 4
        q = cp.asarray(rng.standard_normal((T, HQ, D)).astype(bf16))
        k = cp.asarray(rng.standard_normal((T, HK, D)).astype(bf16))
        v = cp.asarray(rng.standard_normal((T, HK, D)).astype(bf16))
        cos, sin = rope_rtc.rope_tables(32768, D, xp=cp)
        pos = cp.asarray(rng.integers(0, 32768, T).astype(np.int64))
        # Whole blocks in a random order, each filled in order (what a block allocator hands out).
        slots = cp.asarray((rng.permutation(NB)[:, None] * BS + np.arange(BS)).reshape(-1)[:T].astype(np.int64))
        kc = cp.zeros((NB, BS, HK, D), bf16)
        vc = cp.zeros_like(kc)
        kc8 = cp.zeros((NB, BS, HK, D), cp.uint8)
        vc8 = cp.zeros_like(kc8)
        scale = cp.asarray(np.array([0.05], np.float32))
        fused = rope_rtc.RopeCachePlan(q, k, v, cos, sin, pos, slots, kc, vc)
        fused8 = rope_rtc.RopeCachePlan(q, k, v, cos, sin, pos, slots, kc8, vc8, kv_cache_dtype="fp8_e4m3",
                                        k_scale=scale, v_scale=scale)
        rope = rope_rtc.RopePlan(q, k, cos, sin, positions=pos, layout="thd").compile()
        flat_k, flat_v = kc.reshape(NB * BS, HK, D), vc.reshape(NB * BS, HK, D)

        def run_fused():
            fused.execute(q, k, v, cos, sin, pos, slots, kc, vc)

        def run_fused8():
            fused8.execute(q, k, v, cos, sin, pos, slots, kc8, vc8, k_scale=scale, v_scale=scale)

        def run_two_step():
            rope.execute(q, k, cos, sin, positions=pos)
            flat_k[slots] = k
            flat_v[slots] = v

        size = q.itemsize
        moved = (2 * q.size + 2 * k.size + v.size + 2 * k.size) * size + T * (D // 2) * 8 + 2 * T * 8
        src, dst = cp.empty(moved // 2, cp.uint8), cp.empty(moved // 2, cp.uint8)

        def copy():
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, moved // 2, 3, cp.cuda.get_current_stream().ptr)

        timer = graph_us if label == "decode" else event_us
        t_copy, t_fused, t_fused8, t_two = (timer(f) for f in (copy, run_fused, run_fused8, run_two_step))
        moved8 = moved - 2 * k.size * (size - 1)  # FP8 entries: one byte each
        print(f"{label} T={T}: {moved / 1e6:.2f} MB moved ({moved8 / 1e6:.2f} with FP8 entries); copy {t_copy:.2f} us "
              f"({moved / t_copy / 1e3:.0f} GB/s); fused {t_fused:.2f} us ({moved / t_fused / 1e3:.0f} GB/s, "
              f"{100 * t_copy / t_fused:.1f}% of the copy); fused FP8 {t_fused8:.2f} us "
              f"({moved8 / t_fused8 / 1e3:.0f} GB/s); RoPE then a CuPy cache write {t_two:.2f} us", flush=True)


if __name__ == "__main__":
    main()
