"""RoPE fused with the paged KV-cache write on the GPU, bit for bit against the NumPy reference:
q_out and k_out (the kernels' arithmetic), and every byte of both caches, poisoned with random
bytes first, so a write at a skipped slot or outside the written entries shows; FP8 entries
bit-exact; scales changed between launches of one plan; CUDA graph capture."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gpu_util import DTYPES, after_current_stream, bits, cache_write_host, host_random, host_tables, poisoned
from rope_rtc.core import dispatch
from rope_rtc.reference import rope_and_cache_reference

pytestmark = pytest.mark.gpu

T, HQ, HK, D, NB, BS, P = 9, 4, 2, 64, 4, 8, 64


def _arrays(cp, dtype, kind, kv_layout, seed=0, rotary_dim=None, heads=(HQ, HK)):
    host = cache_write_host(dtype, kind, kv_layout, seed, tokens=T, heads=heads, head_dim=D, blocks=NB, block_size=BS,
                            rows=P, rotary_dim=rotary_dim, index_dtype=np.int64)
    dev = {n: cp.asarray(a) for n, a in host.items()}
    if kind != "auto":  # small scales: some entries saturate
        for name, value in (("k_scale", 0.004), ("v_scale", 0.02)):
            host[name] = np.float32(value)
            dev[name] = cp.asarray(np.array([value], np.float32))
    return host, dev


CASES = list(itertools.product(["bfloat16", "float16", "float32"], ["auto", "fp8_e4m3", "fp8_e5m2"], ["nhd", "hnd"],
                               [False, True], [None, 32], [True, False]))


@pytest.mark.parametrize("dtype,kind,kv_layout,interleaved,rotary_dim,in_place", CASES)
def test_rope_and_cache_bit_exact(dtype, kind, kv_layout, interleaved, rotary_dim, in_place):
    import cupy as cp

    import rope_rtc

    host, dev = _arrays(cp, dtype, kind, kv_layout, rotary_dim=rotary_dim)
    dt = DTYPES[dtype]
    q_out = None if in_place else poisoned(cp, (T, HQ, D), dt)
    k_out = None if in_place else poisoned(cp, (T, HK, D), dt)
    scales = {n: dev[n] for n in ("k_scale", "v_scale") if n in dev}
    got = rope_rtc.rope_and_cache(dev["q"], dev["k"], dev["v"], dev["cos"], dev["sin"], dev["positions"],
                                  dev["slot_mapping"], dev["k_cache"], dev["v_cache"], kv_layout=kv_layout,
                                  kv_cache_dtype=kind, q_out=q_out, k_out=k_out, interleaved=interleaved,
                                  rotary_dim=rotary_dim, **scales)
    want = rope_and_cache_reference(host["q"], host["k"], host["v"], host["cos"], host["sin"], host["positions"],
                                    host["slot_mapping"], host["k_cache"], host["v_cache"], kv_layout=kv_layout,
                                    kv_cache_dtype=kind, k_scale=host.get("k_scale"), v_scale=host.get("v_scale"),
                                    interleaved=interleaved, rotary_dim=rotary_dim)
    for out, ref in zip(got, want[:2]):
        np.testing.assert_array_equal(bits(cp.asnumpy(out)), bits(ref))
    for name, ref in (("k_cache", want[2]), ("v_cache", want[3])):
        np.testing.assert_array_equal(cp.asnumpy(dev[name]).view(np.uint8), ref.view(np.uint8), err_msg=name)
    if not in_place:
        np.testing.assert_array_equal(bits(cp.asnumpy(dev["q"])), bits(host["q"]))
        np.testing.assert_array_equal(bits(cp.asnumpy(dev["k"])), bits(host["k"]))
    np.testing.assert_array_equal(bits(cp.asnumpy(dev["v"])), bits(host["v"]))


@pytest.mark.parametrize("scheme", ["offset", "cu_seqlens"])
def test_position_schemes(scheme):
    import cupy as cp

    import rope_rtc

    host, dev = _arrays(cp, "bfloat16", "auto", "nhd", seed=5)
    if scheme == "offset":
        kw = {"offset": 11}
        positions = np.arange(T) + 11
    else:
        cu = np.array([0, 4, T], np.int32)
        offs = np.array([3, 20], np.int64)
        kw = {"cu_seqlens": cp.asarray(cu), "offset": cp.asarray(offs)}
        t = np.arange(T)
        seq = np.searchsorted(cu, t, side="right") - 1
        positions = t - cu[seq] + offs[seq]
    rope_rtc.rope_and_cache(dev["q"], dev["k"], dev["v"], dev["cos"], dev["sin"], None, dev["slot_mapping"],
                            dev["k_cache"], dev["v_cache"], **kw)
    want = rope_and_cache_reference(host["q"], host["k"], host["v"], host["cos"], host["sin"], positions,
                                    host["slot_mapping"], host["k_cache"], host["v_cache"])
    np.testing.assert_array_equal(bits(cp.asnumpy(dev["q"])), bits(want[0]))
    np.testing.assert_array_equal(cp.asnumpy(dev["k_cache"]).view(np.uint8), want[2].view(np.uint8))


def test_plan_new_scales_graph_replay_and_capture():
    """One plan: launches on the same arrays replay a graph; a scale changed on the device between
    launches is used by the next; a captured launch replays on refilled buffers."""
    import cupy as cp

    import rope_rtc

    host, dev = _arrays(cp, "bfloat16", "fp8_e4m3", "hnd", seed=9)
    args = [dev[n] for n in ("q", "k", "v", "cos", "sin", "positions", "slot_mapping", "k_cache", "v_cache")]
    q_out, k_out = cp.empty_like(dev["q"]), cp.empty_like(dev["k"])
    kw = dict(kv_layout="hnd", kv_cache_dtype="fp8_e4m3", k_scale=dev["k_scale"], v_scale=dev["v_scale"])
    plan = rope_rtc.RopeCachePlan(*args, q_out=q_out, k_out=k_out, **kw)
    for k_scale in (0.004, 0.5, 0.01):
        dev["k_scale"][...] = k_scale
        plan.execute(*args, q_out=q_out, k_out=k_out, k_scale=dev["k_scale"], v_scale=dev["v_scale"])
        want = rope_and_cache_reference(host["q"], host["k"], host["v"], host["cos"], host["sin"], host["positions"],
                                        host["slot_mapping"], host["k_cache"], host["v_cache"], kv_layout="hnd",
                                        kv_cache_dtype="fp8_e4m3", k_scale=np.float32(k_scale),
                                        v_scale=host["v_scale"])
        np.testing.assert_array_equal(cp.asnumpy(dev["k_cache"]), want[2])
        np.testing.assert_array_equal(bits(cp.asnumpy(k_out)), bits(want[1]))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        plan.execute(*args, q_out=q_out, k_out=k_out, k_scale=dev["k_scale"], v_scale=dev["v_scale"], stream=stream)
        graph = stream.end_capture()
    new_k = host_random((T, HK, D), DTYPES["bfloat16"], 77, 2.0)
    dev["k"][...] = cp.asarray(new_k)
    after_current_stream(cp, stream)
    graph.launch(stream)
    stream.synchronize()
    want = rope_and_cache_reference(host["q"], new_k, host["v"], host["cos"], host["sin"], host["positions"],
                                    host["slot_mapping"], host["k_cache"], host["v_cache"], kv_layout="hnd",
                                    kv_cache_dtype="fp8_e4m3", k_scale=np.float32(0.01), v_scale=host["v_scale"])
    np.testing.assert_array_equal(cp.asnumpy(dev["k_cache"]), want[2])


NAMES = ("q", "k", "v", "cos", "sin", "positions", "slot_mapping", "k_cache", "v_cache")


@pytest.mark.parametrize("heads", [(3, 1), (6, 3), (4, 2)])
@pytest.mark.parametrize("kind", ["auto", "fp8_e5m2"])
def test_head_counts_and_new_arrays_of_one_plan(heads, kind):
    """Odd head counts (one head per thread) and even ones (two); then a second set of arrays of
    the same signature through the same plan (the address-only rebind), every byte checked."""
    import cupy as cp

    import rope_rtc

    for seed in (21, 22):
        host, dev = _arrays(cp, "bfloat16", kind, "nhd", seed=seed, heads=heads)
        scales = {n: dev[n] for n in ("k_scale", "v_scale") if n in dev}
        if seed == 21:
            plan = rope_rtc.RopeCachePlan(*(dev[n] for n in NAMES), kv_cache_dtype=kind, **scales)
        plan.execute(*(dev[n] for n in NAMES), **scales)
        want = rope_and_cache_reference(*(host[n] for n in NAMES), kv_cache_dtype=kind, k_scale=host.get("k_scale"),
                                        v_scale=host.get("v_scale"))
        np.testing.assert_array_equal(bits(cp.asnumpy(dev["q"])), bits(want[0]))
        np.testing.assert_array_equal(bits(cp.asnumpy(dev["k"])), bits(want[1]))
        for name, ref in (("k_cache", want[2]), ("v_cache", want[3])):
            np.testing.assert_array_equal(cp.asnumpy(dev[name]).view(np.uint8), ref.view(np.uint8), err_msg=name)


# Scales on both sides of the kernel's fast-quotient range [2^-64, 2^64] and in it: ordinary, an
# inexact reciprocal (1/3), negative, huge and tiny, subnormal and zero (the exact division path).
FP8_SCALES = (0.05, 1.0 / 3.0, -0.75, 448.0 / 7.0, 2.0 ** -64, 2.0 ** 64, 3.0e-20, 2.0 ** -65, 2.0 ** 65,
              1.0e-30, 3.0e30, 1.0e-40, 0.0)


def _every_input_value(dtype: str) -> np.ndarray:
    """Every bit pattern of a 16-bit dtype (NaNs included); for float32, 2^16 random patterns and
    the special values (zeros, infinities, the extremes of the normal and subnormal ranges)."""
    if dtype != "float32":
        return np.arange(1 << 16, dtype=np.uint16).view(DTYPES[dtype])
    special = np.array([0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1.1754944e-38, 1.0e-45, -1.0e-45,
                        448.0, 464.0, 57344.0, 61440.0], np.float32)
    rand = np.random.default_rng(31).integers(0, 1 << 32, (1 << 16) - special.size, dtype=np.uint64)
    return np.concatenate([special, rand.astype(np.uint32).view(np.float32)])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_entries_of_every_input_value(dtype, kind):
    """v carries every value of its dtype into the cache: each FP8 entry equals the reference's
    (the value divided by the scale in FP32, saturated, rounded to nearest even) for scales inside
    and outside the kernel's fast-quotient range; a NaN value gives an FP8 NaN."""
    import cupy as cp
    import ml_dtypes

    import rope_rtc
    from rope_rtc.reference import fp8_quantize

    hk, d = 2, 64
    values = _every_input_value(dtype)
    t = values.size // (hk * d)
    dt = DTYPES[dtype]
    v = cp.asarray(values.reshape(t, hk, d))
    q, k = (cp.asarray(host_random((t, n, d), dt, 40 + n, 2.0)) for n in (2, hk))
    cos, sin = (cp.asarray(a) for a in host_tables(8, d // 2, 41))
    positions = cp.zeros(t, cp.int64)
    slots = cp.arange(t, dtype=cp.int64)
    shape = (t // BS, BS, hk, d)
    fmt = ml_dtypes.float8_e4m3fn if kind == "fp8_e4m3" else ml_dtypes.float8_e5m2
    nan_in = np.isnan(values.astype(np.float32))
    for scale in FP8_SCALES:
        k_cache, v_cache = cp.zeros(shape, cp.uint8), cp.zeros(shape, cp.uint8)
        k_scale = v_scale = cp.asarray(np.array([scale], np.float32))
        rope_rtc.rope_and_cache(q.copy(), k.copy(), v, cos, sin, positions, slots, k_cache, v_cache,
                                kv_cache_dtype=kind, k_scale=k_scale, v_scale=v_scale)
        got = cp.asnumpy(v_cache).reshape(-1)
        want = fp8_quantize(values, np.float32(scale), kind)
        nan_want = np.isnan(want.view(fmt).astype(np.float32))
        exact = ~nan_want
        bad = np.flatnonzero(got[exact] != want[exact])
        assert bad.size == 0, (f"scale {scale!r}: {bad.size} entries differ, first at value "
                               f"{values[exact][bad[0]]!r}: got {got[exact][bad[0]]:#04x}, want {want[exact][bad[0]]:#04x}")
        assert np.isnan(got[nan_want].view(fmt).astype(np.float32)).all(), f"scale {scale!r}: a NaN quotient's entry"
        assert nan_in.sum() == 0 or nan_want[nan_in].all()


@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3"])
def test_one_calls_with_new_arrays_take_the_repeat_path_and_match_a_fresh_thread(kind):
    """rope_and_cache on new arrays every call (an engine's decode step): from a signature's second
    call the thread's generated path launches; q, k and every byte of both caches equal what the
    same calls give in a thread that has seen nothing."""
    import cupy as cp

    import rope_rtc
    from rope_rtc.ops import kv_cache

    sets = [_arrays(cp, "bfloat16", kind, "nhd", seed=10 * i) for i in range(5)]
    names = ("q", "k", "v", "cos", "sin", "positions", "slot_mapping", "k_cache", "v_cache")

    def run(dev):
        scales = {n: dev[n] for n in ("k_scale", "v_scale") if n in dev}
        rope_rtc.rope_and_cache(*(dev[n] for n in names), kv_cache_dtype=kind, **scales)

    firsts = [{n: a.copy() for n, a in dev.items()} for _, dev in sets]
    for _, dev in sets:
        run(dev)
    assert kv_cache.ONE_CALL.thread().last is not dispatch.NO_LAST
    for (_, dev), first in zip(sets, firsts):
        kv_cache.ONE_CALL.forget()
        run(first)
        for n in ("q", "k", "k_cache", "v_cache"):
            assert np.array_equal(bits(cp.asnumpy(dev[n])) if dev[n].dtype != np.uint8 else cp.asnumpy(dev[n]),
                                  bits(cp.asnumpy(first[n])) if first[n].dtype != np.uint8 else cp.asnumpy(first[n])), n
