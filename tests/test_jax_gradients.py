"""Gradients for every API, against torch autograd of Hugging Face transformers' Llama
``apply_rotary_pos_emb`` (and, for the cache write, torch's own index_put), on the CPU:

- the CuPy / NumPy API: the backward of RoPE is the inverse rotation of the cotangents
  (``inverse=True``, q and k in one call); the cache write's (docs/jax.md, "Gradients") routes
  the written entries' cotangents back to their tokens first;
- ``rope_rtc.jax``: ``jax.grad`` through the functions: their custom VJP, and JAX's own
  derivative of the jnp version (``backend="jnp"``).

Needs torch and transformers (skipped where either is missing: the project's venv, CI); the JAX
half needs JAX too."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import transformers_refs as R

import rope_rtc
from rope_rtc.reference import assert_rope_close, rope_reference

# As in test_jax.py: JAX must not take the GPU's memory from the GPU tests of the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

B, S, HQ, HK, D, ROWS = 2, 6, 4, 2, 32, 64
T, NB, BS = 9, 4, 8


def _random(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _llama():
    """transformers' Llama ``apply_rotary_pos_emb``, skipping the test where it is missing."""
    torch, transformers = R.imports()
    from transformers.models.llama import modeling_llama

    return torch, modeling_llama.apply_rotary_pos_emb


def _torch_rope_grads(q, k, wq, wk, cos, sin, pos):
    """(dq, dk) of ``sum(wq * q_rot) + sum(wk * k_rot)`` by torch autograd, q and k ``[B, H, S, D]``
    (bhsd, as Llama's attention holds them), positions ``[B, S]``."""
    torch, apply = _llama()
    c = torch.as_tensor(np.concatenate([cos, cos], axis=1)[pos])  # [B, S, D]: Llama's cat(freqs, freqs)
    s = torch.as_tensor(np.concatenate([sin, sin], axis=1)[pos])
    tq, tk = torch.tensor(q, requires_grad=True), torch.tensor(k, requires_grad=True)
    q_rot, k_rot = apply(tq, tk, c, s)
    ((q_rot * torch.as_tensor(wq)).sum() + (k_rot * torch.as_tensor(wk)).sum()).backward()
    return tq.grad.numpy(), tk.grad.numpy()


def _tokens(a: np.ndarray) -> np.ndarray:
    """bhsd ``[B, H, S, D]`` as ``[B * S, H, D]``."""
    return np.transpose(a, (0, 2, 1, 3)).reshape(-1, a.shape[1], a.shape[3])


def _inputs(seed: int):
    q, k = _random((B, HQ, S, D), seed), _random((B, HK, S, D), seed + 1)
    wq, wk = _random(q.shape, seed + 2), _random(k.shape, seed + 3)
    cos, sin = rope_rtc.rope_tables(ROWS, D, numerics="transformers")
    pos = np.random.default_rng(seed + 4).integers(0, ROWS, (B, S))
    return q, k, wq, wk, cos, sin, pos


def _check(got, want, w, pos, cos, sin):
    """``got`` and torch's ``want`` are both the inverse rotation of ``w``: each within the bound
    of the float64 reference, and within twice it of each other."""
    ref = rope_reference(_tokens(w), cos, sin, pos.reshape(-1), interleaved=False, inverse=True)
    assert_rope_close(_tokens(want), ref, _tokens(w), interleaved=False)
    assert_rope_close(_tokens(got), ref, _tokens(w), interleaved=False)


def test_the_numpy_api_backward_is_the_inverse_rotation_torch_computes():
    q, k, wq, wk, cos, sin, pos = _inputs(0)
    tq, tk = _torch_rope_grads(q, k, wq, wk, cos, sin, pos)
    dq, dk = rope_rtc.apply_rope_qk(wq, wk, cos, sin, positions=pos, layout="bhsd", inverse=True, backend="numpy")
    _check(dq, tq, wq, pos, cos, sin)
    _check(dk, tk, wk, pos, cos, sin)


def _torch_cache_grads(q, k, v, cos, sin, pos, slots, kc, vc, w):
    """Gradients of ``sum(w_i * out_i)`` over (q_rot, k_rot, k_cache, v_cache) by torch autograd,
    the cache write as index_put on the flat ``[slots, H, D]`` view (nhd)."""
    torch, apply = _llama()
    c = torch.as_tensor(np.concatenate([cos, cos], axis=1)[pos])[None]  # [1, T, D]
    s = torch.as_tensor(np.concatenate([sin, sin], axis=1)[pos])[None]
    leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v, kc, vc)]
    tq, tk, tv, tkc, tvc = leaves
    q_rot, k_rot = apply(tq.transpose(0, 1)[None], tk.transpose(0, 1)[None], c, s)  # thd as [1, H, T, D]
    q_rot, k_rot = q_rot[0].transpose(0, 1), k_rot[0].transpose(0, 1)
    written = torch.as_tensor(np.flatnonzero(slots >= 0))
    index = torch.as_tensor(slots[slots >= 0])
    new_kc = tkc.reshape(NB * BS, HK, D).index_put((index,), k_rot[written]).reshape(kc.shape)
    new_vc = tvc.reshape(NB * BS, HK, D).index_put((index,), tv[written]).reshape(vc.shape)
    sum(((o * torch.as_tensor(wi)).sum() for o, wi in zip((q_rot, k_rot, new_kc, new_vc), w))).backward()
    return [leaf.grad.numpy() for leaf in leaves]


