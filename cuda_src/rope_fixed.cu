// The general RoPE kernel specialised on what a model fixes: head dim, rotary window, q and k
// head counts, dtype and pair style are compile-time, so the index arithmetic is divisions by
// constants, every loop has a fixed trip count and the argument block is small. The plan picks
// it when a call fits (rope_rtc/ops/rope_launch.py: fixed_build); everything else runs rope.cu.
//
// Compile-time parameters:
//   ROPE_DTYPE, ROPE_INTERLEAVED, ROPE_VEC, ROPE_PDL  as in rope.cu
//   FIX_HQ, FIX_HK    q and k head counts (FIX_HK = 0: no k)
//   FIX_D             head dim
//   FIX_RO, FIX_RD    rotary window [FIX_RO, FIX_RO + FIX_RD) of each head
//   FIX_HB            heads per thread; divides FIX_HQ and FIX_HK, so a thread's heads are all q or all k
//   FIX_ORDER         0: thread order (token, head group, unit), the memory order when heads are
//                     the denser axis (bshd, thd); 1: (batch, head group, token, unit), the memory
//                     order of bhsd, one head's rows end to end
//   FIX_MROPE         optional multimodal RoPE (rope_rtc/ops/mrope.py): 0 or absent: none; 1: contiguous
//                     sections (Qwen2-VL, Qwen2.5-VL, vision towers' axial RoPE); 2: interleaved
//                     T, H, W, T, ... (Qwen3-VL); with FIX_MT, FIX_MH, FIX_MW, FIX_MX the sections
//                     (pairs per stream, summing to FIX_RD / 2; absent ones 0) and FIX_MN the number
//                     of position streams (2, 3 or 4; absent: 3). positions is then [FIX_MN, tokens]
//                     (for three: temporal, height, width; mrope_stride elements between streams, the
//                     token count in a dense build), and pair column i takes the row of its stream's
//                     position. Interleaved streams cycle 0, 1, .., FIX_MN - 1, the remainder to 0.
//   FIX_ANGLES        optional: 0 or absent: cos/sin tables; 1 or 2: cos and sin computed from the
//                     inverse frequencies (float64 or float32) in the cos field (angles.cuh)
//   FIX_POS           optional: the position scheme (POS_* in positions.cuh), fixed at compile time;
//                     absent or -1: read from the block (the multimodal builds, which read their
//                     own position streams; the angle builds for large launches; the table
//                     builds of bf16 interleaved pairs in bhsd order: rope_rtc/build/registry.py)
//   FIX_DENSE         optional: 1 for arrays whose heads (token-major order) or rows (bhsd) are
//                     head_dim apart and whose batches follow each other: one run-time stride per
//                     array (dense_in, dense_out); with an offset, offsets or positions compiled
//                     in, every field it reads lies in the block's first 128 bytes
//                     (fixed_params.cuh). Absent or 0: any strides the plan accepts.
// The kernel rotates in place or out of place with the whole head rotated; an out-of-place
// call with a partial window (the outside copied) runs the generic kernel.
//
// Work split: one thread per (token, group of FIX_HB heads, vector unit), in FIX_ORDER. A thread
// issues its q/k loads and its position load independently (with the scheme compiled in, the
// compiler issues the position load first; the gathered multimodal builds load their merged
// values' positions before the q/k loads), then the table loads, then rotates and stores; the
// table slice is read once for the thread's heads.
// The vector width, heads per thread, orders and cache hints here are the fastest measured
// (benchmarks/probes/fixed_sweep.py sweeps them); a lane loading one vector and taking its
// partner half through a warp shuffle is slower.
#include "common.cuh"
#include "angles.cuh"
#include "fixed_params.cuh"
#include "positions.cuh"
#include "rope_types.cuh"

#if !defined(FIX_HQ) || !defined(FIX_HK) || !defined(FIX_D) || !defined(FIX_RO) || !defined(FIX_RD) || \
    !defined(FIX_HB) || !defined(FIX_ORDER) || !defined(ROPE_DTYPE) || !defined(ROPE_INTERLEAVED) ||  \
    !defined(ROPE_VEC)
#error "rope_fixed.cu needs every compile-time parameter (rope_rtc/build/registry.py: FixedGeometry)"
#endif

