"""rope_rtc.jax on the GPU: the kernels inside ``jax.jit`` through XLA's buffer callback.

- values: bit for bit what the CuPy API's kernels compute (``rope_kernel_arithmetic``, the
  kernels' arithmetic), and within the general bound of the float64 reference; the program holds
  the buffer callback (so the kernel ran, not the jnp reference);
- donated q, k and caches are rotated and written where they lie (the results' buffer pointers
  are the inputs'); inputs not donated are left as they were (XLA copied them first);
- the cache write: every byte of both caches, poisoned with random bytes, against the NumPy
  reference; FP8 too;
- gradients: the inverse rotation by the kernel, equal to the CuPy API's ``inverse=True`` bit for
  bit, and to ``jax.grad`` of the jnp version within the bound; the cache write's against JAX's
  own derivative of the jnp version; against torch autograd where torch is installed;
- no host synchronisation: the callback returns while the GPU is still busy with a kernel queued
  before it on XLA's stream;
- vmap, and outputs XLA allocates (out of place) checked for every element.

Needs JAX with its CUDA backend (the device image has it); JAX must not preallocate the GPU's
memory, which the other GPU tests of the process need (set here before JAX starts)."""

from __future__ import annotations

import os
import time

import ml_dtypes
import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from gpu_util import DTYPES, cache_write_host, host_random, host_tables, keep_busy  # noqa: E402
from helpers import CACHE_ARGS, bits, cache_write_reference, layout_shape, token_rows  # noqa: E402
from rope_rtc.reference import assert_rope_close, rope_kernel_arithmetic, rope_reference  # noqa: E402

pytestmark = pytest.mark.gpu

B, S, HQ, HK, D, ROWS = 2, 7, 8, 2, 64, 128
T, NB, BS = 9, 4, 8


@pytest.fixture(scope="module")
def jax():
    """JAX, every computation on its first CUDA device. A JAX without a CUDA backend skips (a
    failure under ROPE_RTC_REQUIRE_GPU=1: the device image has one)."""
    jax = pytest.importorskip("jax", reason='JAX is not installed (pip install "rope-rtc[jax]" "jax[cuda13]")')
    try:
        gpus = jax.devices("cuda")
    except RuntimeError as exc:
        pytest.skip(f"JAX {jax.__version__} has no CUDA backend ({exc}); pip install \"jax[cuda13]\"")
    with jax.default_device(gpus[0]):
        yield jax


@pytest.fixture(scope="module")
def rj(jax):
    import rope_rtc.jax as rj

    return rj


def _tokens(a, layout: str) -> np.ndarray:
    return token_rows(np.asarray(a), layout)


def _positions(scheme: str, layout: str, seed: int, jnp):
    """The position arguments of ``scheme`` and every token's position in (b, s) order."""
    rng = np.random.default_rng(seed)
    nb, ns = (1, B * S) if layout == "thd" else (B, S)
    s = np.arange(ns)
    if scheme == "positions":
        pos = rng.integers(0, ROWS, (nb, ns))
        return {"positions": jnp.asarray((pos.reshape(-1) if layout == "thd" else pos).astype(np.int32))}, pos.reshape(-1)
    if scheme == "offset":
        return {"offset": 5}, np.tile(5 + s, nb)
    if scheme == "offsets":
        starts = rng.integers(0, ROWS - ns, nb)
        return {"offset": jnp.asarray(starts.astype(np.int32))}, (starts[:, None] + s[None, :]).reshape(-1)
    cu = np.arange(B + 1) * S  # cu_seqlens: B packed sequences of S tokens
    starts = rng.integers(0, ROWS - S, B)
    return ({"cu_seqlens": jnp.asarray(cu.astype(np.int32)), "offset": jnp.asarray(starts.astype(np.int32))},
            (starts[:, None] + np.arange(S)[None, :]).reshape(-1))


def _holds_the_kernel(jitted, *args) -> bool:
    return "xla_buffer_python_gpu_callback" in jitted.lower(*args).as_text()


