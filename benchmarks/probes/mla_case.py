"""DeepSeek-V3's MLA step (q [T, 128, 128 + 64] bf16 rotated in place on its last 64 channels,
k_pe [T, 64], kv_c [T, 512], the bf16 cache [blocks, 16, 576], adjacent pairs, random positions
and slots) for Nsight Compute, and beside the bounds of its access pattern.

    PYTHONPATH=. python3 benchmarks/probes/mla_case.py ncu T
        one warm-up and two launches of the fused kernel (profile the last:
        ncu -k regex:mla_rope_cache --launch-skip 2 --launch-count 1 --set full ...)
    PYTHONPATH=. python3 benchmarks/probes/mla_case.py bounds [T ...]
        GPU µs of the fused launch beside: a copy of the same bytes (cudaMemcpyAsync); a kernel
        that reads and writes exactly the fused launch's bytes in place without the rotation
        (q's rotary channels, k_pe; kv_c read, the cache row written): what the access pattern
        itself costs; and the same kernel with q's rotary channels packed (the first third of
        q's memory, dense) instead of 128 bytes in each 384-byte head row: what that sparse
        pattern costs. CUDA events for prefill sizes, graph replay for T <= 64.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
from probe_timing import event_us, graph_us

H, NOPE, ROPE, LORA, BLOCK, TABLE = 128, 128, 64, 512, 16, 32768

# One thread per 16-byte vector of the fused launch's traffic, token-major like the fused kernel:
# q's rotary vectors (8 per head), k_pe's (8), kv_c's (64, written to the cache row with k_pe's).
_TOUCH = r"""
typedef uint4 V;
extern "C" __global__ void __launch_bounds__(256) mla_touch(V* q, V* k_pe, const V* kv_c, const long long* slots,
                                                            V* cache, unsigned flip, long long total,
                                                            unsigned q_head_vectors) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const long long t = i / (128 * 8 + 8 + 64);
    const unsigned r = (unsigned)(i - t * (128 * 8 + 8 + 64));
    if (r < 128 * 8) {  // q head r / 8, rotary vector r % 8: channels 128 + 8 * (r % 8) (or packed)
        V* p = q_head_vectors == 24 ? q + t * (128 * 24) + (r / 8) * 24 + 16 + (r % 8) : q + t * (128 * 8) + r;
        V v = __ldcs(p); v.x ^= flip; __stcs(p, v);
        return;
    }
    const long long slot = slots[t];
    if (r < 128 * 8 + 8) {
        const unsigned u = r - 128 * 8;
        V* p = k_pe + t * 8 + u;
        V v = __ldcs(p); v.x ^= flip; __stcs(p, v);
        if (slot >= 0) __stcs(cache + slot * 72 + 64 + u, v);
        return;
    }
    const unsigned u = r - 128 * 8 - 8;
    V v = __ldcs(kv_c + t * 64 + u);
    if (slot >= 0) __stcs(cache + slot * 72 + u, v);
}
"""


def _arrays(T: int):
    import cupy as cp

    import rope_rtc

    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    q = cp.asarray(rng.standard_normal((T, H, NOPE + ROPE), dtype=np.float32).astype(bf16))
    k_pe = cp.asarray(rng.standard_normal((T, ROPE), dtype=np.float32).astype(bf16))
    kv_c = cp.asarray(rng.standard_normal((T, LORA), dtype=np.float32).astype(bf16))
    blocks = -(-T // BLOCK) + 64
    order = rng.permutation(blocks)
    slots = cp.asarray((order[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[:T].astype(np.int64))
    pos = cp.asarray(rng.integers(0, TABLE, T).astype(np.int64))
    cos, sin = rope_rtc.rope_tables(TABLE, ROPE, xp=cp)
    cache = cp.zeros((blocks, BLOCK, LORA + ROPE), bf16)
    plan = rope_rtc.MlaRopeCachePlan(q, k_pe, kv_c, cos, sin, pos, slots, cache)
    return plan, (q, k_pe, kv_c, cos, sin, pos, slots, cache)


def ncu(T: int) -> None:
    import cupy as cp

    plan, args = _arrays(T)
    for _ in range(3):
        plan.execute(*args)
    cp.cuda.runtime.deviceSynchronize()


def bounds(sizes: list[int]) -> None:
    import cupy as cp

    touch = cp.RawKernel(_TOUCH, "mla_touch")
    for T in sizes:
        plan, args = _arrays(T)
        q, k_pe, kv_c, _, _, _, slots, cache = args
        total = T * (H * 8 + 8 + 64)
        moved = T * (2 * H * ROPE * 2 + 2 * ROPE * 2 + LORA * 2 + (LORA + ROPE) * 2 + ROPE // 2 * 8 + 16)
        src, dst = cp.empty(moved // 2, cp.uint8), cp.empty(moved // 2, cp.uint8)
        fns = {
            "fused": lambda: plan.execute(*args),
            "touch (same bytes, no rotation)": lambda: touch((-(-total // 256),), (256,),
                                                             (q, k_pe, kv_c, slots, cache, np.uint32(0),
                                                              np.int64(total), np.uint32(24))),
            "touch, q's rotary bytes packed": lambda: touch((-(-total // 256),), (256,),
                                                            (q, k_pe, kv_c, slots, cache, np.uint32(0),
                                                             np.int64(total), np.uint32(8))),
            "copy (same bytes)": lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, moved // 2, 3,
                                                                     cp.cuda.get_current_stream().ptr),
        }
        timer = graph_us if T <= 64 else event_us
        for name, fn in fns.items():
            us = min(timer(fn) for _ in range(3))
            print(f"T={T:<6} {name:<34} {us:9.2f} µs  {moved / us / 1e3:8.1f} GB/s")


if __name__ == "__main__":
    if sys.argv[1] == "ncu":
        ncu(int(sys.argv[2]))
    else:
        bounds([int(a) for a in sys.argv[2:]] or [16384, 64, 1])
