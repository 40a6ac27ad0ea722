"""DeepSeek-style MLA (RoPE on q's rotary part and k_pe, the latent cache row, FP8) on the CPU: the
NumPy reference against a straightforward computation, backend="numpy" end to end, the checks that
run before any launch, the argument block and the repeat path (fake device arrays), and NVRTC
compiling the kernel."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fakes import BF16, FakeGPU, fake_cupy
from rope_rtc import mla_rope_and_cache
from rope_rtc.core import dispatch
from rope_rtc.reference import fp8_quantize, mla_rope_and_cache_reference, rope_kernel_arithmetic

T, H, NOPE, R, L = 6, 4, 16, 8, 32
D = NOPE + R
BLOCKS, BLOCK_SIZE = 3, 4


def _host_inputs(dtype=np.float32, seed=0, kind="auto"):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((T, H, D)) * 3).astype(dtype)
    k_pe = (rng.standard_normal((T, R)) * 3).astype(dtype)
    kv_c = (rng.standard_normal((T, L)) * 300).astype(dtype)  # past e4m3's 448 after scaling: saturates
    ang = rng.uniform(-9, 9, (16, R // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    positions = rng.integers(0, 16, T).astype(np.int64)
    slots = rng.permutation(BLOCKS * BLOCK_SIZE)[:T].astype(np.int32)
    slots[2] = -1  # a token that writes no row
    shape = (BLOCKS, BLOCK_SIZE, L + R)
    cache = rng.integers(0, 256, shape, dtype=np.uint8) if kind != "auto" else \
        (rng.standard_normal(shape) * 7).astype(dtype)
    return q, k_pe, kv_c, cos, sin, positions, slots, cache


def _straightforward(q, k_pe, kv_c, cos, sin, positions, slots, cache, interleaved):
    """MLA in float64 by the definition, token by token and pair by pair (no shared code)."""
    q64, k64 = q.astype(np.float64), k_pe.astype(np.float64)
    q_ref, k_ref, cache_ref = q64.copy(), k64.copy(), cache.astype(np.float64)
    for t in range(T):
        c, s = cos[positions[t]].astype(np.float64), sin[positions[t]].astype(np.float64)
        for i in range(R // 2):
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + R // 2)
            for h in range(H):
                x0, x1 = q64[t, h, NOPE + a], q64[t, h, NOPE + b]
                q_ref[t, h, NOPE + a], q_ref[t, h, NOPE + b] = x0 * c[i] - x1 * s[i], x1 * c[i] + x0 * s[i]
            x0, x1 = k64[t, a], k64[t, b]
            k_ref[t, a], k_ref[t, b] = x0 * c[i] - x1 * s[i], x1 * c[i] + x0 * s[i]
        if slots[t] >= 0:
            blk, off = divmod(int(slots[t]), BLOCK_SIZE)
            cache_ref[blk, off] = np.concatenate([kv_c[t].astype(np.float64), k_ref[t]])
    return q_ref, k_ref, cache_ref


@pytest.mark.parametrize("interleaved", [True, False])
def test_the_reference_against_a_straightforward_computation(interleaved):
    inputs = _host_inputs()
    q_out, k_out, cache, q_fp8 = mla_rope_and_cache_reference(*inputs, interleaved=interleaved)
    q_ref, k_ref, cache_ref = _straightforward(*inputs, interleaved)
    assert q_fp8 is None
    np.testing.assert_allclose(q_out, q_ref, rtol=0, atol=2e-5 * 6)
    np.testing.assert_allclose(k_out, k_ref, rtol=0, atol=2e-5 * 6)
    np.testing.assert_allclose(cache, cache_ref, rtol=0, atol=2e-5 * 6)
    np.testing.assert_array_equal(q_out[..., :NOPE], inputs[0][..., :NOPE])  # the unrotated part as it was
    unused = [s for s in range(BLOCKS * BLOCK_SIZE) if s not in set(inputs[6].tolist())]
    np.testing.assert_array_equal(cache.reshape(-1, L + R)[unused], inputs[7].reshape(-1, L + R)[unused])


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_numpy_backend_fp8_is_the_two_step_path_bit_for_bit(kind, dtype):
    """RoPE (the library's arithmetic) on the rotary parts, then the FP8 cast of [kv_c | k_pe]."""
    q, k_pe, kv_c, cos, sin, positions, slots, cache = _host_inputs(dtype, seed=3, kind=kind)
    before = cache.copy()
    kv_scale, q_scale = np.array([0.37], np.float32), np.array([0.11], np.float32)
    q_fp8 = np.full((T, H, D), 0xFF, np.uint8)
    want_q = rope_kernel_arithmetic(q[..., NOPE:], cos, sin, positions, interleaved=True)
    want_k = rope_kernel_arithmetic(k_pe[:, None], cos, sin, positions, interleaved=True)[:, 0]
    q_in, k_in = q.copy(), k_pe.copy()
    out = mla_rope_and_cache(q, k_pe, kv_c, cos, sin, positions, slots, cache, kv_cache_dtype=kind, kv_scale=kv_scale,
                             q_fp8_out=q_fp8, q_fp8_scale=q_scale, q_fp8_dtype=kind, backend="numpy")
    assert out[0] is q and out[1] is k_pe and out[2] is q_fp8
    np.testing.assert_array_equal(q[..., NOPE:].view(np.uint8), want_q.view(np.uint8))
    np.testing.assert_array_equal(q[..., :NOPE], q_in[..., :NOPE])
    np.testing.assert_array_equal(k_pe.view(np.uint8), want_k.view(np.uint8))  # written back in place
    want_q_full = q_in.copy()
    want_q_full[..., NOPE:] = want_q
    np.testing.assert_array_equal(q_fp8, fp8_quantize(want_q_full, q_scale[0], kind))
    for t in range(T):
        if slots[t] < 0:
            continue
        blk, off = divmod(int(slots[t]), BLOCK_SIZE)
        row = fp8_quantize(np.concatenate([kv_c[t], want_k[t]]), kv_scale[0], kind)
        np.testing.assert_array_equal(cache[blk, off], row)
    untouched = np.ones(BLOCKS * BLOCK_SIZE, bool)
    untouched[slots[slots >= 0]] = False
    np.testing.assert_array_equal(cache.reshape(-1, L + R)[untouched], before.reshape(-1, L + R)[untouched])
    assert not np.array_equal(k_in.view(np.uint8), k_pe.view(np.uint8))


@pytest.mark.parametrize("bad", [16, -1])
def test_host_positions_outside_the_table_are_refused_and_nothing_is_written(bad):
    """As every other op with host positions: a ValueError naming the entry, with q, k_pe and the
    cache untouched. Past the table a bare IndexError escaped from the reference; -1 wrapped to the
    table's last row and the results were written in place."""
    q, k_pe, kv_c, cos, sin, positions, slots, cache = _host_inputs()
    positions[3] = bad
    before = [a.copy() for a in (q, k_pe, kv_c, cache)]
    with pytest.raises(ValueError, match=rf"^positions: entry 3 is {bad}, outside the table's 16 rows \(0\.\.15\)"):
        mla_rope_and_cache(q, k_pe, kv_c, cos, sin, positions, slots, cache, backend="numpy")
    for got, want in zip((q, k_pe, kv_c, cache), before):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("interleaved", [True, False])
def test_numpy_backend_model_dtype_with_q_out_and_a_3d_k_pe(interleaved):
    q, k_pe, kv_c, cos, sin, positions, slots, cache = _host_inputs(BF16, seed=5)
    k3 = k_pe[:, None, :].copy()
    want = mla_rope_and_cache_reference(q, k3, kv_c, cos, sin, positions, slots, cache, interleaved=interleaved)
    q_out = np.full_like(q, np.nan)
    q_in = q.copy()
    got = mla_rope_and_cache(q, k3, kv_c, cos, sin, positions, slots, cache, q_out=q_out, interleaved=interleaved,
                             backend="numpy")
    assert got[0] is q_out and got[2] is None
    np.testing.assert_array_equal(q.view(np.uint16), q_in.view(np.uint16))  # q untouched with q_out
    np.testing.assert_array_equal(q_out.view(np.uint16), want[0].view(np.uint16))
    np.testing.assert_array_equal(k3.view(np.uint16), want[1].view(np.uint16))
    np.testing.assert_array_equal(cache.view(np.uint16), want[2].view(np.uint16))


def test_the_reference_takes_a_typed_fp8_cache():
    inputs = list(_host_inputs(kind="fp8_e4m3"))
    want = mla_rope_and_cache_reference(*inputs, kv_cache_dtype="fp8_e4m3", kv_scale=np.float32(0.5))
    inputs[7] = inputs[7].view(ml_dtypes.float8_e4m3fn)
    got = mla_rope_and_cache_reference(*inputs, kv_cache_dtype="fp8_e4m3", kv_scale=np.float32(0.5))
    np.testing.assert_array_equal(got[2].view(np.uint8), want[2])


@pytest.mark.parametrize("kind,scale,exc,match", [
    ("fp8_e4m3", None, TypeError, "kv_scale: an FP8 cache needs a float32 scale"),
    ("auto", np.float32(0.5), ValueError, r"kv_scale: only FP8 caches take scales \(kv_cache_dtype='auto'\)"),
    ("fp8", None, ValueError, "kv_cache_dtype: expected one of"),
])
def test_the_reference_refuses_a_scale_the_op_refuses(kind, scale, exc, match):
    # Without kv_scale it wrote every FP8 entry as NaN (float32(None)); beside a bf16 cache it ignored one.
    inputs = _host_inputs(kind="fp8_e4m3" if kind == "fp8_e4m3" else "auto")
    with pytest.raises(exc, match=match):
        mla_rope_and_cache_reference(*inputs, kv_cache_dtype=kind, kv_scale=scale)


# -- fake device arrays: checks, block, repeat path ---------------------------------------------

def _call(dtype=BF16, **change):
    kw = dict(q=fake_cupy((T, H, D), dtype), k_pe=fake_cupy((T, R), dtype), kv_c=fake_cupy((T, L), dtype),
              cos=fake_cupy((64, R // 2), np.float32), sin=fake_cupy((64, R // 2), np.float32),
              positions=fake_cupy((T,), np.int64), slot_mapping=fake_cupy((T,), np.int32),
              kv_cache=fake_cupy((BLOCKS, 16, L + R), dtype))
    kw.update(change)
    return kw


def _fp8(**change):
    return _call(kv_cache=fake_cupy((BLOCKS, 16, L + R), np.uint8), kv_cache_dtype="fp8_e4m3",
                 kv_scale=fake_cupy((1,), np.float32), **change)


def test_a_call_launches_once_with_its_block():
    with FakeGPU() as gpu:
        kw = _call()
        out = mla_rope_and_cache(**kw)
        assert out == (kw["q"], kw["k_pe"], None)
        (rec,) = gpu.launches
        p, req = rec["mla"], rec["request"]
        assert rec["fn"][0] == "mla_rope_cache"
        assert (p.q, p.q_out, p.k_pe, p.kv_c, p.cache) == (kw["q"].data.ptr, kw["q"].data.ptr, kw["k_pe"].data.ptr,
                                                          kw["kv_c"].data.ptr, kw["kv_cache"].data.ptr)
        assert (p.cos, p.sin, p.positions, p.slot_mapping) == (kw["cos"].data.ptr, kw["sin"].data.ptr,
                                                               kw["positions"].data.ptr, kw["slot_mapping"].data.ptr)
        assert (p.q_fp8, p.cache_scale, p.q_scale) == (0, 0, 0)
        assert (p.q_st, p.q_sh, p.kpe_st, p.kvc_st, p.cache_sb, p.cache_so) == (H * D, D, R, L, 16 * (L + R), L + R)
        assert (p.num_slots, p.block_size, p.table_rows, p.table_stride) == (BLOCKS * 16, 16, 64, R // 2)
        assert (p.index_flags, p.slot_i64) == (1, 0)
        assert req.vec == 8 and (req.nope, req.rope, req.lora, req.kind, req.q_kind) == (NOPE, R, L, 0, 0)
        # in place: q's rotary units only (interleaved: R / vec), then k_pe's and kv_c's
        assert (p.q_units, p.token_units) == (1, H * 1 + 1 + L // 8)
        assert p.total == T * p.token_units
        (gx, _, _), (bx, _, _) = rec["grid"], rec["block"]
        assert gx * bx >= p.total


def test_fp8_cache_q_out_and_fp8_q_fill_the_block():
    with FakeGPU() as gpu:
        q_out, q_fp8, qs = fake_cupy((T, H, D), BF16), fake_cupy((T, H, D), np.uint8), fake_cupy((1,), np.float32)
        kw = _fp8(q_out=q_out, q_fp8_out=q_fp8, q_fp8_scale=qs, q_fp8_dtype="fp8_e5m2", interleaved=False)
        out = mla_rope_and_cache(**kw)
        assert out == (q_out, kw["k_pe"], q_fp8)
        p, req = gpu.launches[-1]["mla"], gpu.launches[-1]["request"]
        assert (p.q_out, p.q_fp8, p.q_scale, p.cache_scale) == (q_out.data.ptr, q_fp8.data.ptr, qs.data.ptr,
                                                                kw["kv_scale"].data.ptr)
        assert (req.kind, req.q_kind, req.interleaved) == (1, 2, False)
        # half-split: R / 2 / vec rotary units; the unrotated channels copied and quantised too
        assert p.q_units == (R // 2) // req.vec + NOPE // req.vec and (p.qf_st, p.qf_sh) == (H * D, D)


@pytest.mark.parametrize("change,exc,match", [
    (dict(kv_c=fake_cupy((T, L + 2), BF16)), ValueError, r"kv_c: 34 channels, but kv_cache rows hold 40"),
    (dict(k_pe=fake_cupy((T, 2, R), BF16)), ValueError, r"k_pe: 2 heads"),
    (dict(q=fake_cupy((T, H, R - 2), BF16)), ValueError, r"q: last dim 6 is not"),
    (dict(cos=fake_cupy((64, R), np.float32), sin=fake_cupy((64, R), np.float32)), ValueError,
     r"cos: expected a table \[max_positions, 4\]"),
    (dict(k_pe=fake_cupy((T, R), np.float16)), TypeError, r"k_pe: dtype float16 differs from q's bfloat16"),
    (dict(kv_c=fake_cupy((T, L), np.float32)), TypeError, r"kv_c: dtype float32"),
    (dict(kv_cache=fake_cupy((BLOCKS, 16, L + R), np.float16)), TypeError, r"kv_cache: dtype float16"),
    (dict(kv_cache=fake_cupy((BLOCKS, 16, L + R), np.uint8)), TypeError, r"kv_cache_dtype='fp8_e4m3'"),
    (dict(slot_mapping=fake_cupy((T,), np.float32)), TypeError, r"slot_mapping: dtype float32"),
    (dict(slot_mapping=fake_cupy((T + 1,), np.int64)), ValueError, r"slot_mapping: expected one entry per token"),
    (dict(positions=fake_cupy((T,), np.float32)), TypeError, r"positions: dtype float32"),
    (dict(slot_mapping=np.array([0, 1, -1, 47, 48, 2])), ValueError, r"slot_mapping: entry 4 is 48"),
    (dict(slot_mapping=np.array([0, 7, -1, 7, 9, 2])), ValueError, r"slot_mapping: entries 1 and 3 both name slot 7"),
    (dict(kv_scale=fake_cupy((1,), np.float32)), ValueError, r"kv_scale: only FP8 caches take scales"),
    (dict(kv_cache_dtype="fp8"), ValueError, r"kv_cache_dtype"),
    (dict(interleaved=1), TypeError, r"interleaved"),
    (dict(q_fp8_out=fake_cupy((T, H, D), np.uint8)), TypeError, r"q_fp8_scale: q_fp8_out is given"),
    (dict(q_out=fake_cupy((T, H, D), np.float16)), TypeError, r"q_out: dtype float16"),
])
def test_bad_calls_are_refused_before_any_launch(change, exc, match):
    with FakeGPU() as gpu:
        with pytest.raises(exc, match=match):
            mla_rope_and_cache(**_call(**change))
        assert gpu.launches == []


def test_an_fp8_cache_needs_its_scale_and_overlapping_outputs_are_refused():
    with FakeGPU() as gpu:
        with pytest.raises(TypeError, match="kv_scale: an FP8 cache needs"):
            mla_rope_and_cache(**dict(_fp8(), kv_scale=None))
        cache = fake_cupy((BLOCKS, 16, L + R), BF16)
        with pytest.raises(ValueError, match="kv_cache: overlaps kv_c"):
            mla_rope_and_cache(**_call(kv_cache=cache, kv_c=cache[0, :T, :L]))
        q = fake_cupy((T, H, D), BF16)
        with pytest.raises(ValueError, match="q_out: overlaps q"):
            mla_rope_and_cache(**_call(q=q, q_out=fake_cupy((T, H, D), BF16, ptr=q.data.ptr + 2)))
        kpe = fake_cupy((T, R), BF16)
        with pytest.raises(ValueError, match="k_pe: overlaps positions"):
            mla_rope_and_cache(**_call(k_pe=kpe, positions=fake_cupy((T,), np.int64, ptr=kpe.data.ptr)))
        assert gpu.launches == []


def test_negative_slots_reach_the_kernel_as_they_are():
    """A negative slot skips its row in the kernel (its k_pe still rotates): the host passes the slots
    through, and a host slot_mapping with negatives is accepted and copied."""
    with FakeGPU() as gpu:
        kw = _call(slot_mapping=fake_cupy((T,), np.int64))
        mla_rope_and_cache(**kw)
        assert gpu.launches[-1]["mla"].slot_i64 == 1
        from rope_rtc.ops.mla_request import validate_mla_call

        req = validate_mla_call(**_call(slot_mapping=np.array([-1, 3, -1, -5, 0, 9])), allow_host_slots=True)
        assert req.slots.device is None


def test_a_misaligned_cache_gets_narrower_vectors_and_aligned_calls_keep_the_wide_build():
    with FakeGPU() as gpu:
        mla_rope_and_cache(**_call(kv_cache=fake_cupy((BLOCKS, 16, L + R), BF16, byte_offset=4)))
        assert gpu.launches[-1]["request"].vec == 2
        mla_rope_and_cache(**_call())
        assert gpu.launches[-1]["request"].vec == 8


def test_new_arrays_of_a_seen_signature_take_the_last_path_without_validation(monkeypatch):
    from fakes import counted
    from rope_rtc.core import dispatch, prepared
    from rope_rtc.ops import mla, mla_request

    with FakeGPU() as gpu:
        sets = [_fp8() for _ in range(6)]
        for kw in sets[:2]:
            mla_rope_and_cache(**kw)
        counts: dict = {}
        counted(monkeypatch, mla, "validate_mla_call", counts)
        counted(monkeypatch, mla_request, "validate_mla_call", counts)
        counted(monkeypatch, dispatch, "signature", counts)
        counted(monkeypatch, prepared.Prepared, "bind", counts)
        for i in range(12):
            kw = sets[i % len(sets)]
            assert mla_rope_and_cache(**kw) == (kw["q"], kw["k_pe"], None)
            p = gpu.launches[-1]["mla"]
            assert (p.q, p.kv_c, p.cache, p.cache_scale, p.slot_mapping) == (
                kw["q"].data.ptr, kw["kv_c"].data.ptr, kw["kv_cache"].data.ptr, kw["kv_scale"].data.ptr,
                kw["slot_mapping"].data.ptr)
        assert counts == {}
        # An overlapping call of the same signature goes back to validation, which refuses it.
        bad = _fp8()
        bad["slot_mapping"] = bad["k_pe"].reshape(-1)[:2 * T].view(np.int32)
        n = len(gpu.launches)
        with pytest.raises(ValueError, match="overlaps slot_mapping"):
            mla_rope_and_cache(**bad)
        assert len(gpu.launches) == n


def test_a_plan_binds_new_arrays_without_validation_and_refuses_another_geometry(monkeypatch):
    from rope_rtc import MlaRopeCachePlan
    from rope_rtc.ops import mla

    names = ("q", "k_pe", "kv_c", "cos", "sin", "positions", "slot_mapping", "kv_cache")
    with FakeGPU() as gpu:
        first = _call()
        plan = MlaRopeCachePlan(**first)
        assert plan.execute(*(first[n] for n in names)) == (first["q"], first["k_pe"], None)
        calls = []
        real = mla.validate_mla_call
        monkeypatch.setattr(mla, "validate_mla_call", lambda *a, **k: calls.append(1) or real(*a, **k))
        for _ in range(3):
            new = _call()
            plan.execute(*(new[n] for n in names))
            assert gpu.launches[-1]["mla"].kv_c == new["kv_c"].data.ptr
        assert calls == []
        other = _call(q=fake_cupy((T, H * 2, D), BF16))
        with pytest.raises(ValueError, match="this plan was built for"):
            plan.execute(*(other[n] for n in names))
        assert len(gpu.launches) == 4


def test_the_plan_holds_no_callers_array_after_a_one_call():
    import gc
    import weakref

    with FakeGPU():
        kw = _call()
        refs = {n: weakref.ref(a) for n, a in kw.items()}
        mla_rope_and_cache(**kw)
        del kw
        gc.collect()
        assert [n for n, r in refs.items() if r() is not None] == []


# -- NVRTC --------------------------------------------------------------------------------------

def test_the_mla_builds_compile_for_sm_90():
    """Every cache kind and FP8 q kind of DeepSeek's geometry, both pair styles, the widest and the
    narrowest width, each dtype."""
    from concurrent.futures import ThreadPoolExecutor

    from rope_rtc.build import registry_mla
    from rope_rtc.build.compiler import compile_source
    from rope_rtc.build.toolchain import Target

    specs = registry_mla.mla_model_specs("bfloat16", True, 128, 128, 64, 512)
    specs += registry_mla.mla_model_specs("bfloat16", False, 16, 128, 64, 512)
    specs += [registry_mla.mla_spec(dt, il, w, kind, 0 if kind == 0 else 3 - kind, 16, 128, 64, 512)
              for dt in ("float32", "float16") for il in (False, True) for kind in (0, 2)
              for w in {registry_mla.mla_vector_widths(dt, il, True)[0], registry_mla.mla_vector_widths(dt, il, True)[-1]}]
    assert len({s.name for s in specs}) == len(specs) >= 12
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda s: compile_source(s.name, s.source, s.defines, Target(90, "cubin")), specs))
    for spec, result in zip(specs, results):
        assert result.binary[:4] == b"\x7fELF" and b"mla_rope_cache" in result.binary, spec.name


def test_check_positions_reads_device_positions_back_before_any_launch(monkeypatch):
    """ROPE_RTC_CHECK_POSITIONS=1 (docs/ops.md: every op) checks MLA's device positions too, in
    the one-call function and in a plan made with it, after the call's own checks."""
    from rope_rtc import MlaRopeCachePlan
    from rope_rtc.ops import mla

    monkeypatch.setenv("ROPE_RTC_CHECK_POSITIONS", "1")
    monkeypatch.setattr(mla.ONE_CALL, "_local", dispatch.ThreadState())  # plans read the switch when made
    values = np.array([0, 1, 2, 64, 4, 5], np.int64)  # the table has 64 rows
    monkeypatch.setattr(mla, "_read_back", lambda positions: values)
    with FakeGPU() as gpu:
        with pytest.raises(ValueError, match=r"positions: entry 3 is 64, outside the table's 64 rows"):
            mla_rope_and_cache(**_call())
        plan = MlaRopeCachePlan(**_call())
        kw = _call()
        with pytest.raises(ValueError, match="positions: entry 3 is 64"):
            plan.execute(**kw)
        with pytest.raises(TypeError, match="k_pe"):  # the call's own checks come first
            plan.execute(**dict(kw, k_pe=fake_cupy((T, R), np.float16)))
        assert gpu.launches == []
        values[3] = 63
        mla_rope_and_cache(**_call())
        plan.execute(**kw)
        assert len(gpu.launches) == 2


def test_a_numpy_bool_is_a_pair_style():
    """interleaved=np.bool_ (a flag read from a NumPy config) is taken, as by apply_rope."""
    inputs = _host_inputs()
    for flag in (np.True_, np.False_):
        want = mla_rope_and_cache_reference(*inputs, interleaved=bool(flag))
        args = [a.copy() for a in inputs]
        got = mla_rope_and_cache(*args, interleaved=flag, backend="numpy")
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert np.array_equal(args[-1], want[2])
    with FakeGPU() as gpu:
        mla_rope_and_cache(**_call(), interleaved=np.True_)
        mla_rope_and_cache(**_call(), interleaved=True)
        assert len(gpu.launches) == 2
    with pytest.raises(TypeError, match="interleaved"):
        mla_rope_and_cache(*_host_inputs(), interleaved=1, backend="numpy")


def test_a_one_row_table_pair_needs_no_common_row_stride():
    """One row: its stride is never read, so cos as a view of a combined [1, R] cache and sin as a
    [1, R/2] array are taken (as apply_rope takes them)."""
    q, k_pe, kv_c, cos, sin, positions, slots, cache = _host_inputs()
    both = np.concatenate([cos[3:4], sin[3:4]], axis=1)
    one_cos, one_sin = both[:, :R // 2], sin[3:4].copy()
    assert one_cos.strides[0] != one_sin.strides[0]
    zero = np.zeros_like(positions)
    want = mla_rope_and_cache_reference(q, k_pe, kv_c, cos[3:4].copy(), one_sin, zero, slots, cache)
    args = [q.copy(), k_pe.copy(), kv_c, one_cos, one_sin, zero, slots, cache.copy()]
    got = mla_rope_and_cache(*args, backend="numpy")
    assert np.array_equal(got[0], want[0]) and np.array_equal(args[-1], want[2])
