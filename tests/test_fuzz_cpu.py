"""Property-based tests of bad (and good) input, on a CPU (issue 6, item 1, CPU part).

Shapes, strides, dtypes, pointer offsets, alignments, position schemes and overlaps are drawn
at random for ``apply_rope``, ``apply_rope_qk``, ``RopePlan`` and ``TailRoPEForward``:

* with fake device arrays and :class:`fakes.FakeGPU` (the real host-side steps up to the launch,
  which is recorded instead of made): every case either reaches a sane launch or raises a
  TypeError/ValueError/NotImplementedError whose message starts with the argument's name, with
  nothing launched. Any other exception (AttributeError, IndexError, ZeroDivisionError, ...)
  fails the test.
* with the NumPy backend on real arrays: every case that is accepted equals the reference
  (``rope_reference`` + one rounding; ``tail_rope_reference``) bit for bit, and a call that
  raises leaves every input, and the in-place output, bit for bit unchanged.

Deterministic (``derandomize=True``, no example database); the number of cases tried is counted
per test and reported by the last test of the module.
"""

from __future__ import annotations

import collections
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import BF16, FakeDeviceArray, FakeGPU, FakeTorchTensor, c_strides, fake_alloc, fake_cupy
from rope_rtc import RopePlan, TailRoPEForward, TensorDesc, apply_rope, apply_rope_qk, tail_rope
from rope_rtc.reference import rope_reference, round_to_dtype, tail_rope_reference
from rope_rtc.registry import rope_vector_widths

CLEAR_ERRORS = (TypeError, ValueError, NotImplementedError)
LAYOUTS = ("bshd", "bhsd", "sbhd", "thd")
FLOATS = (np.dtype(np.float32), np.dtype(np.float16), BF16)

#: cases tried, per test and outcome; reported by test_zz_report_case_counts
COUNTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

ARG_NAMES = ("x", "q", "k", "out", "q_out", "k_out", "cos", "sin", "cosine", "sine", "positions", "offset",
             "cu_seqlens", "layout", "interleaved", "inverse", "rotary_dim", "rotary_offset", "backend", "execute",
             "variant")
_NAMED = re.compile(r"^(" + "|".join(sorted(ARG_NAMES, key=len, reverse=True)) + r")\b")


def _check_clear(exc: BaseException) -> str:
    msg = str(exc)
    assert _NAMED.match(msg), f"the message does not start with the argument's name: {msg!r}"
    return type(exc).__name__


# ---------------------------------------------------------------------------------------------
# drawing arrays

def _layout_shape(layout, b, s, h, d):
    return {"bshd": (b, s, h, d), "bhsd": (b, h, s, d), "sbhd": (s, b, h, d), "thd": (b * s, h, d)}[layout]


def _draw_strides(data, shape, *, allow_negative):
    """Element strides: C order with random padding; rarely a strided last axis, a zero (broadcast)
    or negative leading stride."""
    n = len(shape)
    strides = [0] * n
    acc = 1
    for i in reversed(range(n)):
        if i == n - 1:
            step = data.draw(st.sampled_from([1] * 12 + [2]), label="last stride")
        else:
            step = acc + data.draw(st.sampled_from([0] * 6 + [1, 2, 3, 8]), label="pad")
        strides[i] = step
        acc = step * max(shape[i], 1)
    if n > 1 and data.draw(st.integers(0, 19), label="odd stride kind") == 0:
        i = data.draw(st.integers(0, n - 2))
        strides[i] = 0 if not allow_negative or data.draw(st.booleans()) else -strides[i]
    return tuple(strides)


def _lo_hi(shape, strides):
    lo = sum((d - 1) * s for d, s in zip(shape, strides) if s < 0 and d > 0)
    hi = sum((d - 1) * s for d, s in zip(shape, strides) if s > 0 and d > 0)
    return lo, hi


