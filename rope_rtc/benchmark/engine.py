"""The engine-interface section of the benchmark: RoPE fused with the paged KV-cache write
(``RopeCachePlan``, the input dtype and FP8) against the two-step sequence an engine would
otherwise run (our ``RopePlan``, then one scatter per cache) and a copy of the same bytes; and
ONNX ``RotaryEmbedding`` (``rope_rtc.onnx.rotary_embedding``) beside ``apply_rope`` on the same
tensor and a copy.

Each record is checked before it is timed: the fused launch's q, k and cache entries must equal,
bit for bit, what the two-step sequence writes (the kernels share their arithmetic), and ONNX's
output must equal ``apply_rope``'s on the same tables.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from .cases import COPY, DTYPE_SHORT, ITEMSIZE, KV_FUSED as FUSED, KV_FUSED_FP8 as FUSED_FP8, KV_TWO_STEP as TWO_STEP
from .cases import ONNX_APPLY, ONNX_OP as ONNX
from .impls import _cupy_capture

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


def run_engine_section(ctx, measure, copy_runner) -> list[dict]:
    """Every engine record (``measure``/``copy_runner``: the runner's, passed in to keep imports
    one way)."""
    recs = []
    for label, T, dtype, interleaved in (("decode", KV_DECODE_T, "bfloat16", False),
                                         ("prefill", KV_PREFILL_T, "bfloat16", False),
                                         ("prefill", KV_PREFILL_T, "bfloat16", True),
                                         ("prefill", KV_PREFILL_T, "float32", False)):
        recs.append(_kv_record(ctx, measure, copy_runner, label, T, dtype, interleaved))
        ctx.free()
    recs.append(_onnx_record(ctx, measure, copy_runner))
    ctx.free()
    return recs


def _record(ident: str, params: dict, moved: int) -> dict:
    return {"id": ident, "group": "engine", "params": params, "bytes_moved": moved, "rows": []}


def _kv_record(ctx, measure, copy_runner, label: str, T: int, dtype: str, interleaved: bool) -> dict:
    import cupy as cp
    import ml_dtypes

    import rope_rtc

    hq, hk, d = KV_HEADS
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]
    pairing = "inter" if interleaved else "half"
    ident = f"engine/kv-cache-{label}/{DTYPE_SHORT[dtype]}/{pairing}/T={T}"
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

    copy = copy_runner(cp, ctx.stream, moved, 1)
    rows.append(_row(COPY, measure(ctx, copy.fns, _cupy_capture(ctx, copy.fns) if small else None, small, 1),
                     f"cudaMemcpyAsync of {copy.half} bytes"))
    del copy

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
    rows.append(_row(FUSED, measure(ctx, fns, _cupy_capture(ctx, fns) if small else None, small, 1),
                     "in place, one launch", check))
    if dtype != "float32" or small:
        fused8 = rope_rtc.RopeCachePlan(q, k, v, cos, sin, pos, slots, kc8, vc8, interleaved=interleaved,
                                        kv_cache_dtype="fp8_e4m3", k_scale=scale, v_scale=scale)
        fns8 = [partial(fused8.execute, q, k, v, cos, sin, pos, slots, kc8, vc8, k_scale=scale, v_scale=scale)]
        moved8 = kv_bytes_moved(T, dtype, fp8=True)
        rows.append(_row(FUSED_FP8, measure(ctx, fns8, _cupy_capture(ctx, fns8) if small else None, small, 1),
                         f"{moved8 / 1e6:.2f} MB moved (entries of one byte)",
                         "not checked here (bit-exact: tests/test_gpu_kv_cache.py)"))

    def two_step():
        rope.execute(q, k, cos, sin, positions=pos)
        flat_k[slots] = k
        flat_v[slots] = v

    rows.append(_row(TWO_STEP, measure(ctx, [two_step], _cupy_capture(ctx, [two_step]) if small else None, small, 1),
                     "three launches"))
    for r in rows:
        us = r["timings"].get("graph" if small else "cold", {}).get("us")
        print(f"  {r['impl']:<46} {'-' if us is None else f'{us:9.2f} µs'}  {r['check']}", flush=True)
    return rec


def _onnx_record(ctx, measure, copy_runner) -> dict:
    """ONNX RotaryEmbedding on a 4-D float16 X [B, H, S, D] with position_ids and float16 caches
    (widened to float32 per call, as the operator's inputs require), out of place."""
    import cupy as cp

    import rope_rtc
    from rope_rtc.onnx import rotary_embedding

    B, H, S, D = 4, 32, 4096, 128
    rows_pos = 8192
    item = 2
    moved = 2 * B * H * S * D * item + B * S * (D // 2) * 2 * 4 + B * S * 8
    ident = f"engine/onnx-rotary-embedding/fp16/bhsd/S={S}"
    rec = _record(ident, {"B": B, "H": H, "S": S, "D": D, "dtype": "float16", "layout": "bhsd", "interleaved": 0},
                  moved)
    print(f"\n[{ident}] {moved / 1e6:.2f} MB moved", flush=True)
    rng = np.random.default_rng(ctx.seed)
    X = cp.asarray(rng.standard_normal((B, H, S, D)).astype(np.float16))
    cos32, sin32 = rope_rtc.rope_tables(rows_pos, D, xp=cp)
    cos16, sin16 = cos32.astype(cp.float16), sin32.astype(cp.float16)
    pos = cp.asarray(rng.integers(0, rows_pos, (B, S)).astype(np.int64))
    out = cp.empty_like(X)
    copy = copy_runner(cp, ctx.stream, moved, 1)
    rec["rows"].append(_row(COPY, measure(ctx, copy.fns, None, False, 1), f"cudaMemcpyAsync of {copy.half} bytes"))
    del copy
    wide_c, wide_s = cos16.astype(cp.float32), sin16.astype(cp.float32)
    check = "-"
    try:
        y = rotary_embedding(X, cos16, sin16, pos)
        ref = rope_rtc.apply_rope(X, wide_c, wide_s, positions=pos, layout="bhsd")
        check = ("bit-exact (= apply_rope)" if bool(cp.array_equal(y.view(cp.uint16), ref.view(cp.uint16)))
                 else "WRONG: differs from apply_rope")
    except Exception as exc:
        check = f"error: {type(exc).__name__}: {exc}"[:300]
    rec["rows"].append(_row(ONNX, measure(ctx, [partial(rotary_embedding, X, cos16, sin16, pos, out=out)], None, False,
                                          1), "float16 caches widened per call; out=", check))
    rec["rows"].append(_row(ONNX_APPLY, measure(ctx, [partial(rope_rtc.apply_rope, X, wide_c, wide_s, positions=pos,
                                                              layout="bhsd", out=out)], None, False, 1), "out="))
    for r in rec["rows"]:
        us = r["timings"].get("cold", {}).get("us")
        print(f"  {r['impl']:<46} {'-' if us is None else f'{us:9.2f} µs'}  {r['check']}", flush=True)
    return rec


def _row(impl: str, timings: dict, note: str = "", check: str = "-") -> dict:
    return {"impl": impl, "layout": "-", "check": check, "note": note, "timings": timings}
