"""A plan called with new arrays of a signature it has bound (CPU: fake device arrays, recorded
launches): the quick path (the one-call functions' generated checks and block write) serves
them without a bind, a remembered set or a launcher token; a set that comes back is bound and
remembered (its graph replays); what validation refuses is still refused before any launch;
and the block holds each call's own values whichever path wrote it."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import BF16, FakeGPU, counted, fake_cupy
from rope_rtc.core import prepared
from rope_rtc.ops import rope, rope_plan, rope_request
from rope_rtc.ops.rope_plan import RopePlan, one_call_signature

B, HQ, HK, D, ROWS = 8, 32, 8, 128, 4096


def _decode_set():
    return fake_cupy((B, 1, HQ, D), BF16), fake_cupy((B, 1, HK, D), BF16), fake_cupy((B,), np.int32)


@pytest.fixture
def fixed():
    with FakeGPU(fixed=True) as gpu:
        yield gpu


@pytest.fixture
def tables():
    return fake_cupy((ROWS, D // 2), np.float32), fake_cupy((ROWS, D // 2), np.float32)


def _pointers(launch: dict) -> tuple:
    p = launch["fixed"]
    return p.in_[0], p.in_[1], p.out[0], p.out[1], p.offsets


def _expected(q, k, offs) -> tuple:
    return q.data.ptr, k.data.ptr, q.data.ptr, k.data.ptr, offs.data.ptr


def test_new_arrays_of_a_bound_signature_take_the_quick_path(fixed, tables, monkeypatch):
    """Failed before the quick path: every new set was validated by its template's bind, given a
    Call, copied into the remembered sets and handed to the launcher as a new token."""
    cos, sin = tables
    q, k, offs = _decode_set()
    plan = RopePlan(q, k, cos, sin, offset=offs, layout="bshd").compile()
    plan.execute(q, k, cos, sin, offset=offs)
    assert fixed.launches[-1]["fn"][0] == "rope_fixed"
    counts: dict = {}
    counted(monkeypatch, rope_request, "validate", counts)
    counted(monkeypatch, rope_plan, "validate", counts)
    counted(monkeypatch, rope_plan.RopeTemplate, "bind", counts)
    counted(monkeypatch, prepared.Prepared, "_bind", counts)
    for _ in range(40):
        q, k, offs = _decode_set()
        assert plan.execute(q, k, cos, sin, offset=offs) == (q, k)
        assert _pointers(fixed.launches[-1]) == _expected(q, k, offs)
        assert fixed.launches[-1]["token"] is None
    assert counts == {} and len(plan._core.recent) == 1


def test_a_rotation_among_a_few_sets_is_remembered(fixed, tables):
    """The second call of a set the quick path served binds and remembers it; from its third the
    launcher gets the set's token (a graph per set), and every launch carries that set's values."""
    cos, sin = tables
    sets = [_decode_set() for _ in range(3)]
    plan = RopePlan(*sets[0][:2], cos, sin, offset=sets[0][2], layout="bshd").compile()
    plan.execute(sets[0][0], sets[0][1], cos, sin, offset=sets[0][2])
    for round_ in range(5):
        for q, k, offs in sets:
            plan.execute(q, k, cos, sin, offset=offs)
            launch = fixed.launches[-1]
            assert _pointers(launch) == _expected(q, k, offs)
            if round_ >= 2:
                assert launch["token"] is not None
    assert len(plan._core.recent) == 3


def test_new_arrays_then_the_same_arrays_again_are_bound_once_and_replayed(fixed, tables, monkeypatch):
    """New arrays (the quick path), then the same arrays on every call (an engine's buffers after
    a plan made on others): the second call binds and remembers the set, once; from the third the
    launcher gets its token, so its graph replays. Every launch carries the set's addresses."""
    cos, sin = tables
    first = _decode_set()
    plan = RopePlan(*first[:2], cos, sin, offset=first[2], layout="bshd").compile()
    plan.execute(first[0], first[1], cos, sin, offset=first[2])
    q, k, offs = _decode_set()
    counts: dict = {}
    counted(monkeypatch, prepared.Prepared, "_bind", counts)
    tokens = []
    for _ in range(6):
        plan.execute(q, k, cos, sin, offset=offs)
        assert _pointers(fixed.launches[-1]) == _expected(q, k, offs)
        tokens.append(fixed.launches[-1]["token"])
    assert counts == {"_bind": 1} and len(plan._core.recent) == 2
    assert tokens[0] is None and None not in tokens[1:] and len({id(t) for t in tokens[1:]}) == 1


