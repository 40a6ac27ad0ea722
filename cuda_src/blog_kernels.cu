// The three kernels of the blog seed (rope-cuda-kernels-blog.txt), FP32, interleaved pairs,
// [B, H, S, D] contiguous, kept so the benchmark can show the progression from a scalar kernel
// to vectorised and fused ones. Faithful to the blog's structure, with two corrections:
// offsets are 64-bit (the blog's int offsets overflow past 2^31 elements), and the vectorised
// kernels index the table by sequence position (the blog's `% total_tokens_heads` reads the
// wrong row for B*H > 1).
#include "common.cuh"

// One thread per pair, scalar loads, separate cos and sin tables [S, D/2].
// grid = (S, H, B), block = D/2.
extern "C" __global__ void rope_blog_baseline(const float* __restrict__ src, float* __restrict__ dst,
                                              const float* __restrict__ cos_table,
                                              const float* __restrict__ sin_table, int seq_len,
                                              int num_heads, int head_dim) {
    const int pair_idx = threadIdx.x;
    const int token_idx = blockIdx.x;
    const int head_idx = blockIdx.y;
    const int batch_idx = blockIdx.z;
    if (pair_idx >= head_dim / 2) return;

    const i64 stride_s = head_dim;
    const i64 stride_h = (i64)seq_len * stride_s;
    const i64 stride_b = (i64)num_heads * stride_h;
    const i64 offset = batch_idx * stride_b + head_idx * stride_h + token_idx * stride_s + pair_idx * 2;
    const i64 trig = (i64)token_idx * (head_dim / 2) + pair_idx;

    const float c = cos_table[trig];
    const float s = sin_table[trig];
    const float v0 = src[offset];
    const float v1 = src[offset + 1];
    dst[offset] = v0 * c - v1 * s;
    dst[offset + 1] = v0 * s + v1 * c;
}

// float2 loads of the pair and of a packed (cos, sin) table [S, D/2, 2]; one thread per pair.
extern "C" __global__ void rope_blog_vectorized(const float2* __restrict__ src, float2* __restrict__ dst,
                                                const float2* __restrict__ cos_sin, i64 total_pairs,
                                                int seq_len, int half_dim) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total_pairs) return;
    const i64 pair = idx % half_dim;
    const i64 token = (idx / half_dim) % seq_len;
    const float2 t = cos_sin[token * half_dim + pair];
    const float2 v = src[idx];
    float2 r;
    r.x = v.x * t.x - v.y * t.y;
    r.y = v.x * t.y + v.y * t.x;
    dst[idx] = r;
}

// q and k of one shape; one table load serves both. In place when src == dst, so the pointers
// carry no __restrict__.
extern "C" __global__ void rope_blog_fused_qk(const float2* q_src, float2* q_dst, const float2* k_src,
                                              float2* k_dst, const float2* __restrict__ cos_sin,
                                              i64 total_pairs, int seq_len, int half_dim) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total_pairs) return;
    const i64 pair = idx % half_dim;
    const i64 token = (idx / half_dim) % seq_len;
    const float2 t = cos_sin[token * half_dim + pair];
    const float2 q = q_src[idx];
    const float2 k = k_src[idx];
    q_dst[idx] = make_float2(q.x * t.x - q.y * t.y, q.x * t.y + q.y * t.x);
    k_dst[idx] = make_float2(k.x * t.x - k.y * t.y, k.x * t.y + k.y * t.x);
}
