"""One call of the general API checked and put in canonical (B, S, H, D) terms: ``validate``
returns a :class:`Request`, or raises TypeError/ValueError before anything is launched or
written. The one-call APIs and :class:`~rope_rtc.RopePlan` share it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import arrays as A
from .descriptors import TensorDesc
from .layouts import Canonical, canonical, check_layout
from .rope_params import POS_CU_SEQLENS, POS_OFFSET, POS_OFFSETS, POS_POSITIONS


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

    @property
    def dtype(self) -> str:
        return self.q.dtype

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


def _int_arg(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    return int(value)


def validate(q, k, cos, sin, *, positions=None, offset=0, cu_seqlens=None, layout="bshd", interleaved=False,
             rotary_dim=None, rotary_offset=0, inverse=False, q_out=None, k_out=None, allow_host=True,
             names=("q", "k"), allow_desc=False) -> Request:
    """Every check of the general API, in one place, before anything is launched or written."""
    check_layout(layout)
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"interleaved: expected a bool, got {type(interleaved).__name__}")
    if not isinstance(inverse, (bool, np.bool_)):
        raise TypeError(f"inverse: expected a bool, got {type(inverse).__name__}")
    qn, kn = names
    qi = A.describe(q, qn, allow_host=allow_host)
    A.check_dtype(qi, A.FLOAT_DTYPES)
    A.check_last_dim_contiguous(qi)
    cq = canonical(qi.shape, qi.strides, layout, qn)
    ki = ck = None
    if k is not None:
        ki = A.describe(k, kn, allow_host=allow_host)
        if ki.dtype != qi.dtype:
            raise TypeError(f"{kn}: dtype {ki.dtype} differs from {qn}'s {qi.dtype}")
        A.check_last_dim_contiguous(ki)
        ck = canonical(ki.shape, ki.strides, layout, kn)
        if (ck.B, ck.S, ck.D) != (cq.B, cq.S, cq.D):
            raise ValueError(f"{kn}: shape {ki.shape} does not match {qn}'s {qi.shape} outside the head axis "
                             f"(only head counts may differ, for GQA/MQA)")
    D = cq.D

    # rotary window
    rdim = D if rotary_dim is None else _int_arg(rotary_dim, "rotary_dim")
    roff = _int_arg(rotary_offset, "rotary_offset")
    if rdim <= 0 or rdim % 2:
        raise ValueError(f"rotary_dim: must be a positive even number, got {rdim}")
    if roff < 0 or roff + rdim > D:
        raise ValueError(f"rotary_dim/rotary_offset: window [{roff}, {roff + rdim}) does not fit the head dim {D}")

    # tables
    ci = A.describe(cos, "cos", allow_host=allow_host)
    si = A.describe(sin, "sin", allow_host=allow_host)
    for t in (ci, si):
        A.check_dtype(t, ("float32",), " (tables are float32: build them with rope_tables)")
        A.check_ndim(t, (2,), "a 2-d table [max_positions, rotary_dim // 2]")
        A.check_last_dim_contiguous(t)
    if ci.shape != si.shape:
        raise ValueError(f"sin: shape {si.shape} differs from cos's {ci.shape}")
    if ci.shape[1] != rdim // 2:
        hint = "" if rotary_dim is not None else f" (rotary_dim defaults to the head dim {D}; pass rotary_dim={2 * ci.shape[1]}?)"
        raise ValueError(f"cos: has {ci.shape[1]} columns but rotary_dim {rdim} needs {rdim // 2}{hint}")
    if ci.shape[0] > 1 and ci.strides[0] != si.strides[0]:
        raise ValueError(f"sin: row stride {si.strides[0]} differs from cos's {ci.strides[0]}")
    for t in (ci, si):
        if t.device is not None:  # the kernel loads table entries as aligned floats
            A.check_aligned(t, t.itemsize)

    # positions
    pi = oi = cui = None
    off = 0
    if cu_seqlens is not None:
        if layout != "thd":
            raise ValueError(f"cu_seqlens: only for layout 'thd' (packed tokens), not {layout!r}")
        if positions is not None:
            raise ValueError("positions and cu_seqlens: pass one of them, not both")
        cui = A.describe(cu_seqlens, "cu_seqlens", allow_host=allow_host)
        A.check_dtype(cui, A.INDEX_DTYPES)
        A.check_ndim(cui, (1,), "a 1-d array [num_seqs + 1]")
        if cui.shape[0] < 2:
            raise ValueError(f"cu_seqlens: needs at least 2 entries ([0, T] for one sequence), got {cui.shape[0]}")
        A.check_contiguous(cui)
        if cui.device is not None:  # loaded as aligned int32/int64
            A.check_aligned(cui, cui.itemsize)
    if positions is not None:
        if offset is not None and not (isinstance(offset, (int, np.integer)) and int(offset) == 0):
            raise ValueError("positions and offset: pass one of them (positions are absolute)")
        pi = A.describe(positions, "positions", allow_host=allow_host)
        A.check_dtype(pi, A.INDEX_DTYPES)
        want = (cq.S,) if layout == "thd" else (cq.B, cq.S)
        if pi.shape != want:
            raise ValueError(f"positions: expected shape {want} (one per token), got {pi.shape}")
        A.check_contiguous(pi)
        if pi.device is not None:  # loaded as aligned int32/int64
            A.check_aligned(pi, pi.itemsize)
    elif isinstance(offset, (int, np.integer)) and not isinstance(offset, (bool, np.bool_)):
        off = int(offset)
        if cui is None and cq.S and cq.B and (off < 0 or off + cq.S > ci.shape[0]):
            raise ValueError(f"offset: positions {off}..{off + cq.S - 1} fall outside the table's {ci.shape[0]} rows")
    elif offset is None:
        off = 0
    else:
        oi = A.describe(offset, "offset", allow_host=allow_host)
        A.check_dtype(oi, A.INDEX_DTYPES)
        nseq = (cui.shape[0] - 1) if cui is not None else cq.B
        if oi.shape != (nseq,):
            raise ValueError(f"offset: an array offset needs shape ({nseq},) (one per sequence), got {oi.shape}")
        A.check_contiguous(oi)
        if oi.device is not None:
            A.check_aligned(oi, oi.itemsize)

    # outputs
    qo = ko = None
    if q_out is not None:
        qo = A.describe(q_out, f"{qn}_out" if k is not None else "out", allow_host=allow_host)
        _check_out(qo, qi)
    if k_out is not None:
        if k is None:
            raise ValueError("k_out: given without k")
        ko = A.describe(k_out, f"{kn}_out", allow_host=allow_host)
        _check_out(ko, ki)

    inputs = [x for x in (qi, ki, ci, si, pi, oi, cui) if x is not None]
    outs = [(qo, qi)] + ([(ko, ki)] if ko is not None else [])
    A.check_outputs([(o, own) for o, own in outs if o is not None], inputs)
    everything = inputs + [o for o, _ in outs if o is not None]
    if not allow_desc:
        for x in everything:
            if isinstance(x.array, TensorDesc):  # no address: launching would read address 0
                raise TypeError(f"{x.name}: a TensorDesc declares an array but holds none; pass arrays here "
                                "(declarations are for building a RopePlan)")
    hosts = {x.device is None for x in everything if not isinstance(x.array, TensorDesc)}
    if len(hosts) > 1:
        host = [x.name for x in everything if x.device is None]
        raise TypeError(f"{', '.join(host)}: host (NumPy) arrays mixed with device arrays; pass all of one kind")
    device = A.check_same_device(everything)
    return Request(qi, ki, qo, ko, ci, si, pi, oi, cui, off, cq, ck, layout, bool(interleaved), rdim, roff,
                   bool(inverse), device)


def _check_out(out: A.ArrayInfo, inp: A.ArrayInfo) -> None:
    if out.dtype != inp.dtype:
        raise TypeError(f"{out.name}: dtype {out.dtype} differs from {inp.name}'s {inp.dtype} (the output keeps the input dtype)")
    if out.shape != inp.shape:
        raise ValueError(f"{out.name}: shape {out.shape} differs from {inp.name}'s {inp.shape}")
    A.check_last_dim_contiguous(out)
