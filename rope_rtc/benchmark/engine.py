"""The engine-interface section of the benchmark: RoPE fused with the paged KV-cache write
(``RopeCachePlan``, the input dtype and FP8) against the two-step sequence an engine would
otherwise run (our ``RopePlan``, then one scatter per cache) and a copy of the same bytes; and
ONNX ``RotaryEmbedding`` (``rope_rtc.onnx.rotary_embedding``) beside ``apply_rope`` on the same
tensor and a copy; multimodal RoPE (three streams) and a vision tower's axial RoPE (two streams,
Qwen2.5-VL's patches) beside a copy; DeepSeek-style MLA (``MlaRopeCachePlan``: RoPE on q's rotary
channels and on k_pe, the ``[kv_c | k_pe]`` cache row, model dtype and FP8) beside its two-step
sequence and a copy.

Each record is checked before it is timed: the fused launch's q, k and cache entries must equal,
bit for bit, what the two-step sequence writes (the kernels share their arithmetic), and ONNX's
output must equal ``apply_rope``'s on the same tables.
"""

from __future__ import annotations

import contextlib
from functools import partial

import numpy as np

from .cases import COPY, COPY_FP8, DTYPE_SHORT, ITEMSIZE, KV_FUSED as FUSED, KV_FUSED_FP8 as FUSED_FP8, KV_TWO_STEP as TWO_STEP
from .cases import MLA_FUSED, MLA_FUSED_FP8, MLA_TWO_STEP, MLA_TWO_STEP_FP8
from .cases import ANGLES_OP, ANGLES_TABLE, MROPE_OP, MROPE_PLAIN, ONNX_APPLY, ONNX_OP as ONNX, QKNORM_HF_NUMERICS, QKNORM_OP, QKNORM_TWO_STEP
from .cases import VISION_COMPILE
from .cases import selected
from .engine_jax import jax_records
from .impls import _cupy_capture

KV_HEADS = (32, 8, 128)   # Hq, Hkv, D
KV_BLOCK = 16             # tokens per cache block
KV_TABLE = 32768          # positions drawn below this (random, as prefix caching gives)
KV_DECODE_T = 8           # B=8 sequences, one token each
KV_PREFILL_T = 16384
MROPE_HEADS = (28, 4, 128)   # Qwen2-VL-7B: Hq, Hkv, D
MROPE_SECTIONS = {False: (16, 24, 24), True: (24, 20, 20)}  # Qwen2-VL's contiguous, Qwen3-VL's interleaved
MROPE_DECODE_T = 8
MROPE_PREFILL_T = 16384
VISION_HEADS = (16, 80)        # Qwen2.5-VL's vision tower: heads (q and k alike), head dim 80 (1280 / 16)
VISION_GRID = (1, 128, 128)    # one image of 128 x 128 patches: 16384 patches in merge order (2 x 2)
QKNORM_HEADS = (32, 8, 128)  # Qwen3-8B: Hq, Hkv, D
QKNORM_DECODE_T = 8
QKNORM_PREFILL_T = 16384
ANGLES_HEADS = (32, 8, 128)  # Llama-3-8B: Hq, Hkv, D
ANGLES_DECODE_T = 8          # B=8 sequences, one token each, positions anywhere below ANGLES_ROWS
ANGLES_PREFILL_T = 16384     # one sequence, positions 0 .. T-1
ANGLES_ROWS = 131072
QKNORM_EPS = 1e-6
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


