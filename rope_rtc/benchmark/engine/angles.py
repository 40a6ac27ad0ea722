"""cos and sin computed in the kernel from float64 ``inv_freq`` against the same plan reading the
exact table, beside a copy and transformers' on-the-fly rotary embedding.
"""

from __future__ import annotations

import numpy as np

from ..cases import ANGLES_OP, ANGLES_TABLE
from .records import _copy_row, _record, _row, _timed, _timed_torch

ANGLES_HEADS = (32, 8, 128)  # Llama-3-8B: Hq, Hkv, D
ANGLES_DECODE_T = 8          # B=8 sequences, one token each, positions anywhere below ANGLES_ROWS
ANGLES_PREFILL_T = 16384     # one sequence, positions 0 .. T-1
ANGLES_ROWS = 131072


def angles_bytes_moved(T: int, table: bool) -> int:
    """q and k read and written (bf16), each token's position; with tables, each token's cos and
    sin row (float32, rotary_dim / 2 each)."""
    hq, hk, d = ANGLES_HEADS
    return T * (2 * (hq + hk) * d * 2 + 8 + (d // 2 * 4 * 2 if table else 0))


def angles_ident(T: int) -> str:
    return f"engine/angles-{'decode' if T <= 64 else 'prefill'}/bf16/thd/T={T}"


def _angles_record(ctx, measure, copy_runner, T: int) -> dict:
    """cos and sin computed in the kernel from float64 inv_freq (numerics "exact") against the
    same plan reading the exact table: Llama-3-8B's heads and rope scaling, bf16 thd, q and k in
    place. The record's bytes are the inv_freq launch's (no table); the table row moves its rows
    too. Checked: the two outputs bit for bit."""
    import cupy as cp
    import ml_dtypes

    import rope_rtc

    hq, hk, d = ANGLES_HEADS
    small = T <= 64
    moved = angles_bytes_moved(T, table=False)
    ident = angles_ident(T)
    rec = _record(ident, {"T": T, "dtype": "bfloat16", "Hq": hq, "Hkv": hk, "D": d, "layout": "thd",
                          "in_place": True, "rope_type": "llama3", "inv_freq": "float64"}, moved)
    print(f"\n[{ident}] {moved / 1e6:.2f} MB moved", flush=True)
    rng = np.random.default_rng(ctx.seed)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    f, att = rope_rtc.inverse_frequencies(d, base=5e5, scaling=scaling)
    cos, sin = rope_rtc.rope_tables(ANGLES_ROWS, d, base=5e5, scaling=scaling, xp=cp)
    inv = cp.asarray(f)
    q = cp.asarray(rng.standard_normal((T, hq, d)).astype(ml_dtypes.bfloat16))
    k = cp.asarray(rng.standard_normal((T, hk, d)).astype(ml_dtypes.bfloat16))
    pos = cp.asarray(rng.integers(0, ANGLES_ROWS, T) if small else np.arange(T)).astype(cp.int64)
    rows = rec["rows"]
    rows.append(_copy_row(cp, ctx, measure, copy_runner, moved, small))
    table = rope_rtc.RopePlan(q, k, cos, sin, positions=pos, layout="thd").compile()
    angles = rope_rtc.RopePlan(q, k, inv_freq=inv, attention_scaling=att, positions=pos, layout="thd").compile()
    try:  # on fresh copies (the timed calls rotate q and k in place)
        q1, k1, q2, k2 = q.copy(), k.copy(), q.copy(), k.copy()
        angles.execute(q1, k1, positions=pos, inv_freq=inv)
        table.execute(q2, k2, cos, sin, positions=pos)
        same = all(bool(cp.array_equal(a.view(cp.uint16), b.view(cp.uint16))) for a, b in ((q1, q2), (k1, k2)))
        check = "bit-exact (= the exact table's call)" if same else "WRONG: differs from the exact table's call"
        del q1, k1, q2, k2
    except Exception as exc:
        check = f"error: {type(exc).__name__}: {exc}"[:300]
    fns = [lambda: angles.execute(q, k, positions=pos, inv_freq=inv)]
    rows.append(_row(ANGLES_OP, _timed(ctx, measure, fns, small),
                     "float64 inv_freq, in place", check))
    fns = [lambda: table.execute(q, k, cos, sin, positions=pos)]
    row = _row(ANGLES_TABLE, _timed(ctx, measure, fns, small),
               f"exact table of {ANGLES_ROWS} rows, in place", "-")
    row["bytes_moved"] = angles_bytes_moved(T, table=True)
    rows.append(row)
    torch = ctx.peers.torch if ctx.peers is not None else None
    if torch is not None:
        rows += _angles_peers(ctx, measure, torch, q, k, f, att, pos, small)
    for r in rows:
        us = r["timings"].get("graph" if small else "cold", {}).get("us")
        print(f"  {r['impl']:<46} {'-' if us is None else f'{us:9.2f} µs'}  {r['check']}", flush=True)
    return rec


def _angles_peers(ctx, measure, torch, q, k, inv_freq, attention: float, pos, small: bool) -> list:
    """What transformers runs per forward when it computes cos and sin on the fly: its rotary
    embedding's arithmetic (float32 ``inv_freq @ position_ids``, ``cat``, cos/sin times the
    attention factor, cast to bf16), then its ``apply_rotary_pos_emb``; eager and compiled, out of
    place as the model runs it. The peer that computes angles on the fly and runs on the image."""
    name, label = "torch (transformers' rotary embedding + apply_rotary_pos_emb)", "torch.compile of the same"
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        from ..impls import to_torch

        tq, tk = (to_torch(torch, a, "bfloat16") for a in (q, k))
        qv, kv = tq[None].transpose(1, 2), tk[None].transpose(1, 2)  # [1, H, T, D]
        tinv = torch.tensor(np.asarray(inv_freq, np.float32), device=tq.device)
        tpos = torch.from_dlpack(pos)[None]  # [1, T]

        def hf():
            freqs = (tinv[None, :, None] @ tpos[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            c = (emb.cos() * attention).to(torch.bfloat16)
            s = (emb.sin() * attention).to(torch.bfloat16)
            return apply_rotary_pos_emb(qv, kv, c, s)

        hf()
        rows = [_row(name, _timed_torch(ctx, measure, torch, hf, small), "float32 angles per call, eager", "-")]
    except Exception as exc:
        return [_row(name, {}, "", f"skip: {type(exc).__name__}: {exc}"[:200])]
    if ctx.peers.compiled.get("general") is not None:  # torch.compile is usable here
        try:
            compiled = torch.compile(hf, dynamic=False)
            compiled()
            rows.append(_row(label, _timed_torch(ctx, measure, torch, compiled, small), "torch.compile(dynamic=False)",
                             "-"))
        except Exception as exc:
            rows.append(_row(label, {}, "", f"skip: {type(exc).__name__}: {exc}"[:200]))
    return rows
