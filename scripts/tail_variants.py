"""Tail kernel tuning probe: unroll x1/x4/x8 and streaming cache hints, cold L2, vs same-size copy."""
import cupy as cp
import ml_dtypes
import numpy as np

from rope_rtc.launch import ArgPack, launch, load_kernel
from rope_rtc.registry import KernelSpec
import ctypes

L2 = cp.cuda.Device().attributes["L2CacheSize"]


def timed(fn, sets, reps=40):
    for i in range(2 * sets):
        fn(i % sets)
    s, e = cp.cuda.Event(), cp.cuda.Event()
    out = []
    for _ in range(5):
        s.record()
        for i in range(reps):
            fn(i % sets)
        e.record(); e.synchronize()
        out.append(cp.cuda.get_elapsed_time(s, e) / reps * 1e3)
    return float(np.median(out))


for T, H, D in [(16384, 64, 512), (4096, 64, 512), (4096, 32, 128), (16384, 1, 512)]:
    moved = 2 * T * H * D * 2 + 2 * T * 32 * 4
    sets = int(np.ceil(4 * L2 / moved)) + 1
    rng = cp.random.default_rng(0)
    xs = [rng.standard_normal((T, H, D), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(sets)]
    cs = [rng.uniform(-1, 1, (T, 32)).astype(cp.float32) for _ in range(sets)]
    os_ = [cp.empty_like(x) for x in xs]
    n = T * H * D // 8
    n_half = moved // 2
    src = [cp.empty(n_half, cp.uint8) for _ in range(sets)]
    dst = [cp.empty(n_half, cp.uint8) for _ in range(sets)]
    st = cp.cuda.get_current_stream().ptr
    copy = timed(lambda i: cp.cuda.runtime.memcpyAsync(dst[i].data.ptr, src[i].data.ptr, n_half, 3, st), sets)
    line = [f"{T}x{H}x{D} copy {copy:7.2f}us"]
    for streaming in (0, 1):
        spec = KernelSpec("tail", "tail_rope.cu", ("tail_rope_bf16_x1", "tail_rope_bf16_x4", "tail_rope_bf16_x8"),
                          (("TAIL_HEADS", str(H)), ("TAIL_DIM", str(D)), ("TAIL_STREAMING", str(streaming))))
        k = load_kernel(spec, 0)
        for u, name in ((1, "tail_rope_bf16_x1"), (4, "tail_rope_bf16_x4"), (8, "tail_rope_bf16_x8")):
            packs = []
            for i in range(sets):
                a = ArgPack([("x", ctypes.c_uint64), ("o", ctypes.c_uint64), ("c", ctypes.c_uint64), ("s", ctypes.c_uint64), ("n", ctypes.c_int64)])
                a.values.x, a.values.o, a.values.c, a.values.s, a.values.n = xs[i].data.ptr, os_[i].data.ptr, cs[i].data.ptr, cs[i].data.ptr, n
                packs.append(a)
            grid = -(-n // (256 * u))
            f = k.functions[name]
            t = timed(lambda i: launch(f, (grid, 1, 1), (256, 1, 1), st, packs[i].address), sets)
            line.append(f"s{streaming}x{u} {100 * copy / t:5.1f}%")
    print("  ".join(line), flush=True)
    del xs, cs, os_, src, dst
