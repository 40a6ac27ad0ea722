"""Host cost of one launch of an empty 8-argument kernel through each path we could use.

Run on the device: PYTHONPATH=. python3 scripts/launch_cost.py. Prints microseconds per call
(median of 7 batches of 20000 calls). Used to choose rope_rtc's launch path (launch.py).
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
    from rope_rtc.tail import TailRoPEForward
    import numpy as np, ml_dtypes
    x = cp.asarray(np.random.default_rng(0).standard_normal((1, 64, 512)).astype(ml_dtypes.bfloat16))
    c = cp.ones((1, 32), cp.float32)
    s = cp.zeros((1, 32), cp.float32)
    o = cp.empty_like(x)
    plan = TailRoPEForward(x, c, s, o).check_support().compile()
    bench("rope_rtc TailRoPEForward.execute [1,64,512]", lambda: plan.execute(x, c, s, o))
    from rope_rtc.rope import RopePlan
    from rope_rtc.tables import rope_tables
    cos, sin = rope_tables(4096, 128, xp=cp)
    q = cp.asarray(np.random.default_rng(1).standard_normal((1, 1, 32, 128)).astype(ml_dtypes.bfloat16))
    kk = cp.asarray(np.random.default_rng(2).standard_normal((1, 1, 8, 128)).astype(ml_dtypes.bfloat16))
    rp = RopePlan(q, kk, cos, sin).compile()
    bench("rope_rtc RopePlan.execute decode [1,1,32|8,128]", lambda: rp.execute(q, kk, cos, sin, offset=7))


if __name__ == "__main__":
    main()
