// Shared device helpers for every rope_rtc kernel family.
//
// Everything here is header-only and compiled into each specialisation by NVRTC. Sources are
// read at run time from this folder; the host hashes every file under cuda_src/ into the cache
// key, so editing this header invalidates every cached binary that could include it.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;
typedef unsigned long long u64;

// Element types, selected by the host with -DROPE_DTYPE=<code>. The codes are part of the
// host/device contract (rope_rtc/registry.py names them).
#define ROPE_DTYPE_F32 0
#define ROPE_DTYPE_F16 1
#define ROPE_DTYPE_BF16 2

template <typename T> struct Scalar;
template <> struct Scalar<float> {
    static __device__ __forceinline__ float to_float(float v) { return v; }
    static __device__ __forceinline__ float from_float(float v) { return v; }
};
template <> struct Scalar<__half> {
    static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
    // One rounding, to nearest even: the numerical contract of DESIGN.md.
    static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};
template <> struct Scalar<__nv_bfloat16> {
    static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

// N elements moved as one aligned access. The host only picks N such that every address the
// kernel forms is a multiple of sizeof(Vec), so the compiler may emit 16-, 8- or 4-byte loads.
template <typename T, int N> struct alignas(sizeof(T) * N) Vec {
    T v[N];
};
