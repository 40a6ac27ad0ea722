// DeepSeek-style multi-head latent attention (rope_rtc/ops/mla.py): in one launch,
//   - rotate the last MLA_RD channels of each of q's MLA_H heads (in place, or into q_out with the
//     first MLA_NOPE channels copied), and, with MLA_QFP8, write the whole of q in FP8 too;
//   - rotate k_pe (one rotary head shared by every q head) in place, whatever its token's slot;
//   - write the row [kv_c | rotated k_pe] (MLA_LORA + MLA_RD channels) into the paged cache at
//     slot_mapping[t]; a negative slot, or one past the cache, writes no row for its token.
// Cache rows are the input dtype or FP8 of CACHE_KIND: the value as rounded to the input dtype,
// divided by the per-tensor scale in FP32, saturated and rounded to nearest even (fp8_entry.cuh),
// which is what RoPE followed by a separate quantising cache write (vLLM's concat_and_cache_mla)
// stores.
//
// Compile-time: ROPE_DTYPE, ROPE_INTERLEAVED, ROPE_VEC (rope_types.cuh), CACHE_KIND (0: the input
// dtype, 1: FP8 e4m3fn, 2: FP8 e5m2), MLA_QFP8 (0: no FP8 q, else its FP8 kind), MLA_H (q heads),
// MLA_NOPE, MLA_RD (q's unrotated and rotated channels), MLA_LORA (kv_c's channels).
//
// Work split: one thread per (token, unit), token-major so that a token's threads read and write
// neighbouring memory. A token's units are its q heads' (q_units each: the rotary units, then,
// when the unrotated channels are copied or quantised, one per vector of them), then the cache
// row's: the rotary units of k_pe, then one per vector of kv_c. A rotary unit is a pair of vectors
// (half-split: lo and hi) or one vector (interleaved); every access is one aligned vector.
#include "common.cuh"
#include "positions.cuh"
#include "rope_types.cuh"
#include "fp8_entry.cuh"

#if !defined(CACHE_KIND) || !defined(MLA_QFP8) || !defined(MLA_H) || !defined(MLA_NOPE) || !defined(MLA_RD) || \
    !defined(MLA_LORA)
#error "mla_rope_cache.cu needs every compile-time parameter (rope_rtc/build/registry_mla.py: mla_spec)"
#endif

constexpr unsigned HALF = MLA_RD / 2;
constexpr unsigned ROT_UNITS = (ROPE_INTERLEAVED ? MLA_RD : HALF) / VEC;
static_assert((ROPE_INTERLEAVED ? MLA_RD : HALF) % VEC == 0 && MLA_NOPE % VEC == 0 && MLA_LORA % VEC == 0,
              "vectors must tile q's parts and the cache row");
static_assert((CACHE_KIND == 0 && MLA_QFP8 == 0) || VEC % 2 == 0, "FP8 entries are stored in pairs");

// Every field is 8 bytes (the host mirror, rope_rtc/ops/mla_request.py: MlaParams, is a ctypes Structure).
// Strides are in elements of each array (bytes for the uint8 ones).
struct MlaParams {
    u64 q, q_out, q_fp8, k_pe, kv_c, cache;
    u64 slot_mapping, positions, cos, sin, cache_scale, q_scale;
    i64 q_st, q_sh, qo_st, qo_sh, qf_st, qf_sh;
    i64 kpe_st, kvc_st, cache_sb, cache_so;
    i64 num_slots, block_size, table_rows, table_stride;
    i64 index_flags, slot_i64, total, q_units, token_units;
    u64 div_block, div_token, div_q_units;
};

// A cache entry vector at element `at` of the cache: the input dtype's bits, or FP8.
__device__ __forceinline__ void store_entry(const MlaParams& p, i64 at, const vec_t& x, const Fp8Scale& s) {
#if CACHE_KIND == 0
    store_stream((bits_t*)p.cache + at, x);
#else
    store_fp8<CACHE_KIND, conv, VEC>((unsigned char*)p.cache + at, x, s);
#endif
}

__device__ __forceinline__ Fp8Scale cache_scale(const MlaParams& p) {
#if CACHE_KIND == 0
    return Fp8Scale{1.0f, 1.0f, true};
#else
    return fp8_scale(*(const float*)p.cache_scale);
#endif
}

