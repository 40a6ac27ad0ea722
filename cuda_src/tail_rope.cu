// Prepared BF16 tail RoPE (seed: prepared-bf16-tail-rope.txt), bit-exact on every architecture.
//
// x and out are contiguous BF16 [T, H, D]; cosine and sine contiguous FP32 [T, 32]. The last 64
// channels of every head are rotated in adjacent pairs (a, b):
//     real = bf16_rne(fma(a, c, -fp32(b * s)))
//     imag = bf16_rne(fma(b, c,  fp32(a * s)))
// That is rotation.cuh's rotate_pair, every kernel's rotation: __fmul_rn is never contracted into
// an FMA by the compiler, and __fmaf_rn is one correctly rounded FMA, so the expression holds
// whatever --fmad says. The prefix is copied bit for bit.
//
// Compile-time: TAIL_HEADS (H) and TAIL_DIM (D in {128, 512}): the contract specialises on
// them, and knowing them turns the token index into a multiply-shift instead of a 64-bit
// division on every 16 bytes.
#include "common.cuh"
#include "rotation.cuh"

#if !defined(TAIL_HEADS) || !defined(TAIL_DIM)
#error "tail_rope.cu needs -DTAIL_HEADS and -DTAIL_DIM"
#endif
#if TAIL_DIM != 128 && TAIL_DIM != 512
#error "TAIL_DIM must be 128 or 512"
#endif

constexpr int TAIL_CHANNELS = 64;               // the rotated tail, fixed by the contract
constexpr int ELEMS = 8;                        // BF16 elements per 16-byte vector
constexpr int HEAD_VECS = TAIL_DIM / ELEMS;     // vectors per head (a power of two)
constexpr int TAIL_START = (TAIL_DIM - TAIL_CHANNELS) / ELEMS;
constexpr u64 ROW_VECS = (u64)TAIL_HEADS * HEAD_VECS;  // vectors per token
constexpr int TABLE_VECS = TAIL_CHANNELS / 2 / 4;        // float4 per table row (8)

__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ unsigned rotate_word(unsigned w, float c, float s) {
    const float a = bf16_lo(w), b = bf16_hi(w);
    float re, im;
    rotate_pair(a, b, c, s, re, im);  // the contract's arithmetic (rotation.cuh)
    const __nv_bfloat16 lo = __float2bfloat16_rn(re);
    const __nv_bfloat16 hi = __float2bfloat16_rn(im);
    return (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
}

__device__ __forceinline__ uint4 process(uint4 v, u64 i, const float4* cosv, const float4* sinv) {
    const unsigned in_head = (unsigned)(i & (HEAD_VECS - 1));
    if (in_head < TAIL_START) return v;  // prefix: copied bit for bit
    const u64 token = i / ROW_VECS;          // constant divisor: multiply and shift
    const u64 tv = token * TABLE_VECS + (in_head - TAIL_START);
    const float4 c = __ldg(cosv + tv);
    const float4 s = __ldg(sinv + tv);
    v.x = rotate_word(v.x, c.x, s.x);
    v.y = rotate_word(v.y, c.y, s.y);
    v.z = rotate_word(v.z, c.z, s.z);
    v.w = rotate_word(v.w, c.w, s.w);
    return v;
}

// UNROLL vectors per thread, strided by the block so every load instruction stays coalesced.
// One vector per thread (UNROLL = 1) is the fastest with cold L2 on every shape, large and small,
// against 4 or 8: more threads in flight hide more DRAM latency.
template <int UNROLL>
__device__ __forceinline__ void tail_body(const uint4* __restrict__ x, uint4* __restrict__ out,
                                          const float4* __restrict__ cosv, const float4* __restrict__ sinv,
                                          i64 num_vectors) {
    const u64 base = (u64)blockIdx.x * blockDim.x * UNROLL + threadIdx.x;
    const u64 n = (u64)num_vectors;
    uint4 v[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
        const u64 i = base + (u64)k * blockDim.x;
        if (i < n) v[k] = x[i];
    }
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) {
        const u64 i = base + (u64)k * blockDim.x;
        if (i < n) out[i] = process(v[k], i, cosv, sinv);
    }
}

extern "C" __global__ void __launch_bounds__(256) tail_rope_bf16_x1(
    const uint4* __restrict__ x, uint4* __restrict__ out, const float4* __restrict__ cosv,
    const float4* __restrict__ sinv, i64 num_vectors) {
    tail_body<1>(x, out, cosv, sinv, num_vectors);
}
