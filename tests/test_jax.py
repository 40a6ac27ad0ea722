"""rope_rtc.jax on the CPU: the jnp reference the functions stage out where no kernel runs (values
against the float64 reference and the cache write's NumPy reference, bit for bit where that one
is), gradients equal to the inverse rotation, the checks made at trace time, and the kernel's
route itself: the same buffer callback XLA runs on a GPU, run here by JAX's CPU backend on host
buffers with the NumPy backend standing in for the kernel, and the program lowered for CUDA.

Skipped where JAX is not installed (``pip install "rope-rtc[jax]"``)."""

from __future__ import annotations

import ctypes
import os
import re
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

# On a GPU machine JAX takes most of the GPU's memory at its first use unless told not to; the
# GPU tests of the same process need it (set before JAX starts a backend).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax", reason='JAX is not installed (pip install "rope-rtc[jax]")')

import jax.numpy as jnp  # noqa: E402

import rope_rtc  # noqa: E402
import rope_rtc.jax as rj  # noqa: E402
from gpu_util import DTYPES, cache_write_host, host_random, host_tables  # noqa: E402
from helpers import CACHE_ARGS, bits, cache_write_reference, layout_shape, token_rows  # noqa: E402
from rope_rtc.core import driver  # noqa: E402
from rope_rtc.jax import checks, jnp_rope, kernel_call  # noqa: E402
from rope_rtc.reference import assert_rope_close, rope_reference  # noqa: E402

