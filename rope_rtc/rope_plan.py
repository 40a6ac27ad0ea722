"""``RopePlan``: the general API prepared once for an inference engine, then executed with
cheap re-validation (argument sets remembered by identity, templates per signature) and one
launch per call (rope_rtc.launch.Launcher)."""

from __future__ import annotations

import ctypes

from . import arrays as A
from .launch import Launcher, StructArg, launch_prefix, load_kernel, remember
from .registry import ROPE_ENTRIES, rope_head_batches, rope_spec, rope_vector_widths
from .rope_launch import allowed_vectors, choose_vector, fill_params, kernel_for, launch_shape
from .rope_params import POS_OFFSET, POS_POSITIONS, RopeParams
from .rope_request import Request, validate


class RopePlan:
    """A prepared :func:`apply_rope_qk` for inference engines.

    Build it from arrays or :class:`~rope_rtc.TensorDesc` declarations with the same keywords as
    ``apply_rope_qk``; ``compile()`` once; then ``execute`` validates and launches with no
    allocation, no synchronisation and no compilation. Fixed by the plan: dtype, layout, pair
    style, rotary window, direction, head counts, head dim, the position scheme and the device.
    Free between executes: the token count (B, S or T, including zero), strides and addresses.

    ``q_out``/``k_out`` at construction decide in place (omitted, or ``q_out=q``) or out of place;
    an out-of-place plan needs ``q_out``/``k_out`` at every ``execute``. ``execute`` remembers the
    last 16 argument sets it saw (holding references to them) and skips re-validation when one
    repeats; new arrays of a shape, stride and dtype signature seen before get the cheaper
    pointer-only checks. From its second launch, a remembered set is launched as a one-node
    CUDA graph instantiated once for it (about 2 µs of host time instead of 4-6 µs for
    ``cuLaunchKernel``; never into a stream that is being captured; a new scalar ``offset`` is
    a new set; ``ROPE_RTC_NO_GRAPH_REPLAY=1`` turns it off).
    Capturable in a CUDA graph: capture ``execute`` on the capturing stream, then refill the same
    buffers and replay. A plan holds one argument block: give each thread its own plan.
    """

    def __init__(self, q, k, cos, sin, *, positions=None, offset=0, cu_seqlens=None, layout: str = "bshd",
                 interleaved: bool = False, rotary_dim: int | None = None, rotary_offset: int = 0,
                 inverse: bool = False, q_out=None, k_out=None, device: int | None = None) -> None:
        self._opts = dict(layout=layout, interleaved=interleaved, rotary_dim=rotary_dim,
                          rotary_offset=rotary_offset, inverse=inverse)
        req = validate(q, k, cos, sin, positions=positions, offset=offset, cu_seqlens=cu_seqlens,
                       q_out=q_out, k_out=k_out, allow_host=False, allow_desc=True, **self._opts)
        # Omitted outputs, or q_out=q / k_out=k, mean in place (Request.in_place needs both given).
        self.in_place = ((q_out is None or A.same_view(req.q_out, req.q))
                         and (k_out is None or k is None or A.same_view(req.k_out, req.k)))
        if not self.in_place and k is not None and k_out is None:
            raise ValueError("k_out: an out-of-place plan (q_out given) needs k_out too")
        if not self.in_place and q_out is None:  # execute() would refuse every call
            raise ValueError("q_out: an out-of-place plan (k_out given) needs q_out too")
        self.dtype, self.layout = req.dtype, layout
        self.interleaved, self.inverse = bool(interleaved), bool(inverse)
        self.rotary_dim, self.rotary_offset = req.rotary_dim, req.rotary_offset
        self.q_heads, self.head_dim = req.cq.H, req.cq.D
        self.k_heads = req.ck.H if req.ck is not None else 0
        self.has_k = k is not None
        self.pos_mode = req.pos_mode
        if device is None:
            device = req.device if req.device is not None else _current_device()
        self.device = int(device)
        self._kernels: dict[int, object] = {}
        self._compiled = False
        # The last call, for the identity fast path (a flat tuple: indexing it is the cheapest read):
        # (q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens, q.shape, launch prefix or
        #  None when there is nothing to launch, S for the scalar-offset bound check or 0).
        self._last = None
        self._templates: dict[tuple, _Template] = {}
        self._filled: _Template | None = None
        self._args = StructArg(RopeParams)
        self._params_address = ctypes.addressof(self._args.values)
        # The last RECENT_SETS argument sets by identity, each with its filled argument block:
        # engines cycle through a few buffers (per layer, per double-buffered step), and a
        # repeat restores the block in one copy instead of re-deriving it. Keyed by the
        # arguments' ids; each entry holds its arguments (in its _last tuple), so the ids cannot
        # be reused while the entry lives.
        self._recent: dict[tuple, tuple] = {}

    def compile(self) -> "RopePlan":
        """Load the kernels this plan can launch (every vector width of its dtype and pair style),
        compiling on a cache miss. After this, ``execute`` never compiles."""
        for vec in rope_vector_widths(self.dtype, self.interleaved):
            for hb in rope_head_batches(self.interleaved):
                k = load_kernel(rope_spec(self.dtype, self.interleaved, vec, hb), self.device)
                self._kernels[(vec, hb)] = tuple(k.functions[e] for e in ROPE_ENTRIES)  # (narrow, wide)
        self._launch = Launcher(self._args.address, self.device)
        self._compiled = True
        return self

    def execute(self, q, k=None, cos=None, sin=None, positions=None, q_out=None, k_out=None, stream=None, *,
                offset=None, cu_seqlens=None):
        """Validate (cheaply when the arrays repeat) and launch. Returns ``(q_out, k_out)``."""
        last = self._last
        off = 0 if offset is None else offset
        if not (last is not None and q is last[0] and k is last[1] and cos is last[2] and sin is last[3]
                and positions is last[4] and q_out is last[5] and k_out is last[6] and cu_seqlens is last[8]
                and q.shape == last[9] and (off is last[7] or (type(off) is int and type(last[7]) is int))):
            self._prepare(q, k, cos, sin, positions, q_out, k_out, off, cu_seqlens)
            last = self._last
        elif type(off) is int and off != last[7]:
            # A new decode step with a new scalar offset: only that field changes.
            self._set_offset(off)
            last = self._last
        qo = q if q_out is None else q_out
        ko = k if k_out is None else k_out
        if last[10] is None:
            return qo, ko
        self._launch(last[10], stream, last)
        return qo, ko

    def _set_offset(self, offset: int) -> None:
        if self.pos_mode == POS_POSITIONS:
            raise ValueError("positions and offset: pass one of them (positions are absolute)")
        rows = self._args.values.table_rows
        S = self._last[11]
        if S and (offset < 0 or offset + S > rows):
            raise ValueError(f"offset: positions {offset}..{offset + S - 1} fall outside the table's {rows} rows")
        self._args.values.offset = offset
        self._last = self._last[:7] + (offset,) + self._last[8:]

    def _prepare(self, q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens) -> None:
        if not self._compiled:
            self.compile()
        key = (id(q), id(k), id(cos), id(sin), id(positions), id(q_out), id(k_out), id(cu_seqlens),
               None if type(offset) is int else id(offset))
        hit = self._recent.get(key)
        if hit is not None and hit[1][9] == q.shape:
            snapshot, last = hit
            ctypes.memmove(self._params_address, snapshot, len(snapshot))
            self._filled = None  # the block no longer matches what the templates last wrote
            self._last = last
            if type(offset) is int and offset != last[7]:
                self._set_offset(offset)
            return
        self._prepare_new(q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens)
        remember(self._recent, key, (bytes(self._args.values), self._last))

    def _prepare_new(self, q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens) -> None:
        """Arguments not among the recent sets: template reuse or full validation."""
        qo = q if (q_out is None and self.in_place) else q_out
        ko = k if (k_out is None and self.in_place) else k_out
        arrays = (q, k, cos, sin, positions, qo, ko, cu_seqlens, None if type(offset) is int else offset)
        sig = _signature(arrays, qo is q, ko is k)
        tmpl = self._templates.get(sig) if sig is not None else None
        if tmpl is not None and self._reuse(tmpl, arrays, offset, q_out, k_out):
            return
        self._full_prepare(q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens, arrays, sig)

    def _reuse(self, tmpl: "_Template", arrays, offset, q_out, k_out) -> bool:
        """Arrays of a shape/stride/dtype signature validated before: only pointer-dependent
        checks run (alignment, and overlap when the arrays' relative placement is new). False
        sends the call through full validation (which raises on a real problem)."""
        ptrs = tuple(0 if a is None else a.data.ptr for a in arrays)
        if not tmpl.placement_ok(ptrs):
            return False
        if type(offset) is int and offset and tmpl.req.positions is not None:
            return False  # positions and an offset: full validation rejects it
        for i, mask in tmpl.natural:
            if ptrs[i] & mask:
                return False  # a table or index array off its natural alignment
        vec = tmpl.vector_for(ptrs)
        if vec is None:
            return False
        if type(offset) is int and tmpl.pos_offset_rows is not None:
            S, rows = tmpl.pos_offset_rows
            if S and (offset < 0 or offset + S > rows):
                return False
        p = self._args.values
        if self._filled is not tmpl or tmpl.filled_vec != vec:
            fill_params(p, tmpl.req, vec)
            self._filled, tmpl.filled_vec = tmpl, vec
        tmpl.write_pointers(p, ptrs, vec, offset)
        q, k, cos, sin, positions, _, _, cu_seqlens, _ = arrays
        self._last = (q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens, q.shape,
                      tmpl.prefix(self._kernels, vec), tmpl.pos_offset_rows[0] if tmpl.pos_offset_rows else 0)
        return True

    def _full_prepare(self, q, k, cos, sin, positions, q_out, k_out, offset, cu_seqlens, arrays, sig) -> None:
        if self.has_k != (k is not None):
            raise TypeError("k: this plan was built " + ("with" if self.has_k else "without") + " k")
        if self.in_place:
            if q_out is not None and q_out is not q:
                raise ValueError("q_out: this plan rotates in place; pass q_out=None or q_out=q")
            if k_out is not None and k_out is not k:
                raise ValueError("k_out: this plan rotates in place; pass k_out=None or k_out=k")
            qo, ko = q, k
        else:
            if q_out is None or (self.has_k and k_out is None):
                raise TypeError("q_out/k_out: this plan writes to separate outputs; pass them to execute()")
            qo, ko = q_out, k_out
        req = validate(q, k, cos, sin, positions=positions, offset=offset,
                       cu_seqlens=cu_seqlens, q_out=qo, k_out=ko, allow_host=False, **self._opts)
        if req.device is not None and req.device != self.device:
            A.check_same_device([req.q], self.device)
        problems = []
        if req.dtype != self.dtype:
            problems.append(f"dtype {req.dtype} (plan: {self.dtype})")
        if (req.cq.H, req.cq.D) != (self.q_heads, self.head_dim):
            problems.append(f"q heads/dim {(req.cq.H, req.cq.D)} (plan: {(self.q_heads, self.head_dim)})")
        if req.ck is not None and req.ck.H != self.k_heads:
            problems.append(f"k heads {req.ck.H} (plan: {self.k_heads})")
        if req.pos_mode != self.pos_mode:
            problems.append("the position scheme (positions / offset array / cu_seqlens) differs from the plan's")
        if problems:
            raise ValueError("execute: " + "; ".join(problems))
        prefix = None
        if req.num_tokens:
            vec = choose_vector(req)
            fill_params(self._args.values, req, vec)
            prefix = launch_prefix(kernel_for(self._kernels, req, vec), *launch_shape(req, vec))
        self._filled = None
        if sig is not None:
            if len(self._templates) >= 64:  # bounded: engines cycle through a few shapes
                self._templates.clear()
            self._templates[sig] = _Template(req, arrays)
        self._last = (q, k, cos, sin, positions, q_out, k_out, offset,
                      cu_seqlens, q.shape, prefix, req.cq.S if req.pos_mode == POS_OFFSET else 0)


