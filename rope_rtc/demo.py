"""``rope-rtc demo``: the blog's configuration on this GPU, checked and timed.

With a GPU: compile (or load) the kernels, run B=4, H=32, S=4096, D=128, FP32, interleaved,
``bhsd`` through the blog's ``baseline``, ``vectorized`` and ``fused`` kernels and the
production kernel (``auto``), check each against the float64 reference (max abs error
<= 1e-6, the blog's claim, and the project's own error bound), and print each one's
effective bandwidth beside a copy of the same size.

Without a GPU: run the blog's worked example and Hugging Face's ``rotate_half`` against
``apply_rope`` on the NumPy backend, say whether this machine can compile kernels, and how to
warm a cache for a GPU machine (``--warm`` does it here, for ``--arch``). Nothing is compiled
unless ``--warm`` asks, and nothing needs the CUDA toolchain (an installation without the
``cuda`` extra runs it too).

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

# The rotate_half comparison: [B, S, H, D] FP32; FP32 arithmetic against float64 stays far below this.
ROTATE_HALF_SHAPE = (1, 8, 2, 8)
ROTATE_HALF_TOLERANCE = 1e-5

BLOG_SHAPE = dict(B=4, H=32, S=4096, D=128)
BLOG_MAX_ABS_ERROR = 1e-6
CHECK_HEADS = (0, 15, 31)     # every batch and position of these heads is compared
VARIANTS = ("baseline", "vectorized", "fused", "auto")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """``rope-rtc demo``'s arguments, parsed by the command line's own parser (one definition)."""
    from .cli import build_parser

    return build_parser().parse_args(["demo", *(argv or [])])


def main(args: list[str] | argparse.Namespace | None = None) -> int:
    """Run the demo; returns the exit status.

    Parameters
    ----------
    args
        Command-line arguments (a list), or the namespace ``rope-rtc demo`` parsed already.
    """
    ns = args if isinstance(args, argparse.Namespace) else parse_args(args)
    arch, cache_dir = getattr(ns, "arch", None) or "sm_90", getattr(ns, "cache_dir", None)
    from .core import driver

    if driver.available():
        return gpu_demo()
    print(f"no GPU found: {driver.unavailable_reason() or 'no CUDA device'}; nothing to time on this machine; "
          "the examples run on the NumPy reference.")
    status = worked_example()
    status |= rotate_half_example()
    problem = toolchain_problem()
    if getattr(ns, "warm", False):
        status |= warm_cache(arch, cache_dir, problem)
    else:
        print_warm_hint(arch, problem)
    return status


# --------------------------------------------------------------------------------------------- CPU


def worked_example() -> int:
    """The blog's worked example on the NumPy backend; 0 when it matches the exact values."""
    from .ops.rope import apply_rope
    from .numerics.tables import rope_tables

    cos, sin = rope_tables(WORKED_POSITION + 1, WORKED_DIM, base=WORKED_BASE)
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