constexpr int HALF = FIX_RD / 2;
constexpr unsigned UNITS = (ROPE_INTERLEAVED ? FIX_RD : HALF) / VEC;
constexpr unsigned HEADS = FIX_HQ + FIX_HK;
constexpr unsigned GROUPS = HEADS / FIX_HB;
// Threads per head window: one per vector unit (a vector of each half for half-split pairs).
constexpr unsigned CHUNKS = UNITS;
// Threads per block: at most this many (rope_rtc/ops/rope_launch.py: fixed_launch_shape picks).
constexpr int MAX_BLOCK = 512;

static_assert(FIX_RD % 2 == 0 && FIX_RO + FIX_RD <= FIX_D, "rotary window outside the head");
static_assert((ROPE_INTERLEAVED ? FIX_RD : HALF) % VEC == 0 && FIX_RO % VEC == 0, "window not a whole number of vectors");
static_assert(FIX_HQ % FIX_HB == 0 && FIX_HK % FIX_HB == 0, "FIX_HB must divide both head counts");
#ifndef FIX_MROPE
#define FIX_MROPE 0
#endif
#ifndef FIX_ANGLES
#define FIX_ANGLES 0
#endif
#ifndef FIX_POS
#define FIX_POS -1
#endif
#ifndef FIX_DENSE
#define FIX_DENSE 0
#endif
static_assert(!(FIX_ANGLES && FIX_MROPE), "multimodal RoPE reads tables");
#if FIX_MROPE
// Three streams (Qwen2-VL, Qwen3-VL) define no FIX_MN, so their builds preprocess to the source they
// always had; the branches on FIX_MN below leave their lines as they were.
#ifndef FIX_MN
#define FIX_MN 3
#endif
#ifndef FIX_MW
#define FIX_MW 0
#endif
#ifndef FIX_MX
#define FIX_MX 0
#endif
static_assert(!ROPE_INTERLEAVED, "multimodal RoPE rotates half-split pairs");
static_assert(FIX_MN >= 2 && FIX_MN <= 4, "multimodal RoPE takes 2, 3 or 4 position streams");
static_assert(FIX_MN == 4 || FIX_MX == 0, "a fourth section needs FIX_MN = 4");
static_assert(FIX_MN >= 3 || FIX_MW == 0, "a third section needs FIX_MN >= 3");
static_assert(FIX_MT + FIX_MH + FIX_MW + FIX_MX == HALF, "the MRoPE sections must sum to FIX_RD / 2");
#endif

// Whether table rows are read NPAIR floats per access. A dense build always does: the plan runs
// it only on calls whose table rows allow it, and the strided build (same block) on the others,
// so the dense build skips the run-time choice, which small launches feel.
__device__ __forceinline__ bool rows_in_vectors(const FixedParams& p) { return FIX_DENSE || p.table_vec; }

#if FIX_MROPE
// Elements between the position streams. A dense build's streams are the call's token count apart
// (rope_rtc/ops/mrope.py: mrope_geometry), which the thread count gives: no read of the block's third
// line on the position's path.
__device__ __forceinline__ i64 mrope_stride(const FixedParams& p) {
#if FIX_DENSE
    return (unsigned)p.total / (GROUPS * CHUNKS);
#else
    return p.mrope_stride;
#endif
}

// Token t's table row in stream k (three streams: 0 temporal, 1 height, 2 width); -1 outside the table.
__device__ __forceinline__ i64 mrope_row(const FixedParams& p, unsigned t, int k, bool wide) {
    const i64 pos = load_index(p.positions, (i64)k * mrope_stride(p) + t, wide);
    return (pos >= 0 && pos < p.table_rows) ? pos : -1;
}

