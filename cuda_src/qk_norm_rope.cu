// Per-head RMSNorm fused with RoPE (rope_rtc/ops/qk_norm.py), as Qwen3 and Gemma 3 prepare q and k:
// each head is normalised over the head dim, scaled by a learned weight of head_dim entries
// (one for q, one for k), then rotated, in one pass over q and k.
//
// Compile-time parameters:
//   ROPE_DTYPE, ROPE_INTERLEAVED, ROPE_VEC  as in rope.cu
//   NORM_HQ, NORM_HK   q and k head counts
//   NORM_HB            heads per lane group (divides both counts, so a group is all q or all k)
//   NORM_STAGED        1: the vectors pass through shared memory (half-split pairs over the whole
//                      head in 16-byte vectors, launches of registry.NORM_STAGED_THREADS and more:
//                      registry.norm_stageable); 0: registers
//   NORM_D             head dim; NORM_D / ROPE_VEC is a power of two of at most 32
//   NORM_RO, NORM_RD   rotary window [NORM_RO, NORM_RO + NORM_RD) of each head (whole vectors)
//   NORM_WF32          1: float32 weights; 0: weights of the input dtype
//   NORM_MODE          0, "exact": FP32 throughout, one rounding to the output dtype at the end;
//                      1, "transformers": rounds where Hugging Face's Qwen3RMSNorm and
//                      apply_rotary_pos_emb round (below)
//
// Arithmetic, for one head x of D channels, in FP32:
//   ss  = sum of x[c]^2: each lane adds its vector's squares in channel order, then the lanes'
//         sums are combined by a butterfly over the lanes (every lane gets the same sum, since
//         each step adds the same two values)
//   var = ss * (1 / D), as torch's mean
//   r   = rsqrtf(var + eps), as torch.rsqrt
//   y   = x * r * w (exact); round(w * round(x * r)) (transformers: the normalised value is cast
//         to the input dtype before the weight multiplies it, the product is rounded again)
//   out = the general kernels' rotation of (y0, y1) with one rounding (exact); transformers:
//         round(round(y0 * c) + round(-y1 * s)) and round(round(y1 * c) + round(y0 * s)) with c and s
//         the table values rounded to the input dtype (apply_rotary_pos_emb in that dtype)
// Channels outside the window are y, rounded.
//
// Work split: LANES consecutive threads per (token, group of NORM_HB heads); a group's lanes lie
// in one warp (LANES divides 32). The weights, the position and the table slice are read once
// for the group.
// - Half-split pairs over the whole head (NORM_SPLIT: NORM_RO == 0, NORM_RD == NORM_D, the
//   Qwen3 / Gemma 3 / OLMo 2 case): LANES = NORM_D / (2 ROPE_VEC); each lane holds the vector at
//   channel c of each head and its partner at c + NORM_D / 2, so both halves of its pairs are in
//   its own registers. A lane adds each vector's squares in channel order, then the two sums:
//   the same order, and so the same bits, as the one-vector-per-lane layout below.
// - Otherwise LANES = NORM_D / ROPE_VEC, one vector of each head per lane. A half-split pair's
//   partner vector is HALF / ROPE_VEC lanes away and comes through a warp shuffle.
// - NORM_STAGED (the first case in 16-byte vectors, large launches): the same lanes and
//   arithmetic, the vectors held in shared memory instead of registers.
#include "common.cuh"
#include "fixed_params.cuh"
#include "positions.cuh"
#include "rotation.cuh"

#if !defined(ROPE_DTYPE) || !defined(ROPE_INTERLEAVED) || !defined(ROPE_VEC) || !defined(NORM_HQ) || \
    !defined(NORM_HK) || !defined(NORM_D) || !defined(NORM_RO) || !defined(NORM_RD) || !defined(NORM_WF32) || \
    !defined(NORM_MODE) || !defined(NORM_HB) || !defined(NORM_STAGED)
#error "qk_norm_rope.cu needs every compile-time parameter (rope_rtc/build/registry.py: NormGeometry)"
#endif