def fake_array(data, shape, dtype, *, label, kind=None, strides=None, at=None, shift=None):
    """A fake device array (``__cuda_array_interface__``, or a fake CuPy array for bfloat16 or when
    drawn) with drawn strides and byte misalignment; ``at`` places it at a given address."""
    dtype = np.dtype(dtype)
    if kind is None:
        kind = "cupy" if dtype == BF16 else data.draw(st.sampled_from(["cai", "cai", "cupy"]), label=f"{label} kind")
    if strides is None:
        strides = _draw_strides(data, shape, allow_negative=kind == "cai")
    if kind == "cupy" and any(s < 0 for s in strides):
        kind = "cai" if dtype != BF16 else kind
        strides = tuple(abs(s) for s in strides) if dtype == BF16 else strides
    if shift is None:
        shift = data.draw(st.sampled_from([0] * 8 + [1, 2, 4, 6, 8, 12]), label=f"{label} byte shift")
    lo, hi = _lo_hi(shape, strides)
    itemsize = dtype.itemsize
    span = (hi - lo + 1) * itemsize
    if at is None:
        base = fake_alloc(span + shift + 64)
        ptr = base + shift - lo * itemsize
    else:
        base, ptr = at - 64, at
    if kind == "cupy":
        return fake_cupy(shape, dtype, ptr=base, byte_offset=ptr - base, strides=tuple(s * itemsize for s in strides))
    return FakeDeviceArray(shape, dtype, ptr=ptr, strides=tuple(s * itemsize for s in strides))


def _ptr(a) -> int:
    return a.data.ptr if hasattr(a, "data") and hasattr(a.data, "ptr") else a.__cuda_array_interface__["data"][0]


