"""Quick kernel-vs-copy probe used while tuning (the benchmark proper is scripts/bench.py).

Cold L2: rotate among buffer sets totalling > 4x L2. Prints % of a same-size device copy.
"""
import cupy as cp
import numpy as np
import ml_dtypes
import rope_rtc
from rope_rtc.tail import TailRoPEForward

L2 = cp.cuda.Device().attributes["L2CacheSize"]


def timed(fn, n_sets, reps=30):
    for i in range(3 * n_sets):
        fn(i % n_sets)
    s, e = cp.cuda.Event(), cp.cuda.Event()
    res = []
    for r in range(5):
        s.record()
        for i in range(reps):
            fn(i % n_sets)
        e.record(); e.synchronize()
        res.append(cp.cuda.get_elapsed_time(s, e) / reps * 1e3)
    return float(np.median(res))


def copy_time(nbytes_moved):
    n = nbytes_moved // 2
    sets = max(1, int(np.ceil(4 * L2 / (2 * n))) + 1)
    src = [cp.empty(n, cp.uint8) for _ in range(sets)]
    dst = [cp.empty(n, cp.uint8) for _ in range(sets)]
    st = cp.cuda.get_current_stream().ptr
    t = timed(lambda i: cp.cuda.runtime.memcpyAsync(dst[i].data.ptr, src[i].data.ptr, n, 3, st), sets)
    del src, dst
    return t


