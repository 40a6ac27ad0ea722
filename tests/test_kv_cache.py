"""RoPE fused with the paged KV-cache write, on the CPU: the NumPy reference (FP8 encodings checked
by hand, the kernels' arithmetic within the general API's bound), the checks that run before any
launch (fake device arrays, recorded launches), and the argument block."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fakes import BF16, FakeGPU, HostDLPack, fake_cupy
from rope_rtc.core import dispatch
from rope_rtc import rope_and_cache
from rope_rtc.reference import (assert_rope_close, fp8_quantize, rope_and_cache_reference, rope_kernel_arithmetic,
                                rope_reference)

T, HQ, HK, D = 5, 4, 2, 64


@pytest.mark.parametrize("kind,values,scale,bits", [
    ("fp8_e4m3", [1.0, -1.0, 448.0, 1000.0, -1e30, 0.0, 3.0], 1.0, [0x38, 0xB8, 0x7E, 0x7E, 0xFE, 0x00, 0x44]),
    ("fp8_e4m3", [2.0, 896.0], 2.0, [0x38, 0x7E]),
    ("fp8_e5m2", [1.0, -2.0, 57344.0, 1e9, 0.5], 1.0, [0x3C, 0xC0, 0x7B, 0x7B, 0x38]),
])
def test_fp8_encodings_by_hand(kind, values, scale, bits):
    got = fp8_quantize(np.asarray(values, np.float32), scale, kind)
    assert got.dtype == np.uint8
    assert [int(b) for b in got] == bits


def test_fp8_rounds_to_nearest_even():
    # e4m3 near 1: spacing 1/8. 1 + 1/16 is a tie between 1 and 1.125: even (1.0, 0x38) wins;
    # 1 + 3/16 ties 1.125 and 1.25: even (1.25, 0x3A).
    got = fp8_quantize(np.asarray([1.0625, 1.1875], np.float32), 1.0, "fp8_e4m3")
    assert [int(b) for b in got] == [0x38, 0x3A]


def _cache_write_inputs(kv_layout: str, seed: int = 0):
    """Host inputs of one cache write: q, k, v, cos, sin, positions, slot_mapping, and FP8 caches
    of random bytes (as uint8), nhd ``[blocks, block_size, HK, D]`` or hnd ``[blocks, HK, block_size, D]``."""
    rng = np.random.default_rng(seed)
    blocks, block_size = 3, 4
    q = (rng.standard_normal((T, HQ, D)) * 4).astype(np.float32)
    k = (rng.standard_normal((T, HK, D)) * 4).astype(np.float32)
    v = (rng.standard_normal((T, HK, D)) * 200).astype(np.float32)  # past e4m3's 448 after scaling: saturates
    ang = rng.uniform(-9, 9, (16, D // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    positions = rng.integers(0, 16, T).astype(np.int64)
    slots = rng.permutation(blocks * block_size)[:T].astype(np.int64)
    slots[1] = -1  # a token that is not written
    shape = (blocks, block_size, HK, D) if kv_layout == "nhd" else (blocks, HK, block_size, D)
    caches = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(2)]
    return (q, k, v, cos, sin, positions, slots, *caches)


@pytest.mark.parametrize("kind,typed", [("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")])
@pytest.mark.parametrize("kv_layout", ["nhd", "hnd"])
def test_the_reference_writes_typed_fp8_caches_as_their_uint8_storage(kind, typed, kv_layout):
    """Caches typed as ml_dtypes' FP8 hold the same bytes as uint8 storage: a value assigned to
    them was converted from its uint8 encoding (the byte 0xE0 stored as 224.0) instead."""
    import ml_dtypes

    fp8 = np.dtype(getattr(ml_dtypes, typed))
    inputs = _cache_write_inputs(kv_layout)
    options = dict(kv_layout=kv_layout, kv_cache_dtype=kind, k_scale=np.float32(0.05), v_scale=np.float32(0.5))
    want = rope_and_cache_reference(*inputs, **options)
    kc, vc = inputs[-2].view(fp8), inputs[-1].view(fp8)
    before = kc.copy(), vc.copy()
    got = rope_and_cache_reference(*inputs[:-2], kc, vc, **options)
    for g, w in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(g, w)
    for g, w in zip(got[2:], want[2:]):
        assert g.dtype == fp8 and g.shape == w.shape
        np.testing.assert_array_equal(g.view(np.uint8), w)
    assert not np.array_equal(want[2], inputs[-2])  # the call wrote entries
    np.testing.assert_array_equal(kc.view(np.uint8), before[0].view(np.uint8))  # the inputs are not modified
    np.testing.assert_array_equal(vc.view(np.uint8), before[1].view(np.uint8))


@pytest.mark.parametrize("kind,typed,match", [
    ("fp8_e4m3", "float8_e5m2", "float8_e5m2.*fp8_e4m3"),
    ("fp8_e5m2", "float8_e4m3fn", "float8_e4m3fn.*fp8_e5m2"),
    ("auto", "float8_e4m3fn", "float8_e4m3fn.*kv_cache_dtype='auto'"),
])
def test_the_reference_refuses_a_typed_fp8_cache_of_another_format(kind, typed, match):
    import ml_dtypes

    fp8 = np.dtype(getattr(ml_dtypes, typed))
    inputs = _cache_write_inputs("nhd")
    for bad in ("k_cache", "v_cache"):
        kc, vc = inputs[-2], inputs[-1]
        kc, vc = (kc.view(fp8), vc) if bad == "k_cache" else (kc, vc.view(fp8))
        with pytest.raises(TypeError, match=f"{bad}: .*{match}"):
            scales = {} if kind == "auto" else dict(k_scale=np.float32(1), v_scale=np.float32(1))
            rope_and_cache_reference(*inputs[:-2], kc, vc, kv_cache_dtype=kind, **scales)


@pytest.mark.parametrize("change,exc,match", [
    (dict(kv_layout="NHD"), ValueError, r"kv_layout: expected 'nhd' .* or 'hnd' .*, got 'NHD'"),
    (dict(kv_layout=None), ValueError, r"kv_layout: expected 'nhd' .* or 'hnd' .*, got None"),
    (dict(kv_cache_dtype="fp8_e4m3", v_scale=np.ones(1, np.float32)), TypeError,
     "k_scale: an FP8 cache needs a float32 scale"),
    (dict(kv_cache_dtype="fp8_e5m2", k_scale=np.ones(1, np.float32)), TypeError,
     "v_scale: an FP8 cache needs a float32 scale"),
    (dict(k_scale=np.ones(1, np.float32)), ValueError,
     r"k_scale: only FP8 caches take scales \(kv_cache_dtype='auto'\)"),
])
def test_the_reference_refuses_what_the_op_refuses(change, exc, match):
    # It took any layout but "nhd" as "hnd" (an nhd cache then got each entry broadcast over the
    # wrong slots), a missing FP8 scale as NaN (every entry written as NaN) and ignored a scale
    # beside a cache of the input dtype, where the op raises.
    inputs = list(_cache_write_inputs("nhd"))
    if change.get("kv_cache_dtype", "auto") == "auto":  # caches of the input dtype
        inputs[-2:] = [np.zeros(c.shape, np.float32) for c in inputs[-2:]]
    with pytest.raises(exc, match=match):
        rope_and_cache_reference(*inputs, **change)
    names = ("q", "k", "v", "cos", "sin", "positions", "slot_mapping", "k_cache", "v_cache")
    with pytest.raises(exc, match=match):  # the op on the same host inputs, through its NumPy backend
        rope_and_cache(**dict(zip(names, inputs)), **change, backend="numpy")


@pytest.mark.parametrize("typed,kind,hint", [
    ("float8_e4m3fn", "fp8_e4m3", r"; its bytes are k_cache\.view\('uint8'\)$"),
    ("float8_e5m2", "fp8_e5m2", r"; its bytes are k_cache\.view\('uint8'\)$"),
    ("float8_e5m2", "fp8_e4m3", r"; its bytes are k_cache\.view\('uint8'\), with kv_cache_dtype='fp8_e5m2'$"),
    ("float8_e4m3fn", "auto", r"; its bytes are k_cache\.view\('uint8'\), with kv_cache_dtype='fp8_e4m3'$"),
    ("float8_e4m3fnuz", "fp8_e4m3", r"'fp8_e4m3'$"),  # another encoding: no view holds fp8_e4m3 bytes
])
def test_the_op_names_the_uint8_storage_for_a_typed_fp8_cache(typed, kind, hint):
    """rope_and_cache takes FP8 caches as their uint8 storage, as the kernels write them. A cache
    typed as ml_dtypes' FP8 (which the reference accepts) gets a TypeError naming the cache, its
    dtype and, for the two formats the kernels write, the view (and kv_cache_dtype) that fixes it;
    float8_e4m3fn was refused as an unnamed PyTorch bfloat16 to pass through DLPack, as every
    named 1-byte extension type was."""
    import ml_dtypes

    fp8 = np.dtype(getattr(ml_dtypes, typed))
    q, k, v, cos, sin, positions, slots, kc, vc = _cache_write_inputs("nhd")
    scale = np.array([0.5], np.float32)
    fp8_options = dict(k_scale=scale, v_scale=scale) if kind != "auto" else {}
    with pytest.raises(TypeError, match=rf"^k_cache: dtype {typed}, expected .* for kv_cache_dtype='{kind}'") as err:
        rope_and_cache(q, k, v, cos, sin, positions, slots, kc.view(fp8), vc.view(fp8), kv_cache_dtype=kind,
                       backend="numpy", **fp8_options)
    assert re.search(hint, str(err.value)), str(err.value)
    assert "DLPack" not in str(err.value)
    if kind != "auto":  # the uint8 storage is taken
        rope_and_cache(q, k, v, cos, sin, positions, slots, kc, vc, kv_cache_dtype=kind, backend="numpy",
                       **fp8_options)


@pytest.mark.parametrize("dtype", ["float32", "float16", BF16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_kernel_arithmetic_is_within_the_bound(dtype, interleaved):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, HQ, D)).astype(dtype)
    ang = rng.uniform(-9, 9, (32, 24))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = rng.integers(0, 32, T)
    got = rope_kernel_arithmetic(x, cos, sin, pos, interleaved=interleaved, rotary_dim=48)
    ref = rope_reference(x, cos, sin, pos, interleaved=interleaved, rotary_dim=48)
    assert_rope_close(got, ref, x, interleaved=interleaved, rotary_dim=48, dtype=np.dtype(dtype))
    np.testing.assert_array_equal(got[..., 48:], x[..., 48:])


def _call(**change):
    """A valid bf16 call on fake device arrays, with ``change`` applied."""
    kw = dict(q=fake_cupy((T, HQ, D), BF16), k=fake_cupy((T, HK, D), BF16), v=fake_cupy((T, HK, D), BF16),
              cos=fake_cupy((64, D // 2), np.float32), sin=fake_cupy((64, D // 2), np.float32),
              positions=fake_cupy((T,), np.int64), slot_mapping=fake_cupy((T,), np.int64),
              k_cache=fake_cupy((3, 16, HK, D), BF16), v_cache=fake_cupy((3, 16, HK, D), BF16))
    kw.update(change)
    return kw


def test_a_call_launches_once_with_its_block():
    with FakeGPU() as gpu:
        kw = _call(kv_layout="hnd", k_cache=fake_cupy((3, HK, 16, D), BF16), v_cache=fake_cupy((3, HK, 16, D), BF16))
        out = rope_and_cache(**kw)
        assert out == (kw["q"], kw["k"])
        (rec,) = gpu.launches
        p = rec["cache"]
        assert (p.in_[0], p.in_[1], p.in_[2]) == (kw["q"].data.ptr, kw["k"].data.ptr, kw["v"].data.ptr)
        assert (p.out[0], p.out[1]) == (kw["q"].data.ptr, kw["k"].data.ptr)
        assert (p.k_cache, p.v_cache) == (kw["k_cache"].data.ptr, kw["v_cache"].data.ptr)
        # hnd: block stride Hk*16*D, head stride 16*D, in-block offset stride D
        assert (p.cache_sb, p.cache_so, p.cache_sh) == (HK * 16 * D, D, 16 * D)
        assert (p.num_slots, p.block_size, p.slot_i64, p.pos_mode) == (48, 16, 1, 2)
        vec, hb = rec["request"].vec, rec["request"].head_batch
        assert hb == 2 and p.total == T * ((HQ + 2 * HK) // hb) * ((D // 2) // vec)
        (gx, _, _), (bx, _, _) = rec["grid"], rec["block"]
        assert gx * bx >= p.total


@pytest.mark.parametrize("change,exc,match", [
    (dict(kv_layout="bhsd"), ValueError, "kv_layout"),
    (dict(kv_cache_dtype="fp8"), ValueError, "kv_cache_dtype"),
    (dict(k_cache=fake_cupy((3, 16, HK, D), np.uint8), v_cache=fake_cupy((3, 16, HK, D), np.uint8)), TypeError,
     "kv_cache_dtype='fp8_e4m3'"),
    (dict(kv_cache_dtype="fp8_e4m3", k_cache=fake_cupy((3, 16, HK, D), np.uint8),
          v_cache=fake_cupy((3, 16, HK, D), np.uint8)), TypeError, "k_scale"),
    (dict(k_scale=fake_cupy((1,), np.float32)), ValueError, "only FP8"),
    (dict(k_cache=fake_cupy((3, 16, 4, D), BF16), v_cache=fake_cupy((3, 16, 4, D), BF16)), ValueError, "4 heads"),
    (dict(v_cache=fake_cupy((4, 16, HK, D), BF16)), ValueError, "v_cache"),
    (dict(v=fake_cupy((T, HK, D), np.float16)), TypeError, "v: dtype float16 differs from k's bfloat16"),
    (dict(v=fake_cupy((T + 1, HK, D), BF16)), ValueError, "v: shape"),
    (dict(slot_mapping=fake_cupy((T + 1,), np.int64)), ValueError, "one slot per token"),
    (dict(slot_mapping=np.array([0, 1, -1, 47, 48])), ValueError, "slot_mapping: entry 4 is 48"),
    (dict(positions=np.array([0, 1, 2, 3, 4])), TypeError, "positions: a NumPy"),
    (dict(k=None), TypeError, "k, v"),
])
def test_bad_calls_are_refused_before_any_launch(change, exc, match):
    with FakeGPU() as gpu:
        with pytest.raises(exc, match=match):
            rope_and_cache(**_call(**change))
        assert gpu.launches == []


def test_caches_may_not_overlap_other_arguments():
    with FakeGPU() as gpu:
        k_cache = fake_cupy((3, 16, HK, D), BF16)
        kw = _call(k_cache=k_cache, v=k_cache[0, :T])  # v lives inside the k cache
        with pytest.raises(ValueError, match="k_cache: overlaps v"):
            rope_and_cache(**kw)
        assert gpu.launches == []


def test_fp8_scales_and_a_host_slot_mapping():
    with FakeGPU() as gpu:
        ks, vs = fake_cupy((1,), np.float32), fake_cupy((), np.float32)
        kw = _call(kv_cache_dtype="fp8_e5m2", k_cache=fake_cupy((3, 16, HK, D), np.uint8),
                   v_cache=fake_cupy((3, 16, HK, D), np.uint8), k_scale=ks, v_scale=vs)
        rope_and_cache(**kw)
        p = gpu.launches[-1]["cache"]
        assert (p.k_scale, p.v_scale) == (ks.data.ptr, vs.data.ptr)
        assert gpu.launches[-1]["request"].kind == 2


def test_a_host_slot_mapping_other_than_numpys_is_refused_before_any_launch():
    """Host slots are taken as a NumPy array, checked value by value and copied to the device; any
    other host array was launched with its host address and its values unchecked."""
    from rope_rtc import RopeCachePlan

    slots = HostDLPack(np.array([0, 1, 10**12, 3, 4, 5][:T], np.int64))
    with FakeGPU() as gpu:
        with pytest.raises(TypeError, match="slot_mapping: a host"):
            rope_and_cache(**_call(slot_mapping=slots))
        with pytest.raises(TypeError, match="slot_mapping: a host"):
            RopeCachePlan(**_call(slot_mapping=slots))
        kw = _call()
        plan = RopeCachePlan(**kw)
        with pytest.raises(TypeError, match="slot_mapping: a host"):
            plan.execute(**dict(kw, slot_mapping=slots))
        assert gpu.launches == []


def test_a_plan_refuses_at_construction_what_execute_would_refuse():
    """q and k are rotated in place unless outputs are given: the plan's own checks treat them so
    (positions inside q are refused when the plan is made, not at its first execute)."""
    from rope_rtc import RopeCachePlan

    q = fake_cupy((T, HQ, D), BF16)
    positions = fake_cupy((T,), np.int64, ptr=q.data.ptr + 64)
    with FakeGPU() as gpu:
        with pytest.raises(ValueError, match="overlaps positions"):
            RopeCachePlan(**_call(q=q, positions=positions))
        assert gpu.launches == []


def test_the_check_positions_switch_covers_the_cache_write(monkeypatch):
    """``ROPE_RTC_CHECK_POSITIONS=1`` reads device positions back before the launch for
    rope_and_cache and RopeCachePlan as for the general API (the read-back itself: GPU tests)."""
    from rope_rtc import RopeCachePlan
    from rope_rtc.ops import kv_cache, rope_request

    checked = []
    monkeypatch.setattr(rope_request, "check_device_positions", lambda req: checked.append(req.positions.ptr))
    kw = _call()
    with FakeGPU() as gpu:
        RopeCachePlan(**kw).execute(**kw)
        rope_and_cache(**kw)
        assert checked == [] and len(gpu.launches) == 2
        monkeypatch.setenv("ROPE_RTC_CHECK_POSITIONS", "1")
        gpu.patch(kv_cache.ONE_CALL, "_local", dispatch.ThreadState())  # plans read the switch when made
        RopeCachePlan(**kw).execute(**kw)
        rope_and_cache(**kw)
        assert checked == [kw["positions"].data.ptr] * 2 and len(gpu.launches) == 4


def test_an_int_offset_at_the_table_end_with_cu_seqlens_is_refused():
    """cu_seqlens with an int offset: every sequence starts there, so offset == table rows is
    outside the table, on the first call and as a plan's new offset."""
    from rope_rtc import RopeCachePlan

    kw = _call(positions=None, cu_seqlens=fake_cupy((2,), np.int32))
    with FakeGPU() as gpu:
        with pytest.raises(ValueError, match="offset: 64 is not a position"):
            rope_and_cache(**kw, offset=64)
        plan = RopeCachePlan(**kw, offset=1)
        plan.execute(**kw, offset=63)
        with pytest.raises(ValueError, match="offset"):
            plan.execute(**kw, offset=64)
        assert len(gpu.launches) == 1


