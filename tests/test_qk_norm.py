"""Per-head RMSNorm fused with RoPE on the CPU: the float64 reference against hand-computed
values, the argument block a call launches with, refusals before any launch, the repeat path's
address checks (weights included), and the builds compiling for several architectures."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fakes import BF16, FakeGPU, fake_cupy
from rope_rtc.core import dispatch
from rope_rtc.errors import UnsupportedLayoutError
from rope_rtc.reference import qk_norm_reference, qk_norm_rope_reference

B, S, HQ, HK, D, P = 2, 5, 4, 2, 128, 64


def _call(**change):
    kw = dict(q=fake_cupy((B, S, HQ, D), BF16), k=fake_cupy((B, S, HK, D), BF16), q_weight=fake_cupy((D,), BF16),
              k_weight=fake_cupy((D,), BF16), cos=fake_cupy((P, D // 2), np.float32),
              sin=fake_cupy((P, D // 2), np.float32), layout="bshd")
    kw.update(change)
    return kw


def _arrays(kw):
    """A call's keywords without the layout, which a plan fixes (``execute`` takes arrays)."""
    return {name: value for name, value in kw.items() if name != "layout"}


def test_reference_against_hand_computed_values():
    x = np.array([[[3.0, 4.0, 0.0, 0.0]]], np.float32)  # mean square 25 / 4
    w = np.array([1.0, 2.0, 0.5, 1.0], np.float32)
    y = qk_norm_reference(x, w, eps=0.0)
    np.testing.assert_allclose(y[0, 0], [3 / 2.5, 2 * 4 / 2.5, 0.0, 0.0])
    # A quarter turn of pair 0 (channels 0 and 2) and none of pair 1 (channels 1 and 3).
    cos = np.array([[0.0, 1.0]], np.float32)
    sin = np.array([[1.0, 0.0]], np.float32)
    out = qk_norm_rope_reference(x, w, cos, sin, np.array([0]), eps=0.0, interleaved=False)
    np.testing.assert_allclose(out[0, 0], [-0.0, 3.2, 1.2, 0.0], atol=1e-12)


def test_heads_per_lane_group():
    from rope_rtc.build.registry import norm_head_batch

    assert norm_head_batch(32, 8) == 4 and norm_head_batch(6, 2) == 2 and norm_head_batch(5, 1) == 1


def test_a_call_launches_the_fused_build_with_its_block(gpu):
    import rope_rtc

    kw = _call()
    rope_rtc.apply_qk_norm_rope(**kw, eps=1e-5, offset=3)
    rec = gpu.launches[-1]
    g, p = rec["geometry"], rec["norm"]
    # half-split pairs over the whole head: a lane holds a vector of each half (D / 16 lanes a head)
    assert (g.vec, g.lanes, g.numerics, g.weights_f32, g.head_batch) == (8, 8, "exact", False, 2) and g.split
    assert p.total == B * S * (HQ + HK) // 2 * 8 and rec["grid"] == (-(-p.total // 256), 1, 1)
    assert (p.weight[0], p.weight[1]) == (kw["q_weight"].data.ptr, kw["k_weight"].data.ptr)
    assert p.eps == np.float32(1e-5) and p.offset == 3 and p.in_[0] == kw["q"].data.ptr


def test_a_4d_array_without_a_layout_is_refused_naming_both_readings(gpu):
    import rope_rtc

    kw = _arrays(_call())
    for build in (rope_rtc.apply_qk_norm_rope, rope_rtc.QKNormRopePlan):
        with pytest.raises(ValueError, match=r'layout: q has shape \(2, 5, 4, 128\).*"bshd" for \[B, S, H, D\].*'
                                             r'"bhsd" for \[B, H, S, D\].*"sbhd"'):
            build(**kw)
    assert gpu.launches == []
    # A 3-d [T, H, D] array needs no layout: "thd", the same block as said explicitly.
    flat = _arrays(_call(q=fake_cupy((B * S, HQ, D), BF16), k=fake_cupy((B * S, HK, D), BF16)))
    rope_rtc.apply_qk_norm_rope(**flat, q_out=flat["q"], k_out=flat["k"])
    rope_rtc.apply_qk_norm_rope(**flat, q_out=flat["q"], k_out=flat["k"], layout="thd")
    assert bytes(gpu.launches[-2]["norm"]) == bytes(gpu.launches[-1]["norm"])
    plan = rope_rtc.QKNormRopePlan(**flat)
    assert plan.layout == "thd" and plan._opts["layout"] == "thd"


