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
// Work split: one block row per token (grid-stride over tokens in x), and per token a
// blockDim.x x blockDim.y tile of (rotary unit, head). Each thread loads its slice of the
// token's cos/sin row once and reuses it for every head it visits (grid.y splits heads across
// blocks only for small token counts, where spreading the work matters more than reuse).
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
typedef Vec<elem_t, VEC> vec_t;
typedef Scalar<elem_t> conv;

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

extern "C" __global__ void __launch_bounds__(256) rope_apply(const RopeParams p) {
    const i64 units = ROPE_INTERLEAVED ? (2 * p.rot_half) / VEC : p.rot_half / VEC;
    const i64 heads = p.q_heads + p.k_heads;
    const i64 head0 = (i64)blockIdx.y * blockDim.y + threadIdx.y;
    const i64 head_step = (i64)gridDim.y * blockDim.y;
    const float sign = p.inverse ? -1.0f : 1.0f;

    for (i64 t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
        i64 b, s;
        split_token(t, p.seq_len, b, s);
        const i64 row = token_row(p, t, b, s);

        // Units loop: one pass when blockDim.x == units (the host's usual choice).
        for (i64 u = threadIdx.x; u < units; u += blockDim.x) {
            const i64 pair0 = u * NPAIR;
            float c[NPAIR], sn[NPAIR];
            if (row >= 0) {
                const float* cr = (const float*)p.cos + row * p.table_stride + pair0;
                const float* sr = (const float*)p.sin + row * p.table_stride + pair0;
#pragma unroll
                for (int j = 0; j < NPAIR; ++j) {
                    c[j] = __ldg(cr + j);
                    sn[j] = sign * __ldg(sr + j);
                }
            } else {
#pragma unroll
                for (int j = 0; j < NPAIR; ++j) c[j] = sn[j] = __int_as_float(0x7fffffff);
            }
            const i64 ch = p.rot_offset + u * VEC;

            for (i64 h = head0; h < heads; h += head_step) {
                const bool is_q = h < p.q_heads;
                const i64 hh = is_q ? h : h - p.q_heads;
                const elem_t* in = (const elem_t*)(is_q ? p.q_in : p.k_in) +
                    (is_q ? b * p.q_in_sb + s * p.q_in_ss + hh * p.q_in_sh
                          : b * p.k_in_sb + s * p.k_in_ss + hh * p.k_in_sh) + ch;
                elem_t* out = (elem_t*)(is_q ? p.q_out : p.k_out) +
                    (is_q ? b * p.q_out_sb + s * p.q_out_ss + hh * p.q_out_sh
                          : b * p.k_out_sb + s * p.k_out_ss + hh * p.k_out_sh) + ch;
#if ROPE_INTERLEAVED
                const vec_t v = *(const vec_t*)in;
                vec_t r;
#pragma unroll
                for (int j = 0; j < NPAIR; ++j) {
                    float o0, o1;
                    rotate(conv::to_float(v.v[2 * j]), conv::to_float(v.v[2 * j + 1]), c[j], sn[j], o0, o1);
                    r.v[2 * j] = conv::from_float(o0);
                    r.v[2 * j + 1] = conv::from_float(o1);
                }
                *(vec_t*)out = r;
#else
                const vec_t lo = *(const vec_t*)in;
                const vec_t hi = *(const vec_t*)(in + p.rot_half);
                vec_t rlo, rhi;
#pragma unroll
                for (int j = 0; j < NPAIR; ++j) {
                    float o0, o1;
                    rotate(conv::to_float(lo.v[j]), conv::to_float(hi.v[j]), c[j], sn[j], o0, o1);
                    rlo.v[j] = conv::from_float(o0);
                    rhi.v[j] = conv::from_float(o1);
                }
                *(vec_t*)out = rlo;
                *(vec_t*)(out + p.rot_half) = rhi;
#endif
            }
        }

        if (p.copy_passthrough) {
            // Out of place with a partial window: channels outside it are copied unchanged.
            const i64 prefix = p.rot_offset / VEC;
            const i64 suffix_start = p.rot_offset + 2 * p.rot_half;
            const i64 per_head = prefix + (p.head_dim - suffix_start) / VEC;
            const i64 total = heads * per_head;
            const i64 step = (i64)gridDim.y * blockDim.y * blockDim.x;
            for (i64 i = head0 * blockDim.x + threadIdx.x; i < total; i += step) {
                const i64 h = i / per_head;
                const i64 u = i - h * per_head;
                const i64 ch = u < prefix ? u * VEC : suffix_start + (u - prefix) * VEC;
                const bool is_q = h < p.q_heads;
                const i64 hh = is_q ? h : h - p.q_heads;
                const elem_t* in = (const elem_t*)(is_q ? p.q_in : p.k_in) +
                    (is_q ? b * p.q_in_sb + s * p.q_in_ss + hh * p.q_in_sh
                          : b * p.k_in_sb + s * p.k_in_ss + hh * p.k_in_sh) + ch;
                elem_t* out = (elem_t*)(is_q ? p.q_out : p.k_out) +
                    (is_q ? b * p.q_out_sb + s * p.q_out_ss + hh * p.q_out_sh
                          : b * p.k_out_sb + s * p.k_out_ss + hh * p.k_out_sh) + ch;
                *(vec_t*)out = *(const vec_t*)in;
            }
        }
    }
}
