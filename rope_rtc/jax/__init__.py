"""rope_rtc's ops for JAX: inside ``jax.jit``, differentiable, on JAX's own stream, with no copy
and no synchronisation; the same program runs without a GPU on a jnp reference.

- :func:`apply_rope`, :func:`apply_rope_qk` — general RoPE (every layout, position scheme and
  table of the CuPy API, ``cos_sin_cache`` and flat ``[T, H * D]`` arrays included)
- :func:`rope_and_cache` — RoPE fused with the paged KV-cache write (FP8 too); the caches are
  written where they lie when donated

Needs JAX (``pip install "rope-rtc[jax]"``; for the GPU, JAX's CUDA build and a rope_rtc CUDA
extra). docs/jax.md: the example, the route through XLA and why, gradients, costs.
"""

from __future__ import annotations

try:
    import jax  # noqa: F401  (rope_rtc.jax is this package; this is JAX itself)
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without JAX
    raise ImportError(f"rope_rtc.jax needs JAX, which cannot be imported ({exc}): pip install \"rope-rtc[jax]\" (on a "
                      "GPU machine also JAX's CUDA build, e.g. pip install \"jax[cuda13]\")") from exc

from .ops import apply_rope, apply_rope_qk, rope_and_cache

__all__ = ["apply_rope", "apply_rope_qk", "rope_and_cache"]
