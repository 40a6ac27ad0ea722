"""Multimodal RoPE (three position streams, Qwen2-VL's and Qwen3-VL's sections) beside our plain
RoPE, a copy and its peers (Hugging Face's rotation, Liger's Qwen2-VL MRoPE kernel).
"""

from __future__ import annotations

import numpy as np

from ..cases import MROPE_OP, MROPE_PLAIN
from .records import _copy_row, _record, _row, _timed, _timed_torch

MROPE_HEADS = (28, 4, 128)   # Qwen2-VL-7B: Hq, Hkv, D
MROPE_SECTIONS = {False: (16, 24, 24), True: (24, 20, 20)}  # Qwen2-VL's contiguous, Qwen3-VL's interleaved
MROPE_DECODE_T = 8
MROPE_PREFILL_T = 16384


def mrope_bytes_moved(T: int) -> int:
    """q and k read and written (bf16), each table column read once from its stream's row (the
    bytes of one cos and one sin row), the three positions of each token."""
    hq, hk, d = MROPE_HEADS
    return T * (2 * (hq + hk) * d * 2 + d * 4 + 3 * 8)


def _liger_mrope():
    """Liger's ``LigerQwen2VLMRopeFunction.apply``, or None (its module alone when the package
    import fails, as the general peers load Liger's RoPE)."""
    try:
        from liger_kernel.ops.qwen2vl_mrope import LigerQwen2VLMRopeFunction

        return LigerQwen2VLMRopeFunction.apply
    except Exception:
        try:
            import importlib.util
            from pathlib import Path

            spec = importlib.util.find_spec("liger_kernel")
            path = Path(spec.origin).parent / "ops" / "qwen2vl_mrope.py"
            mspec = importlib.util.spec_from_file_location("_bench_liger_mrope", path)
            mod = importlib.util.module_from_spec(mspec)
            mspec.loader.exec_module(mod)
            return mod.LigerQwen2VLMRopeFunction.apply
        except Exception:
            return None


def mrope_ident(T: int, interleaved: bool) -> str:
    return (f"engine/mrope-{'decode' if T <= 64 else 'prefill'}/{'interleaved' if interleaved else 'contiguous'}"
            f"/bf16/thd/T={T}")


def _mrope_record(ctx, measure, copy_runner, T: int, interleaved: bool) -> dict:
    """Multimodal RoPE, Qwen2-VL-7B's heads, Qwen2-VL's contiguous or Qwen3-VL's interleaved
    sections, bf16 thd, q and k in place; beside our plain RoPE on the same arrays (positions
    [T]), a copy, and the peers (Hugging Face's rotation with the recombined cos/sin; Liger's
    Qwen2-VL MRoPE kernel, contiguous sections only)."""
    import cupy as cp
    import ml_dtypes

    import rope_rtc
    from rope_rtc.numerics.reference import mrope_reference

    from ..buffers import tolerance_check
    from ..cases import Wrong

    hq, hk, d = MROPE_HEADS
    small = T <= 64
    moved = mrope_bytes_moved(T)
    section = MROPE_SECTIONS[interleaved]
    ident = mrope_ident(T, interleaved)
    rec = _record(ident, {"T": T, "dtype": "bfloat16", "Hq": hq, "Hkv": hk, "D": d, "section": list(section),
                          "interleaved_sections": interleaved, "layout": "thd", "in_place": True}, moved)
    print(f"\n[{ident}] {moved / 1e6:.2f} MB moved", flush=True)
    rng = np.random.default_rng(ctx.seed)
    rows = 32768
    qh = rng.standard_normal((T, hq, d)).astype(ml_dtypes.bfloat16)
    kh = rng.standard_normal((T, hk, d)).astype(ml_dtypes.bfloat16)
    pos_h = rng.integers(0, rows, (3, T)).astype(np.int64)
    q, k, pos = cp.asarray(qh), cp.asarray(kh), cp.asarray(pos_h)
    cos, sin = rope_rtc.rope_tables(rows, d, xp=cp)
    rec["rows"].append(_copy_row(cp, ctx, measure, copy_runner, moved, small))
    n_check = min(T, 256)
    ref = [mrope_reference(h[:n_check], cp.asnumpy(cos), cp.asnumpy(sin), pos_h[:, :n_check], section,
                           interleaved_sections=interleaved) for h in (qh, kh)]

    def checked(outs, strict):
        worst = 0.0
        for out, want, h in zip(outs, ref, (qh, kh)):
            got = np.asarray(out[:n_check]).astype(np.float32)
            worst = max(worst, tolerance_check(got, want, h[:n_check], False, "bfloat16"))
        return "ok (bound of the general API)" if strict else f"ok ({worst:.2f} of tol)"

    plan = rope_rtc.MRopePlan(q, k, cos, sin, pos, section, interleaved_sections=interleaved).compile()
    pos0 = pos[0]  # one view for every call: the plain plan's same-arrays path
    plain = rope_rtc.RopePlan(q, k, cos, sin, positions=pos0, layout="thd").compile()
    try:
        q1, k1 = q.copy(), k.copy()
        plan.execute(q1, k1, cos, sin, pos)
        check = checked((cp.asnumpy(q1), cp.asnumpy(k1)), True)
    except Wrong as exc:
        check = f"WRONG: {exc}"
    fns = [lambda: plan.execute(q, k, cos, sin, pos)]
    rec["rows"].append(_row(MROPE_OP, _timed(ctx, measure, fns, small),
                            "MRopePlan, in place", check))
    fns = [lambda: plain.execute(q, k, cos, sin, positions=pos0)]
    rec["rows"].append(_row(MROPE_PLAIN, _timed(ctx, measure, fns, small),
                            "RopePlan, one position stream", "-"))
    torch = ctx.peers.torch if ctx.peers is not None else None
    if torch is not None:  # on fresh copies of the inputs (the timed calls above rotated q and k in place)
        rec["rows"] += _mrope_peers(ctx, measure, torch, cp.asarray(qh), cp.asarray(kh), cos, sin, pos, small,
                                    checked, section, interleaved)
    for r in rec["rows"]:
        us = r["timings"].get("graph" if small else "cold", {}).get("us")
        print(f"  {r['impl']:<46} {'-' if us is None else f'{us:9.2f} µs'}  {r['check']}", flush=True)
    return rec


