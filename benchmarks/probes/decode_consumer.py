"""What the evict-first q/k accesses of the decode kernels cost the kernel that reads q and k next
(attention, in an engine): RoPE then a consumer of q and k, under graph replay, hot (one buffer set)
and cycling over buffer sets: up to 42 MB of q and k at 1 and 8 tokens, 84 MB at 64 (the H100's L2
holds 50 MB).

    PYTHONPATH=. python3 benchmarks/probes/decode_consumer.py

Per call of each pair, and of each kernel alone: a hand-written RoPE kernel with the plan's thread
map (a thread per 4 pairs of one head, an 8-byte vector of each half; blocks of 256) on the step's
tables, built twice, with evict-first loads and stores of q and k (`__ldcs`/`__stcs`, as
cuda_src/rope_types.cuh) and with plain ones, checked against the plan's bits first; the plan
itself on the same tables; the consumer (plain 16-byte loads of every q and k vector, summed into
a sink so that they stay). bf16 `thd`, Hq=32, Hkv=8, D=128.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# HINT 1: evict-first loads and stores of q and k; 0: plain.
_KERNELS = r"""
#include <cuda_bf16.h>
#if HINT
#define LD(p) __ldcs(p)
#define ST(p, v) __stcs(p, v)
#else
#define LD(p) (*(p))
#define ST(p, v) (*(p) = (v))
#endif
union Half4 { uint2 v; __nv_bfloat162 h[2]; };

// Thread i: token i / 640, head (i % 640) / 16 (q's 32, then k's 8), pairs 4 (i % 16) .. +3 of the
// head's halves; cos/sin row t of the step's tables (64 pairs a row).
extern "C" __global__ void __launch_bounds__(256) rope_step(__nv_bfloat16* __restrict__ q,
                                                            __nv_bfloat16* __restrict__ k,
                                                            const float* __restrict__ cos,
                                                            const float* __restrict__ sin, unsigned total) {
    const unsigned i = blockIdx.x * 256 + threadIdx.x;
    if (i >= total) return;
    const unsigned t = i / 640, rem = i - t * 640, h = rem / 16, col = rem - h * 16;
    __nv_bfloat16* head = h < 32 ? q + ((size_t)t * 32 + h) * 128 : k + ((size_t)t * 8 + (h - 32)) * 128;
    uint2* p = (uint2*)(head + col * 4);
    Half4 a, b, x, y;
    a.v = LD(p);
    b.v = LD(p + 16);
    const float4 c = __ldg((const float4*)(cos + (size_t)t * 64 + col * 4));
    const float4 s = __ldg((const float4*)(sin + (size_t)t * 64 + col * 4));
    const float cv[4] = {c.x, c.y, c.z, c.w}, sv[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const float2 x1 = __bfloat1622float2(a.h[j]), x2 = __bfloat1622float2(b.h[j]);
        const float c0 = cv[2 * j], c1 = cv[2 * j + 1], s0 = sv[2 * j], s1 = sv[2 * j + 1];
        // the library's rounding (cuda_src/rotation.cuh): the product with s rounded, then one FMA
        x.h[j] = __floats2bfloat162_rn(__fmaf_rn(x1.x, c0, -__fmul_rn(x2.x, s0)),
                                       __fmaf_rn(x1.y, c1, -__fmul_rn(x2.y, s1)));
        y.h[j] = __floats2bfloat162_rn(__fmaf_rn(x2.x, c0, __fmul_rn(x1.x, s0)),
                                       __fmaf_rn(x2.y, c1, __fmul_rn(x1.y, s1)));
    }
    ST(p, x.v);
    ST(p + 16, y.v);
}

// Every 16 bytes of q then k read once, as attention reads them; partial sums added into one
// float per block, a sink that keeps the loads.
extern "C" __global__ void __launch_bounds__(256) consume(const uint4* __restrict__ q, const uint4* __restrict__ k,
                                                          unsigned nq, unsigned nk, float* out) {
    float acc = 0.f;
    for (unsigned i = blockIdx.x * 256 + threadIdx.x; i < nq + nk; i += gridDim.x * 256) {
        const uint4 v = i < nq ? q[i] : k[i - nq];
        acc += __uint_as_float(v.x) + __uint_as_float(v.y) + __uint_as_float(v.z) + __uint_as_float(v.w);
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 16);
    if ((threadIdx.x & 31) == 0) atomicAdd(out + blockIdx.x, acc);
}
"""

# (tokens, buffer-set counts): one set (hot), then sets of q and k near and past the L2's size.
CASES = ((1, (1, 256, 4096)), (8, (1, 512)), (64, (1, 16, 64)))


def _cycling(fn, sets: int):
    """A call that runs fn(0), fn(1), .. fn(sets - 1), fn(0), .. one per call."""
    count = [0]

    def call():
        fn(count[0] % sets)
        count[0] += 1

    return call


def main() -> None:
    import cupy as cp

    import rope_rtc
    from rope_rtc.measure import graph_us

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    mods = {hint: cp.RawModule(code=_KERNELS, options=("-std=c++17", f"-DHINT={hint}")) for hint in (1, 0)}
    rope = {hint: m.get_function("rope_step") for hint, m in mods.items()}
    consume = mods[0].get_function("consume")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = cp.zeros(sms, cp.float32)
    for T, set_counts in CASES:
        nmax = max(set_counts)
        q = cp.asarray(rng.standard_normal((nmax, T, 32, 128), dtype=np.float32).astype(bf16))
        k = cp.asarray(rng.standard_normal((nmax, T, 8, 128), dtype=np.float32).astype(bf16))
        cos, sin = rope_rtc.rope_tables(T, 128, xp=cp)  # the step's tables: token t at row t
        plan = rope_rtc.RopePlan(q[0], k[0], cos, sin, layout="thd").compile()
        total = T * 40 * 16
        nq, nk = T * 32 * 128 // 8, T * 8 * 128 // 8
        grid = min(sms, -(-(nq + nk) // 256))
        ref = q[0].copy(), k[0].copy()
        plan.execute(ref[0], ref[1], cos, sin)
        for hint in (1, 0):  # the hand-written kernel gives the plan's bits
            x, y = q[0].copy(), k[0].copy()
            rope[hint](((total + 255) // 256,), (256,), (x, y, cos, sin, np.uint32(total)))
            assert bool((x.view(cp.uint16) == ref[0].view(cp.uint16)).all()) and \
                bool((y.view(cp.uint16) == ref[1].view(cp.uint16)).all()), f"HINT={hint}: not the plan's bits"

        def hand(hint):
            return lambda i: rope[hint](((total + 255) // 256,), (256,), (q[i], k[i], cos, sin, np.uint32(total)))

        def plan_call(i):
            plan.execute(q[i], k[i], cos, sin)

        def reader(i):
            consume((grid,), (256,), (q[i], k[i], np.uint32(nq), np.uint32(nk), out))

        def pair(first):
            return lambda i: (first(i), reader(i))

        calls = {"evict-first": hand(1), "plain": hand(0), "plan": plan_call, "consumer": reader,
                 "evict-first+consumer": pair(hand(1)), "plain+consumer": pair(hand(0)),
                 "plan+consumer": pair(plan_call)}
        for sets in set_counts:
            times = {name: graph_us(cp, _cycling(fn, sets), n=max(200, sets)) for name, fn in calls.items()}
            row = "  ".join(f"{name} {us:.3f}" for name, us in times.items())
            print(f"T={T:<3} sets={sets:<5} ({sets * (q[0].nbytes + k[0].nbytes) / 1e6:5.1f} MB)  {row}", flush=True)


if __name__ == "__main__":
    main()
