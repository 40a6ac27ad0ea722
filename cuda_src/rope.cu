// The general RoPE kernel family: any float dtype, half-split or interleaved pairs, a rotary
// window inside the head, q and k (different head counts) in one launch, four position schemes.
//
// Compile-time parameters (what code generation needs, nothing else):
//   ROPE_DTYPE        element type code (common.cuh)
//   ROPE_INTERLEAVED  0: half-split pairs (x[i], x[i + R/2]) (GPT-NeoX, HF rotate_half)
//                     1: adjacent pairs (x[2i], x[2i + 1]) (RoFormer, GPT-J)
//   ROPE_VEC          elements per vector access (16 bytes when the host's alignment allows)
//   ROPE_PDL          optional: 1 for a programmatic dependent launch (common.cuh: wait_for_producer)
// Everything else (strides, counts, window, positions, direction) is a run-time field of
// RopeParams, so one binary serves every shape.
//
// Work split: one thread per (token, group of HEAD_BATCH heads, vector unit), a flat grid like a
// copy kernel's, in the order (token tile, head group, token in tile, unit). A thread loads its
// table slice once, issues the loads of all its heads before any store, then rotates and stores.
// The host picks the tile (token_tile in rope_rtc/ops/rope_launch.py): 1 token when heads are the denser
// axis (bshd), so a warp covers one token's heads; several when tokens are (bhsd), so a warp
// covers a run of consecutive rows of one head. Either way the threads of one block share a few
// cos/sin rows, which L1 then serves to every head: a table row is read from L2 once per block,
// not once per head.
#include "common.cuh"
#include "positions.cuh"
#include "rope_types.cuh"

// Heads per thread (ROPE_HEAD_BATCH, chosen by the host), loaded before any is stored (in place,
// the compiler could not reorder a load of one head above the store of another on its own: the
// pointers may alias).
#ifndef ROPE_HEAD_BATCH
#error "rope.cu needs -DROPE_HEAD_BATCH (rope_rtc/build/registry.py: rope_head_batch)"
#endif
constexpr int HEAD_BATCH = ROPE_HEAD_BATCH;

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
    i64 tile;              // tokens per tile (the thread order is tile, head group, token, unit)
    // The flat index space, computed on the host: rot_total threads rotate (one per token, head
    // group and unit, the token count rounded up to whole tiles), then copy threads copy the
    // window's outside (out of place only). Threads past the last token return at once.
    i64 units, groups, copy_units, rot_total, total;
    // narrow = 1: total < 2^31, so one thread per index with 32-bit index arithmetic and the
    // divisions below as multiply-shifts; 0: the 64-bit grid-stride loop.
    i64 narrow;
    u64 div_units, div_groups, div_tile, div_seq, div_copy_units, div_heads;  // fast_div packed
};

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
    rotate_interleaved<conv, VEC>(u.a, c, sn, r);
    store_vec<bits_t, VEC>(hp.out, r);
#else
    vec_t rlo, rhi;
    rotate_halves<conv, VEC>(u.a, u.b, c, sn, rlo, rhi);
    store_vec<bits_t, VEC>(hp.out, rlo);
    store_vec<bits_t, VEC>(hp.out + rot_half, rhi);
#endif
}