// The position stream (three streams: 0 temporal, 1 height, 2 width) of pair column i.
__device__ __forceinline__ int mrope_stream(unsigned i) {
#if FIX_MROPE == 1 && FIX_MN == 4
    return i < FIX_MT ? 0 : (i < FIX_MT + FIX_MH ? 1 : (i < FIX_MT + FIX_MH + FIX_MW ? 2 : 3));
#elif FIX_MROPE == 1
    return i < FIX_MT ? 0 : (i < FIX_MT + FIX_MH ? 1 : 2);  // two streams: 2 only past the window
#elif FIX_MN == 2
    return (i % 2 == 1 && i < 2 * FIX_MH) ? 1 : 0;
#elif FIX_MN == 4
    return (i % 4 == 1 && i < 4 * FIX_MH) ? 1
         : ((i % 4 == 2 && i < 4 * FIX_MW) ? 2 : ((i % 4 == 3 && i < 4 * FIX_MX) ? 3 : 0));
#else
    return (i % 3 == 1 && i < 3 * FIX_MH) ? 1 : ((i % 3 == 2 && i < 3 * FIX_MW) ? 2 : 0);
#endif
}

#if FIX_MN != 3
// Interleaved sections: the first pair column from which every column takes stream 0.
#define MROPE_CYCLED \
    (FIX_MN * (FIX_MH > FIX_MW ? (FIX_MH > FIX_MX ? FIX_MH : FIX_MX) : (FIX_MW > FIX_MX ? FIX_MW : FIX_MX)))

// Of the rows row[0 .. FIX_MN), stream k's.
__device__ __forceinline__ i64 stream_row(const i64 (&row)[FIX_MN], int k) {
#if FIX_MN == 2
    return k == 0 ? row[0] : row[1];
#else
    return k == 0 ? row[0] : (k == 1 ? row[1] : (k == 2 ? row[2] : row[3]));
#endif
}
#endif
#endif

// Interleaved sections in token-major order (thd, bshd): a unit's pairs come from up to FIX_MN
// rows, so each token's merged row (every pair column from its own stream's row) is gathered
// first: one table read per value instead of one per head group. Where a token's threads are
// whole warps and the half window a whole number of columns per lane (MROPE_WARP), each warp
// gathers its token's row itself, LANE_COLS columns per lane, and every thread takes its slice
// from the lanes holding it by warp shuffles: no shared memory and no block barrier, faster at
// decode (the benchmark's engine/mrope-decode). Otherwise (MROPE_SHARED) the block gathers its
// tokens' rows into shared memory, one value per thread, and each thread reads its slice there.
#define MROPE_THREADS_PER_TOKEN ((FIX_HQ + FIX_HK) / FIX_HB * (FIX_RD / 2 / ROPE_VEC))
#ifndef MROPE_WARP
#define MROPE_WARP (FIX_MROPE == 2 && FIX_ORDER == 0 && MROPE_THREADS_PER_TOKEN % 32 == 0 && \
                    (FIX_RD / 2) % 32 == 0 && ROPE_VEC % (FIX_RD / 64) == 0)
#endif
#ifndef MROPE_SHARED
#define MROPE_SHARED (FIX_MROPE == 2 && FIX_ORDER == 0 && !MROPE_WARP)
#endif
#if MROPE_WARP || MROPE_SHARED
// Column col of the merged row at stream position pos: cos, and sin times sign (NaN for a position
// outside the table). Both gathers read their values through this.
__device__ __forceinline__ void merged_value(const FixedParams& p, i64 pos, unsigned col, float sign, float& c,
                                             float& sn) {
    const i64 r = (pos >= 0 && pos < p.table_rows) ? pos : -1;
    c = __int_as_float(0x7fffffff), sn = c;
    if (r >= 0) {
        c = __ldg((const float*)p.cos + r * p.table_stride + col);
        sn = sign * __ldg((const float*)p.sin + r * p.table_stride + col);
    }
}
#endif
#if MROPE_WARP
constexpr int LANE_COLS = HALF / 32;  // pair columns each lane gathers: lane l holds l * LANE_COLS + c

// The positions of this lane's columns, in the stream of each, for the thread's token: loaded
// before the q/k loads, so that the position loads, on which the table loads and the shuffles
// wait, leave first.
struct MergedStart {
    i64 pos[LANE_COLS];
};