B, S, HQ, HK, D, ROWS = 2, 5, 4, 2, 32, 64
DOCS = Path(__file__).resolve().parents[1] / "docs" / "jax.md"


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """Every computation here on JAX's CPU device, also where JAX has a GPU (the kernel's tests
    are tests/test_gpu_jax.py): the jnp reference is what runs without one."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def scheme_arrays(scheme: str, layout: str, seed: int) -> tuple[dict, np.ndarray]:
    """The position arguments of ``scheme`` and every token's position, ``[B * S]`` in (b, s)
    order, computed here independently of the library (``thd`` is one sequence of B * S tokens,
    except with ``cu_seqlens``: B packed sequences of S)."""
    rng = np.random.default_rng(seed)
    nb, ns = (1, B * S) if layout == "thd" else (B, S)
    s = np.arange(ns)
    if scheme == "positions":
        pos = rng.integers(0, ROWS, (nb, ns))
        arg = pos.reshape(-1) if layout == "thd" else pos
        return {"positions": jnp.asarray(arg.astype(np.int32))}, pos.reshape(-1)
    if scheme == "offset":
        return {"offset": 7}, np.tile(7 + s, nb)
    if scheme == "offsets":  # one start per sequence
        starts = rng.integers(0, ROWS - ns, nb)
        return {"offset": jnp.asarray(starts.astype(np.int32))}, (starts[:, None] + s[None, :]).reshape(-1)
    if scheme == "scalar-array":  # a 0-d offset array: every sequence from the same start
        return {"offset": jnp.asarray(np.int32(11))}, np.tile(11 + s, nb)
    # cu_seqlens: thd only, B sequences of S tokens packed, each with its own start
    cu = np.arange(B + 1) * S
    starts = rng.integers(0, ROWS - S, B)
    return ({"cu_seqlens": jnp.asarray(cu.astype(np.int32)), "offset": jnp.asarray(starts.astype(np.int32))},
            (starts[:, None] + np.arange(S)[None, :]).reshape(-1))


def _tokens(a, layout: str) -> np.ndarray:
    return token_rows(np.asarray(a), layout)


SCHEMES = [(layout, scheme) for layout in ("bshd", "bhsd", "sbhd", "thd")
           for scheme in ("positions", "offset", "offsets", "scalar-array")] + [("thd", "cu_seqlens")]


@pytest.mark.parametrize("layout,scheme", SCHEMES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_values_within_the_bound_of_the_float64_reference(layout, scheme, dtype, interleaved):
    dt = DTYPES[dtype]
    shape_q, shape_k = layout_shape(layout, B, S, HQ, D), layout_shape(layout, B, S, HK, D)
    q, k = host_random(shape_q, dt, 1, 2.0), host_random(shape_k, dt, 2, 2.0)
    cos, sin = host_tables(ROWS, D // 2, 3)
    kw, pos = scheme_arrays(scheme, layout, 4)
    f = jax.jit(lambda q, k: rj.apply_rope_qk(q, k, cos, sin, layout=layout, interleaved=interleaved, backend="jnp",
                                              **kw))
    got = f(jnp.asarray(q), jnp.asarray(k))
    for out, x in zip(got, (q, k)):
        assert out.dtype == x.dtype and out.shape == x.shape
        ref = rope_reference(_tokens(x, layout), cos, sin, pos, interleaved=interleaved)
        assert_rope_close(_tokens(out, layout), ref, _tokens(x, layout), interleaved=interleaved)


@pytest.mark.parametrize("rotary_dim,rotary_offset", [(16, 0), (16, 8), (8, 24)])
def test_partial_window_and_inverse(rotary_dim, rotary_offset):
    x = host_random((B, S, HQ, D), ml_dtypes.bfloat16, 5)
    cos, sin = host_tables(ROWS, rotary_dim // 2, 6)
    y = rj.apply_rope(jnp.asarray(x), cos, sin, offset=3, layout="bshd", rotary_dim=rotary_dim,
                      rotary_offset=rotary_offset, inverse=True, backend="jnp")
    pos = np.tile(3 + np.arange(S), B)
    ref = rope_reference(_tokens(x, "bshd"), cos, sin, pos, interleaved=False, rotary_dim=rotary_dim,
                         rotary_offset=rotary_offset, inverse=True)
    assert_rope_close(_tokens(y, "bshd"), ref, _tokens(x, "bshd"), interleaved=False, rotary_dim=rotary_dim,
                      rotary_offset=rotary_offset)


def test_cos_sin_cache_and_flat_heads_equal_the_tables():
    T = B * S
    q, k = host_random((T, HQ * D), np.float32, 7), host_random((T, HK * D), np.float32, 8)
    cos, sin = host_tables(ROWS, D // 2, 9)
    cache = np.concatenate([cos, sin], axis=1)
    pos = jnp.asarray(np.random.default_rng(10).integers(0, ROWS, T).astype(np.int32))
    flat = rj.apply_rope_qk(jnp.asarray(q), jnp.asarray(k), cos_sin_cache=cache, positions=pos, head_dim=D,
                            backend="jnp")
    heads = rj.apply_rope_qk(jnp.asarray(q.reshape(T, HQ, D)), jnp.asarray(k.reshape(T, HK, D)), cos, sin,
                             positions=pos, layout="thd", backend="jnp")
    assert flat[0].shape == (T, HQ * D) and flat[1].shape == (T, HK * D)
    for a, b in zip(flat, heads):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).reshape(a.shape))


def test_positions_outside_the_table_give_nan_for_their_token():
    x = host_random((6, HQ, D), np.float32, 11)
    cos, sin = host_tables(ROWS, D // 2, 12)
    pos = np.array([0, -1, ROWS, 5, ROWS + 100, 3], np.int32)
    y = np.asarray(rj.apply_rope(jnp.asarray(x), cos, sin, positions=jnp.asarray(pos), layout="thd", backend="jnp"))
    outside = (pos < 0) | (pos >= ROWS)
    assert np.isnan(y[outside]).all()
    assert not np.isnan(y[~outside]).any()


def test_wide_positions_and_slots_are_not_cut_to_32_bits():
    """With jax_enable_x64, an int64 position or slot past 2^31 lies outside the table or the
    cache: NaN for its token, no cache row written, as the kernels and the NumPy reference do (the
    jnp version cut them to int32, onto a row and a slot inside)."""
    from rope_rtc.reference import rope_and_cache_reference

    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        x = host_random((3, HQ, D), np.float32, 41)
        cos, sin = host_tables(ROWS, D // 2, 42)
        for kw in (dict(positions=np.array([0, 2**32 + 3, 5], np.int64)),
                   dict(offset=np.array(2**32, np.int64), layout="thd")):
            kw = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
            y = np.asarray(rj.apply_rope(jnp.asarray(x), cos, sin, layout="thd", backend="jnp",
                                         **{k: v for k, v in kw.items() if k != "layout"}))
            wide = np.array([False, True, False]) if "positions" in kw else np.ones(3, bool)
            assert np.isnan(y[wide]).all() and not np.isnan(y[~wide]).any()
        q, k, v = (host_random((2, 1, D), np.float32, seed) for seed in (43, 44, 45))
        caches = np.zeros((2, 4, 1, D), np.float32), np.zeros((2, 4, 1, D), np.float32)
        pos, slots = np.array([0, 1]), np.array([2**32 + 5, 6], np.int64)
        got = rj.rope_and_cache(*map(jnp.asarray, (q, k, v)), cos, sin, jnp.asarray(pos), jnp.asarray(slots),
                                *map(jnp.asarray, caches), backend="jnp")
        want = rope_and_cache_reference(q, k, v, cos, sin, pos, slots, *caches)
        for cache, ref in zip(got[2:], want[2:]):  # slot 6 alone written (the rotation may differ by an FMA)
            np.testing.assert_array_equal(np.asarray(cache).any(axis=(2, 3)), ref.any(axis=(2, 3)))
        np.testing.assert_array_equal(np.asarray(got[3]), want[3])  # v as given
    finally:
        jax.config.update("jax_enable_x64", old)


def test_host_indices_that_jax_would_cut_to_32_bits_are_refused():
    """Without jax_enable_x64, JAX makes an int64 NumPy array int32, silently: a position of
    2^32 + 3 became 3 and a slot past 2^31 one inside the cache (another sequence's entry). The
    values are known at trace time, so such an array is refused, naming it."""
    assert not jax.config.jax_enable_x64
    x = jnp.asarray(host_random((2, HQ, D), np.float32, 48))
    cos, sin = host_tables(ROWS, D // 2, 49)
    with pytest.raises(ValueError, match=r"^positions: 4294967299 does not fit .*jax_enable_x64"):
        rj.apply_rope(x, cos, sin, positions=np.array([0, 2**32 + 3], np.int64), layout="thd", backend="jnp")
    host = cache_inputs("float32", "auto", "nhd", seed=54)
    args = {n: host[n] for n in CACHE_ARGS}
    args["slot_mapping"] = np.full(T, -(2**31) - 1, np.int64)  # would wrap to 2^31 - 1
    with pytest.raises(ValueError, match=r"^slot_mapping: -2147483649 does not fit"):
        rj.rope_and_cache(*args.values(), backend="jnp")
    ok = rj.apply_rope(x, cos, sin, positions=np.array([0, 5], np.int64), layout="thd", backend="jnp")
    assert not np.isnan(np.asarray(ok)).any()


def test_a_table_of_no_rows_gives_nan_for_every_token_of_device_positions():
    """Positions given as an array are not checked against the table (they may be traced): with a
    table of no rows every token is outside it, NaN, as on the GPU (jnp.take raised IndexError)."""
    x = jnp.asarray(host_random((3, HQ, D), np.float32, 46))
    cos, sin = host_tables(ROWS, D // 2, 47)
    for kw in (dict(positions=jnp.asarray([0, 1, 2], jnp.int32)), dict(offset=jnp.asarray(0, jnp.int32))):
        y = np.asarray(rj.apply_rope(x, cos[:0], sin[:0], layout="thd", backend="jnp", **kw))
        assert y.shape == x.shape and np.isnan(y).all()


# -- gradients ------------------------------------------------------------------------------------

@pytest.fixture
def under_the_vjp(monkeypatch):
    """The backend that runs the custom VJP here: "auto" where rope_rtc could launch kernels
    (simulated), on the CPU device, whose program runs the jnp version under the custom rule
    (backend="jnp", or no usable GPU, leaves the rule out: JAX differentiates the jnp code)."""
    monkeypatch.setattr(kernel_call, "_usable", [None])
    with jax.default_device(jax.devices("cpu")[0]):
        yield "auto"


@pytest.mark.parametrize("layout,scheme", [("bshd", "positions"), ("bhsd", "offsets"), ("thd", "cu_seqlens")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_grad_is_the_inverse_rotation(layout, scheme, dtype, interleaved, under_the_vjp):
    """jax.grad of sum(w * rope(x)) is the inverse rotation of w: within the general bound of the
    float64 reference, and equal to jax.grad of the jnp version differentiated by JAX itself."""
    dt = DTYPES[dtype]
    shape_q, shape_k = layout_shape(layout, B, S, HQ, D), layout_shape(layout, B, S, HK, D)
    q, k = host_random(shape_q, dt, 13), host_random(shape_k, dt, 14)
    wq, wk = host_random(shape_q, dt, 15), host_random(shape_k, dt, 16)
    cos, sin = host_tables(ROWS, D // 2, 17)
    kw, pos = scheme_arrays(scheme, layout, 18)
    opts = dict(layout=layout, interleaved=interleaved, backend=under_the_vjp, **kw)

    def loss(q, k):
        qr, kr = rj.apply_rope_qk(q, k, cos, sin, **opts)
        return (jnp.sum(qr.astype(jnp.float32) * wq.astype(np.float32))
                + jnp.sum(kr.astype(jnp.float32) * wk.astype(np.float32)))

    gq, gk = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(q), jnp.asarray(k))
    for g, w in ((gq, wq), (gk, wk)):
        assert g.dtype == dt
        ref = rope_reference(_tokens(w, layout), cos, sin, pos, interleaved=interleaved, inverse=True)
        assert_rope_close(_tokens(g, layout), ref, _tokens(w, layout), interleaved=interleaved)

    # JAX's own derivative of the same jnp code, without the custom rule.
    call, _, _, tables, index, _ = checks.check_rope(("q", "k"), q, k, cos, sin, None, kw.get("positions"),
                                                     kw.get("offset", 0), kw.get("cu_seqlens"), layout, interleaved,
                                                     None, 0, False, None, "jnp", True)

    def plain_loss(q, k):
        qr, kr = jnp_rope.rope(call, q, k, tables, index)
        return (jnp.sum(qr.astype(jnp.float32) * wq.astype(np.float32))
                + jnp.sum(kr.astype(jnp.float32) * wk.astype(np.float32)))

    pq, pk = jax.jit(jax.grad(plain_loss, argnums=(0, 1)))(jnp.asarray(q), jnp.asarray(k))
    for g, p, w in ((gq, pq, wq), (gk, pk, wk)):
        ref = rope_reference(_tokens(w, layout), cos, sin, pos, interleaved=interleaved, inverse=True)
        assert_rope_close(_tokens(p, layout), ref, _tokens(w, layout), interleaved=interleaved)
        # Both round the same FP32 value once; they may differ by the FMA XLA contracts, no more.
        diff = np.abs(np.asarray(g, np.float64) - np.asarray(p, np.float64))
        assert diff.max() <= 2.0 ** -6 * np.abs(np.asarray(w, np.float64)).max()


def test_grad_passes_the_channels_outside_the_window_through(under_the_vjp):
    x = host_random((1, S, HQ, D), np.float32, 19)
    cos, sin = host_tables(ROWS, 8, 20)
    w = host_random(x.shape, np.float32, 21)
    g = jax.grad(lambda x: jnp.sum(rj.apply_rope(x, cos, sin, layout="bshd", rotary_dim=16, rotary_offset=4,
                                                 backend=under_the_vjp) * w))(jnp.asarray(x))
    g = np.asarray(g)
    np.testing.assert_array_equal(g[..., :4], w[..., :4])
    np.testing.assert_array_equal(g[..., 20:], w[..., 20:])


# -- the cache write ------------------------------------------------------------------------------

T, NB, BS = 9, 4, 8


def cache_inputs(dtype, kind: str, kv_layout: str, seed: int = 0) -> dict:
    host = cache_write_host(dtype, kind, kv_layout, seed, tokens=T, heads=(HQ, HK), head_dim=D, blocks=NB,
                            block_size=BS, rows=ROWS)
    if kind != "auto":
        host["k_scale"], host["v_scale"] = np.float32(0.004), np.float32(0.02)
    return host


def cache_reference(host: dict, kind: str, kv_layout: str):
    return cache_write_reference(host, kind, kv_layout, NB * BS, host.get("k_scale"), host.get("v_scale"))


@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("kv_layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rope_and_cache_equals_the_numpy_reference_bit_for_bit(kind, kv_layout, dtype):
    host = cache_inputs(dtype, kind, kv_layout)
    scales = {n: float(host[n]) for n in ("k_scale", "v_scale") if n in host}
    f = jax.jit(lambda q, k, v, kc, vc: rj.rope_and_cache(q, k, v, host["cos"], host["sin"], host["positions"],
                                                          host["slot_mapping"], kc, vc, kv_layout=kv_layout,
                                                          kv_cache_dtype=kind, backend="jnp", **scales),
                donate_argnums=(3, 4))
    got = f(*(jnp.asarray(host[n]) for n in ("q", "k", "v", "k_cache", "v_cache")))
    for name, out, ref in zip(("q", "k", "k_cache", "v_cache"), got, cache_reference(host, kind, kv_layout)):
        out, ref = bits(np.asarray(out)), bits(ref)
        if kind == "auto" and name.endswith("cache"):
            # The random bytes left in the caches hold NaNs; some XLA versions' CPU scatter
            # canonicalises a NaN's payload (the kernels never touch an entry not written).
            nan = np.isnan(np.asarray(ref).view(DTYPES[dtype])) & np.isnan(np.asarray(out).view(DTYPES[dtype]))
            out, ref = np.where(nan, 0, out), np.where(nan, 0, ref)
        np.testing.assert_array_equal(out, ref, err_msg=name)


def test_rope_and_cache_grad_routes_the_cache_cotangents(under_the_vjp):
    """The custom VJP against JAX's own derivative of the jnp version (a scatter and its transpose)."""
    host = cache_inputs("float32", "auto", "hnd", seed=30)
    w = [host_random(s, np.float32, 40 + i) for i, s in enumerate(((T, HQ, D), (T, HK, D), host["k_cache"].shape,
                                                                   host["k_cache"].shape))]
    names = ("q", "k", "v", "k_cache", "v_cache")

    def loss(fn):
        def f(q, k, v, kc, vc):
            return sum(jnp.sum(o * wi) for o, wi in zip(fn(q, k, v, kc, vc), w))
        return f

    ours = loss(lambda q, k, v, kc, vc: rj.rope_and_cache(q, k, v, host["cos"], host["sin"], host["positions"],
                                                           host["slot_mapping"], kc, vc, kv_layout="hnd",
                                                           backend=under_the_vjp))
    call, arrays = checks.check_cache(*(host[n] for n in CACHE_ARGS), "hnd", "auto", None, None, 0, None, False, None,
                                      "jnp", True)
    plain = loss(lambda q, k, v, kc, vc: jnp_rope.rope_and_cache(call, q, k, v, arrays[3], arrays[4], arrays[5],
                                                                  (kc, vc), arrays[7]))
    args = [jnp.asarray(host[n]) for n in names]
    got = jax.jit(jax.grad(ours, argnums=tuple(range(5))))(*args)
    want = jax.jit(jax.grad(plain, argnums=tuple(range(5))))(*args)
    for name, g, p in zip(names, got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(p), rtol=2e-6, atol=2e-6, err_msg=name)


def test_fp8_cache_grad_flows_through_q_and_k_only(under_the_vjp):
    host = cache_inputs("bfloat16", "fp8_e4m3", "nhd", seed=50)
    wq, wk = host_random((T, HQ, D), np.float32, 51), host_random((T, HK, D), np.float32, 52)

    def loss(q, k, v):
        qo, ko, _, _ = rj.rope_and_cache(q, k, v, host["cos"], host["sin"], host["positions"], host["slot_mapping"],
                                         host["k_cache"], host["v_cache"], kv_cache_dtype="fp8_e4m3", k_scale=0.004,
                                         v_scale=0.02, backend=under_the_vjp)
        return jnp.sum(qo.astype(jnp.float32) * wq) + jnp.sum(ko.astype(jnp.float32) * wk)

    gq, gk, gv = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(host[n]) for n in ("q", "k", "v")))
    assert not np.asarray(gv, np.float32).any()
    for g, w in ((gq, wq), (gk, wk)):
        ref = rope_reference(w.astype(ml_dtypes.bfloat16), host["cos"], host["sin"], host["positions"],
                             interleaved=False, inverse=True)
        assert_rope_close(np.asarray(g), ref, w.astype(ml_dtypes.bfloat16), interleaved=False)


