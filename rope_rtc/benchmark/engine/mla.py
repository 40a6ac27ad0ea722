"""DeepSeek-style MLA (``MlaRopeCachePlan``: RoPE on q's rotary channels and on k_pe, the
``[kv_c | k_pe]`` cache row, model dtype and FP8) beside its two-step sequence and a copy.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from ..cases import COPY_FP8, MLA_FUSED, MLA_FUSED_FP8, MLA_TWO_STEP, MLA_TWO_STEP_FP8
from .records import _copy_row, _record, _row, _timed

# DeepSeek-V3: q heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank
MLA_HEADS, MLA_NOPE, MLA_ROPE, MLA_LORA = 128, 128, 64, 512
MLA_BLOCK = 16               # tokens per cache block
MLA_TABLE = 32768            # positions drawn below this
MLA_PREFILL_T = 16384
MLA_DECODE_T = (1, 4, 16, 64)
MLA_DECODE_T_QUICK = (1, 64)
MLA_KV_SCALE = 0.05
# DeepSeek-V3's rope_scaling (its mscale / mscale_all_dim ratio is 1: the tables are plain rotations)
MLA_SCALING = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def mla_ident(T: int) -> str:
    return f"engine/mla-{'decode' if T <= 64 else 'prefill'}/bf16/inter/T={T}"


def mla_bytes_moved(T: int, fp8: bool = False) -> int:
    """In place, bf16: q's rotary channels read and written (the others are not touched), k_pe read
    and written, kv_c read, the cache row ``[kv_c | k_pe]`` written (one byte an entry for FP8),
    each token's cos and sin row, its position and its slot."""
    entry = 1 if fp8 else 2
    return T * (2 * MLA_HEADS * MLA_ROPE * 2 + 2 * MLA_ROPE * 2 + MLA_LORA * 2 + (MLA_LORA + MLA_ROPE) * entry
                + MLA_ROPE // 2 * 4 * 2 + 16)


# The two-step sequence's cache write, one thread per cache entry: token t's row [kv_c | k_pe]
# (bf16 bits) into row slot_mapping[t] of the cache, as it is (bf16) or divided by the scale in
# FP32 and converted to FP8 e4m3 with saturation, rounding to nearest even (the PTX cvt).
_CACHE_WRITE = r"""
#define ROW (LORA + ROPE)
#if FP8
__device__ __forceinline__ unsigned char entry(unsigned short v, const float* s) {
    const float f = __uint_as_float((unsigned)v << 16) / *s;
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(f));
    return (unsigned char)(pair & 0xFF);
}
typedef unsigned char out_t;
#else
__device__ __forceinline__ unsigned short entry(unsigned short v, const float*) { return v; }
typedef unsigned short out_t;
#endif
extern "C" __global__ void mla_cache_write(const unsigned short* __restrict__ kv_c,
                                           const unsigned short* __restrict__ k_pe,
                                           const long long* __restrict__ slots, out_t* __restrict__ cache,
                                           const float* __restrict__ scale, long long total) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const long long t = i / ROW;
    const int c = (int)(i - t * ROW);
    const long long slot = slots[t];
    if (slot < 0) return;
    const unsigned short v = c < LORA ? kv_c[t * LORA + c] : k_pe[t * ROPE + (c - LORA)];
    cache[slot * ROW + c] = entry(v, scale);
}
"""


def _mla_cache_writer(cp, fp8: bool, kv_c, k_pe, slots, cache, scale):
    """A call writing every token's ``[kv_c | k_pe]`` row into ``cache`` (CuPy ``RawKernel``)."""
    kern = cp.RawKernel(f"#define LORA {MLA_LORA}\n#define ROPE {MLA_ROPE}\n#define FP8 {int(fp8)}\n"
                        + _CACHE_WRITE, "mla_cache_write")
    total = kv_c.shape[0] * (MLA_LORA + MLA_ROPE)
    grid = (max(1, -(-total // 256)),)
    return partial(kern, grid, (256,), (kv_c, k_pe, slots, cache, scale, np.int64(total)))


def _mla_record(ctx, measure, copy_runner, T: int) -> dict:
    """DeepSeek-V3's MLA before attention: q [T, 128, 128 + 64] bf16 (its last 64 channels rotated
    in place), k_pe [T, 64] rotated in place, kv_c [T, 512], the cache [blocks, 16, 576] in bf16 and
    FP8 e4m3 (scale 0.05), DeepSeek's adjacent pairs and YaRN tables, blocks in a random order,
    random positions. Beside a copy of the bytes moved and the two-step sequence: one RopePlan on
    q's rotary channels and k_pe, then a CuPy kernel writing the cache rows (FP8: divided by the
    scale and converted). Checked before timing, on fresh copies: the fused launch equals the
    two-step sequence over every token and the NumPy reference on the first tokens, bit for bit."""
    import cupy as cp
    import ml_dtypes

    import rope_rtc
    from rope_rtc.reference import mla_rope_and_cache_reference

    H, N, R, L = MLA_HEADS, MLA_NOPE, MLA_ROPE, MLA_LORA
    small = T <= 64
    ident = mla_ident(T)
    moved, moved8 = mla_bytes_moved(T), mla_bytes_moved(T, fp8=True)
    rec = _record(ident, {"T": T, "dtype": "bfloat16", "interleaved": True, "H": H, "qk_nope_head_dim": N,
                          "qk_rope_head_dim": R, "kv_lora_rank": L, "block_size": MLA_BLOCK, "in_place": True,
                          "kv_scale": MLA_KV_SCALE}, moved)
    print(f"\n[{ident}] {moved / 1e6:.2f} MB moved ({moved8 / 1e6:.2f} MB with the FP8 cache)", flush=True)
    rng = np.random.default_rng(ctx.seed)
    bf16 = ml_dtypes.bfloat16

    def host(shape):  # float32 normals truncated to bf16 bits: quick for q's 400 M values
        return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).view(bf16)

    qh, kh, kvh = host((T, H, N + R)), host((T, R)), host((T, L))
    blocks = -(-T // MLA_BLOCK) + 64
    pos_h = rng.integers(0, MLA_TABLE, T).astype(np.int64)
    order = rng.permutation(blocks)
    slots_h = (order[:, None] * MLA_BLOCK + np.arange(MLA_BLOCK)).reshape(-1)[:T].astype(np.int64)
    q, k_pe, kv_c, pos, slots = (cp.asarray(a) for a in (qh, kh, kvh, pos_h, slots_h))
    cos, sin = rope_rtc.rope_tables(MLA_TABLE, R, base=10000.0, scaling=MLA_SCALING, xp=cp)
    shape = (blocks, MLA_BLOCK, L + R)
    cache, cache8 = cp.zeros(shape, bf16), cp.zeros(shape, cp.uint8)
    scale = cp.asarray(np.array([MLA_KV_SCALE], np.float32))
    rows = rec["rows"]

    rows.append(_copy_row(cp, ctx, measure, copy_runner, moved, small))
    if not small:  # the FP8 rows' own same-size copy: a copy's rate depends on its size
        row = _copy_row(cp, ctx, measure, copy_runner, moved8, False, COPY_FP8)
        row["bytes_moved"] = moved8
        rows.append(row)

    rope = rope_rtc.RopePlan(q[..., N:], k_pe.reshape(T, 1, R), cos, sin, positions=pos, layout="thd",
                             interleaved=True).compile()
    n_check = min(T, 32)
    host_cos, host_sin = cp.asnumpy(cos), cp.asnumpy(sin)
    for fp8 in (False, True):
        kind = "fp8_e4m3" if fp8 else "auto"
        dest = cache8 if fp8 else cache
        extra = dict(kv_scale=scale) if fp8 else {}
        fused = rope_rtc.MlaRopeCachePlan(q, k_pe, kv_c, cos, sin, pos, slots, dest, kv_cache_dtype=kind, **extra)
        check, two_check, two_fns = "-", "skip: not checked", None
        try:  # on fresh copies of the inputs (the timed calls rotate q and k_pe in place)
            want = mla_rope_and_cache_reference(qh[:n_check], kh[:n_check], kvh[:n_check], host_cos, host_sin,
                                                pos_h[:n_check], slots_h[:n_check], np.zeros(shape, dest.dtype),
                                                kv_cache_dtype=kind, kv_scale=MLA_KV_SCALE if fp8 else None)
            first = slots_h[:n_check]  # the rows those tokens write
            want = (want[0], want[1], want[2].reshape(-1, L + R)[first])

            def like_reference(qo, ko, co) -> bool:  # the first tokens, bit for bit
                got = (cp.asnumpy(qo[:n_check]), cp.asnumpy(ko[:n_check]), cp.asnumpy(co).reshape(-1, L + R)[first])
                return all(np.array_equal(*(np.ascontiguousarray(x).view(np.uint8) for x in (a, b)))
                           for a, b in zip(got, want))

            # From the host arrays: the timed calls of the previous pass rotated q and k_pe in place.
            q1, k1, c1 = cp.asarray(qh), cp.asarray(kh), cp.zeros(shape, dest.dtype)
            fused.execute(q1, k1, kv_c, cos, sin, pos, slots, c1, **extra)
            fused_ok = like_reference(q1, k1, c1)
            check = "bit-exact (= the NumPy reference)" if fused_ok else "WRONG: differs from the NumPy reference"
            try:
                q2, k2, c2 = cp.asarray(qh), cp.asarray(kh), cp.zeros(shape, dest.dtype)
                rope.execute(q2[..., N:], k2.reshape(T, 1, R), cos, sin, positions=pos)
                _mla_cache_writer(cp, fp8, kv_c, k2, slots, c2, scale)()
                same = all(bool(cp.array_equal(a.view(cp.uint8), b.view(cp.uint8))) for a, b in
                           ((q1, q2), (k1, k2), (c1, c2)))
                if same:
                    two_check = "bit-exact (= the fused launch)"
                    if fused_ok:
                        check = "bit-exact (= the two-step sequence and the NumPy reference)"
                elif like_reference(q2, k2, c2):
                    two_check, check = "-", "WRONG: differs from the two-step sequence"
                else:
                    two_check = "WRONG: differs from the NumPy reference"
                two_fns = [_mla_two_step(cp, rope, fp8, q, k_pe, kv_c, cos, sin, pos, slots, dest, scale)]
                del q2, k2, c2
            except Exception as exc:
                two_check = f"skip: {type(exc).__name__}: {exc}"[:300]
            del q1, k1, c1
        except Exception as exc:
            check = f"error: {type(exc).__name__}: {exc}"[:300]
        fns = [partial(fused.execute, q, k_pe, kv_c, cos, sin, pos, slots, dest, **extra)]
        row = _row(MLA_FUSED_FP8 if fp8 else MLA_FUSED, _timed(ctx, measure, fns, small), "in place, one launch", check)
        if fp8:
            row["bytes_moved"] = moved8  # fewer bytes than the record's: GB/s and % of copy use these
        rows.append(row)
        name = MLA_TWO_STEP_FP8 if fp8 else MLA_TWO_STEP
        row = (_row(name, _timed(ctx, measure, two_fns, small), "two launches: RoPE, then the cache write",
                    two_check) if two_fns else _row(name, {}, "", two_check))
        if fp8:
            row["bytes_moved"] = moved8
        rows.append(row)
    for r in rows:
        us = r["timings"].get("graph" if small else "cold", {}).get("us")
        print(f"  {r['impl']:<46} {'-' if us is None else f'{us:9.2f} µs'}  {r['check']}", flush=True)
    return rec


def _mla_two_step(cp, rope, fp8: bool, q, k_pe, kv_c, cos, sin, pos, slots, cache, scale):
    """RoPE on q's rotary channels and k_pe (one RopePlan launch, in place), then the cache write."""
    T = q.shape[0]
    q_rot, k3 = q[..., MLA_NOPE:], k_pe.reshape(T, 1, MLA_ROPE)  # views made once, as an engine keeps them
    write = _mla_cache_writer(cp, fp8, kv_c, k_pe, slots, cache, scale)

    def two_step():
        rope.execute(q_rot, k3, cos, sin, positions=pos)
        write()

    return two_step