// Rotate unit u of head group g for token t = (b, s): issue every head's loads before any store
// (in place the compiler may not reorder a load of one head above the store of another on its
// own: the pointers may alias), then the table row, then rotate and store.
__device__ __forceinline__ void rotate_group(const RopeParams& p, i64 t, i64 b, i64 s, i64 g, i64 u, float sign) {
    const i64 heads = p.q_heads + p.k_heads;
    const i64 ch = p.rot_offset + u * VEC;
    HeadPtrs hp[HEAD_BATCH];
    Unit in[HEAD_BATCH];
#pragma unroll
    for (int k = 0; k < HEAD_BATCH; ++k) {
        // Consecutive heads per thread: strided heads (g + k*groups) are slower for
        // interleaved pairs.
        const i64 hk = g * HEAD_BATCH + k;
        if (hk < heads) {
            hp[k] = head_ptrs(p, hk, b, s, ch);
            in[k] = load_unit(hp[k], p.rot_half);
        }
    }
    const i64 row = token_row(p, t, b, s);
    float c[NPAIR], sn[NPAIR];
    // The values of positions.cuh's table_slice_at, written out: through the helper NVRTC numbers
    // this kernel's registers differently and ptxas allocates another binary.
    if (row >= 0) {
        const float* cr = (const float*)p.cos + row * p.table_stride + u * NPAIR;
        const float* sr = (const float*)p.sin + row * p.table_stride + u * NPAIR;
        if (p.table_vec) {
            const Vec<float, NPAIR> cv = ldg_vec<float, NPAIR>(cr);
            const Vec<float, NPAIR> sv = ldg_vec<float, NPAIR>(sr);
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
}

// Copy unit u (of the channels outside the rotary window) of head h for token (b, s).
__device__ __forceinline__ void copy_unit(const RopeParams& p, i64 b, i64 s, i64 h, i64 u) {
    const i64 prefix = p.rot_offset / VEC;
    const i64 ch = u < prefix ? u * VEC : p.rot_offset + 2 * p.rot_half + (u - prefix) * VEC;
    const HeadPtrs hp = head_ptrs(p, h, b, s, ch);
    store_vec<bits_t, VEC>(hp.out, load_vec<bits_t, VEC>(hp.in));
}

// One thread per index, 32-bit arithmetic, multiply-shift divisions (total < 2^31; the host
// launches exactly ceil(total / 256) blocks).
__device__ __forceinline__ void narrow_thread(const RopeParams& p, float sign) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned)p.total) return;
    const bool rot = i < (unsigned)p.rot_total;
    const unsigned j = rot ? i : i - (unsigned)p.rot_total;
    const unsigned per = (unsigned)(rot ? p.units : p.copy_units);
    const unsigned across = (unsigned)(rot ? p.groups : p.q_heads + p.k_heads);
    const unsigned r = fast_div(j, rot ? p.div_units : p.div_copy_units);
    const unsigned u = j - r * per;
    const unsigned r2 = fast_div(r, p.div_tile);
    const unsigned tt = r - r2 * (unsigned)p.tile;
    const unsigned tile = fast_div(r2, rot ? p.div_groups : p.div_heads);
    const unsigned h = r2 - tile * across;
    const unsigned t = tile * (unsigned)p.tile + tt;
    if (t >= (unsigned)p.num_tokens) return;  // the last tile's padding
    const unsigned b = fast_div(t, p.div_seq);
    const unsigned s = t - b * (unsigned)p.seq_len;
    wait_for_producer();
    allow_dependents();
    if (rot) rotate_group(p, t, b, s, h, u, sign);
    else copy_unit(p, b, s, h, u);
}

// The general case: 64-bit indices, grid-stride loop (the grid is capped at the CUDA limit).
__device__ __forceinline__ void wide_loop(const RopeParams& p, float sign) {
    wait_for_producer();
    allow_dependents();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < p.total; i += (i64)gridDim.x * blockDim.x) {
        const bool rot = i < p.rot_total;
        const i64 j = rot ? i : i - p.rot_total;
        const i64 per = rot ? p.units : p.copy_units;
        const i64 across = rot ? p.groups : p.q_heads + p.k_heads;
        const i64 r = j / per, u = j - r * per;
        const i64 r2 = r / p.tile, tt = r - r2 * p.tile;
        const i64 tile = r2 / across, h = r2 - tile * across;
        const i64 t = tile * p.tile + tt;
        if (t >= p.num_tokens) continue;
        const i64 b = t / p.seq_len, s = t - b * p.seq_len;
        if (rot) rotate_group(p, t, b, s, h, u, sign);
        else copy_unit(p, b, s, h, u);
    }
}

// Two entry points so that each gets its own register allocation: the 64-bit loop needs ~10
// more registers, and the 32-bit path is what every tensor below 2^31 indices runs (at 26-40
// registers, 6-8 blocks of 256 fit an SM: enough loads in flight to reach the copy rate).
// ROPE_MIN_BLOCKS bounds registers through __launch_bounds__; the default 1 sets no bound, as a
// bound of 8 blocks spilled the multi-head builds and did not speed up the one-head build.
#ifndef ROPE_MIN_BLOCKS
#define ROPE_MIN_BLOCKS 1
#endif

extern "C" __global__ void __launch_bounds__(256, ROPE_MIN_BLOCKS) rope_apply(const RopeParams p) {
    narrow_thread(p, p.inverse ? -1.0f : 1.0f);
}

extern "C" __global__ void __launch_bounds__(256) rope_apply_wide(const RopeParams p) {
    wide_loop(p, p.inverse ? -1.0f : 1.0f);
}
