"""What a programmatic dependent launch (``pdl=True``) saves per layer, under CUDA-graph replay:
a decode step's QKV projection (a cuBLAS GEMM, fp16, x [T, 4096] @ W [4096, 6144], torch) followed
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


def per_layer_us(torch, stream, step, layers: int = LAYERS, samples: int = 7) -> float:
    """GPU µs per layer of ``step(i)`` for i in range(layers), captured once into a graph on
    ``stream`` (torch's capture: CuPy refuses cuBLAS calls under capture)."""
    with torch.cuda.stream(stream):
        for i in range(layers):  # warm: compiles, loads, cuBLAS handles and workspaces
            step(i)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(layers):
            step(i)
    with torch.cuda.stream(stream):
        graph.replay()
        stream.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(samples):
            start.record(stream)
            for _ in range(10):
                graph.replay()
            end.record(stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / (10 * layers))
    return best


def main(sizes: list[int]) -> None:
    import cupy as cp
    import torch

    import rope_rtc

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    cos, sin = rope_rtc.rope_tables(ROWS, D, xp=cp)
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream
    for T in sizes:
        x = [torch.randn(T, HIDDEN, device="cuda", dtype=torch.float16) for _ in range(LAYERS)]
        w = torch.randn(HIDDEN, (HQ + 2 * HK) * D, device="cuda", dtype=torch.float16) / 64
        qkv_t = [torch.empty(T, (HQ + 2 * HK) * D, device="cuda", dtype=torch.float16) for _ in range(LAYERS)]
        qkv = [cp.from_dlpack(t) for t in qkv_t]  # the same memory
        q = [a[:, :HQ * D].reshape(T, HQ, D) for a in qkv]
        k = [a[:, HQ * D:(HQ + HK) * D].reshape(T, HK, D) for a in qkv]
        pos = cp.asarray(rng.integers(0, ROWS, T).astype(np.int32))
        plans = {pdl: rope_rtc.RopePlan(q[0], k[0], cos, sin, positions=pos, layout="thd", pdl=pdl).compile()
                 for pdl in (False, True)}
        cp.cuda.runtime.deviceSynchronize()

        def gemm(i):
            torch.matmul(x[i], w, out=qkv_t[i])

        def pair(pdl):
            def step(i):
                gemm(i)
                plans[pdl].execute(q[i], k[i], cos, sin, positions=pos, stream=handle)
            return step

        def rope_only(pdl):
            return lambda i: plans[pdl].execute(q[i], k[i], cos, sin, positions=pos, stream=handle)

        rows = {"GEMM alone": per_layer_us(torch, stream, gemm)}
        for pdl in (False, True):
            rows[f"GEMM, then RoPE{' (pdl)' if pdl else ''}"] = per_layer_us(torch, stream, pair(pdl))
        for pdl in (False, True):
            rows[f"RoPE alone, back to back{' (pdl)' if pdl else ''}"] = per_layer_us(torch, stream, rope_only(pdl))
        base = rows["GEMM alone"]
        for name, us in rows.items():
            extra = f"  RoPE adds {us - base:5.2f} µs" if name.startswith("GEMM, then") else ""
            print(f"T={T:<3} {name:<32} {us:7.2f} µs per layer{extra}", flush=True)
        saved = rows["GEMM, then RoPE"] - rows["GEMM, then RoPE (pdl)"]
        print(f"T={T:<3} pdl saves {saved:.2f} µs per layer ({saved * LAYERS:.1f} µs per 32-layer step)", flush=True)
        # bits: both builds on the same inputs
        with torch.cuda.stream(stream):
            gemm(0)
            ref = qkv_t[0].clone()
            plans[False].execute(q[0], k[0], cos, sin, positions=pos, stream=handle)
            plain = qkv_t[0].clone()
            qkv_t[0].copy_(ref)
            plans[True].execute(q[0], k[0], cos, sin, positions=pos, stream=handle)
        stream.synchronize()
        same = bool(torch.equal(qkv_t[0].view(torch.int16), plain.view(torch.int16)))
        print(f"T={T:<3} outputs bit for bit equal with and without pdl: {same}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 8, 64])
