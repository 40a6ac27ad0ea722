"""Per-head RMSNorm fused with RoPE on the GPU: ``numerics="exact"`` within the documented bound
of the float64 reference over dtypes, layouts, pair styles, windows, position schemes and in/out
of place (outputs poisoned with NaN first); ``numerics="transformers"`` against Hugging Face
transformers' own Qwen3 path (``Qwen3RMSNorm`` on each head, then ``apply_rotary_pos_emb``); a
plan's new arrays and CUDA graph capture."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gpu_util import DTYPES, after_current_stream, bits, host_random, host_tables, poisoned
from rope_rtc.core import dispatch
from rope_rtc.reference import qk_norm_error_bound, qk_norm_reference, qk_norm_rope_reference

pytestmark = pytest.mark.gpu

HQ, HK, P, EPS = 4, 2, 96, 1e-6
TO_LAYOUT = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}


def _to_layout(x, layout):
    return x[0] if layout == "thd" else np.ascontiguousarray(np.transpose(x, TO_LAYOUT[layout]))


def _from_layout(y, layout):
    return y[None] if layout == "thd" else np.transpose(y, np.argsort(TO_LAYOUT[layout]))


def _weight(d, dtype, seed):
    return (1.0 + 0.25 * np.random.default_rng(seed).standard_normal(d)).astype(dtype)


def _check_exact(out, host, weight, cos, sin, positions, *, interleaved, rotary_dim, rotary_offset, dtype):
    n, h, d = host.shape
    want = qk_norm_rope_reference(host, weight, cos, sin, positions, eps=EPS, interleaved=interleaved,
                                  rotary_dim=rotary_dim, rotary_offset=rotary_offset)
    got = out.astype(np.float64)
    assert not np.isnan(got).any(), "an output element was not written (NaN poison left)"
    bound = qk_norm_error_bound(qk_norm_reference(host, weight, eps=EPS), DTYPES[dtype], got,
                                interleaved=interleaved, rotary_dim=rotary_dim, rotary_offset=rotary_offset)
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"error {err[worst]:.3g} over the bound {bound[worst]:.3g} at {worst}"


CASES = list(itertools.product(["bfloat16", "float16", "float32"], ["bshd", "thd", "bhsd", "sbhd"], [False, True],
                               [(128, None, 0), (64, 32, 16), (256, None, 0), (32, None, 0), (512, None, 0)],
                               [True, False]))


def _refused(dtype: str, d: int, interleaved: bool) -> bool:
    """The head dims docs/qk-norm-rope.md names as refused: a head must fit one warp's lanes, 16
    bytes each (both halves of a pair for half-split pairs)."""
    return d == 512 and (interleaved or dtype == "float32") or (dtype == "float32" and d == 256 and interleaved)


@pytest.mark.parametrize("dtype,layout,interleaved,geometry,in_place", CASES)
def test_exact_within_the_bound(dtype, layout, interleaved, geometry, in_place):
    import cupy as cp

    import rope_rtc

    d, rotary_dim, rotary_offset = geometry
    B, S = (1, 13) if layout == "thd" else (2, 5)
    dt = DTYPES[dtype]
    qh, kh = host_random((B, S, HQ, d), dt, 1, 2.0), host_random((B, S, HK, d), dt, 2, 0.5)
    qw, kw = _weight(d, dt, 3), _weight(d, dt, 4)
    r = rotary_dim or d
    cos, sin = host_tables(P, r // 2, 5)
    pos = np.random.default_rng(6).integers(0, P, (B, S)).astype(np.int64)
    q, k = cp.asarray(_to_layout(qh, layout)), cp.asarray(_to_layout(kh, layout))
    q_out = q if in_place else poisoned(cp, q.shape, dt)
    k_out = k if in_place else poisoned(cp, k.shape, dt)
    call = dict(eps=EPS, positions=cp.asarray(pos[0] if layout == "thd" else pos), layout=layout,
                interleaved=interleaved, rotary_dim=rotary_dim, rotary_offset=rotary_offset, q_out=q_out, k_out=k_out)
    args = (q, k, cp.asarray(qw), cp.asarray(kw), cp.asarray(cos), cp.asarray(sin))
    if _refused(dtype, d, interleaved):  # 64 lanes of 16 bytes: more than a warp per head
        with pytest.raises(NotImplementedError, match=f"head_dim {d}"):
            rope_rtc.apply_qk_norm_rope(*args, **call)
        return
    got = rope_rtc.apply_qk_norm_rope(*args, **call)
    for out, host, w, h in zip(got, (qh, kh), (qw, kw), (HQ, HK)):
        actual = _from_layout(cp.asnumpy(out), layout).reshape(B * S, h, d)
        _check_exact(actual, host.reshape(B * S, h, d), w, cos, sin, pos.reshape(-1), interleaved=interleaved,
                     rotary_dim=rotary_dim, rotary_offset=rotary_offset, dtype=dtype)
    if not in_place:
        np.testing.assert_array_equal(bits(cp.asnumpy(q)), bits(_to_layout(qh, layout)))
        np.testing.assert_array_equal(bits(cp.asnumpy(k)), bits(_to_layout(kh, layout)))


@pytest.mark.parametrize("scheme", ["offset", "offsets", "cu_seqlens"])
def test_position_schemes_and_float32_weights(scheme):
    import cupy as cp

    import rope_rtc

    d, dt = 128, DTYPES["bfloat16"]
    layout = "thd" if scheme == "cu_seqlens" else "bshd"
    B, S = 3, 4
    qh, kh = host_random((B, S, HQ, d), dt, 11, 2.0), host_random((B, S, HK, d), dt, 12, 2.0)
    qw, kw = _weight(d, np.float32, 13), _weight(d, np.float32, 14)
    cos, sin = host_tables(P, d // 2, 15)
    starts = np.array([0, 7, 30])
    pos = (starts[:, None] + np.arange(S)[None, :]).astype(np.int64)
    kw_args = {"offset": 7} if scheme == "offset" else (
        {"offset": cp.asarray(starts.astype(np.int32))} if scheme == "offsets" else
        {"cu_seqlens": cp.asarray(np.array([0, 4, 8, 12], np.int32)), "offset": cp.asarray(starts.astype(np.int64))})
    if scheme == "offset":
        pos = np.broadcast_to(7 + np.arange(S), (B, S))
    q = cp.asarray(qh.reshape(B * S, HQ, d) if layout == "thd" else qh)
    k = cp.asarray(kh.reshape(B * S, HK, d) if layout == "thd" else kh)
    # float32 weights 16 bytes into an allocation: eight per lane are read as two 16-byte loads
    dqw, dkw = (cp.asarray(np.concatenate([np.zeros(4, np.float32), w]))[4:] for w in (qw, kw))
    got = rope_rtc.apply_qk_norm_rope(q, k, dqw, dkw, cp.asarray(cos), cp.asarray(sin), eps=EPS, layout=layout,
                                      **kw_args)
    for out, host, w, h in zip(got, (qh, kh), (qw, kw), (HQ, HK)):
        _check_exact(cp.asnumpy(out).reshape(B * S, h, d), host.reshape(B * S, h, d), w, cos, sin, pos.reshape(-1),
                     interleaved=False, rotary_dim=None, rotary_offset=0, dtype="bfloat16")


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_positions_outside_the_table_give_nan_for_their_tokens(index_dtype):
    """Device positions past the table's last row or negative (never read back): those tokens'
    heads are NaN (the table loads are predicated on the row), the others exact. The outputs start
    finite (1e4): a NaN is the kernel's own."""
    import cupy as cp

    import rope_rtc

    d, dt, T = 128, DTYPES["bfloat16"], 6
    qh, kh = host_random((T, HQ, d), dt, 51, 2.0), host_random((T, HK, d), dt, 52, 2.0)
    qw, kw = _weight(d, np.float32, 53), _weight(d, np.float32, 54)
    cos, sin = host_tables(P, d // 2, 55)
    pos = np.array([5, P, -1, 0, P + 7, P - 1], index_dtype)
    bad = (pos < 0) | (pos >= P)
    q_out, k_out = cp.full(qh.shape, 1e4, dtype=dt), cp.full(kh.shape, 1e4, dtype=dt)
    rope_rtc.apply_qk_norm_rope(cp.asarray(qh), cp.asarray(kh), cp.asarray(qw), cp.asarray(kw), cp.asarray(cos),
                                cp.asarray(sin), eps=EPS, layout="thd", positions=cp.asarray(pos), q_out=q_out,
                                k_out=k_out)
    for out, host, w in ((q_out, qh, qw), (k_out, kh, kw)):
        got = cp.asnumpy(out)
        assert np.isnan(got[bad].astype(np.float32)).all()
        _check_exact(got[~bad], host[~bad], w, cos, sin, pos[~bad], interleaved=False, rotary_dim=None,
                     rotary_offset=0, dtype="bfloat16")


def _torch_from(a):
    """A torch view of a CuPy array (bfloat16 through its 16-bit pattern)."""
    import cupy as cp
    import torch

    if a.dtype == DTYPES["bfloat16"]:
        return torch.from_dlpack(a.view(cp.uint16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def _ordered(b: np.ndarray, width: int) -> np.ndarray:
    """Sign-magnitude bit patterns as integers in the order of the values (+0 and -0 both 0)."""
    b = b.astype(np.int64) & ((1 << width) - 1)
    sign, mag = b >> (width - 1), b & ((1 << (width - 1)) - 1)
    return np.where(sign == 1, -mag, mag)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_transformers_numerics_match_qwen3(dtype):
    """Qwen3's attention path in transformers: q_norm / k_norm (Qwen3RMSNorm over each head), then
    apply_rotary_pos_emb with the model's own cos/sin (Qwen3RotaryEmbedding). Bit-equal where the
    arithmetic allows (the mean square's summation order differs), never more than one ulp."""
    torch = pytest.importorskip("torch")
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from transformers import Qwen3Config

    import cupy as cp

    import rope_rtc

    d, B, S = 128, 2, 37
    dt = DTYPES[dtype]
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    config = Qwen3Config(hidden_size=HQ * d, head_dim=d, num_attention_heads=HQ, num_key_value_heads=HK,
                         rms_norm_eps=EPS, max_position_embeddings=P, rope_theta=1_000_000.0)
    rotary = qwen3.Qwen3RotaryEmbedding(config=config).to("cuda")
    positions = torch.arange(P, device="cuda")[None]
    cos32, sin32 = rotary(torch.zeros(1, device="cuda", dtype=torch.float32), positions)  # float32 [1, P, D]
    cos_t, sin_t = cp.asarray(cos32[0, :, : d // 2].contiguous()), cp.asarray(sin32[0, :, : d // 2].contiguous())

    q, k = cp.asarray(host_random((B, S, HQ, d), dt, 21, 3.0)), cp.asarray(host_random((B, S, HK, d), dt, 22, 3.0))
    qw, kw = cp.asarray(_weight(d, dt, 23)), cp.asarray(_weight(d, dt, 24))
    pos = cp.asarray(np.random.default_rng(25).integers(0, P, (B, S)).astype(np.int64))
    got_q, got_k = rope_rtc.apply_qk_norm_rope(q, k, qw, kw, cos_t, sin_t, eps=EPS, numerics="transformers",
                                               positions=pos, layout="bshd")

    q_norm, k_norm = qwen3.Qwen3RMSNorm(d, eps=EPS), qwen3.Qwen3RMSNorm(d, eps=EPS)
    with torch.no_grad():
        q_norm.weight.copy_(_torch_from(qw))
        k_norm.weight.copy_(_torch_from(kw))
    q_norm, k_norm = q_norm.to("cuda", tdt), k_norm.to("cuda", tdt)
    tpos = _torch_from(pos)
    cos, sin = rotary(torch.zeros(1, device="cuda", dtype=tdt), tpos)  # [B, S, D] in the input dtype
    with torch.no_grad():
        hq = q_norm(_torch_from(q)).transpose(1, 2)  # [B, H, S, D], as Qwen3Attention
        hk = k_norm(_torch_from(k)).transpose(1, 2)
        want_q, want_k = qwen3.apply_rotary_pos_emb(hq, hk, cos, sin)
    width = 16 if dtype != "float32" else 32
    for got, want in ((got_q, want_q.transpose(1, 2)), (got_k, want_k.transpose(1, 2))):
        w = want.contiguous().cpu().view(torch.int16 if width == 16 else torch.int32).numpy()
        dist = np.abs(_ordered(bits(cp.asnumpy(got)), width) - _ordered(w, width))
        assert dist.max() <= 1, f"{int((dist > 1).sum())} elements more than one ulp from transformers"
        assert (dist == 0).mean() >= 0.99, f"only {(dist == 0).mean():.4f} of the elements bit-equal"


def test_plan_new_arrays_graph_capture_and_exact_repeat():
    import cupy as cp

    import rope_rtc

    d, dt, B, S = 128, DTYPES["bfloat16"], 2, 3
    cos, sin = (cp.asarray(a) for a in host_tables(P, d // 2, 31))
    qw, kw = cp.asarray(_weight(d, dt, 32)), cp.asarray(_weight(d, dt, 33))
    sets = [(cp.asarray(host_random((B, S, HQ, d), dt, 40 + i, 2.0)), cp.asarray(host_random((B, S, HK, d), dt, 50 + i,
                                                                                              2.0))) for i in range(2)]
    outs = [(poisoned(cp, (B, S, HQ, d), dt), poisoned(cp, (B, S, HK, d), dt)) for _ in range(2)]
    plan = rope_rtc.QKNormRopePlan(*sets[0], qw, kw, cos, sin, q_out=outs[0][0], k_out=outs[0][1], offset=3,
                                   layout="bshd").compile()
    want = [rope_rtc.apply_qk_norm_rope(q, k, qw, kw, cos, sin, offset=3, layout="bshd") for q, k in sets]
    for _ in range(3):  # new arrays, then the remembered sets (graph replay from the second launch)
        for (q, k), (qo, ko) in zip(sets, outs):
            plan.execute(q, k, qw, kw, cos, sin, q_out=qo, k_out=ko, offset=3)
    cp.cuda.Device().synchronize()
    for (qo, ko), (wq, wk) in zip(outs, want):
        np.testing.assert_array_equal(bits(cp.asnumpy(qo)), bits(cp.asnumpy(wq)))
        np.testing.assert_array_equal(bits(cp.asnumpy(ko)), bits(cp.asnumpy(wk)))
    stream = cp.cuda.Stream(non_blocking=True)
    qo, ko = poisoned(cp, (B, S, HQ, d), dt), poisoned(cp, (B, S, HK, d), dt)
    with stream:
        stream.begin_capture()
        plan.execute(*sets[1], qw, kw, cos, sin, q_out=qo, k_out=ko, offset=3, stream=stream)
        graph = stream.end_capture()
    after_current_stream(cp, stream)  # the outputs' NaN fill
    graph.launch(stream)
    stream.synchronize()
    np.testing.assert_array_equal(bits(cp.asnumpy(qo)), bits(cp.asnumpy(want[1][0])))
    np.testing.assert_array_equal(bits(cp.asnumpy(ko)), bits(cp.asnumpy(want[1][1])))


@pytest.mark.parametrize("dtype,d,layout,numerics,in_place,f32_weights", [
    ("bfloat16", 128, "thd", "exact", False, False), ("bfloat16", 128, "bshd", "transformers", True, False),
    ("bfloat16", 256, "sbhd", "exact", False, True), ("float16", 256, "bhsd", "exact", True, False),
    ("float16", 128, "sbhd", "transformers", False, False), ("float32", 128, "thd", "exact", True, False),
    ("float32", 256, "bshd", "transformers", False, False)])
def test_the_staged_build_writes_the_register_builds_bits(monkeypatch, dtype, d, layout, numerics, in_place,
                                                          f32_weights):
    """A launch of 2^18 threads or more takes the staged build (the vectors through shared
    memory). Every token is independent, so its output must equal bit for bit what the register
    build (which the matrix above checks against the references) writes for the same tokens in
    calls small enough to take it: 12288 tokens in one call, then in chunks of 768 per sequence."""
    import cupy as cp

    import rope_rtc
    from rope_rtc.ops.qk_norm import QKNormRopePlan

    B, S = (1, 12288) if layout == "thd" else (2, 6144)
    dt = DTYPES[dtype]
    qh, kh = host_random((B, S, HQ, d), dt, 61, 2.0), host_random((B, S, HK, d), dt, 62, 0.5)
    wdt = np.float32 if f32_weights else dt
    qw, kw, (cos, sin) = cp.asarray(_weight(d, wdt, 63)), cp.asarray(_weight(d, wdt, 64)), host_tables(P, d // 2, 65)
    cos, sin = cp.asarray(cos), cp.asarray(sin)
    pos = np.random.default_rng(66).integers(0, P, (B, S)).astype(np.int32)
    positions = cp.asarray(pos[0] if layout == "thd" else pos)
    axis = {"thd": 0, "bshd": 1, "bhsd": 2, "sbhd": 0}[layout]

    def arrays():
        q, k = cp.asarray(_to_layout(qh, layout)), cp.asarray(_to_layout(kh, layout))
        return q, k, (q if in_place else poisoned(cp, q.shape, dt)), (k if in_place else poisoned(cp, k.shape, dt))

    def outputs(q_out, k_out):  # in place: the plan's default
        return {} if in_place else dict(q_out=q_out, k_out=k_out)

    served = []
    real = QKNormRopePlan.fixed_kernel
    q, k, q_out, k_out = arrays()
    plan = rope_rtc.QKNormRopePlan(q, k, qw, kw, cos, sin, eps=EPS, numerics=numerics, positions=positions,
                                   layout=layout, **outputs(q_out, k_out)).compile()
    monkeypatch.setattr(QKNormRopePlan, "fixed_kernel", lambda self, g: served.append(g) or real(self, g))
    plan.execute(q, k, qw, kw, cos, sin, positions=positions, **outputs(q_out, k_out))
    q2, k2, q2_out, k2_out = arrays()
    step = 768
    for s0 in range(0, S, step):
        part = (slice(None),) * axis + (slice(s0, s0 + step),)
        plan.execute(q2[part], k2[part], qw, kw, cos, sin, positions=cp.ascontiguousarray(positions[..., s0:s0 + step]),
                     **outputs(q2_out[part], k2_out[part]))
    cp.cuda.Device().synchronize()
    assert list(dict.fromkeys(g.staged for g in served)) == [True, False], "the whole call staged, the chunks not"
    for got, want in ((q_out, q2_out), (k_out, k2_out)):
        got, want = cp.asnumpy(got), cp.asnumpy(want)
        assert not np.isnan(got.astype(np.float32)).any(), "an output element was not written (NaN poison left)"
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("numerics", ["exact", "transformers"])
def test_one_calls_with_new_arrays_take_the_repeat_path_and_match_a_fresh_thread(numerics):
    """apply_qk_norm_rope on new arrays every call: from a signature's second call the thread's
    generated path launches; every call's bits equal the same call's in a fresh thread."""
    import cupy as cp

    import rope_rtc
    from rope_rtc.ops import qk_norm

    B, S, D = 2, 5, 128
    dt = DTYPES["bfloat16"]
    cos, sin = (cp.asarray(t) for t in host_tables(P, D // 2, 61))
    qw, kw = cp.asarray(_weight(D, dt, 62)), cp.asarray(_weight(D, dt, 63))
    calls = []
    for i in range(6):
        q, k = cp.asarray(host_random((B, S, HQ, D), dt, 70 + i)), cp.asarray(host_random((B, S, HK, D), dt, 80 + i))
        calls.append((q, k, i, q.copy(), k.copy()))
    for q, k, off, _, _ in calls:
        rope_rtc.apply_qk_norm_rope(q, k, qw, kw, cos, sin, eps=EPS, numerics=numerics, offset=off, q_out=q, k_out=k,
                                    layout="bshd")
    assert qk_norm.ONE_CALL.thread().last is not dispatch.NO_LAST
    for q, k, off, q0, k0 in calls:
        qk_norm.ONE_CALL.forget()
        rope_rtc.apply_qk_norm_rope(q0, k0, qw, kw, cos, sin, eps=EPS, numerics=numerics, offset=off, q_out=q0,
                                    k_out=k0, layout="bshd")
        assert np.array_equal(bits(cp.asnumpy(q)), bits(cp.asnumpy(q0)))
        assert np.array_equal(bits(cp.asnumpy(k)), bits(cp.asnumpy(k0)))
