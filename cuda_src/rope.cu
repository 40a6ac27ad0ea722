// The general RoPE kernel family: any float dtype, half-split or interleaved pairs, a rotary
// window inside the head, q and k (different head counts) in one launch, four position schemes.
//
// Compile-time parameters (what code generation needs, nothing else):
//   ROPE_DTYPE        element type code (common.cuh)
//   ROPE_INTERLEAVED  0: half-split pairs (x[i], x[i + R/2]) (GPT-NeoX, HF rotate_half)
//                     1: adjacent pairs (x[2i], x[2i + 1]) (RoFormer, GPT-J)
//   ROPE_VEC          elements per vector access (16 bytes when the host's alignment allows)
// Everything else (strides, counts, window, positions, direction) is a run-time field of
// RopeParams, so one binary serves every shape.
//
// Work split: one thread per (token, group of HEAD_BATCH heads, vector unit), a flat grid like a
// copy kernel's. A thread loads its table slice once, issues the loads of all its heads before
// any store (more bytes in flight, index arithmetic amortised), then rotates and stores. The
// host picks which of token and head group varies faster (heads_inner) so that neighbouring
// threads touch neighbouring memory in every layout. A token's cos/sin row is read from DRAM
// once and served to its other head groups from L1/L2.
#include "common.cuh"

#if !defined(ROPE_DTYPE) || !defined(ROPE_INTERLEAVED) || !defined(ROPE_VEC)
#error "rope.cu needs -DROPE_DTYPE, -DROPE_INTERLEAVED and -DROPE_VEC"
#endif

#if ROPE_DTYPE == ROPE_DTYPE_F32
typedef float elem_t;
#elif ROPE_DTYPE == ROPE_DTYPE_F16
typedef __half elem_t;
#elif ROPE_DTYPE == ROPE_DTYPE_BF16
typedef __nv_bfloat16 elem_t;
#else
#error "unknown ROPE_DTYPE"
#endif

#if ROPE_INTERLEAVED && (ROPE_VEC % 2)
#error "interleaved pairs need an even vector width"
#endif

constexpr int VEC = ROPE_VEC;
// Pairs (and so table entries) one vector unit touches.
constexpr int NPAIR = ROPE_INTERLEAVED ? VEC / 2 : VEC;
// Heads per thread (ROPE_HEAD_BATCH, chosen by the host), loaded before any is stored (in place,
// the compiler could not reorder a load of one head above the store of another on its own: the
// pointers may alias).
#ifndef ROPE_HEAD_BATCH
#error "rope.cu needs -DROPE_HEAD_BATCH (rope_rtc/registry.py: rope_head_batch)"
#endif
constexpr int HEAD_BATCH = ROPE_HEAD_BATCH;
typedef Scalar<elem_t> conv;
typedef conv::bits_t bits_t;
typedef Vec<bits_t, VEC> vec_t;

// Position schemes (pos_mode). The codes are mirrored in rope_rtc/rope_params.py.
#define POS_OFFSET 0       // offset + s
#define POS_OFFSETS 1      // offsets[b] + s
#define POS_POSITIONS 2    // positions[t]
#define POS_CU_SEQLENS 3   // t - cu_seqlens[b] + (offsets ? offsets[b] : offset)

#define IDX_POSITIONS_I64 1
#define IDX_OFFSETS_I64 2
#define IDX_CU_SEQLENS_I64 4

// Every field is 8 bytes so the host mirror (a ctypes Structure) has no padding to get wrong.
struct RopeParams {
    u64 q_in, q_out, k_in, k_out;  // device addresses; k_* are 0 when there is no k
    i64 q_in_sb, q_in_ss, q_in_sh;  // element strides of the batch, sequence and head axes
    i64 q_out_sb, q_out_ss, q_out_sh;
    i64 k_in_sb, k_in_ss, k_in_sh;
    i64 k_out_sb, k_out_ss, k_out_sh;
    u64 cos, sin;          // float32 tables, row r at r * table_stride
    u64 positions;         // POS_POSITIONS: one per token
    u64 offsets;           // POS_OFFSETS / POS_CU_SEQLENS: one per sequence, or 0
    u64 cu_seqlens;        // POS_CU_SEQLENS: num_seqs + 1 entries
    i64 offset;            // scalar offset
    i64 num_tokens;        // B * S (T for packed tokens)
    i64 seq_len;           // S: token t is (b, s) = (t / S, t % S)
    i64 num_seqs;          // B for POS_CU_SEQLENS
    i64 table_rows, table_stride;
    i64 q_heads, k_heads, head_dim;
    i64 rot_offset, rot_half;  // rotary window [rot_offset, rot_offset + 2 * rot_half)
    i64 pos_mode, index_flags, inverse, copy_passthrough;
    i64 table_vec;         // 1: table rows may be read NPAIR floats at a time (aligned)
    i64 heads_inner;       // 1: thread order (token, head, unit); 0: (head, token, unit)
};