__device__ __forceinline__ MergedStart gather_start(const FixedParams& p) {
    const bool wide = p.index_flags & IDX_POSITIONS_I64;
    const unsigned t = (blockIdx.x * blockDim.x + threadIdx.x) / (GROUPS * CHUNKS);
    const unsigned lane = threadIdx.x & 31;
    MergedStart m;
#pragma unroll
    for (int c = 0; c < LANE_COLS; ++c)
        m.pos[c] = load_index(p.positions, (i64)mrope_stream(lane * LANE_COLS + c) * mrope_stride(p) + t, wide);
    return m;
}
#endif
#if MROPE_SHARED
constexpr unsigned TOKEN_THREADS = GROUPS * CHUNKS;
// Tokens one block can touch: its threads may start and end inside a token.
constexpr unsigned MERGED_TOKENS = (MAX_BLOCK + TOKEN_THREADS - 1) / TOKEN_THREADS + 1;

// The block's first token, its token count, and the position of this thread's first merged
// value (v = threadIdx.x). The kernel calls this before it issues its
// q/k loads, so that the position load, on which the table load and then the block's barrier wait,
// leaves first, as a plain build's does; loaded inside the gather it would issue after the q/k
// loads and their address arithmetic.
struct MergedStart {
    unsigned t0, n;
    i64 pos0;
};

__device__ __forceinline__ MergedStart gather_start(const FixedParams& p) {
    const bool wide = p.index_flags & IDX_POSITIONS_I64;
    const unsigned first = blockIdx.x * blockDim.x;
    const unsigned last = min(first + blockDim.x, (unsigned)p.total) - 1;
    MergedStart m;
    m.t0 = first / TOKEN_THREADS;
    m.n = last / TOKEN_THREADS - m.t0 + 1;
    // A thread without a value loads the first one's position (unused): a load outside the
    // gather's loop and its branch, which the compiler then issues ahead of the q/k loads.
    const unsigned v = threadIdx.x < m.n * HALF ? threadIdx.x : 0, slot = v / HALF, col = v - slot * HALF;
    m.pos0 = load_index(p.positions, (i64)mrope_stream(col) * mrope_stride(p) + m.t0 + slot, wide);
    return m;
}

// Fill merged[slot][0 cos | 1 sin][column] for the tokens of this block (sign applied to sin; NaN
// for a position outside the table). Every thread of the block takes part; its first value's
// position is m.pos0.
__device__ __forceinline__ void gather_merged(const FixedParams& p, const MergedStart& m, float (*merged)[2][HALF]) {
    const bool wide = p.index_flags & IDX_POSITIONS_I64;
    const float sign = p.sin_sign;
    for (unsigned v = threadIdx.x; v < m.n * HALF; v += blockDim.x) {
        const unsigned slot = v / HALF, col = v - slot * HALF;
        const i64 pos = v == threadIdx.x ? m.pos0
                                         : load_index(p.positions, (i64)mrope_stream(col) * mrope_stride(p) + m.t0 + slot, wide);
        float c, sn;
        merged_value(p, pos, col, sign, c, sn);
        merged[slot][0][col] = c;
        merged[slot][1][col] = sn;
    }
}
#elif !MROPE_WARP
struct MergedStart {};  // the other builds gather nothing
__device__ __forceinline__ MergedStart gather_start(const FixedParams&) { return MergedStart(); }
#endif

// Token t's table row (-1 outside the table). With the scheme fixed at compile time the compiler
// issues the index load (positions[t], offsets[b]) first, ahead of the q/k address arithmetic; a
// scheme read from the block keeps it behind the branches of every scheme, which delays a
// decode launch.
__device__ __forceinline__ i64 fixed_row(const FixedParams& p, unsigned t, unsigned b, unsigned s) {
#if FIX_POS >= 0
    return token_row_in<FIX_POS>(p, t, b, s);
#else
    return token_row(p, t, b, s);
#endif
}

