// RoPE fused with the paged KV-cache write (rope_rtc/ops/kv_cache.py): in one launch, rotate q (in
// place or into q_out) and k (into k_out, which may be k), and write the rotated k and the
// unrotated v into the caches at slot_mapping[t] (block = slot / block_size, offset = slot %
// block_size); a negative slot, or one past the cache, writes no cache entry for that token.
//
// Cache entries are either the input dtype (the rotated k exactly as k_out holds it) or FP8:
// the value as rounded to the input dtype, divided by the per-tensor scale in FP32 (a device
// scalar, so it can change between launches), saturated to the format's finite range and
// rounded to nearest even (cuda_fp8.h, __NV_SATFINITE): what RoPE followed by vLLM's
// reshape_and_cache_flash would store.
//
// Compile-time: ROPE_DTYPE, ROPE_INTERLEAVED, ROPE_VEC (as rope.cu), CACHE_KIND (0: the input
// dtype, 1: FP8 e4m3fn, 2: FP8 e5m2), KV_HQ, KV_HK (head counts), KV_D (head dim), KV_RD
// (rotary dim, the window starting at channel 0), KV_HB (heads per thread; divides both head counts).
//
// Work split: one thread per (token, group of KV_HB heads, unit) over HQ q heads, HK k heads and
// HK v heads (a group is all q, all k or all v; the table slice is read once per group). A
// unit is a pair of vectors of the window (half-split: lo and hi; interleaved: one vector), then
// one vector per unit of the channels past the window. v copies the same channels.
#include "common.cuh"
#include "positions.cuh"
#include "rope_types.cuh"
#include "fp8_entry.cuh"

#if !defined(CACHE_KIND) || !defined(KV_HQ) || !defined(KV_HK) || !defined(KV_D) || !defined(KV_RD) || !defined(KV_HB)
#error "rope_cache.cu needs every compile-time parameter (rope_rtc/build/registry.py: cache_spec)"
#endif

constexpr int HALF = KV_RD / 2;
constexpr unsigned ROT_UNITS = (ROPE_INTERLEAVED ? KV_RD : HALF) / VEC;
constexpr unsigned COPY_UNITS = (KV_D - KV_RD) / VEC;
constexpr unsigned UNITS = ROT_UNITS + COPY_UNITS;
constexpr unsigned HEADS = KV_HQ + 2 * KV_HK;
constexpr unsigned GROUPS = HEADS / KV_HB;
static_assert((ROPE_INTERLEAVED ? KV_RD : HALF) % VEC == 0 && (KV_D - KV_RD) % VEC == 0, "vectors must tile the head");
static_assert(CACHE_KIND == 0 || VEC >= 2, "an FP8 entry store needs at least 2 bytes");
static_assert(KV_HQ % KV_HB == 0 && KV_HK % KV_HB == 0, "KV_HB must divide both head counts");

// [0] is q, [1] is k, [2] is v (element strides of the token and head axes; the channel axis is
// contiguous). Every field is 8 bytes (the host mirror is a ctypes Structure).
struct CacheParams {
    u64 in[3], out[2];
    i64 in_st[3], in_sh[3], out_st[2], out_sh[2];
    u64 k_cache, v_cache;
    i64 cache_sb, cache_so, cache_sh;  // element strides of a cache's block, in-block offset, head
    i64 num_slots, block_size;  // num_slots < 2^31 (the host checks)
    u64 slot_mapping, k_scale, v_scale;
    u64 cos, sin, positions, offsets, cu_seqlens;
    i64 offset, num_tokens, num_seqs, table_rows, table_stride;
    i64 pos_mode, index_flags, slot_i64, total;
    u64 div_block;  // fast_div packed block_size
};

// One cache entry vector: the input dtype's bits, or FP8 of value / scale (fp8_entry.cuh).
__device__ __forceinline__ void store_entry(u64 cache, i64 at, const vec_t& x, const Fp8Scale& s) {
#if CACHE_KIND == 0
    store_stream((bits_t*)cache + at, x);
#else
    store_fp8<CACHE_KIND, conv, VEC>((unsigned char*)cache + at, x, s);
#endif
}