# ---------------------------------------------------------------------------------------------
# regressions: arrays other than CuPy's, alignment of every written array, overlaps, plans

def test_arrays_through_the_cuda_array_interface_launch():
    from fakes import FakeDeviceArray

    f16 = np.float16  # (bfloat16 has no __cuda_array_interface__ type string)
    with FakeGPU() as gpu:
        kw = _call(q=FakeDeviceArray((T, HQ, D), f16), k=fake_cupy((T, HK, D), f16), v=FakeDeviceArray((T, HK, D), f16),
                   k_cache=fake_cupy((3, 16, HK, D), f16), v_cache=fake_cupy((3, 16, HK, D), f16))
        rope_and_cache(**kw)
        p = gpu.launches[-1]["cache"]
        assert (p.in_[0], p.in_[2]) == (kw["q"].ptr, kw["v"].ptr)


def test_a_misaligned_v_cache_gets_narrower_vectors():
    with FakeGPU() as gpu:
        kw = _call(v_cache=fake_cupy((3, 16, HK, D), BF16, byte_offset=2))
        rope_and_cache(**kw)
        vec = gpu.launches[-1]["request"].vec
        assert kw["v_cache"].data.ptr % (vec * 2) == 0 and vec == 1


@pytest.mark.parametrize("case,exc,match", [
    ("slots_misaligned", ValueError, "slot_mapping"),
    ("k_out_is_v", ValueError, "overlaps v"),
    ("slots_inside_k_out", ValueError, "overlaps slot_mapping"),
    ("scale_inside_q_out", ValueError, "overlaps k_scale"),
    ("unhashable_layout", ValueError, "kv_layout"),
    ("cache_overlaps_itself", ValueError, "k_cache: its entries overlap"),
    ("fp8_odd_window", NotImplementedError, "whole vectors"),
])
def test_more_bad_calls_are_refused_before_any_launch(case, exc, match):
    with FakeGPU() as gpu:
        if case == "slots_misaligned":
            kw = _call(slot_mapping=fake_cupy((T,), np.int64, byte_offset=4))
        elif case == "k_out_is_v":
            v = fake_cupy((T, HK, D), BF16)
            kw = _call(v=v, k_out=v, q_out=fake_cupy((T, HQ, D), BF16))
        elif case == "slots_inside_k_out":
            k_out = fake_cupy((T, HK, D), BF16)
            slots = fake_cupy((T,), np.int64, ptr=k_out.data.ptr)
            kw = _call(k_out=k_out, q_out=fake_cupy((T, HQ, D), BF16), slot_mapping=slots)
        elif case == "scale_inside_q_out":
            q_out = fake_cupy((T, HQ, D), BF16)
            kw = _call(q_out=q_out, k_out=fake_cupy((T, HK, D), BF16), kv_cache_dtype="fp8_e4m3",
                       k_cache=fake_cupy((3, 16, HK, D), np.uint8), v_cache=fake_cupy((3, 16, HK, D), np.uint8),
                       k_scale=fake_cupy((1,), np.float32, ptr=q_out.data.ptr), v_scale=fake_cupy((1,), np.float32))
        elif case == "unhashable_layout":
            kw = _call(kv_layout=["nhd"])
        elif case == "cache_overlaps_itself":
            kw = _call(k_cache=fake_cupy((3, 16, HK, D), BF16, strides=(0, HK * D * 2, D * 2, 2)))
        else:
            kw = _call(kv_cache_dtype="fp8_e4m3", k_cache=fake_cupy((3, 16, HK, D), np.uint8),
                       v_cache=fake_cupy((3, 16, HK, D), np.uint8), k_scale=fake_cupy((1,), np.float32),
                       v_scale=fake_cupy((1,), np.float32), rotary_dim=2,
                       cos=fake_cupy((64, 1), np.float32), sin=fake_cupy((64, 1), np.float32))
        with pytest.raises(exc, match=match):
            rope_and_cache(**kw)
        assert gpu.launches == []