// The table slice of pair unit pu for token t (NaN outside the table), sign applied to sin.
__device__ __forceinline__ void table_slice(const FixedParams& p, unsigned t, unsigned b, unsigned s, unsigned pu,
                                            float* c, float* sn, const MergedStart& m) {
#if MROPE_WARP
    // This lane's columns of the token's merged row, then each pair's value from its lane.
    const unsigned lane = threadIdx.x & 31;
    const float sign = p.sin_sign;
    float cv[LANE_COLS], sv[LANE_COLS];
#pragma unroll
    for (int k = 0; k < LANE_COLS; ++k) merged_value(p, m.pos[k], lane * LANE_COLS + k, sign, cv[k], sv[k]);
#pragma unroll
    for (int j = 0; j < NPAIR; ++j) {
        const unsigned src = pu * (NPAIR / LANE_COLS) + j / LANE_COLS;
        c[j] = __shfl_sync(0xffffffffu, cv[j % LANE_COLS], src);
        sn[j] = __shfl_sync(0xffffffffu, sv[j % LANE_COLS], src);
    }
#elif MROPE_SHARED
    __shared__ __align__(16) float merged[MERGED_TOKENS][2][HALF];
    gather_merged(p, m, merged);
    __syncthreads();
    const unsigned slot = t - (blockIdx.x * blockDim.x) / TOKEN_THREADS;
#pragma unroll
    for (int j = 0; j < NPAIR; ++j) {
        c[j] = merged[slot][0][pu * NPAIR + j];
        sn[j] = merged[slot][1][pu * NPAIR + j];
    }
#elif FIX_MROPE
    const bool wide = p.index_flags & IDX_POSITIONS_I64;
    const float sign = p.sin_sign;
    const unsigned i0 = pu * NPAIR;
    const int k0 = mrope_stream(i0);
#if FIX_MROPE == 1
    // Contiguous sections: the unit's ends decide (always one stream when the sections are whole
    // vectors, which the compiler then knows).
#if FIX_MN == 4
    const bool one = (FIX_MT % NPAIR == 0 && FIX_MH % NPAIR == 0 && FIX_MW % NPAIR == 0)
                     || k0 == mrope_stream(i0 + NPAIR - 1);
#else
    const bool one = (FIX_MT % NPAIR == 0 && FIX_MH % NPAIR == 0) || k0 == mrope_stream(i0 + NPAIR - 1);
#endif
#elif FIX_MN != 3
    const bool one = i0 >= (unsigned)MROPE_CYCLED;  // past the interleaved part: stream 0 only
#else
    const bool one = i0 >= 3 * (FIX_MH > FIX_MW ? FIX_MH : FIX_MW);  // past the interleaved part: temporal only
#endif
    if (one) {
        // The unit lies in one section (every unit, when the sections are whole vectors): one
        // position, one row slice, vector loads where the table allows.
        table_slice_at<NPAIR>(p, mrope_row(p, t, k0, wide), i0, rows_in_vectors(p), sign, c, sn);
        return;
    }
    // Pairs from several streams: each stream's row, then each pair from its stream's row.
    i64 row[FIX_MN];
#pragma unroll
    for (int k = 0; k < FIX_MN; ++k) row[k] = mrope_row(p, t, k, wide);
#pragma unroll
    for (int j = 0; j < NPAIR; ++j) {
        const unsigned i = i0 + j;
        const int k = mrope_stream(i);
#if FIX_MN != 3
        const i64 r = stream_row(row, k);
#else
        const i64 r = k == 0 ? row[0] : (k == 1 ? row[1] : row[2]);
#endif
        if (r >= 0) {
            c[j] = __ldg((const float*)p.cos + r * p.table_stride + i);
            sn[j] = sign * __ldg((const float*)p.sin + r * p.table_stride + i);
        } else {
            c[j] = sn[j] = __int_as_float(0x7fffffff);
        }
    }
#elif FIX_ANGLES
    typename AngleFreq<FIX_ANGLES>::type f[NPAIR];
    angle_freqs<NPAIR, FIX_ANGLES>(p, pu * NPAIR, f);
    angle_values<NPAIR, FIX_ANGLES>(p, fixed_row(p, t, b, s), f, p.sin_sign, c, sn);
#else
    table_slice_at<NPAIR>(p, fixed_row(p, t, b, s), pu * NPAIR, rows_in_vectors(p), p.sin_sign, c, sn);
#endif
}