def _poison_allocator(jax, shapes_dtypes) -> None:
    """Leave NaN in the memory XLA's allocator hands out next: an output element the kernel fails
    to write then shows (an output XLA allocates cannot be filled beforehand)."""
    import jax.numpy as jnp

    junk = [jnp.full(shape, jnp.nan, dtype) for shape, dtype in shapes_dtypes for _ in range(2)]
    jax.block_until_ready(junk)
    for a in junk:
        a.delete()


CASES = [("bshd", "positions", "bfloat16"), ("bhsd", "offsets", "float16"), ("sbhd", "offset", "float32"),
         ("thd", "cu_seqlens", "bfloat16"), ("thd", "positions", "float32")]


@pytest.mark.parametrize("layout,scheme,dtype", CASES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("in_place", [True, False])
def test_values_inside_jit_are_the_kernels(jax, rj, layout, scheme, dtype, interleaved, in_place):
    import jax.numpy as jnp

    dt = DTYPES[dtype]
    q = host_random(layout_shape(layout, B, S, HQ, D), dt, 1, 2.0)
    k = host_random(layout_shape(layout, B, S, HK, D), dt, 2, 2.0)
    cos, sin = host_tables(ROWS, D // 2, 3)
    kw, pos = _positions(scheme, layout, 4, jnp)
    f = jax.jit(lambda q, k: rj.apply_rope_qk(q, k, cos, sin, layout=layout, interleaved=interleaved,
                                              in_place=in_place, **kw), donate_argnums=(0, 1))
    assert _holds_the_kernel(f, jnp.asarray(q), jnp.asarray(k))
    _poison_allocator(jax, [(q.shape, dt), (k.shape, dt)])
    got = f(jnp.asarray(q), jnp.asarray(k))
    for out, x in zip(got, (q, k)):
        assert out.dtype == x.dtype and out.shape == x.shape
        rows = _tokens(x, layout)
        want = rope_kernel_arithmetic(rows, cos, sin, pos, interleaved=interleaved)
        np.testing.assert_array_equal(bits(_tokens(out, layout)), bits(want))
        ref = rope_reference(rows, cos, sin, pos, interleaved=interleaved)
        assert_rope_close(_tokens(out, layout), ref, rows, interleaved=interleaved)


def test_cos_sin_cache_flat_heads_and_a_partial_window(jax, rj):
    import jax.numpy as jnp

    n = B * S
    x = host_random((n, HQ * D), ml_dtypes.bfloat16, 5)
    cos, sin = host_tables(ROWS, 16, 6)
    cache = np.concatenate([cos, sin], axis=1)
    f = jax.jit(lambda x: rj.apply_rope(x, cos_sin_cache=cache, offset=3, head_dim=D, rotary_dim=32,
                                        rotary_offset=16, inverse=True))
    assert _holds_the_kernel(f, jnp.asarray(x))
    got = np.asarray(f(jnp.asarray(x)))
    assert got.shape == x.shape
    rows = x.reshape(n, HQ, D)
    ref = rope_reference(rows, cos, sin, 3 + np.arange(n), interleaved=False, rotary_dim=32, rotary_offset=16,
                         inverse=True)
    assert_rope_close(got.reshape(rows.shape), ref, rows, interleaved=False, rotary_dim=32, rotary_offset=16)


def test_donated_q_and_k_are_rotated_where_they_lie(jax, rj):
    import jax.numpy as jnp

    q = jnp.asarray(host_random((B, S, HQ, D), ml_dtypes.bfloat16, 7))
    k = jnp.asarray(host_random((B, S, HK, D), ml_dtypes.bfloat16, 8))
    cos, sin = host_tables(ROWS, D // 2, 9)
    f = jax.jit(lambda q, k: rj.apply_rope_qk(q, k, cos, sin, layout="bshd"), donate_argnums=(0, 1))
    f(jnp.array(q), jnp.array(k))  # compiled (and the kernels loaded) before the pointers are taken
    qd, kd = jnp.array(q), jnp.array(k)
    pointers = qd.unsafe_buffer_pointer(), kd.unsafe_buffer_pointer()
    qo, ko = f(qd, kd)
    assert (qo.unsafe_buffer_pointer(), ko.unsafe_buffer_pointer()) == pointers
    assert qd.is_deleted() and kd.is_deleted()


def test_inputs_not_donated_stay_as_they_were(jax, rj):
    import jax.numpy as jnp

    host = host_random((B, S, HQ, D), np.float32, 10)
    x = jnp.asarray(host)
    cos, sin = host_tables(ROWS, D // 2, 11)
    y = jax.jit(lambda x: rj.apply_rope(x, cos, sin, layout="bshd"))(x)  # in place: XLA copies x first
    np.testing.assert_array_equal(np.asarray(x), host)
    assert y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    ref = rope_reference(_tokens(host, "bshd"), cos, sin, np.tile(np.arange(S), B), interleaved=False)
    assert_rope_close(_tokens(y, "bshd"), ref, _tokens(host, "bshd"), interleaved=False)


# -- the cache write ------------------------------------------------------------------------------

def _cache_host(dtype: str, kind: str, kv_layout: str, seed: int) -> dict:
    return cache_write_host(dtype, kind, kv_layout, seed, tokens=T, heads=(HQ, HK), head_dim=D, blocks=NB,
                            block_size=BS, rows=ROWS)


def _cache_reference(host: dict, kind: str, kv_layout: str, scales: dict):
    return cache_write_reference(host, kind, kv_layout, NB * BS, scales.get("k_scale"), scales.get("v_scale"))


@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("kv_layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_cache_write_writes_the_donated_caches_where_they_lie(jax, rj, kind, kv_layout, dtype):
    import jax.numpy as jnp

    host = _cache_host(dtype, kind, kv_layout, 20)
    scales = {"k_scale": 0.004, "v_scale": 0.02} if kind != "auto" else {}
    f = jax.jit(lambda q, k, kc, vc: rj.rope_and_cache(q, k, host["v"], host["cos"], host["sin"], host["positions"],
                                                       host["slot_mapping"], kc, vc, kv_layout=kv_layout,
                                                       kv_cache_dtype=kind, **scales),
                donate_argnums=(0, 1, 2, 3))
    args = lambda: [jnp.asarray(host[n]) for n in ("q", "k", "k_cache", "v_cache")]  # noqa: E731
    assert _holds_the_kernel(f, *args())
    f(*args())  # compiled and loaded first
    fresh = args()
    pointers = [a.unsafe_buffer_pointer() for a in fresh]
    got = f(*fresh)
    assert [a.unsafe_buffer_pointer() for a in got] == pointers  # nothing copied, the caches included
    for name, out, ref in zip(("q", "k", "k_cache", "v_cache"), got, _cache_reference(host, kind, kv_layout, scales)):
        np.testing.assert_array_equal(bits(np.asarray(out)), bits(ref), err_msg=name)


def test_a_cache_not_donated_is_copied_by_xla_and_left_as_it_was(jax, rj):
    import jax.numpy as jnp

    host = _cache_host("bfloat16", "auto", "nhd", 30)
    arrays = {n: jnp.asarray(host[n]) for n in CACHE_ARGS}
    got = jax.jit(lambda *a: rj.rope_and_cache(*a))(*(arrays[n] for n in CACHE_ARGS))
    for name in ("k_cache", "v_cache"):
        np.testing.assert_array_equal(bits(np.asarray(arrays[name])), bits(host[name]), err_msg=name)
    for name, out, ref in zip(("q", "k", "k_cache", "v_cache"), got, _cache_reference(host, "auto", "nhd", {})):
        np.testing.assert_array_equal(bits(np.asarray(out)), bits(ref), err_msg=name)


# -- gradients ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout,scheme", [("bshd", "positions"), ("thd", "cu_seqlens")])
def test_grad_is_the_kernels_inverse_rotation(jax, rj, cp, dtype, layout, scheme):
    import jax.numpy as jnp

    import rope_rtc

    dt = DTYPES[dtype]
    q = host_random(layout_shape(layout, B, S, HQ, D), dt, 40)
    k = host_random(layout_shape(layout, B, S, HK, D), dt, 41)
    # Cotangents the loss hands back exactly: values of the input dtype.
    wq = host_random(q.shape, dt, 42).astype(np.float32)
    wk = host_random(k.shape, dt, 43).astype(np.float32)
    cos, sin = host_tables(ROWS, D // 2, 44)
    kw, pos = _positions(scheme, layout, 45, jnp)

    def loss(backend):
        def f(q, k):
            qr, kr = rj.apply_rope_qk(q, k, cos, sin, layout=layout, backend=backend, **kw)
            return jnp.sum(qr.astype(jnp.float32) * wq) + jnp.sum(kr.astype(jnp.float32) * wk)
        return f

    grad = jax.jit(jax.grad(loss("nvrtc"), argnums=(0, 1)))
    # The backward's launch is the kernel's: the one callback of the program (the loss is linear,
    # so the gradient needs no value of the forward, and JAX drops the forward's launch).
    assert grad.lower(jnp.asarray(q), jnp.asarray(k)).as_text().count("xla_buffer_python_gpu_callback") == 1
    gq, gk = grad(jnp.asarray(q), jnp.asarray(k))
    # The CuPy API's inverse rotation of the same cotangents: the same kernel, bit for bit.
    dev = {n: cp.asarray(a) for n, a in (("wq", wq.astype(dt)), ("wk", wk.astype(dt)), ("cos", cos), ("sin", sin))}
    extra = {n: cp.asarray(np.asarray(v)) if not isinstance(v, int) else v for n, v in kw.items()}
    want = rope_rtc.apply_rope_qk(dev["wq"], dev["wk"], dev["cos"], dev["sin"], layout=layout, inverse=True, **extra)
    for g, w in zip((gq, gk), want):
        np.testing.assert_array_equal(bits(np.asarray(g)), bits(cp.asnumpy(w)))
    # jax.grad of the jnp version: the same inverse rotation, within the bound.
    pq, pk = jax.jit(jax.grad(loss("jnp"), argnums=(0, 1)))(jnp.asarray(q), jnp.asarray(k))
    for g, p, w in ((gq, pq, wq), (gk, pk, wk)):
        rows = _tokens(w.astype(dt), layout)
        ref = rope_reference(rows, cos, sin, pos, interleaved=False, inverse=True)
        assert_rope_close(_tokens(g, layout), ref, rows, interleaved=False)
        assert_rope_close(_tokens(p, layout), ref, rows, interleaved=False)


def test_the_cache_writes_grad_equals_jaxs_own_derivative_of_the_jnp_version(jax, rj):
    import jax.numpy as jnp

    from rope_rtc.jax import checks, jnp_rope

    host = _cache_host("float32", "auto", "hnd", 50)
    host["slot_mapping"][5] = -1
    w = [host_random(s, np.float32, 51 + i) for i, s in enumerate(((T, HQ, D), (T, HK, D), host["k_cache"].shape,
                                                                   host["k_cache"].shape))]
    call, arrays = checks.check_cache(*(host[n] for n in CACHE_ARGS), "hnd", "auto", None, None, 0, None, False, None,
                                      "jnp", True)

    def loss(fn):
        return lambda q, k, v, kc, vc: sum(jnp.sum(o * wi) for o, wi in zip(fn(q, k, v, kc, vc), w))

    ours = loss(lambda q, k, v, kc, vc: rj.rope_and_cache(q, k, v, host["cos"], host["sin"], host["positions"],
                                                           host["slot_mapping"], kc, vc, kv_layout="hnd",
                                                           backend="nvrtc"))
    plain = loss(lambda q, k, v, kc, vc: jnp_rope.rope_and_cache(call, q, k, v, arrays[3], arrays[4], arrays[5],
                                                                  (kc, vc), arrays[7]))
    args = [jnp.asarray(host[n]) for n in ("q", "k", "v", "k_cache", "v_cache")]
    got = jax.jit(jax.grad(ours, argnums=tuple(range(5))))(*args)
    want = jax.jit(jax.grad(plain, argnums=tuple(range(5))))(*args)
    for name, g, p in zip(("q", "k", "v", "k_cache", "v_cache"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(p), rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.device
def test_kernel_grad_is_what_torch_autograd_computes(jax, rj):
    """Against torch autograd of transformers' Llama apply_rotary_pos_emb (the device has both)."""
    import jax.numpy as jnp
    from test_jax_gradients import _check, _inputs, _torch_rope_grads

    q, k, wq, wk, cos, sin, pos = _inputs(60)
    tq, tk = _torch_rope_grads(q, k, wq, wk, cos, sin, pos)
    positions = jnp.asarray(pos.astype(np.int32))

    def loss(q, k):
        qr, kr = rj.apply_rope_qk(q, k, cos, sin, positions=positions, layout="bhsd", backend="nvrtc")
        return (qr * wq).sum() + (kr * wk).sum()

    dq, dk = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(q), jnp.asarray(k))
    _check(np.asarray(dq), tq, wq, pos, cos, sin)
    _check(np.asarray(dk), tk, wk, pos, cos, sin)


# -- no synchronisation, vmap ---------------------------------------------------------------------

def test_the_callback_returns_while_the_gpu_is_busy(jax, rj, cp, monkeypatch):
    """The kernel's callback queued behind a spinning kernel of the same program (on XLA's stream)
    returns without waiting for it: it never synchronises the stream or the device. Staged with
    command buffers off, so that the callback runs at every execution (as it does wherever XLA
    does not record it)."""
    import jax.numpy as jnp
    from jax.experimental.buffer_callback import buffer_callback

    import rope_rtc.ops.rope as ops_rope
    from rope_rtc.jax import kernel_call

    monkeypatch.setattr(kernel_call, "COMMAND_BUFFER", False)

    x = jnp.asarray(host_random((B, S, HQ, D), np.float32, 71))
    cos, sin = host_tables(ROWS, D // 2, 72)

    def spin(ctx, out, x_in):  # out is x's own buffer (aliased): nothing to write
        cp.cuda.runtime.setDevice(x_in.__dlpack_device__()[1])  # XLA's thread: the device's context current
        keep_busy(cp, cp.cuda.ExternalStream(ctx.stream), 400_000_000)  # a fifth of a second or so

    busy = buffer_callback(spin, jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={0: 0})
    f = jax.jit(lambda x: rj.apply_rope(busy(x), cos, sin, layout="bshd", backend="nvrtc"))
    f(x).block_until_ready()  # compiled, kernels loaded
    spans = []
    real = ops_rope.apply_rope

    def timed(*args, **kw):
        t = time.perf_counter()
        result = real(*args, **kw)
        spans.append(time.perf_counter() - t)
        return result

    monkeypatch.setattr(ops_rope, "apply_rope", timed)
    t0 = time.perf_counter()
    y = f(x)
    y.block_until_ready()
    total = time.perf_counter() - t0
    assert len(spans) == 1
    assert total > 0.05, f"the spinning kernel took {total:.4f} s: too short to tell"
    assert spans[0] < 0.25 * total, f"the callback took {spans[0]:.4f} s of a {total:.4f} s program"
    ref = rope_reference(_tokens(np.asarray(x), "bshd"), cos, sin, np.tile(np.arange(S), B), interleaved=False)
    assert_rope_close(_tokens(y, "bshd"), ref, _tokens(np.asarray(x), "bshd"), interleaved=False)


def test_recorded_launches_follow_buffers_that_move(jax, rj, monkeypatch):
    """With command buffers (``kernel_call.COMMAND_BUFFER``), XLA records the callback's launch
    and replays it: five argument sets in distinct buffers, all alive at once so that no two share
    an address, each run twice through one jitted step (not donated, so each step's results are
    new buffers too), give the kernels' bits every time."""
    import jax.numpy as jnp

    from rope_rtc.jax import kernel_call

    monkeypatch.setattr(kernel_call, "COMMAND_BUFFER", True)
    cos, sin = host_tables(ROWS, D // 2, 100)
    hosts = [(host_random((B, 1, HQ, D), ml_dtypes.bfloat16, 101 + i), host_random((B, 1, HK, D), ml_dtypes.bfloat16, 111 + i),
              np.array([3 + 11 * i, 40 + 7 * i], np.int32)) for i in range(5)]
    step = jax.jit(lambda q, k, starts: rj.apply_rope_qk(q, k, cos, sin, offset=starts, layout="bshd"))
    sets = [tuple(jnp.asarray(a) for a in h) for h in hosts]
    for _ in range(2):
        for (q, k, starts), arrays in zip(hosts, sets):
            qo, ko = step(*arrays)
            for got, x in ((qo, q), (ko, k)):
                want = rope_kernel_arithmetic(x[:, 0], cos, sin, starts, interleaved=False)
                np.testing.assert_array_equal(bits(np.asarray(got)[:, 0]), bits(want))


def test_a_cold_process_records_its_first_launch(tmp_path):
    """With command buffers, a fresh process whose first rope_rtc call of all is inside a jitted
    step, with an empty kernel cache: the compile and the module load happen while XLA records the
    callback, and the step's results are the kernels' bits."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import ml_dtypes, numpy as np, jax, jax.numpy as jnp
        import rope_rtc.jax as rj
        from rope_rtc.jax import kernel_call
        from rope_rtc.reference import rope_kernel_arithmetic
        kernel_call.COMMAND_BUFFER = True
        rng = np.random.default_rng(5)
        x = rng.standard_normal((4, 1, 8, 64)).astype(ml_dtypes.bfloat16)
        ang = rng.uniform(-3, 3, (64, 32))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        starts = np.array([1, 9, 30, 50], np.int32)
        f = jax.jit(lambda x, s: rj.apply_rope(x, cos, sin, offset=s, layout="bshd", backend="nvrtc"))
        for _ in range(3):
            got = np.asarray(f(jnp.asarray(x), jnp.asarray(starts)))
            want = rope_kernel_arithmetic(x[:, 0], cos, sin, starts, interleaved=False)
            assert np.array_equal(got[:, 0].view(np.uint16), want.view(np.uint16))
        print("ok")
    """)
    env = dict(os.environ, ROPE_RTC_CACHE_DIR=str(tmp_path / "cache"), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_vmap_runs_the_kernel_per_element(jax, rj):
    import jax.numpy as jnp

    x = host_random((3, S, HQ, D), ml_dtypes.bfloat16, 80)
    cos, sin = host_tables(ROWS, D // 2, 81)
    f = jax.jit(jax.vmap(lambda x: rj.apply_rope(x, cos, sin, offset=2, layout="thd", backend="nvrtc")))
    got = np.asarray(f(jnp.asarray(x)))
    for out, xi in zip(got, x):
        want = rope_kernel_arithmetic(xi, cos, sin, 2 + np.arange(S), interleaved=False)
        np.testing.assert_array_equal(bits(out), bits(want))


def test_two_calls_in_one_step_each_with_its_own_shapes(jax, rj):
    """A model step: two layers' RoPE, prefill-shaped and decode-shaped, in one program."""
    import jax.numpy as jnp

    cos, sin = host_tables(ROWS, D // 2, 90)
    p = host_random((1, 32, HQ, D), ml_dtypes.bfloat16, 91)
    d = host_random((4, 1, HQ, D), ml_dtypes.bfloat16, 92)
    starts = np.array([3, 17, 40, 99], np.int32)

    @jax.jit
    def step(p, d, starts):
        return (rj.apply_rope(p, cos, sin, layout="bshd"),
                rj.apply_rope(d, cos, sin, offset=starts, layout="bshd"))

    gp, gd = step(jnp.asarray(p), jnp.asarray(d), jnp.asarray(starts))
    np.testing.assert_array_equal(bits(np.asarray(gp)[0]),
                                  bits(rope_kernel_arithmetic(p[0], cos, sin, np.arange(32), interleaved=False)))
    np.testing.assert_array_equal(bits(np.asarray(gd)[:, 0]),
                                  bits(rope_kernel_arithmetic(d[:, 0], cos, sin, starts, interleaved=False)))
