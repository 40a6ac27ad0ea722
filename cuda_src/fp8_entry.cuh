// FP8 entries of a value in the input dtype, for the cache writes of rope_cache.cu and
// mla_rope_cache.cu: value / scale in FP32 (round to nearest), saturated to the format's largest
// finite value and rounded to nearest even (cuda_fp8.h, __NV_SATFINITE).
#pragma once

#include "common.cuh"
#include <cuda_fp8.h>

// value / scale rounded to nearest, as __fdiv_rn gives it, without the division's slow path:
// q0 = value * r (r the correctly rounded reciprocal of the scale) is within one ulp of the
// quotient, and one Markstein correction q0 + (value - scale * q0) * r rounds it correctly (Muller
// et al., Handbook of Floating-Point Arithmetic, theorem 4.10) while nothing underflows or
// overflows: taken only for scales in [2^-64, 2^64] (fp8_fast_scale). Where the correction has no
// meaning (q1 zero or NaN) q0 is what the division gives, or rounds to the same entry after
// saturation.
__device__ __forceinline__ float fp8_quotient(float x, float scale, float r) {
    const float q0 = __fmul_rn(x, r);
    const float q1 = __fmaf_rn(__fmaf_rn(-q0, scale, x), r, q0);
    return fabsf(q1) > 0.0f ? q1 : q0;
}

__device__ __forceinline__ bool fp8_fast_scale(float scale) {
    const float a = fabsf(scale);
    return a >= 0x1p-64f && a <= 0x1p64f;
}

// A scale read once per thread, with what its entries need: the reciprocal and whether the fast
// quotient is exact for it.
struct Fp8Scale {
    float scale, rcp;
    bool fast;
};

__device__ __forceinline__ Fp8Scale fp8_scale(float scale) {
    Fp8Scale s;
    s.scale = scale;
    s.rcp = __frcp_rn(scale);
    s.fast = fp8_fast_scale(scale);
    return s;
}

// The N entries (N even) of a vector x of element type Conv (a Scalar<T> of common.cuh) in FP8 of
// KIND (1: e4m3fn, 2: e5m2), stored as one N-byte access at dst. Evict-first: written once, read
// by a later kernel; with the default policy the entries stay in L2 at q's and k's expense, and
// the KV-cache write's FP8 launch took as long as one writing twice the entry bytes. Converted
// in pairs: one cvt.rn.satfinite per two entries.
template <int KIND, typename Conv, int N>
__device__ __forceinline__ void store_fp8(unsigned char* dst, const Vec<typename Conv::bits_t, N>& x,
                                          const Fp8Scale& s) {
    static_assert(KIND == 1 || KIND == 2, "FP8 kind: 1 (e4m3fn) or 2 (e5m2)");
    static_assert(N % 2 == 0, "FP8 entries are converted in pairs");
    Vec<unsigned short, N / 2> e;
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
        const float x0 = Conv::to_float(x.v[2 * j]), x1 = Conv::to_float(x.v[2 * j + 1]);
        const float2 v = s.fast ? make_float2(fp8_quotient(x0, s.scale, s.rcp), fp8_quotient(x1, s.scale, s.rcp))
                                : make_float2(__fdiv_rn(x0, s.scale), __fdiv_rn(x1, s.scale));
        e.v[j] = __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, KIND == 1 ? __NV_E4M3 : __NV_E5M2);
    }
    __stcs((typename RawAccess<N>::type*)dst, e.raw);
}
