// The argument block of the specialised general kernel (rope_fixed.cu), which the fused
// QK-norm kernel (qk_norm_rope.cu) extends. [0] is q, [1] is k. The host mirror is a ctypes
// Structure (rope_rtc/ops/rope_params.py, FIXED_FIELDS).
//
// A launch's arguments reach each SM through the constant cache cold, one miss per 64-byte line,
// and small launches wait on those misses. So what a dense build
// (FIX_DENSE: one run-time stride per array) reads lies in the block's first 128 bytes (its
// "lines" 0 and 1 below; on sm_90, whose parameters start 16 bytes into a line, they span
// three of the cache's lines, the first shared with the global-memory descriptor), 32-bit where
// the plan's limits allow (fewer than 2^31 threads, table rows below 2^32, row strides of fewer
// than 2^31 elements either way); the angle and multimodal builds' own fields and a scheme read
// from the block come next, then the strides of the general layouts and the cu_seqlens
// scheme's num_seqs.
#pragma once

#include "common.cuh"

struct FixedParams {
    // What a call binds, in one run (the host writes these 11 fields with one pack).
    u64 in[2], out[2];
    u64 cos, sin, positions, offsets, cu_seqlens;
    unsigned offset, table_vec;
    // What the plan fixes: line 1 (bytes 64-127) ends after dense_out.
    u64 div_seq;  // fast_div packed S
    unsigned total, table_rows, seq_len;
    int table_stride;  // elements between table rows (negative: a table read backwards)
    int index_flags;
    float sin_sign;  // -1 for the inverse rotation: one multiply, no select on the table's path
    // Dense builds only: the one stride of each array (elements), between tokens (token-major
    // order: heads are head_dim apart and batches follow each other) or between heads (bhsd:
    // rows are head_dim apart and batches follow each other).
    int dense_in[2], dense_out[2];
    // Line 2 (bytes 128-191) starts with what only some builds read, so that a dense build
    // reading it needs one more line, not two: the angle builds' factor and the scheme of the
    // builds that read it from the block.
    double attention;  // the factor that multiplies cos and sin (FIX_ANGLES builds only: angles.cuh)
    int mrope_stride;  // elements between the position streams (FIX_MROPE builds only)
    int pos_mode;      // the position scheme (POS_* in positions.cuh) of builds without FIX_POS
    // The strided builds' layout, and what only the cu_seqlens scheme reads.
    i64 in_sb[2], in_ss[2], in_sh[2];
    i64 out_sb[2], out_ss[2], out_sh[2];
    i64 num_seqs, num_tokens;
};
