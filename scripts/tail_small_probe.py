"""Where the small tail shapes and the execute() host time go (issue 4), on the GPU machine.

    PYTHONPATH=. python3 scripts/tail_small_probe.py [--part nodes|host|kernels|graphs|queue|all]

nodes: per-node GPU time under graph replay (1024 nodes, one buffer set each, as the benchmark's
       graph_cold rows) of a memcpy node, an empty kernel, a 16-byte copy kernel and variants of
       the tail kernel, for each small shape.
host:  host µs per call of the raw launch, a graph launch and the plans' execute (graph replay
       on and off), in a tight loop and in bursts of 100 from an idle GPU (the benchmark's method:
       the launch queue never fills), plus the pieces execute adds to the launch.
kernels: variants of the tail kernel against the production one (bit-identical outputs).
graphs: whether a graph launch works inside a caller's capture (it does not), and the cost of
       the capture queries.
queue: whether graph replays wait for the GPU (calls behind a 2 ms kernel), and each plan's host
       time in bursts of 10 and 100 against its GPU time per back-to-back launch: a plan whose
       graph takes the GPU longer than the host takes to launch it measures GPU time in long bursts.
"""
import argparse
import ctypes
import statistics
import time
from pathlib import Path

import cupy as cp
import ml_dtypes
import numpy as np
from cuda.bindings import driver as drv, nvrtc

from rope_rtc import driver
from rope_rtc.launch import ArgPack
from rope_rtc.tail import TailRoPEForward
from rope_rtc.toolchain import cuda_headers

ROOT = Path(__file__).resolve().parents[1]
SETS = 1024
KVARIANTS = ("vA", "vAP", "vBP", "vC64P")

VARIANTS = r"""
#include "common.cuh"
constexpr int HEAD_VECS = TAIL_DIM / 8;
constexpr int TAIL_START = (TAIL_DIM - 64) / 8;
constexpr unsigned ROW_VECS = (unsigned)TAIL_HEADS * HEAD_VECS;
__device__ __forceinline__ unsigned rot(unsigned w, float c, float s) {
    const float a = __uint_as_float(w << 16), b = __uint_as_float(w & 0xffff0000u);
    const float re = __fmaf_rn(a, c, -__fmul_rn(b, s));
    const float im = __fmaf_rn(b, c, __fmul_rn(a, s));
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(re)) | ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(im)) << 16);
}
extern "C" __global__ void empty5(const uint4*, uint4*, const float4*, const float4*, i64) {}
extern "C" __global__ void copy16(const uint4* __restrict__ x, uint4* __restrict__ o, const float4*, const float4*, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) o[i] = x[i];
}
// 32-bit indices (n < 2^31 vectors)
extern "C" __global__ void __launch_bounds__(256) tail32(const uint4* __restrict__ x, uint4* __restrict__ out,
        const float4* __restrict__ cosv, const float4* __restrict__ sinv, i64 n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned)n) return;
    uint4 v = x[i];
    const unsigned h = i & (HEAD_VECS - 1);
    if (h >= TAIL_START) {
        const unsigned tv = (i / ROW_VECS) * 8 + (h - TAIL_START);
        const float4 c = __ldg(cosv + tv), s = __ldg(sinv + tv);
        v.x = rot(v.x, c.x, s.x); v.y = rot(v.y, c.y, s.y); v.z = rot(v.z, c.z, s.z); v.w = rot(v.w, c.w, s.w);
    }
    out[i] = v;
}
__device__ __forceinline__ unsigned pack(float re, float im) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(re, im);  // one cvt.rn.bf16x2.f32 on sm_80+
    const __nv_bfloat162_raw r = h;
    return (unsigned)r.x | ((unsigned)r.y << 16);
}
template <bool PACK>
__device__ __forceinline__ unsigned rotw(unsigned w, float c, float s) {
    if (!PACK) return rot(w, c, s);
    const float a = __uint_as_float(w << 16), b = __uint_as_float(w & 0xffff0000u);
    return pack(__fmaf_rn(a, c, -__fmul_rn(b, s)), __fmaf_rn(b, c, __fmul_rn(a, s)));
}
// Table index first, table loads before the x load; ALL: every thread loads a table row.
template <typename I, bool PACK, bool ALL>
__device__ __forceinline__ void tail_first(const uint4* __restrict__ x, uint4* __restrict__ out,
        const float4* __restrict__ cosv, const float4* __restrict__ sinv, i64 n) {
    const I i = (I)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (I)n) return;
    const unsigned h = (unsigned)i & (HEAD_VECS - 1);
    const bool r = h >= TAIL_START;
    const I tv = (i / (I)ROW_VECS) * 8 + (r ? h - TAIL_START : 0);
    float4 c = make_float4(0.f, 0.f, 0.f, 0.f), s = c;
    if (ALL || r) { c = __ldg(cosv + tv); s = __ldg(sinv + tv); }
    uint4 v = x[i];
    if (r) { v.x = rotw<PACK>(v.x, c.x, s.x); v.y = rotw<PACK>(v.y, c.y, s.y); v.z = rotw<PACK>(v.z, c.z, s.z); v.w = rotw<PACK>(v.w, c.w, s.w); }
    out[i] = v;
}
#define VARIANT(name, I, P, A) extern "C" __global__ void __launch_bounds__(256) name(const uint4* __restrict__ x, \
    uint4* __restrict__ out, const float4* __restrict__ cosv, const float4* __restrict__ sinv, i64 n) { tail_first<I, P, A>(x, out, cosv, sinv, n); }
VARIANT(vA, unsigned, false, false)
VARIANT(vAP, unsigned, true, false)
VARIANT(vBP, unsigned, true, true)
VARIANT(vC64P, u64, true, false)
"""