constexpr int VEC = ROPE_VEC;
#define NORM_SPLIT (!ROPE_INTERLEAVED && NORM_RO == 0 && NORM_RD == NORM_D)
constexpr unsigned LANES = NORM_SPLIT ? NORM_D / (2 * VEC) : NORM_D / VEC;
constexpr unsigned HEADS = NORM_HQ + NORM_HK;
constexpr unsigned GROUPS = HEADS / NORM_HB;  // head groups per token: all q or all k
constexpr int HALF = NORM_RD / 2;
constexpr unsigned PARTNER = HALF / VEC;  // lanes between the two vectors of half-split pairs
constexpr int NPAIR = ROPE_INTERLEAVED ? VEC / 2 : VEC;
constexpr unsigned FULL = 0xffffffffu;

static_assert(NORM_D % ((NORM_SPLIT ? 2 : 1) * VEC) == 0 && LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0,
              "a head must be 1-32 lanes (a power of two)");
static_assert(NORM_HQ % NORM_HB == 0 && NORM_HK % NORM_HB == 0, "NORM_HB must divide both head counts");
static_assert(NORM_RO % VEC == 0 && NORM_RO + NORM_RD <= NORM_D, "the window must start on a vector, inside the head");
static_assert(ROPE_INTERLEAVED ? (NORM_RD % VEC == 0 && VEC % 2 == 0) : HALF % VEC == 0, "the window must be whole vectors");

// rope_types.cuh's types, spelled out (see there).
typedef Scalar<elem_t> conv;
typedef conv::bits_t bits_t;
typedef Vec<bits_t, VEC> vec_t;
typedef typename RawAccess<sizeof(vec_t)>::type raw_t;
#if NORM_WF32
typedef float weight_t;
#else
typedef bits_t weight_t;
#endif

struct NormParams {
    FixedParams f;
    u64 weight[2];  // q's, k's: NORM_D entries each
    float eps;
    unsigned zero;  // always 0: the staged build's opaque zero (below)
};

__device__ __forceinline__ float round_to_dtype(float v) { return round_to<conv>(v); }

// The lane's VEC weights, one aligned vector load (the host aligns the weights to it).
__device__ __forceinline__ void load_weights(u64 base, unsigned c0, float* w) {
    const Vec<weight_t, VEC> v = ldg_vec<weight_t, VEC>((const weight_t*)base + c0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
#if NORM_WF32
        w[e] = v.v[e];
#else
        w[e] = conv::to_float(v.v[e]);
#endif
    }
}

// A head's scale 1 / sqrt(mean square + eps) from one lane's sum of squares: the lanes' sums
// combined by a butterfly over the group's lanes (every lane gets the same sum). rsqrtf, as
// torch.rsqrt: within the exact mode's bound, and a few instructions where a correctly rounded
// square root and division are a few dozen.
__device__ __forceinline__ float head_scale(float ss, float eps) {
#pragma unroll
    for (unsigned off = LANES / 2; off > 0; off >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(FULL, ss, off));
    return rsqrtf(__fadd_rn(__fmul_rn(ss, 1.0f / NORM_D), eps));
}

// A normalised, weighted value: exact, or rounded where transformers' Qwen3RMSNorm rounds.
__device__ __forceinline__ float normalised(float y, float r, float w) {
#if NORM_MODE == 0
    return __fmul_rn(__fmul_rn(y, r), w);
#else
    return round_to_dtype(__fmul_rn(w, round_to_dtype(__fmul_rn(y, r))));
#endif
}

// The rotation of (x0, x1) (rotation.cuh): every kernel's FP32 rotation (exact), or
// apply_rotary_pos_emb's in the input dtype (transformers).
__device__ __forceinline__ void rotated(float x0, float x1, float c, float s, float& re, float& im) {
#if NORM_MODE == 0
    rotate_pair(x0, x1, c, s, re, im);
#else
    rotate_pair_rounded<conv>(x0, x1, c, s, re, im);
#endif
}

