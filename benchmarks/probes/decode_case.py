"""The decode case (q [T, 32, 128], k [T, 8, 128], ``thd``, random positions into an 8192-row
table, in place) beside the bounds of its access pattern, and for Nsight Compute.

    PYTHONPATH=. python3 benchmarks/probes/decode_case.py bounds [T ...]
        GPU µs per call under graph replay (200 calls per graph) of: a copy node of the same
        bytes (cudaMemcpyAsync, what the benchmark's target compares with); an empty kernel (a
        kernel node's floor); a kernel that loads and stores q and k in place, 16 bytes a thread
        (what the bytes cost in a kernel); the same kernel that also loads each token's position
        and then a 16-byte slice of the cos and sin rows it names before storing (the dependent
        chain RoPE adds); the plan, bf16 and fp16; and the plan given the step's tables instead
        of positions (cos and sin gathered at the positions once per step, as Hugging Face
        computes them once for all layers and as the benchmark's peers receive them).
    PYTHONPATH=. python3 benchmarks/probes/decode_case.py ncu T
        two launches each of the plan, the touch kernels and the empty kernel, for
        ncu -k regex:'rope_fixed|decode_' --set full ...
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
from probe_timing import graph_us

HQ, HK, D, ROWS = 32, 8, 128, 8192

# One thread per 16-byte vector of q then k (token-major, heads head_dim apart); chain = 1 adds
# the position load and the table loads RoPE's rotation waits for.
_KERNELS = r"""
extern "C" __global__ void decode_empty() {}

extern "C" __global__ void __launch_bounds__(128) decode_touch(uint4* q, uint4* k, const int* pos, const float4* cos,
                                                               const float4* sin, unsigned q_vectors, unsigned total,
                                                               int chain) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    uint4* p = i < q_vectors ? q + i : k + (i - q_vectors);
    uint4 v = __ldcs(p);
    if (chain) {
        // 16 vectors per head of 128 two-byte elements: 32 q heads, 8 k heads per token
        const unsigned t = i < q_vectors ? i / (32 * 16) : (i - q_vectors) / (8 * 16);
        const int row = pos[t];
        const float4 c = __ldg(cos + row * 16 + (i & 15)), s = __ldg(sin + row * 16 + (i & 15));
        v.x ^= __float_as_uint(c.x * s.y);
    }
    __stcs(p, v);
}
"""


def _arrays(T: int, dtype):
    import cupy as cp

    import rope_rtc

    rng = np.random.default_rng(0)
    q = cp.asarray(rng.standard_normal((T, HQ, D), dtype=np.float32).astype(dtype))
    k = cp.asarray(rng.standard_normal((T, HK, D), dtype=np.float32).astype(dtype))
    pos = cp.asarray(rng.integers(0, ROWS, T).astype(np.int32))
    cos, sin = rope_rtc.rope_tables(ROWS, D, xp=cp)
    plan = rope_rtc.RopePlan(q, k, cos, sin, layout="thd", positions=pos).compile()
    return plan, (q, k, cos, sin, pos)


def _step_tables(q, k, cos, sin, pos):
    """The plan on the step's own tables: rows ``cos[pos]``, ``sin[pos]``, token t at row t."""
    import cupy as cp

    import rope_rtc

    scos, ssin = cp.ascontiguousarray(cos[pos]), cp.ascontiguousarray(sin[pos])
    plan = rope_rtc.RopePlan(q, k, scos, ssin, layout="thd").compile()
    return lambda: plan.execute(q, k, scos, ssin)


def _calls(T: int, dtype) -> dict:
    import cupy as cp

    mod = cp.RawModule(code=_KERNELS)
    empty, touch = mod.get_function("decode_empty"), mod.get_function("decode_touch")
    plan, (q, k, cos, sin, pos) = _arrays(T, dtype)
    qv, total = q.nbytes // 16, (q.nbytes + k.nbytes) // 16
    grid = (-(-total // 128), 1, 1)
    moved = 2 * (q.nbytes + k.nbytes)
    src, dst = cp.empty(moved // 2, cp.uint8), cp.empty(moved // 2, cp.uint8)

    def touch_call(chain):
        return lambda: touch(grid, (128,), (q, k, pos, cos, sin, np.uint32(qv), np.uint32(total), np.int32(chain)))

    return moved, {
        "copy node (same bytes)": lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, moved // 2, 3,
                                                                      cp.cuda.get_current_stream().ptr),
        "empty kernel": lambda: empty((1,), (32,), ()),
        "touch q, k in place": touch_call(0),
        "touch + position -> table chain": touch_call(1),
        "RopePlan.execute": lambda: plan.execute(q, k, cos, sin, positions=pos),
        "RopePlan.execute, the step's tables": _step_tables(q, k, cos, sin, pos),
    }


def bounds(sizes: list[int]) -> None:
    for dtype in (ml_dtypes.bfloat16, np.float16):
        for T in sizes:
            moved, calls = _calls(T, dtype)
            copy = None
            for name, fn in calls.items():
                us = min(graph_us(fn) for _ in range(3))
                copy = copy or us
                print(f"{np.dtype(dtype).name:<8} T={T:<3} {name:<34} {us:6.2f} µs  {us / copy:5.2f}x the copy node",
                      flush=True)


def ncu(T: int) -> None:
    import cupy as cp

    _, calls = _calls(T, ml_dtypes.bfloat16)
    for name, fn in calls.items():
        if name.startswith("copy"):
            continue
        for _ in range(2):
            fn()
    cp.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    if sys.argv[1] == "ncu":
        ncu(int(sys.argv[2]))
    else:
        bounds([int(a) for a in sys.argv[2:]] or [1, 4, 16, 64])