def test_a_python_int_scale_is_a_scale():
    """The docstring's "float": a Python int (k_scale=1) is the same constant, not refused as
    "expected a JAX or NumPy array, got int"."""
    host = cache_inputs("bfloat16", "fp8_e4m3", "nhd", seed=53)
    args = [jnp.asarray(host[n]) for n in CACHE_ARGS]
    ints = rj.rope_and_cache(*args, kv_cache_dtype="fp8_e4m3", k_scale=1, v_scale=2, backend="jnp")
    floats = rj.rope_and_cache(*args, kv_cache_dtype="fp8_e4m3", k_scale=1.0, v_scale=2.0, backend="jnp")
    for a, b in zip(ints, floats):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- checks at trace time -------------------------------------------------------------------------

def _traced(fn, *args):
    """Trace ``fn`` under jit (nothing runs): the checks raise here."""
    return jax.jit(fn).trace(*args)


def test_checks_raise_at_trace_time_naming_the_argument():
    q = jnp.asarray(host_random((B, S, HQ, D), np.float32, 60))
    cos, sin = host_tables(ROWS, D // 2, 61)
    with pytest.raises(ValueError, match="layout"):
        _traced(lambda q: rj.apply_rope(q, cos, sin), q)
    with pytest.raises(TypeError, match="cos"):
        _traced(lambda q: rj.apply_rope(q, cos.astype(np.float16), sin, layout="bshd"), q)
    with pytest.raises(TypeError, match="positions"):
        _traced(lambda q: rj.apply_rope(q, cos, sin, positions=jnp.zeros((B, S)), layout="bshd"), q)
    with pytest.raises(ValueError, match="positions"):
        _traced(lambda q: rj.apply_rope(q, cos, sin, positions=jnp.zeros((S,), jnp.int32), layout="bshd"), q)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        _traced(lambda q: rj.apply_rope(q, cos_sin_cache=np.zeros((ROWS, D + 2), np.float32), layout="bshd"), q)
    with pytest.raises(ValueError, match="offset"):
        _traced(lambda q: rj.apply_rope(q, cos, sin, offset=ROWS, layout="bshd"), q)
    with pytest.raises(ValueError, match="backend"):
        _traced(lambda q: rj.apply_rope(q, cos, sin, layout="bshd", backend="numpy"), q)
    with pytest.raises(TypeError, match="in_place"):
        _traced(lambda q: rj.apply_rope(q, cos, sin, layout="bshd", in_place=1), q)
    with pytest.raises(TypeError, match="x: expected a JAX or NumPy array"):
        rj.apply_rope([1.0, 2.0], cos, sin, layout="bshd")
    with pytest.raises(TypeError, match="k: expected an array"):
        rj.apply_rope_qk(q, None, cos, sin, layout="bshd")


def test_cache_checks_raise_at_trace_time_naming_the_argument():
    host = cache_inputs("bfloat16", "auto", "nhd", seed=70)
    args = {n: jnp.asarray(host[n]) for n in CACHE_ARGS}

    def call(**changes):
        a = dict(args, **{k: v for k, v in changes.items() if k in args})
        opts = dict({k: v for k, v in changes.items() if k not in args}, backend="jnp")
        return _traced(lambda: rj.rope_and_cache(*(a[n] for n in CACHE_ARGS), **opts))

    call()  # the unchanged call traces
    with pytest.raises(TypeError, match="k_cache"):
        call(k_cache=args["k_cache"].astype(jnp.float32), v_cache=args["v_cache"].astype(jnp.float32))
    with pytest.raises(ValueError, match="slot_mapping"):
        call(slot_mapping=args["slot_mapping"][:3])
    with pytest.raises(ValueError, match="kv_layout"):
        call(kv_layout="nchw")
    with pytest.raises(TypeError, match="k_scale"):
        call(kv_cache_dtype="fp8_e4m3", k_cache=args["k_cache"].view(jnp.uint8)[..., :D],
             v_cache=args["v_cache"].view(jnp.uint8)[..., :D])
    with pytest.raises(ValueError, match="v"):
        call(v=args["v"][:, :1])


# -- backend="auto" and "nvrtc" without kernels ---------------------------------------------------

def test_auto_without_kernels_runs_the_reference_and_warns_once(monkeypatch):
    monkeypatch.setattr(kernel_call, "_usable", ["no CUDA driver found (simulated)"])
    monkeypatch.setattr(kernel_call, "_warned", [])
    x = jnp.asarray(host_random((S, HQ, D), np.float32, 80))
    cos, sin = host_tables(ROWS, D // 2, 81)
    with pytest.warns(RuntimeWarning, match="jnp reference.*simulated") as record:
        a = rj.apply_rope(x, cos, sin, layout="thd")
        rj.apply_rope(x, cos, sin, layout="thd")
    assert len(record) == 1
    assert record[0].filename == __file__  # the user's line, not JAX's or rope_rtc's
    np.testing.assert_array_equal(np.asarray(a), np.asarray(rj.apply_rope(x, cos, sin, layout="thd", backend="jnp")))


@pytest.mark.skipif(driver.available(), reason="this machine has a usable GPU")
def test_nvrtc_without_a_gpu_raises_no_device_error(no_device, monkeypatch):
    monkeypatch.setattr(kernel_call, "_usable", [])
    x = jnp.asarray(host_random((S, HQ, D), np.float32, 82))
    cos, sin = host_tables(ROWS, D // 2, 83)
    with pytest.raises(rope_rtc.NoDeviceError, match="no CUDA driver found"):
        rj.apply_rope(x, cos, sin, layout="thd", backend="nvrtc")


# -- the kernel's route, run on the CPU -----------------------------------------------------------

@pytest.fixture
def host_callback(monkeypatch):
    """The kernel's buffer callback on JAX's CPU backend: XLA's host buffers as NumPy arrays, the
    CuPy API's NumPy backend standing in for the kernel; records each call's arguments."""
    calls = []

    def host_array(buffer, device):
        a = np.asarray(buffer)
        return a, a.__array_interface__["data"][0]

    monkeypatch.setattr(kernel_call, "device_array", host_array)
    monkeypatch.setattr(kernel_call, "launch_stream", lambda ctx, device: None)
    monkeypatch.setattr(kernel_call, "CALLBACK_BACKEND", "numpy")
    import rope_rtc.ops.kv_cache as ops_cache
    import rope_rtc.ops.rope as ops_rope

    for module, name in ((ops_rope, "apply_rope_qk"), (ops_rope, "apply_rope"), (ops_cache, "rope_and_cache")):
        real = getattr(module, name)

        def recording(*args, _real=real, _name=name, **kw):
            calls.append((_name, args, kw))
            return _real(*args, **kw)

        monkeypatch.setattr(module, name, recording)
    return calls


def _kernel_rope(*args, **kw):
    """``apply_rope_qk``'s kernel branch itself (what ``platform_dependent`` picks for CUDA)."""
    call, q, k, tables, index, flat = checks.check_rope(("q", "k"), *args, **kw)
    return call, q, k, tables, index


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("layout,scheme", [("bshd", "offsets"), ("bhsd", "positions"), ("thd", "cu_seqlens"),
                                           ("sbhd", "offset")])
def test_the_kernel_callback_on_host_buffers(host_callback, in_place, layout, scheme):
    q = host_random(layout_shape(layout, B, S, HQ, D), ml_dtypes.bfloat16, 90)
    k = host_random(layout_shape(layout, B, S, HK, D), ml_dtypes.bfloat16, 91)
    cos, sin = host_tables(ROWS, D // 2, 92)
    kw, pos = scheme_arrays(scheme, layout, 93)
    call, _, _, tables, index = _kernel_rope(q, k, cos, sin, None, kw.get("positions"), kw.get("offset", 0),
                                             kw.get("cu_seqlens"), layout, True, None, 0, False, None, "nvrtc",
                                             in_place)
    f = jax.jit(lambda q, k, t, i: kernel_call.rope(call, q, k, t, i), donate_argnums=(0, 1))
    got = f(jnp.asarray(q), jnp.asarray(k), tables, index)
    name, args, given = host_callback[-1]
    assert name == "apply_rope_qk" and given["backend"] == "numpy" and given["layout"] == layout
    # In place: XLA gave q's and k's own buffers as the results, and the callback says so.
    assert (given["q_out"] is args[0] and given["k_out"] is args[1]) == in_place
    for out, x in zip(got, (q, k)):
        ref = rope_reference(_tokens(x, layout), cos, sin, pos, interleaved=True)
        assert_rope_close(_tokens(out, layout), ref, _tokens(x, layout), interleaved=True)


def test_the_kernel_callback_for_one_tensor_and_a_cos_sin_cache(host_callback):
    x = host_random((B * S, HQ * D), np.float32, 94)
    cos, sin = host_tables(ROWS, D // 2, 95)
    cache = np.concatenate([cos, sin], axis=1)
    call, xx, _, tables, index, flat = checks.check_rope(("x", "k"), x, None, None, None, cache, None, 2, None, None,
                                                         False, None, 0, False, D, "nvrtc", True)
    got = jax.jit(lambda x, t, i: kernel_call.rope(call, x, None, t, i)[0])(xx, tables, index)
    name, args, given = host_callback[-1]
    assert name == "apply_rope" and given["cos_sin_cache"].shape == (ROWS, D) and given["offset"] == 2
    rows = x.reshape(B * S, HQ, D)
    ref = rope_reference(rows, cos, sin, 2 + np.arange(B * S), interleaved=False)
    assert_rope_close(np.asarray(got).reshape(rows.shape), ref, rows, interleaved=False)


@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("in_place", [True, False])
def test_the_cache_callback_writes_the_caches_own_buffers(host_callback, kind, in_place):
    host = cache_inputs("bfloat16", kind, "hnd", seed=100)
    host["slot_mapping"][5] = -1  # the NumPy backend refuses a slot past the cache; the kernel skips it
    scales = [jnp.full((1,), host[n], jnp.float32) if n in host else None for n in ("k_scale", "v_scale")]
    call, arrays = checks.check_cache(*(host[n] for n in CACHE_ARGS), "hnd", kind, *scales, 0, None, False, None,
                                      "nvrtc", in_place)
    q, k, v, tables, index, slots, caches, sc = arrays
    f = jax.jit(lambda q, k, caches: kernel_call.rope_and_cache(call, q, k, v, tables, index, slots, caches, sc),
                donate_argnums=(0, 1, 2))
    got = f(q, k, caches)
    name, args, given = host_callback[-1]
    assert name == "rope_and_cache" and given["kv_cache_dtype"] == kind
    assert (given["q_out"] is args[0] and given["k_out"] is args[1]) == in_place
    for label, out, ref in zip(("q", "k", "k_cache", "v_cache"), got, cache_reference(host, kind, "hnd")):
        np.testing.assert_array_equal(bits(np.asarray(out)), bits(ref), err_msg=label)


def test_vmap_runs_the_callback_once_per_element(host_callback):
    x = host_random((3, S, HQ, D), np.float32, 110)
    cos, sin = host_tables(ROWS, D // 2, 111)
    call, _, _, tables, index, _ = checks.check_rope(("x", "k"), x[0], None, cos, sin, None, None, 1, None, "thd",
                                                     False, None, 0, False, None, "nvrtc", True)
    got = jax.jit(jax.vmap(lambda x: kernel_call.rope(call, x, None, tables, index)[0]))(jnp.asarray(x))
    assert len(host_callback) == 3
    for out, xi in zip(np.asarray(got), x):
        assert_rope_close(out, rope_reference(xi, cos, sin, 1 + np.arange(S), interleaved=False), xi,
                          interleaved=False)


# -- the program lowered for CUDA -----------------------------------------------------------------

# The custom call XLA lowers the kernel's buffer callback to (rope_rtc.jax.kernel_call.COMMAND_BUFFER
# on, the default: XLA may record the launch into its command buffers).
KERNEL_TARGET = "xla_buffer_python_gpu_callback_cmd_buffer"


def _custom_calls(text: str) -> list[str]:
    return re.findall(r"stablehlo\.custom_call @(\w+)\(([^)]*)\)[^\n]*", text)


def test_lowered_for_cuda_the_kernel_takes_donated_buffers(monkeypatch):
    """The kernel branch for CUDA (a buffer callback whose results alias q and k, and donated
    arguments aliasing the results), the jnp reference for the CPU: one program, both platforms."""
    monkeypatch.setattr(kernel_call, "_usable", [None])
    q = jnp.asarray(host_random((B, S, HQ, D), ml_dtypes.bfloat16, 120))
    k = jnp.asarray(host_random((B, S, HK, D), ml_dtypes.bfloat16, 121))
    cos, sin = host_tables(ROWS, D // 2, 122)
    offsets = jnp.asarray(np.array([1, 4], np.int32))
    traced = jax.jit(lambda q, k, o: rj.apply_rope_qk(q, k, cos, sin, offset=o, layout="bshd"),
                     donate_argnums=(0, 1)).trace(q, k, offsets)
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    calls = _custom_calls(cuda)
    assert [name for name, _ in calls] == [KERNEL_TARGET]
    assert "output_operand_aliases" in cuda and "operand_index = 0" in cuda and "operand_index = 1" in cuda
    assert cuda.count("tf.aliasing_output") == 2  # the donated q and k are the results' buffers
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert _custom_calls(cpu) == []


def test_lowered_for_cuda_the_gradient_is_the_kernel_again(monkeypatch):
    monkeypatch.setattr(kernel_call, "_usable", [None])
    x = jnp.asarray(host_random((S, HQ, D), np.float32, 123))
    cos, sin = host_tables(ROWS, D // 2, 124)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(rj.apply_rope(x, cos, sin, layout="thd", offset=2) ** 2)))
    text = grad.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert [name for name, _ in _custom_calls(text)] == [KERNEL_TARGET] * 2


def test_lowered_for_cuda_a_gradient_of_a_gradient_is_the_kernel_again(monkeypatch):
    """Reverse over reverse where a kernel may run: the VJP's rules call the op, not its buffer
    callback, which has no JVP (JAX refused to trace it). Forward mode stays JAX's refusal."""
    monkeypatch.setattr(kernel_call, "_usable", [None])
    x = jnp.asarray(host_random((S, HQ, D), np.float32, 125))
    cos, sin = host_tables(ROWS, D // 2, 126)
    loss = lambda x: jnp.sum(rj.apply_rope(x, cos, sin, layout="thd", offset=2) ** 3)
    hvp = jax.jit(jax.grad(lambda x: jnp.vdot(jax.grad(loss)(x), x)))
    text = hvp.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert [name for name, _ in _custom_calls(text)] == [KERNEL_TARGET] * 4  # two forwards, two backwards
    host = cache_inputs("float32", "auto", "nhd", seed=131)
    args = [jnp.asarray(host[n]) for n in CACHE_ARGS]
    cache_loss = lambda k: jnp.sum(rj.rope_and_cache(*args[:1], k, *args[2:])[2] ** 3)
    jax.jit(jax.grad(lambda k: jnp.vdot(jax.grad(cache_loss)(k), k))).trace(args[1]).lower(lowering_platforms=("cuda",))
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jit(jax.hessian(loss)).trace(x)


@pytest.mark.parametrize("backend", ["jnp", "auto"])
def test_where_no_kernel_can_run_every_mode_of_differentiation_works(monkeypatch, backend):
    """backend="jnp", or no usable GPU: the jnp version alone, which JAX differentiates in every
    mode (jvp, jacfwd, hessian: refused under the custom VJP before), equal to the same
    derivatives of a RoPE written here. backend="jnp" where kernels could run too."""
    monkeypatch.setattr(kernel_call, "_usable", [None] if backend == "jnp" else ["no CUDA driver found (simulated)"])
    x = jnp.asarray(host_random((5, 2, 32), np.float32, 127))
    cos, sin = host_tables(ROWS, 16, 128)
    pos = np.array([3, 0, 7, 1, 2])
    c, s = jnp.asarray(cos[pos])[:, None, :], jnp.asarray(sin[pos])[:, None, :]

    def mine(x):
        x0, x1 = x[..., :16], x[..., 16:]
        return jnp.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time "no kernel here" warning of backend="auto"
        ours = lambda x: rj.apply_rope(x, cos, sin, positions=jnp.asarray(pos), layout="thd", backend=backend)
        t = jnp.asarray(host_random((5, 2, 32), np.float32, 129))
        for got, want in ((jax.jvp(ours, (x,), (t,))[1], jax.jvp(mine, (x,), (t,))[1]),
                          (jax.hessian(lambda x: jnp.sum(ours(x) ** 3))(x), jax.hessian(lambda x: jnp.sum(mine(x) ** 3))(x))):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        host = cache_inputs("float32", "auto", "nhd", seed=132)
        args = [jnp.asarray(host[n]) for n in CACHE_ARGS]
        jax.jacfwd(lambda k: rj.rope_and_cache(args[0], k, *args[2:], backend=backend)[2])(args[1])


def test_lowered_for_cuda_the_cache_results_alias_the_caches(monkeypatch):
    monkeypatch.setattr(kernel_call, "_usable", [None])
    host = cache_inputs("bfloat16", "auto", "nhd", seed=130)
    args = [jnp.asarray(host[n]) for n in CACHE_ARGS]
    traced = jax.jit(lambda *a: rj.rope_and_cache(*a, in_place=False), donate_argnums=(7, 8)).trace(*args)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    (name, operands), = _custom_calls(text)
    assert name == KERNEL_TARGET
    # q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache: the caches are operands 7 and 8
    aliases = re.findall(r"output_tuple_indices = \[(\d)\], operand_index = (\d+)", text)
    assert sorted(aliases) == [("2", "7"), ("3", "8")]


# -- docs/jax.md ----------------------------------------------------------------------------------

EXAMPLES = re.findall(r"<!-- example: \w+ -->\n```python\n(.*?)```", DOCS.read_text(), re.S) if DOCS.exists() else []


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"jax.md[{i}]" for i in range(len(EXAMPLES))])
def test_docs_examples_run_on_the_cpu(code):
    """The page's examples run as written here too (on the jnp reference)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no kernels here: the fallback says so once
        exec(compile(code, "docs/jax.md", "exec"), {"__name__": "example"})


# -- the kernel's callback on CuPy arrays, down to the launch (tests/fakes.py's FakeGPU) -----------

class FakeXlaBuffer:
    """What XLA hands a GPU buffer callback, for memory that does not exist: a shape, a dtype (one
    that names bfloat16), ``__cuda_array_interface__`` (version 2, no strides, no stream) and the
    DLPack device (CUDA, ordinal 0)."""

    def __init__(self, shape, dtype, address: int, writeable: bool) -> None:
        self.shape, self.dtype, self.address, self.writeable = tuple(shape), np.dtype(dtype), address, writeable

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.address, not self.writeable),
                "version": 2}

    def __dlpack_device__(self) -> tuple[int, int]:
        return 2, 0


class FakeContext:
    stream = 0x5EED


@pytest.fixture
def fake_gpu():
    """conftest's ``gpu`` (a FakeGPU recording launches), which builds real CuPy arrays over fake
    addresses: skipped where CuPy is missing."""
    pytest.importorskip("cupy", reason="CuPy is not installed (the rope-rtc[cuda13] extra)")
    from fakes import FakeGPU

    with FakeGPU() as fake:
        yield fake


@pytest.mark.parametrize("in_place", [True, False])
def test_the_kernel_callback_launches_on_xlas_stream_over_xlas_buffers(fake_gpu, monkeypatch, in_place):
    """The callback as XLA's GPU handler calls it: each buffer becomes a CuPy array over its
    memory, an aliased result is its input's very array (in place), and the CuPy API launches
    once, on XLA's stream, with the buffers' addresses."""
    from fakes import fake_alloc

    monkeypatch.setattr(kernel_call, "launch_stream", lambda ctx, device: ctx.stream)  # no device to make current
    bf16 = np.dtype(ml_dtypes.bfloat16)
    shapes = {"q": ((B, S, HQ, D), bf16), "k": ((B, S, HK, D), bf16), "cos": ((ROWS, D // 2), np.float32),
              "sin": ((ROWS, D // 2), np.float32), "offsets": ((B,), np.int32)}
    ins = {n: FakeXlaBuffer(s, dt, fake_alloc(int(np.prod(s)) * np.dtype(dt).itemsize), False)
           for n, (s, dt) in shapes.items()}
    outs = [FakeXlaBuffer(ins[n].shape, bf16, ins[n].address if in_place else fake_alloc(1 << 16), True)
            for n in ("q", "k")]
    call, *_ = checks.check_rope(("q", "k"), np.zeros((B, S, HQ, D), bf16), np.zeros((B, S, HK, D), bf16),
                                 np.zeros((ROWS, D // 2), np.float32), np.zeros((ROWS, D // 2), np.float32), None,
                                 None, np.zeros((B,), np.int32), None, "bshd", False, None, 0, False, None, "nvrtc",
                                 in_place)
    order = kernel_call.rope_order(call)
    assert order == ("q", "k", "cos", "sin", "offsets")
    kernel_call._rope_callback(call, order)(FakeContext(), outs, *(ins[n] for n in order))
    (launch,) = fake_gpu.launches
    assert launch["stream"] == FakeContext.stream
    addresses = _addresses(launch.get("params", launch.get("fixed")))
    for name in ("q", "k", "cos", "offsets"):
        assert ins[name].address in addresses, name
    for out in outs:
        assert out.address in addresses


def _addresses(block) -> set[int]:
    """Every integer held by a recorded argument block (addresses among them)."""
    found = set()
    for name, _ in type(block)._fields_:
        value = getattr(block, name)
        found |= {int(v) for v in value} if isinstance(value, ctypes.Array) else {int(value)}
    return found


def test_the_cache_callback_launches_once_over_the_caches_own_buffers(fake_gpu, monkeypatch):
    from fakes import fake_alloc

    monkeypatch.setattr(kernel_call, "launch_stream", lambda ctx, device: ctx.stream)
    host = cache_inputs("bfloat16", "fp8_e4m3", "nhd", seed=140)
    scales = (np.ones(1, np.float32), np.ones(1, np.float32))
    call, arrays = checks.check_cache(*(host[n] for n in CACHE_ARGS), "nhd", "fp8_e4m3", *scales, 0, None, False,
                                      None, "nvrtc", True)
    q, k, v, tables, index, slots, caches, sc = arrays
    named = dict(zip(kernel_call.CACHE_ORDER, (q, k, v, *tables, *index, slots, *caches, *sc)))
    order = tuple(n for n in kernel_call.CACHE_ORDER if named[n] is not None)
    ins = {n: FakeXlaBuffer(named[n].shape, named[n].dtype, fake_alloc(named[n].size * named[n].dtype.itemsize),
                            False) for n in order}
    outs = [FakeXlaBuffer(ins[n].shape, ins[n].dtype, ins[n].address, True) for n in ("q", "k", "k_cache", "v_cache")]
    kernel_call._cache_callback(call, order)(FakeContext(), outs, *(ins[n] for n in order))
    (launch,) = fake_gpu.launches
    assert launch["stream"] == FakeContext.stream and "cache" in launch
    held = _addresses(launch["cache"])
    for name in ("q", "k", "v", "slot_mapping", "k_cache", "v_cache", "k_scale", "v_scale", "positions"):
        assert ins[name].address in held, name


def test_a_cache_result_in_a_buffer_of_its_own_is_refused(fake_gpu, monkeypatch):
    """The caches are always aliased; were XLA ever to give their results other buffers, the
    write would land where nobody reads it: the callback refuses before launching."""
    from fakes import fake_alloc

    monkeypatch.setattr(kernel_call, "launch_stream", lambda ctx, device: ctx.stream)
    host = cache_inputs("bfloat16", "auto", "nhd", seed=150)
    call, arrays = checks.check_cache(*(host[n] for n in CACHE_ARGS), "nhd", "auto", None, None, 0, None, False, None,
                                      "nvrtc", True)
    q, k, v, tables, index, slots, caches, sc = arrays
    named = dict(zip(kernel_call.CACHE_ORDER, (q, k, v, *tables, *index, slots, *caches, *sc)))
    order = tuple(n for n in kernel_call.CACHE_ORDER if named[n] is not None)
    ins = {n: FakeXlaBuffer(named[n].shape, named[n].dtype, fake_alloc(named[n].size * named[n].dtype.itemsize),
                            False) for n in order}
    outs = [FakeXlaBuffer(ins[n].shape, ins[n].dtype, fake_alloc(1 << 20), True)
            for n in ("q", "k", "k_cache", "v_cache")]
    with pytest.raises(RuntimeError, match="input_output_aliases"):
        kernel_call._cache_callback(call, order)(FakeContext(), outs, *(ins[n] for n in order))
    assert fake_gpu.launches == []