def _cache_inputs(seed: int):
    rng = np.random.default_rng(seed)
    q, k, v = _random((T, HQ, D), seed), _random((T, HK, D), seed + 1), _random((T, HK, D), seed + 2)
    kc, vc = _random((NB, BS, HK, D), seed + 3), _random((NB, BS, HK, D), seed + 4)
    cos, sin = rope_rtc.rope_tables(ROWS, D, numerics="transformers")
    pos = rng.integers(0, ROWS, T)
    slots = rng.permutation(NB * BS)[:T]
    slots[3] = -1  # a token whose k and v go to no slot
    w = [_random(a.shape, seed + 10 + i) for i, a in enumerate((q, k, kc, vc))]
    return q, k, v, kc, vc, cos, sin, pos, slots, w


def numpy_cache_backward(w, cos, sin, pos, slots):
    """The cache write's backward with the NumPy API (docs/jax.md, "Gradients"): each written
    entry's cotangent goes back to its token (added to k's before the inverse rotation, v's as
    it is), and the caches keep theirs with the written entries zeroed."""
    gq, gk, gkc, gvc = (np.array(a) for a in w)
    flat_k, flat_v = gkc.reshape(NB * BS, HK, D), gvc.reshape(NB * BS, HK, D)
    written = slots >= 0
    gv = np.zeros_like(gk)
    gk[written] += flat_k[slots[written]]
    gv[written] = flat_v[slots[written]]
    flat_k[slots[written]] = 0
    flat_v[slots[written]] = 0
    dq, dk = rope_rtc.apply_rope_qk(gq, gk, cos, sin, positions=pos, layout="thd", inverse=True, backend="numpy")
    return dq, dk, gv, gkc, gvc


def test_the_numpy_api_cache_write_backward_is_what_torch_computes():
    q, k, v, kc, vc, cos, sin, pos, slots, w = _cache_inputs(20)
    want = _torch_cache_grads(q, k, v, cos, sin, pos, slots, kc, vc, w)
    got = numpy_cache_backward(w, cos, sin, pos, slots)
    for name, g, t in zip(("q", "k", "v", "k_cache", "v_cache"), got, want):
        np.testing.assert_allclose(g, t, rtol=1e-5, atol=1e-5, err_msg=name)


# -- rope_rtc.jax -----------------------------------------------------------------------------------

def _jax():
    """JAX, its computations on the CPU device (the GPU's are tests/test_gpu_jax.py's)."""
    jax = pytest.importorskip("jax", reason='JAX is not installed (pip install "rope-rtc[jax]")')
    return jax


@pytest.fixture
def on_the_cpu():
    jax = _jax()
    with jax.default_device(jax.devices("cpu")[0]):
        yield jax


@pytest.mark.parametrize("backend", ["jnp", "auto", "vjp"])
def test_jax_grad_is_what_torch_computes(backend, on_the_cpu, monkeypatch):
    """"jnp": JAX's derivative of the jnp version; "vjp": the custom VJP, which runs where a kernel
    could (simulated here); "auto": whichever this machine runs."""
    jax = on_the_cpu
    import rope_rtc.jax as rj
    from rope_rtc.jax import kernel_call

    if backend == "vjp":
        monkeypatch.setattr(kernel_call, "_usable", [None])
        backend = "auto"

    q, k, wq, wk, cos, sin, pos = _inputs(40)
    tq, tk = _torch_rope_grads(q, k, wq, wk, cos, sin, pos)
    positions = jax.numpy.asarray(pos.astype(np.int32))

    def loss(q, k):
        qr, kr = rj.apply_rope_qk(q, k, cos, sin, positions=positions, layout="bhsd", backend=backend)
        return (qr * wq).sum() + (kr * wk).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "auto" without kernels says so once
        dq, dk = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, k)
    _check(np.asarray(dq), tq, wq, pos, cos, sin)
    _check(np.asarray(dk), tk, wk, pos, cos, sin)


@pytest.mark.parametrize("backend", ["jnp", "vjp"])
def test_jax_cache_write_grad_is_what_torch_computes(backend, on_the_cpu, monkeypatch):
    jax = on_the_cpu
    import rope_rtc.jax as rj
    from rope_rtc.jax import kernel_call

    if backend == "vjp":  # the custom VJP, which runs where a kernel could (simulated here)
        monkeypatch.setattr(kernel_call, "_usable", [None])
        backend = "auto"

    q, k, v, kc, vc, cos, sin, pos, slots, w = _cache_inputs(60)
    want = _torch_cache_grads(q, k, v, cos, sin, pos, slots, kc, vc, w)

    def loss(q, k, v, kc, vc):
        outs = rj.rope_and_cache(q, k, v, cos, sin, pos.astype(np.int32), slots.astype(np.int32), kc, vc,
                                 backend=backend)
        return sum((o * wi).sum() for o, wi in zip(outs, w))

    got = jax.jit(jax.grad(loss, argnums=tuple(range(5))))(q, k, v, kc, vc)
    for name, g, t in zip(("q", "k", "v", "k_cache", "v_cache"), got, want):
        np.testing.assert_allclose(np.asarray(g), t, rtol=1e-5, atol=1e-5, err_msg=name)

