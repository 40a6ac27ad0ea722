// Token positions and their table rows, shared by the general kernels (rope.cu, rope_fixed.cu,
// rope_cache.cu).
//
// A kernel's argument block P has the fields pos_mode, index_flags, offset, offsets, positions,
// cu_seqlens, num_seqs and table_rows; the codes are mirrored in rope_rtc/ops/rope_params.py.
#pragma once

#include "common.cuh"

#define POS_OFFSET 0       // offset + s
#define POS_OFFSETS 1      // offsets[b] + s
#define POS_POSITIONS 2    // positions[t]
#define POS_CU_SEQLENS 3   // t - cu_seqlens[b] + (offsets ? offsets[b] : offset)

#define IDX_POSITIONS_I64 1
#define IDX_OFFSETS_I64 2
#define IDX_CU_SEQLENS_I64 4

__device__ __forceinline__ i64 load_index(u64 base, i64 i, bool wide) {
    return wide ? ((const i64*)base)[i] : (i64)((const int*)base)[i];
}

// The table row for token t = (b, s) under position scheme MODE (POS_*); -1 when it falls
// outside the table (the caller writes NaN rather than reading out of bounds: device-side
// positions are never read back to the host). A kernel that fixes the scheme at compile time
// calls this directly (rope_fixed.cu: FIX_POS); the others go through token_row.
template <int MODE, typename P>
__device__ __forceinline__ i64 token_row_in(const P& p, i64 t, i64 b, i64 s) {
    i64 pos;
    if constexpr (MODE == POS_OFFSET) {
        pos = p.offset + s;
    } else if constexpr (MODE == POS_OFFSETS) {
        pos = load_index(p.offsets, b, p.index_flags & IDX_OFFSETS_I64) + s;
    } else if constexpr (MODE == POS_POSITIONS) {
        pos = load_index(p.positions, t, p.index_flags & IDX_POSITIONS_I64);
    } else {
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
    return (pos >= 0 && pos < p.table_rows) ? pos : -1;
}

// token_row_in with the scheme read from the argument block.
template <typename P>
__device__ __forceinline__ i64 token_row(const P& p, i64 t, i64 b, i64 s) {
    switch ((int)p.pos_mode) {
        case POS_OFFSET: return token_row_in<POS_OFFSET>(p, t, b, s);
        case POS_OFFSETS: return token_row_in<POS_OFFSETS>(p, t, b, s);
        case POS_POSITIONS: return token_row_in<POS_POSITIONS>(p, t, b, s);
        default: return token_row_in<POS_CU_SEQLENS>(p, t, b, s);
    }
}

// The cos/sin values of NPAIR pairs from column `at` of table row `row` (NaN when row < 0), sin
// times `sign`, from the tables of P (fields cos, sin, table_stride). The tables go through the
// read-only path (a launch never writes them: the host refuses outputs that overlap them);
// `vec`: the row slice is aligned for one NPAIR-float load.
template <int NPAIR, typename P, typename At, typename Flag>
__device__ __forceinline__ void table_slice_at(const P& p, i64 row, At at, Flag vec, float sign, float* c, float* sn) {
    // The loads sit under the row's check with NaN defaults, not in one arm of an if/else around
    // the whole slice: the specialised decode builds then predicate them, where the if/else made
    // the compiler issue them only once a branch had resolved, later on a decode launch's short
    // path (benchmarks/probes/decode_case.py).
    const bool inside = row >= 0;
    const float* cr = (const float*)p.cos + row * p.table_stride + at;
    const float* sr = (const float*)p.sin + row * p.table_stride + at;
    Vec<float, NPAIR> cv, sv;
#pragma unroll
    for (int j = 0; j < NPAIR; ++j) cv.v[j] = sv.v[j] = __int_as_float(0x7fffffff);
    if (vec) {
        if (inside) {
            cv = ldg_vec<float, NPAIR>(cr);
            sv = ldg_vec<float, NPAIR>(sr);
        }
    } else {
#pragma unroll
        for (int j = 0; j < NPAIR; ++j) {
            if (inside) {
                cv.v[j] = __ldg(cr + j);
                sv.v[j] = __ldg(sr + j);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NPAIR; ++j) {
        c[j] = cv.v[j];
        sn[j] = sign * sv.v[j];
    }
}