def compile_variants(heads: int, dim: int):
    err, prog = nvrtc.nvrtcCreateProgram(VARIANTS.encode(), b"variants.cu", 0, [], [])
    cc = cp.cuda.Device().compute_capability
    opts = [f"-arch=sm_{cc}", "-std=c++17", f"-DTAIL_HEADS={heads}", f"-DTAIL_DIM={dim}",
            f"-I{ROOT / 'cuda_src'}", f"-I{cuda_headers().path}"]
    st = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])[0]
    if int(st):
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(log.decode())
    _, n = nvrtc.nvrtcGetCUBINSize(prog)
    buf = b" " * n
    nvrtc.nvrtcGetCUBIN(prog, buf)
    mod = driver.load_module(cp.cuda.Device().id, bytes(buf))
    return mod, {k: driver.get_function(mod, k) for k in ("empty5", "copy16", "tail32", *KVARIANTS)}


def Args(a, b, c, d, n) -> ArgPack:
    """The five 8-byte arguments every kernel here takes (pointers or unused, then a count)."""
    pack = ArgPack([(f, ctypes.c_uint64) for f in ("a", "b", "c", "d", "n")])
    v = pack.values
    v.a, v.b, v.c, v.d, v.n = a, b, c, d, n
    return pack


def launches(sh, f, args, n, block=256) -> list:
    """One launch callable per argument pack: ``n`` threads of ``f`` in blocks of ``block``."""
    grid = -(-n // block)
    return [lambda a=a: driver.check(drv.cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, sh, a.address, 0), "launch")
            for a in args]


def node_time(stream, launches) -> float:
    """µs per node of a graph of ``launches`` (callables that enqueue on ``stream``)."""
    with stream:
        stream.begin_capture()
        for f in launches:
            f()
        g = stream.end_capture()
    for _ in range(2):
        g.launch(stream)
    stream.synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    res = []
    for _ in range(7):
        s.record(stream)
        g.launch(stream)
        e.record(stream)
        e.synchronize()
        res.append(cp.cuda.get_elapsed_time(s, e) * 1e3 / len(launches))
    return statistics.median(res)