extern "C" __global__ void __launch_bounds__(MAX_BLOCK) rope_fixed(const FixedParams p) {
#if MROPE_SHARED
    // Every thread reaches the block's barrier (table_slice): threads past the end shadow the
    // last thread's loads and return before storing.
    const bool live = blockIdx.x * blockDim.x + threadIdx.x < (unsigned)p.total;
    const unsigned i = live ? blockIdx.x * blockDim.x + threadIdx.x : (unsigned)p.total - 1;
#else
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned)p.total) return;
#endif
    wait_for_producer();  // a programmatic dependent launch: the kernel before this one has written q and k
    allow_dependents();
    const MergedStart m = gather_start(p);  // before the q/k loads (see gather_start)
#if FIX_ORDER == 1
    const unsigned r = i / CHUNKS, u = i - r * CHUNKS;
    const unsigned bg = fast_div(r, p.div_seq), s = r - bg * (unsigned)p.seq_len;
    const unsigned b = bg / GROUPS, g = bg - b * GROUPS;
    const unsigned t = b * (unsigned)p.seq_len + s;
#else
    const unsigned t = i / (GROUPS * CHUNKS), r = i - t * (GROUPS * CHUNKS);
    const unsigned g = r / CHUNKS, u = r - g * CHUNKS;
    const unsigned b = fast_div(t, p.div_seq), s = t - b * (unsigned)p.seq_len;
#endif
    const int which = (g * FIX_HB >= FIX_HQ) ? 1 : 0;  // the group is all q or all k
    const unsigned h0 = g * FIX_HB - (which ? FIX_HQ : 0);
    const i64 ch = FIX_RO + u * VEC;
#if FIX_DENSE && FIX_ORDER == 1
    // bhsd: the thread's head is run b * H + h0 of rows head_dim apart, dense_* elements per run.
    const i64 run = (i64)(b * (which ? FIX_HK : FIX_HQ) + h0);
    const i64 in_sh = p.dense_in[which], out_sh = p.dense_out[which];
    const bits_t* in = (const bits_t*)p.in[which] + (run * in_sh + (i64)s * FIX_D + ch);
    bits_t* out = (bits_t*)p.out[which] + (run * out_sh + (i64)s * FIX_D + ch);
#elif FIX_DENSE
    // Token-major: token t (batches folded in) is dense_* elements on, its heads head_dim apart.
    constexpr i64 in_sh = FIX_D, out_sh = FIX_D;
    const bits_t* in = (const bits_t*)p.in[which] + ((i64)t * p.dense_in[which] + (i64)h0 * FIX_D + ch);
    bits_t* out = (bits_t*)p.out[which] + ((i64)t * p.dense_out[which] + (i64)h0 * FIX_D + ch);
#else
    const bits_t* in = (const bits_t*)p.in[which] + (b * p.in_sb[which] + s * p.in_ss[which] + h0 * p.in_sh[which] + ch);
    bits_t* out = (bits_t*)p.out[which] + (b * p.out_sb[which] + s * p.out_ss[which] + h0 * p.out_sh[which] + ch);
    const i64 in_sh = p.in_sh[which], out_sh = p.out_sh[which];
#endif
    float c[NPAIR], sn[NPAIR];
#if ROPE_INTERLEAVED
    vec_t x[FIX_HB];
#pragma unroll
    for (int k = 0; k < FIX_HB; ++k) x[k] = load_stream(in + k * in_sh);
    table_slice(p, t, b, s, u, c, sn, m);
#if MROPE_SHARED
    if (!live) return;
#endif
#pragma unroll
    for (int k = 0; k < FIX_HB; ++k) {
        vec_t o;
        rotate_interleaved<conv, VEC>(x[k], c, sn, o);
        store_stream(out + k * out_sh, o);
    }
#else
    vec_t lo[FIX_HB], hi[FIX_HB];
#pragma unroll
    for (int k = 0; k < FIX_HB; ++k) {
        lo[k] = load_stream(in + k * in_sh);
        hi[k] = load_stream(in + k * in_sh + HALF);
    }
    table_slice(p, t, b, s, u, c, sn, m);
#if MROPE_SHARED
    if (!live) return;
#endif
#pragma unroll
    for (int k = 0; k < FIX_HB; ++k) {
        vec_t olo, ohi;
        rotate_halves<conv, VEC>(lo[k], hi[k], c, sn, olo, ohi);
        store_stream(out + k * out_sh, olo);
        store_stream(out + k * out_sh + HALF, ohi);
    }
#endif
}