def engine_jobs(quick: bool = False) -> list[tuple[str, str, tuple]]:
    """Every engine job: ``(name, record function of this module, its arguments after ctx,
    measure and copy_runner)``. ``engine/<name>`` is what ``--cases`` and ``--list`` match; the
    quick run measures fewer MLA decode sizes."""
    jobs = [(f"kv-cache-{label}/{DTYPE_SHORT[dtype]}/{'inter' if interleaved else 'half'}", "_kv_record",
             (label, T, dtype, interleaved))
            for label, T, dtype, interleaved in (("decode", KV_DECODE_T, "bfloat16", False),
                                                 ("prefill", KV_PREFILL_T, "bfloat16", False),
                                                 ("prefill", KV_PREFILL_T, "bfloat16", True),
                                                 ("prefill", KV_PREFILL_T, "float32", False))]
    jobs.append(("onnx", "_onnx_record", ()))
    jobs += [(f"mrope/T={T}", "_mrope_record", (T, interleaved))
             for interleaved in (False, True) for T in (MROPE_DECODE_T, MROPE_PREFILL_T)]
    jobs.append((f"vision/N={VISION_GRID[1] * VISION_GRID[2]}", "_vision_record", ()))
    jobs += [(f"qk-norm/T={T}", "_qk_norm_record", (T,)) for T in (QKNORM_DECODE_T, QKNORM_PREFILL_T)]
    jobs += [(f"angles/T={T}", "_angles_record", (T,)) for T in (ANGLES_DECODE_T, ANGLES_PREFILL_T)]
    jobs += [(mla_ident(T).removeprefix("engine/"), "_mla_record", (T,))
             for T in (MLA_PREFILL_T,) + (MLA_DECODE_T_QUICK if quick else MLA_DECODE_T)]
    jobs.append(("jax", "jax_records", ()))  # several records, from a child process (engine_jax)
    return jobs


def engine_job_selected(name: str, tokens: list[str] | None) -> bool:
    """``--cases``: ``engine`` (or a glob over it) selects every job, ``engine/<prefix>`` the jobs
    whose ``engine/<name>`` starts with it (``engine/angles``, ``engine/kv-cache-prefill/bf16``,
    ``engine/mla``)."""
    if selected("engine", "engine", tokens):
        return True
    return any(t.startswith("engine/") and f"engine/{name}".startswith(t) for t in tokens)


def run_engine_section(ctx, measure, copy_runner, tokens: list[str] | None = None) -> list[dict]:
    """Every selected engine record (``measure``/``copy_runner``: the runner's, passed in to keep
    imports one way; ``tokens``: ``--cases``, see :func:`engine_job_selected`)."""
    jobs = [(name, partial(globals()[fn], ctx, measure, copy_runner, *args))
            for name, fn, args in engine_jobs(bool(getattr(ctx, "quick", False))) if engine_job_selected(name, tokens)]
    recs = []
    for name, job in jobs:  # one failing record costs only itself
        try:
            got = job()
            recs.extend(got if isinstance(got, list) else [got])
        except Exception as exc:
            line = f"engine/{name} failed: {type(exc).__name__}: {exc}"[:400]
            print(line, flush=True)
            recs.append({"id": f"engine/{name}", "group": "engine", "params": {}, "bytes_moved": 0, "error": line,
                         "rows": []})
            with contextlib.suppress(Exception):
                ctx.stream.synchronize()
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
        if not small:  # the FP8 row's own same-size copy: a copy's rate depends on its size
            copy8 = copy_runner(cp, ctx.stream, moved8, 1)
            row = _row(COPY_FP8, measure(ctx, copy8.fns, None, False, 1), f"cudaMemcpyAsync of {copy8.half} bytes")
            row["bytes_moved"] = moved8
            rows.append(row)
            del copy8
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
        row8 = _row(FUSED_FP8, measure(ctx, fns8, _cupy_capture(ctx, fns8) if small else None, small, 1),
                    "entries of one byte", check8)
        row8["bytes_moved"] = moved8  # fewer bytes than the record's: GB/s and % of copy use these
        rows.append(row8)

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
    from rope_rtc.ops.onnx import rotary_embedding

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


