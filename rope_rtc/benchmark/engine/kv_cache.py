"""RoPE fused with the paged KV-cache write (``RopeCachePlan``, the input dtype and FP8) against
the two-step sequence an engine would otherwise run (``RopePlan``, then one scatter per cache)
and a copy of the same bytes.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from ..cases import COPY_FP8, DTYPE_SHORT, ITEMSIZE
from ..cases import KV_FUSED as FUSED, KV_FUSED_FP8 as FUSED_FP8, KV_TWO_STEP as TWO_STEP
from .records import _copy_row, _record, _row, _timed

KV_HEADS = (32, 8, 128)   # Hq, Hkv, D
KV_BLOCK = 16             # tokens per cache block
KV_TABLE = 32768          # positions drawn below this (random, as prefix caching gives)
KV_DECODE_T = 8           # B=8 sequences, one token each
KV_PREFILL_T = 16384


def kv_bytes_moved(T: int, dtype: str, fp8: bool = False) -> int:
    """q and k read and written, v read, the k and v entries written (one byte each for FP8),
    the table rows, the positions and the slots."""
    hq, hk, d = KV_HEADS
    item = ITEMSIZE[dtype]
    entry = 1 if fp8 else item
    return T * ((2 * hq + 3 * hk) * d * item + 2 * hk * d * entry + d * 4 + 16)


def _slots(rng, T: int, blocks: int) -> np.ndarray:
    """Whole cache blocks in a random order (what a block allocator hands out), each filled in order."""
    order = rng.permutation(blocks)
    return (order[:, None] * KV_BLOCK + np.arange(KV_BLOCK)).reshape(-1)[:T].astype(np.int64)


def kv_ident(label: str, T: int, dtype: str, interleaved: bool) -> str:
    return f"engine/kv-cache-{label}/{DTYPE_SHORT[dtype]}/{'inter' if interleaved else 'half'}/T={T}"


def _kv_record(ctx, measure, copy_runner, label: str, T: int, dtype: str, interleaved: bool) -> dict:
    import cupy as cp
    import ml_dtypes

    import rope_rtc

    hq, hk, d = KV_HEADS
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]
    ident = kv_ident(label, T, dtype, interleaved)
    moved = kv_bytes_moved(T, dtype)
    rec = _record(ident, {"T": T, "dtype": dtype, "interleaved": interleaved, "Hq": hq, "Hkv": hk, "D": d,
                          "block_size": KV_BLOCK, "layout": "nhd", "in_place": True}, moved)
    print(f"\n[{ident}] {moved / 1e6:.2f} MB moved", flush=True)
    rng = np.random.default_rng(ctx.seed)
    blocks = -(-T // KV_BLOCK) + 64
    host = {n: rng.standard_normal(s).astype(np_dtype) for n, s in (("q", (T, hq, d)), ("k", (T, hk, d)),
                                                                    ("v", (T, hk, d)))}
    q, k, v = (cp.asarray(host[n]) for n in ("q", "k", "v"))
    cos, sin = rope_rtc.rope_tables(KV_TABLE, d, xp=cp)
    pos = cp.asarray(rng.integers(0, KV_TABLE, T).astype(np.int64))
    slots = cp.asarray(_slots(rng, T, blocks))
    shape = (blocks, KV_BLOCK, hk, d)
    kc, vc = cp.zeros(shape, np_dtype), cp.zeros(shape, np_dtype)
    kc8, vc8 = cp.zeros(shape, cp.uint8), cp.zeros(shape, cp.uint8)
    scale = cp.asarray(np.array([0.05], np.float32))
    small = label == "decode"
    rows = rec["rows"]

    rows.append(_copy_row(cp, ctx, measure, copy_runner, moved, small))

    # The check: the fused launch against the two-step sequence, on fresh copies of the inputs.
    rope = rope_rtc.RopePlan(q, k, cos, sin, positions=pos, layout="thd", interleaved=interleaved).compile()
    flat_k, flat_v = kc.reshape(-1, hk, d), vc.reshape(-1, hk, d)
    check = "-"
    try:
        q1, k1, kc1, vc1 = q.copy(), k.copy(), cp.full(shape, np.nan, np_dtype), cp.full(shape, np.nan, np_dtype)
        rope_rtc.rope_and_cache(q1, k1, v, cos, sin, pos, slots, kc1, vc1, interleaved=interleaved)
        q2, k2 = q.copy(), k.copy()
        rope.execute(q2, k2, cos, sin, positions=pos)
        same = all(bool(cp.array_equal(a.view(cp.uint8), b.view(cp.uint8))) for a, b in (
            (q1, q2), (k1, k2), (kc1.reshape(-1, hk, d)[slots], k2), (vc1.reshape(-1, hk, d)[slots], v)))
        check = "bit-exact (= the two-step sequence)" if same else "WRONG: differs from the two-step sequence"
        del q1, k1, kc1, vc1, q2, k2
    except Exception as exc:
        check = f"error: {type(exc).__name__}: {exc}"[:300]

    fused = rope_rtc.RopeCachePlan(q, k, v, cos, sin, pos, slots, kc, vc, interleaved=interleaved)
    fns = [partial(fused.execute, q, k, v, cos, sin, pos, slots, kc, vc)]
    rows.append(_row(FUSED, _timed(ctx, measure, fns, small),
                     "in place, one launch", check))
    if dtype != "float32" or small:
        fused8 = rope_rtc.RopeCachePlan(q, k, v, cos, sin, pos, slots, kc8, vc8, interleaved=interleaved,
                                        kv_cache_dtype="fp8_e4m3", k_scale=scale, v_scale=scale)
        fns8 = [partial(fused8.execute, q, k, v, cos, sin, pos, slots, kc8, vc8, k_scale=scale, v_scale=scale)]
        moved8 = kv_bytes_moved(T, dtype, fp8=True)
        if not small:  # the FP8 row's own same-size copy: a copy's rate depends on its size
            row = _copy_row(cp, ctx, measure, copy_runner, moved8, False, COPY_FP8)
            row["bytes_moved"] = moved8
            rows.append(row)
        check8 = "-"
        try:  # on fresh copies: the entries against the NumPy reference's quantisation of RoPE's output
            from rope_rtc.numerics.reference import fp8_quantize

            q8, k8 = q.copy(), k.copy()
            kc8c, vc8c = cp.zeros(shape, cp.uint8), cp.zeros(shape, cp.uint8)
            fused8.execute(q8, k8, v, cos, sin, pos, slots, kc8c, vc8c, k_scale=scale, v_scale=scale)
            k2 = k.copy()
            rope.execute(q.copy(), k2, cos, sin, positions=pos)
            s32 = np.float32(cp.asnumpy(scale)[0])
            same = all(np.array_equal(cp.asnumpy(c.reshape(-1, hk, d)[slots]), fp8_quantize(cp.asnumpy(x), s32,
                                                                                            "fp8_e4m3"))
                       for c, x in ((kc8c, k2), (vc8c, v)))
            check8 = ("bit-exact (= RoPE, then the NumPy reference's FP8 quantisation)" if same else
                      "WRONG: differs from RoPE, then the NumPy reference's FP8 quantisation")
            del q8, k8, kc8c, vc8c, k2
        except Exception as exc:
            check8 = f"error: {type(exc).__name__}: {exc}"[:300]
        row8 = _row(FUSED_FP8, _timed(ctx, measure, fns8, small),
                    "entries of one byte", check8)
        row8["bytes_moved"] = moved8  # fewer bytes than the record's: GB/s and % of copy use these
        rows.append(row8)

    def two_step():
        rope.execute(q, k, cos, sin, positions=pos)
        flat_k[slots] = k
        flat_v[slots] = v

    rows.append(_row(TWO_STEP, _timed(ctx, measure, [two_step], small),
                     "three launches"))
    for r in rows:
        us = r["timings"].get("graph" if small else "cold", {}).get("us")
        print(f"  {r['impl']:<46} {'-' if us is None else f'{us:9.2f} µs'}  {r['check']}", flush=True)
    return rec
