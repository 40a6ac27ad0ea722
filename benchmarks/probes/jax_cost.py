"""rope_rtc.jax under ``jax.jit`` on the GPU, beside the same RoPE written in jnp and fused by XLA
(``backend="jnp"``) and beside a same-size device copy; then the host time each call adds to a
jitted step.

    PYTHONPATH=. python3 benchmarks/probes/jax_cost.py [--chain 200] [--layers 32]

GPU time: CUDA events recorded on XLA's own stream from inside the program (two small buffer
callbacks), around a chain of calls queued behind a spinning kernel, so that the calls run back
to back whatever the host's speed; µs per call is the window over the chain's length, median of
5 runs. Consecutive calls are kept apart by ``jax.lax.optimization_barrier`` (XLA would otherwise
fuse a chain of jnp rotations into one kernel); q and k are rotated in place (intermediates).

- prefill: bf16 ``bshd`` q and k ``[4, 4096, 32, 128]``, positions 0..4095: GB/s of the bytes
  moved (q and k read and written, each token's table rows read) and % of a device-to-device copy
  of that many bytes (``rope_rtc.measure``: half read, half written; cold L2);
- decode: bf16 q ``[B, 1, 32, 128]``, k ``[B, 1, 8, 128]``, one offset per sequence (an array:
  traced), B = 1, 8, 64: GPU µs per call, ours (a callback per execution, the default; and with
  command buffers) and XLA's;
- host: wall µs per call of a jitted decode step of ``--layers`` chained calls (B = 8), jnp's and
  ours with command buffers off (a Python call per execution; the part spent inside the
  callback's one-call function timed by a wrapper), then ours with them on (buffer_callback's
  ``command_buffer_compatible``: XLA records the launches into its CUDA graphs), its outputs
  checked against the callback's for five argument sets in distinct buffers, each run twice (a
  replay that kept stale addresses shows as WRONG).

Sets ``rope_rtc.jax.kernel_call.COMMAND_BUFFER`` for each row (and back) and wraps
``rope_rtc.ops.rope.apply_rope_qk`` for the host section only. Exits 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # CuPy's copy needs memory too

import numpy as np  # noqa: E402

from rope_rtc.benchmark.engine_jax import (Window, chain_fn, chain_us as gpu_us_per_call,  # noqa: E402
                                          command_buffers, inputs, step_fn, wall_us_per_call)


def copy_us(cp, moved: int) -> float:
    from rope_rtc.measure import CopyRunner, gpu_us

    stream = cp.cuda.Stream(non_blocking=True)
    runner = CopyRunner(cp, stream, moved, 1)
    return gpu_us(cp, stream, runner.fns[0])


def prefill(jax, jnp, cp, rj, window: Window, rng, length: int) -> None:
    B, S, H, D = 4, 4096, 32, 128
    args = inputs(jnp, rng, B, S, H, H, D, S)
    moved = 2 * (args[0].nbytes + args[1].nbytes) + B * S * (D // 2) * 4 * 2
    copy = copy_us(cp, moved)
    print(f"prefill bf16 bshd q, k [{B}, {S}, {H}, {D}], in place: {moved / 2**20:.0f} MiB moved; "
          f"device copy of that many bytes: {copy:.1f} us ({moved / copy / 1e3:.0f} GB/s)")
    for label, backend in (("rope_rtc.jax (kernel)", "nvrtc"), ("jnp, fused by XLA", "jnp")):
        us = gpu_us_per_call(jax, chain_fn(jax, rj, window, backend, length, 0), args, window, length)
        print(f"  {label:24s} {us:9.1f} us  {moved / us / 1e3:7.0f} GB/s  {100 * copy / us:5.1f}% of the copy")


def decode(jax, jnp, rj, window: Window, rng, length: int) -> None:
    print(f"decode bf16 q [B, 1, 32, 128], k [B, 1, 8, 128], offsets [B]: GPU us per call ({length} chained)")
    for b in (1, 8, 64):
        args = inputs(jnp, rng, b, 1, 32, 8, 128, 4096)
        row = [f"  B={b:<3d}"]
        for label, backend, on in (("rope_rtc.jax", "nvrtc", False), ("with command buffers", "nvrtc", True),
                                   ("jnp/XLA", "jnp", False)):
            with command_buffers(on):
                us = gpu_us_per_call(jax, chain_fn(jax, rj, window, backend, length, None), args, window, length)
            row.append(f"{label} {us:7.2f}")
        print("   ".join(row))


def host(jax, jnp, rj, rng, layers: int) -> None:
    import rope_rtc.ops.rope as ops_rope

    args = inputs(jnp, rng, 8, 1, 32, 8, 128, 4096)
    print(f"host: a jitted decode step of {layers} chained calls (B=8), each step waited for: wall us per call")
    jnp_us = wall_us_per_call(jax, step_fn(jax, rj, "jnp", layers), args, layers)
    inside = [0.0, 0]
    real = ops_rope.apply_rope_qk

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return real(*a, **kw)
        finally:
            inside[0] += time.perf_counter() - t0
            inside[1] += 1

    with command_buffers(False):
        ours_fn = step_fn(jax, rj, "nvrtc", layers)
        ours_us = wall_us_per_call(jax, ours_fn, args, layers)
        ops_rope.apply_rope_qk = timed
        try:
            wall_us_per_call(jax, step_fn(jax, rj, "nvrtc", layers), args, layers, steps=50)
        finally:
            ops_rope.apply_rope_qk = real
        # Argument sets in distinct buffers, all kept alive (so no two share an address): a
        # replay that kept the buffers it was recorded with shows as WRONG.
        sets = [args] + [(args[0] * (1 + i), args[1] * (2 + i), *args[2:4], (args[4] + 7 * i) % 4000)
                         for i in range(1, 5)]
        expected = [jax.block_until_ready(ours_fn(*a)) for a in sets]
    print(f"  jnp, fused by XLA            {jnp_us:7.2f}")
    print(f"  rope_rtc.jax                 {ours_us:7.2f}   (+{ours_us - jnp_us:.2f} per call over jnp; inside the "
          f"one-call function: {inside[0] / max(inside[1], 1) * 1e6:.2f})")
    with command_buffers(True):
        graphed = step_fn(jax, rj, "nvrtc", layers)
        graphed_us = wall_us_per_call(jax, graphed, args, layers)
        same = all(bool((x == y).all()) for run, want in zip(sets, expected)
                   for _ in range(2) for x, y in zip(graphed(*run), want))
    print(f"  with command buffers         {graphed_us:7.2f}   outputs {'equal to the callback' if same else 'WRONG'} "
          f"(per-call) for {len(sets)} argument sets in distinct buffers, each run twice")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=200, help="calls per timed window at decode (prefill: 10)")
    parser.add_argument("--layers", type=int, default=32, help="calls per jitted step in the host section")
    opts = parser.parse_args()
    try:
        import jax

        gpus = jax.devices("cuda")
    except Exception as exc:  # no JAX, or a JAX without its CUDA backend
        print(f"jax_cost.py needs JAX with a CUDA device: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    import cupy as cp
    import jax.numpy as jnp

    import rope_rtc
    import rope_rtc.jax as rj

    print(f"{gpus[0].device_kind}; JAX {jax.__version__}, rope_rtc {rope_rtc.__version__}, CuPy {cp.__version__}")
    rng = np.random.default_rng(0)
    with jax.default_device(gpus[0]):
        window = Window(jax, cp)
        prefill(jax, jnp, cp, rj, window, rng, 10)
        decode(jax, jnp, rj, window, rng, opts.chain)
        host(jax, jnp, rj, rng, opts.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