#if NORM_SPLIT
// A head's sum of squares in this lane: each vector's squares in channel order, then the two
// sums: the order of the one-vector-per-lane layout, whose first butterfly step adds exactly
// these two (HALF / VEC lanes apart), so both layouts give the same bits.
__device__ __forceinline__ float split_squares(const vec_t& lo, const vec_t& hi) {
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
        const float a = conv::to_float(lo.v[e]), z = conv::to_float(hi.v[e]);
        s0 = __fadd_rn(s0, __fmul_rn(a, a));
        s1 = __fadd_rn(s1, __fmul_rn(z, z));
    }
    return __fadd_rn(s0, s1);
}

// The lane's weights of both halves and its table slice: once for the group's heads.
__device__ __forceinline__ void split_constants(const NormParams& p, int which, unsigned t, unsigned b, unsigned s,
                                                unsigned c0, float* wl, float* wh, float* c, float* sn) {
    load_weights(p.weight[which], c0, wl);
    load_weights(p.weight[which], c0 + HALF, wh);
    table_slice_at<VEC>(p.f, token_row(p.f, t, b, s), c0, p.f.table_vec, p.f.sin_sign, c, sn);
#if NORM_MODE == 1
#pragma unroll
    for (int e = 0; e < VEC; ++e) {  // the tables in the input dtype, once for the group
        c[e] = round_to_dtype(c[e]);
        sn[e] = round_to_dtype(sn[e]);
    }
#endif
}
#endif

#if NORM_STAGED
static_assert(NORM_SPLIT && sizeof(raw_t) == 16, "the staged build is for half-split pairs in 16-byte vectors");
constexpr unsigned BLOCK = 256;

// One 16-byte vector from global memory to the thread's own shared slot (cp.async: no register
// holds it in flight), marked evict-first in L2 as the register build's __ldcs loads are (the
// hint measured 1.6 points of a copy over none).
__device__ __forceinline__ void stage_copy(raw_t* slot, const void* src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(slot);
    asm volatile(
        "{\n\t.reg .b64 pol;\n\tcreatepolicy.fractional.L2::evict_first.b64 pol, 1.0;\n\t"
        "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, pol;\n\t}" ::"r"(d), "l"(src) : "memory");
}

