"""The specialised build of the general kernel (cuda_src/rope_fixed.cu) on the GPU: chosen where
it fits, bit-identical to the generic kernel everywhere it runs (both round each product to FP32
before one FMA), NaN-poisoned outputs, and the generic kernel where it does not fit."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from gpu_util import DTYPES, bits, host_random, host_tables, poisoned
from helpers import layout_shape

pytestmark = pytest.mark.gpu


@pytest.fixture
def launched(monkeypatch):
    """The launch prefixes of the calls that follow, in order: a spy on the launcher's entries
    (a plan's call through the quick path keeps no Call to read them from)."""
    from rope_rtc.core import launcher as launch

    got: list = []
    plain, one_call = launch.Launcher.__call__, launch.Launcher.launch

    def spy_plain(self, prefix, stream=None, token=None):
        got.append(prefix)
        return plain(self, prefix, stream, token)

    def spy_one_call(self, prefix, handle):
        got.append(prefix)
        return one_call(self, prefix, handle)

    monkeypatch.setattr(launch.Launcher, "__call__", spy_plain)
    monkeypatch.setattr(launch.Launcher, "launch", spy_one_call)
    return got


def _served(plan, launched: list) -> tuple:
    """``(template, launch prefix)`` of the plan's last call: its Call's when it was bound or
    remembered; the quick path's template and the prefix launched when it took the quick path."""
    core = plan._core
    if core.last is not None:
        return core.last.template, core.last.prefix
    return core.quick[2], launched[-1]


def _off_the_vector_boundary(cp, *tables):
    """Copies of float32 tables starting 4 bytes into their allocations (off every vector boundary)."""
    out = []
    for t in tables:
        buf = cp.empty(t.size + 1, cp.float32)
        view = buf[1:].reshape(t.shape)
        view[...] = t
        out.append(view)
    return out


def _run(cp, monkeypatch, use_fixed, dtype, layout, interleaved, scheme, in_place, rotary_dim=None, with_k=True,
         Hq=32, Hk=8, D=128, dense=True):
    """One RopePlan call; returns (q_out, k_out) on the host and the plan. ``dense``: whether dense
    arrays may take the dense build (rope_launch.USE_DENSE)."""
    import rope_rtc
    from rope_rtc.ops import rope_launch

    monkeypatch.setattr(rope_launch, "USE_FIXED", use_fixed)
    monkeypatch.setattr(rope_launch, "USE_DENSE", dense)
    B, S, P = 2, 37, 128
    dt = DTYPES[dtype]
    q = cp.asarray(host_random(layout_shape(layout, B, S, Hq, D), dt, 11))
    k = cp.asarray(host_random(layout_shape(layout, B, S, Hk, D), dt, 12)) if with_k else None
    cos, sin = (cp.asarray(a) for a in host_tables(P, (rotary_dim or D) // 2, 13))
    rng = np.random.default_rng(14)
    if scheme == "offset":
        kw = {"offset": 5}
    elif scheme == "offsets":
        kw = {"offset": cp.asarray(rng.integers(0, P - S, B).astype(np.int32))}
    elif scheme == "positions":
        shape = (B * S,) if layout == "thd" else (B, S)
        kw = {"positions": cp.asarray(rng.integers(0, P, shape).astype(np.int64))}
    else:  # cu_seqlens (thd)
        kw = {"cu_seqlens": cp.asarray(np.array([0, 30, B * S], np.int32)),
              "offset": cp.asarray(np.array([3, 60], np.int64))}
    if in_place:
        qo, ko = q, k
    else:
        qo = poisoned(cp, q.shape, dt)
        ko = poisoned(cp, k.shape, dt) if with_k else None
    plan = rope_rtc.RopePlan(q, k, cos, sin, layout=layout, interleaved=interleaved, rotary_dim=rotary_dim,
                             q_out=None if in_place else qo, k_out=None if in_place else ko, **kw).compile()
    plan.execute(q, k, cos, sin, q_out=qo, k_out=ko, **kw)
    return cp.asnumpy(qo), (cp.asnumpy(ko) if with_k else None), plan


CASES = [c for c in itertools.product(["float32", "float16", "bfloat16"], ["bshd", "bhsd", "sbhd", "thd"],
                                      [False, True], ["offset", "offsets", "positions", "cu_seqlens"], [False, True])
         if (c[3] == "cu_seqlens") == (c[1] == "thd") or c[3] == "positions"]


@pytest.mark.parametrize("dtype,layout,interleaved,scheme,in_place", CASES)
def test_fixed_build_equals_generic_bits(cp, monkeypatch, launched, dtype, layout, interleaved, scheme, in_place):
    fq, fk, plan = _run(cp, monkeypatch, True, dtype, layout, interleaved, scheme, in_place)
    tmpl, prefix = _served(plan, launched)
    assert tmpl.fixed is not None, "the specialised build should serve this call"
    assert prefix[0] is plan._fixed[tmpl.fixed]
    gq, gk, gplan = _run(cp, monkeypatch, False, dtype, layout, interleaved, scheme, in_place)
    assert _served(gplan, launched)[0].fixed is None
    assert not np.isnan(fq.astype(np.float32)).any() and not np.isnan(fk.astype(np.float32)).any()
    np.testing.assert_array_equal(bits(fq), bits(gq))
    np.testing.assert_array_equal(bits(fk), bits(gk))


@pytest.mark.parametrize("dtype,layout,interleaved,scheme,in_place", CASES)
def test_dense_build_equals_strided_bits(cp, monkeypatch, launched, dtype, layout, interleaved, scheme, in_place):
    """Contiguous arrays take the dense build (sbhd's batches are not one after another: the
    strided one); it gives the strided build's bits."""
    dq, dk, plan = _run(cp, monkeypatch, True, dtype, layout, interleaved, scheme, in_place)
    tmpl, prefix = _served(plan, launched)
    g = tmpl.fixed
    assert g is not None and g.dense is (layout != "sbhd")
    assert prefix[0] is plan._fixed[g]
    sq, sk, splan = _run(cp, monkeypatch, True, dtype, layout, interleaved, scheme, in_place, dense=False)
    assert not _served(splan, launched)[0].fixed.dense
    assert not np.isnan(dq.astype(np.float32)).any() and not np.isnan(dk.astype(np.float32)).any()
    np.testing.assert_array_equal(bits(dq), bits(sq))
    np.testing.assert_array_equal(bits(dk), bits(sk))


@pytest.mark.parametrize("layout", ["thd", "bshd", "bhsd"])
def test_dense_build_on_fused_qkv_views_and_padded_rows(cp, monkeypatch, launched, layout):
    """Token-major q and k as views of one fused q|k|v buffer (dense, with the buffer's token
    stride), and bhsd q and k whose rows are padded to a longer sequence (dense, with the padded
    head stride), in place and into fresh outputs, equal the generic kernel bit for bit."""
    import rope_rtc
    from rope_rtc.ops import rope_launch

    B, S, Hq, Hk, D, P = 2, 19, 8, 2, 128, 64
    dt = DTYPES["bfloat16"]
    cos, sin = (cp.asarray(a) for a in host_tables(P, D // 2, 22))
    pos = cp.asarray(np.random.default_rng(23).integers(0, P, (B * S,) if layout == "thd" else (B, S)).astype(np.int32))
    if layout == "bhsd":
        host = [host_random((B, Hq, S + 3, D), dt, 21), host_random((B, Hk, S + 3, D), dt, 24)]
        views = lambda bufs: (bufs[0][:, :, :S], bufs[1][:, :, :S])
    else:
        shape = (B * S, Hq + 2 * Hk, D) if layout == "thd" else (B, S, Hq + 2 * Hk, D)
        host = [host_random(shape, dt, 21)]
        views = lambda bufs: (bufs[0][..., :Hq, :], bufs[0][..., Hq:Hq + Hk, :])
    results = []
    for use_fixed in (True, False):
        monkeypatch.setattr(rope_launch, "USE_FIXED", use_fixed)
        for in_place in (True, False):
            bufs = [cp.asarray(h) for h in host]
            q, k = views(bufs)
            qo = q if in_place else poisoned(cp, q.shape, dt)
            ko = k if in_place else poisoned(cp, k.shape, dt)
            plan = rope_rtc.RopePlan(q, k, cos, sin, layout=layout, positions=pos,
                                     q_out=None if in_place else qo, k_out=None if in_place else ko).compile()
            plan.execute(q, k, cos, sin, positions=pos, q_out=qo, k_out=ko)
            g = _served(plan, launched)[0].fixed
            assert (g is not None and g.dense) if use_fixed else g is None
            results.append([cp.asnumpy(qo), cp.asnumpy(ko)] + [cp.asnumpy(b) for b in bufs])
    for a, b in zip(results[:2], results[2:]):
        for x, y in zip(a, b):
            assert not np.isnan(x.astype(np.float32)).any()
            np.testing.assert_array_equal(bits(x), bits(y))


@pytest.mark.parametrize("with_k,Hq,Hk", [(True, 6, 3), (False, 5, 0), (True, 32, 32)])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_fixed_build_head_counts_and_partial_window(cp, monkeypatch, launched, with_k, Hq, Hk, layout):
    """Odd head counts (one head per thread in bhsd), q alone, a partial window in place."""
    for rotary_dim in (None, 64):
        fq, fk, plan = _run(cp, monkeypatch, True, "bfloat16", layout, False, "positions", True,
                            rotary_dim=rotary_dim, with_k=with_k, Hq=Hq, Hk=Hk or 8)
        assert _served(plan, launched)[0].fixed is not None
        gq, gk, _ = _run(cp, monkeypatch, False, "bfloat16", layout, False, "positions", True,
                         rotary_dim=rotary_dim, with_k=with_k, Hq=Hq, Hk=Hk or 8)
        np.testing.assert_array_equal(bits(fq), bits(gq))
        if with_k:
            np.testing.assert_array_equal(bits(fk), bits(gk))


def test_partial_window_out_of_place_runs_generic(cp, monkeypatch, launched):
    fq, fk, plan = _run(cp, monkeypatch, True, "bfloat16", "bshd", False, "offset", False, rotary_dim=64)
    assert _served(plan, launched)[0].fixed is None  # the channels outside the window are copied
    assert not np.isnan(fq.astype(np.float32)).any()


def test_new_int_offset_on_remembered_arrays(cp, monkeypatch, launched):
    """A new scalar offset on the same arrays rewrites the specialised block's own offset field."""
    import rope_rtc
    from rope_rtc.reference import rope_reference

    q0 = host_random((1, 9, 4, 64), np.float32, 3)
    cos, sin = (cp.asarray(a) for a in host_tables(64, 32, 4))
    q = cp.asarray(q0)
    out = poisoned(cp, q.shape, np.float32)
    plan = rope_rtc.RopePlan(q, None, cos, sin, q_out=out, layout="bshd").compile()
    for offset in (0, 7, 20, 7):
        out.fill(np.nan)
        plan.execute(q, None, cos, sin, q_out=out, offset=offset)
        assert _served(plan, launched)[0].fixed is not None
        pos = np.arange(9) + offset
        ref = rope_reference(q0.reshape(-1, 4, 64), cp.asnumpy(cos), cp.asnumpy(sin), pos, interleaved=False)
        np.testing.assert_allclose(cp.asnumpy(out).reshape(-1, 4, 64), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,layout", [("bfloat16", "thd"), ("float16", "bshd"), ("float32", "thd")])
@pytest.mark.parametrize("dense,aligned", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_positions_outside_the_table_give_nan_as_the_generic_kernel(cp, monkeypatch, launched, dtype, layout, dense,
                                                                    aligned, index_dtype):
    """Device positions past the table's last row or negative (never read back to the host): the
    specialised builds, dense and strided, whose table loads are predicated on the row, write NaN
    in those tokens' rotated channels and the exact rotation in the others, the generic kernel's
    bits; the index width read from the block (int32 or int64 positions) included, and tables 4
    bytes off a 16-byte boundary, which the strided build reads a float at a time. The outputs
    start finite (1e4, which no rotation of these inputs gives): a NaN is the kernel's own."""
    import rope_rtc
    from rope_rtc.ops import rope_launch

    B, S, Hq, Hk, D, P = 2, 5, 8, 2, 128, 40
    dt = DTYPES[dtype]
    q0 = host_random(layout_shape(layout, B, S, Hq, D), dt, 41)
    k0 = host_random(layout_shape(layout, B, S, Hk, D), dt, 42)
    cos, sin = (cp.asarray(a) for a in host_tables(P, D // 2, 43))
    if not aligned:
        cos, sin = _off_the_vector_boundary(cp, cos, sin)
    pos_h = np.array([3, P, 0, -1, P - 1, 2 ** 20, 7, -P, 11, P + 1], index_dtype)
    if index_dtype == np.int64:
        pos_h[5] = 2 ** 33 + 3  # its low 32 bits are a row inside the table
    bad = (pos_h < 0) | (pos_h >= P)
    pos = cp.asarray(pos_h if layout == "thd" else pos_h.reshape(B, S))
    outs = []
    for use_fixed in (True, False):
        monkeypatch.setattr(rope_launch, "USE_FIXED", use_fixed)
        monkeypatch.setattr(rope_launch, "USE_DENSE", dense)
        q, k = cp.asarray(q0), cp.asarray(k0)
        qo, ko = cp.full(q.shape, 1e4, dtype=dt), cp.full(k.shape, 1e4, dtype=dt)
        plan = rope_rtc.RopePlan(q, k, cos, sin, layout=layout, positions=pos, q_out=qo, k_out=ko).compile()
        plan.execute(q, k, cos, sin, positions=pos, q_out=qo, k_out=ko)
        tmpl, prefix = _served(plan, launched)
        if use_fixed:  # the kernel launched: a dense plan runs its strided build on the misaligned tables
            assert tmpl.fixed is not None
            assert prefix[0] is plan._fixed[dataclasses.replace(tmpl.fixed, dense=dense and aligned)]
        else:
            assert tmpl.fixed is None
        outs.append([cp.asnumpy(qo), cp.asnumpy(ko)])
    for (f, g), h in zip(zip(*outs), (Hq, Hk)):
        np.testing.assert_array_equal(bits(f), bits(g))
        rows = f.reshape(B * S, h, D).astype(np.float32)
        assert np.isnan(rows[bad]).all()
        assert not np.isnan(rows[~bad]).any() and (np.abs(rows[~bad]) < 1e3).all(), "a token left unwritten"


def test_misaligned_call_falls_back_to_generic(cp, launched):
    """A view 2 bytes off the build's 8-byte vectors runs the generic kernel, on narrower ones."""
    import rope_rtc

    base = cp.asarray(host_random(4 * 128 * 8 + 1, DTYPES["bfloat16"], 5))
    x = base[1:].reshape(1, 4, 8, 128)
    cos, sin = (cp.asarray(a) for a in host_tables(16, 64, 6))
    aligned = x.copy()  # a fresh, aligned buffer with the same values
    plan = rope_rtc.RopePlan(x, None, cos, sin, layout="bshd").compile()
    plan.execute(x, None, cos, sin)
    tmpl, prefix = _served(plan, launched)
    assert prefix[0] is not plan._fixed.get(tmpl.fixed)
    plan.execute(aligned, None, cos, sin)
    tmpl, prefix = _served(plan, launched)
    assert prefix[0] is plan._fixed[tmpl.fixed]
    np.testing.assert_array_equal(bits(cp.asnumpy(x)), bits(cp.asnumpy(aligned)))


def test_tables_off_the_vector_boundary_take_the_strided_build_on_a_dense_plan(cp, launched):
    """A dense plan's call whose tables start 4 bytes off a 16-byte boundary runs the strided
    build (which reads them a float at a time) and gives the same bits as aligned tables."""
    import rope_rtc

    q0 = host_random((6, 8, 128), DTYPES["bfloat16"], 31)
    ch, sh = host_tables(40, 64, 32)
    pos = cp.asarray(np.random.default_rng(33).integers(0, 40, 6).astype(np.int32))
    cos, sin = cp.asarray(ch), cp.asarray(sh)
    c4, s4 = _off_the_vector_boundary(cp, cos, sin)
    outs = []
    q = cp.asarray(q0)
    plan = rope_rtc.RopePlan(q, None, cos, sin, layout="thd", positions=pos).compile()
    for tables, dense in (((cos, sin), True), ((c4, s4), False)):
        q = cp.asarray(q0)
        plan.execute(q, None, *tables, positions=pos)
        tmpl, prefix = _served(plan, launched)
        assert prefix[0] is plan._fixed[dataclasses.replace(tmpl.fixed, dense=dense)]
        outs.append(cp.asnumpy(q))
    np.testing.assert_array_equal(bits(outs[0]), bits(outs[1]))


def test_new_int_offsets_on_the_strided_fallback(cp):
    """A dense plan's calls with tables off the vector boundary (the strided build) and a new int
    offset on the same arrays: each offset gives the aligned tables' bits (the offset lands in the
    specialised block, k's strides stay as validated)."""
    import rope_rtc

    q0 = host_random((1, 9, 4, 128), DTYPES["bfloat16"], 41)
    k0 = host_random((1, 9, 2, 128), DTYPES["bfloat16"], 42)
    ch, sh = host_tables(40, 64, 43)
    cos, sin = cp.asarray(ch), cp.asarray(sh)
    c4, s4 = _off_the_vector_boundary(cp, cos, sin)
    q, k = cp.asarray(q0), cp.asarray(k0)
    plan = rope_rtc.RopePlan(q, k, c4, s4, layout="bshd").compile()
    for offset in (0, 3, 7, 3):
        q[...], k[...] = cp.asarray(q0), cp.asarray(k0)
        plan.execute(q, k, c4, s4, offset=offset)
        got = (cp.asnumpy(q), cp.asnumpy(k))
        qa, ka = cp.asarray(q0), cp.asarray(k0)
        rope_rtc.apply_rope_qk(qa, ka, cos, sin, offset=offset, q_out=qa, k_out=ka, layout="bshd")
        for a, b in zip(got, (cp.asnumpy(qa), cp.asnumpy(ka))):
            np.testing.assert_array_equal(bits(a), bits(b))
