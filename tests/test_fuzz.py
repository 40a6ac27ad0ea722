"""Property-based tests of bad (and good) input, on a CPU.

Shapes, strides, dtypes, pointer offsets, alignments, position schemes and overlaps are drawn
at random for ``apply_rope``, ``apply_rope_qk``, ``RopePlan`` and ``TailRoPEForward``:

* (a) with fake device arrays and :class:`fakes.FakeGPU` (the real host-side steps up to the
  launch, which is recorded instead of made): every case either reaches a sane launch or raises a
  TypeError/ValueError/NotImplementedError whose message starts with the argument's name, with
  nothing launched. Any other exception (AttributeError, IndexError, ZeroDivisionError, ...)
  fails the test.
* (b) with the NumPy backend on real arrays: every case that is accepted equals the reference
  (``rope_reference`` + one rounding; ``tail_rope_reference``) bit for bit, and a call that
  raises leaves every input, and the in-place output, bit for bit unchanged.
* (c) a plan's re-used validation decides as a full validation would.
* (d) hostile input on the NumPy backend, in a plain seeded loop (tens of thousands of cases):
  0-d arrays, non-native byte order, huge and non-finite scalars, out-of-range indices,
  non-finite data and tables, and hostile ``rope_tables`` parameters. Every call equals the
  reference or raises TypeError/ValueError/NotImplementedError/RopeRtcError naming the argument,
  with every input unchanged; failures are reported per class with a reproducer each.

Each case has a "chaos" level drawn first: the probability that any one ingredient (dtype,
window, stride, pointer shift, table, position array, output) is drawn from its invalid
choices. Chaos 0 gives valid cases (which must be accepted, except where noted), higher levels
mix several faults. Deterministic (``derandomize=True``, no example database); the number of
cases tried is counted per test and reported by the last test of the module.
"""

from __future__ import annotations

import collections
import math
import re
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import BF16, FakeDeviceArray, FakeGPU, FakeTorchTensor, c_strides, fake_alloc, fake_cupy
from helpers import bits, layout_shape, token_rows
from rope_rtc import RopePlan, TailRoPEForward, TensorDesc, apply_rope, apply_rope_qk, tail_rope
from rope_rtc.errors import RopeRtcError
from rope_rtc.reference import rope_reference, round_to_dtype, tail_rope_reference
from rope_rtc.tables import rope_tables
from rope_rtc.build.registry import rope_vector_widths

CLEAR_ERRORS = (TypeError, ValueError, NotImplementedError)
LAYOUTS = ("bshd", "bhsd", "sbhd", "thd")
FLOATS = (np.dtype(np.float32), np.dtype(np.float16), BF16)
ACCEPTED = ("ok", "launched", "accepted", "nothing")

#: cases tried, per test and outcome; reported by test_zz_report_case_counts
COUNTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
CHAOS = st.sampled_from([0.0, 0.0, 0.0, 0.04, 0.1, 0.3])
RELOCATION_CHAOS = st.sampled_from([0.0, 0.2, 0.4, 0.6])
SIZES = st.sampled_from([1, 1, 2, 2, 3, 5, 0])  # B, S, H: zero sometimes

ARG_NAMES = ("x", "q", "k", "out", "q_out", "k_out", "cos", "sin", "cosine", "sine", "positions", "offset",
             "cu_seqlens", "layout", "interleaved", "inverse", "rotary_dim", "rotary_offset", "backend", "execute",
             "variant")
_NAMED = re.compile(r"^(" + "|".join(sorted(ARG_NAMES, key=len, reverse=True)) + r")\b")


def _check_clear(exc: BaseException) -> str:
    msg = str(exc)
    assert _NAMED.match(msg), f"the message does not start with the argument's name: {msg!r}"
    return type(exc).__name__


# ---------------------------------------------------------------------------------------------
# drawing cases
#
# Hypothesis draws the structure of a case (API, chaos, dtype, layout, sizes, position scheme);
# the many small details (padding, pointer shifts, which protocol a fake speaks, which
# ingredient goes wrong) come from a NumPy generator seeded by one more draw. A hypothesis draw
# costs tens of microseconds and a case needs dozens of details: this keeps a few thousand cases
# well under a minute, deterministically.


class Dice:
    """Small random choices for one case, from a seed that hypothesis draws."""

    def __init__(self, seed: int, chaos: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.chaos = chaos

    def pick(self, options):
        return options[int(self.rng.integers(len(options)))]

    def one_in(self, n: int) -> bool:
        return int(self.rng.integers(n)) == 0

    def int(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1)) if hi >= lo else lo

    def bad(self) -> bool:
        """Whether this ingredient is drawn from its invalid choices."""
        return bool(self.rng.random() < self.chaos)


def _strides(dice, shape, *, contiguous=False, allow_negative=True):
    """Element strides: C order with (even) padding; with chaos, odd padding, a strided last axis,
    or a zero (broadcast) or negative leading stride."""
    n = len(shape)
    strides, acc = [0] * n, 1
    for i in reversed(range(n)):
        if i == n - 1:
            step = 2 if (not contiguous and dice.bad()) else 1
        elif contiguous:
            step = acc
        else:
            step = acc + (dice.pick([1, 3]) if dice.bad() else dice.pick([0, 0, 0, 2, 8]))
        strides[i] = step
        acc = step * max(shape[i], 1)
    if n > 1 and not contiguous:
        i = dice.int(0, n - 2)
        if allow_negative and dice.one_in(12):
            strides[i] = -strides[i]  # a reversed view: valid
        elif dice.bad():
            strides[i] = 0  # broadcast: fine to read, but an output (or in place) may not overlap itself
    return tuple(strides)


def _lo_hi(shape, strides):
    lo = sum((d - 1) * s for d, s in zip(shape, strides) if s < 0 and d > 0)
    hi = sum((d - 1) * s for d, s in zip(shape, strides) if s > 0 and d > 0)
    return lo, hi


def _shift(dice, align=16):
    """A byte shift of the pointer: a multiple of ``align`` unless this ingredient goes bad."""
    return dice.pick([1, 2, 4, 6, 8, 12]) if dice.bad() else dice.pick([0, 0, 0, 0, align, 2 * align])


def fake_array(dice, shape, dtype, *, kind=None, strides=None, at=None, shift=None):
    """A fake device array (``__cuda_array_interface__``, or a fake CuPy array for bfloat16 or when
    drawn) with drawn strides and byte shift; ``at`` places it at a given address."""
    dtype = np.dtype(dtype)
    if kind is None:
        kind = "cupy" if dtype == BF16 else dice.pick(["cai", "cai", "cupy"])
    if strides is None:
        strides = _strides(dice, shape, allow_negative=kind == "cai")
    if kind == "cupy" and any(s < 0 for s in strides) and dtype != BF16:
        kind = "cai"
    if shift is None:
        shift = _shift(dice)
    lo, hi = _lo_hi(shape, strides)
    itemsize = dtype.itemsize
    span = (hi - lo + 1) * itemsize
    if at is None:
        base = fake_alloc(span + shift + 64)
        ptr = base + shift - lo * itemsize
    else:
        base, ptr = at - 64 + lo * itemsize, at
    if kind == "cupy":
        return fake_cupy(shape, dtype, ptr=base, byte_offset=ptr - base, strides=tuple(s * itemsize for s in strides))
    return FakeDeviceArray(shape, dtype, ptr=ptr, strides=tuple(s * itemsize for s in strides))


def _ptr(a) -> int:
    return a.data.ptr if hasattr(a, "data") and hasattr(a.data, "ptr") else a.__cuda_array_interface__["data"][0]


