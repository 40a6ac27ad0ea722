"""The one-call functions on the prepared-launch core, on the CPU (fake device arrays, recorded
launches): what the repeat path does and does not do, per-thread plans, and the address checks
that remain on new arrays of a signature seen before."""

from __future__ import annotations

import os
import threading
import weakref

import numpy as np
import pytest

from fakes import BF16, FakeDeviceArray, FakeGPU, fake_alloc, fake_cupy
from fakes import counted as _counted
from rope_rtc import apply_rope, apply_rope_qk, env, tail_rope
from rope_rtc.core import dispatch, prepared
from rope_rtc.ops import rope, rope_params, rope_plan, rope_request

B, S, HQ, HK, D, ROWS = 8, 1, 32, 8, 128, 4096


def decode_arrays(seed: int = 0):
    """A decode step's arrays (bf16 q [8,1,32,128], k [8,1,8,128], per-sequence offsets) at fresh addresses."""
    q = fake_cupy((B, S, HQ, D), BF16)
    k = fake_cupy((B, S, HK, D), BF16)
    return q, k, fake_cupy((B,), np.int32)


@pytest.fixture
def table():
    return fake_cupy((ROWS, D // 2), np.float32), fake_cupy((ROWS, D // 2), np.float32)


class _CountingEnviron(dict):
    """os.environ's contents, counting every read."""

    def __init__(self, base) -> None:
        super().__init__(base)
        self.reads = 0

    def get(self, key, default=None):
        self.reads += 1
        return super().get(key, default)

    def __getitem__(self, key):
        self.reads += 1
        return super().__getitem__(key)

    def __contains__(self, key):
        self.reads += 1
        return super().__contains__(key)




def test_repeat_path_reads_no_environment_builds_no_launcher_and_validates_nothing(gpu, table, monkeypatch):
    cos, sin = table
    q, k, offs = decode_arrays()
    apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd")  # the first call of the signature
    assert len(gpu.launches) == 1
    counts: dict = {}
    environ = _CountingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", environ)
    _counted(monkeypatch, env, "settings", counts)
    _counted(monkeypatch, prepared.Prepared, "_new_launcher", counts)
    _counted(monkeypatch, rope_plan.RopePlan, "__init__", counts)
    for module in (rope, rope_plan):  # every full validation goes through rope_request.validate
        _counted(monkeypatch, module, "validate", counts)
    _counted(monkeypatch, rope_request, "validate", counts)
    sets = [decode_arrays() for _ in range(64)]
    for i in range(200):
        q, k, offs = sets[i % len(sets)]
        assert apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd") == (q, k)
        p = gpu.launches[-1]["params"]
        assert (p.q_in, p.q_out, p.k_in, p.k_out, p.offsets) == (q.data.ptr, q.data.ptr, k.data.ptr, k.data.ptr,
                                                                 offs.data.ptr)
    assert counts == {} and environ.reads == 0
    assert len(gpu.launches) == 201
    # Nothing of the caller's is held after a call: the plans keep templates, not arrays.
    for plan in rope.ONE_CALL.thread().by_key.values():
        assert plan._core.last is None and not plan._core.recent


def test_one_call_plans_are_per_signature_and_bounded(gpu, table):
    cos, sin = table
    q, k, offs = decode_arrays()
    apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd")
    apply_rope(q, cos, sin, offset=3, out=q, layout="bshd")
    apply_rope(q, cos, sin, offset=3, layout="bshd")  # out of place: another plan
    plans = rope.ONE_CALL.thread().by_key
    assert len(plans) == 3
    # A different token count is a new signature of the same plan: no new plan.
    q2 = fake_cupy((B, 5, HQ, D), BF16)
    apply_rope(q2, cos, sin, offset=3, out=q2, layout="bshd")
    assert len(plans) == 3 and len(rope.ONE_CALL.thread().by_signature) == 4
    for h in range(1, dispatch.ONE_CALL_SIGNATURES + 10):
        x = fake_cupy((1, 1, h, 8), np.float32)
        apply_rope(x, cos[:, :4], sin[:, :4], out=x, layout="bshd")
    assert len(plans) <= dispatch.ONE_CALL_SIGNATURES and len(rope.ONE_CALL.thread().by_signature) <= dispatch.ONE_CALL_SIGNATURES


def test_address_checks_still_run_on_a_known_signature(gpu, table):
    cos, sin = table
    q, k, offs = decode_arrays()
    apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd")
    n = len(gpu.launches)
    # The same signature at an address the 16-byte access cannot use: a narrower build, or the error.
    q_odd = fake_cupy((B, S, HQ, D), BF16, byte_offset=2)
    apply_rope_qk(q_odd, k, cos, sin, offset=offs, q_out=q_odd, k_out=k, layout="bshd")
    assert gpu.launches[-1]["vec"] == 1
    # Overlap of an output with another argument is found on the repeat path too.
    base = fake_cupy((B, S, HQ + HK, D), BF16)
    qv, kv = base[:, :, :HQ], base[:, :, HQ - HK + 1:HQ + 1]
    with pytest.raises(ValueError, match="overlaps"):
        apply_rope_qk(qv, kv, cos, sin, offset=offs, q_out=qv, k_out=kv, layout="bshd")
    # Every other pairing too (the template lists each unordered pair once): k rotated in place
    # over the offsets array, q over the offsets, and k over the table.
    q2, k2, _ = decode_arrays()
    shared = fake_cupy(cos.shape, np.float32)  # a table whose first bytes are k's
    k_on_table = shared.reshape(-1).view(BF16)[:k2.size].reshape(k2.shape)
    for offsets, q_arg, k_arg, tables in (
            (k2.reshape(-1)[:2 * B].view(np.int32), q2, k2, (cos, sin)),
            (q2.reshape(-1)[:2 * B].view(np.int32), q2, k2, (cos, sin)),
            (offs, q2, k_on_table, (cos, shared))):
        with pytest.raises(ValueError, match="overlaps"):
            apply_rope_qk(q_arg, k_arg, *tables, offset=offsets, q_out=q_arg, k_out=k_arg, layout="bshd")
    assert len(gpu.launches) == n + 1


def test_threads_never_share_a_plan(table):
    """8 threads, 1,000 calls each on their own arrays: every launch carries the calling
    thread's pointers (a shared argument block would mix them), and no two threads hold the
    same plan."""
    cos, sin = table
    plan_ids: dict[int, set] = {}
    errors: list = []
    with FakeGPU() as gpu:
        lock = threading.Lock()
        start = threading.Barrier(8)  # all alive at once: thread idents stay distinct

        def worker(t: int) -> None:
            try:
                start.wait()
                sets = [decode_arrays() for _ in range(8)]
                mine = []
                for i in range(1000):
                    q, k, offs = sets[i % len(sets)]
                    apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd")
                    mine.append((q.data.ptr, k.data.ptr, offs.data.ptr))
                with lock:
                    plan_ids[t] = {id(p) for p in rope.ONE_CALL.thread().by_key.values()}
                expected.append((threading.get_ident(), mine))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        expected: list = []
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors, errors
    by_thread: dict[int, list] = {}
    for rec in gpu.launches:
        p = rec["params"]
        by_thread.setdefault(rec["thread"], []).append((p.q_in, p.k_in, p.offsets))
    for ident, mine in expected:
        assert by_thread[ident] == mine
    ids = list(plan_ids.values())
    assert all(len(s) == 1 for s in ids)
    assert len(set().union(*ids)) == 8


def test_tail_rope_one_call_keeps_no_arrays(table):
    with FakeGPU() as gpu:
        for T in (4, 4, 7):
            x = fake_cupy((T, 64, 512), BF16)
            c, s = fake_cupy((T, 32), np.float32), fake_cupy((T, 32), np.float32)
            out, = tail_rope(x, c, s)
            assert out.shape == x.shape and out.data.ptr != x.data.ptr
            assert gpu.launches[-1]["fn"] == "tail_rope_bf16_x1"
        from rope_rtc.ops import tail

        plans = list(tail.ONE_CALL.thread().by_key.values())
        assert len(plans) == 1 and plans[0]._decl is None
        assert plans[0]._core.last is None and not plans[0]._core.recent
        assert len(gpu.launches) == 3


def test_a_numpy_offset_scalar_is_an_int(gpu, table):
    cos, sin = table
    q = fake_cupy((B, S, HQ, D), BF16)
    apply_rope(q, cos, sin, offset=np.int64(9), out=q, layout="bshd")
    assert gpu.launches[-1]["params"].offset == 9
    plan = rope_plan.RopePlan(q, None, cos, sin, layout="bshd").compile()
    plan.execute(q, None, cos, sin, offset=np.int32(11))
    assert gpu.launches[-1]["params"].offset == 11
    with pytest.raises(TypeError, match="offset: expected an int or an int array"):
        apply_rope(q, cos, sin, offset=5.0, out=q, layout="bshd")


# ---------------------------------------------------------------------------------------------
# a template never serves a call that full validation would treat differently

def test_an_in_place_template_does_not_serve_a_separate_output(gpu):
    # out=x[:] is the same view as x (in place); a later out=y of the same signature is not.
    cos, sin = fake_cupy((64, 16), np.float32), fake_cupy((64, 16), np.float32)
    x = fake_cupy((2, 8, 4, 64), np.float32)
    apply_rope(x, cos, sin, rotary_dim=32, out=x[:], layout="bshd")
    assert gpu.launches[-1]["params"].copy_passthrough == 0
    y = fake_cupy((2, 8, 4, 64), np.float32)
    apply_rope(x, cos, sin, rotary_dim=32, out=y, layout="bshd")
    assert gpu.launches[-1]["params"].copy_passthrough == 1  # channels 32..63 of y are copied
    # ... and an output that overlaps its input without being the same view is refused.
    buf = fake_cupy((2, 9, 4, 64), np.float32)
    a, b = buf[:, :8], buf[:, 1:]
    apply_rope(a, cos, sin, rotary_dim=32, out=a[:], layout="bshd")
    n = len(gpu.launches)
    with pytest.raises(ValueError, match="out overlaps x"):
        apply_rope(a, cos, sin, rotary_dim=32, out=b, layout="bshd")
    assert len(gpu.launches) == n
    # An in-place plan refuses separate outputs even after an equal view was accepted.
    k = fake_cupy((2, 8, 2, 64), np.float32)
    plan = rope_plan.RopePlan(x, k, cos[:, :16], sin[:, :16], rotary_dim=32, layout="bshd")
    plan.execute(x, k, cos[:, :16], sin[:, :16], q_out=x[:], k_out=k[:])
    with pytest.raises(ValueError, match="q_out: this plan rotates in place"):
        plan.execute(x, k, cos, sin, q_out=y, k_out=fake_cupy((2, 8, 2, 64), np.float32))


@pytest.mark.parametrize("option,value", [("interleaved", 1), ("inverse", 0), ("rotary_offset", False),
                                          ("rotary_dim", 64.0), ("layout", ["bshd"])])
def test_options_of_the_wrong_type_are_refused_after_a_valid_call_too(gpu, option, value):
    cos, sin = fake_cupy((64, 32), np.float32), fake_cupy((64, 32), np.float32)
    x = fake_cupy((2, 8, 4, 64), np.float32)
    good = dict(interleaved=True, inverse=False, rotary_offset=0, rotary_dim=64, layout="bshd")
    apply_rope(x, cos, sin, out=x, **good)
    n = len(gpu.launches)
    with pytest.raises((TypeError, ValueError), match=option):
        apply_rope(x, cos, sin, out=x, **{**good, option: value})
    assert len(gpu.launches) == n


def test_a_plan_notices_k_reshaped_in_place(gpu):
    cos, sin = fake_cupy((64, 32), np.float32), fake_cupy((64, 32), np.float32)
    q, k = fake_cupy((2, 8, 4, 64), np.float32), fake_cupy((2, 8, 4, 64), np.float32)
    plan = rope_plan.RopePlan(q, k, cos, sin, layout="bshd")
    plan.execute(q, k, cos, sin)
    k.shape = (2, 8, 2, 128)  # CuPy reshapes in place
    with pytest.raises(ValueError, match="k: shape"):
        plan.execute(q, k, cos, sin)


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("what,new_shape", [("q_out", (8, 8, 64)), ("cos", (128, 64)), ("offsets", (2, 2))])
def test_an_argument_reshaped_in_place_keeps_the_memory_validated(what, new_shape, fixed):
    """A remembered call re-checks the shapes that fix its launch (q and k: the test above); an
    in-place reshape of any other argument keeps its size and memory, so the repeat reads and
    writes exactly the bytes validated before (the block does not change)."""
    with FakeGPU(fixed=fixed) as gpu:
        cos, sin = fake_cupy((256, 32), np.float32), fake_cupy((256, 32), np.float32)
        q, k = fake_cupy((4, 2, 8, 64), BF16), fake_cupy((4, 2, 4, 64), BF16)
        qo, ko = fake_cupy((4, 2, 8, 64), BF16), fake_cupy((4, 2, 4, 64), BF16)
        offs = fake_cupy((4,), np.int32)
        plan = rope_plan.RopePlan(q, k, cos, sin, offset=offs, q_out=qo, k_out=ko, layout="bshd")

        def block() -> bytes:
            plan.execute(q, k, cos, sin, q_out=qo, k_out=ko, offset=offs)
            return bytes(plan._core.block)

        before = block()
        {"q_out": qo, "cos": cos, "offsets": offs}[what].shape = new_shape
        assert block() == before and len(gpu.launches) == 2


@pytest.mark.parametrize("fixed", [False, True])
def test_an_int_subclass_offset_is_its_value(fixed):
    """An IntEnum (or any int subclass) is validated as the int it is, and launched as that int."""
    import enum

    class Step(enum.IntEnum):
        FIVE = 5

    with FakeGPU(fixed=fixed) as gpu:
        cos, sin = fake_cupy((64, 16), np.float32), fake_cupy((64, 16), np.float32)
        x = fake_cupy((2, 4, 4, 32), np.float32)

        def offset_launched():
            rec = gpu.launches[-1]
            return (rec.get("fixed") or rec.get("params")).offset

        apply_rope(x, cos, sin, offset=5, out=x, layout="bshd")  # the repeat path's signature, first
        apply_rope(x, cos, sin, offset=Step.FIVE, out=x, layout="bshd")
        assert offset_launched() == 5
        rope_plan.RopePlan(x, None, cos, sin, layout="bshd").execute(x, None, cos, sin, offset=Step.FIVE)
        assert offset_launched() == 5
        with pytest.raises(ValueError, match="offset: positions 61..64 fall outside the table's 64 rows"):
            apply_rope(x, cos, sin, offset=type("Big", (int,), {})(61), out=x, layout="bshd")


@pytest.mark.parametrize("fixed", [False, True])
def test_empty_index_arrays_off_their_alignment_are_accepted_as_validation_accepts_them(fixed):
    # Nothing reads an empty array: its address is not checked, by validation or by a template.
    with FakeGPU(fixed=fixed) as gpu:
        cos, sin = fake_cupy((16, 16), np.float32), fake_cupy((16, 16), np.float32)
        x = fake_cupy((2, 0, 4, 32), np.float32)  # no tokens
        apply_rope(x, cos, sin, positions=fake_cupy((2, 0), np.int32, byte_offset=2), out=x, layout="bshd")
        x = fake_cupy((0, 3, 4, 32), np.float32)  # no sequences
        offs = fake_cupy((0,), np.int64, byte_offset=4)
        apply_rope(x, cos, sin, offset=offs, out=x, layout="bshd")
        rope_plan.RopePlan(x, None, cos, sin, offset=offs, layout="bshd").execute(x, None, cos, sin, offset=offs)
        assert gpu.launches == []


def test_a_plan_reads_another_librarys_array_again_on_every_call(gpu):
    """A torch tensor can move its memory under the same object (``t.set_``, ``t.data = ...``):
    calls with arrays that are not CuPy's are never served from what a plan remembers."""
    cos, sin = fake_cupy((64, 32), np.float32), fake_cupy((64, 32), np.float32)
    x = FakeDeviceArray((2, 8, 4, 64), np.float32)
    plan = rope_plan.RopePlan(x, None, cos, sin, layout="bshd")
    plan.execute(x, None, cos, sin)
    plan.execute(x, None, cos, sin)
    assert gpu.launches[-1]["params"].q_in == x.ptr
    x.ptr = fake_alloc(2 * 8 * 4 * 64 * 4)  # the same object, its storage swapped
    plan.execute(x, None, cos, sin)
    assert gpu.launches[-1]["params"].q_in == gpu.launches[-1]["params"].q_out == x.ptr


def test_a_plan_call_with_another_librarys_array_is_launched_without_a_token(gpu):
    """A call that is bound anew every time (not every argument a CuPy array) hands the launcher
    no token: a graph of it could never replay, and a token the launcher remembers would keep
    the caller's arrays alive after the call."""
    cos, sin = fake_cupy((64, 32), np.float32), fake_cupy((64, 32), np.float32)
    x = FakeDeviceArray((2, 8, 4, 64), np.float32)
    plan = rope_plan.RopePlan(x, None, cos, sin, layout="bshd")
    for _ in range(3):
        plan.execute(x, None, cos, sin)
    assert [launch["token"] for launch in gpu.launches] == [None] * 3
    y = fake_cupy((2, 8, 4, 64), np.float32)  # CuPy arrays: remembered, so a token to replay
    plan = rope_plan.RopePlan(y, None, cos, sin, layout="bshd")
    plan.execute(y, None, cos, sin)
    plan.execute(y, None, cos, sin)
    assert gpu.launches[-1]["token"] is not None and gpu.launches[-1]["token"] is gpu.launches[-2]["token"]


def test_a_plan_keeps_the_argument_set_it_uses_all_along(gpu, monkeypatch):
    """A plan forgets the least recently used of its remembered argument sets, not the oldest:
    the set an engine uses on every step, between ever new ones, is bound once."""
    from rope_rtc.core import prepared

    cos, sin = fake_cupy((64, 32), np.float32), fake_cupy((64, 32), np.float32)
    steady = fake_cupy((2, 8, 4, 64), np.float32)
    passing = [fake_cupy((2, 8, 4, 64), np.float32) for _ in range(3 * prepared.RECENT_SETS)]
    plan = rope_plan.RopePlan(steady, None, cos, sin, layout="bshd")
    bound = []
    inner = prepared.Prepared._bind

    def counted(self, arrays, scalar):
        bound.append(arrays[0])
        return inner(self, arrays, scalar)

    monkeypatch.setattr(prepared.Prepared, "_bind", counted)
    for x in passing:
        plan.execute(steady, None, cos, sin)
        plan.execute(x, None, cos, sin)
    assert sum(a is steady for a in bound) <= 1
    assert gpu.launches[-2]["params"].q_in == steady.data.ptr and gpu.launches[-1]["params"].q_in == passing[-1].data.ptr


def test_a_plans_flat_views_of_another_librarys_array_are_made_again_on_every_call(gpu):
    """``head_dim=`` (flat q [T, H * D]): the views of a call whose arrays are not CuPy's are
    not kept for the next call, since the same object can come back with other memory or
    strides (torch: ``t.set_``, ``t.data = ...``, ``t.as_strided_``) and an unchanged shape."""
    T, H, D = 4, 2, 64
    cos, sin = fake_cupy((64, D // 2), np.float32), fake_cupy((64, D // 2), np.float32)
    q = FakeDeviceArray((T, H * D), np.float16)
    plan = rope_plan.RopePlan(q, None, cos, sin, layout="thd", head_dim=D)
    plan.execute(q, None, cos, sin)
    q.ptr = fake_alloc(T * 3 * H * D * 2)  # the same object over new memory, rows three heads' worth apart
    q.strides = (3 * H * D * 2, 2)
    plan.execute(q, None, cos, sin)
    p = gpu.launches[-1]["params"]
    assert p.q_in == p.q_out == q.ptr
    assert p.q_in_ss == 3 * H * D  # the token stride of the new view, in elements


# ---------------------------------------------------------------------------------------------
# the repeat path at the specialised build, and the signature it reads

def test_repeat_path_at_the_specialised_build_binds_without_a_call_record(table, monkeypatch):
    cos, sin = table
    with FakeGPU(fixed=True) as gpu:
        q, k, offs = decode_arrays()
        apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd")
        assert gpu.launches[-1]["fn"][0] == "rope_fixed"
        counts: dict = {}
        _counted(monkeypatch, env, "settings", counts)
        _counted(monkeypatch, rope_request, "validate", counts)
        _counted(monkeypatch, rope, "validate", counts)
        _counted(monkeypatch, rope_plan.RopeTemplate, "bind", counts)  # the path that builds a Call
        _counted(monkeypatch, prepared, "Call", counts)
        sets = [decode_arrays() for _ in range(64)]
        for i in range(130):
            q, k, offs = sets[i % len(sets)]
            assert apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd") == (q, k)
            p = gpu.launches[-1]["fixed"]
            assert (p.in_[0], p.in_[1], p.out[0], p.out[1], p.offsets, p.cos, p.sin) == (
                q.data.ptr, k.data.ptr, q.data.ptr, k.data.ptr, offs.data.ptr, cos.data.ptr, sin.data.ptr)
            assert p.table_vec == 1 and p.offset == 0
        assert counts == {} and len(gpu.launches) == 131
        # A table off the vector alignment of its rows is read a float at a time.
        wide = fake_cupy((ROWS, D // 2 + 1), np.float32)
        apply_rope_qk(q, k, wide[:, 1:], wide[:, :-1], offset=offs, q_out=q, k_out=k, layout="bshd")
        assert gpu.launches[-1]["fixed"].table_vec == 0


def test_a_strided_view_of_a_contiguous_arrays_shape_gets_its_own_template(table):
    cos, sin = table
    with FakeGPU(fixed=True) as gpu:
        q, k, offs = decode_arrays()
        apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd")
        assert gpu.launches[-1]["fixed"].in_sh[0] == D
        wide = fake_cupy((B, S, HQ, 2 * D), BF16)
        qv = wide[..., :D]  # q's shape and dtype, not C-contiguous
        apply_rope_qk(qv, k, cos, sin, offset=offs, q_out=qv, k_out=k, layout="bshd")
        p = gpu.launches[-1]["fixed"]
        assert (p.in_[0], p.in_sh[0], p.in_sb[0]) == (qv.data.ptr, 2 * D, HQ * 2 * D)
        apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd")
        assert gpu.launches[-1]["fixed"].in_sh[0] == D
        # Arrays that differ only in the stride of an axis of length 1 are both C-contiguous: one
        # template serves them (no address depends on that stride).
        q1 = fake_cupy((B, HQ, D), BF16)[:, None]
        assert q1.shape == q.shape and q1.strides != q.strides and q1._c_contiguous
        templates = len(rope.ONE_CALL.thread().by_signature)
        apply_rope_qk(q1, k, cos, sin, offset=offs, q_out=q1, k_out=k, layout="bshd")
        p = gpu.launches[-1]["fixed"]
        assert (p.in_[0], p.out[0], p.in_sb[0], p.in_sh[0]) == (q1.data.ptr, q1.data.ptr, HQ * D, D)
        assert len(rope.ONE_CALL.thread().by_signature) == templates


def test_cupy_arrays_carry_the_contiguity_flag_the_one_call_signature_reads():
    import cupy

    assert isinstance(fake_cupy((2, 3), np.float32)._c_contiguous, bool)
    assert hasattr(cupy.ndarray, "_c_contiguous")
    assert fake_cupy((4, 6), np.float32)[:, :3]._c_contiguous is False


def _tail_binds_new_arrays(tail, n: int) -> None:
    """``n`` tail_rope calls on new [4, 64, 512] arrays: each writes its addresses into the one
    plan's block."""
    for _ in range(n):
        x, c, s = fake_cupy((4, 64, 512), BF16), fake_cupy((4, 32), np.float32), fake_cupy((4, 32), np.float32)
        out, = tail_rope(x, c, s)
        (plan,) = tail.ONE_CALL.thread().by_key.values()
        v = plan._core.block
        assert (v.x, v.out, v.cos, v.sin, v.n) == (x.data.ptr, out.data.ptr, c.data.ptr, s.data.ptr, 4 * 64 * 512 // 8)


def test_tail_rope_repeat_path_binds_new_arrays_without_full_validation(monkeypatch):
    from rope_rtc.ops import tail

    with FakeGPU() as gpu:
        x = fake_cupy((4, 64, 512), BF16)
        c, s = fake_cupy((4, 32), np.float32), fake_cupy((4, 32), np.float32)
        tail_rope(x, c, s)
        counts: dict = {}
        _counted(monkeypatch, tail._TailOp, "validate", counts)
        _counted(monkeypatch, tail._TailTemplate, "bind", counts)
        _tail_binds_new_arrays(tail, 5)
        assert counts == {} and len(gpu.launches) == 6
        # New arrays the template cannot take go through full validation, which names the problem.
        n = len(gpu.launches)
        odd = fake_cupy((4 * 32 + 1,), np.float32)[1:].reshape(4, 32)
        with pytest.raises(ValueError, match="cosine"):
            tail_rope(x, odd, s)
        assert len(gpu.launches) == n and counts.get("validate") == 1


# ---------------------------------------------------------------------------------------------
# the thread's last repeat path (a template's generated one_call for the signature)

def test_a_repeated_signature_skips_the_signature_tuples_and_the_dictionary(table, monkeypatch):
    cos, sin = table
    with FakeGPU(fixed=True) as gpu:
        q, k, offs = decode_arrays()
        apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd")
        apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd")  # makes the thread's record
        counts: dict = {}
        _counted(monkeypatch, rope.ONE_CALL, "_signature_of", counts)
        _counted(monkeypatch, rope_request, "validate", counts)
        sets = [decode_arrays() for _ in range(8)]
        for i in range(20):
            q, k, offs = sets[i % len(sets)]
            apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd")
            p = gpu.launches[-1]["fixed"]
            assert (p.in_[0], p.in_[1], p.out[0], p.out[1], p.offsets) == (
                q.data.ptr, k.data.ptr, q.data.ptr, k.data.ptr, offs.data.ptr)
        assert counts == {}


def test_the_public_functions_take_the_last_repeat_path_themselves(table, monkeypatch):
    """A repeated call goes from apply_rope / apply_rope_qk to the generated function and the
    launch, without _run_device (a call and an options tuple): in place, with outputs given, with
    an output the function allocates, on the current stream and on a given one. An offset of
    another type than the signature's still reaches _run_device, which sorts it out."""
    cos, sin = table
    with FakeGPU(fixed=True) as gpu:
        q, k, offs = decode_arrays()
        for _ in range(2):
            apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd")
        counts: dict = {}
        _counted(monkeypatch, rope, "_run_device", counts)
        for stream, handle in ((None, 0), (77, 77)):
            q, k, offs = decode_arrays()
            assert apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, stream=stream, layout="bshd") == (q, k)
            rec = gpu.launches[-1]
            assert (rec["fixed"].in_[0], rec["fixed"].offsets, rec["stream"]) == (q.data.ptr, offs.data.ptr, handle)
        assert counts == {}
        x = fake_cupy((B, S, HQ, D), BF16)
        for _ in range(2):
            apply_rope(x, cos, sin, offset=3, layout="bshd")
        counts.clear()
        for stream, handle in ((None, 0), (78, 78)):
            x = fake_cupy((B, S, HQ, D), BF16)
            out = apply_rope(x, cos, sin, offset=5, stream=stream, layout="bshd")
            rec = gpu.launches[-1]
            assert out is not x and out.shape == x.shape and out.dtype == x.dtype
            assert (rec["fixed"].in_[0], rec["fixed"].out[0], rec["fixed"].offset, rec["stream"]) == (
                x.data.ptr, out.data.ptr, 5, handle)
            given = fake_cupy(x.shape, BF16)
            assert apply_rope(x, cos, sin, offset=6, out=given, stream=stream, layout="bshd") is given
            assert (gpu.launches[-1]["fixed"].out[0], gpu.launches[-1]["stream"]) == (given.data.ptr, handle)
        assert counts == {}
        n = len(gpu.launches)
        apply_rope(x, cos, sin, offset=np.int64(9), layout="bshd")
        assert counts == {"_run_device": 1} and len(gpu.launches) == n + 1
        assert gpu.launches[-1]["fixed"].offset == 9


def test_a_call_without_a_layout_repeats_and_its_path_refuses_a_4d_array(table, monkeypatch):
    """``layout=None`` (a [T, H, D] call needs no layout) is an option the repeat paths compare by
    identity like any other: such a call repeats without validation, and a 4-d array passed without
    a layout after it gets full validation's refusal, never the 3-d call's path; ``layout="thd"``
    launches the same block."""
    cos, sin = table
    with FakeGPU(fixed=True) as gpu:
        q, k = fake_cupy((B, HQ, D), BF16), fake_cupy((B, HK, D), BF16)
        for _ in range(2):
            apply_rope_qk(q, k, cos, sin, offset=3, q_out=q, k_out=k)
        counts: dict = {}
        _counted(monkeypatch, rope, "_run_device", counts)
        for module in (rope, rope_plan, rope_request):
            _counted(monkeypatch, module, "validate", counts)
        for _ in range(4):
            q, k = fake_cupy((B, HQ, D), BF16), fake_cupy((B, HK, D), BF16)
            assert apply_rope_qk(q, k, cos, sin, offset=3, q_out=q, k_out=k) == (q, k)
            assert gpu.launches[-1]["fixed"].in_[0] == q.data.ptr
        assert counts == {}
        block = bytes(gpu.launches[-1]["fixed"])
        n = len(gpu.launches)
        q4, k4 = fake_cupy((2, HQ, 4, D), BF16), fake_cupy((2, HK, 4, D), BF16)  # [B, H, S, D]
        with pytest.raises(ValueError, match=r'layout: q has shape \(2, 32, 4, 128\).*"bshd".*"bhsd".*"sbhd"'):
            apply_rope_qk(q4, k4, cos, sin, offset=3, q_out=q4, k_out=k4)
        x = fake_cupy((B, HQ, D), BF16)
        for _ in range(2):
            apply_rope(x, cos, sin, offset=3, out=x)
        with pytest.raises(ValueError, match=r'layout: x has shape \(2, 32, 4, 128\).*"bshd".*"bhsd".*"sbhd"'):
            apply_rope(q4, cos, sin, offset=3, out=q4)
        with pytest.raises(ValueError, match=r'layout: x has shape \(2, 32, 4, 128\)'):
            apply_rope(q4, cos, sin, offset=3)
        assert len(gpu.launches) == n + 2
        apply_rope_qk(q, k, cos, sin, offset=3, q_out=q, k_out=k, layout="thd")
        assert bytes(gpu.launches[-1]["fixed"]) == block


def test_the_last_repeat_path_still_checks_every_argument(table):
    """Each way a call can differ from the thread's last one (shape, dtype, contiguity, an
    absent or extra argument, in place or not, addresses, offset) is noticed: the call gets the
    plan its signature needs, a narrower build, or the error full validation gives."""
    cos, sin = table
    with FakeGPU(fixed=True) as gpu:
        def record():
            q, k, offs = decode_arrays()
            for _ in range(2):
                apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, layout="bshd")
            assert gpu.launches[-1]["fn"][0] == "rope_fixed"
            return offs

        offs = record()
        # Another token count: its own geometry.
        q5, k5 = fake_cupy((B, 5, HQ, D), BF16), fake_cupy((B, 5, HK, D), BF16)
        apply_rope_qk(q5, k5, cos, sin, offset=offs, q_out=q5, k_out=k5, layout="bshd")
        assert gpu.launches[-1]["fixed"].seq_len == 5
        offs = record()
        # Another dtype of the same shape.
        qf, kf = fake_cupy((B, S, HQ, D), np.float16), fake_cupy((B, S, HK, D), np.float16)
        apply_rope_qk(qf, kf, cos, sin, offset=offs, q_out=qf, k_out=kf, layout="bshd")
        assert gpu.launches[-1]["fn"][1].dtype == "float16"
        offs = record()
        # Out of place: outputs written, inputs untouched.
        q, k, _ = decode_arrays()
        qo, ko = fake_cupy(q.shape, BF16), fake_cupy(k.shape, BF16)
        apply_rope_qk(q, k, cos, sin, offset=offs, q_out=qo, k_out=ko, layout="bshd")
        p = gpu.launches[-1]["fixed"]
        assert (p.in_[0], p.out[0], p.in_[1], p.out[1]) == (q.data.ptr, qo.data.ptr, k.data.ptr, ko.data.ptr)
        offs = record()
        # An int offset instead of the array: positions offset + s, checked against the table.
        q, k, _ = decode_arrays()
        apply_rope_qk(q, k, cos, sin, offset=7, q_out=q, k_out=k, layout="bshd")
        assert gpu.launches[-1]["fixed"].offset == 7 and gpu.launches[-1]["fixed"].offsets == 0
        for _ in range(2):
            apply_rope_qk(q, k, cos, sin, offset=9, q_out=q, k_out=k, layout="bshd")
        assert gpu.launches[-1]["fixed"].offset == 9
        n = len(gpu.launches)
        with pytest.raises(ValueError, match="offset"):
            apply_rope_qk(q, k, cos, sin, offset=ROWS, q_out=q, k_out=k, layout="bshd")
        with pytest.raises(ValueError, match="offset"):
            apply_rope_qk(q, k, cos, sin, offset=-1, q_out=q, k_out=k, layout="bshd")
        assert len(gpu.launches) == n
        offs = record()
        n = len(gpu.launches)
        # Overlap of an output with another argument of the same signature.
        base = fake_cupy((B, S, HQ + HK, D), BF16)
        qv, kv = base[:, :, :HQ], base[:, :, HQ - HK + 1:HQ + 1]
        with pytest.raises(ValueError, match="overlaps"):
            apply_rope_qk(qv, kv, cos, sin, offset=offs, q_out=qv, k_out=kv, layout="bshd")
        q, k, _ = decode_arrays()
        with pytest.raises(ValueError, match="overlaps"):
            apply_rope_qk(q, k, cos, sin, offset=k.reshape(-1)[:2 * B].view(np.int32), q_out=q, k_out=k, layout="bshd")
        assert len(gpu.launches) == n
        offs = record()
        # An address off the specialised build's vector: the generic build at a narrower vector.
        q_odd = fake_cupy((B, S, HQ, D), BF16, byte_offset=2)
        apply_rope_qk(q_odd, k, cos, sin, offset=offs, q_out=q_odd, k_out=k, layout="bshd")
        assert gpu.launches[-1]["fn"][0] != "rope_fixed" and gpu.launches[-1]["vec"] == 1
        offs = record()
        # A strided view of q's shape.
        wide = fake_cupy((B, S, HQ, 2 * D), BF16)
        qs = wide[..., :D]
        apply_rope_qk(qs, k, cos, sin, offset=offs, q_out=qs, k_out=k, layout="bshd")
        assert gpu.launches[-1]["fixed"].in_sh[0] == 2 * D
        # ... and its own generated path: another strided view of that layout binds through it,
        # while a C-contiguous q of the shape is not taken for it.
        apply_rope_qk(qs, k, cos, sin, offset=offs, q_out=qs, k_out=k, layout="bshd")
        qs2 = fake_cupy((B, S, HQ, 2 * D), BF16)[..., D:]
        apply_rope_qk(qs2, k, cos, sin, offset=offs, q_out=qs2, k_out=k, layout="bshd")
        p = gpu.launches[-1]["fixed"]
        assert (p.in_[0], p.out[0], p.in_sh[0]) == (qs2.data.ptr, qs2.data.ptr, 2 * D)
        qc = fake_cupy((B, S, HQ, D), BF16)
        apply_rope_qk(qc, k, cos, sin, offset=offs, q_out=qc, k_out=k, layout="bshd")
        p = gpu.launches[-1]["fixed"]
        assert (p.in_[0], p.in_sh[0]) == (qc.data.ptr, D)
        offs = record()
        # positions instead of offsets.
        pos = fake_cupy((B, S), np.int32)
        apply_rope_qk(q, k, cos, sin, positions=pos, q_out=q, k_out=k, layout="bshd")
        assert gpu.launches[-1]["fixed"].positions == pos.data.ptr
        offs = record()
        # q_out a separate array where the record has q rotated in place, and the reverse.
        q, k, _ = decode_arrays()
        qo = fake_cupy(q.shape, BF16)
        apply_rope_qk(q, k, cos, sin, offset=offs, q_out=qo, k_out=k, layout="bshd")
        p = gpu.launches[-1]["fixed"]
        assert (p.in_[0], p.out[0], p.out[1]) == (q.data.ptr, qo.data.ptr, k.data.ptr)


@pytest.mark.parametrize("option,value", [("interleaved", 1), ("inverse", 0), ("rotary_offset", False),
                                          ("rotary_dim", 128.0)])
def test_options_of_the_wrong_type_are_refused_after_the_last_repeat_path_too(table, option, value):
    cos, sin = table
    with FakeGPU(fixed=True) as gpu:
        q, k, offs = decode_arrays()
        good = dict(interleaved=False, inverse=False, rotary_offset=0, rotary_dim=128, layout="bshd")
        for _ in range(3):
            apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, **good)
        assert gpu.launches[-1]["fn"][0] == "rope_fixed"
        n = len(gpu.launches)
        with pytest.raises((TypeError, ValueError), match=option):
            apply_rope_qk(q, k, cos, sin, offset=offs, q_out=q, k_out=k, **{**good, option: value})
        assert len(gpu.launches) == n


def test_tail_rope_last_repeat_path_checks_the_signature_and_alignment(monkeypatch):
    from rope_rtc.ops import tail

    with FakeGPU() as gpu:
        c, s = fake_cupy((4, 32), np.float32), fake_cupy((4, 32), np.float32)
        x = fake_cupy((4, 64, 512), BF16)
        tail_rope(x, c, s)
        tail_rope(x, c, s)  # makes the thread's record
        counts: dict = {}
        _counted(monkeypatch, tail._TailTemplate, "write", counts)
        _counted(monkeypatch, tail._TailOp, "validate", counts)
        _tail_binds_new_arrays(tail, 5)
        assert counts == {}
        # Another token count: its own template and launch size.
        x8, c8, s8 = fake_cupy((8, 64, 512), BF16), fake_cupy((8, 32), np.float32), fake_cupy((8, 32), np.float32)
        tail_rope(x8, c8, s8)
        assert gpu.launches[-1]["fn"] is not None and next(iter(tail.ONE_CALL.thread().by_key.values()))._core.block.n == 8 * 64 * 64
        # Off the 16-byte alignment, of the record's signature: full validation names it.
        x, c, s = fake_cupy((4, 64, 512), BF16), fake_cupy((4, 32), np.float32), fake_cupy((4, 32), np.float32)
        tail_rope(x, c, s)
        tail_rope(x, c, s)
        n = len(gpu.launches)
        odd = fake_cupy((4, 64, 512), BF16, byte_offset=2)
        with pytest.raises(ValueError, match="x"):
            tail_rope(odd, c, s)
        assert len(gpu.launches) == n
        # A non-contiguous view of the record's shape.
        wide = fake_cupy((4, 64, 1024), BF16)
        with pytest.raises(ValueError, match="x"):
            tail_rope(wide[..., :512], c, s)
        assert len(gpu.launches) == n


def test_outputs_are_allocated_from_the_current_allocator(monkeypatch):
    """``launch.empty`` asks CuPy's current allocator (looked up on every call, so a
    ``using_allocator`` block is honoured) for exactly the output's bytes and wraps that memory as
    an array of the shape and dtype; an empty shape goes through ``cupy.empty``."""
    from rope_rtc.core import outputs as launch

    asked, made = [], []

    class Array:
        def __init__(self, shape, dtype, memptr=None):
            self.shape, self.dtype, self.memptr = shape, dtype, memptr

    def allocator(nbytes):
        asked.append(nbytes)
        return f"memory of {nbytes}"

    def cupy_empty(shape, dtype):
        made.append(shape)
        return Array(shape, dtype)

    current = [allocator]
    monkeypatch.setattr(launch, "_EMPTY", [(Array, lambda: current[0], cupy_empty, None)])
    a = launch.empty((8, 1, 32, 128), BF16)
    assert (a.shape, a.dtype, a.memptr) == ((8, 1, 32, 128), BF16, "memory of 65536")
    current[0] = lambda n: asked.append(-n) or "other"
    assert launch.empty((3, 5), np.dtype(np.float32)).memptr == "other"
    assert asked == [65536, -60] and not made
    z = launch.empty((0, 4), np.dtype(np.float32))
    assert made == [(0, 4)] and z.memptr is None and asked == [65536, -60]


class _Pool:
    """A stand-in memory pool: what ``launch.allocate`` asks of one is its ``malloc``'s owner."""

    def malloc(self, nbytes):
        return None


@pytest.fixture
def recycling(monkeypatch):
    """``launch.allocate`` over real CuPy arrays on fake memory (counted as they are made), with an
    allocator to switch and an empty recycling cache."""
    from rope_rtc.core import outputs as launch

    made = []
    default = _Pool()
    allocator = [default.malloc]  # CuPy's default: its pool's malloc

    def new_array(shape, dtype, device, stream, current):
        out = fake_cupy(shape, dtype, device=device)
        made.append(id(out))  # counted, not held
        return out

    monkeypatch.setattr(launch, "_new_array", new_array)
    monkeypatch.setattr(launch, "_EMPTY", [(None, lambda: allocator[0], None, default)])
    monkeypatch.setattr(launch, "_recycled", threading.local())
    return launch, made, allocator


def test_an_output_nothing_references_is_handed_out_again(recycling):
    """A small output the caller has let go of comes back from the next call of its signature
    without a new allocation. One whose memory anything still reaches never does, so a live
    result is never overwritten: the array held, a view of it, an alias built on its pointer
    (``as_strided``), the pointer itself, a pointer into its memory, a weak reference."""
    from cupy.lib.stride_tricks import as_strided

    launch, made, _ = recycling
    shape, dt = (8, 1, 32, 128), np.dtype(BF16)
    a = launch.allocate(shape, dt, 0, 7)
    first = id(a)
    del a
    b = launch.allocate(shape, dt, 0, 7)
    assert id(b) == first and len(made) == 1
    del b
    holds = [lambda x: x, lambda x: x[0], lambda x: x.reshape(-1), as_strided, lambda x: x.data,
             lambda x: x.data + 16, weakref.ref, lambda x: [x]]
    for hold in holds:
        launch.release_outputs()
        b = launch.allocate(shape, dt, 0, 7)
        kept = hold(b)
        del b
        n = len(made)
        c = launch.allocate(shape, dt, 0, 7)
        assert len(made) == n + 1, f"reused an output still reached through {hold}"
        del kept, c
        d = launch.allocate(shape, dt, 0, 7)  # let go: recycled
        assert len(made) == n + 1
        del d


def test_a_loop_that_rebinds_its_results_recycles_them(recycling):
    """``q, k = apply_rope_qk(...)`` in a loop holds the last call's two outputs while it makes
    the next call: with q and k of one shape (one key) the outputs still come back, four arrays in
    all."""
    launch, made, _ = recycling
    shape, dt = (4, 8, 128), np.dtype(np.float16)
    q = k = None
    for _ in range(10):
        new_q = launch.allocate(shape, dt, 0, 7)
        new_k = launch.allocate(shape, dt, 0, 7)
        assert new_q is not new_k and new_q is not q and new_q is not k and new_k is not q and new_k is not k
        q, k = new_q, new_k
        del new_q, new_k
    assert len(made) == 4


def test_recycling_keys_on_stream_device_dtype_and_shape(recycling):
    """An output is only reused in the order of the stream and on the device it was made with, at
    its shape and dtype; an output reshaped in place by the caller is not (and leaves the cache)."""
    launch, made, allocator = recycling
    shape, dt = (4, 64), np.dtype(np.float32)
    a = launch.allocate(shape, dt, 0, 7)
    a.shape = (64, 4)  # the caller reshaped it in place, then let it go
    del a
    for args in (((4, 64), dt, 0, 8), ((4, 64), dt, 1, 7), ((4, 64), np.dtype(np.float16), 0, 7), (shape, dt, 0, 7)):
        n = len(made)
        out = launch.allocate(*args)
        assert len(made) == n + 1 and out.shape == args[0]
        del out
    assert len(launch._recycled.by_key[(shape, dt, 0, 7)]) == 1  # the reshaped one left
    n = len(made)
    out = launch.allocate(shape, dt, 0, 7)
    assert len(made) == n
    del out


def test_only_the_default_pools_memory_is_recycled(recycling):
    """Under another allocator (``using_allocator``, ``set_allocator``) nothing is kept: each call
    allocates, and no caller's pool is kept alive (a kept output of a pool that is then freed would
    point at freed memory). Back on the default pool, its own kept outputs come back."""
    import gc

    launch, made, allocator = recycling
    default_malloc = allocator[0]
    shape, dt = (16,), np.dtype(np.float32)
    kept = launch.allocate(shape, dt, 0, 7)
    del kept

    class Pool:
        __hash__ = None  # an unhashable allocator is no error either

        def __eq__(self, other):
            return self is other

        def malloc(self, nbytes):
            return None

    pool = Pool()
    gone = weakref.ref(pool)
    allocator[0] = pool.malloc
    n = len(made)
    for _ in range(3):
        out = launch.allocate(shape, dt, 0, 7)
        del out
    assert len(made) == n + 3
    allocator[0] = lambda nbytes: None  # plain cudaMalloc, say
    out = launch.allocate(shape, dt, 0, 7)
    del out
    assert len(made) == n + 4
    del pool
    allocator[0] = default_malloc
    gc.collect()
    assert gone() is None
    out = launch.allocate(shape, dt, 0, 7)
    assert len(made) == n + 4 and out.shape == shape


def test_large_outputs_are_not_kept_and_release_drops_the_rest(recycling):
    """Outputs above ``RECYCLE_BYTES`` are never kept (their GPU time hides an allocation);
    ``release_outputs`` lets go of the small ones."""
    launch, made, _ = recycling
    big = (launch.RECYCLE_BYTES // 4 + 1,)
    a = launch.allocate(big, np.dtype(np.float32), 0, 7)
    del a
    launch.allocate(big, np.dtype(np.float32), 0, 7)
    assert len(made) == 2
    a = launch.allocate((16,), np.dtype(np.float32), 0, 7)
    del a
    import rope_rtc

    rope_rtc.release_outputs()
    launch.allocate((16,), np.dtype(np.float32), 0, 7)
    assert len(made) == 4


def test_recycling_is_off_where_reference_counts_cannot_say_free(monkeypatch):
    """The free counts are measured on this interpreter through the function that uses them, and
    checked against an array, pointer, memory and weak reference held; a free-threaded build
    (whose reference counts are not exact) recycles nothing."""
    import sysconfig

    from rope_rtc.core import outputs as launch

    free = launch._calibrate()
    assert free is not None and launch._FREE == free
    out = fake_cupy((4, 4), np.float32)
    slot = [out]
    del out
    assert launch._idle(slot, free) == 0
    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: 1 if name == "Py_GIL_DISABLED" else real(name))
    assert launch._calibrate() is None
    # An interpreter whose counts did not change when something holds the array: no recycling.
    monkeypatch.undo()
    monkeypatch.setattr(launch, "_getrefcount", lambda obj: 1)
    assert launch._calibrate() is None


def test_an_output_reshaped_in_place_leaves_the_cache_without_comparing_arrays(recycling):
    """An idle output the caller reshaped in place is dropped from the cache by identity: arrays
    are never compared with ``==`` (elementwise for CuPy, and a launch)."""
    launch, made, _ = recycling
    shape, dt = (4, 64), np.dtype(np.float32)
    held = launch.allocate(shape, dt, 0, 7)
    b = launch.allocate(shape, dt, 0, 7)
    b.shape = (64, 4)
    del b
    out = launch.allocate(shape, dt, 0, 7)
    assert len(made) == 3 and out is not held and out.shape == shape
    assert [a.shape for a in launch._recycled.by_key[(shape, dt, 0, 7)]] == [shape, shape]


def test_a_missing_cupy_on_a_gpu_machine_is_a_toolchain_error(monkeypatch):
    """The first GPU call on a machine with a driver but no CuPy names the extra to install
    (ToolchainError), not a bare ImportError from the one-call path's own imports."""
    import sys

    from rope_rtc.core import driver
    from rope_rtc.errors import ToolchainError

    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(driver, "available", lambda: True)
    monkeypatch.setattr(driver, "driver_version", lambda: 12040)
    monkeypatch.setattr(prepared, "_NDARRAY", None)
    monkeypatch.setattr(rope, "_gpu_present", False)
    with pytest.raises(ToolchainError, match="CuPy"):
        rope._resolve_backend("auto")


def test_the_last_output_key_does_not_recycle_once_recycling_is_off(recycling, monkeypatch):
    """The thread's last output key serves only while recycling is on: with the free counts
    unknown (``_FREE`` None), a call of that key allocates a new output."""
    launch, made, _ = recycling
    shape, dt = (4, 64), np.dtype(np.float32)
    a = launch.allocate(shape, dt, 0, 7)
    del a
    assert launch._recycled.last.shape == shape
    monkeypatch.setattr(launch, "_FREE", None)
    n = len(made)
    b = launch.allocate(shape, dt, 0, 7)
    assert len(made) == n + 1 and b.shape == shape


def _engine_call(cache, q, k, pos, **kw):
    return apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=D, q_out=q, k_out=k, **kw)


def test_the_engines_convention_takes_a_repeat_path_too(monkeypatch):
    """Flat [T, H * D] q/k and one cos_sin_cache, new arrays every call (vLLM's convention): the
    call split the cache and viewed every array again, then validated the views in full (about ten
    times a table call's host time); a seen signature now runs the generated checks on the flat
    arrays, with the cache's halves kept while the same cache comes back."""
    from rope_rtc.ops import conventions

    with FakeGPU(fixed=True) as gpu:
        cache = fake_cupy((ROWS, D), np.float32)
        sets = [(fake_cupy((B, HQ * D), BF16), fake_cupy((B, HK * D), BF16), fake_cupy((B,), np.int64))
                for _ in range(8)]
        for q, k, pos in sets[:3]:
            _engine_call(cache, q, k, pos)
        counts: dict = {}
        _counted(monkeypatch, conventions, "unflatten_heads", counts)
        _counted(monkeypatch, rope, "unflatten_heads", counts)
        _counted(monkeypatch, rope, "split_cos_sin_cache", counts)
        for module in (rope, rope_plan):
            _counted(monkeypatch, module, "validate", counts)
        _counted(monkeypatch, rope_request, "validate", counts)
        for i in range(40):
            q, k, pos = sets[i % len(sets)]
            assert _engine_call(cache, q, k, pos) == (q, k)
            f = gpu.launches[-1]["fixed"]
            assert (f.in_[0], f.in_[1], f.out[0], f.out[1], f.positions) == (q.data.ptr, k.data.ptr, q.data.ptr,
                                                                              k.data.ptr, pos.data.ptr)
            assert (f.cos, f.sin) == (cache.data.ptr, cache.data.ptr + D // 2 * 4)
        assert counts == {}
        launched = [bytes(rec["fixed"]) for rec in gpu.launches[-3:]]
    with FakeGPU(fixed=True) as gpu:  # the same calls, each the first of its thread's kind: the same blocks
        for i in range(37, 40):
            q, k, pos = sets[i % len(sets)]
            rope.ONE_CALL.forget()
            _engine_call(cache, q, k, pos)
            assert bytes(gpu.launches[-1]["fixed"]) == launched[i - 37]


@pytest.mark.parametrize("change", ["another cache", "the cache reshaped in place", "another head_dim", "interleaved",
                                    "rotary_dim", "outputs apart", "host positions", "misaligned q"])
def test_the_engines_convention_repeat_path_serves_only_its_own_calls(change):
    """Whatever the repeat path does not fix goes the full way: the block equals a cold call's."""
    with FakeGPU(fixed=True) as gpu:
        cache = fake_cupy((ROWS, D), np.float32)
        for _ in range(3):
            _engine_call(cache, fake_cupy((B, HQ * D), BF16), fake_cupy((B, HK * D), BF16), fake_cupy((B,), np.int64))
        q, k, pos = fake_cupy((B, HQ * D), BF16), fake_cupy((B, HK * D), BF16), fake_cupy((B,), np.int64)
        kw = dict(cos_sin_cache=cache, positions=pos, layout="thd", head_dim=D, q_out=q, k_out=k)
        if change == "another cache":
            kw["cos_sin_cache"] = fake_cupy((ROWS, D), np.float32)
        elif change == "the cache reshaped in place":
            cache.shape = (ROWS // 2, 2 * D)  # rows of 256: rotary_dim 128 needs 128
        elif change == "another head_dim":
            kw["head_dim"] = D // 2
            kw["cos_sin_cache"] = fake_cupy((ROWS, D // 2), np.float32)
        elif change == "interleaved":
            kw["interleaved"] = True
        elif change == "rotary_dim":
            kw["rotary_dim"] = D // 2
            kw["cos_sin_cache"] = fake_cupy((ROWS, D // 2), np.float32)
        elif change == "outputs apart":
            kw["q_out"], kw["k_out"] = fake_cupy((B, HQ * D), BF16), fake_cupy((B, HK * D), BF16)
        elif change == "host positions":
            kw["positions"] = np.arange(B)
        else:
            q = fake_cupy((B, HQ * D), BF16, byte_offset=2)
            kw["q_out"] = q
        n = len(gpu.launches)
        try:
            apply_rope_qk(q, k, **kw)
            hot = [bytes(rec["fixed"]) if "fixed" in rec else bytes(rec["params"]) for rec in gpu.launches[n:]]
            hot_error = None
        except (TypeError, ValueError) as exc:
            hot, hot_error = [], str(exc)
    with FakeGPU(fixed=True) as gpu:
        try:
            apply_rope_qk(q, k, **kw)
            cold = [bytes(rec["fixed"]) if "fixed" in rec else bytes(rec["params"]) for rec in gpu.launches]
            cold_error = None
        except (TypeError, ValueError) as exc:
            cold, cold_error = [], str(exc)
    assert (hot, hot_error) == (cold, cold_error)
    if change == "the cache reshaped in place":
        assert cold_error is not None and "cos_sin_cache: rows of 256" in cold_error


def test_the_engines_convention_repeat_path_of_apply_rope(monkeypatch):
    from rope_rtc.ops import conventions

    with FakeGPU(fixed=True) as gpu:
        cache = fake_cupy((ROWS, D), np.float32)
        sets = [(fake_cupy((B, HQ * D), BF16), fake_cupy((B,), np.int64)) for _ in range(4)]
        for x, pos in sets[:3]:
            apply_rope(x, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=D, out=x)
        counts: dict = {}
        _counted(monkeypatch, conventions, "unflatten_heads", counts)
        _counted(monkeypatch, rope, "unflatten_heads", counts)
        for module in (rope, rope_plan, rope_request):
            _counted(monkeypatch, module, "validate", counts)
        for i in range(8):
            x, pos = sets[i % len(sets)]
            assert apply_rope(x, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=D, out=x) is x
            f = gpu.launches[-1]["fixed"]
            assert (f.in_[0], f.out[0], f.in_[1], f.positions) == (x.data.ptr, x.data.ptr, 0, pos.data.ptr)
            assert (f.cos, f.sin) == (cache.data.ptr, cache.data.ptr + D // 2 * 4)
        assert counts == {}
        # apply_rope_qk's calls do not take apply_rope's path (nor the reverse)
        q, k = fake_cupy((B, HQ * D), BF16), fake_cupy((B, HK * D), BF16)
        _engine_call(cache, q, k, sets[0][1])
        assert counts.get("validate", 0) >= 1


# ---------------------------------------------------------------------------------------------
# warm against cold: each repeat path launches what the same call in a fresh thread launches

def _rope_record(rec) -> tuple:
    """What a launch gives the kernel: entry, grid, block, stream and the argument block's bytes
    that its build reads."""
    if "fixed" not in rec:
        return (rec["fn"], rec["grid"], rec["block"], rec["stream"], bytes(rec["params"]))
    block = rope_params.FixedParams.from_buffer_copy(rec["fixed"])
    if not rec["geometry"].mrope:
        # Read by multimodal builds only, and never written for others: a plan's block keeps there
        # what its last generic launch (a RopeParams over the same memory) left.
        block.mrope_stride = 0
    if rec["geometry"].k_heads == 0:  # apply_rope: a build without k reads none of k's fields
        for name in ("in_", "out", "in_sb", "in_ss", "in_sh", "out_sb", "out_ss", "out_sh", "dense_in", "dense_out"):
            getattr(block, name)[1] = 0
    return (rec["fn"], rec["grid"], rec["block"], rec["stream"], bytes(block))


def _rope_episode(rng, n: int) -> list:
    """``n`` calls of one kind (an op, a dtype, a layout, a position source, a table or angle
    source, outputs in place, given or allocated): new arrays each call, now and then one off the
    16-byte alignment (a narrower build, or the error), of another token count, or a call that
    must be refused."""
    from helpers import layout_shape

    bsz, hq, hk, d, rows = 2, 8, 2, 128, 64
    qk = bool(rng.random() < 0.6)
    dtype = [BF16, np.dtype(np.float16), np.dtype(np.float32)][int(rng.choice(3, p=[0.6, 0.2, 0.2]))]
    source = str(rng.choice(["tables", "tables", "inv_freq", "engine"]))
    layout = "thd" if source == "engine" else str(rng.choice(["bshd", "bshd", "thd", "sbhd", "bhsd"]))
    pos_kind = str(rng.choice(["positions", "offset", "offsets", "cu_seqlens"] if layout == "thd"
                              else ["positions", "offset", "offsets"]))
    if source == "engine":
        pos_kind = "positions"
    if layout == "thd" and pos_kind == "offsets":
        pos_kind = "offset"
    outs = str(rng.choice(["in place", "given", "allocated"]))
    opts = {} if source == "engine" else dict(interleaved=bool(rng.random() < 0.3))
    if source == "tables" and rng.random() < 0.3:
        opts["rotary_dim"] = d // 2
    if source != "engine":
        opts["layout"] = layout
    rot = opts.get("rotary_dim", d)
    cos, sin = fake_cupy((rows, rot // 2), np.float32), fake_cupy((rows, rot // 2), np.float32)
    cache = fake_cupy((rows, rot), np.float32)
    inv = fake_cupy((rot // 2,), np.float64 if rng.random() < 0.5 else np.float32)
    scaling = float(rng.choice([1.0, 0.5])) if rng.random() < 0.5 else None
    idx = np.int64 if rng.random() < 0.5 else np.int32
    stream = None if rng.random() < 0.7 else 77
    calls = []
    for _ in range(n):
        s = int(rng.choice([3, 3, 3, 5]))
        off = 2 if rng.random() < 0.12 else 0  # 2 bytes: off every vector wider than one element
        shapes = [layout_shape(layout, bsz, s, h, d) for h in ((hq, hk) if qk else (hq,))]
        if source == "engine":
            shapes = [(bsz * s, h * d) for h in ((hq, hk) if qk else (hq,))]
        ins = [fake_cupy(sh, dtype, byte_offset=off if i == 0 else 0) for i, sh in enumerate(shapes)]
        kw = dict(opts, stream=stream)
        if source == "tables":
            kw.update(cos=cos, sin=sin)
        elif source == "inv_freq":
            kw.update(inv_freq=inv, attention_scaling=scaling)
        else:
            kw.update(cos_sin_cache=cache, head_dim=d)
        t = bsz * s
        if pos_kind == "positions":
            kw["positions"] = fake_cupy((t,) if layout == "thd" else (bsz, s), idx)
        elif pos_kind == "offset":
            kw["offset"] = int(rng.integers(0, 8))
        elif pos_kind == "offsets":
            kw["offset"] = fake_cupy((bsz,), idx)
        else:
            kw.update(cu_seqlens=fake_cupy((bsz + 1,), idx), offset=int(rng.integers(0, 4)))
        refused = rng.random() < 0.06
        if refused and "offset" in kw and type(kw["offset"]) is int and source != "inv_freq":
            kw["offset"] = rows  # past the table
        elif refused:
            kw["rotary_offset"] = 1.0  # an option of the wrong type
        out_names = ("q_out", "k_out") if qk else ("out",)
        if outs == "in place" or source == "engine" and outs == "allocated" and rng.random() < 0.5:
            kw.update(zip(out_names, ins))
        elif outs == "given":
            kw.update(zip(out_names, (fake_cupy(a.shape, dtype) for a in ins)))
        calls.append((apply_rope_qk if qk else apply_rope, ins, kw))
    return calls


@pytest.mark.parametrize("fixed", [False, True])
def test_the_one_call_repeat_paths_launch_what_a_cold_call_launches(fixed):
    """Episodes of apply_rope and apply_rope_qk calls (tables, inv_freq, the engines' flat arrays
    and cos_sin_cache; positions, an int offset, per-sequence offsets, cu_seqlens; outputs in
    place, given or allocated; now and then misaligned, another token count, or refused): each
    warm call (the thread's last repeat path, its convention path, its signature dictionary)
    launches the same entry, grid, stream and block bytes as the same call in a fresh thread, or
    raises the same."""
    from fakes import warm_and_cold

    rng = np.random.default_rng(21 + fixed)
    calls = [c for _ in range(45) for c in _rope_episode(rng, 6)]
    with FakeGPU(fixed=fixed) as gpu:
        warm, cold = warm_and_cold(gpu, [lambda f=f, ins=ins, kw=kw: f(*ins, **kw) for f, ins, kw in calls],
                                   _rope_record)
    assert len(warm) == len(calls) and [i for i, (w, c) in enumerate(zip(warm, cold)) if w != c] == []
    launched = [w for w in warm if w and w[0] != "error"]
    assert len(launched) > 200 and len(warm) - len(launched) > 5
    if fixed:
        assert {w[0][0][0] for w in launched} == {"rope_fixed", "rope_apply"}


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("offset, cu", [(-1, False), (61, False), (64, True), (-2, True)])
def test_a_bad_offset_is_worded_alike_on_a_new_plan_and_a_warm_one(fixed, offset, cu):
    """A warm plan checks a new int offset itself (check_scalar); its message is validation's."""
    with FakeGPU(fixed=fixed):
        cos, sin = fake_cupy((64, 16), np.float32), fake_cupy((64, 16), np.float32)
        if cu:
            x = fake_cupy((8, 4, 32), np.float32)
            kw = dict(layout="thd", cu_seqlens=fake_cupy((3,), np.int32))
        else:
            x = fake_cupy((2, 4, 4, 32), np.float32)
            kw = dict(layout="bshd")
        with pytest.raises(ValueError) as fresh:
            rope_plan.RopePlan(x, None, cos, sin, offset=offset, **kw)
        warm = rope_plan.RopePlan(x, None, cos, sin, offset=0, **kw)
        per_call = {k: v for k, v in kw.items() if k == "cu_seqlens"}
        warm.execute(x, None, cos, sin, offset=0, **per_call)
        with pytest.raises(ValueError) as again:
            warm.execute(x, None, cos, sin, offset=offset, **per_call)
        assert str(again.value) == str(fresh.value)
        assert str(fresh.value).startswith("offset: ")