def _mrope_record(ctx, measure, copy_runner, T: int, interleaved: bool) -> dict:
    """Multimodal RoPE, Qwen2-VL-7B's heads, Qwen2-VL's contiguous or Qwen3-VL's interleaved
    sections, bf16 thd, q and k in place; beside our plain RoPE on the same arrays (positions
    [T]), a copy, and the peers (Hugging Face's rotation with the recombined cos/sin; Liger's
    Qwen2-VL MRoPE kernel, contiguous sections only)."""
    import cupy as cp
    import ml_dtypes

    import rope_rtc
    from rope_rtc.numerics.reference import mrope_reference

    from .buffers import tolerance_check
    from .cases import Wrong

    hq, hk, d = MROPE_HEADS
    small = T <= 64
    label = "decode" if small else "prefill"
    moved = mrope_bytes_moved(T)
    section = MROPE_SECTIONS[interleaved]
    ident = f"engine/mrope-{label}/{'interleaved' if interleaved else 'contiguous'}/bf16/thd/T={T}"
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
    copy = copy_runner(cp, ctx.stream, moved, 1)
    rec["rows"].append(_row(COPY, measure(ctx, copy.fns, _cupy_capture(ctx, copy.fns) if small else None, small, 1),
                            f"cudaMemcpyAsync of {copy.half} bytes"))
    del copy
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
    rec["rows"].append(_row(MROPE_OP, measure(ctx, fns, _cupy_capture(ctx, fns) if small else None, small, 1),
                            "MRopePlan, in place", check))
    fns = [lambda: plain.execute(q, k, cos, sin, positions=pos0)]
    rec["rows"].append(_row(MROPE_PLAIN, measure(ctx, fns, _cupy_capture(ctx, fns) if small else None, small, 1),
                            "RopePlan, one position stream", "-"))
    torch = ctx.peers.torch if ctx.peers is not None else None
    if torch is not None:  # on fresh copies of the inputs (the timed calls above rotated q and k in place)
        rec["rows"] += _mrope_peers(ctx, measure, torch, cp.asarray(qh), cp.asarray(kh), cos, sin, pos, small,
                                    checked, section, interleaved)
    for r in rec["rows"]:
        us = r["timings"].get("graph" if small else "cold", {}).get("us")
        print(f"  {r['impl']:<46} {'-' if us is None else f'{us:9.2f} µs'}  {r['check']}", flush=True)
    return rec


def vision_bytes_moved(N: int) -> int:
    """q and k read and written (bf16), each table column read once from its axis's row (the bytes
    of one cos and one sin row), the two positions of each patch."""
    h, d = VISION_HEADS
    return N * (2 * 2 * h * d * 2 + d * 4 + 2 * 8)


