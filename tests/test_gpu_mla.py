"""DeepSeek-style MLA on the GPU: q's rotary part and k_pe within the library's rotation contract
(bit for bit with the NumPy reference, which is that arithmetic), every byte of the cache bit for
bit (model dtype, FP8 e4m3 and e5m2, poisoned with random bytes first, so a write at a skipped
slot shows), the two-step path (apply_rope on the rotary part, then the library's FP8 cast), and
transformers' DeepSeek-V3 rotation."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_util import DTYPES, host_random, host_tables, poisoned
from rope_rtc.reference import assert_rope_close, fp8_quantize, mla_rope_and_cache_reference, rope_reference

pytestmark = pytest.mark.gpu

T, H, NOPE, R, L, NB, BS, P = 37, 16, 128, 64, 512, 8, 16, 256


def _host(dtype, kind, seed=0):
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    h = dict(q=host_random((T, H, NOPE + R), dt, seed + 1, 2.0), k_pe=host_random((T, R), dt, seed + 2, 2.0),
             kv_c=host_random((T, L), dt, seed + 3, 3.0))
    h["cos"], h["sin"] = host_tables(P, R // 2, seed + 4)
    h["positions"] = rng.integers(0, P, T).astype(np.int64)
    slots = rng.permutation(NB * BS)[:T].astype(np.int64)
    slots[3], slots[7] = -1, -5  # tokens that write no row
    h["slot_mapping"] = slots
    cache_dt = np.uint8 if kind != "auto" else dt
    shape = (NB, BS, L + R)
    raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(cache_dt).itemsize, dtype=np.uint8)
    h["kv_cache"] = raw.view(cache_dt).reshape(shape)  # random bytes: every byte not written stays
    return h


def _bytes(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("kind", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_mla_matches_the_reference_bit_for_bit(cp, dtype, kind, interleaved):
    import rope_rtc

    h = _host(dtype, kind)
    d = {n: cp.asarray(a) for n, a in h.items()}
    scale = dict(kv_scale=cp.asarray(np.array([0.01], np.float32))) if kind != "auto" else {}
    q_scale = np.array([0.02], np.float32)
    q_out = poisoned(cp, h["q"].shape, d["q"].dtype)
    q_fp8 = cp.full(h["q"].shape, 0xFF, np.uint8)
    out = rope_rtc.mla_rope_and_cache(d["q"], d["k_pe"], d["kv_c"], d["cos"], d["sin"], d["positions"],
                                      d["slot_mapping"], d["kv_cache"], kv_cache_dtype=kind, q_out=q_out,
                                      q_fp8_out=q_fp8, q_fp8_scale=cp.asarray(q_scale), interleaved=interleaved,
                                      **scale)
    assert out[0] is q_out and out[2] is q_fp8
    want = mla_rope_and_cache_reference(*(h[n] for n in ("q", "k_pe", "kv_c", "cos", "sin", "positions",
                                                         "slot_mapping", "kv_cache")),
                                        kv_cache_dtype=kind, kv_scale=0.01 if kind != "auto" else None,
                                        q_fp8_scale=q_scale[0], interleaved=interleaved)
    np.testing.assert_array_equal(_bytes(cp.asnumpy(q_out)), _bytes(want[0]))
    np.testing.assert_array_equal(_bytes(cp.asnumpy(d["k_pe"])), _bytes(want[1]))
    np.testing.assert_array_equal(_bytes(cp.asnumpy(d["kv_cache"])), _bytes(want[2]))  # skipped rows untouched
    np.testing.assert_array_equal(cp.asnumpy(q_fp8), want[3])
    np.testing.assert_array_equal(_bytes(cp.asnumpy(d["q"])), _bytes(h["q"]))  # q itself untouched with q_out
    # the rotation within the library's bound of the float64 reference
    ref = rope_reference(h["q"][..., NOPE:], h["cos"], h["sin"], h["positions"], interleaved=interleaved)
    assert_rope_close(cp.asnumpy(q_out)[..., NOPE:], ref, h["q"][..., NOPE:], interleaved=interleaved,
                      dtype=np.dtype(DTYPES[dtype]))


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_mla_equals_the_two_step_path(cp, kind):
    """apply_rope on q's rotary part and on k_pe, then the library's FP8 cast of [kv_c | k_pe]: the
    same bytes as the one launch (in place, DeepSeek's adjacent pairs, bf16)."""
    import rope_rtc

    h = _host("bfloat16", kind, seed=11)
    d = {n: cp.asarray(a) for n, a in h.items()}
    two = {n: cp.asarray(a) for n, a in h.items()}
    scale = cp.asarray(np.array([0.03], np.float32))
    rope_rtc.mla_rope_and_cache(d["q"], d["k_pe"], d["kv_c"], d["cos"], d["sin"], d["positions"], d["slot_mapping"],
                                d["kv_cache"], kv_cache_dtype=kind, kv_scale=scale)
    rope_rtc.apply_rope(two["q"], two["cos"], two["sin"], positions=two["positions"], layout="thd", interleaved=True,
                        rotary_offset=NOPE, rotary_dim=R, out=two["q"])
    k3 = two["k_pe"].reshape(T, 1, R)
    rope_rtc.apply_rope(k3, two["cos"], two["sin"], positions=two["positions"], layout="thd", interleaved=True, out=k3)
    cp.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(_bytes(cp.asnumpy(d["q"])), _bytes(cp.asnumpy(two["q"])))
    np.testing.assert_array_equal(_bytes(cp.asnumpy(d["k_pe"])), _bytes(cp.asnumpy(two["k_pe"])))
    cache = h["kv_cache"].copy()
    k_host, kv_host = cp.asnumpy(two["k_pe"]), h["kv_c"]
    for t, slot in enumerate(h["slot_mapping"]):
        if slot >= 0:
            cache[slot // BS, slot % BS] = fp8_quantize(np.concatenate([kv_host[t], k_host[t]]), np.float32(0.03), kind)
    np.testing.assert_array_equal(cp.asnumpy(d["kv_cache"]), cache)


def test_a_plan_relaunches_with_a_new_scale_and_in_graph_capture(cp):
    import rope_rtc

    h = _host("bfloat16", "fp8_e4m3", seed=5)
    d = {n: cp.asarray(a) for n, a in h.items()}
    scale = cp.asarray(np.array([0.01], np.float32))
    args = [d[n] for n in ("q", "k_pe", "kv_c", "cos", "sin", "positions", "slot_mapping", "kv_cache")]
    plan = rope_rtc.MlaRopeCachePlan(*args, kv_cache_dtype="fp8_e4m3", kv_scale=scale)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        plan.execute(*args, kv_scale=scale, stream=stream)
        graph = stream.end_capture()
    scale[...] = 0.05
    graph.launch(stream)
    stream.synchronize()
    want = mla_rope_and_cache_reference(*(h[n] for n in ("q", "k_pe", "kv_c", "cos", "sin", "positions",
                                                         "slot_mapping", "kv_cache")),
                                        kv_cache_dtype="fp8_e4m3", kv_scale=0.05)
    np.testing.assert_array_equal(cp.asnumpy(d["kv_cache"]), want[2])


def test_check_positions_refuses_a_device_position_past_the_table(cp, monkeypatch):
    """Without ROPE_RTC_CHECK_POSITIONS a device position past the table gives NaN; with it the
    call is refused before the launch, nothing written (one-call function and plan)."""
    import rope_rtc
    from rope_rtc.core import dispatch
    from rope_rtc.ops import mla

    h = _host("float16", "auto", seed=6)
    h["positions"][5] = P  # one past the table
    names = ("q", "k_pe", "kv_c", "cos", "sin", "positions", "slot_mapping", "kv_cache")
    d = {n: cp.asarray(a) for n, a in h.items()}
    rope_rtc.mla_rope_and_cache(*(d[n] for n in names))
    assert np.isnan(cp.asnumpy(d["k_pe"]).astype(np.float32)[5]).all()
    monkeypatch.setenv("ROPE_RTC_CHECK_POSITIONS", "1")
    monkeypatch.setattr(mla.ONE_CALL, "_local", dispatch.ThreadState())  # plans read the switch when made
    d = {n: cp.asarray(a) for n, a in h.items()}
    before = {n: cp.asnumpy(a) for n, a in d.items()}
    with pytest.raises(ValueError, match=f"positions: entry 5 is {P}, outside the table's {P} rows"):
        rope_rtc.mla_rope_and_cache(*(d[n] for n in names))
    plan = rope_rtc.MlaRopeCachePlan(*(d[n] for n in names))
    with pytest.raises(ValueError, match=f"positions: entry 5 is {P}"):
        plan.execute(*(d[n] for n in names))
    for n in names:
        assert np.array_equal(_bytes(cp.asnumpy(d[n])), _bytes(before[n])), n


@pytest.mark.device
@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.707])
def test_the_rotation_matches_transformers_deepseek_v3(cp, mscale_all_dim):
    """transformers' DeepSeek-V3 rotation (DeepseekV3RotaryEmbedding's YaRN cos/sin with its
    attention_scaling, apply_rotary_pos_emb_interleave), built and compared as
    tests/transformers_refs.py's ``check_deepseek_v3`` does (run on the CPU with the NumPy backend
    by test_transformers_refs.py), the kernel writing into a NaN-poisoned q_out: bit for bit the
    NumPy reference, within the float32 bound of transformers' after its de-interleaving
    permutation; and the FP8 bytes against torch's own float8 cast."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import transformers_refs as refs

    import rope_rtc

    def mla(q, k_pe, kv_c, cos, sin, positions, slots, cache):
        d = {n: cp.asarray(a) for n, a in dict(q=q, k_pe=k_pe, kv_c=kv_c, cos=cos, sin=sin, positions=positions,
                                                 slots=slots, cache=cache).items()}
        q_out = poisoned(cp, q.shape, np.float32)
        rope_rtc.mla_rope_and_cache(d["q"], d["k_pe"], d["kv_c"], d["cos"], d["sin"], d["positions"], d["slots"],
                                    d["cache"], q_out=q_out)  # interleaved=True, DeepSeek's pairs, the default
        got = cp.asnumpy(q_out), cp.asnumpy(d["k_pe"])
        want = mla_rope_and_cache_reference(q, k_pe, kv_c, cos, sin, positions, slots, cache)
        np.testing.assert_array_equal(_bytes(got[0]), _bytes(want[0]))
        np.testing.assert_array_equal(_bytes(got[1]), _bytes(want[1]))
        np.testing.assert_array_equal(_bytes(cp.asnumpy(d["cache"])), _bytes(want[2]))
        return got

    res = refs.check_deepseek_v3(mscale_all_dim, mla, device="cuda")
    # FP8 bytes against torch's own float8 cast of the same quotient
    rows = np.concatenate([np.random.default_rng(3).standard_normal((4, L)).astype(np.float32), res["got"][1][:4]], -1)
    vals = torch.as_tensor(rows, device="cuda") / 0.5
    torch_e4m3 = vals.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy()
    np.testing.assert_array_equal(torch_e4m3, fp8_quantize(vals.cpu().numpy() * 0.5, np.float32(0.5), "fp8_e4m3"))