def test_views_made_on_every_call_are_not_mistaken_for_a_set_seen_again(fixed, tables, monkeypatch):
    """New views of the same buffers on every call (the freed views' identities come back): each
    call takes the quick path with its own addresses, and none is remembered."""
    cos, sin = tables
    qb, kb, offs = fake_cupy((2, B, 1, HQ, D), BF16), fake_cupy((2, B, 1, HK, D), BF16), fake_cupy((B,), np.int32)
    plan = RopePlan(qb[0], kb[0], cos, sin, offset=offs, layout="bshd").compile()
    plan.execute(qb[0], kb[0], cos, sin, offset=offs)
    counts: dict = {}
    counted(monkeypatch, prepared.Prepared, "_bind", counts)
    for i in range(30):
        q, k = qb[i % 2], kb[i % 2]
        plan.execute(q, k, cos, sin, offset=offs)
        assert _pointers(fixed.launches[-1]) == _expected(q, k, offs)
    assert counts == {} and len(plan._core.recent) == 1


def test_the_block_holds_each_calls_values_whichever_path_wrote_it(fixed, tables):
    """A remembered set after a quick call restores its own block; a quick call's arrays called
    again (the plan's last call) launch the block the quick path wrote; an int offset changes only
    the offset."""
    cos, sin = tables
    a, b = _decode_set(), _decode_set()
    plan = RopePlan(a[0], a[1], cos, sin, offset=a[2], layout="bshd").compile()
    for s in (a, b, a, b, b, a, a, b):
        plan.execute(s[0], s[1], cos, sin, offset=s[2])
        assert _pointers(fixed.launches[-1]) == _expected(*s)
    q, k, _ = _decode_set()
    plan_int = RopePlan(q, k, cos, sin, offset=3, layout="bshd").compile()
    plan_int.execute(q, k, cos, sin, offset=3)
    q2, k2, _ = _decode_set()
    for off in (5, 5, 9):
        plan_int.execute(q2, k2, cos, sin, offset=off)
        p = fixed.launches[-1]["fixed"]
        assert (p.in_[0], p.in_[1], p.offset) == (q2.data.ptr, k2.data.ptr, off)