def test_a_plan_takes_device_slots_and_stays_on_its_device():
    from rope_rtc import RopeCachePlan

    with FakeGPU() as gpu:
        kw = _call()
        plan = RopeCachePlan(**kw)
        with pytest.raises(TypeError, match="slot_mapping: a plan takes device arrays"):
            plan.execute(**{**kw, "slot_mapping": np.arange(T)})
        other = {n: (fake_cupy(a.shape, a.dtype, device=1) if hasattr(a, "data") else a) for n, a in kw.items()}
        with pytest.raises(ValueError, match="built for device 0"):
            plan.execute(**other)
        assert gpu.launches == []
        plan.execute(**kw)
        assert len(gpu.launches) == 1


def test_caches_reshaped_in_place_are_bound_again():
    """The same cache objects, reshaped in place to another block size (the same memory): the
    next call writes where the caches now say, as a new plan would."""
    from rope_rtc import RopeCachePlan

    with FakeGPU() as gpu:
        kw = _call(k_cache=fake_cupy((3, HK, 16, D), BF16), v_cache=fake_cupy((3, HK, 16, D), BF16))
        plan = RopeCachePlan(**kw, kv_layout="hnd")
        plan.execute(**kw)
        assert gpu.launches[-1]["cache"].block_size == 16
        for name in ("k_cache", "v_cache"):
            kw[name].shape = (6, HK, 8, D)
        plan.execute(**kw)
        p = gpu.launches[-1]["cache"]
        assert (p.block_size, p.cache_sb, p.cache_sh) == (8, HK * 8 * D, 8 * D)