def nodes_part():
    stream = cp.cuda.Stream(non_blocking=True)
    sh = drv.CUstream(stream.ptr)
    shapes = [(1, 1, 128), (1, 1, 512), (1, 4, 128), (1, 8, 512), (1, 32, 128), (4, 1, 128), (4, 1, 512),
              (4, 4, 128), (4, 32, 128), (4, 8, 512), (1, 64, 512), (4, 64, 512)]
    print(f"{'shape':>12} {'KB':>6} | memcpy  empty1  empty  copyk256 copyk64 | tail256 tail128 tail64 tail32b | "
          f"tail256 same-out  (µs per node, {SETS} nodes, one set each)")
    rng = cp.random.default_rng(0)
    for T, H, D in shapes:
        mod, fn = compile_variants(H, D)
        xs = [rng.standard_normal((T, H, D), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(SETS)]
        tab = [cp.cos(rng.uniform(-5, 5, (2, T, 32))).astype(cp.float32) for _ in range(SETS)]
        outs = [cp.empty_like(x) for x in xs]
        moved = 2 * xs[0].nbytes + 2 * tab[0][0].nbytes
        half = moved // 2
        src = [cp.empty(half, cp.uint8) for _ in range(SETS)]
        dst = [cp.empty(half, cp.uint8) for _ in range(SETS)]
        plan = TailRoPEForward(xs[0], tab[0][0], tab[0][1], outs[0]).check_support().compile()
        tail_fn = plan._function
        nvec = xs[0].size // 8
        targs = [Args(x.data.ptr, o.data.ptr, t[0].data.ptr, t[1].data.ptr, nvec) for x, o, t in zip(xs, outs, tab)]
        same = [Args(x.data.ptr, outs[0].data.ptr, t[0].data.ptr, t[1].data.ptr, nvec) for x, t in zip(xs, tab)]
        cvec = -(-half // 16)
        cargs = [Args(s_.data.ptr, d_.data.ptr, 0, 0, half // 16) for s_, d_ in zip(src, dst)]

        def kl(f, block, args, n):
            return launches(sh, f, args, n, block)

        row = {}
        row["memcpy"] = node_time(stream, [lambda s_=s_, d_=d_: cp.cuda.runtime.memcpyAsync(d_.data.ptr, s_.data.ptr, half, 3, stream.ptr)
                                           for s_, d_ in zip(src, dst)])
        row["empty1"] = node_time(stream, kl(fn["empty5"], 32, targs, 1))
        row["empty"] = node_time(stream, kl(fn["empty5"], 256, targs, nvec))
        row["copyk256"] = node_time(stream, kl(fn["copy16"], 256, cargs, cvec))
        row["copyk64"] = node_time(stream, kl(fn["copy16"], 64, cargs, cvec))
        for b in (256, 128, 64):
            row[f"tail{b}"] = node_time(stream, kl(tail_fn, b, targs, nvec))
        row["tail32b"] = node_time(stream, kl(fn["tail32"], 128, targs, nvec))
        row["same"] = node_time(stream, kl(tail_fn, 256, same, nvec))
        print(f"{str((T, H, D)):>12} {moved / 1024:6.1f} | " + " ".join(f"{row[k]:6.3f}" for k in
              ("memcpy", "empty1", "empty", "copyk256", "copyk64")) + " | " +
              " ".join(f"{row[k]:6.3f}" for k in ("tail256", "tail128", "tail64", "tail32b")) + f" | {row['same']:6.3f}",
              flush=True)
        del xs, tab, outs, src, dst, plan
        cp.get_default_memory_pool().free_all_blocks()


def kernels_part():
    """Variants of the tail kernel: bit-identical output, node time (tiny shapes), cold rate (large)."""
    stream = cp.cuda.Stream(non_blocking=True)
    sh = drv.CUstream(stream.ptr)
    L2 = cp.cuda.Device().attributes["L2CacheSize"]
    rng = cp.random.default_rng(1)
    tiny = [(1, 1, 128), (1, 1, 512), (1, 4, 128), (1, 32, 128), (1, 8, 512), (4, 1, 128), (4, 4, 128), (4, 32, 128),
            (1, 64, 512), (4, 64, 512)]
    large = [(4096, 1, 128), (4096, 4, 128), (16384, 4, 128), (4096, 32, 128), (16384, 32, 128), (16384, 64, 512)]
    names = ("cur", *KVARIANTS)
    print("tail kernel variants: µs per graph node (tiny) / % of memcpy with cold L2 (large)")
    print(f"{'shape':>16} | memcpy copyk | " + " ".join(f"{n:>7}" for n in names))
    for T, H, D in tiny + large:
        mod, fn = compile_variants(H, D)
        big = (T, H, D) in large
        moved = 2 * T * H * D * 2 + 2 * T * 32 * 4
        sets = max(1, -(-4 * L2 // moved) + 1) if big else SETS
        xs = [rng.standard_normal((T, H, D), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(sets)]
        tab = [cp.cos(rng.uniform(-5, 5, (2, T, 32))).astype(cp.float32) for _ in range(sets)]
        outs = [cp.full(x.shape, cp.nan, x.dtype) for x in xs]
        half = moved // 2
        src = [cp.empty(half, cp.uint8) for _ in range(sets)]
        dst = [cp.empty(half, cp.uint8) for _ in range(sets)]
        plan = TailRoPEForward(xs[0], tab[0][0], tab[0][1], outs[0]).check_support().compile()
        fns = {"cur": plan._function, **{k: fn[k] for k in KVARIANTS}}
        nvec = xs[0].size // 8
        targs = [Args(x.data.ptr, o.data.ptr, t[0].data.ptr, t[1].data.ptr, nvec) for x, o, t in zip(xs, outs, tab)]
        cargs = [Args(s_.data.ptr, d_.data.ptr, 0, 0, half // 16) for s_, d_ in zip(src, dst)]

        def kl(f, args, n, block=256):
            return launches(sh, f, args, n, block)
        mc = [lambda s_=s_, d_=d_: cp.cuda.runtime.memcpyAsync(d_.data.ptr, s_.data.ptr, half, 3, stream.ptr)
              for s_, d_ in zip(src, dst)]
        # bit-identical to the production kernel (fills and compares on the launch stream)
        with stream:
            kl(fns["cur"], targs[:1], nvec)[0]()
            ref = outs[0].view(cp.uint16).copy()
            for k in KVARIANTS:
                outs[0].fill(cp.nan)
                kl(fns[k], targs[:1], nvec)[0]()
                if not bool((outs[0].view(cp.uint16) == ref).all()):
                    print(f"  {k}: OUTPUT DIFFERS", flush=True)
        if not big:
            row = [node_time(stream, mc), node_time(stream, kl(fn["copy16"], cargs, -(-half // 16)))]
            row += [node_time(stream, kl(fns[k], targs, nvec)) for k in names]
            print(f"{str((T, H, D)):>16} | " + " ".join(f"{v:6.3f}" for v in row), flush=True)
        else:
            def ev(launches, reps=5):
                with stream:
                    for f in launches * 2:
                        f()
                    s_, e_ = cp.cuda.Event(), cp.cuda.Event()
                    res = []
                    for _ in range(reps):
                        s_.record(stream)
                        for f in launches:
                            f()
                        e_.record(stream)
                        e_.synchronize()
                        res.append(cp.cuda.get_elapsed_time(s_, e_) * 1e3 / len(launches))
                return statistics.median(res)
            reps = max(1, 40 // sets)
            tm = ev(mc * reps)
            tc = ev(kl(fn["copy16"], cargs, -(-half // 16)) * reps)
            row = [100 * tm / ev(kl(fns[k], targs, nvec) * reps) for k in names]
            print(f"{str((T, H, D)):>16} | {tm:6.1f} {100 * tm / tc:5.1f}% | " + " ".join(f"{v:6.1f}%" for v in row), flush=True)
        del xs, tab, outs, src, dst, plan, targs, cargs
        cp.get_default_memory_pool().free_all_blocks()


def graphs_part():
    """Can a plan replay its launch as a one-node graph? Capture inside a caller's capture, cost."""
    from rope_rtc.reference import tail_rope_reference
    rt = cp.cuda.runtime
    rng = np.random.default_rng(3)
    xh = rng.standard_normal((4, 8, 128)).astype(ml_dtypes.bfloat16)
    ch = np.cos(rng.uniform(-3, 3, (4, 32))).astype(np.float32)
    sh_ = np.sin(rng.uniform(-3, 3, (4, 32))).astype(np.float32)
    x, c, s = cp.asarray(xh), cp.asarray(ch), cp.asarray(sh_)
    o = cp.full(x.shape, cp.nan, x.dtype)
    plan = TailRoPEForward(x, c, s, o).check_support().compile()
    plan.execute(x, c, s, o)
    prefix, addr = plan._last[5], plan._args.address
    priv = cp.cuda.Stream(non_blocking=True)
    _, old = drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    priv.begin_capture()
    driver.check(drv.cuLaunchKernel(*prefix, drv.CUstream(priv.ptr), addr, 0), "launch")
    g = priv.end_capture()
    drv.cuThreadExchangeStreamCaptureMode(old)
    ge = g.graphExec
    ok = lambda: bool((o.view(cp.uint16) == cp.asarray(tail_rope_reference(xh, ch, sh_)).view(cp.uint16)).all())
    o.fill(cp.nan)
    user = cp.cuda.Stream(non_blocking=True)
    rt.graphLaunch(ge, user.ptr)
    user.synchronize()
    print("plain graph launch exact:", ok())
    for mode, name in ((rt.streamCaptureModeRelaxed, "relaxed"), (rt.streamCaptureModeGlobal, "global"),
                       (rt.streamCaptureModeThreadLocal, "thread-local")):
        try:
            o.fill(cp.nan)
            cp.cuda.Device().synchronize()
            user.begin_capture(mode)
            rt.graphLaunch(ge, user.ptr)
            ug = user.end_capture()
            ug.launch(user)
            user.synchronize()
            print(f"graph launched inside a {name} capture: exact after replay: {ok()}")
        except Exception as exc:
            print(f"graph launched inside a {name} capture: {type(exc).__name__}: {exc}")
            try:
                user.end_capture()
            except Exception:
                pass
    # instantiating while the caller's stream is capturing in global mode (exchange to relaxed)
    try:
        user.begin_capture(rt.streamCaptureModeGlobal)
        _, old = drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        priv.begin_capture()
        driver.check(drv.cuLaunchKernel(*prefix, drv.CUstream(priv.ptr), addr, 0), "launch")
        g2 = priv.end_capture()
        drv.cuThreadExchangeStreamCaptureMode(old)
        user.end_capture()  # the caller's capture survived the instantiation
        o.fill(cp.nan)
        cp.cuda.Device().synchronize()
        rt.graphLaunch(g2.graphExec, priv.ptr)
        priv.synchronize()
        print("instantiate during another stream's global capture (mode exchanged): exact:", ok())
    except Exception as exc:
        print(f"instantiate during a global capture: {type(exc).__name__}: {exc}")
        if user.is_capturing():
            user.end_capture()
    cur = cp.cuda.get_current_stream()
    hp = cur.ptr
    isc = drv.cuStreamIsCapturing
    sobj = drv.CUstream(hp)
    for name, f in (("runtime.graphLaunch(exec, stream ptr)", lambda: rt.graphLaunch(ge, hp)),
                    ("cuStreamIsCapturing", lambda: isc(sobj)),
                    ("cupy Stream.is_capturing()", cur.is_capturing)):
        tight = per_call(f, 20000)
        burst = per_call(f, 20000, burst=100)
        print(f"  {name:48s} {tight[0]:6.2f}/{tight[1]:6.2f} | {burst[0]:6.2f}/{burst[1]:6.2f}", flush=True)


def per_call(fn, n, reps=9, burst=None):
    sync = cp.cuda.runtime.deviceSynchronize
    for _ in range(500):
        fn()
    sync()
    res = []
    for _ in range(reps):
        if burst:
            tot = 0.0
            for _ in range(n // burst):
                sync()
                t = time.perf_counter()
                for _ in range(burst):
                    fn()
                tot += time.perf_counter() - t
            res.append(tot / n * 1e6)
        else:
            sync()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            res.append((time.perf_counter() - t) / n * 1e6)
        sync()
    return statistics.median(res), min(res)


def gpu_us_per_call(fn, n: int) -> float:
    """GPU µs per call of ``n`` back-to-back calls (CUDA events on the current stream)."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    cp.cuda.runtime.deviceSynchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / n


def host_part():
    x = cp.asarray(np.random.default_rng(0).standard_normal((1, 64, 512)).astype(ml_dtypes.bfloat16))
    c = cp.ones((1, 32), cp.float32)
    s = cp.zeros((1, 32), cp.float32)
    o = cp.empty_like(x)
    plan = TailRoPEForward(x, c, s, o).check_support().compile()
    plan.execute(x, c, s, o)
    prefix = plan._last[5]
    addr = plan._args.address
    st = drv.CUstream(cp.cuda.get_current_stream().ptr)
    launch = drv.cuLaunchKernel
    raw = lambda: launch(*prefix, st, addr, 0)  # noqa: E731
    execute = lambda: plan.execute(x, c, s, o)  # noqa: E731
    gcs = cp.cuda.get_current_stream
    getdev = cp.cuda.runtime.getDevice

    class M:
        def m(self):
            return None
    mm = M().m
    from rope_rtc.rope import RopePlan
    from rope_rtc.tables import rope_tables
    cos, sin = rope_tables(4096, 128, xp=cp)
    q = cp.asarray(np.random.default_rng(1).standard_normal((1, 1, 32, 128)).astype(ml_dtypes.bfloat16))
    k = cp.asarray(np.random.default_rng(2).standard_normal((1, 1, 8, 128)).astype(ml_dtypes.bfloat16))
    rp = RopePlan(q, k, cos, sin).compile()
    # The same launch as a one-node CUDA graph, instantiated once (arguments frozen in it).
    cs = cp.cuda.Stream(non_blocking=True)
    with cs:
        cs.begin_capture()
        plan.execute(x, c, s, o)
        graph = cs.end_capture()
    cur = cp.cuda.get_current_stream()
    plain = TailRoPEForward(x, c, s, o).check_support().compile()
    plain._launch.replay = False
    rp_plain = RopePlan(q, k, cos, sin).compile()
    rp_plain._launch.replay = False
    sobj = drv.CUstream(cur.ptr)
    items = [
        ("TailRoPEForward.execute, graph replay off", lambda: plain.execute(x, c, s, o)),
        ("RopePlan.execute decode, graph replay off", lambda: rp_plain.execute(q, k, cos, sin, offset=7)),
        ("cuStreamIsCapturing (bindings)", lambda: drv.cuStreamIsCapturing(sobj)),
        ("cupy Stream.is_capturing()", cur.is_capturing),
        ("cupy runtime.streamIsCapturing(ptr)", lambda: cp.cuda.runtime.streamIsCapturing(cur.ptr)),
        ("cupy Graph.launch (one kernel node)", lambda: graph.launch(cur)),
        ("raw cuLaunchKernel, function as int", lambda: launch(int(prefix[0]), *prefix[1:], st, addr, 0)),
        ("cudaMemcpyAsync 16 B (cupy runtime)", lambda: cp.cuda.runtime.memcpyAsync(o.data.ptr, x.data.ptr, 16, 3, cur.ptr)),
        ("raw cuLaunchKernel (bindings, pre-packed)", raw),
        ("RopePlan.execute decode (same arrays, same offset)", lambda: rp.execute(q, k, cos, sin, offset=7)),
        ("TailRoPEForward.execute (same arrays)", execute),
        ("cupy.cuda.get_current_stream(0).ptr", lambda: gcs(0).ptr),
        ("cupy.cuda.get_current_stream().ptr", lambda: gcs().ptr),
        ("cupy.cuda.runtime.getDevice()", getdev),
        ("empty method call", mm),
    ]
    print("host µs per call: median/min of 9 | tight loop of 20000 | bursts of 100 from an idle GPU")
    for name, f in items:
        try:
            f()
        except Exception as exc:  # a path this binding version does not take
            print(f"  {name:48s} error: {exc}")
            continue
        tight = per_call(f, 20000)
        burst = per_call(f, 20000, burst=100)
        print(f"  {name:48s} {tight[0]:6.2f}/{tight[1]:6.2f} | {burst[0]:6.2f}/{burst[1]:6.2f}", flush=True)
    print(f"  GPU time per launch over 20000 back-to-back raw launches: {gpu_us_per_call(raw, 20000):.2f} µs")


def queue_part():
    spin = cp.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
        const long long t = clock64(); while (clock64() - t < cycles) {} }''', "spin")
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((1, 64, 512)).astype(ml_dtypes.bfloat16))
    c, s = cp.ones((1, 32), cp.float32), cp.zeros((1, 32), cp.float32)
    o, o2 = cp.empty_like(x), cp.empty_like(x)
    tail = TailRoPEForward(x, c, s, o).check_support().compile()
    plain = TailRoPEForward(x, c, s, o).check_support().compile()
    plain._launch.replay = False
    from rope_rtc.rope import RopePlan
    from rope_rtc.tables import rope_tables
    cos, sin = rope_tables(8192, 128, xp=cp)
    q = cp.asarray(rng.standard_normal((1, 32, 128)).astype(ml_dtypes.bfloat16))
    k = cp.asarray(rng.standard_normal((1, 8, 128)).astype(ml_dtypes.bfloat16))
    pos = cp.asarray(np.array([1234], np.int32))
    rp = RopePlan(q, k, cos, sin, positions=pos, layout="thd").compile()
    for _ in range(5):
        tail.execute(x, c, s, o), tail.execute(x, c, s, o2), plain.execute(x, c, s, o)
    cp.cuda.runtime.deviceSynchronize()
    print("calls issued behind a 2 ms kernel: host µs per call, and the first call that waited > 50 µs")
    for name, f in (("graph replay, one graph", lambda i: tail.execute(x, c, s, o)),
                    ("graph replay, two graphs alternating", lambda i: tail.execute(x, c, s, o if i % 2 else o2)),
                    ("cuLaunchKernel", lambda i: plain.execute(x, c, s, o))):
        for n in (100, 1000, 3000):
            spin((1,), (1,), (np.int64(4_000_000),))  # about 2 ms at 1.98 GHz
            t0 = time.perf_counter()
            marks = []
            for i in range(n):
                f(i)
                marks.append(time.perf_counter())
            steps = np.diff([t0] + marks)
            waited = np.flatnonzero(steps > 50e-6)
            cp.cuda.runtime.deviceSynchronize()
            print(f"  {name:38s} n={n:5d}: {(marks[-1] - t0) / n * 1e6:6.2f} µs/call, "
                  f"first wait at call {waited[0] if waited.size else None}")
    print("host µs per call in bursts of 10 | 100 (median/min of 9), and GPU µs per back-to-back call")
    for name, f in (("TailRoPEForward.execute", lambda: tail.execute(x, c, s, o)),
                    ("RopePlan.execute (decode, positions)", lambda: rp.execute(q, k, cos, sin, pos))):
        b10, b100 = per_call(f, 20000, burst=10), per_call(f, 20000, burst=100)
        print(f"  {name:38s} {b10[0]:6.2f}/{b10[1]:6.2f} | {b100[0]:6.2f}/{b100[1]:6.2f} | "
              f"GPU {gpu_us_per_call(f, 2000):.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="all", choices=("nodes", "host", "kernels", "graphs", "queue", "all"))
    a = ap.parse_args()
    if a.part in ("host", "all"):
        host_part()
    if a.part in ("nodes", "all"):
        nodes_part()
    if a.part in ("kernels", "all"):
        kernels_part()
    if a.part in ("graphs", "all"):
        graphs_part()
    if a.part in ("queue", "all"):
        queue_part()