def _vision_record(ctx, measure, copy_runner) -> dict:
    """A vision tower's axial RoPE: Qwen2.5-VL's heads and head dim 80 (not a power of two), its
    "same" frequencies (``axial_tables``) and patch order (``vision_positions``, merge size 2),
    bf16 [N, H, D] q and k in place, two position streams; beside a copy of the same bytes and
    torch.compile of transformers' vision rotary path as each layer runs it (:func:`_vision_peer`)."""
    import cupy as cp
    import ml_dtypes

    import rope_rtc
    from rope_rtc.numerics.reference import mrope_reference

    from .buffers import tolerance_check
    from .cases import Wrong

    heads, d = VISION_HEADS
    pos_h = rope_rtc.vision_positions([VISION_GRID], spatial_merge_size=2)
    N = pos_h.shape[1]
    moved = vision_bytes_moved(N)
    section = (d // 4, d // 4)
    ident = f"engine/vision-axial/bf16/thd/N={N}"
    rec = _record(ident, {"T": N, "dtype": "bfloat16", "Hq": heads, "Hkv": heads, "D": d, "section": list(section),
                          "layout": "thd", "in_place": True, "style": "same"}, moved)
    print(f"\n[{ident}] {moved / 1e6:.2f} MB moved", flush=True)
    rng = np.random.default_rng(ctx.seed)
    qh = rng.standard_normal((N, heads, d)).astype(ml_dtypes.bfloat16)
    kh = rng.standard_normal((N, heads, d)).astype(ml_dtypes.bfloat16)
    q, k, pos = cp.asarray(qh), cp.asarray(kh), cp.asarray(pos_h)
    cos, sin = rope_rtc.axial_tables(max(VISION_GRID[1:]), d, style="same", xp=cp)
    copy = copy_runner(cp, ctx.stream, moved, 1)
    rec["rows"].append(_row(COPY, measure(ctx, copy.fns, None, False, 1), f"cudaMemcpyAsync of {copy.half} bytes"))
    del copy
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

    from .buffers import tolerance_check
    from .cases import Wrong
    from .impls import to_torch

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


def _mrope_peers(ctx, measure, torch, q, k, cos, sin, pos, small: bool, checked, section, interleaved) -> list:
    """Hugging Face's rotation (cos/sin recombined by section once per step, as the model does,
    in bf16; out of place) and Liger's Qwen2-VL MRoPE kernel (in place; contiguous sections), on
    bshd memory seen as [1, H, T, D]."""
    from ..numerics.reference import mrope_streams
    from .impls import to_torch

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

    def hf():
        return hf_apply(qv, kv, c1, s1)

    try:
        oq, ok_ = hf()
        check = checked((oq[0].transpose(0, 1).float().cpu().numpy(), ok_[0].transpose(0, 1).float().cpu().numpy()),
                        False)
    except Exception as exc:
        check = f"WRONG: {type(exc).__name__}: {exc}"[:200]
    rows.append(_row("torch (Hugging Face's rotation)", measure(ctx, [hf], _torch_capture(ctx, torch, hf) if small
                                                                else None, small, 1),
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

    try:
        a, b = liger(tq.clone()[None].transpose(1, 2), tk.clone()[None].transpose(1, 2), c3, s3, sec)
        check = checked((a[0].transpose(0, 1).float().cpu().numpy(), b[0].transpose(0, 1).float().cpu().numpy()),
                        False)
    except Exception as exc:
        check = f"WRONG: {type(exc).__name__}: {exc}"[:200]
    rows.append(_row("liger (LigerQwen2VLMRopeFunction)", measure(ctx, [lg], _torch_capture(ctx, torch, lg) if small
                                                                  else None, small, 1),
                     "Triton, in place, cos/sin [3, 1, T, D] bf16", check))
    return rows


def _torch_capture(ctx, torch, fn):
    """Capture ``fn`` (torch work on the benchmark's stream) into a CUDA graph, as the general
    peers are captured."""
    from .timing import capture_torch

    def capture(indices):
        return capture_torch(torch, [fn for _ in indices])

    return capture


def qk_norm_bytes_moved(T: int) -> int:
    """q and k read and written (bf16), one cos and one sin row per token, the positions (the
    weights, read once, are left out)."""
    hq, hk, d = QKNORM_HEADS
    return T * (2 * (hq + hk) * d * 2 + d * 4 + 8)


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
    label = "decode" if small else "prefill"
    moved = qk_norm_bytes_moved(T)
    ident = f"engine/qk-norm-{label}/bf16/thd/T={T}"
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
    copy = copy_runner(cp, ctx.stream, moved, 1)
    rec["rows"].append(_row(COPY, measure(ctx, copy.fns, _cupy_capture(ctx, copy.fns) if small else None, small, 1),
                            f"cudaMemcpyAsync of {copy.half} bytes"))
    del copy
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
        rec["rows"].append(_row(impl, measure(ctx, fns, _cupy_capture(ctx, fns) if small else None, small, 1), note,
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

    from .impls import to_torch

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

    rows.append(_row("torch (Hugging Face's Qwen3 path)",
                     measure(ctx, [hf], _torch_capture(ctx, torch, hf) if small else None, small, 1),
                     "Qwen3RMSNorm on q and k heads, then apply_rotary_pos_emb, eager", "-"))
    if ctx.peers.compiled.get("general") is not None:  # torch.compile is usable here
        try:
            compiled = torch.compile(hf, dynamic=False)
            compiled()
            rows.append(_row("torch.compile (Hugging Face's Qwen3 path)",
                             measure(ctx, [compiled], _torch_capture(ctx, torch, compiled) if small else None, small,
                                     1), "torch.compile(dynamic=False) of the same path", "-"))
        except Exception as exc:
            rows.append(_row("torch.compile (Hugging Face's Qwen3 path)", {}, "",
                             f"skip: {type(exc).__name__}: {exc}"[:200]))
    return rows


def angles_bytes_moved(T: int, table: bool) -> int:
    """q and k read and written (bf16), each token's position; with tables, each token's cos and
    sin row (float32, rotary_dim / 2 each)."""
    hq, hk, d = ANGLES_HEADS
    return T * (2 * (hq + hk) * d * 2 + 8 + (d // 2 * 4 * 2 if table else 0))


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
    label = "decode" if small else "prefill"
    moved = angles_bytes_moved(T, table=False)
    ident = f"engine/angles-{label}/bf16/thd/T={T}"
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
    copy = copy_runner(cp, ctx.stream, moved, 1)
    rows.append(_row(COPY, measure(ctx, copy.fns, _cupy_capture(ctx, copy.fns) if small else None, small, 1),
                     f"cudaMemcpyAsync of {copy.half} bytes"))
    del copy
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
    rows.append(_row(ANGLES_OP, measure(ctx, fns, _cupy_capture(ctx, fns) if small else None, small, 1),
                     "float64 inv_freq, in place", check))
    fns = [lambda: table.execute(q, k, cos, sin, positions=pos)]
    row = _row(ANGLES_TABLE, measure(ctx, fns, _cupy_capture(ctx, fns) if small else None, small, 1),
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

        from .impls import to_torch

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
        rows = [_row(name, measure(ctx, [hf], _torch_capture(ctx, torch, hf) if small else None, small, 1),
                     "float32 angles per call, eager", "-")]
    except Exception as exc:
        return [_row(name, {}, "", f"skip: {type(exc).__name__}: {exc}"[:200])]
    if ctx.peers.compiled.get("general") is not None:  # torch.compile is usable here
        try:
            compiled = torch.compile(hf, dynamic=False)
            compiled()
            rows.append(_row(label, measure(ctx, [compiled], _torch_capture(ctx, torch, compiled) if small else None,
                                            small, 1), "torch.compile(dynamic=False)", "-"))
        except Exception as exc:
            rows.append(_row(label, {}, "", f"skip: {type(exc).__name__}: {exc}"[:200]))
    return rows


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

    def timed(fns):
        return measure(ctx, fns, _cupy_capture(ctx, fns) if small else None, small, 1)

    copy = copy_runner(cp, ctx.stream, moved, 1)
    rows.append(_row(COPY, timed(copy.fns), f"cudaMemcpyAsync of {copy.half} bytes"))
    del copy
    if not small:  # the FP8 rows' own same-size copy: a copy's rate depends on its size
        copy8 = copy_runner(cp, ctx.stream, moved8, 1)
        row = _row(COPY_FP8, timed(copy8.fns), f"cudaMemcpyAsync of {copy8.half} bytes")
        row["bytes_moved"] = moved8
        rows.append(row)
        del copy8

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
        row = _row(MLA_FUSED_FP8 if fp8 else MLA_FUSED, timed(fns), "in place, one launch", check)
        if fp8:
            row["bytes_moved"] = moved8  # fewer bytes than the record's: GB/s and % of copy use these
        rows.append(row)
        name = MLA_TWO_STEP_FP8 if fp8 else MLA_TWO_STEP
        row = (_row(name, timed(two_fns), "two launches: RoPE, then the cache write", two_check) if two_fns
               else _row(name, {}, "", two_check))
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