__device__ __forceinline__ raw_t stage_read(const raw_t* slot) {
    raw_t v;
    const unsigned a = (unsigned)__cvta_generic_to_shared(slot);
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

// The staged build (large launches): the group's vectors go to shared memory, each thread's to
// slots only it writes and reads (no barrier), and are read from there twice: once for every
// head's sums, whose butterflies then run side by side, and once for the output. 64 registers
// at Qwen3-8B's heads where the register build below holds 119-122, so twice the warps per SM
// cover the loads' latency; the same arithmetic in the same order, so the same bits.
//
// Its index prologue and output loop repeat the register build's: written as shared helpers
// (a struct of the lane's indices, one store function), ptxas allocated registers differently in
// 60 of 184 builds (fp16's staged build 64 -> 68: one block per SM fewer), so each kernel keeps
// its own; the shared helpers above compile to the same machine code.
extern "C" __global__ void __launch_bounds__(BLOCK) qk_norm_rope(const NormParams p) {
    __shared__ raw_t stage[2 * NORM_HB][BLOCK];
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    // No early return: every lane of the warp takes part in the shuffles. The total is a multiple
    // of LANES, so a head group's lanes are all in range or all out.
    const bool live = i < (unsigned)p.f.total;
    const unsigned j = i % LANES, tg = i / LANES;
    const unsigned t = tg / GROUPS, g = tg - t * GROUPS;
    const int which = g * NORM_HB >= NORM_HQ ? 1 : 0;  // the group is all q or all k
    const unsigned hh = g * NORM_HB - (which ? NORM_HQ : 0);
    const unsigned b = fast_div(t, p.f.div_seq), s = t - b * (unsigned)p.f.seq_len;
    const unsigned c0 = j * VEC;  // the lane's low channels; its high ones are HALF further
    const i64 in_sh = p.f.in_sh[which], out_sh = p.f.out_sh[which];
    const unsigned me = threadIdx.x;

    // The copies first, then the weights, the position and its table slice while they fly.
    float wl[VEC], wh[VEC], c[VEC], sn[VEC];
    if (live) {
        const bits_t* in = (const bits_t*)p.f.in[which] + (b * p.f.in_sb[which] + s * p.f.in_ss[which] + hh * in_sh + c0);
#pragma unroll
        for (int k = 0; k < NORM_HB; ++k) {
            stage_copy(&stage[2 * k][me], in + k * in_sh);
            stage_copy(&stage[2 * k + 1][me], in + k * in_sh + HALF);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
        split_constants(p, which, t, b, s, c0, wl, wh, c, sn);
        asm volatile("cp.async.wait_all;" ::: "memory");  // the thread's own copies have landed
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) wl[e] = wh[e] = c[e] = sn[e] = 0.0f;
#pragma unroll
        for (int k = 0; k < 2 * NORM_HB; ++k) stage[k][me] = raw_t{};
    }
    bits_t* out = (bits_t*)p.f.out[which] + (b * p.f.out_sb[which] + s * p.f.out_ss[which] + hh * out_sh + c0);
    // Each head's scale: the two vectors' sums of squares (channel order), then their sum, then
    // the butterfly, as the register build below adds them.
    float r[NORM_HB];
#pragma unroll
    for (int k = 0; k < NORM_HB; ++k) {
        vec_t lo, hi;
        lo.raw = stage_read(&stage[2 * k][me]);
        hi.raw = stage_read(&stage[2 * k + 1][me]);
        r[k] = split_squares(lo, hi);
    }
#pragma unroll
    for (int k = 0; k < NORM_HB; ++k) r[k] = head_scale(r[k], p.eps);
#pragma unroll
    for (int k = 0; k < NORM_HB; ++k) {
        // The second reads' address depends on the head's scale (p.zero is 0): ptxas cannot move
        // them above the reductions, where every head's words would again live in registers.
        const unsigned slot = me + (__float_as_uint(r[k]) & p.zero);
        vec_t lo, hi;
        lo.raw = stage_read(&stage[2 * k][slot]);
        hi.raw = stage_read(&stage[2 * k + 1][slot]);
        vec_t olo, ohi;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            float re, im;
            rotated(normalised(conv::to_float(lo.v[e]), r[k], wl[e]), normalised(conv::to_float(hi.v[e]), r[k], wh[e]),
                    c[e], sn[e], re, im);
            olo.v[e] = conv::from_float(re);
            ohi.v[e] = conv::from_float(im);
        }
        if (live) {
            __stcs((raw_t*)(out + k * out_sh), olo.raw);
            __stcs((raw_t*)(out + k * out_sh + HALF), ohi.raw);
        }
    }
}
#elif NORM_SPLIT
extern "C" __global__ void __launch_bounds__(256) qk_norm_rope(const NormParams p) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    // No early return: every lane of the warp takes part in the shuffles. The total is a multiple
    // of LANES, so a head group's lanes are all in range or all out.
    const bool live = i < (unsigned)p.f.total;
    const unsigned j = i % LANES, tg = i / LANES;
    const unsigned t = tg / GROUPS, g = tg - t * GROUPS;
    const int which = g * NORM_HB >= NORM_HQ ? 1 : 0;  // the group is all q or all k
    const unsigned hh = g * NORM_HB - (which ? NORM_HQ : 0);
    const unsigned b = fast_div(t, p.f.div_seq), s = t - b * (unsigned)p.f.seq_len;
    const unsigned c0 = j * VEC;  // the lane's low channels; its high ones are HALF further
    const i64 in_sh = p.f.in_sh[which], out_sh = p.f.out_sh[which];

    // Every load first: the group's vectors, the weights, then the position and its table slice.
    vec_t lo[NORM_HB], hi[NORM_HB];
    float wl[VEC], wh[VEC], c[VEC], sn[VEC];
    if (live) {
        const bits_t* in = (const bits_t*)p.f.in[which] + (b * p.f.in_sb[which] + s * p.f.in_ss[which] + hh * in_sh + c0);
#pragma unroll
        for (int k = 0; k < NORM_HB; ++k) {
            lo[k].raw = __ldcs((const raw_t*)(in + k * in_sh));
            hi[k].raw = __ldcs((const raw_t*)(in + k * in_sh + HALF));
        }
        split_constants(p, which, t, b, s, c0, wl, wh, c, sn);
    } else {
#pragma unroll
        for (int k = 0; k < NORM_HB; ++k) lo[k].raw = hi[k].raw = raw_t{};
#pragma unroll
        for (int e = 0; e < VEC; ++e) wl[e] = wh[e] = c[e] = sn[e] = 0.0f;
    }
    bits_t* out = (bits_t*)p.f.out[which] + (b * p.f.out_sb[which] + s * p.f.out_ss[which] + hh * out_sh + c0);
    // Each head's scale: the two vectors' sums of squares (channel order), then their sum, then
    // the butterfly: the order of the one-vector-per-lane layout, whose first butterfly step adds
    // exactly these two (HALF / VEC lanes apart), so both layouts give the same bits.
    float r[NORM_HB];
