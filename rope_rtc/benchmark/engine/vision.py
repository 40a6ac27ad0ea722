"""A vision tower's axial RoPE (two position streams, Qwen2.5-VL's patches) beside a copy and
torch.compile of transformers' vision rotary path.
"""

from __future__ import annotations

import numpy as np

from ..cases import MROPE_OP, VISION_COMPILE
from .records import _copy_row, _record, _row

VISION_HEADS = (16, 80)        # Qwen2.5-VL's vision tower: heads (q and k alike), head dim 80 (1280 / 16)
VISION_GRID = (1, 128, 128)    # one image of 128 x 128 patches: 16384 patches in merge order (2 x 2)


def vision_bytes_moved(N: int) -> int:
    """q and k read and written (bf16), each table column read once from its axis's row (the bytes
    of one cos and one sin row), the two positions of each patch."""
    h, d = VISION_HEADS
    return N * (2 * 2 * h * d * 2 + d * 4 + 2 * 8)


def vision_ident(N: int) -> str:
    return f"engine/vision-axial/bf16/thd/N={N}"


def _vision_record(ctx, measure, copy_runner) -> dict:
    """A vision tower's axial RoPE: Qwen2.5-VL's heads and head dim 80 (not a power of two), its
    "same" frequencies (``axial_tables``) and patch order (``vision_positions``, merge size 2),
    bf16 [N, H, D] q and k in place, two position streams; beside a copy of the same bytes and
    torch.compile of transformers' vision rotary path as each layer runs it (:func:`_vision_peer`)."""
    import cupy as cp
    import ml_dtypes

    import rope_rtc
    from rope_rtc.numerics.reference import mrope_reference

    from ..buffers import tolerance_check
    from ..cases import Wrong

    heads, d = VISION_HEADS
    pos_h = rope_rtc.vision_positions([VISION_GRID], spatial_merge_size=2)
    N = pos_h.shape[1]
    moved = vision_bytes_moved(N)
    section = (d // 4, d // 4)
    ident = vision_ident(N)
    rec = _record(ident, {"T": N, "dtype": "bfloat16", "Hq": heads, "Hkv": heads, "D": d, "section": list(section),
                          "layout": "thd", "in_place": True, "style": "same"}, moved)
    print(f"\n[{ident}] {moved / 1e6:.2f} MB moved", flush=True)
    rng = np.random.default_rng(ctx.seed)
    qh = rng.standard_normal((N, heads, d)).astype(ml_dtypes.bfloat16)
    kh = rng.standard_normal((N, heads, d)).astype(ml_dtypes.bfloat16)
    q, k, pos = cp.asarray(qh), cp.asarray(kh), cp.asarray(pos_h)
    cos, sin = rope_rtc.axial_tables(max(VISION_GRID[1:]), d, style="same", xp=cp)
    rec["rows"].append(_copy_row(cp, ctx, measure, copy_runner, moved, False))
    n_check = 256
    ref = [mrope_reference(h[:n_check], cp.asnumpy(cos), cp.asnumpy(sin), pos_h[:, :n_check], section)
           for h in (qh, kh)]
    plan = rope_rtc.MRopePlan(q, k, cos, sin, pos, section).compile()
    try:
        q1, k1 = q.copy(), k.copy()
        plan.execute(q1, k1, cos, sin, pos)
        for out, want, h in zip((q1, k1), ref, (qh, kh)):
            tolerance_check(cp.asnumpy(out[:n_check]).astype(np.float32), want, h[:n_check], False, "bfloat16")
        check = "ok (bound of the general API)"
    except Wrong as exc:
        check = f"WRONG: {exc}"
    fns = [lambda: plan.execute(q, k, cos, sin, pos)]
    rec["rows"].append(_row(MROPE_OP, measure(ctx, fns, None, False, 1), "MRopePlan, two streams, in place", check))
    rec["rows"].append(_vision_peer(ctx, measure, q, k, cos, sin, pos_h, section, n_check))
    for r in rec["rows"]:
        us = r["timings"].get("cold", {}).get("us")
        print(f"  {r['impl']:<46} {'-' if us is None else f'{us:9.2f} µs'}  {r['check']}", flush=True)
    return rec


def _vision_skip_reason(peers) -> str | None:
    """Why the vision row's torch.compile peer cannot run here, or None."""
    if peers is None or "torch.compile" not in peers.wanted:
        return "--peers excludes torch.compile"
    if peers.torch is None:
        return "PyTorch unusable here"
    if peers.compiled.get("general") is None:
        return "torch.compile unusable here"
    return None


def _vision_peer(ctx, measure, q, k, cos, sin, pos_h, section, n_check: int) -> dict:
    """torch.compile(dynamic=False) of transformers' vision rotary path as each layer of the tower
    runs it: ``apply_rotary_pos_emb_vision`` (Qwen2.5-VL's: q and k upcast to float32, ``x * cos +
    rotate_half(x) * sin``, cast back) on bf16 [N, H, D] q and k, with the tower's materialised
    float32 cos/sin [N, D] (made once per forward, outside the timing); out of place. Checked on
    the first tokens against the float64 reference within the general bound."""
    peers = getattr(ctx, "peers", None)
    reason = _vision_skip_reason(peers)
    if reason is not None:
        return _row(VISION_COMPILE, {}, "", f"skip: {reason}")
    import cupy as cp

    from rope_rtc.numerics.reference import mrope_reference

    from ..buffers import tolerance_check
    from ..cases import Wrong
    from ..impls import to_torch

    torch = peers.torch
    try:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision as hf_vision

        source = "transformers' apply_rotary_pos_emb_vision (Qwen2.5-VL)"
    except Exception as exc:
        def hf_vision(qq, kk, c, s):  # the same formula, transformers not importable
            def rotate_half(x):
                h = x.shape[-1] // 2
                return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

            dq, dk = qq.dtype, kk.dtype
            qq, kk = qq.float(), kk.float()
            c, s = c.unsqueeze(-2).float(), s.unsqueeze(-2).float()
            return (qq * c + rotate_half(qq) * s).to(dq), (kk * c + rotate_half(kk) * s).to(dk)

        source = f"the same formula inline (transformers not importable: {type(exc).__name__})"
    d = q.shape[-1]
    quarter = d // 4
    tcos, tsin = torch.from_dlpack(cos), torch.from_dlpack(sin)
    ph, pw = (torch.from_dlpack(cp.asarray(pos_h[i])) for i in range(2))
    # the tower's position_embeddings: [N, D] float32, h's columns then w's, twice (rotate_half's layout)
    c = torch.cat([tcos[ph, :quarter], tcos[pw, quarter:]], dim=-1)
    s = torch.cat([tsin[ph, :quarter], tsin[pw, quarter:]], dim=-1)
    c, s = torch.cat([c, c], dim=-1).contiguous(), torch.cat([s, s], dim=-1).contiguous()
    tq, tk = to_torch(torch, q, "bfloat16"), to_torch(torch, k, "bfloat16")

    def path():
        return hf_vision(tq, tk, c, s)

    try:
        compiled = torch.compile(path, dynamic=False)
        oq, ok_ = compiled()
        torch.cuda.synchronize()
    except Exception as exc:
        return _row(VISION_COMPILE, {}, "", f"skip: torch.compile failed: {type(exc).__name__}: {exc}"[:200])
    try:
        host_cos, host_sin = cp.asnumpy(cos), cp.asnumpy(sin)
        for out, x in ((oq, q), (ok_, k)):
            xh = cp.asnumpy(x[:n_check])
            want = mrope_reference(xh, host_cos, host_sin, pos_h[:, :n_check], section)
            tolerance_check(out[:n_check].float().cpu().numpy(), want, xh, False, "bfloat16")
        check = "ok (bound of the general API)"
    except Wrong as exc:
        check = f"WRONG: {exc}"
    del oq, ok_
    return _row(VISION_COMPILE, measure(ctx, [compiled], None, False, 1),
                f"torch.compile(dynamic=False) of {source} on q and k, float32 cos/sin [N, D], out of place", check)
