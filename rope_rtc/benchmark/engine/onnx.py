"""ONNX ``RotaryEmbedding`` (``rope_rtc.onnx.rotary_embedding``) beside ``apply_rope`` on the
same tensor and a copy.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from ..cases import ONNX_APPLY, ONNX_OP as ONNX
from .records import _copy_row, _record, _row


ONNX_SHAPE = (4, 32, 4096, 128)  # X's [B, H, S, D]
ONNX_IDENT = f"engine/onnx-rotary-embedding/fp16/bhsd/S={ONNX_SHAPE[2]}"


def _onnx_record(ctx, measure, copy_runner) -> dict:
    """ONNX RotaryEmbedding on a 4-D float16 X [B, H, S, D] with position_ids and float16 caches
    (widened to float32 per call, as the operator's inputs require), out of place."""
    import cupy as cp

    import rope_rtc
    from rope_rtc.ops.onnx import rotary_embedding

    B, H, S, D = ONNX_SHAPE
    rows_pos = 8192
    item = 2
    moved = 2 * B * H * S * D * item + B * S * (D // 2) * 2 * 4 + B * S * 8
    ident = ONNX_IDENT
    rec = _record(ident, {"B": B, "H": H, "S": S, "D": D, "dtype": "float16", "layout": "bhsd", "interleaved": 0},
                  moved)
    print(f"\n[{ident}] {moved / 1e6:.2f} MB moved", flush=True)
    rng = np.random.default_rng(ctx.seed)
    X = cp.asarray(rng.standard_normal((B, H, S, D)).astype(np.float16))
    cos32, sin32 = rope_rtc.rope_tables(rows_pos, D, xp=cp)
    cos16, sin16 = cos32.astype(cp.float16), sin32.astype(cp.float16)
    pos = cp.asarray(rng.integers(0, rows_pos, (B, S)).astype(np.int64))
    out = cp.empty_like(X)
    rec["rows"].append(_copy_row(cp, ctx, measure, copy_runner, moved, False))
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
