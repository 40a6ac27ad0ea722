"""One call of the general API checked and put in canonical (B, S, H, D) terms: ``validate``
returns a :class:`Request`, or raises TypeError/ValueError (a layout the kernel cannot serve:
:class:`~rope_rtc.errors.UnsupportedLayoutError`) before anything is launched or written. The
one-call APIs and :class:`~rope_rtc.RopePlan` share it; the checks on single arrays live in
``arrays``.

Positions that live on the host (NumPy ``positions``, ``offset`` or ``cu_seqlens``) are
checked value by value (:func:`check_position_values`). Device-resident ones are not read
back (that would synchronise): a position outside the table gives NaN for that token, unless
``ROPE_RTC_CHECK_POSITIONS=1`` asks the API to read them back and raise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import math

import numpy as np

from ..build.registry import ANGLE_MODES
from ..core import arrays as A
from ..core.descriptors import TensorDesc, is_int
from ..core.layouts import Canonical, canonical, check_layout, default_layout
from ..errors import shown
from .rope_params import POS_CU_SEQLENS, POS_OFFSET, POS_OFFSETS, POS_POSITIONS

#: Positions an ``inv_freq`` call accepts: 0 .. 2**31 - 1 (the kernel's 32-bit conversions; also
#: the longest table rope_tables builds).
ANGLE_POSITIONS = 2**31
#: The largest inverse frequency the kernel's argument reduction serves at every such position
#: (|position * inv_freq * 2 / pi| below 2^51: cuda_src/angles.cuh).
MAX_INV_FREQ = 2.0**20

@dataclass
class Request:
    """A validated call, in canonical (B, S, H, D) terms."""

    q: A.ArrayInfo
    k: A.ArrayInfo | None
    q_out: A.ArrayInfo | None
    k_out: A.ArrayInfo | None
    cos: A.ArrayInfo
    sin: A.ArrayInfo
    positions: A.ArrayInfo | None
    offsets: A.ArrayInfo | None
    cu_seqlens: A.ArrayInfo | None
    offset: int
    cq: Canonical
    ck: Canonical | None
    layout: str
    interleaved: bool
    rotary_dim: int
    rotary_offset: int
    inverse: bool
    device: int | None
    # cos and sin computed in the kernel: 0 (tables), else registry.ANGLE_MODES[inv_freq dtype];
    # ``cos`` and ``sin`` then both describe inv_freq.
    angles: int = 0
    attention: float = 1.0

    @property
    def dtype(self) -> str:
        return self.q.dtype

    @property
    def table_rows(self) -> int:
        """Positions the call may use: the table's rows, or ANGLE_POSITIONS for angles computed
        in the kernel."""
        return ANGLE_POSITIONS if self.angles else self.cos.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.cq.B * self.cq.S

    @property
    def in_place(self) -> bool:
        """Every output is its own input's view (then nothing outside the window needs copying)."""
        q_in = self.q_out is not None and A.same_view(self.q_out, self.q)
        if self.k is None:
            return q_in
        return q_in and self.k_out is not None and A.same_view(self.k_out, self.k)

    @property
    def pos_mode(self) -> int:
        if self.cu_seqlens is not None:
            return POS_CU_SEQLENS
        if self.positions is not None:
            return POS_POSITIONS
        return POS_OFFSETS if self.offsets is not None else POS_OFFSET

    def infos(self) -> tuple:
        """Every argument's info (None where absent), in the plans' argument order: q, k, cos, sin,
        positions, q_out, k_out, cu_seqlens, offset array (inv_freq in cos's place, sin None, for
        angles computed in the kernel)."""
        return (self.q, self.k, self.cos, None if self.angles else self.sin, self.positions, self.q_out, self.k_out,
                self.cu_seqlens, self.offsets)

    def without_arrays(self) -> "Request":
        """The same request holding no caller's array (what a template keeps)."""
        strip = {f: replace(getattr(self, f), array=None) for f in
                 ("q", "k", "q_out", "k_out", "cos", "sin", "positions", "offsets", "cu_seqlens")
                 if getattr(self, f) is not None}
        return replace(self, **strip)