@pytest.mark.parametrize("tokens,dtype,interleaved,weight_offset,staged", [
    (10923, BF16, False, 0, True),  # 24 threads a token (3 groups of 8 lanes): 2^18 threads and up
    (10922, BF16, False, 0, False),
    (10923, BF16, True, 0, False),  # interleaved pairs: no staged twin
    (10923, BF16, False, 8, False),  # weights 8 bytes off 16: 8-byte vectors, no staged twin
    (5462, np.float32, False, 0, True),  # FP32: 16-byte vectors of 4, 48 threads a token
])
def test_large_launches_take_the_staged_build(gpu, tokens, dtype, interleaved, weight_offset, staged):
    """The staged build (vectors through shared memory) serves launches of 2^18 threads and more
    with half-split pairs over the whole head in 16-byte vectors; everything else, and smaller
    launches, take the register build."""
    import rope_rtc
    from rope_rtc.build.registry import NORM_STAGED_THREADS

    w = dict(q_weight=fake_cupy((D,), dtype, byte_offset=weight_offset),
             k_weight=fake_cupy((D,), dtype, byte_offset=weight_offset))
    kw = _call(q=fake_cupy((1, tokens, HQ, D), dtype), k=fake_cupy((1, tokens, HK, D), dtype), **w,
               cos=fake_cupy((tokens, D // 2), np.float32), sin=fake_cupy((tokens, D // 2), np.float32))
    rope_rtc.apply_qk_norm_rope(**kw, interleaved=interleaved)
    rec = gpu.launches[-1]
    assert rec["geometry"].staged is staged and rec["norm"].zero == 0  # the staged build's opaque zero
    if not interleaved and not weight_offset:
        assert (rec["norm"].total >= NORM_STAGED_THREADS) is staged


@pytest.mark.parametrize("change,exc,match", [
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(eps=float("nan")), ValueError, "eps"),
    (dict(eps="1e-6"), TypeError, "eps"),
    (dict(eps=10**400), ValueError, "eps"),  # an int past float's range: OverflowError before
    (dict(numerics="hf"), ValueError, "numerics"),
    (dict(q_weight=None), TypeError, "q_weight"),
    (dict(q_weight=fake_cupy((D // 2,), BF16)), ValueError, r"q_weight: expected shape \[head_dim\]"),
    (dict(q_weight=fake_cupy((D, 2), BF16)[:, 0]), UnsupportedLayoutError, "q_weight: expected a contiguous"),
    (dict(k_weight=fake_cupy((D,), np.float16)), TypeError, "k_weight"),
    (dict(q_weight=fake_cupy((D,), np.float32), k_weight=fake_cupy((D,), np.float32), numerics="transformers"),
     TypeError, "transformers multiplies in the input dtype"),
    (dict(k=None), TypeError, "k:"),
    (dict(q=fake_cupy((B, S, HQ, 96), BF16), k=fake_cupy((B, S, HK, 96), BF16), q_weight=fake_cupy((96,), BF16),
          k_weight=fake_cupy((96,), BF16), cos=fake_cupy((P, 48), np.float32), sin=fake_cupy((P, 48), np.float32)),
     NotImplementedError, "head_dim 96"),
])
def test_bad_calls_are_refused_before_any_launch(gpu, change, exc, match):
    import rope_rtc

    with pytest.raises(exc, match=match):
        rope_rtc.apply_qk_norm_rope(**_call(**change))
    assert gpu.launches == []


def test_an_output_over_a_weight_is_refused_on_the_repeat_path_too(gpu):
    import rope_rtc

    kw = _call()
    rope_rtc.apply_qk_norm_rope(**kw, q_out=kw["q"], k_out=kw["k"])
    n = len(gpu.launches)
    # New arrays of the same signature: q's first head is also q_weight's bytes.
    q2 = fake_cupy((B, S, HQ, D), BF16)
    with pytest.raises(ValueError, match="q_out overlaps q_weight"):
        rope_rtc.apply_qk_norm_rope(**_call(q=q2, q_weight=q2.reshape(-1)[:D]), q_out=q2, k_out=kw["k"])
    assert len(gpu.launches) == n


def test_new_arrays_of_a_seen_signature_take_the_address_checks_only(gpu, monkeypatch):
    import rope_rtc
    from rope_rtc.ops import qk_norm

    plan = rope_rtc.QKNormRopePlan(**_call(), numerics="transformers")
    plan.execute(**_arrays(_call()))
    calls = []
    real = qk_norm.validate_qk_norm
    monkeypatch.setattr(qk_norm, "validate_qk_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    for _ in range(3):
        kw = _call()
        plan.execute(**_arrays(kw))
        assert gpu.launches[-1]["norm"].weight[1] == kw["k_weight"].data.ptr
    assert calls == [] and gpu.launches[-1]["geometry"].numerics == "transformers"
    # Weights of another dtype than the plan's: refused (float32 ones by the transformers numerics
    # themselves, and by an exact plan built with bfloat16 weights).
    f32 = dict(q_weight=fake_cupy((D,), np.float32), k_weight=fake_cupy((D,), np.float32))
    with pytest.raises(TypeError, match="transformers multiplies in the input dtype"):
        plan.execute(**_arrays(_call(**f32)))
    exact = rope_rtc.QKNormRopePlan(**_call())
    with pytest.raises(ValueError, match="plan: bfloat16"):
        exact.execute(**_arrays(_call(**f32)))


def test_lanes_per_head_by_pair_style_and_window():
    from rope_rtc.build.registry import NormGeometry, norm_vector_widths

    def lanes(dtype, interleaved, rotary_offset, rotary_dim, d=D):
        vec = norm_vector_widths(dtype, interleaved, d, rotary_offset, rotary_dim)[0]
        return NormGeometry(dtype, interleaved, 4, 2, d, rotary_offset, rotary_dim, vec, False, "exact").lanes

    assert lanes("bfloat16", False, 0, D) == D // 16  # both halves of a pair in one lane
    assert lanes("bfloat16", True, 0, D) == D // 8
    assert lanes("bfloat16", False, 0, D // 2) == D // 8  # a partial window: one vector a lane, partners shuffled
    # float32 head dim 256 with half-split pairs fits a warp (32 lanes of two 16-byte vectors);
    # interleaved pairs would need 64 lanes
    assert lanes("float32", False, 0, 256, d=256) == 32
    assert norm_vector_widths("float32", True, 256, 0, 256) == ()


@pytest.mark.parametrize("arch", [80, 90, 100])
def test_the_builds_compile(arch, tmp_path, monkeypatch):
    from rope_rtc.build import compiler, toolchain
    from rope_rtc.build.registry import NormGeometry, norm_stageable, norm_vector_widths

    if arch not in toolchain.supported_archs():
        pytest.skip(f"this NVRTC does not know sm_{arch}")
    for dtype, interleaved, numerics in (("bfloat16", False, "exact"), ("float16", True, "transformers"),
                                         ("float32", False, "transformers")):
        vec = norm_vector_widths(dtype, interleaved, D, 0, D)[0]
        g = NormGeometry(dtype, interleaved, 32, 8, D, 0, D, vec, False, numerics, 4)
        for build in (g, replace(g, staged=True)) if norm_stageable(g) else (g,):
            spec = build.spec()
            assert compiler.compile_source(spec.name, spec.source, spec.defines,
                                           toolchain.Target(arch, "cubin")).binary


@pytest.mark.parametrize("tokens", [2, 0])
def test_weights_off_every_vector_are_named_with_or_without_tokens(gpu, tokens):
    """Weights 2 bytes off a 16-byte boundary fit no build of bf16 head dim 128 (vectors of 8, 4
    or 2 elements, a lane holding one of each half): a ValueError names them, also when there is
    nothing to launch (the template once declined the call that validation had accepted, an
    AssertionError); weights 4 and 8 bytes off take the narrower builds, with or without tokens."""
    import rope_rtc

    def call(offset):
        return _call(q=fake_cupy((tokens, S, HQ, D), BF16), k=fake_cupy((tokens, S, HK, D), BF16),
                     q_weight=fake_cupy((D + 8,), BF16)[offset:D + offset], k_weight=fake_cupy((D,), BF16))

    with pytest.raises(ValueError, match="q_weight: address .* is not 4-byte aligned"):
        rope_rtc.apply_qk_norm_rope(**call(1))
    with pytest.raises(ValueError, match="q_weight: address"):
        rope_rtc.QKNormRopePlan(**call(1))
    for offset, vec in ((2, 2), (4, 4)):
        kw = call(offset)
        rope_rtc.apply_qk_norm_rope(**kw)
        rope_rtc.QKNormRopePlan(**kw).execute(**_arrays(kw))
        if tokens:
            assert gpu.launches[-1]["geometry"].vec == vec


def test_float32_weights_need_only_16_byte_alignment(gpu):
    """The kernel reads eight float32 weights as two 16-byte loads."""
    import rope_rtc

    w = dict(q_weight=fake_cupy((D + 4,), np.float32)[4:], k_weight=fake_cupy((D + 4,), np.float32)[4:])
    rope_rtc.apply_qk_norm_rope(**_call(**w))
    assert gpu.launches[-1]["geometry"].vec == 8 and gpu.launches[-1]["geometry"].weights_f32


def test_an_eps_beyond_float32_is_refused(gpu):
    import rope_rtc

    with pytest.raises(ValueError, match=r"eps: expected a finite value >= 0 \(as a float32\), got 1e\+39"):
        rope_rtc.apply_qk_norm_rope(**_call(), eps=1e39)  # once refused only later, as "got inf"
    # A positive eps that is 0 as a float32 would drop the guard the caller asked for: an all-zero
    # head (a padding token) normalised to NaN. eps=0 itself stays a value (transformers takes it).
    with pytest.raises(ValueError, match=r"eps: 1e-50 is 0 as a float32, .*at least 1\.4e-45"):
        rope_rtc.apply_qk_norm_rope(**_call(), eps=1e-50)
    assert gpu.launches == []
    rope_rtc.apply_qk_norm_rope(**_call(), eps=0.0)
    assert gpu.launches[-1]["norm"].eps == 0.0


def test_one_misaligned_call_does_not_pin_later_calls_to_a_narrower_build(gpu):
    # Regression: the misaligned call's narrower template replaced the signature's one.
    from rope_rtc import apply_qk_norm_rope

    apply_qk_norm_rope(**_call(), eps=1e-6, q_out=None)
    wide = gpu.launches[-1]["geometry"].vec
    q = fake_cupy((B, S, HQ, D), BF16, byte_offset=8)
    apply_qk_norm_rope(**_call(q=q), eps=1e-6)
    assert gpu.launches[-1]["geometry"].vec < wide
    apply_qk_norm_rope(**_call(), eps=1e-6)
    assert gpu.launches[-1]["geometry"].vec == wide


@pytest.mark.parametrize("first", ["q", "weights"])
def test_a_misaligned_first_call_does_not_pin_later_aligned_calls(gpu, first):
    """The other order: a signature whose first call was off the widest build's alignment (q 8
    bytes off, or the weights 4 bytes off) kept that narrower build for every later aligned call,
    one-call and plan alike, and large launches lost the staged build with it."""
    import rope_rtc

    off = (dict(q=fake_cupy((B, S, HQ, D), BF16, byte_offset=8)) if first == "q" else
           dict(q_weight=fake_cupy((D + 2,), BF16)[2:]))
    rope_rtc.apply_qk_norm_rope(**_call(**off))
    narrow = gpu.launches[-1]["geometry"].vec
    rope_rtc.apply_qk_norm_rope(**_call())
    wide = gpu.launches[-1]["geometry"].vec
    assert narrow < wide == 8
    rope_rtc.apply_qk_norm_rope(**_call(**off))  # the narrow build again, beside the wide one
    assert gpu.launches[-1]["geometry"].vec == narrow
    plan = rope_rtc.QKNormRopePlan(**_call(**off))
    plan.execute(**_arrays(_call(**off)))
    assert gpu.launches[-1]["geometry"].vec == narrow
    plan.execute(**_arrays(_call()))
    assert gpu.launches[-1]["geometry"].vec == wide
    T = 10923  # large enough for the staged build (test_large_launches_take_the_staged_build)

    def big(offset=0):
        return _call(q=fake_cupy((1, T, HQ, D), BF16, byte_offset=offset),
                     k=fake_cupy((1, T, HK, D), BF16, byte_offset=offset),
                     cos=fake_cupy((T, D // 2), np.float32), sin=fake_cupy((T, D // 2), np.float32))

    rope_rtc.apply_qk_norm_rope(**big(8))
    assert not gpu.launches[-1]["geometry"].staged
    rope_rtc.apply_qk_norm_rope(**big())
    g = gpu.launches[-1]["geometry"]
    assert (g.vec, g.staged) == (8, True)


def test_an_enormous_eps_or_attention_factor_is_described_not_spelled_out(gpu):
    """A 401-digit int was printed whole in the message (rope_tables already describes such a
    value by its bits)."""
    import rope_rtc

    with pytest.raises(ValueError, match=r"eps: .*got an int of 1329 bits$"):
        rope_rtc.apply_qk_norm_rope(**_call(), eps=10**400)
    q = fake_cupy((2, 5, 8, 128), BF16)
    with pytest.raises(ValueError, match=r"attention_scaling: .*got an int of 1329 bits$"):
        rope_rtc.apply_rope(q, inv_freq=fake_cupy((64,), np.float64), attention_scaling=10**400, out=q,
                            layout="bshd")
    assert gpu.launches == []


def _record(rec) -> tuple:
    """What a launch record says the kernel gets: entry, grid, block, the argument block's bytes."""
    block = rec.get("norm", rec.get("fixed"))
    return (rec["fn"], rec["grid"], rec["block"], bytes(block))


def _outcome(gpu, call) -> tuple:
    from fakes import launch_outcome

    return launch_outcome(gpu, call, _record)


def test_the_one_call_and_plan_repeat_paths_launch_what_a_cold_call_launches():
    """Random calls of apply_qk_norm_rope and of a plan with new arrays, options and alignments:
    each warm call (the thread's last repeat path, the plan's quick path) launches the same entry,
    grid and block bytes as the same call in a fresh thread and a fresh plan, or raises the same."""
    import rope_rtc
    from fakes import in_a_fresh_thread

    rng = np.random.default_rng(11)
    cos, sin = fake_cupy((P, D // 2), np.float32), fake_cupy((P, D // 2), np.float32)
    weights = [fake_cupy((D,), BF16), fake_cupy((D,), BF16), fake_cupy((D + 2,), BF16)[2:], fake_cupy((D,), np.float32)]
    calls = []
    for _ in range(40):  # episodes: one configuration, then calls with new arrays, now and then off it
        s, apart = int(rng.choice([S, S + 1])), rng.random() < 0.3
        kw = dict(eps=float(rng.choice([1e-6, 1e-5])), numerics=str(rng.choice(["exact", "exact", "transformers"])),
                  layout="bshd")
        qw, kw_ = weights[int(rng.integers(0, 2))], weights[int(rng.integers(0, 2))]
        for _ in range(6):
            off = 8 if rng.random() < 0.15 else 0
            q, k = fake_cupy((B, s, HQ, D), BF16, byte_offset=off), fake_cupy((B, s, HK, D), BF16, byte_offset=off)
            outs = (fake_cupy(q.shape, BF16), fake_cupy(k.shape, BF16)) if apart else (q, k)
            w = (weights[2] if rng.random() < 0.1 else qw, weights[3] if rng.random() < 0.05 else kw_)
            calls.append((q, k, w[0], w[1], outs, dict(kw, offset=int(rng.integers(0, 4)))))
    warm, cold = [], []
    with FakeGPU() as gpu:
        plan = rope_rtc.QKNormRopePlan(calls[0][0], calls[0][1], calls[0][2], calls[0][3], cos, sin,
                                       layout="bshd")
        for q, k, qw, kw_, outs, kw in calls:
            warm.append(_outcome(gpu, lambda: rope_rtc.apply_qk_norm_rope(q, k, qw, kw_, cos, sin, q_out=outs[0],
                                                                          k_out=outs[1], **kw)))
            if outs[0] is q and kw["eps"] == 1e-6 and kw["numerics"] == "exact":
                warm.append(_outcome(gpu, lambda: plan.execute(q, k, qw, kw_, cos, sin, offset=kw["offset"])))

        for q, k, qw, kw_, outs, kw in calls:
            cold.append(in_a_fresh_thread(lambda: _outcome(gpu, lambda: rope_rtc.apply_qk_norm_rope(
                q, k, qw, kw_, cos, sin, q_out=outs[0], k_out=outs[1], **kw))))
            if outs[0] is q and kw["eps"] == 1e-6 and kw["numerics"] == "exact":
                fresh = rope_rtc.QKNormRopePlan(calls[0][0], calls[0][1], calls[0][2], calls[0][3], cos, sin,
                                                layout="bshd")
                cold.append(_outcome(gpu, lambda: fresh.execute(q, k, qw, kw_, cos, sin, offset=kw["offset"])))
    assert len(warm) == len(cold)
    assert [i for i, (w, c) in enumerate(zip(warm, cold)) if w != c] == []
    assert sum(1 for w in warm if w and w[0] != "error") > 200


def test_new_arrays_of_a_seen_signature_take_the_generated_path(monkeypatch):
    """apply_qk_norm_rope bound every call through the signature's dictionary and the template's
    bind (about 3.5 times apply_rope_qk's host time); now the thread's last generated path, as
    apply_rope_qk's. Neither it nor a plan with new arrays validates again."""
    import rope_rtc
    from fakes import counted
    from rope_rtc.ops import qk_norm, rope_request

    with FakeGPU() as gpu:
        sets = [_call() for _ in range(8)]
        for kw in sets[:2]:
            rope_rtc.apply_qk_norm_rope(**kw, q_out=kw["q"], k_out=kw["k"])
        plan = rope_rtc.QKNormRopePlan(**sets[0])
        plan.execute(*(sets[0][n] for n in ("q", "k", "q_weight", "k_weight", "cos", "sin")))
        counts: dict = {}
        counted(monkeypatch, dispatch, "bind_once", counts)
        counted(monkeypatch, qk_norm, "validate_qk_norm", counts)
        counted(monkeypatch, rope_request, "validate", counts)
        for i in range(24):
            kw = sets[i % len(sets)]
            rope_rtc.apply_qk_norm_rope(**kw, q_out=kw["q"], k_out=kw["k"])
            n = gpu.launches[-1]["norm"]
            assert tuple(n.weight) == (kw["q_weight"].data.ptr, kw["k_weight"].data.ptr)
            plan.execute(*(kw[n] for n in ("q", "k", "q_weight", "k_weight", "cos", "sin")), offset=i % 3)
            n = gpu.launches[-1]["norm"]
            assert (*n.weight, n.offset) == (kw["q_weight"].data.ptr, kw["k_weight"].data.ptr, i % 3)
        assert counts == {}