// The rotation of one rotary unit (u < ROT_UNITS) of the MLA_RD channels at x, in place in a/b.
__device__ __forceinline__ void rotate_unit(const MlaParams& p, i64 row, unsigned u, vec_t& a, vec_t& b) {
    float c[NPAIR], sn[NPAIR];
    table_slice_at<NPAIR>(p, row, u * NPAIR, false, 1.0f, c, sn);
#if ROPE_INTERLEAVED
    rotate_interleaved<conv, VEC>(a, c, sn, a);
#else
    rotate_halves<conv, VEC>(a, b, c, sn, a, b);
#endif
}

// Where slot t's row starts (elements of the cache), or -1 for a token that writes no row.
__device__ __forceinline__ i64 row_at(const MlaParams& p, unsigned t) {
    const i64 slot = load_index(p.slot_mapping, t, p.slot_i64);
    if (slot < 0 || slot >= p.num_slots) return -1;
    const unsigned block = fast_div((unsigned)slot, p.div_block);
    return (i64)block * p.cache_sb + (slot - (i64)block * p.block_size) * p.cache_so;
}

extern "C" __global__ void __launch_bounds__(256) mla_rope_cache(const MlaParams p) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned)p.total) return;
    const unsigned t = fast_div(i, p.div_token);
    const unsigned r = i - t * (unsigned)p.token_units;
    const unsigned q_part = MLA_H * (unsigned)p.q_units;
    constexpr bool two = !ROPE_INTERLEAVED;
    if (r < q_part) {  // a unit of q head h
        const unsigned h = fast_div(r, p.div_q_units);
        const unsigned g = r - h * (unsigned)p.q_units;
        const bits_t* in = (const bits_t*)p.q + ((i64)t * p.q_st + (i64)h * p.q_sh);
        bits_t* out = (bits_t*)p.q_out + ((i64)t * p.qo_st + (i64)h * p.qo_sh);
#if MLA_QFP8
        const Fp8Scale s = fp8_scale(*(const float*)p.q_scale);
        unsigned char* f = (unsigned char*)p.q_fp8 + ((i64)t * p.qf_st + (i64)h * p.qf_sh);
#endif
        if (g >= ROT_UNITS) {  // a vector of the unrotated channels: copied, quantised, or both
            const unsigned c0 = (g - ROT_UNITS) * VEC;
            const vec_t a = load_stream(in + c0);
            if (out != in) store_stream(out + c0, a);  // in place they stay as they are
#if MLA_QFP8
            store_fp8<MLA_QFP8, conv, VEC>(f + c0, a, s);
#endif
            return;
        }
        const unsigned c0 = MLA_NOPE + g * VEC;  // rotary unit g
        vec_t a = load_stream(in + c0), b;
        if (two) b = load_stream(in + c0 + HALF);
        rotate_unit(p, token_row_in<POS_POSITIONS>(p, t, 0, 0), g, a, b);
        store_stream(out + c0, a);
        if (two) store_stream(out + c0 + HALF, b);
#if MLA_QFP8
        store_fp8<MLA_QFP8, conv, VEC>(f + c0, a, s);
        if (two) store_fp8<MLA_QFP8, conv, VEC>(f + c0 + HALF, b, s);
#endif
        return;
    }
    const unsigned u = r - q_part;
    if (u < ROT_UNITS) {  // a rotary unit of k_pe: rotated in place whatever the slot, then its entries
        const i64 at = row_at(p, t);
        const unsigned c0 = u * VEC;
        bits_t* kp = (bits_t*)p.k_pe + (i64)t * p.kpe_st;
        vec_t a = load_stream(kp + c0), b;
        if (two) b = load_stream(kp + c0 + HALF);
        rotate_unit(p, token_row_in<POS_POSITIONS>(p, t, 0, 0), u, a, b);
        store_stream(kp + c0, a);
        if (two) store_stream(kp + c0 + HALF, b);
        if (at < 0) return;
        const Fp8Scale s = cache_scale(p);
        store_entry(p, at + MLA_LORA + c0, a, s);
        if (two) store_entry(p, at + MLA_LORA + c0 + HALF, b, s);
        return;
    }
    const i64 at = row_at(p, t);  // a vector of kv_c: nothing to do for a token that writes no row
    if (at < 0) return;
    const unsigned c = (u - ROT_UNITS) * VEC;
    const vec_t x = load_stream((const bits_t*)p.kv_c + (i64)t * p.kvc_st + c);
    store_entry(p, at + c, x, cache_scale(p));
}