def _mrope_peers(ctx, measure, torch, q, k, cos, sin, pos, small: bool, checked, section, interleaved) -> list:
    """Hugging Face's rotation (cos/sin recombined by section once per step, as the model does,
    in bf16; out of place) and Liger's Qwen2-VL MRoPE kernel (in place; contiguous sections), on
    bshd memory seen as [1, H, T, D]."""
    from ...numerics.reference import mrope_streams
    from ..impls import to_torch

    T, hq, d = q.shape
    sec = list(section)
    tq, tk = to_torch(torch, q, "bfloat16"), to_torch(torch, k, "bfloat16")
    tpos = torch.from_dlpack(pos)
    tcos, tsin = torch.from_dlpack(cos), torch.from_dlpack(sin)
    # [3, 1, T, d]: each stream's rows, both halves (rotate_half's layout)
    c3 = torch.cat([tcos[tpos], tcos[tpos]], dim=-1)[:, None].to(torch.bfloat16)
    s3 = torch.cat([tsin[tpos], tsin[tpos]], dim=-1)[:, None].to(torch.bfloat16)
    # Each column from its stream (what the model's rotary embedding computes once per step).
    stream = torch.as_tensor(np.concatenate([mrope_streams(sec, d, interleaved_sections=interleaved)] * 2),
                             device=c3.device)
    cols = torch.arange(d, device=c3.device)
    c1, s1 = c3[stream, :, :, cols].permute(1, 2, 0), s3[stream, :, :, cols].permute(1, 2, 0)  # [1, T, d]
    hf_apply = ctx.peers.hf_apply
    rows = []
    qv, kv = tq[None].transpose(1, 2), tk[None].transpose(1, 2)  # [1, H, T, d] views

    def peer_check(run) -> str:
        """A peer's q and k outputs ([1, H, T, d] each) against the reference, or what went wrong."""
        try:
            return checked(tuple(o[0].transpose(0, 1).float().cpu().numpy() for o in run()), False)
        except Exception as exc:
            return f"WRONG: {type(exc).__name__}: {exc}"[:200]

    def hf():
        return hf_apply(qv, kv, c1, s1)

    check = peer_check(hf)  # before the timing: its first call, outside a graph capture
    rows.append(_row("torch (Hugging Face's rotation)", _timed_torch(ctx, measure, torch, hf, small),
                     "cos/sin recombined once per step, bf16, out of place", check))
    liger = None if interleaved else _liger_mrope()
    if interleaved:
        return rows
    if liger is None:
        rows.append(_row("liger (LigerQwen2VLMRopeFunction)", {}, "", "skip: not importable"))
        return rows
    lq, lk = tq.clone()[None].transpose(1, 2), tk.clone()[None].transpose(1, 2)

    def lg():
        return liger(lq, lk, c3, s3, sec)

    check = peer_check(lambda: liger(tq.clone()[None].transpose(1, 2), tk.clone()[None].transpose(1, 2), c3, s3, sec))
    rows.append(_row("liger (LigerQwen2VLMRopeFunction)", _timed_torch(ctx, measure, torch, lg, small),
                     "Triton, in place, cos/sin [3, 1, T, D] bf16", check))
    return rows