#if NORM_MODE == 0
    // Exact numerics: every head's sums first, then their butterflies side by side, then a second
    // pass that converts the inputs again. The empty asm marks the loaded words as rewritten, so
    // the compiler keeps them packed across the reductions instead of every head's FP32 values,
    // which spares registers (faster at Qwen3-8B's heads, the same bits).
#pragma unroll
    for (int k = 0; k < NORM_HB; ++k) r[k] = split_squares(lo[k], hi[k]);
#pragma unroll
    for (int k = 0; k < NORM_HB; ++k) {
        r[k] = head_scale(r[k], p.eps);
        unsigned* w0 = (unsigned*)&lo[k].raw;
        unsigned* w1 = (unsigned*)&hi[k].raw;
#pragma unroll
        for (int q = 0; q < (int)(sizeof(raw_t) / 4); ++q) asm volatile("" : "+r"(w0[q]), "+r"(w1[q]));
    }
#endif
#pragma unroll
    for (int k = 0; k < NORM_HB; ++k) {
        float y0[VEC], y1[VEC];
#if NORM_MODE == 0
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            y0[e] = conv::to_float(lo[k].v[e]);
            y1[e] = conv::to_float(hi[k].v[e]);
        }
#else
        // Transformers numerics: one head at a time (the two passes measured slower here).
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            y0[e] = conv::to_float(lo[k].v[e]);
            s0 = __fadd_rn(s0, __fmul_rn(y0[e], y0[e]));
            y1[e] = conv::to_float(hi[k].v[e]);
            s1 = __fadd_rn(s1, __fmul_rn(y1[e], y1[e]));
        }
        r[k] = head_scale(__fadd_rn(s0, s1), p.eps);
#endif
        vec_t olo, ohi;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            float re, im;
            rotated(normalised(y0[e], r[k], wl[e]), normalised(y1[e], r[k], wh[e]), c[e], sn[e], re, im);
            olo.v[e] = conv::from_float(re);
            ohi.v[e] = conv::from_float(im);
        }
        if (live) {
            __stcs((raw_t*)(out + k * out_sh), olo.raw);
            __stcs((raw_t*)(out + k * out_sh + HALF), ohi.raw);
        }
    }
}
#else
extern "C" __global__ void __launch_bounds__(256) qk_norm_rope(const NormParams p) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    // No early return: every lane of the warp takes part in the shuffles. The total is a multiple
    // of LANES, so a head group's lanes are all in range or all out.
    const bool live = i < (unsigned)p.f.total;
    const unsigned j = i % LANES, tg = i / LANES;
    const unsigned t = tg / GROUPS, g = tg - t * GROUPS;
    const int which = g * NORM_HB >= NORM_HQ ? 1 : 0;  // the group is all q or all k
    const unsigned hh = g * NORM_HB - (which ? NORM_HQ : 0);
    const unsigned b = fast_div(t, p.f.div_seq), s = t - b * (unsigned)p.f.seq_len;
    const unsigned c0 = j * VEC;
    const i64 in_sh = p.f.in_sh[which], out_sh = p.f.out_sh[which];

    // Every load first: the group's vectors, the weights, then the position and its table slice
    // (once for the group's heads).
    vec_t x[NORM_HB];
    float w[VEC];
    const bool in_window = c0 >= NORM_RO && c0 < NORM_RO + NORM_RD;