def test_what_validation_refuses_is_refused_before_any_launch(fixed, tables):
    """New arrays the quick path declines go through full validation: an offset past the table,
    other head counts, an output over the other input (out of place), q off its alignment."""
    cos, sin = tables
    q, k, _ = _decode_set()
    plan = RopePlan(q, k, cos, sin, offset=0, layout="bshd").compile()
    plan.execute(q, k, cos, sin, offset=0)
    n = len(fixed.launches)
    q2, k2, _ = _decode_set()
    with pytest.raises(ValueError, match="offset"):
        plan.execute(q2, k2, cos, sin, offset=ROWS)
    with pytest.raises((TypeError, ValueError), match="q"):
        plan.execute(fake_cupy((B, 1, HQ // 2, D), BF16), fake_cupy((B, 1, HK, D), BF16), cos, sin, offset=0)
    assert len(fixed.launches) == n
    out_plan = RopePlan(q, k, cos, sin, q_out=fake_cupy(q.shape, BF16), k_out=fake_cupy(k.shape, BF16),
                        layout="bshd").compile()
    out_plan.execute(q, k, cos, sin, q_out=fake_cupy(q.shape, BF16), k_out=fake_cupy(k.shape, BF16))
    n = len(fixed.launches)
    q3, k3, _ = _decode_set()
    with pytest.raises(ValueError, match="overlap|share|alias"):
        out_plan.execute(q3, k3, cos, sin, q_out=fake_cupy(q.shape, BF16), k_out=q3[:, :, :HK])
    assert len(fixed.launches) == n
    odd = fake_cupy((B, 1, HQ, D), BF16, byte_offset=2)
    plan.execute(odd, k2, cos, sin, offset=0)  # the generic kernel, one element at a time, takes it
    launch = fixed.launches[-1]
    assert launch["fn"][0] == "rope_apply" and launch["vec"] == 1 and launch["params"].q_in == odd.data.ptr
    plan.execute(q2, k2, cos, sin, offset=0)  # aligned again: the specialised build
    assert fixed.launches[-1]["fn"][0] == "rope_fixed" and _pointers(fixed.launches[-1])[:2] == (q2.data.ptr,
                                                                                                   k2.data.ptr)


@pytest.mark.parametrize("case", ["contiguous", "strided", "out_of_place", "no_k_positions", "angles"])
def test_the_plans_signature_is_the_one_call_functions(case):
    """The plan's quick path looks its generated function up by the signature the one-call
    functions compute argument by argument (rope._signature_and_pointers)."""
    q, k = fake_cupy((4, 16, 8, 64), np.float32), fake_cupy((4, 16, 2, 64), np.float32)
    cos, sin = fake_cupy((64, 32), np.float32), fake_cupy((64, 32), np.float32)
    positions = offsets = cu = None
    q_out, k_out = q, k
    if case == "strided":
        q = fake_cupy((4, 16, 16, 64), np.float32)[:, :, ::2]
        q_out = q
    elif case == "out_of_place":
        q_out, k_out = fake_cupy(q.shape, np.float32), fake_cupy(k.shape, np.float32)
        offsets = fake_cupy((4,), np.int64)
    elif case == "no_k_positions":
        k = k_out = None
        positions = fake_cupy((4, 16), np.int32)
    elif case == "angles":
        cos, sin = fake_cupy((32,), np.float64), None
        cu = fake_cupy((5,), np.int32)
    arrays = (q, k, cos, sin, positions, q_out, k_out, cu, offsets)
    with FakeGPU():
        sig, _ = rope._signature_and_pointers(arrays)
    assert one_call_signature(arrays) == sig


def test_a_new_offsets_array_each_call_is_not_mistaken_for_a_set_seen_again(fixed, tables, monkeypatch):
    """q and k kept, an offsets array made each call (the freed one's identity comes back two
    calls later): each call takes the quick path, and no set is remembered. Failed while only
    q was held weakly: every other call was bound in full and remembered."""
    cos, sin = tables
    q, k, offs = _decode_set()
    plan = RopePlan(q, k, cos, sin, offset=offs, layout="bshd").compile()
    plan.execute(q, k, cos, sin, offset=offs)
    plan.execute(*_decode_set()[:2], cos, sin, offset=offs)  # another set: the quick path from here
    counts: dict = {}
    counted(monkeypatch, prepared.Prepared, "_bind", counts)
    for _ in range(40):
        offs = fake_cupy((B,), np.int32)
        plan.execute(q, k, cos, sin, offset=offs)
        assert _pointers(fixed.launches[-1]) == _expected(q, k, offs)
        del offs
    assert counts == {} and len(plan._core.recent) == 1


def _tail_set(T=4, H=8, D=512):
    return (fake_cupy((T, H, D), BF16), fake_cupy((T, 32), np.float32), fake_cupy((T, 32), np.float32),
            fake_cupy((T, H, D), BF16))


def test_a_tail_plan_with_new_arrays_takes_the_quick_path(monkeypatch):
    """TailRoPEForward with new arrays of its signature every call (new outputs included): no
    validation, no bind, no launcher token; each call's block holds its own addresses and the
    call returns its own output. Before the tail op had a quick path every such call was bound,
    copied into the remembered sets and handed to the launcher as a new token."""
    from rope_rtc.ops import tail
    from rope_rtc.ops.tail import TailRoPEForward

    with FakeGPU() as gpu:
        first = _tail_set()
        plan = TailRoPEForward(*first).check_support().compile()
        plan.execute(*first)
        counts: dict = {}
        counted(monkeypatch, tail._TailOp, "validate", counts)
        counted(monkeypatch, prepared.Prepared, "_bind", counts)
        v = plan._core.block
        for _ in range(30):
            x, c, s, o = _tail_set()
            got = plan.execute(x, c, s, o)
            assert got["out"] is o and len(got) == 1
            assert (v.x, v.cos, v.sin, v.out) == (x.data.ptr, c.data.ptr, s.data.ptr, o.data.ptr)
            assert gpu.launches[-1]["token"] is None
        assert counts == {} and len(plan._core.recent) == 1


@pytest.mark.parametrize("bad", ["dtype", "shape", "strided", "overlap"])
def test_a_tail_plans_quick_path_checks_the_callers_output(bad):
    """The output is the caller's here: one of another dtype, shape or layout, or over the input,
    is declined by the quick path and refused by full validation before any launch."""
    from rope_rtc.ops.tail import TailRoPEForward

    with FakeGPU() as gpu:
        first = _tail_set()
        plan = TailRoPEForward(*first).check_support().compile()
        plan.execute(*first)
        plan.execute(*_tail_set())  # the quick path from here
        x, c, s, o = _tail_set()
        out = {"dtype": fake_cupy(o.shape, np.float16), "shape": fake_cupy((4, 8, 256), BF16),
               "strided": fake_cupy((4, 8, 1024), BF16)[:, :, ::2], "overlap": x}[bad]
        n = len(gpu.launches)
        with pytest.raises((TypeError, ValueError, NotImplementedError), match="out"):
            plan.execute(x, c, s, out)
        assert len(gpu.launches) == n
