"""Host cost of one launch through each launch path rope_rtc could use, beside the plans' execute().

On a GPU machine, from the repository root:

    PYTHONPATH=. python3 benchmarks/probes/launch_cost.py
    ROPE_RTC_NO_GRAPH_REPLAY=1 PYTHONPATH=. python3 benchmarks/probes/launch_cost.py   # plans without graph replay

Prints microseconds per call: the median of 7 tight loops of 20000 calls of an empty 8-argument
kernel through each path, then of the plans' execute() on decode-sized arrays. A tight loop
measures the host only while each launch takes the GPU less time than the host takes to issue it;
the host times the product reports come from the benchmark, which queues its calls behind a held
GPU (docs/performance.md, "How the benchmark measures").
"""
import ctypes
import statistics
import time

import cupy as cp
from cuda.bindings import driver as drv, nvrtc


SRC = b'extern "C" __global__ void empty8(long long a, long long b, long long c, long long d, long long e, long long f, long long g, long long h) {}'


def cubin() -> bytes:
    err, prog = nvrtc.nvrtcCreateProgram(SRC, b"empty.cu", 0, [], [])
    cc = cp.cuda.Device().compute_capability
    opts = [f"-arch=sm_{cc}".encode()]
    assert nvrtc.nvrtcCompileProgram(prog, 1, opts)[0] == 0
    _, n = nvrtc.nvrtcGetCUBINSize(prog)
    buf = b" " * n
    nvrtc.nvrtcGetCUBIN(prog, buf)
    return buf


def bench(label, fn, n=20000, reps=7):
    for _ in range(2000):
        fn()
    cp.cuda.runtime.deviceSynchronize()
    res = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        res.append((time.perf_counter() - t) / n * 1e6)
        cp.cuda.runtime.deviceSynchronize()
    print(f"{label:60s} {statistics.median(res):6.2f} us")


def main():
    cp.cuda.Device(0).use()
    cp.empty(1)  # initialise the runtime and primary context
    image = cubin()
    err, mod = drv.cuModuleLoadData(image)
    err, f = drv.cuModuleGetFunction(mod, b"empty8")
    vals = (ctypes.c_int64 * 8)(*range(8))
    ptrs = (ctypes.c_void_p * 8)(*(ctypes.addressof(vals) + 8 * i for i in range(8)))
    addr = ctypes.addressof(ptrs)
    sh = cp.cuda.get_current_stream().ptr
    st = drv.CUstream(sh)
    bench("cuda.bindings cuLaunchKernel, pre-packed void**", lambda: drv.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, st, addr, 0))
    bench("cuda.bindings cuLaunchKernel, tuple args", lambda: drv.cuLaunchKernel(
        f, 1, 1, 1, 32, 1, 1, 0, st, ((0, 1, 2, 3, 4, 5, 6, 7), (ctypes.c_int64,) * 8), 0))
    lib = ctypes.CDLL("libcuda.so.1")
    raw = lib.cuLaunchKernel
    raw.restype = ctypes.c_int
    fp = ctypes.c_void_p(int(f))
    one, t32, zero = ctypes.c_uint(1), ctypes.c_uint(32), ctypes.c_uint(0)
    sp = ctypes.c_void_p(sh)
    ap = ctypes.c_void_p(addr)
    bench("ctypes libcuda cuLaunchKernel, pre-built ctypes args", lambda: raw(fp, one, one, one, t32, one, one, zero, sp, ap, None))
    raw2 = lib.cuLaunchKernel
    typed = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(ctypes.cast(raw2, ctypes.c_void_p).value)
    fi = int(f)
    bench("ctypes CFUNCTYPE with int args", lambda: typed(fi, 1, 1, 1, 32, 1, 1, 0, sh, addr, None))
    k = cp.RawKernel(SRC.decode(), "empty8")
    args = tuple(cp.int64(i) for i in range(8))
    bench("cupy RawKernel", lambda: k((1,), (32,), args))
    cur = cp.cuda.get_current_stream()
    capture = cp.cuda.Stream(non_blocking=True)
    with capture:
        capture.begin_capture()
        drv.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, drv.CUstream(capture.ptr), addr, 0)
        graph = capture.end_capture()
    bench("cupy Graph.launch of a one-kernel-node graph", lambda: graph.launch(cur))
    src, dst = cp.empty(16, cp.uint8), cp.empty(16, cp.uint8)
    bench("cudaMemcpyAsync of 16 bytes (cupy runtime)",
          lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, 16, 3, cur.ptr))
    bench("cupy Stream.is_capturing()", cur.is_capturing)

    import ml_dtypes
    import numpy as np

    import rope_rtc

    x = cp.asarray(np.random.default_rng(0).standard_normal((1, 64, 512)).astype(ml_dtypes.bfloat16))
    c = cp.asarray(np.cos(np.random.default_rng(3).uniform(-3, 3, (1, 32))).astype(np.float32))
    s = cp.asarray(np.sin(np.random.default_rng(4).uniform(-3, 3, (1, 32))).astype(np.float32))
    o = cp.empty_like(x)
    plan = rope_rtc.TailRoPEForward(x, c, s, o).check_support().compile()
    bench("rope_rtc TailRoPEForward.execute [1,64,512], same arrays", lambda: plan.execute(x, c, s, o))
    cos, sin = rope_rtc.rope_tables(4096, 128, xp=cp)
    q = cp.asarray(np.random.default_rng(1).standard_normal((1, 1, 32, 128)).astype(ml_dtypes.bfloat16))
    kk = cp.asarray(np.random.default_rng(2).standard_normal((1, 1, 8, 128)).astype(ml_dtypes.bfloat16))
    rp = rope_rtc.RopePlan(q, kk, cos, sin, layout="bshd").compile()
    bench("rope_rtc RopePlan.execute decode [1,1,32|8,128], same arrays", lambda: rp.execute(q, kk, cos, sin, offset=7))


if __name__ == "__main__":
    main()