__device__ __forceinline__ i64 load_index(u64 base, i64 i, bool wide) {
    return wide ? ((const i64*)base)[i] : (i64)((const int*)base)[i];
}

__device__ __forceinline__ void split_token(i64 t, i64 seq_len, i64& b, i64& s) {
    // 32-bit division when it fits: a 64-bit one costs several times as many instructions.
    if (((t | seq_len) >> 31) == 0) {
        const unsigned ut = (unsigned)t, us = (unsigned)seq_len;
        b = ut / us;
        s = ut - (unsigned)b * us;
    } else {
        b = t / seq_len;
        s = t - b * seq_len;
    }
}

// The table row for token t; -1 when it falls outside the table (the caller writes NaN rather
// than reading out of bounds: device-side positions are never read back to the host).
__device__ i64 token_row(const RopeParams& p, i64 t, i64 b, i64 s) {
    i64 pos;
    switch ((int)p.pos_mode) {
        case POS_OFFSET: pos = p.offset + s; break;
        case POS_OFFSETS: pos = load_index(p.offsets, b, p.index_flags & IDX_OFFSETS_I64) + s; break;
        case POS_POSITIONS: pos = load_index(p.positions, t, p.index_flags & IDX_POSITIONS_I64); break;
        default: {
            const bool wide = p.index_flags & IDX_CU_SEQLENS_I64;
            // Last sequence whose start is <= t (cu_seqlens is non-decreasing).
            i64 lo = 0, hi = p.num_seqs;
            if (t < load_index(p.cu_seqlens, 0, wide) || t >= load_index(p.cu_seqlens, hi, wide)) return -1;
            while (hi - lo > 1) {
                const i64 mid = (lo + hi) >> 1;
                if (load_index(p.cu_seqlens, mid, wide) <= t) lo = mid; else hi = mid;
            }
            const i64 base = p.offsets ? load_index(p.offsets, lo, p.index_flags & IDX_OFFSETS_I64) : p.offset;
            pos = t - load_index(p.cu_seqlens, lo, wide) + base;
        }
    }
    return (pos >= 0 && pos < p.table_rows) ? pos : -1;
}

__device__ __forceinline__ void rotate(float x0, float x1, float c, float s, float& o0, float& o1) {
    o0 = x0 * c - x1 * s;
    o1 = x1 * c + x0 * s;
}

// Element offsets of head h (of q, or of k past the q heads) for token (b, s).
struct HeadPtrs {
    const bits_t* in;
    bits_t* out;
};

__device__ __forceinline__ HeadPtrs head_ptrs(const RopeParams& p, i64 h, i64 b, i64 s, i64 ch) {
    HeadPtrs r;
    if (h < p.q_heads) {
        r.in = (const bits_t*)p.q_in + (b * p.q_in_sb + s * p.q_in_ss + h * p.q_in_sh + ch);
        r.out = (bits_t*)p.q_out + (b * p.q_out_sb + s * p.q_out_ss + h * p.q_out_sh + ch);
    } else {
        const i64 hh = h - p.q_heads;
        r.in = (const bits_t*)p.k_in + (b * p.k_in_sb + s * p.k_in_ss + hh * p.k_in_sh + ch);
        r.out = (bits_t*)p.k_out + (b * p.k_out_sb + s * p.k_out_ss + hh * p.k_out_sh + ch);
    }
    return r;
}

// The vectors one unit of one head reads: one for interleaved pairs, two (lo and hi halves)
// for half-split pairs.
struct Unit {
    vec_t a;
#if !ROPE_INTERLEAVED
    vec_t b;
#endif
};

__device__ __forceinline__ Unit load_unit(const HeadPtrs& hp, i64 rot_half) {
    Unit u;
    u.a = load_vec<bits_t, VEC>(hp.in);
#if !ROPE_INTERLEAVED
    u.b = load_vec<bits_t, VEC>(hp.in + rot_half);
#endif
    return u;
}

__device__ __forceinline__ void rotate_store(const HeadPtrs& hp, const Unit& u, const float* c, const float* sn,
                                             i64 rot_half) {
#if ROPE_INTERLEAVED
    vec_t r;
#pragma unroll
    for (int j = 0; j < NPAIR; ++j) {
        float o0, o1;
        rotate(conv::to_float(u.a.v[2 * j]), conv::to_float(u.a.v[2 * j + 1]), c[j], sn[j], o0, o1);
        r.v[2 * j] = conv::from_float(o0);
        r.v[2 * j + 1] = conv::from_float(o1);
    }
    store_vec<bits_t, VEC>(hp.out, r);
#else
    vec_t rlo, rhi;
#pragma unroll
    for (int j = 0; j < NPAIR; ++j) {
        float o0, o1;
        rotate(conv::to_float(u.a.v[j]), conv::to_float(u.b.v[j]), c[j], sn[j], o0, o1);
        rlo.v[j] = conv::from_float(o0);
        rhi.v[j] = conv::from_float(o1);
    }
    store_vec<bits_t, VEC>(hp.out, rlo);
    store_vec<bits_t, VEC>(hp.out + rot_half, rhi);
#endif
}

