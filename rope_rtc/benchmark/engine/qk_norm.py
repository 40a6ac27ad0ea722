"""Per-head RMSNorm fused with RoPE (``QKNormRopePlan``, both numerics) beside a copy, the
two-step sequence and Hugging Face's Qwen3 path.
"""

from __future__ import annotations

import numpy as np

from ..cases import QKNORM_HF_NUMERICS, QKNORM_OP, QKNORM_TWO_STEP
from .records import _copy_row, _record, _row, _timed, _timed_torch

QKNORM_HEADS = (32, 8, 128)  # Qwen3-8B: Hq, Hkv, D
QKNORM_DECODE_T = 8
QKNORM_PREFILL_T = 16384
QKNORM_EPS = 1e-6


def qk_norm_bytes_moved(T: int) -> int:
    """q and k read and written (bf16), one cos and one sin row per token, the positions (the
    weights, read once, are left out)."""
    hq, hk, d = QKNORM_HEADS
    return T * (2 * (hq + hk) * d * 2 + d * 4 + 8)


def qk_norm_ident(T: int) -> str:
    return f"engine/qk-norm-{'decode' if T <= 64 else 'prefill'}/bf16/thd/T={T}"


def _qk_norm_record(ctx, measure, copy_runner, T: int) -> dict:
    """Per-head RMSNorm fused with RoPE, Qwen3-8B's heads, bf16 thd, q and k in place, random
    positions: ours (both numerics) beside a copy, the two-step sequence (torch's rms_norm, then
    our RopePlan on its output) and Hugging Face's Qwen3 path (Qwen3RMSNorm on each head, then
    apply_rotary_pos_emb), eager and under torch.compile."""
    import cupy as cp
    import ml_dtypes

    import rope_rtc
    from rope_rtc.numerics.reference import qk_norm_error_bound, qk_norm_reference, qk_norm_rope_reference

    hq, hk, d = QKNORM_HEADS
    small = T <= 64
    moved = qk_norm_bytes_moved(T)
    ident = qk_norm_ident(T)
    rec = _record(ident, {"T": T, "dtype": "bfloat16", "Hq": hq, "Hkv": hk, "D": d, "layout": "thd",
                          "in_place": True, "eps": QKNORM_EPS}, moved)
    print(f"\n[{ident}] {moved / 1e6:.2f} MB moved", flush=True)
    rng = np.random.default_rng(ctx.seed)
    rows = 32768
    qh = (rng.standard_normal((T, hq, d)) * 3).astype(ml_dtypes.bfloat16)
    kh = (rng.standard_normal((T, hk, d)) * 3).astype(ml_dtypes.bfloat16)
    wq = (1 + 0.25 * rng.standard_normal(d)).astype(ml_dtypes.bfloat16)
    wk = (1 + 0.25 * rng.standard_normal(d)).astype(ml_dtypes.bfloat16)
    pos_h = rng.integers(0, rows, T).astype(np.int64)
    q, k, qw, kw, pos = (cp.asarray(a) for a in (qh, kh, wq, wk, pos_h))
    cos, sin = rope_rtc.rope_tables(rows, d, xp=cp)
    rec["rows"].append(_copy_row(cp, ctx, measure, copy_runner, moved, small))
    n_check = min(T, 256)
    host_cos, host_sin = cp.asnumpy(cos), cp.asnumpy(sin)
    check = "-"
    plans = {}
    for numerics in ("exact", "transformers"):
        plans[numerics] = rope_rtc.QKNormRopePlan(q, k, qw, kw, cos, sin, eps=QKNORM_EPS, numerics=numerics,
                                                  positions=pos, layout="thd").compile()
    try:
        q1, k1 = q.copy(), k.copy()
        plans["exact"].execute(q1, k1, qw, kw, cos, sin, positions=pos)
        for out, host, w in ((q1, qh, wq), (k1, kh, wk)):
            got = cp.asnumpy(out[:n_check]).astype(np.float64)
            want = qk_norm_rope_reference(host[:n_check], w, host_cos, host_sin, pos_h[:n_check], eps=QKNORM_EPS,
                                          interleaved=False)
            bound = qk_norm_error_bound(qk_norm_reference(host[:n_check], w, eps=QKNORM_EPS), ml_dtypes.bfloat16,
                                        got, interleaved=False)
            if not (np.abs(got - want) <= bound).all():
                raise ValueError("outside the documented bound of the float64 reference")
        check = "ok (bound of the float64 reference)"
        del q1, k1
    except Exception as exc:
        check = f"WRONG: {type(exc).__name__}: {exc}"[:200]
    for numerics, impl, note, chk in (("exact", QKNORM_OP, "one launch, in place, FP32 and one rounding", check),
                                      ("transformers", QKNORM_HF_NUMERICS, "one launch, in place, Qwen3RMSNorm's "
                                       "roundings", "-")):
        plan = plans[numerics]
        fns = [lambda plan=plan: plan.execute(q, k, qw, kw, cos, sin, positions=pos)]
        rec["rows"].append(_row(impl, _timed(ctx, measure, fns, small), note,
                                chk))
    torch = ctx.peers.torch if ctx.peers is not None else None
    if torch is not None:
        rec["rows"] += _qk_norm_peers(ctx, measure, torch, q, k, qw, kw, cos, sin, pos, small)
    for r in rec["rows"]:
        us = r["timings"].get("graph" if small else "cold", {}).get("us")
        print(f"  {r['impl']:<46} {'-' if us is None else f'{us:9.2f} µs'}  {r['check']}", flush=True)
    return rec