def test_new_arrays_of_a_seen_signature_bind_without_full_validation(monkeypatch):
    """A plan's second call with new arrays of the same shapes, strides and dtypes takes only the
    address checks: full validation does not run again, and the block holds the new addresses."""
    from rope_rtc.ops import kv_cache
    from rope_rtc.ops.kv_cache import RopeCachePlan

    names = ("q", "k", "v", "cos", "sin", "positions", "slot_mapping", "k_cache", "v_cache")
    with FakeGPU() as gpu:
        first = _call()
        plan = RopeCachePlan(**first)
        plan.execute(*(first[n] for n in names))
        calls = []
        real = kv_cache.validate_cache_call
        monkeypatch.setattr(kv_cache, "validate_cache_call", lambda *a, **k: calls.append(1) or real(*a, **k))
        second = _call()
        plan.execute(*(second[n] for n in names))
        assert calls == []
        p = gpu.launches[-1]["cache"]
        assert (p.in_[0], p.in_[1], p.in_[2]) == (second["q"].data.ptr, second["k"].data.ptr, second["v"].data.ptr)
        assert (p.out[0], p.out[1]) == (second["q"].data.ptr, second["k"].data.ptr)
        assert (p.k_cache, p.v_cache, p.slot_mapping) == (second["k_cache"].data.ptr, second["v_cache"].data.ptr,
                                                          second["slot_mapping"].data.ptr)
        assert (p.cos, p.sin, p.positions) == (second["cos"].data.ptr, second["sin"].data.ptr,
                                               second["positions"].data.ptr)


