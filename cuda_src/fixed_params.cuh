// The argument block of the specialised general kernel (rope_fixed.cu), which the fused
// QK-norm kernel (qk_norm_rope.cu) extends. [0] is q, [1] is k. Every field is 8 bytes (the host
// mirror is a ctypes Structure: rope_rtc/rope_params.py, FIXED_FIELDS).
#pragma once

#include "common.cuh"

struct FixedParams {
    // What a call binds first, in one run (the host writes these 11 fields with one pack).
    u64 in[2], out[2];
    u64 cos, sin, positions, offsets, cu_seqlens;
    i64 offset, table_vec;
    // What the plan fixes.
    i64 in_sb[2], in_ss[2], in_sh[2];
    i64 out_sb[2], out_ss[2], out_sh[2];
    i64 num_tokens, seq_len, num_seqs, table_rows, table_stride;
    i64 pos_mode, index_flags, inverse, total;
    u64 div_seq;  // fast_div packed S
    i64 mrope_stride;  // elements between the position streams (FIX_MROPE builds only)
    double attention;  // the factor that multiplies cos and sin (FIX_ANGLES builds only: angles.cuh)
};
