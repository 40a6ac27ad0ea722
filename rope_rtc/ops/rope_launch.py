"""How a validated :class:`~rope_rtc.ops.rope_request.Request` becomes a launch of the general kernel
(cuda_src/rope.cu): the vector width, the argument block, the index space, the build (heads per
thread, 32- or 64-bit entry) and the grid. The one-call APIs and the plans share it.

The module-level limits are read at each call, so tests may lower them to force a path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..build.registry import FixedGeometry, angle_geometries, fixed_geometry, rope_head_batch, rope_vector_widths
from ..core import arrays as A
from ..core.layouts import canonical
from .rope_params import IDX_CU_SEQLENS_I64, IDX_OFFSETS_I64, IDX_POSITIONS_I64, FixedParams, RopeParams, fast_divisor
from .rope_request import Request

# Threads per block of the general kernel (cuda_src/rope.cu: __launch_bounds__(256)).
BLOCK_THREADS = 256
GRID_LIMIT = 2**31 - 1
# Index spaces below this run the kernel's 32-bit path (rope.cu: narrow_thread).
NARROW_LIMIT = 2**31
# Threads per token tile when tokens are the denser axis (token_tile): one warp.
TILE_THREADS = 32
# Launches with fewer (token, head) pairs than this run one head per thread (decode: latency).
SMALL_TOKEN_HEADS = 2**14
# The specialised build (cuda_src/rope_fixed.cu) serves every call it fits; False: the generic
# kernel serves all (the tests run their matrix both ways).
USE_FIXED = True
# Dense arrays take the dense build of the specialised kernel (FIX_DENSE); False: the strided one
# serves every call (the tests run both).
USE_DENSE = True
# Specialised launches with fewer threads than this use blocks of FIXED_SMALL_BLOCK (decode:
# more SMs share the few warps); others FIXED_BLOCK (benchmarks/probes/fixed_sweep.py).
FIXED_SMALL_THREADS = 2**14
FIXED_BLOCK, FIXED_SMALL_BLOCK = 256, 128


def _views(req: Request):
    """(info, canonical strides) of the four tensors the kernel touches (outputs default to inputs)."""
    lay = req.layout
    q_out = req.q_out or req.q
    out = [(req.q, req.cq), (q_out, canonical(q_out.shape, q_out.strides, lay, q_out.name))]
    if req.k is not None:
        k_out = req.k_out or req.k
        out += [(req.k, req.ck), (k_out, canonical(k_out.shape, k_out.strides, lay, k_out.name))]
    return out


def allowed_vectors(req: Request) -> tuple[int, ...]:
    """Vector widths (elements, widest first) the window and strides allow, pointers aside."""
    D, R, ro = req.cq.D, req.rotary_dim, req.rotary_offset
    copy = not req.in_place and R < D
    out = []
    for vec in rope_vector_widths(req.dtype, req.interleaved):
        if ro % vec or ((R // 2) if not req.interleaved else R) % vec or (copy and D % vec):
            continue
        if all(extent <= 1 or stride % vec == 0 for _, c in _views(req)
               for extent, stride in ((c.B, c.sb), (c.S, c.ss), (c.H, c.sh))):
            out.append(vec)
    return tuple(out)


def misaligned_view(req: Request, vec: int) -> A.ArrayInfo | None:
    """The first of q, its output, k and its output whose address or strides do not allow
    ``vec``-element accesses; None when all do."""
    size = req.q.itemsize
    for info, c in _views(req):
        if info.ptr % (vec * size) or any(extent > 1 and stride % vec
                                          for extent, stride in ((c.B, c.sb), (c.S, c.ss), (c.H, c.sh))):
            return info
    return None


def choose_vector(req: Request) -> int:
    """The widest vector (elements) every address the kernel forms is aligned to."""
    size = req.q.itemsize
    D, R, ro = req.cq.D, req.rotary_dim, req.rotary_offset
    half = R // 2
    copy = not req.in_place and R < D
    culprit = req.q.name  # what stopped the narrowest width: the error names it
    for vec in rope_vector_widths(req.dtype, req.interleaved):
        if ro % vec or (half if not req.interleaved else R) % vec:
            culprit = "rotary_offset/rotary_dim"
            continue
        if copy and (D % vec):
            culprit = f"{req.q.name} (head dim {D})"
            continue
        bad = misaligned_view(req, vec)
        if bad is None:
            return vec
        culprit = bad.name
    worst = min(rope_vector_widths(req.dtype, req.interleaved))
    raise ValueError(
        f"{culprit}: addresses or strides are not aligned to {worst * size} bytes, the smallest access "
        f"{'interleaved pairs' if req.interleaved else 'the kernel'} can use for {req.dtype}; pass an aligned copy"
    )


def fill_params(p: RopeParams, req: Request, vec: int) -> None:
    views = _views(req)
    (qi, cq), (qo, cqo) = views[0], views[1]
    p.q_in, p.q_out = qi.ptr, qo.ptr
    p.q_in_sb, p.q_in_ss, p.q_in_sh = cq.sb, cq.ss, cq.sh
    p.q_out_sb, p.q_out_ss, p.q_out_sh = cqo.sb, cqo.ss, cqo.sh
    if req.k is not None:
        (ki, ck), (ko, cko) = views[2], views[3]
        p.k_in, p.k_out = ki.ptr, ko.ptr
        p.k_in_sb, p.k_in_ss, p.k_in_sh = ck.sb, ck.ss, ck.sh
        p.k_out_sb, p.k_out_ss, p.k_out_sh = cko.sb, cko.ss, cko.sh
        p.k_heads = ck.H
    else:
        p.k_in = p.k_out = 0
        p.k_in_sb = p.k_in_ss = p.k_in_sh = p.k_out_sb = p.k_out_ss = p.k_out_sh = 0
        p.k_heads = 0
    fill_positions_and_tables(p, req)
    p.seq_len = max(req.cq.S, 1)
    p.inverse = int(req.inverse)
    p.q_heads, p.head_dim = req.cq.H, req.cq.D
    p.rot_offset, p.rot_half = req.rotary_offset, req.rotary_dim // 2
    p.copy_passthrough = int(not req.in_place and req.rotary_dim < req.cq.D)
    p.table_vec = table_vec(req, vec // 2 if req.interleaved else vec)
    space = index_space(req, vec)
    p.tile, p.units, p.groups, p.copy_units = space.tile, space.units, space.groups, space.copy_units
    p.rot_total, p.total, p.narrow = space.rot_total, space.total, int(space.narrow)
    if space.narrow:  # (a zero extent means no thread divides by it: 1 stands in)
        p.div_units = fast_divisor(max(space.units, 1))
        p.div_groups = fast_divisor(max(space.groups, 1))
        p.div_tile = fast_divisor(space.tile)
        p.div_seq = fast_divisor(p.seq_len)
        p.div_copy_units = fast_divisor(max(space.copy_units, 1))
        p.div_heads = fast_divisor(max(space.heads, 1))


def fill_positions_and_tables(p, req: Request) -> None:
    """The fields every general kernel's block shares (rope.cu, rope_fixed.cu, rope_cache.cu and
    positions.cuh read them under the same names): tables, position scheme, token counts."""
    p.cos, p.sin = req.cos.ptr, req.sin.ptr
    p.table_rows = req.table_rows
    p.table_stride = 0 if req.angles else req.cos.strides[0]
    p.positions = req.positions.ptr if req.positions is not None else 0
    p.offsets = req.offsets.ptr if req.offsets is not None else 0
    p.cu_seqlens = req.cu_seqlens.ptr if req.cu_seqlens is not None else 0
    p.offset = req.offset
    p.num_tokens = req.num_tokens
    p.num_seqs = req.cu_seqlens.shape[0] - 1 if req.cu_seqlens is not None else req.cq.B
    p.pos_mode = req.pos_mode
    p.index_flags = _index_flags(req)


def table_vec(req: Request, npair: int) -> int:
    """1 when table rows may be read ``npair`` floats per access: every row slice aligned to that."""
    if req.angles:
        return 0
    rows_aligned = req.cos.shape[0] <= 1 or req.cos.strides[0] % npair == 0
    return int(rows_aligned and req.cos.ptr % (4 * npair) == 0 and req.sin.ptr % (4 * npair) == 0)


def _index_flags(req: Request) -> int:
    return ((IDX_POSITIONS_I64 if req.positions is not None and req.positions.dtype == "int64" else 0)
            | (IDX_OFFSETS_I64 if req.offsets is not None and req.offsets.dtype == "int64" else 0)
            | (IDX_CU_SEQLENS_I64 if req.cu_seqlens is not None and req.cu_seqlens.dtype == "int64" else 0))


def fixed_build(req: Request, layout_denser: bool) -> FixedGeometry | None:
    """The specialised build that serves this call, or None (the generic kernel does).

    It fits when the window is a whole number of its vectors, every stride is too, nothing
    outside the window needs copying (in place, or the whole head rotated), the heads divide
    into its head groups and the threads fit 32-bit indices. ``layout_denser``: the plan's
    layout puts tokens closer than heads (bhsd), which fixes the thread order (a plan fixes
    its builds when it compiles them)."""
    if req.angles:
        return angle_build(req, layout_denser)
    if not USE_FIXED or (not req.in_place and req.rotary_dim < req.cq.D):
        return None
    g = fixed_geometry(req.dtype, req.interleaved, req.cq.H, req.ck.H if req.ck is not None else 0, req.cq.D,
                       req.rotary_offset, req.rotary_dim, layout_denser, req.pos_mode)
    if g is None or g.vec not in allowed_vectors(req):
        return None
    if fixed_threads(req, g) >= NARROW_LIMIT or not fits_fixed_block(req):
        return None
    return with_dense(req, g)


# The 32-bit fields of the specialised build's block (cuda_src/fixed_params.cuh): table rows (and
# so the int offset) below 2^32, a table row stride (signed: tables may be read backwards) of
# fewer than 2^31 elements either way.
TABLE_ROWS_LIMIT = 2**32
TABLE_STRIDE_LIMIT = 2**31


def fits_fixed_block(req: Request) -> bool:
    """Whether the call's table fits the specialised build's 32-bit fields (else the generic
    kernel serves it; the thread count is checked beside)."""
    stride = 0 if req.angles else req.cos.strides[0]
    return req.table_rows < TABLE_ROWS_LIMIT and abs(stride) < TABLE_STRIDE_LIMIT


def check_fixed_block(req: Request, kernel: str) -> None:
    """ValueError when the call's table does not fit the specialised block, for a ``kernel`` that
    has no generic build (multimodal RoPE, the fused QK-norm)."""
    if not fits_fixed_block(req):
        raise ValueError(f"cos/sin: {req.table_rows} rows or a row stride of {req.cos.strides[0]} elements; {kernel} "
                         "takes tables of fewer than 2^32 rows, rows fewer than 2^31 elements apart either way")


def dense_strides(req: Request, order: int) -> tuple[int, int, int, int] | None:
    """The one stride per array of a dense build (FIX_DENSE in cuda_src/rope_fixed.cu), as
    (q, q_out, k, k_out), or None when an array is not dense for thread order ``order``.

    Token-major order (0): heads head_dim apart and batches one after another; the stride is
    the token's (fused q|k|v views qualify: their token stride is free). bhsd order (1): rows
    head_dim apart and batches one after another; the stride is the head's (a cache padded to a
    longer sequence qualifies). Strides of extents of 1 are never used, so they do not count."""
    out = []
    for _, c in _views(req):
        if order == 0:
            inner = c.H <= 1 or c.sh == c.D
            run = c.ss if c.S > 1 else c.sb
            outer = c.B <= 1 or c.S <= 1 or c.sb == c.S * c.ss
        else:
            inner = c.S <= 1 or c.ss == c.D
            run = c.sh if c.H > 1 else c.sb
            outer = c.B <= 1 or c.H <= 1 or c.sb == c.H * c.sh
        if (c.B * c.S if order == 0 else c.B * c.H) <= 1:
            run = 0  # one token (one head in bhsd): the stride only ever multiplies zero
        if not (inner and outer and 0 <= run < TABLE_STRIDE_LIMIT):
            return None
        out.append(run)
    return tuple(out) + (0, 0) * (len(out) == 2)  # no k: its two strides are never read


# bhsd launches of this many threads or more (32 MB moved and up) keep the strided build: there
# the dense one is slower on prefill, where token-major prefill is level and every launch of a few
# MB or less is faster (benchmarks/probes/fixed_sweep.py).
DENSE_BHSD_THREADS = 2**20


def with_dense(req: Request, g: FixedGeometry) -> FixedGeometry:
    """``g`` as its dense build when every array of the call is dense for its thread order (the
    argument block's first two lines then hold what the kernel reads for the common position
    schemes, which small launches wait for less; cuda_src/fixed_params.cuh), but for large bhsd
    launches."""
    if not USE_DENSE or (g.order == 1 and fixed_threads(req, g) >= DENSE_BHSD_THREADS):
        return g
    return replace(g, dense=True) if dense_strides(req, g.order) is not None else g


def angle_build(req: Request, layout_denser: bool) -> FixedGeometry:
    """The build that computes the call's cos and sin from ``inv_freq`` (no generic kernel does):
    NotImplementedError or ValueError saying why none fits."""
    builds = angle_builds(req, layout_denser)
    small = fixed_threads(req, builds[0]) < FIXED_SMALL_THREADS  # builds[0]: the small launches' build
    chosen = builds[0] if small else builds[1]
    if req.num_tokens and (chosen.vec not in allowed_vectors(req) or any(
            i.ptr % (chosen.vec * req.q.itemsize) for i in (req.q, req.k, req.q_out, req.k_out) if i is not None)):
        names = "/".join(i.name for i in (req.q, req.k) if i is not None)
        raise ValueError(f"{names}/outputs: addresses or strides are not aligned to {chosen.vec * req.q.itemsize} "
                         "bytes, which the inv_freq kernel reads; pass aligned arrays (a contiguous array is)")
    if fixed_threads(req, chosen) >= NARROW_LIMIT:
        raise ValueError(f"{req.q.name}: {req.num_tokens} tokens need 2^31 threads or more; split the call")
    return with_dense(req, chosen)


def angle_builds(req: Request, layout_denser: bool) -> list[FixedGeometry]:
    """The (small, large) builds that compute cos and sin for the request's geometry (arrays
    aside); NotImplementedError when none can serve it."""
    if not req.in_place and req.rotary_dim < req.cq.D:
        raise NotImplementedError(f"rotary_dim: {req.rotary_dim} of {req.cq.D} channels out of place; with inv_freq "
                                  "a partial window is rotated in place only (pass out=x / q_out=q, k_out=k, or "
                                  "rotate the whole head)")
    builds = angle_geometries(req.dtype, req.interleaved, req.cq.H, req.ck.H if req.ck is not None else 0, req.cq.D,
                              req.rotary_offset, req.rotary_dim, req.cos.dtype, layout_denser, req.pos_mode)
    if not builds:
        raise NotImplementedError(f"rotary_dim/rotary_offset: {req.rotary_dim} at {req.rotary_offset} is not a whole "
                                  f"number of the kernel's vectors for {req.dtype}; with inv_freq the window must "
                                  "be (tables serve any window)")
    return builds


def fixed_threads(req: Request, g: FixedGeometry) -> int:
    units = (g.rotary_dim if g.interleaved else g.rotary_dim // 2) // g.vec
    return req.num_tokens * ((g.q_heads + g.k_heads) // g.head_batch) * units


def fill_fixed(p: FixedParams, req: Request, g: FixedGeometry) -> None:
    """Every field of the specialised build's block (addresses too: bind rewrites those)."""
    runs = dense_strides(req, g.order) if g.dense else (0, 0, 0, 0)
    assert runs is not None, "a dense build chosen for arrays that are not dense"
    for w, (info, c) in enumerate(_views(req)):
        side, kind = w // 2, w % 2  # (q, q_out, k, k_out): side 0 is q, 1 is k; kind 1 an output
        run = runs[w]
        if kind == 0:
            p.in_[side], p.in_sb[side], p.in_ss[side], p.in_sh[side] = info.ptr, c.sb, c.ss, c.sh
            p.dense_in[side] = run
        else:
            p.out[side], p.out_sb[side], p.out_ss[side], p.out_sh[side] = info.ptr, c.sb, c.ss, c.sh
            p.dense_out[side] = run
    fill_positions_and_tables(p, req)
    p.seq_len = max(req.cq.S, 1)
    p.sin_sign = -1.0 if req.inverse else 1.0
    p.table_vec = table_vec(req, g.vec // 2 if g.interleaved else g.vec)
    p.attention = req.attention
    p.total = fixed_threads(req, g)
    p.div_seq = fast_divisor(p.seq_len)


def fixed_launch_shape(req: Request, g: FixedGeometry) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    total = fixed_threads(req, g)
    block = FIXED_SMALL_BLOCK if total < FIXED_SMALL_THREADS else FIXED_BLOCK
    return (max(1, -(-total // block)), 1, 1), (block, 1, 1)


def tokens_denser(req: Request) -> bool:
    """Whether consecutive tokens of a head lie closer in memory than consecutive heads (bhsd)."""
    return not (req.cq.H <= 1 or req.num_tokens <= 1 or abs(req.cq.sh) <= abs(req.cq.ss))


def token_tile(req: Request, units: int) -> int:
    """Tokens per tile of the thread order (tile, head group, token, unit).

    1 when heads are the denser axis (bshd, thd): a warp covers one token's heads, in memory
    order. When tokens are (bhsd), TILE_THREADS // units tokens: a warp reads consecutive rows
    of one head (one contiguous run), and the block's other warps, on other heads, find the
    same cos/sin rows in L1. This order keeps its rate at every sequence length, where walking
    each head's tokens end to end (a tile of every token) falls behind on long sequences.
    """
    if not tokens_denser(req):
        return 1
    return max(1, min(TILE_THREADS // max(units, 1), req.num_tokens))


@dataclass(frozen=True)
class IndexSpace:
    """The flat kernel's threads for one launch: rot_total rotating threads (one per token, head
    group and unit, the token count rounded up to whole tiles), then the copying ones."""

    head_batch: int
    tile: int
    units: int        # vector units per head group
    groups: int       # head groups
    copy_units: int   # units per head outside the rotary window (out of place), else 0
    heads: int
    rot_total: int
    total: int

    @property
    def narrow(self) -> bool:
        """Whether the launch fits the 32-bit entry (rope.cu: rope_apply, not rope_apply_wide)."""
        return self.total < NARROW_LIMIT


def index_space(req: Request, vec: int) -> IndexSpace:
    """The one derivation of the launch's threads: fill_params, launch_shape and kernel_for all read it."""
    D, R = req.cq.D, req.rotary_dim
    units = (R if req.interleaved else R // 2) // vec
    copy_units = (D - R) // vec if (not req.in_place and R < D) else 0
    heads = req.cq.H + (req.ck.H if req.ck is not None else 0)
    hb = head_batch(req)
    groups = -(-heads // hb)
    tile = token_tile(req, units)
    tokens = -(-req.num_tokens // tile) * tile  # whole tiles; the kernel skips the padding
    rot_total = tokens * groups * units
    return IndexSpace(hb, tile, units, groups, copy_units, heads, rot_total, rot_total + tokens * heads * copy_units)


def is_narrow(req: Request, vec: int) -> bool:
    """Whether the launch runs the 32-bit entry point."""
    return index_space(req, vec).narrow


def head_batch(req: Request) -> int:
    """Heads per thread for this launch (registry.rope_head_batch: 1 for small launches)."""
    heads = req.cq.H + (req.ck.H if req.ck is not None else 0)
    return rope_head_batch(req.interleaved, small=req.num_tokens * heads < SMALL_TOKEN_HEADS,
                           heads_inner=not tokens_denser(req))


def kernel_for(kernels: dict, req: Request, vec: int):
    """The entry (narrow or wide) of the kernel for this launch, from a plan's loaded kernels."""
    space = index_space(req, vec)
    return kernels[(vec, space.head_batch)][0 if space.narrow else 1]


def launch_shape(req: Request, vec: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of the flat kernel: one thread per (token, head, vector unit), like a copy."""
    total = index_space(req, vec).total
    # Below NARROW_LIMIT one thread per index; past it the kernel grid-strides up to the limit.
    blocks = min(max(1, -(-total // BLOCK_THREADS)), GRID_LIMIT)
    return (blocks, 1, 1), (BLOCK_THREADS, 1, 1)