def _strides_el(a) -> tuple[int, ...]:
    item = np.dtype(a.dtype).itemsize
    st_ = a.strides if a.strides is not None else c_strides(a.shape, item)
    return tuple(s // item for s in st_)


def _same_place_kind(dtype):
    return "cupy" if np.dtype(dtype) == BF16 else "cai"


def _index_dtype(dice):
    return np.float32 if dice.bad() else dice.pick([np.int32, np.int64])


def draw_index(dice, shape):
    return fake_array(dice, shape, _index_dtype(dice), kind="cai", strides=_strides(dice, shape, contiguous=True),
                      shift=dice.pick([4, 2]) if dice.bad() else 0)


def draw_output(dice, x, *, choice=None):
    """None or the input itself (in place) or a fresh array; with chaos, one that overlaps x, x's
    bytes in another view, or the wrong dtype or shape."""
    if x is None:
        return None
    if choice is None:
        choice = (dice.pick(["overlap", "other_view", "wrong_dtype", "wrong_shape"]) if dice.bad()
                  else dice.pick(["none", "same", "fresh"]))
    if choice == "none":
        return None
    if choice == "same":
        return x
    dtype = np.dtype(x.dtype)
    if choice == "fresh":
        return fake_array(dice, x.shape, dtype)
    if choice == "overlap":
        return fake_array(dice, x.shape, dtype, strides=_strides_el(x), at=_ptr(x) + dice.int(1, 9) * dtype.itemsize,
                          kind=_same_place_kind(dtype), shift=0)
    if choice == "other_view":
        return fake_array(dice, x.shape, dtype, at=_ptr(x), kind=_same_place_kind(dtype), shift=0)
    if choice == "wrong_dtype":
        return fake_array(dice, x.shape, [d for d in FLOATS if d != dtype][0])
    return fake_array(dice, tuple(x.shape[:-1]) + (x.shape[-1] + 2,), dtype)


def draw_window(dice, d):
    """(rotary_dim, rotary_offset): None/0 or an even window inside the head; with chaos, anything."""
    if dice.bad():
        return dice.pick([None, dice.int(-2, d + 3)]), dice.pick([0, dice.int(-1, d)])
    if dice.one_in(2):
        return None, 0
    r = 2 * dice.int(1, d // 2)
    return r, 2 * dice.int(0, (d - r) // 2)


def draw_general_case(data, *, with_k, paired=False):
    chaos = data.draw(CHAOS, label="chaos")
    dice = Dice(data.draw(st.integers(0, 2**32 - 1), label="seed"), chaos)
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    b, s = data.draw(SIZES, label="B"), data.draw(SIZES, label="S")
    h = data.draw(SIZES, label="H")
    d = data.draw(st.sampled_from([2, 4, 6, 8, 10, 16, 24, 32, 64, 66, 128]), label="D")
    scheme = data.draw(st.sampled_from(["default", "int", "offsets", "positions", "cu_seqlens"]), label="positions")
    interleaved = data.draw(st.booleans(), label="interleaved")

    if dice.bad():
        dtype = dice.pick([np.dtype(np.float64), np.dtype(np.int32)])
    lay = layout
    if dice.bad():
        layout = dice.pick(["bsdh", "BSHD", "thd" if layout != "thd" else "bshd"])
    q = fake_array(dice, layout_shape(lay, b, s, h, d), dtype)
    k = None
    if with_k:
        kd = dice.pick([d_ for d_ in FLOATS if d_ != dtype] or [FLOATS[0]]) if dice.bad() else dtype
        k = fake_array(dice, layout_shape(lay, b, s + (1 if dice.bad() else 0), dice.int(0, 4), d), kd)
    rotary_dim, rotary_offset = draw_window(dice, d)
    r = d if rotary_dim is None else rotary_dim
    tokens = b * s if lay == "thd" else s
    offset = dice.int(0, 3) if scheme == "int" else 0
    rows = max(tokens + offset, 0) + dice.int(0, 3) - (dice.int(1, 3) if dice.bad() else 0)
    rows = max(rows, 0)
    cols = max(r // 2, 0) + (dice.pick([-1, 1]) if dice.bad() else 0)
    cols = max(cols, 0)
    table_strides = _strides(dice, (rows, cols))
    cos = fake_array(dice, (rows, cols), np.float64 if dice.bad() else np.float32, shift=_shift(dice, 4),
                     strides=table_strides)
    sin_shape = (rows + 1, cols) if dice.bad() else (rows, cols)
    # One row stride for both tables (the kernel takes one), unless this ingredient goes bad.
    sin = fake_array(dice, sin_shape, np.float32, shift=_shift(dice, 4),
                     strides=_strides(dice, sin_shape) if dice.bad() else table_strides)
    kw = dict(layout=layout, rotary_dim=rotary_dim, rotary_offset=rotary_offset,
              interleaved="yes" if dice.bad() else interleaved, inverse=1 if dice.bad() else dice.one_in(2))
    nseq = b if lay != "thd" else dice.int(0 if dice.bad() else 1, 3)
    tokens_shape = (b * s,) if lay == "thd" else (b, s)
    if scheme == "int":
        kw["offset"] = offset
    elif scheme == "offsets":
        kw["offset"] = draw_index(dice, ((1 if lay == "thd" else b) + (1 if dice.bad() else 0),))
    elif scheme == "positions":
        kw["positions"] = draw_index(dice, tokens_shape + ((1,) if dice.bad() else ()))
        if dice.bad():
            kw["offset"] = 1
    elif scheme == "cu_seqlens":
        if lay != "thd" and not dice.bad():
            kw["layout"] = layout = "thd"
            q = fake_array(dice, layout_shape("thd", b, s, h, d), dtype)
            k = fake_array(dice, layout_shape("thd", b, s, dice.int(0, 4), d), dtype) if with_k else None
            nseq = max(b, 1)
        kw["cu_seqlens"] = draw_index(dice, (nseq + 1,))
        if dice.one_in(2):
            kw["offset"] = draw_index(dice, (nseq,))
        if dice.bad():
            kw["positions"] = draw_index(dice, (b * s,))
    if paired and not dice.bad():  # a plan rotates both in place or writes both elsewhere
        choice = dice.pick(["none", "same", "fresh"])
        out, k_out = draw_output(dice, q, choice=choice), draw_output(dice, k, choice=choice)
    else:
        out, k_out = draw_output(dice, q), draw_output(dice, k)
    if dice.bad():
        out = fake_array(dice, q.shape, np.dtype(q.dtype), at=_ptr(cos), kind=_same_place_kind(q.dtype), shift=0)
    if dice.bad():
        sin = FakeTorchTensor(sin_shape, np.float32)
    return q, k, cos, sin, out, k_out, kw, chaos


def _check_launches(gpu):
    for launch in gpu.launches:
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

@settings(FUZZ, max_examples=1500)
@given(st.data())
def test_fuzz_general_fake_arrays(data):
    api = data.draw(st.sampled_from(["apply_rope", "apply_rope_qk", "plan"]), label="api")
    q, k, cos, sin, out, k_out, kw, chaos = draw_general_case(data, with_k=api != "apply_rope", paired=api == "plan")
    with FakeGPU() as gpu:
        try:
            if api == "apply_rope":
                apply_rope(q, cos, sin, out=out, backend="nvrtc", **kw)
            elif api == "apply_rope_qk":
                apply_rope_qk(q, k, cos, sin, q_out=out, k_out=k_out, backend="nvrtc", **kw)
            else:
                plan = RopePlan(q, k, cos, sin, q_out=out, k_out=k_out, **kw)
                extra = {n: kw[n] for n in ("offset", "cu_seqlens") if n in kw}
                for _ in range(2):  # the second call takes the fast path
                    plan.execute(q, k, cos, sin, positions=kw.get("positions"), q_out=out, k_out=k_out, **extra)
        except CLEAR_ERRORS as exc:
            outcome = _check_clear(exc)
            if api != "plan":
                assert gpu.launches == []
            if chaos == 0:
                raise AssertionError(f"a valid case was rejected: {exc}") from exc
        else:
            outcome = "launched" if gpu.launches else "accepted, nothing to launch"
        _check_launches(gpu)
    COUNTS["general/fake"][outcome] += 1


def draw_tail_case(data):
    chaos = data.draw(CHAOS, label="chaos")
    dice = Dice(data.draw(st.integers(0, 2**32 - 1), label="seed"), chaos)
    rank = data.draw(st.sampled_from([2, 3]), label="rank")
    t = data.draw(st.sampled_from([0, 1, 2, 3, 5, 17, 4096]), label="T")
    h = data.draw(st.sampled_from([1, 2, 3, 64]), label="H")
    d = data.draw(st.sampled_from([128, 512]), label="D")
    if dice.bad():
        rank = dice.pick([1, 4])
    if dice.bad():
        h = 0
    if dice.bad():
        d = dice.pick([64, 256, 130])
    xdt = dice.pick([np.dtype(np.float16), np.dtype(np.float32)]) if dice.bad() else BF16
    shape = {1: (d,), 2: (t, d), 3: (t, h, d), 4: (t, h, 1, d)}[rank]

    def tail_array(shape, dtype):
        dtype = np.dtype(dtype)
        contiguous = not dice.bad()
        return fake_array(dice, shape, dtype, strides=_strides(dice, shape, contiguous=contiguous),
                          shift=_shift(dice, 16), kind=_same_place_kind(dtype) if contiguous else None)

    x = tail_array(shape, xdt)
    cosine = tail_array((t + 1, 32) if dice.bad() else (t, 32), np.float64 if dice.bad() else np.float32)
    sine = tail_array((t, dice.pick([16, 64])) if dice.bad() else (t, 32), np.float32)
    where = dice.pick(["x", "overlap_x", "cosine", "sine"]) if dice.bad() else "fresh"
    if where == "fresh":
        out = tail_array(shape, xdt)
    elif where == "x":
        out = x
    else:
        target = {"overlap_x": x, "cosine": cosine, "sine": sine}[where]
        out = fake_array(dice, shape, xdt, at=_ptr(target) + (32 if where == "overlap_x" else 0), shift=0,
                         strides=_strides(dice, shape, contiguous=True), kind=_same_place_kind(xdt))
    return dice, x, cosine, sine, out


@settings(FUZZ, max_examples=800)
@given(st.data())
def test_fuzz_tail_fake_arrays(data):
    dice, x, cosine, sine, out = draw_tail_case(data)
    as_descs = data.draw(st.booleans(), label="declared with TensorDesc")
    t2 = data.draw(st.sampled_from([None, None, 0, 1, 7, 300]), label="T at a second execute")
    cons = [TensorDesc(np.dtype(a.dtype), a.shape, _strides_el(a)) for a in (x, cosine, sine, out)] if as_descs \
        else [x, cosine, sine, out]
    if dice.bad():
        cons[dice.int(0, 3)] = FakeTorchTensor((1, 32), np.float32)
    backend = dice.pick(["frost", "numpy", "auto"]) if dice.bad() else "nvrtc"
    with FakeGPU() as gpu:
        try:
            plan = TailRoPEForward(*cons, backend=backend).check_support().compile()
            assert plan.scratch_workspace_bytes() == 0
            assert plan.execute(x, cosine, sine, out)["out"] is out
            if gpu.launches:  # the argument block of that launch (a second execute rewrites it)
                v = _block(plan)
                assert v.n > 0 and v.x % 16 == 0 and v.out % 16 == 0 and v.cos % 16 == 0 and v.sin % 16 == 0
            if t2 is not None:
                shape2 = (t2,) + tuple(x.shape[1:])
                x2, o2 = fake_cupy(shape2, BF16), fake_cupy(shape2, BF16)
                c2, s2 = FakeDeviceArray((t2, 32), np.float32), FakeDeviceArray((t2, 32), np.float32)
                assert plan.execute(x2, c2, s2, o2)["out"] is o2
        except CLEAR_ERRORS as exc:
            outcome = _check_clear(exc)
            if dice.chaos == 0:
                raise AssertionError(f"a valid case was rejected: {exc}") from exc
        else:
            outcome = "launched" if gpu.launches else "accepted, nothing to launch"
        _check_launches(gpu)
    COUNTS["tail/fake"][outcome] += 1


# ---------------------------------------------------------------------------------------------
# (b) the NumPy backend on real arrays: the reference's answer, or a clear error and no write

def _host_array(dice, shape, dtype, rng, *, contiguous=False):
    """A real NumPy array, random values, as a view into a padded buffer (with chaos, sometimes a
    strided last axis)."""
    dtype = np.dtype(dtype)
    strided_last = not contiguous and len(shape) and shape[-1] > 1 and dice.bad()
    big = tuple(d + (0 if contiguous else dice.pick([0, 0, 0, 1, 3])) for d in shape)
    if strided_last:
        big = tuple(shape[:-1]) + (2 * shape[-1],)
    if dtype.kind in "iu":
        buf = rng.integers(-2, 8, size=big).astype(dtype)
    else:
        buf = (rng.standard_normal(big) * 4).astype(np.float32).astype(dtype)
    if strided_last:
        return buf[..., ::2]
    return buf[tuple(slice(0, d) for d in shape)]


def _positions_for(layout, b, s, kw):
    """Per-token positions [B*S] for an accepted call, computed here (not by the library)."""
    n = b * s
    if layout == "thd":  # one packed sequence of all tokens
        b, s = 1, n
    if "positions" in kw:
        return np.asarray(kw["positions"]).reshape(-1).astype(np.int64)
    off = kw.get("offset", 0)
    if "cu_seqlens" in kw:
        cu = np.asarray(kw["cu_seqlens"]).astype(np.int64)
        pos = np.full(n, -1, np.int64)
        for j in range(len(cu) - 1):
            base = int(off[j]) if isinstance(off, np.ndarray) else int(off)
            for t in range(max(cu[j], 0), min(cu[j + 1], n)):
                if cu[0] <= t < cu[-1]:
                    pos[t] = t - cu[j] + base
        return pos
    if isinstance(off, np.ndarray):
        return (off.astype(np.int64)[:, None] + np.arange(s)[None, :]).reshape(-1)
    return np.broadcast_to(int(off) + np.arange(s), (b, s)).reshape(-1)


@settings(FUZZ, max_examples=1000)
@given(st.data())
def test_fuzz_general_numpy_backend(data):
    chaos = data.draw(CHAOS, label="chaos")
    dice = Dice(data.draw(st.integers(0, 2**32 - 1), label="seed"), chaos)
    rng = dice.rng
    api = data.draw(st.sampled_from(["apply_rope", "apply_rope_qk"]), label="api")
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    b, s, h = data.draw(SIZES, label="B"), data.draw(SIZES, label="S"), data.draw(SIZES, label="H")
    d = data.draw(st.sampled_from([2, 4, 6, 8, 12, 16]), label="D")
    scheme = data.draw(st.sampled_from(["default", "int", "offsets", "positions", "cu_seqlens"]), label="scheme")
    out_kind = data.draw(st.sampled_from(["none", "same", "fresh"]), label="out")
    if dice.bad():
        dtype = np.dtype(np.float64)
    lay = layout
    if dice.bad():
        layout = dice.pick(["bsdh", "thd" if layout != "thd" else "bshd"])
    if scheme == "cu_seqlens" and not dice.bad():
        layout = lay = "thd"
    x = _host_array(dice, layout_shape(lay, b, s, h, d), dtype, rng)
    k = _host_array(dice, layout_shape(lay, b, s, dice.int(0, 3), d), dtype, rng) if api == "apply_rope_qk" else None
    rotary_dim, rotary_offset = draw_window(dice, d)
    r = d if rotary_dim is None else rotary_dim
    tokens = b * s if lay == "thd" else s
    offset = dice.int(0, 3) if scheme == "int" else 0
    rows = max(max(tokens + offset, 0) + dice.int(0, 3) - (dice.int(1, 3) if dice.bad() else 0), 0)
    cols = max(max(r // 2, 0) + (dice.pick([-1, 1]) if dice.bad() else 0), 0)
    # Padded tables must share one row stride (the kernel takes one): contiguous unless chaos.
    cos = _host_array(dice, (rows, cols), np.float16 if dice.bad() else np.float32, rng, contiguous=not dice.bad())
    sin = _host_array(dice, (rows, cols), np.float32, rng, contiguous=not dice.bad())
    kw = dict(layout=layout, rotary_dim=rotary_dim, rotary_offset=rotary_offset, interleaved=dice.one_in(2),
              inverse=dice.one_in(2))
    nseq = b if lay != "thd" else dice.int(0 if dice.bad() else 1, 3)
    tokens_shape = (b * s,) if lay == "thd" else (b, s)
    if scheme == "int":
        kw["offset"] = offset - (dice.int(1, 2) if dice.bad() else 0)
    elif scheme == "offsets":  # starts that keep every position in the table, unless this goes bad
        hi = rows + 1 if dice.bad() else max(rows - tokens, 0)
        size = (1 if lay == "thd" else b) + (1 if dice.bad() else 0)
        kw["offset"] = rng.integers(-1 if dice.bad() else 0, hi + 1, size=size).astype(_index_dtype(dice))
    elif scheme == "positions":
        lo, hi = (-1, rows + 1) if dice.bad() else (0, max(rows, 1))
        kw["positions"] = rng.integers(lo, hi, size=tokens_shape + ((1,) if dice.bad() else ())).astype(
            _index_dtype(dice))
        if dice.bad():
            kw["offset"] = 2
    elif scheme == "cu_seqlens":
        cu = np.sort(rng.integers(0, b * s + 1, size=nseq + 1))
        if not dice.bad():  # boundaries from 0 to the token count
            cu[0], cu[-1] = 0, b * s
        kw["cu_seqlens"] = cu.astype(_index_dtype(dice))
        if dice.one_in(2):
            hi = 3 if dice.bad() else max(rows - b * s, 0) + 1
            kw["offset"] = rng.integers(0, hi, size=nseq).astype(np.int32)
    if dice.bad():
        out_kind = dice.pick(["overlap", "readonly", "broadcast", "wrong_dtype"])
    if out_kind == "none":
        out = None
    elif out_kind == "same":
        out = x
    elif out_kind == "fresh":
        out = np.full(x.shape, np.nan, dtype)
    elif out_kind == "overlap" and x.size > 1:
        flat = np.zeros(x.size + 3, dtype)
        out = flat[1 : 1 + x.size].reshape(x.shape)
        x = flat[: x.size].reshape(x.shape)  # out shares all but one element with x
        x[...] = rng.standard_normal(x.shape).astype(np.float32).astype(dtype)
    elif out_kind == "readonly":
        out = np.zeros(x.shape, dtype)
        out.flags.writeable = False
    elif out_kind == "wrong_dtype":
        out = np.zeros(x.shape, np.float32 if dtype != np.float32 else np.float16)
    else:  # writable, and every row of it is the same memory
        out = np.lib.stride_tricks.as_strided(np.zeros(x.shape[-1:], dtype), x.shape,
                                              (0,) * (x.ndim - 1) + (dtype.itemsize,))
    k_out = k if k is not None and dice.one_in(2) else None
    saved = [(a, bits(a).copy()) for a in (x, k, cos, sin, out, k_out) if isinstance(a, np.ndarray)]
    try:
        if api == "apply_rope":
            got, got_k = apply_rope(x, cos, sin, out=out, backend="numpy", **kw), None
        else:
            got, got_k = apply_rope_qk(x, k, cos, sin, q_out=out, k_out=k_out, backend="numpy", **kw)
    except CLEAR_ERRORS as exc:
        outcome = _check_clear(exc)
        for a, saved_bits in saved:  # nothing written: inputs, and the in-place output
            np.testing.assert_array_equal(bits(a), saved_bits)
        if chaos == 0:
            raise AssertionError(f"a valid case was rejected: {exc}") from exc
    else:
        outcome = "ok"
        pos = _positions_for(lay, b, s, kw)
        for arr, res, own_out in ((x, got, out), (k, got_k, k_out)):
            if arr is None:
                continue
            before = next(saved_bits for a, saved_bits in saved if a is arr).view(arr.dtype).reshape(arr.shape)
            want = round_to_dtype(rope_reference(token_rows(before, lay), cos, sin, pos, interleaved=kw["interleaved"],
                                                 rotary_dim=rotary_dim, rotary_offset=rotary_offset,
                                                 inverse=kw["inverse"]), arr.dtype)
            np.testing.assert_array_equal(bits(token_rows(res, lay)), bits(want))
            if own_out is not None:
                assert res is own_out
            if own_out is not arr:  # out of place: the input is untouched
                np.testing.assert_array_equal(bits(arr), bits(before))
    COUNTS["general/numpy"][outcome] += 1


@settings(FUZZ, max_examples=400)
@given(st.data())
def test_fuzz_tail_numpy_backend(data):
    chaos = data.draw(CHAOS, label="chaos")
    dice = Dice(data.draw(st.integers(0, 2**32 - 1), label="seed"), chaos)
    rng = dice.rng
    rank = data.draw(st.sampled_from([2, 3]), label="rank")
    t = data.draw(st.sampled_from([0, 1, 2, 5, 9]), label="T")
    h = data.draw(st.sampled_from([1, 2, 3]), label="H")
    d = data.draw(st.sampled_from([128, 512]), label="D")
    one_call = data.draw(st.booleans(), label="one call")
    if dice.bad():
        rank = 1
    if dice.bad():
        h = 0
    if dice.bad():
        d = 256
    shape = {1: (d,), 2: (t, d), 3: (t, h, d)}[rank]
    xdt = np.dtype(np.float16) if dice.bad() else BF16
    x = _host_array(dice, shape, xdt, rng, contiguous=not dice.bad())
    cosine = np.cos(rng.uniform(-50, 50, (t, 31) if dice.bad() else (t, 32))).astype(np.float32)
    sine = np.sin(rng.uniform(-50, 50, (t, 32))).astype(np.float32) * (-1 if dice.one_in(4) else 1)
    out_kind = dice.pick(["x", "overlap", "cosine"]) if dice.bad() else "fresh"
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
        out = cosine.view(xdt).reshape(-1)[: x.size]  # the table's bytes as the output
    saved = [(a, bits(a).copy()) for a in (x, cosine, sine)]
    try:
        if one_call:
            result = tail_rope(x, cosine, sine, backend="numpy")
        else:
            result = TailRoPEForward(x, cosine, sine, out, backend="numpy").execute(x, cosine, sine, out)
    except CLEAR_ERRORS as exc:
        outcome = _check_clear(exc)
        if chaos == 0:
            raise AssertionError(f"a valid case was rejected: {exc}") from exc
    else:
        outcome = "ok"
        np.testing.assert_array_equal(bits(result["out"]), bits(tail_rope_reference(x, cosine, sine)))
    for a, saved_bits in saved:  # inputs are never written, whatever happened
        np.testing.assert_array_equal(bits(a), saved_bits)
    COUNTS["tail/numpy"][outcome] += 1


# ---------------------------------------------------------------------------------------------
# (c) prepared plans re-use validation per argument signature (all-CuPy arguments): a re-used
#     validation must decide exactly as full validation would, for every new placement of the
#     arrays (aligned, misaligned, landing on another argument's bytes).


def _block(plan):
    """The plan's kernel-argument block (a ctypes structure)."""
    core = getattr(plan, "_core", None)
    return core.block if core is not None else plan._args.values


def _params_bytes(plan) -> bytes:
    import ctypes

    v = _block(plan)
    return ctypes.string_at(ctypes.addressof(v), ctypes.sizeof(v))


def _outcome(gpu, call, plan):
    """('raised', type, message) or ('launched'/'nothing', launch, argument bytes) of one execute."""
    n = len(gpu.launches)
    try:
        call()
    except CLEAR_ERRORS as exc:
        _check_clear(exc)
        assert len(gpu.launches) == n
        return ("raised", type(exc).__name__, str(exc))
    if len(gpu.launches) == n:
        return ("nothing",)
    launch = gpu.launches[-1]
    return ("launched", launch["fn"], launch["grid"], launch["block"], _params_bytes(plan))


def _count_full_validations(plan) -> list:
    """Counts the plan's full validations (its prepared core's op.validate, or its _full_prepare),
    to see which calls re-used one."""
    calls = []
    core = getattr(plan, "_core", None)
    owner, name = (core.op, "validate") if core is not None else (plan, "_full_prepare")
    inner = getattr(owner, name, None)
    if inner is not None:
        def counted(*args, **kwargs):
            calls.append(1)
            return inner(*args, **kwargs)

        setattr(owner, name, counted)
    return calls


def _relocated(dice, a, others):
    """``a``'s shape, strides and dtype at a new address: aligned, or (with chaos) shifted by a few
    bytes or laid over another argument's bytes."""
    dtype = np.dtype(a.dtype)
    roll = dice.rng.random()
    if roll < dice.chaos / 2 and others:
        at, shift = _ptr(dice.pick(others)) + dice.int(0, 3) * 16 + dice.pick([0, 0, dtype.itemsize]), 0
    elif roll < dice.chaos:
        at, shift = None, dice.pick([1, 2, 4, 6, 8, 12])
    else:
        at, shift = None, dice.pick([0, 16, 32, 48])
    return fake_array(dice, a.shape, dtype, kind="cupy", strides=_strides_el(a), at=at, shift=shift)


@settings(FUZZ, max_examples=500)
@given(st.data())
def test_fuzz_plan_revalidation_matches_full_validation(data):
    first = Dice(data.draw(st.integers(0, 2**32 - 1), label="seed"), 0.0)
    dice = Dice(data.draw(st.integers(0, 2**32 - 1), label="seed 2"), data.draw(RELOCATION_CHAOS, label="chaos"))
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    b, s, h = data.draw(SIZES, label="B"), data.draw(SIZES, label="S"), data.draw(SIZES, label="H")
    d = data.draw(st.sampled_from([2, 8, 16, 64, 66]), label="D")
    scheme = data.draw(st.sampled_from(["default", "int", "offsets", "positions", "cu_seqlens"]), label="scheme")
    mode = data.draw(st.sampled_from(["in_place", "out_of_place"]), label="outputs")
    interleaved = data.draw(st.booleans(), label="interleaved")
    if scheme == "cu_seqlens":
        layout = "thd"
    q = fake_array(first, layout_shape(layout, b, s, h, d), dtype, kind="cupy", shift=0)
    k = fake_array(first, layout_shape(layout, b, s, first.int(0, 3), d), dtype, kind="cupy", shift=0)
    rotary_dim, rotary_offset = draw_window(first, d)
    r = d if rotary_dim is None else rotary_dim
    tokens = b * s if layout == "thd" else s
    rows = tokens + 3 + first.int(0, 3)
    strides = _strides(first, (rows, r // 2))
    cos = fake_array(first, (rows, r // 2), np.float32, kind="cupy", strides=strides, shift=0)
    sin = fake_array(first, (rows, r // 2), np.float32, kind="cupy", strides=strides, shift=0)

    def index(shape):
        return fake_array(first, shape, first.pick([np.int32, np.int64]), kind="cupy",
                          strides=_strides(first, shape, contiguous=True), shift=0)

    kw = {}
    if scheme == "int":
        kw["offset"] = first.int(0, 3)
    elif scheme == "offsets":
        kw["offset"] = index((1 if layout == "thd" else b,))
    elif scheme == "positions":
        kw["positions"] = index((b * s,) if layout == "thd" else (b, s))
    elif scheme == "cu_seqlens":
        kw["cu_seqlens"] = index((first.int(1, 3) + 1,))
    q_out = k_out = None
    if mode == "out_of_place":
        q_out = fake_array(first, q.shape, dtype, kind="cupy", shift=0)
        k_out = fake_array(first, k.shape, dtype, kind="cupy", shift=0)
    opts = dict(layout=layout, interleaved=interleaved, rotary_dim=rotary_dim, rotary_offset=rotary_offset)

    def execute(plan, q, k, cos, sin, q_out, k_out, kw):
        return plan.execute(q, k, cos, sin, positions=kw.get("positions"), q_out=q_out, k_out=k_out,
                            offset=kw.get("offset"), cu_seqlens=kw.get("cu_seqlens"))

    with FakeGPU() as gpu:
        warm = RopePlan(q, k, cos, sin, q_out=q_out, k_out=k_out, **opts, **kw)
        first_outcome = _outcome(gpu, lambda: execute(warm, q, k, cos, sin, q_out, k_out, kw), warm)
        assert first_outcome[0] != "raised", f"a valid case was rejected: {first_outcome}"
        # New arrays of the same signature (the plan's template applies), placed anew.
        args = {"q": q, "k": k, "cos": cos, "sin": sin, **{n: v for n, v in kw.items() if not isinstance(v, int)}}
        if mode == "out_of_place":
            args.update(q_out=q_out, k_out=k_out)
        moved = {}
        for name, a in args.items():
            moved[name] = _relocated(dice, a, list(moved.values()))
        kw2 = {n: moved.get(n, v) for n, v in kw.items()}
        if "offset" in kw2 and isinstance(kw2["offset"], int):
            kw2["offset"] = dice.int(-1, 5) if dice.bad() else dice.int(0, 3)
        elif "positions" in kw2 and dice.bad():
            kw2["offset"] = dice.int(1, 3)  # not allowed with positions
        new = (moved["q"], moved["k"], moved["cos"], moved["sin"], moved.get("q_out"), moved.get("k_out"), kw2)
        full_validations = _count_full_validations(warm)
        reused = _outcome(gpu, lambda: execute(warm, *new), warm)
        fresh = RopePlan(q, k, cos, sin, q_out=q_out, k_out=k_out, **opts, **kw)
        full = _outcome(gpu, lambda: execute(fresh, *new), fresh)
        assert reused == full
        _check_launches(gpu)
    COUNTS["plan/revalidation"][reused[0] + ("" if full_validations else ", validation re-used")] += 1


@settings(FUZZ, max_examples=300)
@given(st.data())
def test_fuzz_tail_revalidation_matches_full_validation(data):
    first = Dice(data.draw(st.integers(0, 2**32 - 1), label="seed"), 0.0)
    dice = Dice(data.draw(st.integers(0, 2**32 - 1), label="seed 2"), data.draw(RELOCATION_CHAOS, label="chaos"))
    t = data.draw(st.sampled_from([0, 1, 3, 17]), label="T")
    h = data.draw(st.sampled_from([1, 2, 3]), label="H")
    d = data.draw(st.sampled_from([128, 512]), label="D")
    shape = (t, h, d)

    def contiguous(shape, dtype, dice_):
        return fake_array(dice_, shape, dtype, kind="cupy", strides=_strides(dice_, shape, contiguous=True),
                          shift=0)

    x, c = contiguous(shape, BF16, first), contiguous((t, 32), np.float32, first)
    s_, o = contiguous((t, 32), np.float32, first), contiguous(shape, BF16, first)
    with FakeGPU() as gpu:
        warm = TailRoPEForward(x, c, s_, o)
        first_outcome = _outcome(gpu, lambda: warm.execute(x, c, s_, o), warm)
        assert first_outcome[0] != "raised", f"a valid case was rejected: {first_outcome}"
        moved = {}
        for name, a in (("x", x), ("cosine", c), ("sine", s_), ("out", o)):
            moved[name] = _relocated(dice, a, list(moved.values()))
        new = (moved["x"], moved["cosine"], moved["sine"], moved["out"])
        full_validations = _count_full_validations(warm)
        reused = _outcome(gpu, lambda: warm.execute(*new), warm)
        fresh = TailRoPEForward(x, c, s_, o)
        full = _outcome(gpu, lambda: fresh.execute(*new), fresh)
        assert reused == full
        _check_launches(gpu)
    COUNTS["tail/revalidation"][reused[0] + ("" if full_validations else ", validation re-used")] += 1


# ---------------------------------------------------------------------------------------------
# (d) hostile input on the NumPy backend: 0-d arrays, non-native byte order, huge and
#     non-finite scalars, huge positions, non-finite data and tables, non-finite scaling
#     parameters. A plain loop over one seeded generator (a hypothesis draw per case would cost
#     more than the call): tens of thousands of cases in seconds. Every call either equals the
#     reference or raises a documented error, and no input (nor an in-place output) changes on
#     an error. Failures are collected per class, with the first reproducer of each, and
#     reported together.

ALLOWED_ERRORS = CLEAR_ERRORS + (RopeRtcError,)
HOSTILE_GENERAL_CASES = 12000
HOSTILE_TAIL_CASES = 2500
HOSTILE_TABLE_CASES = 3000

HUGE = 10**30
HOSTILE_SCALARS = [2**63, 2**63 - 1, -(2**63) - 1, 2**64, HUGE, -HUGE, 2**31, 2**31 - 1, -(2**31), -1,
                   np.int64(2**63 - 1), np.int64(-(2**63)), np.uint64(2**64 - 1), np.int32(-1),
                   math.nan, math.inf, -math.inf, np.float64(math.nan), 1e308, 2.0, True, np.bool_(True),
                   "1", None, np.array(3), np.array([1, 2])]
HOSTILE_INDICES = [2**62, 2**63 - 1, -(2**63), 2**31, 2**32, -1, -(2**31)]
NONFINITE = [math.nan, math.inf, -math.inf]
ARRAY_SLOTS = {"apply_rope": ("x", "cos", "sin", "out", "positions", "offset", "cu_seqlens"),
               "apply_rope_qk": ("q", "k", "cos", "sin", "q_out", "k_out", "positions", "offset", "cu_seqlens")}
MUTATIONS = ("none", "0-d array", "byte order", "byte order, in place", "hostile scalar", "hostile scalar, B=0",
             "huge index", "non-finite data", "non-finite table")


def _swapped(a: np.ndarray) -> np.ndarray:
    """The same values in the other byte order (a new array)."""
    return a.astype(a.dtype.newbyteorder("S"))


def _native(a):
    if isinstance(a, np.ndarray) and not a.dtype.isnative and a.dtype.kind in "iuf":
        return a.astype(a.dtype.newbyteorder("="))
    return a


def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"ndarray{value.shape}<{value.dtype.str if value.dtype.kind != 'V' else value.dtype}>"
    text = repr(value)
    return text if len(text) < 40 else text[:37] + "..."


class Tally:
    """Outcome counts, and the first reproducer of each class of failure."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts: collections.Counter = collections.Counter()
        self.failures: dict[str, tuple[int, str]] = {}

    def fail(self, klass: str, reproducer: str) -> None:
        n, first = self.failures.get(klass, (0, reproducer))
        self.failures[klass] = (n + 1, first)
        self.failed_case = True

    def start(self) -> None:
        self.failed_case = False

    def end(self, outcome: str) -> None:
        """Counts the case once: as FAILED if any check failed, else as its outcome."""
        self.counts["FAILED" if self.failed_case else outcome] += 1

    def report(self) -> None:
        COUNTS[self.name].update(self.counts)
        total = sum(self.counts.values())
        print(f"\n{self.name}: {total} cases ({', '.join(f'{k} {v}' for k, v in sorted(self.counts.items()))})")
        if self.failures:
            lines = [f"  {klass}: {n} case(s), e.g. {first}" for klass, (n, first) in sorted(self.failures.items())]
            print("\n".join(lines))
            pytest.fail(f"{self.name}: {len(self.failures)} class(es) of failure:\n" + "\n".join(lines),
                        pytrace=False)


def _hostile_general_case(rng, api):
    """A valid call of `api` on host arrays, as (call kwargs, layout, B, S)."""
    dice = Dice(int(rng.integers(2**32)), 0.0)
    dtype = dice.pick(FLOATS)
    layout = dice.pick(LAYOUTS)
    b, s, h = dice.pick([0, 1, 1, 2, 3]), dice.pick([0, 1, 2, 3]), dice.pick([1, 1, 2, 3])
    d = dice.pick([2, 4, 8, 16])
    scheme = dice.pick(["default", "int", "offsets", "positions", "cu_seqlens"])
    if scheme == "cu_seqlens":
        layout = "thd"
    x = _host_array(dice, layout_shape(layout, b, s, h, d), dtype, dice.rng)
    rotary_dim, rotary_offset = draw_window(dice, d)
    r = d if rotary_dim is None else rotary_dim
    tokens = b * s if layout == "thd" else s
    rows = tokens + 3 + dice.int(1, 3)
    cos = _host_array(dice, (rows, r // 2), np.float32, dice.rng, contiguous=True)
    sin = _host_array(dice, (rows, r // 2), np.float32, dice.rng, contiguous=True)
    call = dict(cos=cos, sin=sin, layout=layout, rotary_dim=rotary_dim, rotary_offset=rotary_offset,
                interleaved=dice.one_in(2), inverse=dice.one_in(2))
    index = dice.pick([np.int32, np.int64])
    if scheme == "int":
        call["offset"] = dice.int(0, 3)
    elif scheme == "offsets":
        call["offset"] = dice.rng.integers(0, 4, size=1 if layout == "thd" else b).astype(index)
    elif scheme == "positions":
        call["positions"] = dice.rng.integers(0, rows, size=(b * s,) if layout == "thd" else (b, s)).astype(index)
    elif scheme == "cu_seqlens":
        nseq = dice.int(1, 3)
        cu = np.sort(dice.rng.integers(0, b * s + 1, size=nseq + 1))
        cu[0], cu[-1] = 0, b * s
        call["cu_seqlens"] = cu.astype(index)
        if dice.one_in(2):
            call["offset"] = dice.rng.integers(0, 4, size=nseq).astype(index)
    out_kind = dice.pick(["none", "same", "fresh"])
    outs = {"none": None, "same": x, "fresh": np.full(x.shape, np.nan, dtype)}
    if api == "apply_rope":
        call.update(x=x, out=outs[out_kind])
    else:
        k = _host_array(dice, layout_shape(layout, b, s, dice.int(1, 3), d), dtype, dice.rng)
        k_kind = dice.pick(["none", "same", "fresh"])
        call.update(q=x, k=k, q_out=outs[out_kind],
                    k_out={"none": None, "same": k, "fresh": np.full(k.shape, np.nan, dtype)}[k_kind])
    return call, layout, b, s


def _mutate_general(rng, api, call, mutation):
    """Applies one hostile mutation in place; returns a short description of it."""
    dice = Dice(int(rng.integers(2**32)), 0.0)
    q_name, out_name = ("x", "out") if api == "apply_rope" else ("q", "q_out")
    if mutation == "0-d array":
        name = dice.pick(ARRAY_SLOTS[api])
        dtype = {"positions": np.int64, "offset": np.int32, "cu_seqlens": np.int64}.get(name)
        dtype = dtype or (np.float32 if name in ("cos", "sin") else call[q_name].dtype)
        call[name] = np.array(1.5 if np.dtype(dtype).kind == "f" else 1).astype(dtype)
        return f"{name}=0-d {np.dtype(dtype)}"
    if mutation.startswith("byte order"):
        present = [n for n in ARRAY_SLOTS[api] if isinstance(call.get(n), np.ndarray)
                   and call[n].dtype.kind in "iuf"]
        if mutation.endswith("in place"):  # the case: q_out=q, k_out=k, one of them swapped
            for a, o in ((q_name, out_name), ("k", "k_out")):
                if a in call:
                    call[o] = call[a]
            present = [n for n in (q_name, "k") if n in call and call[n].dtype.kind == "f"]
        if not present:
            return "nothing to swap"
        names = [dice.pick(present)] if dice.one_in(3) or len(present) == 1 else \
            list(dice.rng.choice(present, size=dice.int(1, len(present)), replace=False))
        for name in names:
            old = call[name]
            new = _swapped(old)
            for slot in list(call):  # keep in-place outputs in place
                if call[slot] is old:
                    call[slot] = new
        return "swapped " + ", ".join(sorted(names))
    if mutation.startswith("hostile scalar"):
        name = dice.pick(["offset", "offset", "rotary_dim", "rotary_offset", "interleaved", "inverse"])
        value = dice.pick(HOSTILE_SCALARS)
        if name == "offset":
            call.pop("positions", None)
        call[name] = value
        return f"{name}={_describe(value)}"
    if mutation == "huge index":
        present = [n for n in ("positions", "offset", "cu_seqlens") if isinstance(call.get(n), np.ndarray)]
        if not present or not call[present[0]].size:
            call.pop("positions", None)
            call["offset"] = dice.pick(HOSTILE_INDICES)
            return f"offset={call['offset']}"
        name = dice.pick(present)
        a = call[name].astype(np.int64)
        a.reshape(-1)[dice.int(0, a.size - 1)] = dice.pick(HOSTILE_INDICES)
        call[name] = a
        return f"{name}={a.tolist()}"
    if mutation in ("non-finite data", "non-finite table"):
        names = ["cos", "sin"] if mutation == "non-finite table" else [n for n in (q_name, "k") if n in call]
        name = dice.pick(names)
        a = call[name]
        if a.size:
            a[tuple(dice.int(0, n - 1) for n in a.shape)] = dice.pick(NONFINITE)
        return f"{name} holds non-finite values"
    return "valid"


def _general_expected(api, call, layout, b, s, before):
    """(name, expected canonical result) of an accepted call, from native-order copies."""
    kw = {n: _native(v) for n, v in call.items() if n in ("positions", "offset", "cu_seqlens") and v is not None}
    with np.errstate(over="raise"):  # a position that wraps around int64 was accepted
        pos = _positions_for(layout, b, s, kw)
    rows = call["cos"].shape[0]
    outside = [int(p) for p in pos if not 0 <= p < rows and not ("cu_seqlens" in kw and p == -1)]
    if outside:
        raise ValueError(f"positions {outside[:3]} are outside the table's {rows} rows")
    rotary_dim = call["rotary_dim"]
    cos, sin = _native(call["cos"]), _native(call["sin"])
    pairs = [("x", "out")] if api == "apply_rope" else [("q", "q_out"), ("k", "k_out")]
    for name, _ in pairs:
        arr = _native(before[name])
        yield name, round_to_dtype(rope_reference(token_rows(arr, layout), cos, sin, pos,
                                                  interleaved=bool(call["interleaved"]), rotary_dim=rotary_dim,
                                                  rotary_offset=int(call["rotary_offset"]),
                                                  inverse=bool(call["inverse"])), arr.dtype)


def _repro(api, call, mutation, what) -> str:
    args = ", ".join(f"{n}={_describe(v)}" for n, v in call.items() if v is not None)
    inplace = [o for a, o in (("x", "out"), ("q", "q_out"), ("k", "k_out")) if o in call and call[o] is call.get(a)
               and call[o] is not None]
    return f"[{mutation}: {what}] {api}({args}{', in place: ' + '/'.join(inplace) if inplace else ''})"


def test_fuzz_hostile_numpy_backend():
    """apply_rope / apply_rope_qk on host arrays: the reference's answer or a documented error,
    and every input byte unchanged on an error."""
    rng = np.random.default_rng(20240613)
    tally = Tally("hostile/numpy")
    for _ in range(HOSTILE_GENERAL_CASES):
        tally.start()
        api = ("apply_rope", "apply_rope_qk")[int(rng.integers(2))]
        mutation = MUTATIONS[int(rng.integers(len(MUTATIONS)))]
        call, layout, b, s = _hostile_general_case(rng, api)
        if mutation == "hostile scalar, B=0":
            call, layout, b, s = _hostile_general_case(rng, api)
            while b * s and mutation:  # a case with no tokens: range checks must still run
                call, layout, b, s = _hostile_general_case(rng, api)
        what = _mutate_general(rng, api, call, mutation)
        arrays = {n: v for n, v in call.items() if isinstance(v, np.ndarray)}
        before = {n: v.copy() for n, v in arrays.items()}
        fn = apply_rope if api == "apply_rope" else apply_rope_qk
        try:
            result = fn(**call, backend="numpy")
        except ALLOWED_ERRORS as exc:
            if not _NAMED.match(str(exc)):
                tally.fail(f"{mutation}: {type(exc).__name__} names no argument",
                           _repro(api, call, mutation, what) + f" -> {exc}")
            changed = [n for n, a in arrays.items() if a.tobytes() != before[n].tobytes()]
            if changed:
                tally.fail(f"{mutation}: {type(exc).__name__} raised after writing {'/'.join(changed)}",
                           _repro(api, call, mutation, what) + f" -> {type(exc).__name__}: {exc}")
            if mutation == "none":
                tally.fail("valid case rejected", _repro(api, call, mutation, what) + f" -> {exc}")
            tally.end(type(exc).__name__)
            continue
        except Exception as exc:  # noqa: BLE001 - any other type is the failure this test is for
            changed = [n for n, a in arrays.items() if a.tobytes() != before[n].tobytes()]
            tally.fail(f"{mutation}: {type(exc).__name__}" + (f" after writing {'/'.join(changed)}" if changed else ""),
                       _repro(api, call, mutation, what) + f" -> {type(exc).__name__}: {exc}")
            tally.end(type(exc).__name__)
            continue
        results = {"x": result} if api == "apply_rope" else {"q": result[0], "k": result[1]}
        try:
            for name, want in _general_expected(api, call, layout, b, s, before):
                got = _native(results[name])
                if not np.array_equal(bits(token_rows(got, layout)), bits(want)):
                    tally.fail(f"{mutation}: accepted, result differs from the reference",
                               _repro(api, call, mutation, what))
                    break
        except Exception as exc:  # noqa: BLE001 - the reference cannot compute what was accepted
            tally.fail(f"{mutation}: accepted what the reference rejects ({type(exc).__name__})",
                       _repro(api, call, mutation, what) + f" -> {exc}")
            tally.end("ok")
            continue
        outputs = {call.get(o) is not None and id(call[o]) for o in ("out", "q_out", "k_out")}
        changed = [n for n, a in arrays.items() if id(a) not in outputs and a.tobytes() != before[n].tobytes()]
        if changed:
            tally.fail(f"{mutation}: accepted, and wrote its input {'/'.join(changed)}",
                       _repro(api, call, mutation, what))
        tally.end("ok")
    tally.report()


def test_fuzz_hostile_tail_numpy_backend():
    """tail_rope / TailRoPEForward on host arrays with 0-d arrays, swapped byte order, foreign
    dtypes and non-finite tables."""
    rng = np.random.default_rng(20240614)
    tally = Tally("hostile/tail")
    for _ in range(HOSTILE_TAIL_CASES):
        tally.start()
        dice = Dice(int(rng.integers(2**32)), 0.0)
        t, h, d = dice.pick([0, 1, 2, 5]), dice.pick([1, 2]), dice.pick([128, 512])
        x = _host_array(dice, (t, h, d) if dice.one_in(2) else (t, d), BF16, dice.rng, contiguous=True)
        cosine = np.cos(dice.rng.uniform(-50, 50, (t, 32))).astype(np.float32)
        sine = np.sin(dice.rng.uniform(-50, 50, (t, 32))).astype(np.float32)
        out = np.full(x.shape, np.nan, BF16)
        args = {"x": x, "cosine": cosine, "sine": sine, "out": out}
        mutation = dice.pick(["none", "0-d array", "byte order", "foreign dtype", "non-finite table"])
        name = dice.pick(["x", "cosine", "sine", "out"])
        if mutation == "0-d array":
            args[name] = np.array(1.5).astype(args[name].dtype)
        elif mutation == "byte order" and name in ("cosine", "sine"):
            args[name] = _swapped(args[name])
        elif mutation in ("byte order", "foreign dtype"):  # bfloat16 has no swapped dtype: raw 2-byte voids
            args[name] = args[name].view(np.dtype(dice.pick([">V2", "<V2", ">u2", ">f2"])))
        elif mutation == "non-finite table" and cosine.size:
            args[name if name in ("cosine", "sine") else "cosine"].reshape(-1)[dice.int(0, cosine.size - 1)] = \
                dice.pick(NONFINITE)
        what = f"{name}: {_describe(args[name])}"
        before = {n: v.copy() for n, v in args.items()}
        one_call = dice.one_in(2)
        repro = (f"[{mutation}: {what}] " + ("tail_rope" if one_call else "TailRoPEForward(...).execute")
                 + "(" + ", ".join(f"{n}={_describe(v)}" for n, v in args.items()) + ")")
        try:
            if one_call:
                got = tail_rope(args["x"], args["cosine"], args["sine"], backend="numpy")["out"]
            else:
                got = TailRoPEForward(*args.values(), backend="numpy").execute(*args.values())["out"]
        except ALLOWED_ERRORS as exc:
            if not _NAMED.match(str(exc)):
                tally.fail(f"{mutation}: {type(exc).__name__} names no argument", repro + f" -> {exc}")
            changed = [n for n, a in args.items() if a.tobytes() != before[n].tobytes()]
            if changed:
                tally.fail(f"{mutation}: raised after writing {'/'.join(changed)}", repro)
            if mutation == "none":
                tally.fail("valid case rejected", repro + f" -> {exc}")
            tally.end(type(exc).__name__)
            continue
        except Exception as exc:  # noqa: BLE001
            tally.fail(f"{mutation}: {type(exc).__name__}", repro + f" -> {type(exc).__name__}: {exc}")
            tally.end(type(exc).__name__)
            continue
        try:
            want = tail_rope_reference(before["x"], _native(before["cosine"]), _native(before["sine"]))
            same = np.array_equal(bits(np.asarray(got)), bits(want))
        except Exception as exc:  # noqa: BLE001
            tally.fail(f"{mutation}: accepted what the reference rejects ({type(exc).__name__})", repro)
            tally.end("ok")
            continue
        if not same:
            tally.fail(f"{mutation}: accepted, result differs from the reference", repro)
        changed = [n for n, a in args.items() if n != "out" and a.tobytes() != before[n].tobytes()]
        if changed:
            tally.fail(f"{mutation}: accepted, and wrote its input {'/'.join(changed)}", repro)
        tally.end("ok")
    tally.report()


_TABLE_SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": True},
    "yarn-attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                       "attention_factor": 1.2},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0] * 4,
                 "original_max_position_embeddings": 16, "factor": 4.0},
    "longrope-attention": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                           "original_max_position_embeddings": 16, "attention_factor": 0.9},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}
_HOSTILE_PARAMETERS = [1e-308, 5e-324, 1e-30, 1e30, 1e38, 1e308, math.nan, -math.nan, math.inf, -math.inf, -1, 0,
                       0.5, 2**63, HUGE, 10**400, [1, 2], "2", True, None, np.float64(math.nan), np.float32(1e-30),
                       np.int64(2**62)]
# Sizes that are invalid whatever the other one is (a valid huge size would allocate gigabytes).
_HOSTILE_ROWS = [0, -1, 2**31, 2**63, 2**64, HUGE, 1.5, True, "8", np.int64(2**40)]
_HOSTILE_DIMS = [0, -2, 7, 2**17, 2**63, HUGE, 8.0, None, np.int64(2**62)]


def test_fuzz_hostile_table_parameters():
    """rope_tables with hostile scaling parameters, bases and sizes, every rope_type, both
    numerics: a finite float32 table of the right shape, or a ValueError/TypeError naming the
    parameter; the scaling dict unchanged."""
    rng = np.random.default_rng(20240615)
    tally = Tally("hostile/tables")
    for _ in range(HOSTILE_TABLE_CASES):
        tally.start()
        dice = Dice(int(rng.integers(2**32)), 0.0)
        kind = dice.pick(sorted(_TABLE_SCALINGS))
        scaling = {k: (list(v) if isinstance(v, list) else v) for k, v in _TABLE_SCALINGS[kind].items()}
        numerics = dice.pick(["exact", "transformers"])
        rows, dim = dice.pick([1, 2, 10, 40]), 8
        call = dict(base=dice.pick([10000.0, 500000.0, 10.0]), scaling=scaling, numerics=numerics)
        target = dice.pick(["none", "scaling", "scaling", "scaling", "base", "max_positions", "rotary_dim"])
        value = dice.pick(_HOSTILE_PARAMETERS)
        if target == "scaling":
            key = dice.pick([k for k in scaling if k != "rope_type"] + ["rope_theta"])
            if key in ("short_factor", "long_factor") and not isinstance(value, list):
                lst = list(scaling[key])
                lst[dice.int(0, 3)] = value
                value = lst
            scaling[key] = value
            named = f"scaling['{key}']"
        elif target == "base":
            call["base"], named = value, "base"
        elif target == "max_positions":
            rows, named = dice.pick(_HOSTILE_ROWS), "max_positions"
        elif target == "rotary_dim":
            dim, named = dice.pick(_HOSTILE_DIMS), "rotary_dim"
        else:
            named = None
        frozen, outcome = repr(scaling), "ok"
        repro = f"[{target}] rope_tables({_describe(rows)}, {_describe(dim)}, " + \
            ", ".join(f"{n}={v!r}" for n, v in call.items()) + ")"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # an overflow met on the way
                cos, sin = rope_tables(rows, dim, **call)
        except (TypeError, ValueError) as exc:
            if named is None:
                tally.fail("valid table rejected", repro + f" -> {exc}")
            elif named not in str(exc) and not (target == "base" and "rope_theta" in scaling):
                tally.fail(f"{target}: {type(exc).__name__} does not name {named}", repro + f" -> {exc}")
            outcome = type(exc).__name__
        except Exception as exc:  # noqa: BLE001
            tally.fail(f"{target}: {type(exc).__name__}", repro + f" -> {type(exc).__name__}: {exc}")
        else:
            if not (cos.dtype == sin.dtype == np.float32 and cos.shape == sin.shape == (rows, dim // 2)):
                tally.fail(f"{target}: wrong table", repro + f" -> {cos.dtype} {cos.shape}")
            elif not (np.isfinite(cos).all() and np.isfinite(sin).all()):
                tally.fail(f"{target}: accepted, table not finite", repro)
        if repr(scaling) != frozen:
            tally.fail(f"{target}: scaling dict changed", repro)
        tally.end(outcome)
    tally.report()


def test_zz_report_case_counts():
    """Reports the cases tried (run with -s or -rP to see it); runs last in this module."""
    expected = {"general/fake", "tail/fake", "general/numpy", "tail/numpy", "plan/revalidation",
                "tail/revalidation", "hostile/numpy", "hostile/tail", "hostile/tables"}
    if set(COUNTS) != expected:
        pytest.skip("reports only when every fuzz test of the module ran")
    total = sum(sum(c.values()) for c in COUNTS.values())
    lines = [f"{name}: {sum(c.values())} cases ({', '.join(f'{k} {v}' for k, v in sorted(c.items()))})"
             for name, c in sorted(COUNTS.items())]
    print(f"\nfuzz cases tried: {total}\n" + "\n".join(lines))
    for name, c in COUNTS.items():
        accepted = sum(v for k, v in c.items() if k.split(",")[0] in ACCEPTED)
        assert accepted >= 0.2 * sum(c.values()), f"{name}: too few valid cases ({dict(c)})"
        assert sum(c.values()) - accepted >= 0.2 * sum(c.values()), f"{name}: too few invalid cases ({dict(c)})"
    assert total >= 20000, lines
