"""What a programmatic dependent launch (``pdl=True``) saves per layer, under CUDA-graph replay:
a decode step's QKV projection (a cuBLAS GEMM, fp16, x [T, 4096] @ W [4096, 6144], CuPy) followed
by RoPE in place on the q and k views of its output (32 q heads, 8 k heads, head dim 128, random
positions), as an engine runs it layer after layer.

    PYTHONPATH=. python3 benchmarks/probes/pdl_pair.py [T ...]

For each token count, GPU µs per layer of 32 layers captured in one graph: the GEMM alone, the
GEMM then RoPE, and the GEMM then RoPE with ``pdl=True``; then RoPE alone, back to back, with and
without (the kernel before each launch is the previous RoPE). The outputs of both RoPE builds are
compared bit for bit.
"""

from __future__ import annotations

import sys

import numpy as np

LAYERS, HIDDEN, HQ, HK, D, ROWS = 32, 4096, 32, 8, 128, 8192


def per_layer_us(stream, step, layers: int = LAYERS, samples: int = 7) -> float:
    """GPU µs per layer of ``step(i)`` for i in range(layers), captured once into a graph."""
    import cupy as cp

    with stream:
        for i in range(layers):  # warm: compiles, loads, cuBLAS handles
            step(i)
        stream.synchronize()
        stream.begin_capture()
        for i in range(layers):
            step(i)
        graph = stream.end_capture()
        graph.upload(stream)
        graph.launch(stream)
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        best = float("inf")
        for _ in range(samples):
            start.record(stream)
            for _ in range(10):
                graph.launch(stream)
            end.record(stream)
            end.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, end) * 1e3 / (10 * layers))
    return best


def main(sizes: list[int]) -> None:
    import cupy as cp

    import rope_rtc

    rng = np.random.default_rng(0)
    cos, sin = rope_rtc.rope_tables(ROWS, D, xp=cp)
    stream = cp.cuda.Stream(non_blocking=True)
    for T in sizes:
        x = [cp.asarray(rng.standard_normal((T, HIDDEN), dtype=np.float32).astype(np.float16)) for _ in range(LAYERS)]
        w = cp.asarray((rng.standard_normal((HIDDEN, (HQ + 2 * HK) * D), dtype=np.float32) / 64).astype(np.float16))
        qkv = [cp.empty((T, (HQ + 2 * HK) * D), np.float16) for _ in range(LAYERS)]
        q = [a[:, :HQ * D].reshape(T, HQ, D) for a in qkv]
        k = [a[:, HQ * D:(HQ + HK) * D].reshape(T, HK, D) for a in qkv]
        pos = cp.asarray(rng.integers(0, ROWS, T).astype(np.int32))
        plans = {pdl: rope_rtc.RopePlan(q[0], k[0], cos, sin, positions=pos, layout="thd", pdl=pdl).compile()
                 for pdl in (False, True)}

        def gemm(i):
            cp.matmul(x[i], w, out=qkv[i])

        def pair(pdl):
            def step(i):
                gemm(i)
                plans[pdl].execute(q[i], k[i], cos, sin, positions=pos, stream=stream)
            return step

        def rope_only(pdl):
            return lambda i: plans[pdl].execute(q[i], k[i], cos, sin, positions=pos, stream=stream)

        rows = {"GEMM alone": per_layer_us(stream, gemm)}
        for pdl in (False, True):
            rows[f"GEMM, then RoPE{' (pdl)' if pdl else ''}"] = per_layer_us(stream, pair(pdl))
        for pdl in (False, True):
            rows[f"RoPE alone, back to back{' (pdl)' if pdl else ''}"] = per_layer_us(stream, rope_only(pdl))
        base = rows["GEMM alone"]
        for name, us in rows.items():
            extra = f"  RoPE adds {us - base:5.2f} µs" if name.startswith("GEMM, then") else ""
            print(f"T={T:<3} {name:<32} {us:7.2f} µs per layer{extra}", flush=True)
        saved = rows["GEMM, then RoPE"] - rows["GEMM, then RoPE (pdl)"]
        print(f"T={T:<3} pdl saves {saved:.2f} µs per layer ({saved * LAYERS:.1f} µs per 32-layer step)", flush=True)
        # bits: both builds on the same inputs
        with stream:
            gemm(0)
            ref = qkv[0].copy()
            plans[False].execute(q[0], k[0], cos, sin, positions=pos, stream=stream)
            plain = qkv[0].copy()
            qkv[0][...] = ref
            plans[True].execute(q[0], k[0], cos, sin, positions=pos, stream=stream)
            stream.synchronize()
        same = bool((qkv[0].view(np.uint16) == plain.view(np.uint16)).all())
        print(f"T={T:<3} outputs bit for bit equal with and without pdl: {same}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8, 64])