def _strides_el(a) -> tuple[int, ...]:
    item = np.dtype(a.dtype).itemsize
    st_ = a.strides if a.strides is not None else c_strides(a.shape, item)
    return tuple(s // item for s in st_)


def draw_dtype(data, label):
    return data.draw(st.sampled_from(list(FLOATS) * 6 + [np.dtype(np.float64), np.dtype(np.int32)]), label=label)


def draw_index(data, shape, *, label, device=True):
    dtype = data.draw(st.sampled_from([np.int32, np.int64, np.int32, np.int64, np.float32]), label=f"{label} dtype")
    if device:
        return fake_array(data, shape, dtype, label=label, kind="cai")
    return dtype


def draw_output(data, x, *, label):
    """None, the input itself (in place), a fresh array, or one that overlaps something."""
    choice = data.draw(st.sampled_from(["none", "none", "same", "same", "fresh", "fresh", "overlap", "other_view",
                                        "wrong_dtype", "wrong_shape"]), label=label)
    if choice == "none":
        return None
    if choice == "same":
        return x
    dtype = np.dtype(x.dtype)
    if choice == "fresh":
        return fake_array(data, x.shape, dtype, label=f"{label} fresh")
    if choice == "overlap":
        k = data.draw(st.integers(1, 9), label=f"{label} shift")
        return fake_array(data, x.shape, dtype, label=label, strides=_strides_el(x), at=_ptr(x) + k * dtype.itemsize,
                          kind="cupy" if dtype == BF16 else "cai")
    if choice == "other_view":
        return fake_array(data, x.shape, dtype, label=label, at=_ptr(x), kind="cupy" if dtype == BF16 else "cai")
    if choice == "wrong_dtype":
        other = [d for d in FLOATS if d != dtype][0]
        return fake_array(data, x.shape, other, label=label)
    shape = tuple(x.shape[:-1]) + (x.shape[-1] + 2,)
    return fake_array(data, shape, dtype, label=label)


def draw_general_case(data, *, with_k):
    dtype = draw_dtype(data, "dtype")
    layout = data.draw(st.sampled_from(list(LAYOUTS) * 5 + ["bsdh"]), label="layout")
    b = data.draw(st.integers(0, 3), label="B")
    s = data.draw(st.integers(0, 5), label="S")
    h = data.draw(st.integers(0, 4), label="H")
    d = data.draw(st.sampled_from([2, 4, 6, 8, 10, 16, 24, 32, 64, 66, 128]), label="D")
    lay = layout if layout in LAYOUTS else "bshd"
    q = fake_array(data, _layout_shape(lay, b, s, h, d), dtype, label="q")
    k = None
    if with_k:
        kd = dtype if data.draw(st.integers(0, 9), label="k dtype differs") else FLOATS[0]
        hk = data.draw(st.integers(0, 4), label="Hk")
        ks = s if data.draw(st.integers(0, 9), label="k S differs") else s + 1
        k = fake_array(data, _layout_shape(lay, b, ks, hk, d), kd, label="k")
    rotary_dim = data.draw(st.one_of(st.none(), st.none(), st.integers(-2, d + 3)), label="rotary_dim")
    rotary_offset = data.draw(st.one_of(st.just(0), st.just(0), st.integers(-1, d)), label="rotary_offset")
    r = d if rotary_dim is None else rotary_dim
    cols = max(r // 2, 0) + data.draw(st.sampled_from([0] * 9 + [1]), label="cols delta")
    rows = data.draw(st.integers(0, s * max(b, 1) + 4), label="rows")
    tdt = data.draw(st.sampled_from([np.float32] * 9 + [np.float64]), label="table dtype")
    cos = fake_array(data, (rows, cols), tdt, label="cos")
    sin_shape = (rows, cols) if data.draw(st.integers(0, 9), label="sin shape differs") else (rows + 1, cols)
    sin = fake_array(data, sin_shape, np.float32, label="sin")
    kw = dict(layout=layout, rotary_dim=rotary_dim, rotary_offset=rotary_offset,
              interleaved=data.draw(st.sampled_from([False, True, False, True, "yes"]), label="interleaved"),
              inverse=data.draw(st.sampled_from([False, True, False, True, 1]), label="inverse"))
    nseq = b if lay != "thd" else data.draw(st.integers(0, 3), label="num seqs")
    scheme = data.draw(st.sampled_from(["default", "int", "offsets", "positions", "cu_seqlens", "both"]),
                       label="positions")
    tokens_shape = (b * s,) if lay == "thd" else (b, s)
    if scheme == "int":
        kw["offset"] = data.draw(st.integers(-2, rows + 1), label="offset")
    elif scheme == "offsets":
        n = nseq + data.draw(st.sampled_from([0] * 5 + [1]), label="offsets delta")
        kw["offset"] = draw_index(data, (n,), label="offsets")
    elif scheme == "positions":
        shape = tokens_shape if data.draw(st.integers(0, 7), label="positions shape ok") else tokens_shape + (1,)
        kw["positions"] = draw_index(data, shape, label="positions")
        if not data.draw(st.integers(0, 7), label="positions with offset"):
            kw["offset"] = 1
    elif scheme in ("cu_seqlens", "both"):
        kw["cu_seqlens"] = draw_index(data, (nseq + 1,), label="cu_seqlens")
        if data.draw(st.booleans(), label="cu offsets"):
            kw["offset"] = draw_index(data, (nseq,), label="cu offsets")
        if scheme == "both":
            kw["positions"] = draw_index(data, tokens_shape, label="positions")
    out = draw_output(data, q, label="q_out")
    k_out = draw_output(data, k, label="k_out") if k is not None else None
    if data.draw(st.integers(0, 29), label="table as output") == 0:
        out = fake_array(data, q.shape, np.dtype(q.dtype), label="out over cos", at=_ptr(cos),
                         kind="cupy" if np.dtype(q.dtype) == BF16 else "cai")
    if data.draw(st.integers(0, 39), label="requires grad") == 0:
        sin = FakeTorchTensor(sin_shape, np.float32)
    return q, k, cos, sin, out, k_out, kw


def _check_launches(gpu, start):
    for launch in gpu.launches[start:]:
        (gx, gy, gz), (bx, by, bz) = launch["grid"], launch["block"]
        assert min(gx, gy, gz, bx, by, bz) >= 1
        assert bx * by * bz <= 1024 and gx < 2**31 and gy < 65536 and gz < 65536
        req = launch.get("req")
        if req is not None:  # one-call API: the chosen width fits every address and stride
            vec = launch["vec"]
            assert vec in rope_vector_widths(req.dtype, req.interleaved)
            p = launch["params"]
            for ptr in (p.q_in, p.q_out) + ((p.k_in, p.k_out) if req.k is not None else ()):
                assert ptr % (vec * req.q.itemsize) == 0


# ---------------------------------------------------------------------------------------------
# (a) fake device arrays: a sane launch or a clear error, nothing else

@settings(FUZZ, max_examples=700)
@given(st.data())
def test_fuzz_general_fake_arrays(data):
    api = data.draw(st.sampled_from(["apply_rope", "apply_rope_qk", "plan"]), label="api")
    q, k, cos, sin, out, k_out, kw = draw_general_case(data, with_k=api != "apply_rope")
    with FakeGPU() as gpu:
        try:
            if api == "apply_rope":
                apply_rope(q, cos, sin, out=out, backend="nvrtc", **kw)
            elif api == "apply_rope_qk":
                apply_rope_qk(q, k, cos, sin, q_out=out, k_out=k_out, backend="nvrtc", **kw)
            else:
                plan = RopePlan(q, k, cos, sin, q_out=out, k_out=k_out, **kw)
                extra = {n: kw[n] for n in ("offset", "cu_seqlens") if n in kw}
                plan.execute(q, k, cos, sin, positions=kw.get("positions"), q_out=out, k_out=k_out, **extra)
                plan.execute(q, k, cos, sin, positions=kw.get("positions"), q_out=out, k_out=k_out, **extra)
        except CLEAR_ERRORS as exc:
            outcome = _check_clear(exc)
            if api != "plan":
                assert gpu.launches == []
        else:
            outcome = "launched" if gpu.launches else "accepted, nothing to launch"
        _check_launches(gpu, 0)
    COUNTS["general/fake"][outcome] += 1


def draw_tail_case(data):
    rank = data.draw(st.sampled_from([2, 3, 3, 3, 1, 4]), label="rank")
    t = data.draw(st.sampled_from([0, 1, 2, 3, 5, 17, 4096]), label="T")
    h = data.draw(st.sampled_from([1, 2, 3, 1, 2, 0]), label="H")
    d = data.draw(st.sampled_from([128, 512, 128, 512, 64, 256]), label="D")
    shape = {1: (d,), 2: (t, d), 3: (t, h, d), 4: (t, h, 1, d)}[rank]
    xdt = data.draw(st.sampled_from([BF16] * 8 + [np.dtype(np.float16), np.dtype(np.float32)]), label="x dtype")

    def tail_array(shape, dtype, label):
        contiguous = data.draw(st.integers(0, 7), label=f"{label} contiguous") > 0
        strides = None if not contiguous else tuple(s // np.dtype(dtype).itemsize
                                                    for s in c_strides(shape, np.dtype(dtype).itemsize))
        shift = data.draw(st.sampled_from([0] * 6 + [2, 4, 8, 16, 32]), label=f"{label} shift")
        return fake_array(data, shape, dtype, label=label, strides=strides, shift=shift)

    x = tail_array(shape, xdt, "x")
    tshape = (t, 32) if data.draw(st.integers(0, 9), label="table shape ok") else (t + 1, 32)
    tdt = data.draw(st.sampled_from([np.float32] * 9 + [np.float64]), label="table dtype")
    cosine = tail_array(tshape, tdt, "cosine")
    sine = tail_array((t, 32), np.float32, "sine")
    where = data.draw(st.sampled_from(["fresh"] * 6 + ["x", "overlap_x", "cosine", "sine"]), label="out")
    if where == "fresh":
        out = tail_array(shape, xdt, "out")
    elif where == "x":
        out = x
    else:
        target = {"overlap_x": x, "cosine": cosine, "sine": sine}[where]
        out = fake_array(data, shape, xdt, label="out", at=_ptr(target) + (32 if where == "overlap_x" else 0),
                         strides=tuple(s // np.dtype(xdt).itemsize for s in c_strides(shape, np.dtype(xdt).itemsize)),
                         kind="cupy" if np.dtype(xdt) == BF16 else "cai")
    return x, cosine, sine, out


@settings(FUZZ, max_examples=500)
@given(st.data())
def test_fuzz_tail_fake_arrays(data):
    x, cosine, sine, out = draw_tail_case(data)
    decl = data.draw(st.sampled_from(["arrays", "arrays", "descs", "grad", "backend"]), label="declared as")
    if decl == "descs":
        cons = [TensorDesc(np.dtype(a.dtype), a.shape, _strides_el(a)) for a in (x, cosine, sine, out)]
    else:
        cons = [x, cosine, sine, out]
    if decl == "grad":
        cons[data.draw(st.integers(0, 3), label="grad arg")] = FakeTorchTensor((1, 32), np.float32)
    backend = "frost" if decl == "backend" else "nvrtc"
    with FakeGPU() as gpu:
        try:
            plan = TailRoPEForward(*cons, backend=backend).check_support().compile()
            assert plan.scratch_workspace_bytes() == 0
            result = plan.execute(x, cosine, sine, out)
            assert result["out"] is out
            if data.draw(st.booleans(), label="new T"):
                t2 = data.draw(st.sampled_from([0, 1, 7, 300]), label="T2")
                shape2 = (t2,) + tuple(x.shape[1:])
                x2, o2 = fake_cupy(shape2, BF16), fake_cupy(shape2, BF16)
                c2, s2 = FakeDeviceArray((t2, 32), np.float32), FakeDeviceArray((t2, 32), np.float32)
                plan.execute(x2, c2, s2, o2)
        except CLEAR_ERRORS as exc:
            outcome = _check_clear(exc)
        else:
            outcome = "launched" if gpu.launches else "accepted, nothing to launch"
            if x.size:
                v = plan._args.values
                assert v.n > 0 and v.x % 16 == 0 and v.out % 16 == 0 and v.cos % 16 == 0 and v.sin % 16 == 0
        _check_launches(gpu, 0)
    COUNTS["tail/fake"][outcome] += 1


# ---------------------------------------------------------------------------------------------
# (b) the NumPy backend on real arrays: the reference's answer, or a clear error and no write

def _host_array(data, shape, dtype, *, label, rng):
    """A real NumPy array with drawn padding (a view into a larger buffer) and sometimes a transposed
    or strided view; filled with random values."""
    dtype = np.dtype(dtype)
    pads = [data.draw(st.sampled_from([0, 0, 0, 1, 3]), label=f"{label} pad") for _ in shape]
    big = tuple(d + p for d, p in zip(shape, pads))
    buf = rng.standard_normal(big).astype(np.float32).astype(dtype) if dtype.kind == "f" or dtype == BF16 else \
        rng.integers(-2, 8, size=big).astype(dtype)
    view = buf[tuple(slice(0, d) for d in shape)]
    if len(shape) >= 1 and data.draw(st.integers(0, 14), label=f"{label} strided last") == 0:
        wide = rng.standard_normal(tuple(shape[:-1]) + (2 * shape[-1],)).astype(np.float32).astype(dtype)
        view = wide[..., ::2]
    return view


def _positions_for(layout, b, s, kw, rows):
    """Per-token positions [B*S] for an accepted call, computed here (not by the library)."""
    n = b * s
    if "positions" in kw:
        return np.asarray(kw["positions"]).reshape(-1).astype(np.int64)
    if "cu_seqlens" in kw:
        cu = np.asarray(kw["cu_seqlens"]).astype(np.int64)
        off = kw.get("offset", 0)
        pos = np.full(n, -1, np.int64)
        for t in range(n):
            seq = None
            for j in range(len(cu) - 1):
                if cu[j] <= t < cu[j + 1]:
                    seq = j
            if seq is not None and cu[0] <= t < cu[-1]:
                base = np.asarray(off).astype(np.int64)[seq] if isinstance(off, np.ndarray) else int(off)
                pos[t] = t - cu[seq] + base
        return pos
    off = kw.get("offset", 0)
    if isinstance(off, np.ndarray):
        return (off.astype(np.int64)[:, None] + np.arange(s)[None, :]).reshape(-1)
    if layout == "thd":
        return int(off) + np.arange(n)
    return np.broadcast_to(int(off) + np.arange(s), (b, s)).reshape(-1)


def _canon(a, layout):
    """[tokens, H, D] in (b, s) token order."""
    perm = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3), "thd": (0, 1, 2)}[layout]
    c = np.transpose(a, perm)
    return c.reshape(int(np.prod(c.shape[:-2])), c.shape[-2], c.shape[-1])


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64, 1: np.uint8}[a.dtype.itemsize])