def rotate_half_example() -> int:
    """Hugging Face's ``rotate_half`` formula, written out here in float64, against
    ``apply_rope(..., interleaved=False)`` on the NumPy backend: half-split pairs are that
    formula. 0 when they agree."""
    from .ops.rope import apply_rope
    from .numerics.tables import rope_tables

    B, S, H, D = ROTATE_HALF_SHAPE
    x = np.random.default_rng(0).standard_normal(ROTATE_HALF_SHAPE).astype(np.float32)
    cos, sin = rope_tables(S, D)
    out = apply_rope(x, cos, sin, layout="bshd", interleaved=False, backend="numpy")
    # Hugging Face's tables repeat each frequency over both halves: [S, D].
    cos_full = np.concatenate([cos, cos], axis=-1).astype(np.float64)[None, :, None, :]
    sin_full = np.concatenate([sin, sin], axis=-1).astype(np.float64)[None, :, None, :]
    x64 = x.astype(np.float64)
    rotated = np.concatenate([-x64[..., D // 2:], x64[..., : D // 2]], axis=-1)  # rotate_half(x)
    expected = x64 * cos_full + rotated * sin_full
    diff = float(np.max(np.abs(out.astype(np.float64) - expected)))
    good = diff <= ROTATE_HALF_TOLERANCE
    print(f"\nHugging Face's x * cos + rotate_half(x) * sin against apply_rope(interleaved=False), "
          f"FP32 [B, S, H, D] = {list(ROTATE_HALF_SHAPE)}, NumPy backend")
    print(f"  max |difference| {diff:.1e}: {'ok' if good else 'FAILED'} (tolerance {ROTATE_HALF_TOLERANCE:g})")
    return 0 if good else 1


def toolchain_problem() -> str | None:
    """Why this installation cannot compile kernels (no NVRTC, no cuda-bindings: the ``cuda``
    extra is not installed), or None when it can."""
    from .errors import ToolchainError
    from .build.toolchain import nvrtc_version, supported_archs

    try:
        nvrtc_version()
        supported_archs()
    except ToolchainError as exc:
        return str(exc)
    return None


def print_warm_hint(arch: str, problem: str | None) -> None:
    """How to compile the kernels ahead of a GPU machine, one flag away."""
    if problem is not None:
        print(f"\nno CUDA toolchain here, so rope_rtc runs on the NumPy reference: {problem}\nWith the extra "
              "installed, `rope-rtc demo --warm` compiles the kernels into the cache.")
        return
    print(f"\nthe kernels are compiled on first use, or ahead: `rope-rtc demo --warm` compiles every kernel for "
          f"{arch} here (--arch picks another), `rope-rtc warm --model config.json` one model's; a GPU machine "
          "given that cache compiles nothing.")


def warm_cache(arch: str, cache_dir: str | None, problem: str | None = None) -> int:
    """Compile every registered kernel (the library's and the demo's) for ``arch`` into the cache;
    0 when every one is there."""
    from .build import registry
    from .build.toolchain import parse_arch
    from .warm import warm

    number = parse_arch(arch)
    print(f"\nwarming the kernel cache for sm_{number} (what a GPU machine will load without compiling)")
    if problem is not None:
        print(f"  cannot compile here: {problem}")
        return 1
    t0 = time.perf_counter()
    try:
        rep = warm([number], cache_dir=cache_dir, jobs=None, progress=True, specs=registry.all_specs())
    except Exception as exc:  # an architecture NVRTC lacks, an unusable cache: say so, run the rest
        print(f"  FAILED: {type(exc).__name__}: {exc}")
        return 1
    print(f"  {rep.compiled} compiled, {rep.cached} already cached, {len(rep.failed)} failed, in "
          f"{time.perf_counter() - t0:.1f} s: {rep.directory}")
    for line in rep.failure_lines():
        print(f"  {line}")
    return 0 if rep.ok else 1


# --------------------------------------------------------------------------------------------- GPU


def blog_bytes_moved(B: int, H: int, S: int, D: int) -> int:
    """q and k read and written (FP32), and the FP32 cos and sin rows of S positions read once."""
    return 2 * 2 * B * H * S * D * 4 + S * (D // 2) * 4 * 2


def gpu_demo() -> int:
    """The blog's configuration on the current GPU: each variant checked against the float64
    reference, then timed beside a same-size copy. 0 when every check passes."""
    import cupy as cp

    from .measure import CopyRunner, gpu_us
    from .numerics.reference import assert_rope_close, rope_reference
    from .numerics.tables import rope_tables

    B, H, S, D = (BLOG_SHAPE[k] for k in ("B", "H", "S", "D"))
    moved = blog_bytes_moved(B, H, S, D)
    stream = cp.cuda.Stream(non_blocking=True)
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    print(f"rope_rtc demo on {name}: B={B} H={H} S={S} D={D}, FP32, interleaved pairs, bhsd, q and k together")
    with stream:
        rs = cp.random.RandomState(0)
        q = rs.standard_normal((B, H, S, D), dtype=cp.float32)
        k = rs.standard_normal((B, H, S, D), dtype=cp.float32)
        cos, sin = rope_tables(S, D, xp=cp)
        heads = list(CHECK_HEADS)
        qh, kh = _canonical(cp.asnumpy(q[:, heads])), _canonical(cp.asnumpy(k[:, heads]))
        cos_h, sin_h = cp.asnumpy(cos), cp.asnumpy(sin)
        positions = np.tile(np.arange(S), B)
        refs = [rope_reference(x, cos_h, sin_h, positions, interleaved=True) for x in (qh, kh)]
        copy = CopyRunner(cp, stream, moved, 1)
        copy_us = gpu_us(cp, stream, copy.fns[0])
        print(f"bytes moved per call {moved / 1e6:.1f} MB (q and k read and written, table rows read once); "
              f"a copy of that size: {copy_us:.1f} µs, {moved / copy_us / 1e3:.0f} GB/s")
        print(f"{'variant':<12}{'max |err|':>11}{'check':>8}{'µs':>10}{'GB/s':>9}{'% of copy':>11}")
        failures = 0
        for variant in VARIANTS:
            qo, ko = cp.empty_like(q), cp.empty_like(k)
            _variant_call(variant, q, k, cos, sin, qo, ko)()
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
            us = gpu_us(cp, stream, _variant_call(variant, qq, kk, cos, sin, qq, kk))
            print(f"{variant:<12}{err:>11.1e}{verdict:>8}{us:>10.1f}{moved / us / 1e3:>9.0f}{100 * copy_us / us:>10.1f}%")
            del qo, ko, qq, kk
    print(f"checked: every batch and position of heads {heads} of q and k against the float64 reference "
          f"(max |err| <= {BLOG_MAX_ABS_ERROR:g}, the blog's claim, and the project's bound 2^-22 (|x0|+|x1|)); "
          "'auto' is the production kernel")
    return 1 if failures else 0


def _variant_call(variant: str, q, k, cos, sin, q_out, k_out):
    """A callable running one of the blog's kernels on these arrays, prepared once, so that a timed
    call only launches, as in the benchmark ("auto": the production kernel through the one-call
    ``apply_rope_qk``)."""
    from .ops.blog import prepare_blog_variant
    from .ops.rope import apply_rope_qk

    if variant == "auto":
        return partial(apply_rope_qk, q, k, cos, sin, layout="bhsd", interleaved=True, q_out=q_out, k_out=k_out)
    return prepare_blog_variant(variant, q, k, cos, sin, q_out=q_out, k_out=k_out)


def _canonical(x_bhsd: np.ndarray) -> np.ndarray:
    """[B, h, S, D] -> [B*S, h, D], the reference's token-major form."""
    B, h, S, D = x_bhsd.shape
    return np.ascontiguousarray(x_bhsd.transpose(0, 2, 1, 3)).reshape(B * S, h, D)
