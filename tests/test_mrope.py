"""Multimodal RoPE on the CPU: the build a call gets (sections fixed at compile time, NVRTC
compiling it for several architectures), its argument block, the checks that run before any
launch, and the address-only path of a seen signature (fake device arrays, recorded launches;
the kernel itself: test_gpu_mrope.py)."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import BF16, FakeGPU, fake_cupy
from rope_rtc.core import dispatch
from rope_rtc import MRopePlan, apply_mrope, apply_mrope_qk
from rope_rtc.ops import mrope
from rope_rtc.build import registry
from rope_rtc.build.registry import fixed_geometry

T, HQ, HK, D = 6, 4, 2, 128
SECTION = [16, 24, 24]


def _call(**change):
    kw = dict(q=fake_cupy((T, HQ, D), BF16), k=fake_cupy((T, HK, D), BF16), cos=fake_cupy((64, D // 2), np.float32),
              sin=fake_cupy((64, D // 2), np.float32), positions=fake_cupy((3, T), np.int64),
              mrope_section=SECTION)
    kw.update(change)
    return kw


@pytest.mark.parametrize("interleaved,style", [(False, 1), (True, 2)])
def test_a_call_launches_the_sectioned_build_with_its_block(gpu, interleaved, style):
    kw = _call()
    apply_mrope_qk(**kw, interleaved_sections=interleaved, q_out=kw["q"], k_out=kw["k"])
    (rec,) = gpu.launches
    g, p = rec["geometry"], rec["fixed"]
    assert g.mrope == (style, 16, 24, 24) and (g.q_heads, g.k_heads, g.head_dim, g.interleaved) == (HQ, HK, D, False)
    spec = dict(g.spec().defines)
    assert (spec["FIX_MROPE"], spec["FIX_MT"], spec["FIX_MH"], spec["FIX_MW"]) == (str(style), "16", "24", "24")
    assert p.positions == kw["positions"].data.ptr and p.mrope_stride == T and p.index_flags & 1
    # a [3, T] array of its own: the dense build, which takes the streams to be T apart
    assert g.dense
    assert (p.in_[0], p.out[0], p.in_[1], p.out[1]) == (kw["q"].data.ptr,) * 2 + (kw["k"].data.ptr,) * 2


def test_batched_layouts_and_a_strided_positions_view(gpu):
    B, S = 2, 3
    q, k = fake_cupy((B, HQ, S, D), BF16), fake_cupy((B, HK, S, D), BF16)
    big = fake_cupy((3, 2, B, S), np.int32)  # each stream's [B, S] contiguous, 2 B S elements apart
    pos = big[:, 0]
    out_q, out_k = apply_mrope_qk(q, k, _call()["cos"], _call()["sin"], pos, SECTION, layout="bhsd")
    rec = gpu.launches[-1]
    assert rec["geometry"].order == 1 and rec["fixed"].mrope_stride == 2 * B * S
    # streams not the token count apart: the strided build, which reads the stride from the block
    assert not rec["geometry"].dense
    assert out_q.shape == q.shape and out_k.shape == k.shape and out_q.data.ptr != q.data.ptr
    x = fake_cupy((B, S, HQ, D), BF16)
    y = apply_mrope(x, _call()["cos"], _call()["sin"], fake_cupy((3, B, S), np.int64), SECTION, layout="bshd", out=x)
    assert y is x and gpu.launches[-1]["geometry"].k_heads == 0


@pytest.mark.parametrize("change,exc,match", [
    (dict(positions=fake_cupy((T,), np.int64)), ValueError, r"positions: expected shape \(3, 6\) \(\[3, T\]"),
    (dict(positions=fake_cupy((2, T), np.int64)), ValueError, r"positions: expected shape \(3, 6\) \(\[3, T\]"),
    (dict(positions=fake_cupy((3, T + 1), np.int64)), ValueError, "positions"),
    (dict(positions=fake_cupy((3, T), np.float32)), TypeError, "positions"),
    (dict(positions=np.zeros((3, T), np.int64)), TypeError, "positions"),
    # streams 2^31 elements apart: more than the block's 32-bit field holds
    (dict(positions=fake_cupy((3, T), np.int64, strides=(2**31 * 8, 8))), ValueError, "fewer than 2.31 elements apart"),
    (dict(mrope_section=[16, 24, 23]), ValueError, "sums to 63"),
    # two sections: two position streams, where positions holds three
    (dict(mrope_section=[16, 48]), ValueError, "first axis .3 streams. disagrees with mrope_section's 2 sections"),
    (dict(mrope_section=[16, 16, 16, 8, 8]), TypeError, "2, 3 or 4 non-negative ints"),
    (dict(mrope_section=[64]), TypeError, "2, 3 or 4 non-negative ints"),
    (dict(q=fake_cupy((T, HQ, D), BF16, byte_offset=2)), ValueError, "aligned"),
    (dict(q=np.zeros((T, HQ, D), np.float32)), TypeError, "q"),
])
def test_bad_calls_are_refused_before_any_launch(gpu, change, exc, match):
    with pytest.raises(exc, match=match):
        apply_mrope_qk(**_call(**change))
    assert gpu.launches == []


def test_an_in_place_plan_with_a_partial_window_is_made_without_outputs(gpu):
    """Omitted outputs mean in place (RopePlan's rule), which a partial window needs."""
    part = _call(cos=fake_cupy((64, 32), np.float32), sin=fake_cupy((64, 32), np.float32), mrope_section=[8, 12, 12])
    plan = MRopePlan(**part, rotary_dim=64)
    assert plan.in_place
    plan.execute(part["q"], part["k"], part["cos"], part["sin"], part["positions"])
    assert gpu.launches[-1]["geometry"].rotary_dim == 64


def test_positions_reshaped_in_place_are_validated_again(gpu):
    kw = _call()
    plan = MRopePlan(**kw)
    args = (kw["q"], kw["k"], kw["cos"], kw["sin"], kw["positions"])
    plan.execute(*args)
    plan.execute(*args)  # remembered
    kw["positions"].shape = (T, 3)  # the same object, token-major now
    with pytest.raises(ValueError, match=r"positions: expected shape \(3, 6\) \(\[3, T\]"):
        plan.execute(*args)
    assert len(gpu.launches) == 2


def test_streams_just_under_2_31_elements_apart_are_taken(gpu):
    apply_mrope_qk(**_call(positions=fake_cupy((3, T), np.int32, strides=((2**31 - 1) * 4, 4))))
    assert gpu.launches[-1]["fixed"].mrope_stride == 2**31 - 1


def test_more_refusals(gpu):
    kw = _call()
    with pytest.raises(TypeError, match="interleaved_sections"):
        apply_mrope_qk(**kw, interleaved_sections=1)
    with pytest.raises(NotImplementedError, match="partial window in place only"):
        apply_mrope_qk(**_call(cos=fake_cupy((64, 32), np.float32), sin=fake_cupy((64, 32), np.float32),
                               mrope_section=[8, 12, 12]), rotary_dim=64)
    qo = fake_cupy((T, HQ, D), BF16)
    pos = fake_cupy((3, T), np.int64, ptr=qo.data.ptr + 64)  # positions inside q_out
    with pytest.raises(ValueError, match="overlaps positions"):
        apply_mrope_qk(**_call(positions=pos), q_out=qo)
    with pytest.raises(TypeError, match="k: expected an array"):
        apply_mrope_qk(kw["q"], None, kw["cos"], kw["sin"], kw["positions"], SECTION)
    assert gpu.launches == []
    # a partial window in place is fine
    part = _call(cos=fake_cupy((64, 32), np.float32), sin=fake_cupy((64, 32), np.float32), mrope_section=[8, 12, 12])
    apply_mrope_qk(**part, rotary_dim=64, q_out=part["q"], k_out=part["k"])
    assert gpu.launches[-1]["geometry"].rotary_dim == 64


def test_new_arrays_of_a_seen_signature_take_the_address_checks_only(gpu, monkeypatch):
    first = _call()
    plan = MRopePlan(**first).compile()
    plan.execute(first["q"], first["k"], first["cos"], first["sin"], first["positions"])
    calls = []
    real = mrope.validate_mrope
    monkeypatch.setattr(mrope, "validate_mrope", lambda *a, **k: calls.append(1) or real(*a, **k))
    second = _call()
    plan.execute(second["q"], second["k"], second["cos"], second["sin"], second["positions"])
    assert calls == []
    p = gpu.launches[-1]["fixed"]
    assert (p.in_[0], p.in_[1], p.positions, p.cos) == (second["q"].data.ptr, second["k"].data.ptr,
                                                         second["positions"].data.ptr, second["cos"].data.ptr)
    # positions whose later streams reach into q: the extents of the whole array are checked
    third = _call()
    big = fake_cupy((3 * T + T * HQ * D // 4,), np.int64)
    third["positions"] = big[: 3 * T].reshape(3, T)
    third["q"] = big[3 * T - 4:].view(BF16)[: T * HQ * D].reshape(T, HQ, D)
    n = len(gpu.launches)
    with pytest.raises(ValueError, match="overlaps"):
        plan.execute(third["q"], third["k"], third["cos"], third["sin"], third["positions"])
    assert len(gpu.launches) == n


def test_the_one_call_function_reuses_its_plan(gpu):
    for _ in range(3):
        kw = _call()
        apply_mrope_qk(**kw, q_out=kw["q"], k_out=kw["k"])
    assert len(mrope.ONE_CALL.thread().by_key) == 1 and len(gpu.launches) == 3


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_sectioned_builds_compile(arch, dtype, tmp_path, monkeypatch):
    import dataclasses

    from rope_rtc.build.kernels import get_binary
    from rope_rtc.build.toolchain import target_for

    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path))
    for style, sec in ((1, (16, 24, 24)), (2, (24, 20, 20))):
        for order in (False, True):
            g = dataclasses.replace(fixed_geometry(dtype, False, 32, 8, 128, 0, 128, order), mrope=(style,) + sec)
            for build in registry.both_strides([g]):  # the dense build derives the streams' stride
                assert get_binary(build.spec(), target_for(arch)).data


@pytest.mark.parametrize("interleaved,tokens,want", [(False, T, 1), (True, T, 1), (False, 400, 2), (True, 400, 2)])
def test_heads_per_thread(gpu, interleaved, tokens, want):
    kw = _call(q=fake_cupy((tokens, HQ, D), BF16), k=fake_cupy((tokens, HK, D), BF16),
               positions=fake_cupy((3, tokens), np.int64))
    apply_mrope_qk(**kw, interleaved_sections=interleaved)
    assert gpu.launches[-1]["geometry"].head_batch == want
    assert registry.mrope_head_batch(28, 4, True, False) == 4 and registry.mrope_head_batch(28, 4, False, False) == 2
    assert registry.mrope_head_batch(3, 1, True, False) == 1
    # interleaved sections gathered in shared memory (token-major order): two heads on prefill, one at decode
    assert registry.mrope_head_batch(28, 4, True, False, gathered=True) == 2
    assert registry.mrope_head_batch(28, 4, True, True, gathered=True) == 1


def test_interleaved_sections_in_token_major_order_gather_in_shared_memory():
    g = registry.mrope_geometries("bfloat16", 28, 4, 128, 128, (24, 20, 20), True, tokens_denser=False)
    assert {x.order for x in g} == {0} and [x.head_batch for x in g] == [1, 2]  # [small launches, large ones]
    g = registry.mrope_geometries("bfloat16", 28, 4, 128, 128, (24, 20, 20), True, tokens_denser=True)
    assert {x.order for x in g} == {1} and sorted(x.head_batch for x in g) == [2, 4]


def test_a_numpy_section_is_accepted(gpu):
    kw = _call(mrope_section=np.array([16, 24, 24]))
    apply_mrope_qk(**kw)
    apply_mrope_qk(**_call(mrope_section=np.array([16, 24, 24])))  # the cached plan serves it
    assert gpu.launches[-1]["geometry"].mrope == (1, 16, 24, 24) and len(gpu.launches) == 2
    with pytest.raises(TypeError, match="2, 3 or 4 non-negative ints"):
        apply_mrope_qk(**_call(mrope_section=np.array([16.0, 24.0, 24.0])))


def test_a_missing_build_is_named_not_an_assertion(gpu, monkeypatch):
    from rope_rtc.ops import rope_plan
    from rope_rtc.errors import KernelNotCachedError

    def missing(g, device, pdl=False):
        raise KernelNotCachedError("rope_fixed[...] is not in the cache and ROPE_RTC_NO_COMPILE=1 forbids compiling it")

    monkeypatch.setattr(rope_plan, "load_fixed_function", missing)
    with pytest.raises(KernelNotCachedError, match="ROPE_RTC_NO_COMPILE"):
        apply_mrope_qk(**_call())
    assert gpu.launches == []


def test_a_plan_refuses_calls_that_do_not_fit_it(gpu):
    kw = _call()
    plan = MRopePlan(**kw)
    other = _call(q=fake_cupy((T, HQ, D), np.float16), k=fake_cupy((T, HK, D), np.float16))
    with pytest.raises(ValueError, match="execute: dtype float16"):
        plan.execute(other["q"], other["k"], other["cos"], other["sin"], other["positions"])
    with pytest.raises(ValueError, match="q heads/dim"):
        wider = _call(q=fake_cupy((T, 2 * HQ, D), BF16))
        plan.execute(wider["q"], wider["k"], wider["cos"], wider["sin"], wider["positions"])
    with pytest.raises(TypeError, match="this plan was built with k"):
        plan.execute(kw["q"], None, kw["cos"], kw["sin"], kw["positions"])
    with pytest.raises(ValueError, match="q_out: this plan rotates in place"):
        plan.execute(kw["q"], kw["k"], kw["cos"], kw["sin"], kw["positions"], q_out=fake_cupy((T, HQ, D), BF16))
    assert gpu.launches == []


def test_a_section_whose_numpy_sum_wraps_is_refused_when_made(gpu):
    """int64 sections summing past 2^63 wrapped to rotary_dim / 2 in NumPy's sum: the plan was made,
    then every execute raised and its build's defines did not compile."""
    wrapping = [np.int64(2**63 - 1), np.int64(2**63 - 1), np.int64(66)]
    for make in (lambda: MRopePlan(**_call(mrope_section=wrapping)), lambda: apply_mrope_qk(**_call(mrope_section=wrapping))):
        with pytest.raises(ValueError, match="mrope_section: .* sums to 18446744073709551680"):
            make()
    assert gpu.launches == []


def test_the_check_positions_switch_validates_the_call_before_reading_positions_back(gpu, monkeypatch):
    """ROPE_RTC_CHECK_POSITIONS=1: MRopePlan.execute read the positions and cos back before
    validating them (AttributeError for cos=None; a synchronising read of anything passed)."""
    read = []
    monkeypatch.setattr(mrope, "_positions_read_back", lambda positions: read.append(positions) or np.zeros((3, T)))
    monkeypatch.setenv("ROPE_RTC_CHECK_POSITIONS", "1")
    kw = _call()
    plan = MRopePlan(**kw)
    with pytest.raises(TypeError, match="cos: expected an array, got None"):
        plan.execute(kw["q"], kw["k"], None, kw["sin"], kw["positions"])
    with pytest.raises(TypeError, match="cos: expected a CuPy or NumPy array"):
        plan.execute(kw["q"], kw["k"], [[0.0] * 64] * 64, kw["sin"], kw["positions"])
    assert read == [] and gpu.launches == []
    plan.execute(kw["q"], kw["k"], kw["cos"], kw["sin"], kw["positions"])
    assert read == [kw["positions"]] and len(gpu.launches) == 1


def test_a_numpy_bool_is_a_bool_for_interleaved_sections_too(gpu):
    """As interleaved= and inverse= of the general API take np.bool_."""
    apply_mrope_qk(**_call(), interleaved_sections=np.True_)
    MRopePlan(**_call(), interleaved_sections=np.False_).execute(**{n: v for n, v in _call().items()
                                                                     if n != "mrope_section"})
    assert [rec["geometry"].mrope[0] for rec in gpu.launches] == [2, 1]
    with pytest.raises(TypeError, match="interleaved_sections: expected a bool"):
        apply_mrope_qk(**_call(), interleaved_sections=1)


@pytest.mark.parametrize("layout,shape,match", [
    ("bshd", (3, 6), r"positions: expected shape \(3, 2, 3\) \(\[3, B, S\]: .*\), got \(3, 6\)$"),
    ("bshd", (2, 3), r"positions: expected shape \(3, 2, 3\) \(\[3, B, S\]: .*\), got \(2, 3\)$"),
    ("thd", (3, 1, 6), r"positions: expected shape \(3, 6\) \(\[3, T\]: .*\), got \(3, 1, 6\)$"),
])
def test_a_positions_shape_error_names_the_array_passed(gpu, layout, shape, match):
    """The message described positions[0] (and, for bshd, asked for the shape of one stream)."""
    x = fake_cupy((2, 3, HQ, D), BF16) if layout == "bshd" else fake_cupy((T, HQ, D), BF16)
    kw = _call()
    with pytest.raises(ValueError, match=match):
        apply_mrope(x, kw["cos"], kw["sin"], fake_cupy(shape, np.int64), SECTION, layout=layout)
    assert gpu.launches == []


def test_apply_mrope_names_its_own_arguments(gpu):
    kw = _call(cos=fake_cupy((64, 32), np.float32), sin=fake_cupy((64, 32), np.float32))
    with pytest.raises(NotImplementedError, match=r"pass out=x, or the whole head\)$"):
        apply_mrope(kw["q"], kw["cos"], kw["sin"], kw["positions"], [8, 12, 12], rotary_dim=64)
    kw = _call()
    with pytest.raises(ValueError, match=r"^x: address"):
        apply_mrope(fake_cupy((T, HQ, D), BF16, byte_offset=2), kw["cos"], kw["sin"], kw["positions"], SECTION)
    with pytest.raises(ValueError, match=r"^k: address"):
        apply_mrope_qk(**_call(k=fake_cupy((T, HK, D), BF16, byte_offset=2)))
    assert gpu.launches == []


def test_positions_through_the_cuda_array_interface_alone(gpu):
    """Any object with __cuda_array_interface__ is an array (arrays.py): positions of that kind
    were refused as "not a device array", or failed on the missing indexing."""
    from fakes import FakeDeviceArray

    class InterfaceOnly:
        def __init__(self, fake):
            self._fake = fake

        @property
        def __cuda_array_interface__(self):
            return self._fake.__cuda_array_interface__

    pos = FakeDeviceArray((3, T), np.int64)
    apply_mrope_qk(**_call(positions=InterfaceOnly(pos)))
    (rec,) = gpu.launches
    assert rec["fixed"].positions == pos.ptr
    with pytest.raises(ValueError, match=r"positions: expected shape \(3, 6\)"):
        apply_mrope_qk(**_call(positions=InterfaceOnly(FakeDeviceArray((T, 3), np.int64))))


@pytest.mark.parametrize("section", [np.array(64), np.zeros((1, 3), np.int64)])
def test_a_section_array_of_another_rank_is_named(gpu, section):
    for make in (lambda: apply_mrope_qk(**_call(mrope_section=section)), lambda: MRopePlan(**_call(mrope_section=section))):
        with pytest.raises(TypeError, match="mrope_section: expected 2, 3 or 4 non-negative ints"):
            make()
    assert gpu.launches == []


def test_q_without_heads_is_named(gpu):
    """The message said the rotary window was not whole vectors; the cause is q's head count."""
    with pytest.raises(NotImplementedError, match=r"q: shape \(6, 0, 128\) has no heads"):
        apply_mrope_qk(**_call(q=fake_cupy((T, 0, D), BF16)))
    assert gpu.launches == []


def _launched(gpu, call) -> tuple:
    from fakes import launch_outcome

    return launch_outcome(gpu, call, lambda r: (r["fn"], r["grid"], r["block"], bytes(r["fixed"])))


def test_the_repeat_paths_launch_what_a_cold_call_launches():
    """Episodes of calls with new arrays (now and then misaligned, out of place, another token
    count, interleaved or contiguous sections, another positions dtype): each warm call (the
    thread's last generated path; a plan's quick path) launches the same entry, grid and block
    bytes as the same call in a fresh thread or a fresh plan, or raises the same."""
    from fakes import in_a_fresh_thread

    rng = np.random.default_rng(12)
    cos, sin = fake_cupy((64, D // 2), np.float32), fake_cupy((64, D // 2), np.float32)
    calls = []
    for _ in range(40):
        t, apart = int(rng.choice([T, T + 2])), rng.random() < 0.3
        inter, pdt = bool(rng.random() < 0.5), np.int64 if rng.random() < 0.7 else np.int32
        section = [24, 20, 20] if inter else SECTION
        for _ in range(6):
            off = 2 if rng.random() < 0.15 else 0
            q, k = fake_cupy((t, HQ, D), BF16, byte_offset=off), fake_cupy((t, HK, D), BF16, byte_offset=off)
            outs = (fake_cupy(q.shape, BF16), fake_cupy(k.shape, BF16)) if apart else (q, k)
            calls.append((q, k, fake_cupy((3, t), pdt), outs, section, inter))
    with FakeGPU() as gpu:
        warm = [_launched(gpu, lambda: apply_mrope_qk(q, k, cos, sin, pos, sec, interleaved_sections=inter,
                                                      q_out=outs[0], k_out=outs[1]))
                for q, k, pos, outs, sec, inter in calls]
        # One plan per section style, made from that style's first aligned in-place call.
        made = {}
        for q, k, pos, outs, sec, inter in calls:
            if outs[0] is q and not q.data.ptr % 16 and inter not in made and q.shape[0] == T:
                made[inter] = (q, k, pos, sec)
        plans = {inter: MRopePlan(q, k, cos, sin, pos, sec, interleaved_sections=inter)
                 for inter, (q, k, pos, sec) in made.items()}
        for q, k, pos, outs, sec, inter in calls:
            if outs[0] is q and inter in plans:
                warm.append(_launched(gpu, lambda: plans[inter].execute(q, k, cos, sin, pos)))

        cold = [in_a_fresh_thread(lambda: _launched(gpu, lambda: apply_mrope_qk(
                    q, k, cos, sin, pos, sec, interleaved_sections=inter, q_out=outs[0], k_out=outs[1])))
                for q, k, pos, outs, sec, inter in calls]
        for q, k, pos, outs, sec, inter in calls:
            if outs[0] is q and inter in plans:
                q0, k0, pos0, sec0 = made[inter]
                plan = MRopePlan(q0, k0, cos, sin, pos0, sec0, interleaved_sections=inter)
                cold.append(_launched(gpu, lambda: plan.execute(q, k, cos, sin, pos)))
    assert len(warm) == len(cold) and [i for i, (w, c) in enumerate(zip(warm, cold)) if w != c] == []
    assert sum(1 for w in warm if w and w[0] != "error") > 200


def test_new_arrays_of_a_seen_signature_take_the_generated_path(gpu, monkeypatch):
    from fakes import counted
    from rope_rtc.ops import rope_request

    sets = [_call() for _ in range(8)]
    for kw in sets[:2]:
        apply_mrope_qk(**kw, q_out=kw["q"], k_out=kw["k"])
    plan = MRopePlan(**sets[0])
    plan.execute(*(sets[0][n] for n in ("q", "k", "cos", "sin", "positions")))
    counts: dict = {}
    counted(monkeypatch, dispatch, "bind_once", counts)
    counted(monkeypatch, mrope, "validate_mrope", counts)
    counted(monkeypatch, rope_request, "validate", counts)
    for i in range(24):
        kw = sets[i % len(sets)]
        for call in (lambda: apply_mrope_qk(**kw, q_out=kw["q"], k_out=kw["k"]),
                     lambda: plan.execute(*(kw[n] for n in ("q", "k", "cos", "sin", "positions")))):
            call()
            f = gpu.launches[-1]["fixed"]
            assert (f.in_[0], f.in_[1], f.positions) == (kw["q"].data.ptr, kw["k"].data.ptr, kw["positions"].data.ptr)
    assert counts == {}


@pytest.mark.parametrize("declared", ["q", "positions", "all"])
def test_a_plan_built_from_declarations_is_refused_naming_the_array(declared):
    """MRopePlan takes arrays, not TensorDesc declarations (RopePlan's and TailRoPEForward's): the
    TypeError the other plans give, naming the declared array; declared positions raised an
    AttributeError from inside (no __cuda_array_interface__)."""
    from rope_rtc import TensorDesc

    T, HQ, HK, D = 6, 4, 2, 64
    arrays = dict(q=fake_cupy((T, HQ, D), BF16), k=fake_cupy((T, HK, D), BF16),
                  cos=fake_cupy((100, D // 2), np.float32), sin=fake_cupy((100, D // 2), np.float32),
                  positions=fake_cupy((3, T), np.int64))
    for name in (arrays if declared == "all" else (declared,)):
        arrays[name] = TensorDesc(arrays[name].dtype, arrays[name].shape)
    first = "q" if declared == "q" else "positions"  # the position streams are checked first
    with FakeGPU() as gpu:
        with pytest.raises(TypeError, match=rf"^{first}: a TensorDesc declares an array but holds none"):
            MRopePlan(arrays["q"], arrays["k"], arrays["cos"], arrays["sin"], arrays["positions"], [8, 12, 12],
                      layout="thd")
        assert gpu.launches == []