@settings(FUZZ, max_examples=600)
@given(st.data())
def test_fuzz_general_numpy_backend(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    api = data.draw(st.sampled_from(["apply_rope", "apply_rope_qk"]), label="api")
    dtype = data.draw(st.sampled_from(list(FLOATS) * 8 + [np.dtype(np.float64)]), label="dtype")
    layout = data.draw(st.sampled_from(list(LAYOUTS) * 6 + ["bsdh"]), label="layout")
    lay = layout if layout in LAYOUTS else "bshd"
    b, s = data.draw(st.integers(0, 3), label="B"), data.draw(st.integers(0, 5), label="S")
    h, d = data.draw(st.integers(0, 3), label="H"), data.draw(st.sampled_from([2, 4, 6, 8, 12, 16]), label="D")
    x = _host_array(data, _layout_shape(lay, b, s, h, d), dtype, label="x", rng=rng)
    k = None
    if api == "apply_rope_qk":
        k = _host_array(data, _layout_shape(lay, b, s, data.draw(st.integers(0, 3), label="Hk"), d), dtype,
                        label="k", rng=rng)
    rotary_dim = data.draw(st.one_of(st.none(), st.none(), st.integers(-1, d + 2)), label="rotary_dim")
    rotary_offset = data.draw(st.one_of(st.just(0), st.integers(-1, d)), label="rotary_offset")
    r = d if rotary_dim is None else rotary_dim
    rows = data.draw(st.integers(0, b * s + 3), label="rows")
    cols = max(r // 2, 0) + data.draw(st.sampled_from([0] * 9 + [1]), label="cols delta")
    cos = _host_array(data, (rows, cols), data.draw(st.sampled_from([np.float32] * 9 + [np.float16]), label="cos dt"),
                      label="cos", rng=rng)
    sin = _host_array(data, (rows, cols), np.float32, label="sin", rng=rng)
    kw = dict(layout=layout, rotary_dim=rotary_dim, rotary_offset=rotary_offset,
              interleaved=data.draw(st.booleans(), label="interleaved"),
              inverse=data.draw(st.booleans(), label="inverse"))
    nseq = b if lay != "thd" else data.draw(st.integers(0, 3), label="num seqs")
    tokens_shape = (b * s,) if lay == "thd" else (b, s)
    scheme = data.draw(st.sampled_from(["default", "int", "offsets", "positions", "cu_seqlens"]), label="scheme")
    idt = data.draw(st.sampled_from([np.int32, np.int64, np.int32, np.int64, np.float32]), label="index dtype")
    if scheme == "int":
        kw["offset"] = data.draw(st.integers(-1, rows + 1), label="offset")
    elif scheme == "offsets":
        n = nseq + data.draw(st.sampled_from([0] * 5 + [1]), label="offsets delta")
        kw["offset"] = rng.integers(-1, rows + 1, size=n).astype(idt)
    elif scheme == "positions":
        shape = tokens_shape if data.draw(st.integers(0, 7), label="pos shape ok") else tokens_shape + (1,)
        kw["positions"] = rng.integers(-1, rows + 1, size=shape).astype(idt)
    elif scheme == "cu_seqlens":
        cu = np.sort(rng.integers(0, b * s + 1, size=nseq + 1))
        if data.draw(st.booleans(), label="cu spans all"):
            cu[0], cu[-1] = 0, b * s
        kw["cu_seqlens"] = cu.astype(idt)
        if data.draw(st.booleans(), label="cu offsets"):
            kw["offset"] = rng.integers(0, 3, size=nseq).astype(np.int32)
    out_kind = data.draw(st.sampled_from(["none", "same", "same", "fresh", "overlap", "readonly", "broadcast"]),
                         label="out")
    if out_kind == "none":
        out = None
    elif out_kind == "same":
        out = x
    elif out_kind == "fresh":
        out = np.full(x.shape, np.nan, dtype)
    elif out_kind == "overlap" and x.size > 1:
        flat = np.zeros(x.size + 3, dtype)
        out = flat[1 : 1 + x.size].reshape(x.shape)
        x = flat[: x.size].reshape(x.shape)  # out shares all but its first element with x
        x[...] = rng.standard_normal(x.shape).astype(np.float32).astype(dtype)
    elif out_kind == "readonly":
        out = np.zeros(x.shape, dtype)
        out.flags.writeable = False
    else:
        out = np.lib.stride_tricks.as_strided(np.zeros(x.shape[-1:], dtype), x.shape, (0,) * (x.ndim - 1) +
                                              (dtype.itemsize,))  # writable, every row one memory
    k_out = (k if data.draw(st.booleans(), label="k in place") else None) if k is not None else None
    saved = [(a, _bits(a).copy()) for a in (x, k, cos, sin, out, k_out) if isinstance(a, np.ndarray)]
    try:
        if api == "apply_rope":
            got, got_k = apply_rope(x, cos, sin, out=out, backend="numpy", **kw), None
        else:
            got, got_k = apply_rope_qk(x, k, cos, sin, q_out=out, k_out=k_out, backend="numpy", **kw)
    except CLEAR_ERRORS as exc:
        outcome = _check_clear(exc)
        for a, bits in saved:  # nothing written: inputs, and the in-place output
            np.testing.assert_array_equal(_bits(a), bits)
    else:
        outcome = "ok"
        pos = _positions_for(lay, b, s, kw, rows)
        for arr, res, own_out in ((x, got, out), (k, got_k, k_out)):
            if arr is None:
                continue
            src = next(bits for a, bits in saved if a is arr).view(arr.dtype).reshape(arr.shape) \
                if own_out is arr else arr
            n = pos.shape[0]
            canon = _canon(src, lay)
            want = round_to_dtype(rope_reference(canon.reshape(n, canon.shape[-2], canon.shape[-1]), cos, sin, pos,
                                                 interleaved=kw["interleaved"], rotary_dim=rotary_dim,
                                                 rotary_offset=rotary_offset, inverse=kw["inverse"]), arr.dtype)
            res_c = _canon(res, lay).reshape(want.shape)
            np.testing.assert_array_equal(_bits(res_c), _bits(want))
            if own_out is arr:
                assert res is arr
            elif own_out is None:
                np.testing.assert_array_equal(_bits(arr), next(bits for a, bits in saved if a is arr))
    COUNTS["general/numpy"][outcome] += 1


@settings(FUZZ, max_examples=250)
@given(st.data())
def test_fuzz_tail_numpy_backend(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    rank = data.draw(st.sampled_from([2, 3, 3, 1]), label="rank")
    t = data.draw(st.sampled_from([0, 1, 2, 5, 9]), label="T")
    h = data.draw(st.sampled_from([1, 2, 3, 0]), label="H")
    d = data.draw(st.sampled_from([128, 512, 128, 256]), label="D")
    shape = {1: (d,), 2: (t, d), 3: (t, h, d)}[rank]
    xdt = data.draw(st.sampled_from([BF16] * 8 + [np.dtype(np.float16)]), label="x dtype")
    x = _host_array(data, shape, xdt, label="x", rng=rng)
    tshape = (t, 32) if data.draw(st.integers(0, 9), label="table ok") else (t, 31)
    cosine = np.cos(rng.uniform(-50, 50, tshape)).astype(np.float32)
    sine = np.sin(rng.uniform(-50, 50, (t, 32))).astype(np.float32)
    if data.draw(st.integers(0, 9), label="negate") == 0:
        sine = -sine
    out_kind = data.draw(st.sampled_from(["fresh", "fresh", "fresh", "x", "overlap", "cosine"]), label="out")
    if out_kind == "fresh":
        out = np.full(x.shape, np.nan, xdt)
    elif out_kind == "x":
        out = x
    elif out_kind == "overlap" and x.size:
        buf = np.zeros(x.size + 8, xdt)
        x = buf[: x.size].reshape(x.shape)
        x[...] = rng.standard_normal(x.shape).astype(np.float32).astype(xdt)
        out = buf[8 : 8 + x.size].reshape(x.shape)
    else:
        out = cosine.view(xdt)[: x.size // 2 if x.ndim else 0].reshape(-1)  # table bytes as an output
    saved = [(a, _bits(a).copy()) for a in (x, cosine, sine)]
    try:
        if data.draw(st.booleans(), label="one call"):
            result = tail_rope(x, cosine, sine, backend="numpy")
        else:
            result = TailRoPEForward(x, cosine, sine, out, backend="numpy").execute(x, cosine, sine, out)
    except CLEAR_ERRORS as exc:
        outcome = _check_clear(exc)
    else:
        outcome = "ok"
        np.testing.assert_array_equal(_bits(result["out"]), _bits(tail_rope_reference(x, cosine, sine)))
    for a, bits in saved:
        np.testing.assert_array_equal(_bits(a), bits)
    COUNTS["tail/numpy"][outcome] += 1


def test_zz_report_case_counts():
    """Reports the cases tried (run with -s or -rP to see the line); runs last in this module."""
    expected = {"general/fake", "tail/fake", "general/numpy", "tail/numpy"}
    if set(COUNTS) != expected:
        pytest.skip("report only when every fuzz test of the module ran")
    total = sum(sum(c.values()) for c in COUNTS.values())
    lines = [f"{name}: {sum(c.values())} cases ({', '.join(f'{k} {v}' for k, v in sorted(c.items()))})"
             for name, c in sorted(COUNTS.items())]
    print(f"\nfuzz cases tried: {total}\n" + "\n".join(lines))
    for name, c in COUNTS.items():
        accepted = sum(v for k, v in c.items() if k in ("ok", "launched", "accepted, nothing to launch"))
        assert accepted > 0, f"{name}: no valid case was generated ({dict(c)})"
        assert sum(c.values()) - accepted > 0, f"{name}: no invalid case was generated ({dict(c)})"
    assert total >= 1000, lines