// i -> (unit, head, token) for `units` units per head; 32-bit division when everything fits.
__device__ __forceinline__ void decompose(i64 i, i64 units, i64 heads, i64 tokens, bool heads_inner, i64& u,
                                          i64& h, i64& t) {
    if (((i | (units * heads * tokens)) >> 31) == 0) {
        const unsigned ui = (unsigned)i, uu = (unsigned)units;
        const unsigned r = ui / uu;
        u = ui - r * uu;
        if (heads_inner) {
            const unsigned uh = (unsigned)heads, q = r / uh;
            h = r - q * uh;
            t = q;
        } else {
            const unsigned ut = (unsigned)tokens, q = r / ut;
            t = r - q * ut;
            h = q;
        }
    } else {
        const i64 r = i / units;
        u = i - r * units;
        if (heads_inner) {
            t = r / heads;
            h = r - t * heads;
        } else {
            h = r / tokens;
            t = r - h * tokens;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) rope_apply(const RopeParams p) {
    const i64 units = ROPE_INTERLEAVED ? (2 * p.rot_half) / VEC : p.rot_half / VEC;
    const i64 heads = p.q_heads + p.k_heads;
    const i64 groups = (heads + HEAD_BATCH - 1) / HEAD_BATCH;
    const i64 rot_total = p.num_tokens * groups * units;
    // Out of place with a partial window: channels outside it are copied, VEC at a time.
    const i64 prefix = p.rot_offset / VEC;
    const i64 suffix_start = p.rot_offset + 2 * p.rot_half;
    const i64 copy_units = p.copy_passthrough ? prefix + (p.head_dim - suffix_start) / VEC : 0;
    const i64 total = rot_total + p.num_tokens * heads * copy_units;
    const float sign = p.inverse ? -1.0f : 1.0f;

    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 u, h, t, b, s;
        if (i < rot_total) {
            i64 g;
            decompose(i, units, groups, p.num_tokens, p.heads_inner, u, g, t);
            split_token(t, p.seq_len, b, s);
            const i64 ch = p.rot_offset + u * VEC;
            HeadPtrs hp[HEAD_BATCH];
            Unit in[HEAD_BATCH];
#pragma unroll
            for (int k = 0; k < HEAD_BATCH; ++k) {
                // Consecutive heads per thread. (Strided heads g + k*groups measured worse:
                // 76-86% of copy for interleaved pairs against 89-94%; docs/perf_notes.md.)
                const i64 hk = g * HEAD_BATCH + k;
                if (hk < heads) {
                    hp[k] = head_ptrs(p, hk, b, s, ch);
                    in[k] = load_unit(hp[k], p.rot_half);
                }
            }
            const i64 row = token_row(p, t, b, s);
            float c[NPAIR], sn[NPAIR];
            if (row >= 0) {
                const float* cr = (const float*)p.cos + row * p.table_stride + u * NPAIR;
                const float* sr = (const float*)p.sin + row * p.table_stride + u * NPAIR;
                if (p.table_vec) {
                    const Vec<float, NPAIR> cv = load_vec<float, NPAIR>(cr);
                    const Vec<float, NPAIR> sv = load_vec<float, NPAIR>(sr);
#pragma unroll
                    for (int j = 0; j < NPAIR; ++j) {
                        c[j] = cv.v[j];
                        sn[j] = sign * sv.v[j];
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < NPAIR; ++j) {
                        c[j] = __ldg(cr + j);
                        sn[j] = sign * __ldg(sr + j);
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < NPAIR; ++j) c[j] = sn[j] = __int_as_float(0x7fffffff);
            }
#pragma unroll
            for (int k = 0; k < HEAD_BATCH; ++k)
                if (g * HEAD_BATCH + k < heads) rotate_store(hp[k], in[k], c, sn, p.rot_half);
        } else {
            decompose(i - rot_total, copy_units, heads, p.num_tokens, p.heads_inner, u, h, t);
            split_token(t, p.seq_len, b, s);
            const i64 ch = u < prefix ? u * VEC : suffix_start + (u - prefix) * VEC;
            const HeadPtrs hp = head_ptrs(p, h, b, s, ch);
            store_vec<bits_t, VEC>(hp.out, load_vec<bits_t, VEC>(hp.in));
        }
    }
}