def tail_case(T, H, D, which=None):
    xb = T * H * D * 2
    moved = 2 * xb + 2 * T * 32 * 4
    sets = max(1, int(np.ceil(4 * L2 / moved)) + 1)
    rng = cp.random.default_rng(0)
    xs = [rng.standard_normal((T, H, D), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(sets)]
    cs = [cp.cos(rng.uniform(-5, 5, (T, 32))).astype(cp.float32) for _ in range(sets)]
    ss = [cp.sin(rng.uniform(-5, 5, (T, 32))).astype(cp.float32) for _ in range(sets)]
    os_ = [cp.empty_like(x) for x in xs]
    plan = TailRoPEForward(xs[0], cs[0], ss[0], os_[0]).check_support().compile()
    t = timed(lambda i: plan.execute(xs[i], cs[i], ss[i], os_[i]), sets)
    c = copy_time(moved)
    print(f"tail {T}x{H}x{D}: {t:8.2f} us  copy {c:8.2f} us  {100 * c / t:5.1f}% of copy  {moved / t / 1e3:7.1f} GB/s", flush=True)


def general_time(dtype, layout, interleaved, B, S, Hq, Hk, D):
    """(µs per fused q+k in-place RopePlan call with cold L2, bytes moved)."""
    dt = {"bf16": ml_dtypes.bfloat16, "fp32": np.float32, "fp16": np.float16}[dtype]
    shp = lambda H: (B, S, H, D) if layout == "bshd" else (B, H, S, D)
    esz = np.dtype(dt).itemsize
    moved = 2 * B * S * (Hq + Hk) * D * esz + 2 * B * S * (D // 2) * 4
    sets = max(1, int(np.ceil(4 * L2 / moved)) + 1)
    rng = cp.random.default_rng(1)
    qs = [rng.standard_normal(shp(Hq), dtype=cp.float32).astype(dt) for _ in range(sets)]
    ks = [rng.standard_normal(shp(Hk), dtype=cp.float32).astype(dt) for _ in range(sets)]
    cos, sin = rope_rtc.rope_tables(S, D, xp=cp)
    plan = rope_rtc.RopePlan(qs[0], ks[0], cos, sin, layout=layout, interleaved=interleaved).compile()
    t = timed(lambda i: plan.execute(qs[i], ks[i], cos, sin), sets)
    del qs, ks
    return t, moved


def blog_time(variant, B, S, H, D):
    """(µs per call of the blog's ``variant`` kernel, fp32 bhsd interleaved q+k in place, bytes moved)."""
    from rope_rtc.blog import prepare_blog_variant

    moved = 2 * 2 * B * H * S * D * 4 + 2 * S * (D // 2) * 4
    sets = max(1, int(np.ceil(4 * L2 / moved)) + 1)
    rng = cp.random.default_rng(1)
    qs = [rng.standard_normal((B, H, S, D), dtype=cp.float32) for _ in range(sets)]
    ks = [rng.standard_normal((B, H, S, D), dtype=cp.float32) for _ in range(sets)]
    cos, sin = rope_rtc.rope_tables(S, D, xp=cp)
    fns = [prepare_blog_variant(variant, qs[i], ks[i], cos, sin, q_out=qs[i], k_out=ks[i]) for i in range(sets)]
    t = timed(lambda i: fns[i](), sets)
    del qs, ks, fns
    return t, moved


def general_case(dtype, layout, interleaved, B, S, Hq, Hk, D):
    t, moved = general_time(dtype, layout, interleaved, B, S, Hq, Hk, D)
    c = copy_time(moved)
    print(f"rope {dtype} {layout} il={interleaved} B{B} S{S} H{Hq}/{Hk} D{D}: {t:8.2f} us  copy {c:8.2f} us  {100 * c / t:5.1f}%  {moved / t / 1e3:7.1f} GB/s", flush=True)


if __name__ == "__main__":
    for shp in [(16384, 64, 512), (4096, 64, 512), (4096, 32, 128), (16384, 1, 512), (4096, 1, 512), (1, 64, 512)]:
        tail_case(*shp)
    for args in [("fp32", "bhsd", True, 4, 4096, 32, 32, 128), ("bf16", "bshd", False, 4, 4096, 32, 32, 128),
                 ("bf16", "bhsd", False, 4, 4096, 32, 32, 128), ("fp32", "bshd", False, 4, 16384, 32, 32, 128),
                 ("bf16", "bshd", False, 4, 512, 32, 32, 128), ("bf16", "bshd", False, 1, 1, 32, 8, 128)]:
        general_case(*args)


def graph_time(fn, n=200, reps=7):
    """µs per call of ``fn()`` replayed as a CUDA graph of ``n`` back-to-back calls (hot L2)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        for _ in range(n):
            fn()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        s, e = cp.cuda.Event(), cp.cuda.Event()
        res = []
        for _ in range(reps):
            s.record(stream)
            graph.launch(stream)
            e.record(stream)
            e.synchronize()
            res.append(cp.cuda.get_elapsed_time(s, e) / n * 1e3)
    return float(np.median(res))


def decode_probe(T, Hq=32, Hk=8, D=128, rows=8192):
    """Decode under graph replay: positions array vs a pre-gathered table (Liger's input) vs a copy."""
    rng = cp.random.default_rng(2)
    q = rng.standard_normal((T, Hq, D), dtype=cp.float32).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((T, Hk, D), dtype=cp.float32).astype(ml_dtypes.bfloat16)
    cos, sin = rope_rtc.rope_tables(rows, D, xp=cp)
    pos = cp.asarray(np.random.default_rng(3).integers(0, rows, T), dtype=cp.int32)
    plan = rope_rtc.RopePlan(q, k, cos, sin, positions=pos, layout="thd").compile()
    t_pos = graph_time(lambda: plan.execute(q, k, cos, sin, pos))
    gc, gs = cp.ascontiguousarray(cos[pos]), cp.ascontiguousarray(sin[pos])
    plan_g = rope_rtc.RopePlan(q, k, gc, gs, layout="thd").compile()
    t_g = graph_time(lambda: plan_g.execute(q, k, gc, gs))
    n = (q.nbytes + k.nbytes)
    src, dst = cp.empty(n, cp.uint8), cp.empty(n, cp.uint8)
    t_c = graph_time(lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n, 3,
                                                         cp.cuda.get_current_stream().ptr))
    return t_pos, t_g, t_c


def configure_general(variant):
    """Point rope_rtc's general kernel at a tuning variant: 'default' (what ships), or
    'hb=N[,minb=N][,nc=0|1][,vecbytes=N][,tile=warp|N]' (heads per thread, a register bound
    through __launch_bounds__, tables through the read-only path or not, narrower vectors,
    tokens per tile when tokens are the denser axis)."""
    from rope_rtc import registry, rope, rope_launch, rope_plan

    names = ("rope_spec", "rope_head_batch", "rope_head_batches", "rope_vector_widths", "token_tile")
    if not hasattr(configure_general, "production"):  # every module-level binding of each name
        configure_general.production = {(m, n): getattr(m, n) for m in (rope, rope_launch, rope_plan)
                                         for n in names if hasattr(m, n)}
    production = configure_general.production
    for (m, n), v in production.items():
        setattr(m, n, v)

    def use(name, value):
        for (m, n) in production:
            if n == name:
                setattr(m, n, value)

    spec, widths, tile = registry.rope_spec, registry.rope_vector_widths, production[(rope_launch, "token_tile")]
    if variant == "default":
        return
    opts = dict(kv.split("=") for kv in variant.split(","))
    if "tile" in opts:  # tokens per tile where tokens are the denser axis: 'warp' (32 threads) or N
        n = opts["tile"]
        use("token_tile", lambda req, units: (1 if tile(req, units) == 1 else min(
            req.num_tokens, max(1, 32 // units) if n == "warp" else int(n))))
    if "hb" not in opts:
        return
    hb = int(opts["hb"])
    extra = ((("ROPE_MIN_BLOCKS", opts["minb"]),) if "minb" in opts else ()) + \
        ((("ROPE_TABLE_NC", opts["nc"]),) if "nc" in opts else ())
    maxb = int(opts.get("vecbytes", 16))
    use("rope_vector_widths", lambda d, i: tuple(w for w in widths(d, i) if w * registry.ITEMSIZE[d] <= maxb))
    use("rope_spec", lambda d, i, v, head_batch=None: registry.KernelSpec(
        "rope", "rope.cu", registry.ROPE_ENTRIES, spec(d, i, v).defines[:3] + (("ROPE_HEAD_BATCH", str(hb)),) + extra))
    use("rope_head_batch", lambda interleaved, small=False, heads_inner=True: hb)
    use("rope_head_batches", lambda interleaved: (hb,))
