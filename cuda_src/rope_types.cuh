// The element and vector types of the general RoPE kernels: the generic build (rope.cu), the
// specialised build (rope_fixed.cu) and the fused KV-cache write (rope_cache.cu), which must agree
// bit for bit. (qk_norm_rope.cu defines the same names itself: included from here, they would
// move its constants in the binary's data, a different CUBIN for the same instructions.)
//
// The generic and specialised builds run one per-thread sequence: every head's vectors loaded
// before any store, the unit's angles read once for those heads, then each head rotated by
// rotation.cuh's function for its pair style and stored. Each kernel writes that short loop out
// itself, around its own addressing: NVVM simplifies a function before it inlines it, and a
// shared function holding the loop (or a head's loads or stores) laid the specialised builds'
// address arithmetic out in another order, and ptxas allocated other binaries, for the builds of
// two or more heads per thread (benchmarks/probes/ptx_diff.py compares every build's code).
//
//   ROPE_DTYPE        element type code (common.cuh)
//   ROPE_INTERLEAVED  0: half-split pairs (x[i], x[i + R/2]) (GPT-NeoX, HF rotate_half)
//                     1: adjacent pairs (x[2i], x[2i + 1]) (RoFormer, GPT-J)
//   ROPE_VEC          elements per vector access (the host picks a width its alignment allows)
#pragma once

#include "common.cuh"
#include "rotation.cuh"

#if !defined(ROPE_DTYPE) || !defined(ROPE_INTERLEAVED) || !defined(ROPE_VEC)
#error "this kernel needs -DROPE_DTYPE, -DROPE_INTERLEAVED and -DROPE_VEC"
#endif

#if ROPE_INTERLEAVED && (ROPE_VEC % 2)
#error "interleaved pairs need an even vector width"
#endif

constexpr int VEC = ROPE_VEC;
// Pairs (and so table entries) one vector of interleaved pairs holds, or a vector of each half
// of half-split pairs.
constexpr int NPAIR = ROPE_INTERLEAVED ? VEC / 2 : VEC;
typedef Scalar<elem_t> conv;
typedef conv::bits_t bits_t;
typedef Vec<bits_t, VEC> vec_t;
typedef typename RawAccess<sizeof(vec_t)>::type raw_t;

// q and k (and v, and the cache entries) are streamed once: evict-first loads and stores
// (ld/st.global.cs) keep them from displacing the table rows in L2, and are faster than plain
// ones on every prefill case. (The generic build, rope.cu, keeps plain accesses.)
__device__ __forceinline__ vec_t load_stream(const bits_t* p) {
    vec_t r;
    r.raw = __ldcs((const raw_t*)p);
    return r;
}

__device__ __forceinline__ void store_stream(bits_t* p, const vec_t& v) { __stcs((raw_t*)p, v.raw); }