def _current_device() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def _signature(arrays, q_in_place: bool, k_in_place: bool):
    """Shape/stride/dtype/device of each argument, when every one is a CuPy array (else None)."""
    parts = []
    for a in arrays:
        if a is None:
            parts.append(None)
        elif type(a).__name__ == "ndarray" and type(a).__module__.startswith("cupy"):
            parts.append((a.shape, a.strides, a.dtype, a.data.device_id))
        else:
            return None
    return (tuple(parts), q_in_place, k_in_place)


class _Template:
    """What full validation established for one argument signature, minus the pointers.

    Order of ``arrays``/``ptrs``: q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offset array.
    """

    OUTPUTS = ((5, 0), (6, 1))  # (output index, its own input index)

    def __init__(self, req: Request, arrays) -> None:
        self.req = req
        infos = (req.q, req.k, req.cos, req.sin, req.positions, req.q_out, req.k_out, req.cu_seqlens, req.offsets)
        ptrs = tuple(0 if a is None else a.data.ptr for a in arrays)
        # Extents relative to each array's pointer; and the placement full validation accepted.
        self.extents = tuple(None if i is None or i.size == 0 else tuple(e - i.ptr for e in i.byte_extent())
                             for i in infos)
        self.validated = tuple(p - ptrs[0] for p in ptrs)
        self.in_place = tuple(arrays[o] is not None and arrays[o] is arrays[i] for o, i in self.OUTPUTS)
        self.allowed = allowed_vectors(req)
        self.itemsize = req.q.itemsize
        # Tables and index arrays are read as aligned 4/8-byte scalars: (argument, alignment mask).
        self.natural = tuple((i, info.itemsize - 1) for i, info in enumerate(infos)
                             if i in (2, 3, 4, 7, 8) and info is not None)
        self.npair_div = 2 if req.interleaved else 1
        self.pos_offset_rows = (req.cq.S, req.cos.shape[0]) if req.pos_mode == POS_OFFSET and req.cu_seqlens is None else None
        self.rows_stride = req.cos.strides[0] if req.cos.shape[0] > 1 else 0
        self.filled_vec = None
        self._prefixes: dict[int, tuple] = {}

    def placement_ok(self, ptrs) -> bool:
        if tuple(p - ptrs[0] for p in ptrs) == self.validated:
            return True  # same relative placement as a validated call: same overlap answer
        for (o, own), same in zip(self.OUTPUTS, self.in_place):
            eo = self.extents[o]
            if eo is None:
                continue
            lo, hi = ptrs[o] + eo[0], ptrs[o] + eo[1]
            for j, ej in enumerate(self.extents):
                if ej is None or j == o or (same and j == own):
                    continue
                if ptrs[j] + ej[0] < hi and lo < ptrs[j] + ej[1]:
                    return False  # extents meet: let full validation decide exactly
        return True

    def vector_for(self, ptrs) -> int | None:
        combined = ptrs[0] | ptrs[1] | ptrs[5] | ptrs[6]
        for vec in self.allowed:
            if combined % (vec * self.itemsize) == 0:
                return vec
        return None

    def write_pointers(self, p: RopeParams, ptrs, vec: int, offset) -> None:
        q, k, cos, sin, positions, q_out, k_out, cu, offs = ptrs
        p.q_in, p.k_in, p.cos, p.sin = q, k, cos, sin
        p.q_out = q_out or q
        p.k_out = k_out or k
        p.positions, p.cu_seqlens, p.offsets = positions, cu, offs
        if type(offset) is int:
            p.offset = offset
        npair = vec // self.npair_div
        p.table_vec = int(self.rows_stride % npair == 0 and cos % (4 * npair) == 0 and sin % (4 * npair) == 0)

    def prefix(self, kernels: dict, vec: int):
        pre = self._prefixes.get(vec)
        if pre is None and self.req.num_tokens:
            pre = self._prefixes[vec] = launch_prefix(kernel_for(kernels, self.req, vec), *launch_shape(self.req, vec))
        return pre