#if ROPE_INTERLEAVED
    const bool lo = in_window;
    const unsigned pair0 = (c0 - NORM_RO) / 2;
#else
    const bool lo = in_window && c0 < NORM_RO + HALF;
    const unsigned lane = threadIdx.x & 31u;
    const unsigned src = in_window ? (lo ? lane + PARTNER : lane - PARTNER) : lane;
    const unsigned pair0 = lo ? c0 - NORM_RO : c0 - NORM_RO - HALF;
#endif
    float c[NPAIR], sn[NPAIR];
    if (live) {
        const bits_t* in = (const bits_t*)p.f.in[which] + (b * p.f.in_sb[which] + s * p.f.in_ss[which] + hh * in_sh + c0);
#pragma unroll
        for (int k = 0; k < NORM_HB; ++k) x[k].raw = __ldcs((const raw_t*)(in + k * in_sh));
        load_weights(p.weight[which], c0, w);
        if (in_window) {
            table_slice_at<NPAIR>(p.f, token_row(p.f, t, b, s), pair0, p.f.table_vec, p.f.sin_sign, c,
                                  sn);
#if NORM_MODE == 1
#pragma unroll
            for (int jj = 0; jj < NPAIR; ++jj) {  // the tables in the input dtype, once for the group
                c[jj] = round_to_dtype(c[jj]);
                sn[jj] = round_to_dtype(sn[jj]);
            }
#endif
        }
    } else {
#pragma unroll
        for (int k = 0; k < NORM_HB; ++k) x[k].raw = raw_t{};
#pragma unroll
        for (int e = 0; e < VEC; ++e) w[e] = 0.0f;
    }
    bits_t* out = (bits_t*)p.f.out[which] + (b * p.f.out_sb[which] + s * p.f.out_ss[which] + hh * out_sh + c0);

#pragma unroll
    for (int k = 0; k < NORM_HB; ++k) {
        float y[VEC];
        float ss = 0.0f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            y[e] = conv::to_float(x[k].v[e]);
            ss = __fadd_rn(ss, __fmul_rn(y[e], y[e]));
        }
        const float r = head_scale(ss, p.eps);
#pragma unroll
        for (int e = 0; e < VEC; ++e) y[e] = normalised(y[e], r, w[e]);
#if !ROPE_INTERLEAVED
        float z[VEC];  // the partner vector's values (the other half of each pair)
#pragma unroll
        for (int e = 0; e < VEC; ++e) z[e] = __shfl_sync(FULL, y[e], src);
#endif
        vec_t o;
        if (in_window) {
#pragma unroll
            for (int jj = 0; jj < NPAIR; ++jj) {
#if ROPE_INTERLEAVED
                const float x0 = y[2 * jj], x1 = y[2 * jj + 1];
#else
                const float x0 = lo ? y[jj] : z[jj], x1 = lo ? z[jj] : y[jj];
#endif
                float re, im;
                rotated(x0, x1, c[jj], sn[jj], re, im);
#if ROPE_INTERLEAVED
                o.v[2 * jj] = conv::from_float(re);
                o.v[2 * jj + 1] = conv::from_float(im);
#else
                o.v[jj] = conv::from_float(lo ? re : im);
#endif
            }
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) o.v[e] = conv::from_float(y[e]);
        }
        if (live) __stcs((raw_t*)(out + k * out_sh), o.raw);
    }
}
#endif