def _qk_norm_peers(ctx, measure, torch, q, k, qw, kw, cos, sin, pos, small: bool) -> list:
    """The two-step sequence (prefill: torch's rms_norm allocates its outputs, so it is not
    captured) and Hugging Face's Qwen3 path, eager and compiled (out of place, as the model)."""
    import cupy as cp

    import rope_rtc

    from ..impls import to_torch

    T, hq, d = q.shape
    tq, tk, tqw, tkw = (to_torch(torch, a, "bfloat16") for a in (q, k, qw, kw))
    rows = []
    if not small:
        rope = rope_rtc.RopePlan(q, k, cos, sin, positions=pos, layout="thd").compile()

        def two_step():
            nq = torch.nn.functional.rms_norm(tq, (d,), tqw, QKNORM_EPS)
            nk = torch.nn.functional.rms_norm(tk, (d,), tkw, QKNORM_EPS)
            rope.execute(cp.from_dlpack(nq.view(torch.int16)).view(q.dtype),
                         cp.from_dlpack(nk.view(torch.int16)).view(k.dtype), cos, sin, positions=pos)

        rows.append(_row(QKNORM_TWO_STEP, measure(ctx, [two_step], None, small, 1),
                         "torch.nn.functional.rms_norm on q and on k, then RopePlan in place: three launches or more"))
    try:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb
    except Exception as exc:
        rows.append(_row("torch (Hugging Face's Qwen3 path)", {}, "", f"skip: {type(exc).__name__}"))
        return rows
    q_norm, k_norm = Qwen3RMSNorm(d, eps=QKNORM_EPS), Qwen3RMSNorm(d, eps=QKNORM_EPS)
    q_norm.weight.data = tqw.clone()
    k_norm.weight.data = tkw.clone()
    tcos, tsin = torch.from_dlpack(cos), torch.from_dlpack(sin)
    tpos = torch.from_dlpack(pos)
    c = torch.cat([tcos[tpos], tcos[tpos]], dim=-1)[None].to(torch.bfloat16)  # [1, T, d], once per step
    s = torch.cat([tsin[tpos], tsin[tpos]], dim=-1)[None].to(torch.bfloat16)
    qv, kv = tq[None], tk[None]  # [1, T, H, d]

    def hf():
        return apply_rotary_pos_emb(q_norm(qv).transpose(1, 2), k_norm(kv).transpose(1, 2), c, s)

    rows.append(_row("torch (Hugging Face's Qwen3 path)", _timed_torch(ctx, measure, torch, hf, small),
                     "Qwen3RMSNorm on q and k heads, then apply_rotary_pos_emb, eager", "-"))
    if ctx.peers.compiled.get("general") is not None:  # torch.compile is usable here
        try:
            compiled = torch.compile(hf, dynamic=False)
            compiled()
            rows.append(_row("torch.compile (Hugging Face's Qwen3 path)",
                             _timed_torch(ctx, measure, torch, compiled, small),
                             "torch.compile(dynamic=False) of the same path", "-"))
        except Exception as exc:
            rows.append(_row("torch.compile (Hugging Face's Qwen3 path)", {}, "",
                             f"skip: {type(exc).__name__}: {exc}"[:200]))
    return rows