def _int_arg(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    return int(value)


def check_options(layout, interleaved, inverse) -> None:
    if layout is not None:  # None: q's rank decides (default_layout)
        check_layout(layout)
    for name, value in (("interleaved", interleaved), ("inverse", inverse)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def _tensor(x, name: str, layout: str | None, allow_host: bool) -> tuple[A.ArrayInfo, Canonical, str]:
    """``x``'s info, its canonical view and its layout (``layout``, or the one its rank settles
    when None)."""
    info = A.describe(x, name, allow_host=allow_host)
    A.check_dtype(info, A.FLOAT_DTYPES)
    if layout is None:
        layout = default_layout(info.shape, name)
    c = canonical(info.shape, info.strides, layout, name)  # the rank first: 0-d arrays have no last axis
    A.check_last_dim_contiguous(info)
    return info, c, layout


def check_window(D: int, rotary_dim, rotary_offset, name: str = "q") -> tuple[int, int]:
    """``(rotary_dim, rotary_offset)`` of a head of ``D`` channels (``name``'s)."""
    if rotary_dim is None:
        if D % 2:
            raise ValueError(f"{name}: head dim {D} is odd; RoPE rotates channel pairs, so pass an even rotary_dim "
                             f"(the rotated channels) and rotary_offset to rotate part of the head")
        rdim = D
    else:
        rdim = _int_arg(rotary_dim, "rotary_dim")
    roff = _int_arg(rotary_offset, "rotary_offset")
    if rdim <= 0 or rdim % 2:
        raise ValueError(f"rotary_dim: must be a positive even number, got {rdim}")
    if roff < 0 or roff + rdim > D:
        raise ValueError(f"rotary_dim/rotary_offset: window [{roff}, {roff + rdim}) does not fit the head dim {D}")
    return rdim, roff


def check_tables(cos, sin, rdim: int, rotary_dim_given: bool, D: int, allow_host: bool) -> tuple[A.ArrayInfo, A.ArrayInfo]:
    ci = A.describe(cos, "cos", allow_host=allow_host)
    si = A.describe(sin, "sin", allow_host=allow_host)
    for t in (ci, si):
        A.check_dtype(t, ("float32",), " (tables are float32: build them with rope_tables)")
        A.check_ndim(t, (2,), "a 2-d table [max_positions, rotary_dim // 2]")
        if t.size and t.shape[-1] > 1 and t.strides[-1] != 1:
            transposed = len(t.shape) == 2 and t.strides[0] == 1
            hint = (" (it looks like a transposed view, t.T of a [rotary_dim // 2, max_positions] array t; a table "
                    "is [max_positions, rotary_dim // 2] with contiguous rows: pass ascontiguousarray(t.T), which "
                    "keeps that shape)") if transposed else ""
            A.check_last_dim_contiguous(t, hint)
    if ci.shape != si.shape:
        raise ValueError(f"sin: shape {si.shape} differs from cos's {ci.shape}")
    cols = ci.shape[1]
    if cols != rdim // 2:
        if cols == rdim:
            raise ValueError(f"cos: has {cols} columns, the full rotary dim {rdim}: this looks like a Hugging Face "
                             f"table with both halves duplicated (cat(freqs, freqs)); pass cos[:, :{rdim // 2}] and "
                             f"sin[:, :{rdim // 2}] (rope_rtc tables hold each frequency once)")
        hint = ""
        if not rotary_dim_given and 2 * cols < D:
            hint = (f" (rotary_dim defaults to the head dim {D}; to rotate only the first {2 * cols} channels "
                    f"pass rotary_dim={2 * cols})")
        raise ValueError(f"cos: has {cols} columns but rotary_dim {rdim} needs {rdim // 2}{hint}")
    if ci.shape[0] > 1 and ci.strides[0] != si.strides[0]:
        raise ValueError(f"sin: row stride {si.strides[0]} differs from cos's {ci.strides[0]}")
    for t in (ci, si):
        if t.device is not None:  # the kernel loads table entries as aligned floats
            A.check_aligned(t, t.itemsize)
    return ci, si


def float_or_inf(value) -> float:
    """``float(value)``, infinite for an int past float's range (so that a range check names it
    rather than Python raising OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_inv_freq(inv_freq, sin, rdim: int, attention_scaling, allow_host: bool) -> tuple[A.ArrayInfo, int, float]:
    """``(info, angle mode, attention factor)`` of a call that computes cos and sin from
    ``inv_freq`` (passed in the cos slot; ``sin`` must be absent)."""
    if sin is not None:
        raise TypeError("sin: pass inv_freq instead of cos and sin, not with them")
    if inv_freq is None:
        raise TypeError("inv_freq: expected a 1-d float64 or float32 array [rotary_dim // 2] "
                        "(rope_rtc.inverse_frequencies gives one)")
    fi = A.describe(inv_freq, "inv_freq", allow_host=allow_host)
    A.check_dtype(fi, tuple(ANGLE_MODES), " (float64 for numerics 'exact', float32 for 'transformers': "
                  "rope_rtc.inverse_frequencies gives either)")
    A.check_ndim(fi, (1,), "a 1-d array [rotary_dim // 2]")
    if fi.shape[0] != rdim // 2:
        raise ValueError(f"inv_freq: has {fi.shape[0]} entries but rotary_dim {rdim} needs {rdim // 2} (one per pair)")
    A.check_contiguous(fi)
    if fi.device is not None:  # loaded as aligned scalars
        A.check_aligned(fi, fi.itemsize)
    else:  # host values are checked (device ones are not read back: the kernel's range is documented)
        values = np.asarray(fi.array, dtype=np.float64)
        bad = ~(np.abs(values) <= MAX_INV_FREQ)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"inv_freq: entry {i} is {values[i]}; inverse frequencies must be finite and at most "
                             f"{MAX_INV_FREQ:g} in magnitude")
    if isinstance(attention_scaling, (bool, np.bool_)) or not isinstance(attention_scaling, (int, float, np.integer,
                                                                                           np.floating)):
        raise TypeError(f"attention_scaling: expected a float, got {type(attention_scaling).__name__}")
    att = float_or_inf(attention_scaling)
    f32 = np.finfo(np.float32)
    # Normal float32 magnitudes only: a smaller factor rounds every cos and sin to (nearly) zero.
    if not (float(f32.tiny) <= att <= float(f32.max)):  # also false for NaN
        raise ValueError(f"attention_scaling: expected a finite positive factor within float32's normal range "
                         f"({float(f32.tiny):.3g}..{float(f32.max):.3g}), got {shown(attention_scaling)}")
    return fi, ANGLE_MODES[fi.dtype], att


def _index_array(x, name: str, ndim_meaning: tuple[tuple[int, ...], str], allow_host: bool) -> A.ArrayInfo:
    info = A.describe(x, name, allow_host=allow_host)
    A.check_dtype(info, A.INDEX_DTYPES)
    A.check_ndim(info, *ndim_meaning)
    A.check_contiguous(info)
    if info.device is not None:  # loaded as aligned int32/int64
        A.check_aligned(info, info.itemsize)
    return info


def position_range(rows: int) -> str:
    """What the positions of a call must lie in, for error messages: a table's rows, or the range
    of angles computed in the kernel."""
    if rows == ANGLE_POSITIONS:
        return f"the positions inv_freq serves (0..{rows - 1})"
    return f"the table's {rows} rows"


def offset_error(offset: int, tokens: int, rows: int, per_sequence: bool) -> str | None:
    """Why an int ``offset`` cannot serve ``tokens`` tokens on a table of ``rows`` rows, or None;
    one wording for a new plan and a warm one. ``per_sequence``: with cu_seqlens every sequence
    starts at the offset, so with any token there it must be a row."""
    if not per_sequence and (offset < 0 or offset + tokens > rows):
        return f"offset: positions {offset}..{offset + tokens - 1} fall outside {position_range(rows)}"
    if offset < 0 or offset > rows or (per_sequence and tokens > 0 and offset >= rows):
        return f"offset: {offset} is not a position of {position_range(rows)}"
    return None


def check_positions(positions, offset, cu_seqlens, layout: str, cq: Canonical, rows: int, allow_host: bool):
    """``(positions, offset array, cu_seqlens, scalar offset)`` of one call."""
    pi = oi = cui = None
    off = 0
    if cu_seqlens is not None:
        if layout != "thd":
            raise ValueError(f"cu_seqlens: only for layout 'thd' (packed tokens), not {layout!r}")
        if positions is not None:
            raise ValueError("positions and cu_seqlens: pass one of them, not both")
        cui = _index_array(cu_seqlens, "cu_seqlens", ((1,), "a 1-d array [num_seqs + 1]"), allow_host)
        if cui.shape[0] < 2:
            raise ValueError(f"cu_seqlens: needs at least 2 entries ([0, T] for one sequence), got {cui.shape[0]}")
    if positions is not None:
        if isinstance(offset, (float, np.floating, bool, np.bool_)):  # the type first, as without positions
            raise TypeError(f"offset: expected an int or an int array (one start per sequence), got "
                            f"{type(offset).__name__} {offset!r}")
        if offset is not None and not (is_int(offset) and int(offset) == 0):
            raise ValueError("positions and offset: pass one of them (positions are absolute)")
        want = (cq.S,) if layout == "thd" else (cq.B, cq.S)
        pi = _index_array(positions, "positions", ((len(want),), f"shape {want} (one position per token)"), allow_host)
        if pi.shape != want:
            raise ValueError(f"positions: expected shape {want} (one per token), got {pi.shape}")
    elif is_int(offset):
        off = int(offset)
        bad = offset_error(off, cq.S, rows, cui is not None)
        if bad:
            raise ValueError(bad)
    elif offset is None:
        off = 0
    elif isinstance(offset, (float, np.floating)) or isinstance(offset, (bool, np.bool_)):
        raise TypeError(f"offset: expected an int or an int array (one start per sequence), got "
                        f"{type(offset).__name__} {offset!r}")
    else:
        nseq = (cui.shape[0] - 1) if cui is not None else cq.B
        oi = _index_array(offset, "offset", ((1,), f"an int, or an array of shape ({nseq},) (one start per sequence)"),
                          allow_host)
        if oi.shape != (nseq,):
            raise ValueError(f"offset: an array offset needs shape ({nseq},) (one per sequence), got {oi.shape}")
    return pi, oi, cui, off


def _outputs(q_out, k_out, qi, ki, qn: str, kn: str, k_given: bool, allow_host: bool):
    qo = ko = None
    if q_out is not None:
        qo = A.describe(q_out, f"{qn}_out" if k_given else "out", allow_host=allow_host)
        _check_out(qo, qi)
    if k_out is not None:
        if not k_given:
            raise ValueError("k_out: given without k")
        ko = A.describe(k_out, f"{kn}_out", allow_host=allow_host)
        _check_out(ko, ki)
    return qo, ko


def check_kinds(everything: list[A.ArrayInfo], allow_desc: bool = False) -> int | None:
    """Arrays (not declarations, unless allowed), all on the host or all on one device."""
    if not allow_desc:
        for x in everything:
            A.check_holds_memory(x)
    hosts = {x.device is None for x in everything if not isinstance(x.array, TensorDesc)}
    if len(hosts) > 1:
        host = [x.name for x in everything if x.device is None]
        raise TypeError(f"{', '.join(host)}: host (NumPy) arrays mixed with device arrays; pass all of one kind")
    return A.check_same_device(everything)


def validate(q, k, cos, sin, *, positions=None, offset=0, cu_seqlens=None, layout=None, interleaved=False,
             rotary_dim=None, rotary_offset=0, inverse=False, q_out=None, k_out=None, allow_host=True,
             names=("q", "k"), allow_desc=False, attention_scaling=None) -> Request:
    """Every check of the general API, before anything is launched or written.

    ``layout=None``: q's rank decides (:func:`~rope_rtc.core.layouts.default_layout`: 3-d is ``"thd"``,
    4-d is refused), and the request holds the layout it settled. ``attention_scaling`` not None:
    cos and sin are computed in the kernel, ``cos`` holds the inverse frequencies and ``sin`` is
    None (the public functions' ``inv_freq=``)."""
    check_options(layout, interleaved, inverse)
    qn, kn = names
    qi, cq, layout = _tensor(q, qn, layout, allow_host)
    ki = ck = None
    if k is not None:
        ki, ck, _ = _tensor(k, kn, layout, allow_host)
        if ki.dtype != qi.dtype:
            raise TypeError(f"{kn}: dtype {ki.dtype} differs from {qn}'s {qi.dtype}")
        if (ck.B, ck.S, ck.D) != (cq.B, cq.S, cq.D):
            raise ValueError(f"{kn}: shape {ki.shape} does not match {qn}'s {qi.shape} outside the head axis "
                             f"(only head counts may differ, for GQA/MQA)")
    rdim, roff = check_window(cq.D, rotary_dim, rotary_offset, qn)
    if attention_scaling is None:
        ci, si = check_tables(cos, sin, rdim, rotary_dim is not None, cq.D, allow_host)
        angles, att, rows = 0, 1.0, ci.shape[0]
    else:
        ci, angles, att = check_inv_freq(cos, sin, rdim, attention_scaling, allow_host)
        si, rows = ci, ANGLE_POSITIONS
    pi, oi, cui, off = check_positions(positions, offset, cu_seqlens, layout, cq, rows, allow_host)
    qo, ko = _outputs(q_out, k_out, qi, ki, qn, kn, k is not None, allow_host)

    inputs = [x for x in (qi, ki, ci, si if si is not ci else None, pi, oi, cui) if x is not None]
    outs = [(o, own) for o, own in ((qo, qi), (ko, ki)) if o is not None]
    A.check_outputs(outs, inputs)
    device = check_kinds(inputs + [o for o, _ in outs], allow_desc)
    req = Request(qi, ki, qo, ko, ci, si, pi, oi, cui, off, cq, ck, layout, bool(interleaved), rdim, roff,
                  bool(inverse), device, angles, att)
    if device is None and not allow_desc:
        check_position_values(req, *(None if x is None else np.asarray(x.array) for x in (pi, oi, cui)))
    return req


def check_position_values(req: Request, positions: np.ndarray | None, offsets: np.ndarray | None,
                          cu_seqlens: np.ndarray | None) -> None:
    """Every position the call would read lies inside the table; ``cu_seqlens`` is ``[0, ..., T]``
    and non-decreasing. The arrays are host copies of the request's index arrays."""
    rows, S = req.table_rows, req.cq.S
    if cu_seqlens is not None:
        cu = cu_seqlens.astype(np.int64)
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens: must start at 0, got {int(cu[0])}")
        steps = np.diff(cu)
        if (steps < 0).any():
            i = int(np.argmax(steps < 0))
            raise ValueError(f"cu_seqlens: must be non-decreasing, but entry {i + 1} ({int(cu[i + 1])}) is below "
                             f"entry {i} ({int(cu[i])})")
        if cu[-1] != S:
            raise ValueError(f"cu_seqlens: must end at the token count T={S} (the last entry is {int(cu[-1])}); "
                             f"{'tokens past it would not be rotated' if cu[-1] < S else 'it counts tokens that do not exist'}")
        lengths = steps
        starts = offsets.astype(np.int64) if offsets is not None else np.full(len(lengths), req.offset, np.int64)
        _check_starts(starts, lengths, rows, "offset")
    elif offsets is not None:
        _check_starts(offsets.astype(np.int64), np.full(len(offsets), S, np.int64) if req.cq.B else
                      np.zeros(len(offsets), np.int64), rows, "offset")
    if positions is not None:
        check_position_rows(positions, rows)


def check_position_rows(positions: np.ndarray, rows: int) -> None:
    """Every entry of the host ``positions`` names one of the table's ``rows`` (``ValueError``
    naming the first that does not)."""
    if not positions.size:
        return
    p = positions.astype(np.int64)
    bad = (p < 0) | (p >= rows)
    if bad.any():
        i = int(np.argmax(bad.reshape(-1)))
        where = f"the table's {rows} rows (0..{rows - 1})" if rows != ANGLE_POSITIONS else position_range(rows)
        raise ValueError(f"positions: entry {i} is {int(p.reshape(-1)[i])}, outside {where}")


def _check_starts(starts: np.ndarray, lengths: np.ndarray, rows: int, name: str) -> None:
    """Sequence b reads table rows starts[b] .. starts[b] + lengths[b] - 1."""
    if (starts < 0).any():
        b = int(np.argmax(starts < 0))
        raise ValueError(f"{name}: sequence {b} starts at position {int(starts[b])}; positions are >= 0")
    past = (lengths > 0) & (starts > rows - lengths)  # not starts + lengths: that can wrap in int64
    if past.any():
        b = int(np.argmax(past))
        first, last = int(starts[b]), int(starts[b]) + int(lengths[b]) - 1  # Python ints: no int64 wrap
        raise ValueError(f"{name}: sequence {b} reads positions {first}..{last}, "
                         f"outside {position_range(rows)}")


def check_device_positions(req: Request) -> None:
    """``ROPE_RTC_CHECK_POSITIONS=1``: read device-resident index arrays back (synchronising) and
    check them like host ones."""
    import cupy

    host = [None if x is None else cupy.asnumpy(cupy.asarray(x.array)) for x in (req.positions, req.offsets,
                                                                             req.cu_seqlens)]
    check_position_values(req, *host)


def _check_out(out: A.ArrayInfo, inp: A.ArrayInfo) -> None:
    if out.dtype != inp.dtype:
        raise TypeError(f"{out.name}: dtype {out.dtype} differs from {inp.name}'s {inp.dtype} (the output keeps the input dtype)")
    if out.shape != inp.shape:
        raise ValueError(f"{out.name}: shape {out.shape} differs from {inp.name}'s {inp.shape}")
    A.check_last_dim_contiguous(out)


def check_positions_of(arrays: tuple, scalar: int, opts: dict) -> None:
    """``ROPE_RTC_CHECK_POSITIONS=1``: read a call's device-resident index arrays back
    (synchronising) and raise on a position outside the table or a malformed ``cu_seqlens``."""
    q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offsets = arrays
    if positions is None and offsets is None and cu_seqlens is None:
        return
    req = validate(q, k, cos, sin, positions=positions, offset=scalar if offsets is None else offsets,
                   cu_seqlens=cu_seqlens, q_out=q_out, k_out=k_out, allow_host=False, **opts)
    check_device_positions(req)