@pytest.mark.parametrize("case,exc,match", [
    ("cache_inside_q", ValueError, "k_cache: overlaps q"),
    ("v_cache_is_k_cache", ValueError, "overlaps"),
    ("slots_inside_k", ValueError, "overlaps slot_mapping"),
])
def test_a_seen_signature_with_overlapping_new_arrays_is_refused(case, exc, match):
    """The address checks of a seen signature send an overlapping call to full validation, which
    refuses it before any launch (the same arrays as a valid call would pass the signature)."""
    from rope_rtc.ops.kv_cache import RopeCachePlan

    names = ("q", "k", "v", "cos", "sin", "positions", "slot_mapping", "k_cache", "v_cache")
    with FakeGPU() as gpu:
        plan = RopeCachePlan(**_call())
        plan.execute(*(_call()[n] for n in names))
        kw = _call()
        if case == "cache_inside_q":  # a cache of the same shape carved out of q's memory
            big = fake_cupy((3 * 16 * HK * D + T * HQ * D,), BF16)
            kw["q"] = big[: T * HQ * D].reshape(T, HQ, D)
            kw["k_cache"] = big[T * HQ * D - 64:][: 3 * 16 * HK * D].reshape(3, 16, HK, D)
        elif case == "v_cache_is_k_cache":
            kw["v_cache"] = kw["k_cache"]
        else:
            kw["slot_mapping"] = kw["k"].reshape(-1)[:4 * T].view(np.int64)
        before = len(gpu.launches)
        with pytest.raises(exc, match=match):
            plan.execute(*(kw[n] for n in names))
        assert len(gpu.launches) == before


