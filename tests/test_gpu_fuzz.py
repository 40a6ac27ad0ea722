"""Property-based tests on the GPU: random shapes, strides, dtypes, windows,
position schemes, alignments and overlaps through apply_rope / apply_rope_qk / RopePlan /
TailRoPEForward. Every case either matches the reference or raises a clear
TypeError/ValueError/NotImplementedError before any launch, leaving its arrays bit for bit
unchanged. Case counts are printed by the last test (``-s``) and asserted non-trivial."""

from __future__ import annotations

import collections

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import TO_BSHD, bits, layout_shape, token_rows
from rope_rtc.reference import assert_rope_close, rope_reference, tail_rope_reference

pytestmark = pytest.mark.gpu

CLEAR = (TypeError, ValueError, NotImplementedError)
COUNTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FLOATS = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _device_view(cp, host, pad, shift):
    """``host``'s values in a device view padded along every axis by ``pad`` and starting
    ``shift`` elements into its buffer (strided and possibly misaligned, like real views)."""
    big = tuple(n + pad for n in host.shape)
    buf = cp.zeros(int(np.prod(big)) + shift + 8, dtype=host.dtype)
    view = buf[shift:shift + int(np.prod(big))].reshape(big)[tuple(slice(0, n) for n in host.shape)]
    view[...] = cp.asarray(host)
    return view


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_fuzz_general_gpu(cp, data):
    import rope_rtc

    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    api = data.draw(st.sampled_from(["apply_rope", "apply_rope_qk", "plan"]), label="api")
    dtype = data.draw(st.sampled_from(sorted(FLOATS)), label="dtype")
    layout = data.draw(st.sampled_from(sorted(TO_BSHD)), label="layout")
    b, s = data.draw(st.integers(0, 3), label="B"), data.draw(st.integers(0, 9), label="S")
    hq, hk = data.draw(st.integers(1, 5), label="Hq"), data.draw(st.integers(1, 3), label="Hk")
    d = data.draw(st.sampled_from([2, 6, 8, 16, 24, 64, 128]), label="D")
    interleaved = data.draw(st.booleans(), label="interleaved")
    rdim = data.draw(st.sampled_from([None, 2, 4, 8, 16, 32]), label="rotary_dim")
    roff = data.draw(st.sampled_from([0, 2, 4, 8]), label="rotary_offset")
    scheme = data.draw(st.sampled_from(["offset", "offsets", "positions"]), label="positions")
    pad = data.draw(st.sampled_from([0, 0, 1, 3]), label="pad")
    shift = data.draw(st.sampled_from([0, 0, 0, 1, 2, 4, 8]), label="shift")
    in_place = data.draw(st.booleans(), label="in place")
    overlap = data.draw(st.sampled_from([False, False, False, True]), label="overlapping output")

    dt = FLOATS[dtype]
    r = d if rdim is None else rdim
    rows = 16
    xq = rng.standard_normal(layout_shape(layout, b, s, hq, d)).astype(np.float32).astype(dt)
    xk = rng.standard_normal(layout_shape(layout, b, s, hk, d)).astype(np.float32).astype(dt)
    ang = rng.uniform(-8, 8, (rows, max(r // 2, 1)))
    cos_h, sin_h = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    q, k = _device_view(cp, xq, pad, shift), _device_view(cp, xk, pad, 0)
    cos, sin = cp.asarray(cos_h), cp.asarray(sin_h)
    n_tok = b * s
    kw = dict(layout=layout, interleaved=interleaved, rotary_dim=rdim, rotary_offset=roff)
    if scheme == "offset":
        off = int(rng.integers(0, 4))
        kw["offset"] = off
        pos = np.tile(np.arange(s) + off, b) if layout != "thd" else np.arange(n_tok) + off
    elif scheme == "offsets" and layout != "thd":
        offs = rng.integers(0, rows - s + 1 if s <= rows else 1, b).astype(np.int32)
        kw["offset"] = cp.asarray(offs)
        pos = (offs[:, None] + np.arange(s)[None, :]).reshape(-1)
    else:
        p = rng.integers(0, rows, n_tok).astype(np.int64)
        kw["positions"] = cp.asarray(p.reshape((n_tok,) if layout == "thd" else (b, s)))
        pos = p
    if in_place:
        q_out, k_out = q, k
    elif overlap and q.size > 1:
        q_out, k_out = k, cp.full(k.shape, cp.nan, dtype=dt)  # q_out is k: rejected (shape or overlap)
    else:
        q_out, k_out = cp.full(q.shape, cp.nan, dtype=dt), cp.full(k.shape, cp.nan, dtype=dt)
    saved = [(a, bits(cp.asnumpy(a))) for a in (q, k, cos, sin) + ((q_out, k_out) if not in_place else ())]
    try:
        if api == "apply_rope":
            res_q, res_k = rope_rtc.apply_rope(q, cos, sin, out=q_out, **kw), None
        elif api == "apply_rope_qk":
            res_q, res_k = rope_rtc.apply_rope_qk(q, k, cos, sin, q_out=q_out, k_out=k_out, **kw)
        else:
            plan_kw = {n: v for n, v in kw.items() if n not in ("offset", "positions")}
            plan = rope_rtc.RopePlan(q, k, cos, sin, q_out=None if in_place else q_out,
                                     k_out=None if in_place else k_out, positions=kw.get("positions"),
                                     offset=kw.get("offset", 0), **plan_kw).compile()
            res_q, res_k = plan.execute(q, k, cos, sin, positions=kw.get("positions"),
                                        q_out=None if in_place else q_out, k_out=None if in_place else k_out,
                                        offset=kw.get("offset"))
        cp.cuda.get_current_stream().synchronize()
    except CLEAR as exc:
        assert str(exc), "an error without a message"
        cp.cuda.get_current_stream().synchronize()
        for a, before in saved:  # nothing written
            assert np.array_equal(bits(cp.asnumpy(a)), before)
        COUNTS["general"]["rejected"] += 1
        return
    for res, x in ((res_q, xq), (res_k, xk)):
        if res is None:
            continue
        xc = token_rows(x, layout)
        ref = rope_reference(xc, cos_h, sin_h, pos, interleaved=interleaved, rotary_dim=rdim, rotary_offset=roff)
        assert_rope_close(token_rows(cp.asnumpy(res), layout), ref, xc, interleaved=interleaved, rotary_dim=rdim,
                          rotary_offset=roff, dtype=np.dtype(dt))
    COUNTS["general"]["ok"] += 1


@settings(FUZZ, max_examples=200)
@given(data=st.data())
def test_fuzz_tail_gpu(cp, data):
    import rope_rtc

    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    t = data.draw(st.sampled_from([0, 1, 2, 5, 33, 257]), label="T")
    h = data.draw(st.sampled_from([1, 2, 3, 8]), label="H")
    d = data.draw(st.sampled_from([64, 128, 256, 512]), label="D")
    shift = data.draw(st.sampled_from([0, 0, 0, 1, 8]), label="shift")
    table_shift = data.draw(st.sampled_from([0, 0, 0, 1]), label="table shift")
    out_kind = data.draw(st.sampled_from(["fresh", "fresh", "fresh", "x", "overlap"]), label="out")
    x_h = rng.standard_normal((t, h, d)).astype(np.float32).astype(ml_dtypes.bfloat16)
    ang = rng.uniform(-8, 8, (t, 32))
    c_h, s_h = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    x = _device_view(cp, x_h, 0, shift)
    c = _device_view(cp, c_h, 0, table_shift)
    s = cp.asarray(s_h)
    if out_kind == "x":
        out = x
    elif out_kind == "overlap" and x.size:
        buf = cp.zeros(x.size + 8, dtype=x.dtype)
        out = buf[8:].reshape(x.shape)
        x = buf[:x.size].reshape(x.shape)
        x[...] = cp.asarray(x_h)
    else:
        out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    saved = [(a, bits(cp.asnumpy(a))) for a in (x, c, s, out)]
    try:
        plan = rope_rtc.TailRoPEForward(x, c, s, out).check_support().compile()
        plan.execute(x, c, s, out)
        cp.cuda.get_current_stream().synchronize()
    except CLEAR as exc:
        assert str(exc)
        for a, before in saved:
            assert np.array_equal(bits(cp.asnumpy(a)), before)
        COUNTS["tail"]["rejected"] += 1
        return
    assert np.array_equal(bits(cp.asnumpy(out)), tail_rope_reference(x_h, c_h, s_h).view(np.uint16))
    COUNTS["tail"]["ok"] += 1


def test_fuzz_gpu_counts(request):
    """Both outcomes happened in both families (the fuzzers reached valid and invalid inputs).

    Checks the families whose fuzzer this session selected (``-k``, a shard of the suite).
    """
    print({k: dict(v) for k, v in COUNTS.items()})
    selected = {item.name for item in request.session.items}
    for fam in ("general", "tail"):
        if f"test_fuzz_{fam}_gpu" not in selected:
            continue
        assert COUNTS[fam]["ok"] > 10 and COUNTS[fam]["rejected"] > 5, dict(COUNTS[fam])
