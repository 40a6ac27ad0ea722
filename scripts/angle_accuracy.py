#!/usr/bin/env python3
"""Accuracy of cos and sin computed in the kernel (``apply_rope(..., inv_freq=)``) at every
position from 0 to 2^20, beside the naive float32 ``cos(float32(p) * inv_freq)`` that computing
angles on the fly usually means, both against the exact table (``rope_tables``, float64 angles,
one rounding). Needs a GPU.

    PYTHONPATH=. python3 scripts/angle_accuracy.py --json docs/benchmarks/angles.json \\
        --plot docs/benchmarks/angles.png

Llama 3's frequencies (base 5e5, rope_type "llama3", head dim 128). Per bucket of positions: the
largest error of either value in float32 ulps of the exact entry, and in absolute terms.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout works without installing

import rope_rtc  # noqa: E402

POSITIONS = 2**20 + 1
BUCKETS = 256
CHUNK = 2**16
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def _ordered(x: np.ndarray) -> np.ndarray:
    i = x.view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def _kernel_rows(cp, inv, att: float, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's cos and sin: float32 q of (1, 0) pairs rotated out of place."""
    half = inv.size
    x = cp.zeros((pos.size, 1, 2 * half), cp.float32)
    x[..., :half] = 1.0
    out = cp.full(x.shape, cp.nan, cp.float32)
    rope_rtc.apply_rope(x, inv_freq=inv, attention_scaling=att, positions=cp.asarray(pos), layout="thd", out=out)
    o = cp.asnumpy(out)[:, 0]
    return o[:, :half], o[:, half:]


def measure() -> dict:
    import cupy as cp

    f64, att = rope_rtc.inverse_frequencies(128, base=5e5, scaling=SCALING)
    inv = cp.asarray(f64)
    f32, a32 = cp.asarray(f64.astype(np.float32)), np.float32(att)
    edges = np.linspace(0, POSITIONS, BUCKETS + 1).astype(np.int64)
    worst = {k: np.zeros(BUCKETS) for k in ("ours_ulp", "ours_abs", "naive_ulp", "naive_abs")}
    differing = 0
    t0 = time.time()
    for start in range(0, POSITIONS, CHUNK):
        pos = np.arange(start, min(start + CHUNK, POSITIONS))
        exact = rope_rtc.tables.angle_rows(pos, f64, att)
        ours = _kernel_rows(cp, inv, att, pos)
        angle = cp.asarray(pos).astype(cp.float32)[:, None] * f32[None, :]  # what the naive kernels compute
        naive = (cp.asnumpy(cp.cos(angle) * a32), cp.asnumpy(cp.sin(angle) * a32))
        bucket = np.searchsorted(edges, pos, side="right") - 1
        for name, got in (("ours", ours), ("naive", naive)):
            ulp = np.maximum(*(np.abs(_ordered(g) - _ordered(e)).max(axis=1) for g, e in zip(got, exact)))
            ab = np.maximum(*(np.abs(g.astype(np.float64) - e).max(axis=1) for g, e in zip(got, exact)))
            np.maximum.at(worst[f"{name}_ulp"], bucket, ulp)
            np.maximum.at(worst[f"{name}_abs"], bucket, ab)
            if name == "ours":
                differing += int(sum(np.count_nonzero(g != e) for g, e in zip(got, exact)))
    return {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "positions": POSITIONS,
            "rope": {"base": 5e5, "scaling": SCALING, "rotary_dim": 128},
            "bucket_edges": edges.tolist(), **{k: v.tolist() for k, v in worst.items()},
            "ours_max_ulp": float(worst["ours_ulp"].max()), "naive_max_ulp": float(worst["naive_ulp"].max()),
            "ours_entries_differing": differing, "entries": 2 * POSITIONS * 64, "seconds": time.time() - t0}


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mid = (np.array(res["bucket_edges"][:-1]) + np.array(res["bucket_edges"][1:])) / 2
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, label in (("naive", "naive float32: cos(float32(p) * inv_freq)"),
                        ("ours", "rope_rtc inv_freq= (float64 angle and reduction)")):
        ax[0].plot(mid, np.maximum(res[f"{name}_abs"], 1e-12), label=label)
        ax[1].plot(mid, np.maximum(res[f"{name}_ulp"], 0.5), label=label)
    ax[0].set(yscale="log", xlabel="position", ylabel="largest |error| in the bucket",
              title="cos and sin against the exact table")
    ax[1].set(yscale="log", xlabel="position", ylabel="largest error, float32 ulps (0 drawn at 0.5)",
              title="the same in ulps of the exact entry")
    for a in ax:
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"Angles computed in the kernel, positions 0..2^20, Llama 3 frequencies ({res['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the curves here")
    ap.add_argument("--plot", help="write the figure here (needs matplotlib)")
    args = ap.parse_args()
    res = measure()
    print(f"ours: largest error {res['ours_max_ulp']:.0f} ulp, {res['ours_entries_differing']} of {res['entries']} "
          f"entries differ from the exact table; naive float32: largest {res['naive_max_ulp']:.0f} ulp, "
          f"{max(res['naive_abs']):.3g} absolute ({res['seconds']:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    if args.plot:
        plot(res, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