__device__ __forceinline__ void table_slice(const CacheParams& p, i64 t, unsigned u, float* c, float* sn) {
    table_slice_at<NPAIR>(p, token_row(p, t, 0, t), u * NPAIR, false, 1.0f, c, sn);
}

extern "C" __global__ void __launch_bounds__(256) rope_cache(const CacheParams p) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned)p.total) return;
    const unsigned t = i / (GROUPS * UNITS), r = i - t * (GROUPS * UNITS);
    const unsigned g = r / UNITS, u = r - g * UNITS;
    const unsigned h = g * KV_HB;  // the group's first head: its heads are all q, all k or all v
    const int which = h < KV_HQ ? 0 : (h < KV_HQ + KV_HK ? 1 : 2);
    const unsigned hh = h - (which == 0 ? 0 : (which == 1 ? KV_HQ : KV_HQ + KV_HK));
    const bool rot = u < ROT_UNITS;
    // Channels of this unit: (c0, c1) for a half-split rotary unit, c0 alone otherwise.
    const unsigned c0 = rot ? u * VEC : KV_RD + (u - ROT_UNITS) * VEC;
    const bool two = rot && !ROPE_INTERLEAVED;
    const unsigned c1 = c0 + HALF;
    // The slot (and the FP8 scale) first: issued with the input loads, not behind the k_out
    // store, which the compiler may not move a later load across (the pointers could alias).
    const i64 slot = which ? load_index(p.slot_mapping, t, p.slot_i64) : -1;
#if CACHE_KIND == 0
    const float scale = 1.0f;
#else
    const float scale = which ? *(const float*)(which == 1 ? p.k_scale : p.v_scale) : 1.0f;
#endif
    const i64 in_sh = p.in_sh[which];
    const bits_t* in = (const bits_t*)p.in[which] + ((i64)t * p.in_st[which] + (i64)hh * in_sh);
    vec_t a[KV_HB], b[KV_HB];
#pragma unroll
    for (int k = 0; k < KV_HB; ++k) {
        a[k] = load_stream(in + k * in_sh + c0);
        if (two) b[k] = load_stream(in + k * in_sh + c1);
    }

    if (which < 2 && rot) {  // rotate q and k: one table slice for the group's heads
        float c[NPAIR], sn[NPAIR];
        table_slice(p, t, u, c, sn);
#pragma unroll
        for (int k = 0; k < KV_HB; ++k) {
            // In place: each pair is read before its results are written.
#if ROPE_INTERLEAVED
            rotate_interleaved<conv, VEC>(a[k], c, sn, a[k]);
#else
            rotate_halves<conv, VEC>(a[k], b[k], c, sn, a[k], b[k]);
#endif
        }
    }
    if (which < 2) {  // q_out / k_out (in place: the same addresses; the outside of the window too)
        const i64 out_sh = p.out_sh[which];
        bits_t* out = (bits_t*)p.out[which] + ((i64)t * p.out_st[which] + (i64)hh * out_sh);
        if (rot || out != in) {
#pragma unroll
            for (int k = 0; k < KV_HB; ++k) {
                store_stream(out + k * out_sh + c0, a[k]);
                if (two) store_stream(out + k * out_sh + c1, b[k]);
            }
        }
    }
    if (which == 0 || slot < 0 || slot >= p.num_slots) return;  // q, a skipped token, or a slot past the cache
    const unsigned block = fast_div((unsigned)slot, p.div_block);
    const i64 off = slot - (i64)block * p.block_size;
    const i64 at = (i64)block * p.cache_sb + off * p.cache_so + (i64)hh * p.cache_sh;
    const u64 cache = which == 1 ? p.k_cache : p.v_cache;
#if CACHE_KIND == 0
    const Fp8Scale s{1.0f, 1.0f, true};
#else
    const Fp8Scale s = fp8_scale(scale);
#endif
#pragma unroll
    for (int k = 0; k < KV_HB; ++k) {
        store_entry(cache, at + k * p.cache_sh + c0, a[k], s);
        if (two) store_entry(cache, at + k * p.cache_sh + c1, b[k], s);
    }
}
