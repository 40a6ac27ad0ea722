"""``rope-rtc demo``: the blog's configuration on this GPU, checked and timed.

With a GPU: compile (or load) the kernels, run B=4, H=32, S=4096, D=128, FP32, interleaved,
``bhsd`` through the blog's ``baseline``, ``vectorized`` and ``fused`` kernels and the
production kernel (``auto``), check each against the float64 reference (max abs error
<= 1e-6, the blog's claim, and the project's own error bound), and print each one's
effective bandwidth beside a copy of the same size.

Without a GPU: warm the kernel cache for sm_90 (or ``--arch``), run the blog's worked
example on the NumPy backend, and say plainly that no GPU was found.

Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import numpy as np

# The blog's worked example: d = 4, base 100, position m = 2, x = [1, 2, 3, 4], interleaved pairs.
WORKED_DIM = 4
WORKED_BASE = 100.0
WORKED_POSITION = 2
WORKED_X = (1.0, 2.0, 3.0, 4.0)
# Exact to 5 decimals (cos/sin of 2.0 and 0.2 unrounded). The blog prints -2.2347, 0.0771,
# 2.1455, 4.5165: its last value comes from cos/sin rounded to four decimals.
WORKED_EXPECTED = (-2.23474, 0.07700, 2.14552, 4.51627)
WORKED_TOLERANCE = 1e-4

BLOG_SHAPE = dict(B=4, H=32, S=4096, D=128)
BLOG_MAX_ABS_ERROR = 1e-6
CHECK_HEADS = (0, 15, 31)     # every batch and position of these heads is compared
VARIANTS = ("baseline", "vectorized", "fused", "auto")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rope-rtc demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90", help="architecture to warm when there is no GPU (default sm_90)")
    p.add_argument("--cache-dir", help="kernel cache to warm (default: ROPE_RTC_CACHE_DIR or the user cache)")
    p.add_argument("--no-warm", action="store_true", help="without a GPU, skip warming the cache")
    return p.parse_args(argv)


def main(args: list[str] | argparse.Namespace | None = None) -> int:
    """Command-line arguments (a list), or the namespace ``rope-rtc demo`` parsed already."""
    ns = args if isinstance(args, argparse.Namespace) else parse_args(args)
    arch, cache_dir = getattr(ns, "arch", None) or "sm_90", getattr(ns, "cache_dir", None)
    from . import driver

    if driver.available():
        return gpu_demo()
    print(f"no GPU found ({driver.unavailable_reason() or 'no CUDA device'}): nothing to time on this machine.")
    status = 0
    if not getattr(ns, "no_warm", False):
        status |= warm_cache(arch, cache_dir)
    status |= worked_example()
    return status


# --------------------------------------------------------------------------------------------- CPU


def _tables(rows: int, dim: int, base: float = 10000.0, xp=np):
    try:
        from .tables import rope_tables

        return rope_tables(rows, dim, base=base, xp=xp)
    except ImportError:   # tables.py still in progress: the same formula, float64 then float32
        inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
        ang = np.outer(np.arange(rows, dtype=np.float64), inv)
        return xp.asarray(np.cos(ang).astype(np.float32)), xp.asarray(np.sin(ang).astype(np.float32))


def worked_example() -> int:
    from .rope import apply_rope

    cos, sin = _tables(WORKED_POSITION + 1, WORKED_DIM, base=WORKED_BASE)
    x = np.asarray(WORKED_X, np.float32).reshape(1, 1, 1, WORKED_DIM)
    out = apply_rope(x, cos, sin, offset=WORKED_POSITION, interleaved=True, layout="bshd",
                     backend="numpy").reshape(-1)
    diff = float(np.max(np.abs(out.astype(np.float64) - np.asarray(WORKED_EXPECTED))))
    good = diff <= WORKED_TOLERANCE
    print(f"\nthe blog's worked example: d={WORKED_DIM}, base={WORKED_BASE:g}, position m={WORKED_POSITION}, "
          f"x={list(WORKED_X)}, interleaved pairs, NumPy backend")
    print("  rope_rtc: [" + ", ".join(f"{v:.5f}" for v in out) + "]")
    print("  exact:    [" + ", ".join(f"{v:.5f}" for v in WORKED_EXPECTED) + "]")
    print(f"  max |difference| {diff:.1e}: {'ok' if good else 'FAILED'} (tolerance {WORKED_TOLERANCE:g})")
    return 0 if good else 1


def warm_cache(arch: str, cache_dir: str | None) -> int:
    """Compile every kernel for ``arch`` into the cache; 0 when every one is there."""
    from .toolchain import parse_arch
    from .warm import warm

    number = parse_arch(arch)
    print(f"\nwarming the kernel cache for sm_{number} (what a GPU machine will load without compiling)")
    t0 = time.perf_counter()
    try:
        rep = warm([number], cache_dir=cache_dir, jobs=None, progress=True)
    except Exception as exc:  # an architecture NVRTC lacks, an unusable cache: say so, run the rest
        print(f"  FAILED: {type(exc).__name__}: {exc}")
        return 1
    print(f"  {rep.compiled} compiled, {rep.cached} already cached, {len(rep.failed)} failed, in "
          f"{time.perf_counter() - t0:.1f} s: {rep.directory}")
    for line in rep.failure_lines():
        print(f"  {line}")
    return 0 if rep.ok else 1


# --------------------------------------------------------------------------------------------- GPU


def gpu_demo() -> int:
    import cupy as cp

    from .benchmark.cases import Case
    from .benchmark.runner import CopyRunner
    from .benchmark.timing import Clock
    from .reference import assert_rope_close, rope_reference

    B, H, S, D = (BLOG_SHAPE[k] for k in ("B", "H", "S", "D"))
    case = Case("blog", "float32", "bhsd", True, B, S, H, H, D)
    stream = cp.cuda.Stream(non_blocking=True)
    clock = Clock(cp, stream, quick=True)
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    print(f"rope_rtc demo on {name}: B={B} H={H} S={S} D={D}, FP32, interleaved pairs, bhsd, q and k together")
    with stream:
        rs = cp.random.RandomState(0)
        q = rs.standard_normal((B, H, S, D), dtype=cp.float32)
        k = rs.standard_normal((B, H, S, D), dtype=cp.float32)
        cos, sin = _tables(S, D, xp=cp)
        heads = list(CHECK_HEADS)
        qh, kh = _canonical(cp.asnumpy(q[:, heads])), _canonical(cp.asnumpy(k[:, heads]))
        cos_h, sin_h = cp.asnumpy(cos), cp.asnumpy(sin)
        positions = np.tile(np.arange(S), B)
        refs = [rope_reference(x, cos_h, sin_h, positions, interleaved=True) for x in (qh, kh)]
        copy = CopyRunner(cp, stream, case.bytes_moved(), 1)
        copy_us = clock.events(copy.fns)["us"]
        moved = case.bytes_moved()
        print(f"bytes moved per call {moved / 1e6:.1f} MB (q and k read and written, table rows read once); "
              f"a copy of that size: {copy_us:.1f} µs, {moved / copy_us / 1e3:.0f} GB/s")
        print(f"{'variant':<12}{'max |err|':>11}{'check':>8}{'µs':>10}{'GB/s':>9}{'% of copy':>11}")
        failures = 0
        for variant in VARIANTS:
            qo, ko = cp.empty_like(q), cp.empty_like(k)
            _run_variant(variant, q, k, cos, sin, qo, ko)
            stream.synchronize()
            err, verdict = 0.0, "ok"
            for out, x, ref in ((qo, qh, refs[0]), (ko, kh, refs[1])):
                got = _canonical(cp.asnumpy(out[:, heads]))
                err = max(err, float(np.max(np.abs(got.astype(np.float64) - ref))))
                try:
                    assert_rope_close(got, ref, x, interleaved=True)
                except AssertionError:
                    verdict = "BOUND"
            if err > BLOG_MAX_ABS_ERROR:
                verdict = "FAILED"
            failures += verdict != "ok"
            qq, kk = q.copy(), k.copy()
            fn = partial(_run_variant, variant, qq, kk, cos, sin, qq, kk)
            us = clock.events([fn])["us"]
            print(f"{variant:<12}{err:>11.1e}{verdict:>8}{us:>10.1f}{moved / us / 1e3:>9.0f}{100 * copy_us / us:>10.1f}%")
            del qo, ko, qq, kk
    print(f"checked: every batch and position of heads {heads} of q and k against the float64 reference "
          f"(max |err| <= {BLOG_MAX_ABS_ERROR:g}, the blog's claim, and the project's bound 2^-22 (|x0|+|x1|)); "
          "'auto' is the production kernel")
    return 1 if failures else 0


def _run_variant(variant: str, q, k, cos, sin, q_out, k_out) -> None:
    """One of the blog's kernels ("auto": the production kernel through apply_rope_qk)."""
    from .blog import prepare_blog_variant
    from .rope import apply_rope_qk

    if variant == "auto":
        apply_rope_qk(q, k, cos, sin, layout="bhsd", interleaved=True, q_out=q_out, k_out=k_out)
    else:
        prepare_blog_variant(variant, q, k, cos, sin, q_out=q_out, k_out=k_out)()


def _canonical(x_bhsd: np.ndarray) -> np.ndarray:
    """[B, h, S, D] -> [B*S, h, D], the reference's token-major form."""
    B, h, S, D = x_bhsd.shape
    return np.ascontiguousarray(x_bhsd.transpose(0, 2, 1, 3)).reshape(B * S, h, D)
