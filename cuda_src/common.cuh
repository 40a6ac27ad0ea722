// Shared device helpers for every rope_rtc kernel family.
//
// Everything here is header-only and compiled into each specialisation by NVRTC. Sources are
// read at run time from this folder; the host hashes each kernel's .cu file and the headers it
// includes into its cache key, so editing this header invalidates every cached binary built with it.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;
typedef unsigned long long u64;

// Element types, selected by the host with -DROPE_DTYPE=<code>. The codes are part of the
// host/device contract (rope_rtc/build/registry.py names them).
#define ROPE_DTYPE_F32 0
#define ROPE_DTYPE_F16 1
#define ROPE_DTYPE_BF16 2

// The element type of a kernel built with -DROPE_DTYPE (the general kernels).
#ifdef ROPE_DTYPE
#if ROPE_DTYPE == ROPE_DTYPE_F32
typedef float elem_t;
#elif ROPE_DTYPE == ROPE_DTYPE_F16
typedef __half elem_t;
#elif ROPE_DTYPE == ROPE_DTYPE_BF16
typedef __nv_bfloat16 elem_t;
#else
#error "unknown ROPE_DTYPE"
#endif
#endif

// Element types as raw bits, so vectors are plain integer loads: a struct of __half or
// __nv_bfloat16 (classes with constructors) is not always turned into one 16-byte access.
template <typename T> struct Scalar;
template <> struct Scalar<float> {
    typedef float bits_t;
    static __device__ __forceinline__ float to_float(float v) { return v; }
    static __device__ __forceinline__ float from_float(float v) { return v; }
};
template <> struct Scalar<__half> {
    typedef unsigned short bits_t;
    static __device__ __forceinline__ float to_float(unsigned short v) { return __half2float(__ushort_as_half(v)); }
    // One rounding, to nearest even: the numerical contract of docs/design.md.
    static __device__ __forceinline__ unsigned short from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
};
template <> struct Scalar<__nv_bfloat16> {
    typedef unsigned short bits_t;
    static __device__ __forceinline__ float to_float(unsigned short v) { return __uint_as_float((unsigned)v << 16); }
    static __device__ __forceinline__ unsigned short from_float(float v) {
        return __bfloat16_as_ushort(__float2bfloat16_rn(v));
    }
};

// The integer type of one access of B bytes.
template <int B> struct RawAccess;
template <> struct RawAccess<32> { struct alignas(32) type { uint4 a, b; }; };
template <> struct RawAccess<16> { typedef uint4 type; };
template <> struct RawAccess<8> { typedef uint2 type; };
template <> struct RawAccess<4> { typedef unsigned type; };
template <> struct RawAccess<2> { typedef unsigned short type; };

// N elements moved as one aligned access. The host only picks N such that every address the
// kernel forms is a multiple of the access size, so this is one 16-, 8-, 4- or 2-byte load.
template <typename Bits, int N> union Vec {
    typename RawAccess<sizeof(Bits) * N>::type raw;
    Bits v[N];
};

template <typename Bits, int N>
__device__ __forceinline__ Vec<Bits, N> load_vec(const void* p) {
    Vec<Bits, N> r;
    r.raw = *(const typename RawAccess<sizeof(Bits) * N>::type*)p;
    return r;
}

// The same through the read-only (non-coherent) path, for arrays no thread of the kernel writes
// (the cos/sin tables: the host refuses outputs that overlap them).
template <typename Bits, int N>
__device__ __forceinline__ Vec<Bits, N> ldg_vec(const void* p) {
    Vec<Bits, N> r;
    if constexpr (sizeof(Bits) * N == 32) {
        r.raw.a = __ldg((const uint4*)p);
        r.raw.b = __ldg((const uint4*)p + 1);
    } else {
        r.raw = __ldg((const typename RawAccess<sizeof(Bits) * N>::type*)p);
    }
    return r;
}

template <typename Bits, int N>
__device__ __forceinline__ void store_vec(void* p, const Vec<Bits, N>& v) {
    *(typename RawAccess<sizeof(Bits) * N>::type*)p = v.raw;
}

// Division of n < 2^31 by a run-time invariant d in [1, 2^31) as a multiply-shift (Granlund and
// Montgomery, PLDI 1994): the host packs m = floor(2^32 (2^l - d) / d) + 1 in the low 32 bits and
// l = ceil(log2 d) above them (rope_rtc/ops/rope_params.py: fast_divisor). Exact for every n < 2^32
// whose n + umulhi(n, m) does not overflow, which n < 2^31 guarantees. A 32-bit division is a
// ~20-instruction sequence; this is three.
__device__ __forceinline__ unsigned fast_div(unsigned n, u64 packed) {
    return (__umulhi(n, (unsigned)packed) + n) >> (unsigned)(packed >> 32);
}

// Programmatic dependent launch (sm_90 and newer; a build with -DROPE_PDL=1, launched by the host
// with programmatic stream serialization): the kernel may start while the kernel before it on the
// stream is still running, so its launch and its index arithmetic overlap that kernel's tail.
// wait_for_producer() blocks until that kernel has finished and its writes are visible; every
// kernel calls it before its first load. allow_dependents() lets the kernel after this one start
// its own launch early (it still waits for this one's writes in its own wait). Both compile to
// nothing in every other build, which is therefore unchanged.
__device__ __forceinline__ void wait_for_producer() {
#if defined(ROPE_PDL) && ROPE_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(ROPE_PDL) && ROPE_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
