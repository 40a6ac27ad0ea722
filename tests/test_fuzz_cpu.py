"""Property-based tests of bad (and good) input, on a CPU (issue 6, item 1, CPU part).

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

Each case has a "chaos" level drawn first: the probability that any one ingredient (dtype,
window, stride, pointer shift, table, position array, output) is drawn from its invalid
choices. Chaos 0 gives valid cases (which must be accepted, except where noted), higher levels
mix several faults. Deterministic (``derandomize=True``, no example database); the number of
cases tried is counted per test and reported by the last test of the module.
"""

from __future__ import annotations

import collections
import re

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


def _layout_shape(layout, b, s, h, d):
    return {"bshd": (b, s, h, d), "bhsd": (b, h, s, d), "sbhd": (s, b, h, d), "thd": (b * s, h, d)}[layout]


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
    q = fake_array(dice, _layout_shape(lay, b, s, h, d), dtype)
    k = None
    if with_k:
        kd = dice.pick([d_ for d_ in FLOATS if d_ != dtype] or [FLOATS[0]]) if dice.bad() else dtype
        k = fake_array(dice, _layout_shape(lay, b, s + (1 if dice.bad() else 0), dice.int(0, 4), d), kd)
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
            q = fake_array(dice, _layout_shape("thd", b, s, h, d), dtype)
            k = fake_array(dice, _layout_shape("thd", b, s, dice.int(0, 4), d), dtype) if with_k else None
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
            if gpu.launches:
                v = plan._args.values
                assert v.n > 0 and v.x % 16 == 0 and v.out % 16 == 0 and v.cos % 16 == 0 and v.sin % 16 == 0
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


def _canon(a, layout):
    """[tokens, H, D] in (b, s) token order."""
    perm = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3), "thd": (0, 1, 2)}[layout]
    c = np.transpose(a, perm)
    return c.reshape(int(np.prod(c.shape[:-2])), c.shape[-2], c.shape[-1])


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


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
    x = _host_array(dice, _layout_shape(lay, b, s, h, d), dtype, rng)
    k = _host_array(dice, _layout_shape(lay, b, s, dice.int(0, 3), d), dtype, rng) if api == "apply_rope_qk" else None
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
    elif scheme == "offsets":
        kw["offset"] = rng.integers(-1, rows + 1, size=(1 if lay == "thd" else b) + (1 if dice.bad() else 0)).astype(
            _index_dtype(dice))
    elif scheme == "positions":
        kw["positions"] = rng.integers(-1, rows + 1, size=tokens_shape + ((1,) if dice.bad() else ())).astype(
            _index_dtype(dice))
        if dice.bad():
            kw["offset"] = 2
    elif scheme == "cu_seqlens":
        cu = np.sort(rng.integers(0, b * s + 1, size=nseq + 1))
        if dice.one_in(2):
            cu[0], cu[-1] = 0, b * s
        kw["cu_seqlens"] = cu.astype(_index_dtype(dice))
        if dice.one_in(2):
            kw["offset"] = rng.integers(0, 3, size=nseq).astype(np.int32)
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
        if chaos == 0:
            raise AssertionError(f"a valid case was rejected: {exc}") from exc
    else:
        outcome = "ok"
        pos = _positions_for(lay, b, s, kw)
        for arr, res, own_out in ((x, got, out), (k, got_k, k_out)):
            if arr is None:
                continue
            before = next(bits for a, bits in saved if a is arr).view(arr.dtype).reshape(arr.shape)
            want = round_to_dtype(rope_reference(_canon(before, lay), cos, sin, pos, interleaved=kw["interleaved"],
                                                 rotary_dim=rotary_dim, rotary_offset=rotary_offset,
                                                 inverse=kw["inverse"]), arr.dtype)
            np.testing.assert_array_equal(_bits(_canon(res, lay)), _bits(want))
            if own_out is not None:
                assert res is own_out
            if own_out is not arr:  # out of place: the input is untouched
                np.testing.assert_array_equal(_bits(arr), _bits(before))
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
    saved = [(a, _bits(a).copy()) for a in (x, cosine, sine)]
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
        np.testing.assert_array_equal(_bits(result["out"]), _bits(tail_rope_reference(x, cosine, sine)))
    for a, bits in saved:  # inputs are never written, whatever happened
        np.testing.assert_array_equal(_bits(a), bits)
    COUNTS["tail/numpy"][outcome] += 1


# ---------------------------------------------------------------------------------------------
# (c) prepared plans re-use validation per argument signature (all-CuPy arguments): a re-used
#     validation must decide exactly as full validation would, for every new placement of the
#     arrays (aligned, misaligned, landing on another argument's bytes).


def _params_bytes(plan) -> bytes:
    import ctypes

    v = plan._args.values
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
    """Counts the plan's full validations (its _full_prepare), to see which calls re-used one."""
    calls = []
    inner = getattr(plan, "_full_prepare", None)
    if inner is not None:
        def counted(*args, **kwargs):
            calls.append(1)
            return inner(*args, **kwargs)

        plan._full_prepare = counted
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
    q = fake_array(first, _layout_shape(layout, b, s, h, d), dtype, kind="cupy", shift=0)
    k = fake_array(first, _layout_shape(layout, b, s, first.int(0, 3), d), dtype, kind="cupy", shift=0)
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

    x, c, s_, o = contiguous(shape, BF16, first), contiguous((t, 32), np.float32, first),         contiguous((t, 32), np.float32, first), contiguous(shape, BF16, first)
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


def test_zz_report_case_counts():
    """Reports the cases tried (run with -s or -rP to see it); runs last in this module."""
    expected = {"general/fake", "tail/fake", "general/numpy", "tail/numpy", "plan/revalidation",
                "tail/revalidation"}
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
    assert total >= 2000, lines