def test_heads_per_thread_and_vector_preference():
    from rope_rtc.build.registry import cache_head_batch, cache_vector_widths

    assert cache_head_batch(32, 8, "bfloat16", False, 4) == 2 and cache_head_batch(32, 8, "bfloat16", True, 8) == 2
    assert cache_head_batch(32, 8, "float32", False, 4) == 1 and cache_head_batch(32, 8, "float32", True, 4) == 2
    assert cache_head_batch(32, 1, "bfloat16", False, 4) == 1 and cache_head_batch(3, 2, "bfloat16", False, 4) == 1
    assert cache_vector_widths("bfloat16", False)[0] == 4  # 8-byte halves, as the specialised build
    assert cache_vector_widths("bfloat16", True)[0] == 8 and cache_vector_widths("float32", False)[0] == 2
    # FP8 entries: the widest access first (8-byte entry stores for 2-byte inputs), one head per thread
    assert cache_vector_widths("bfloat16", False, 1)[0] == 8 and cache_vector_widths("float32", False, 2)[0] == 4
    assert cache_head_batch(32, 8, "bfloat16", False, 8) == 1
    with FakeGPU() as gpu:
        rope_and_cache(**_call(q=fake_cupy((T, 3, D), BF16), k=fake_cupy((T, 1, D), BF16),
                               v=fake_cupy((T, 1, D), BF16), k_cache=fake_cupy((3, 16, 1, D), BF16),
                               v_cache=fake_cupy((3, 16, 1, D), BF16)))
        rec = gpu.launches[-1]
        assert rec["request"].head_batch == 1 and rec["cache"].total == T * 5 * ((D // 2) // rec["request"].vec)


def test_a_plan_holds_no_callers_array_after_a_call():
    import gc
    import weakref

    with FakeGPU():
        kw = _call()
        refs = {name: weakref.ref(a) for name, a in kw.items()}
        rope_and_cache(**kw)
        del kw
        gc.collect()
        assert [name for name, r in refs.items() if r() is not None] == []


def test_fused_qkv_views_and_one_kv_allocation_of_new_buffers_bind_without_full_validation(monkeypatch):
    """q, k and v as views of one fused projection, and the k and v caches as the halves of one
    [blocks, 2, block_size, H, D] allocation: new buffers of the same layout take the address checks
    alone (their views meet in extent, at the offsets validation accepted)."""
    from rope_rtc.ops import kv_cache
    from rope_rtc.ops.kv_cache import RopeCachePlan

    def arrays():
        qkv = fake_cupy((T, HQ + 2 * HK, D), BF16)
        kv = fake_cupy((3, 2, 16, HK, D), BF16)
        return dict(q=qkv[:, :HQ], k=qkv[:, HQ:HQ + HK], v=qkv[:, HQ + HK:], cos=fake_cupy((64, D // 2), np.float32),
                    sin=fake_cupy((64, D // 2), np.float32), positions=fake_cupy((T,), np.int64),
                    slot_mapping=fake_cupy((T,), np.int64), k_cache=kv[:, 0], v_cache=kv[:, 1])

    names = ("q", "k", "v", "cos", "sin", "positions", "slot_mapping", "k_cache", "v_cache")
    with FakeGPU() as gpu:
        first = arrays()
        plan = RopeCachePlan(**first)
        plan.execute(*(first[n] for n in names))
        calls = []
        real = kv_cache.validate_cache_call
        monkeypatch.setattr(kv_cache, "validate_cache_call", lambda *a, **k: calls.append(1) or real(*a, **k))
        for _ in range(3):
            new = arrays()
            plan.execute(*(new[n] for n in names))
            assert gpu.launches[-1]["cache"].k_cache == new["k_cache"].data.ptr
        assert calls == []


@pytest.mark.parametrize("option,value,exc", [("interleaved", 1, TypeError), ("rotary_dim", 64.0, TypeError),
                                              ("rotary_dim", [64], TypeError)])
def test_options_of_the_wrong_type_are_refused_after_a_valid_call_too(option, value, exc):
    with FakeGPU() as gpu:
        good = dict(interleaved=True, rotary_dim=64)
        rope_and_cache(**_call(), **good)
        n = len(gpu.launches)
        with pytest.raises(exc, match=option):
            rope_and_cache(**_call(), **{**good, option: value})
        assert len(gpu.launches) == n


def test_a_bool_offset_is_refused_after_an_int_one_of_the_same_signature():
    from rope_rtc.ops.kv_cache import RopeCachePlan

    names = ("q", "k", "v", "cos", "sin", "positions", "slot_mapping", "k_cache", "v_cache")
    with FakeGPU() as gpu:
        kw = _call(positions=None)
        rope_and_cache(**kw, offset=3)
        plan = RopeCachePlan(**kw, offset=3)
        plan.execute(*(kw[n] for n in names), offset=3)
        n = len(gpu.launches)
        for call in (lambda: rope_and_cache(**kw, offset=True),
                     lambda: plan.execute(*(kw[n] for n in names), offset=True)):
            with pytest.raises(TypeError, match="offset"):
                call()
        assert len(gpu.launches) == n


def test_one_misaligned_call_does_not_pin_later_calls_to_narrower_vectors():
    # Regression: the misaligned call's narrower template replaced the signature's one, so every
    # later aligned call of that signature ran the narrow build too (one-call and plan paths).
    from rope_rtc import RopeCachePlan

    with FakeGPU() as gpu:
        rope_and_cache(**_call())
        wide = gpu.launches[-1]["request"].vec
        rope_and_cache(**_call(v_cache=fake_cupy((3, 16, HK, D), BF16, byte_offset=2)))
        assert gpu.launches[-1]["request"].vec == 1 < wide
        rope_and_cache(**_call())
        assert gpu.launches[-1]["request"].vec == wide
        kw = _call()
        plan = RopeCachePlan(**kw)
        plan.execute(**kw)
        assert gpu.launches[-1]["request"].vec == wide
        plan.execute(**_call(v_cache=fake_cupy((3, 16, HK, D), BF16, byte_offset=2)))
        assert gpu.launches[-1]["request"].vec == 1
        plan.execute(**_call())  # new aligned arrays of the same signature
        assert gpu.launches[-1]["request"].vec == wide


@pytest.mark.parametrize("name", ["v", "slot_mapping", "k_cache", "v_cache", "k_scale"])
def test_a_declaration_in_place_of_an_array_is_refused_before_any_launch(name):
    """A TensorDesc declares an array but holds no memory: in v, the slots, a cache or a scale it
    was launched with a null pointer (the RoPE arguments were already refused)."""
    from rope_rtc import RopeCachePlan, TensorDesc

    fp8 = dict(kv_cache_dtype="fp8_e4m3", k_cache=fake_cupy((3, 16, HK, D), np.uint8),
               v_cache=fake_cupy((3, 16, HK, D), np.uint8), k_scale=fake_cupy((1,), np.float32),
               v_scale=fake_cupy((1,), np.float32))
    kw = _call(**fp8)
    real = kw[name]
    kw[name] = TensorDesc(np.dtype(real.dtype), real.shape, device=0)
    with FakeGPU() as gpu:
        with pytest.raises(TypeError, match=f"{name}: a TensorDesc declares an array"):
            rope_and_cache(**kw)
        with pytest.raises(TypeError, match=f"{name}: a TensorDesc declares an array"):
            RopeCachePlan(**kw)
        good = _call(**fp8)
        plan = RopeCachePlan(**good)
        del good["kv_cache_dtype"]  # fixed by the plan
        with pytest.raises(TypeError, match=f"{name}: a TensorDesc declares an array"):
            plan.execute(**dict(good, **{name: kw[name]}))
        assert gpu.launches == []


def _declared(kw: dict) -> dict:
    """``kw`` with every array replaced by its TensorDesc declaration (on device 0)."""
    from rope_rtc import TensorDesc

    return {n: TensorDesc(np.dtype(a.dtype), a.shape, device=0) if hasattr(a, "dtype") else a
            for n, a in kw.items()}


def test_declarations_are_checked_as_arrays_when_allowed():
    """The JAX functions check a cache write at trace time on TensorDesc declarations (``allow_desc``):
    a valid call gives the request its arrays would give, and a wrong one is refused naming the
    argument, as for arrays; without ``allow_desc`` a declaration is refused."""
    from rope_rtc.ops.kv_cache import validate_cache_call

    fp8 = dict(kv_cache_dtype="fp8_e4m3", k_cache=fake_cupy((3, 16, HK, D), np.uint8),
               v_cache=fake_cupy((3, 16, HK, D), np.uint8), k_scale=fake_cupy((1,), np.float32),
               v_scale=fake_cupy((1,), np.float32))
    with FakeGPU():
        for change in ({}, fp8):
            kw = _call(**change)
            real, _ = validate_cache_call(**kw)
            creq, _ = validate_cache_call(**_declared(kw), allow_desc=True)
            assert (creq.kind, creq.vec, creq.rope.num_tokens, creq.rope.rotary_dim, creq.k_cache.shape) == \
                (real.kind, real.vec, real.rope.num_tokens, real.rope.rotary_dim, real.k_cache.shape)
        bad = _declared(_call(v_cache=fake_cupy((3, 16, HK, D // 2), BF16)))
        with pytest.raises(ValueError, match=f"v_cache: holds {HK} heads of dim {D // 2}"):
            validate_cache_call(**bad, allow_desc=True)
        with pytest.raises(TypeError, match="a TensorDesc declares an array"):
            validate_cache_call(**_declared(_call()))


@pytest.mark.parametrize("case,culprit", [
    ("v_cache", "v_cache"),
    ("v", "v"),
    ("fp8_row_stride", "k_cache"),
])
def test_a_misalignment_error_names_the_array(case, culprit):
    with FakeGPU() as gpu:
        if case == "v_cache":
            kw = _call(v_cache=fake_cupy((3, 16, HK, D), BF16, byte_offset=1))
        elif case == "v":
            kw = _call(v=fake_cupy((T, HK, D), BF16, byte_offset=1))
        else:  # uint8 entries with rows 65 bytes apart: no 2-byte access fits
            kw = _call(kv_cache_dtype="fp8_e4m3", k_cache=fake_cupy((3, 16, HK, D + 1), np.uint8)[..., :D],
                       v_cache=fake_cupy((3, 16, HK, D + 1), np.uint8)[..., :D], k_scale=fake_cupy((1,), np.float32),
                       v_scale=fake_cupy((1,), np.float32))
        with pytest.raises(ValueError, match=rf"^{culprit}: "):
            rope_and_cache(**kw)
        assert gpu.launches == []


def test_two_tokens_writing_one_slot_are_refused_when_the_slots_come_from_the_host():
    """Tokens that share a slot race in the kernel (the reference lets the last one win): a host
    slot_mapping is checked for it like for its range; negative slots (skipped) may repeat."""
    with FakeGPU() as gpu:
        with pytest.raises(ValueError, match=r"slot_mapping: entries 1 and 3 both name slot 7"):
            rope_and_cache(**_call(slot_mapping=np.array([0, 7, -1, 7, 9])))
        assert gpu.launches == []
        # The checks alone (the one-call function then copies the slots to the device).
        from rope_rtc.ops.kv_cache import validate_cache_call

        creq, _ = validate_cache_call(**_call(slot_mapping=np.array([0, -1, 2, -1, 9])), allow_host_slots=True)
        assert creq.slots.shape == (T,)


def test_a_misaligned_first_call_does_not_pin_later_aligned_calls():
    # The other order of test_one_misaligned_call_does_not_pin_later_calls_to_narrower_vectors.
    from rope_rtc import RopeCachePlan

    with FakeGPU() as gpu:
        rope_and_cache(**_call(v_cache=fake_cupy((3, 16, HK, D), BF16, byte_offset=2)))
        assert gpu.launches[-1]["request"].vec == 1
        rope_and_cache(**_call())
        wide = gpu.launches[-1]["request"].vec
        assert wide > 1
        kw = _call(v_cache=fake_cupy((3, 16, HK, D), BF16, byte_offset=2))
        plan = RopeCachePlan(**kw)
        plan.execute(**kw)
        assert gpu.launches[-1]["request"].vec == 1
        plan.execute(**_call())
        assert gpu.launches[-1]["request"].vec == wide


def _launched(gpu, call) -> tuple:
    from fakes import launch_outcome

    return launch_outcome(gpu, call, lambda r: (r["fn"][1].vec, r["grid"], r["block"], bytes(r["cache"])))


def test_the_repeat_paths_launch_what_a_cold_call_launches():
    """Episodes of rope_and_cache calls with new arrays (now and then a misaligned v cache, outputs
    apart, another token count, FP8 entries, the hnd layout, an offset past the table): each warm
    call (the thread's last generated path; a plan's quick path) launches the same vector width,
    grid and block bytes as the same call in a fresh thread or a fresh plan, or raises the same."""
    from fakes import in_a_fresh_thread
    from rope_rtc import RopeCachePlan

    rng = np.random.default_rng(13)
    calls = []
    for _ in range(30):
        t, apart = int(rng.choice([T, T + 3])), rng.random() < 0.3
        fp8, hnd = rng.random() < 0.3, rng.random() < 0.3
        for _ in range(6):
            kw = _call(q=fake_cupy((t, HQ, D), BF16), k=fake_cupy((t, HK, D), BF16), v=fake_cupy((t, HK, D), BF16),
                       positions=None if rng.random() < 0.3 else fake_cupy((t,), np.int64),
                       slot_mapping=fake_cupy((t,), np.int64))
            shape = (3, HK, 16, D) if hnd else (3, 16, HK, D)
            if hnd:
                kw["kv_layout"] = "hnd"
            dt = np.uint8 if fp8 else BF16
            kw["k_cache"] = fake_cupy(shape, dt)
            kw["v_cache"] = fake_cupy(shape, dt, byte_offset=2 if rng.random() < 0.15 else 0)
            if fp8:
                kw.update(kv_cache_dtype="fp8_e4m3", k_scale=fake_cupy((1,), np.float32),
                          v_scale=fake_cupy((1,), np.float32))
            if apart:
                kw.update(q_out=fake_cupy(kw["q"].shape, BF16), k_out=fake_cupy(kw["k"].shape, BF16))
            if kw["positions"] is None:
                kw["offset"] = int(rng.choice([0, 5, 64 - t + 1]))  # the last: past the table
            calls.append(kw)
    plan_keys = ("kv_layout", "kv_cache_dtype")
    with FakeGPU() as gpu:
        warm = [_launched(gpu, lambda: rope_and_cache(**kw)) for kw in calls]
        plans, planned = {}, []  # a plan per kind of call, made from its first call a plan takes
        for kw in calls:
            key = tuple(kw.get(n) for n in plan_keys) + (kw["positions"] is None, "q_out" in kw)
            if key not in plans:
                try:
                    plans[key] = (RopeCachePlan(**kw), kw)
                except (TypeError, ValueError):
                    continue
            plan = plans[key][0]
            args = {n: v for n, v in kw.items() if n not in plan_keys}
            planned.append((plans[key][1], args))
            warm.append(_launched(gpu, lambda: plan.execute(**args)))

        cold = [in_a_fresh_thread(lambda: _launched(gpu, lambda: rope_and_cache(**kw))) for kw in calls]
        for made_from, args in planned:
            plan = RopeCachePlan(**made_from)
            cold.append(_launched(gpu, lambda: plan.execute(**args)))
    assert len(warm) == len(cold) and [i for i, (w, c) in enumerate(zip(warm, cold)) if w != c] == []
    assert sum(1 for w in warm if w and w[0] != "error") > 150


def test_new_arrays_of_a_seen_signature_take_the_generated_path(monkeypatch):
    """rope_and_cache computed the signature of its 15 arguments twice and bound the template on
    every call (about five times apply_rope_qk's host time); now the thread's last generated path."""
    from fakes import counted
    from rope_rtc.ops import kv_cache
    from rope_rtc.core import prepared

    with FakeGPU() as gpu:
        sets = [_call() for _ in range(8)]
        for kw in sets[:2]:
            rope_and_cache(**kw)
        counts: dict = {}
        counted(monkeypatch, kv_cache, "validate_cache_call", counts)
        counted(monkeypatch, dispatch, "signature", counts)
        counted(monkeypatch, prepared.Prepared, "bind", counts)
        for i in range(24):
            kw = sets[i % len(sets)]
            assert rope_and_cache(**kw) == (kw["q"], kw["k"])
            p = gpu.launches[-1]["cache"]
            assert (p.in_[2], p.k_cache, p.slot_mapping, p.positions) == (
                kw["v"].data.ptr, kw["k_cache"].data.ptr, kw["slot_mapping"].data.ptr, kw["positions"].data.ptr)
        assert counts == {}
