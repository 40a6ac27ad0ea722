"""Host (NumPy) arrays through every public op on a GPU: ``backend="auto"`` (and ``"nvrtc"``)
copies them to the device, runs the kernel and copies the results back, as ``apply_rope`` does:
the same bits as the op on device copies of the arrays, outputs written where the GPU writes
them, and the NumPy backend within the op's contract of the GPU's result."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_util import bits, host_random, host_tables
from rope_rtc import apply_mrope, apply_mrope_qk, apply_qk_norm_rope, apply_rope, rope_and_cache, tail_rope
from rope_rtc.onnx import rotary_embedding
from rope_rtc.reference import (BFLOAT16, assert_rope_close, mrope_reference, qk_norm_error_bound, qk_norm_reference,
                                qk_norm_rope_reference, qk_norm_rope_transformers_reference, rope_and_cache_reference,
                                tail_rope_reference)

pytestmark = pytest.mark.gpu

T, HQ, HK, D = 9, 4, 2, 128
SECTION = (16, 24, 24)


def _device(cp, host: dict) -> dict:
    return {n: cp.asarray(a) if isinstance(a, np.ndarray) else a for n, a in host.items()}


def _same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(bits(got), bits(want))


def _mrope_args(dtype, seed):
    rng = np.random.default_rng(seed)
    cos, sin = host_tables(64, D // 2, seed)
    return dict(q=host_random((T, HQ, D), dtype, seed), k=host_random((T, HK, D), dtype, seed + 1), cos=cos, sin=sin,
                positions=rng.integers(0, 64, (3, T)), mrope_section=SECTION, layout="thd")


@pytest.mark.parametrize("backend", ["auto", "nvrtc"])
@pytest.mark.parametrize("dtype", [BFLOAT16, np.float32], ids=["bfloat16", "float32"])
def test_mrope(backend, dtype):
    import cupy as cp

    kw = _mrope_args(dtype, seed=1)
    q0, k0 = kw["q"].copy(), kw["k"].copy()
    qo, ko = apply_mrope_qk(**kw, backend=backend)
    np.testing.assert_array_equal(bits(kw["q"]), bits(q0))  # out of place: the inputs are untouched
    dq, dk = apply_mrope_qk(**_device(cp, kw))
    _same_bits(qo, cp.asnumpy(dq))
    _same_bits(ko, cp.asnumpy(dk))
    numpy_q, numpy_k = apply_mrope_qk(**kw, backend="numpy")
    ref = mrope_reference(q0, kw["cos"], kw["sin"], kw["positions"], SECTION)
    assert_rope_close(qo, ref, q0, interleaved=False)
    assert_rope_close(numpy_q, ref, q0, interleaved=False)
    # In place: the caller's array receives the result, and is what comes back.
    x = q0.copy()
    assert apply_mrope(x, kw["cos"], kw["sin"], kw["positions"], SECTION, layout="thd", out=x, backend=backend) is x
    _same_bits(x, qo)


@pytest.mark.parametrize("numerics", ["exact", "transformers"])
@pytest.mark.parametrize("backend", ["auto", "nvrtc"])
def test_qk_norm(backend, numerics):
    import cupy as cp

    rng = np.random.default_rng(2)
    cos, sin = host_tables(32, D // 2, 2)
    kw = dict(q=host_random((2, 5, HQ, D), BFLOAT16, 3, 3.0), k=host_random((2, 5, HK, D), BFLOAT16, 4, 3.0),
              q_weight=(1 + 0.2 * rng.standard_normal(D)).astype(BFLOAT16),
              k_weight=(1 + 0.2 * rng.standard_normal(D)).astype(BFLOAT16), cos=cos, sin=sin,
              positions=rng.integers(0, 32, (2, 5)), numerics=numerics, eps=1e-6, layout="bshd")
    q_out, k_out = np.full_like(kw["q"], np.nan), np.full_like(kw["k"], np.nan)
    got = apply_qk_norm_rope(**kw, q_out=q_out, k_out=k_out, backend=backend)
    assert got[0] is q_out and got[1] is k_out
    dq, dk = apply_qk_norm_rope(**_device(cp, kw))
    _same_bits(q_out, cp.asnumpy(dq))
    _same_bits(k_out, cp.asnumpy(dk))
    numpy_q, _ = apply_qk_norm_rope(**kw, backend="numpy")
    flat = kw["q"].reshape(10, HQ, D)
    pos = kw["positions"].reshape(-1)
    gpu_q, cpu_q = q_out.reshape(flat.shape).astype(np.float64), numpy_q.reshape(flat.shape).astype(np.float64)
    if numerics == "exact":
        ref = qk_norm_rope_reference(flat, kw["q_weight"], cos, sin, pos, eps=1e-6, interleaved=False)
        bound = qk_norm_error_bound(qk_norm_reference(flat, kw["q_weight"], eps=1e-6), BFLOAT16,
                                    q_out.reshape(flat.shape), interleaved=False)
        assert (np.abs(gpu_q - ref) <= bound).all() and (np.abs(cpu_q - ref) <= bound).all()
    else:  # the kernel's roundings; its rsqrtf and order of the squares may move a result by one ulp
        want = qk_norm_rope_transformers_reference(flat, kw["q_weight"], cos, sin, pos, eps=1e-6, interleaved=False)
        _same_bits(numpy_q.reshape(flat.shape), want)
        ulps = np.abs(bits(q_out.reshape(flat.shape)).astype(np.int32) - bits(want).astype(np.int32))
        assert ulps.max() <= 1


@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["auto", "nvrtc"])
def test_rope_and_cache(backend, kind):
    import cupy as cp

    rng = np.random.default_rng(5)
    cos, sin = host_tables(32, D // 2, 5)
    cdt = BFLOAT16 if kind == "auto" else np.uint8
    cache = (lambda: host_random((4, 8, HK, D), BFLOAT16, 6)) if kind == "auto" else \
        (lambda: rng.integers(0, 255, (4, 8, HK, D)).astype(cdt))
    slots = rng.permutation(32)[:T].astype(np.int64)
    slots[3] = -1
    kw = dict(q=host_random((T, HQ, D), BFLOAT16, 7), k=host_random((T, HK, D), BFLOAT16, 8),
              v=host_random((T, HK, D), BFLOAT16, 9), cos=cos, sin=sin, positions=rng.integers(0, 32, T),
              slot_mapping=slots, k_cache=cache(), v_cache=cache(), kv_cache_dtype=kind)
    if kind != "auto":
        kw.update(k_scale=np.array([0.25], np.float32), v_scale=np.array([4.0], np.float32))
    before = {n: a.copy() if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    device = _device(cp, before)
    got = rope_and_cache(**kw, backend=backend)
    assert got[0] is kw["q"] and got[1] is kw["k"]  # rotated in place, as on the GPU
    rope_and_cache(**device)
    for n in ("q", "k", "k_cache", "v_cache"):
        _same_bits(kw[n], cp.asnumpy(device[n]))
    want = rope_and_cache_reference(*(before[n] for n in ("q", "k", "v", "cos", "sin", "positions", "slot_mapping",
                                                         "k_cache", "v_cache")), kv_cache_dtype=kind,
                                    k_scale=None if kind == "auto" else 0.25, v_scale=None if kind == "auto" else 4.0)
    for a, b in zip((kw["q"], kw["k"], kw["k_cache"], kw["v_cache"]), want):
        _same_bits(a, b)


@pytest.mark.parametrize("backend", ["auto", "nvrtc"])
def test_tail_rope(backend):
    import cupy as cp

    x = host_random((5, 3, 512), BFLOAT16, 10, 4.0)
    cosine, sine = host_tables(5, 32, 10)
    (out,) = tail_rope(x, cosine, sine, backend=backend)
    _same_bits(out, tail_rope_reference(x, cosine, sine))
    _same_bits(out, cp.asnumpy(tail_rope(cp.asarray(x), cp.asarray(cosine), cp.asarray(sine))["out"]))


def test_host_arrays_mixed_with_device_arrays_name_the_numpy_backend():
    import cupy as cp

    kw = _mrope_args(np.float32, seed=11)
    with pytest.raises(TypeError, match=r"cos: a NumPy \(host\) array is not accepted here.*backend='numpy'"):
        apply_mrope_qk(**dict(_device(cp, kw), cos=kw["cos"]))
    cos, sin = host_tables(16, 8, 12)
    x = cp.asarray(host_random((1, 4, 2, 16), np.float32, 12))
    with pytest.raises(TypeError, match=r"cos: a NumPy \(host\) array is not accepted here.*backend='numpy'"):
        apply_rope(x, cos, cp.asarray(sin), layout="bshd")


def test_the_onnx_operator_and_apply_rope_still_stage_host_arrays():
    cos, sin = host_tables(8, 8, 13)
    X = host_random((1, 2, 4, 16), np.float32, 13)
    ids = np.arange(4).reshape(1, 4)
    y = rotary_embedding(X, cos, sin, ids)
    _same_bits(y, rotary_embedding(X, cos, sin, ids, backend="nvrtc"))
    assert type(apply_rope(X, cos, sin, positions=ids, layout="bhsd")) is np.ndarray
