"""Every kernel specialisation rope_rtc can build, as one enumerable list.

A :class:`KernelSpec` names a source file, its compile-time defines and the ``extern "C"``
entry points it provides. ``rope-rtc warm`` compiles ``warm_specs()``: ``all_specs()`` without
the demo's and the benchmark's kernels (``DEMO_FAMILIES``), which compile where they are used.
The API modules build their specs with the functions here, so what is warmed is exactly what
is launched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# pos_mode codes (rope.cu: POS_*): the position scheme a build may fix at compile time (FIX_POS).
POS_OFFSET, POS_OFFSETS, POS_POSITIONS, POS_CU_SEQLENS = 0, 1, 2, 3
POS_MODES = (POS_OFFSET, POS_OFFSETS, POS_POSITIONS, POS_CU_SEQLENS)

# dtype name -> code of ROPE_DTYPE in cuda_src/common.cuh
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# 16-byte vectors are the widest global access; narrower widths serve windows and strides that
# are not 16-byte aligned.
VECTOR_BYTES = (16, 8, 4, 2)

TAIL_DIMS = (128, 512)
# Head counts warmed by default for the tail kernel (the contract specialises on H); others
# compile on first use or with `rope-rtc warm --tail-heads`.
DEFAULT_TAIL_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class KernelSpec:
    family: str
    source: str
    entries: tuple[str, ...]
    defines: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        if not self.defines:
            return self.family
        return f"{self.family}[{','.join(f'{k}={v}' for k, v in self.defines)}]"


# Programmatic dependent launch (griddepcontrol): sm_90 and newer.
PDL_MIN_ARCH = 90


# The families a plan with pdl=True loads in their waiting build (rope_rtc.ops.rope_plan).
PDL_FAMILIES = ("rope", "rope_fixed")
_WAITS = ("ROPE_PDL", "1")  # the define of the waiting builds


def waiting_for_producer(spec: KernelSpec) -> KernelSpec:
    """``spec`` built to wait for the kernel before it (``ROPE_PDL``, cuda_src/common.cuh), for a
    launch with programmatic stream serialization."""
    return KernelSpec(spec.family, spec.source, spec.entries, spec.defines + (_WAITS,))


def waiting_builds(specs, arch: int) -> list[KernelSpec]:
    """The waiting builds of ``specs`` that a ``pdl=True`` plan on ``arch`` may load (none before
    sm_90)."""
    return [waiting_for_producer(s) for s in specs if s.family in PDL_FAMILIES] if arch >= PDL_MIN_ARCH else []


def not_waiting(spec: KernelSpec) -> KernelSpec | None:
    """The build ``spec`` is the waiting build of (:func:`waiting_for_producer`), or None."""
    if _WAITS not in spec.defines:
        return None
    return KernelSpec(spec.family, spec.source, spec.entries, tuple(d for d in spec.defines if d != _WAITS))


def blog_spec() -> KernelSpec:
    return KernelSpec("blog", "blog_kernels.cu",
                      ("rope_blog_baseline", "rope_blog_vectorized", "rope_blog_fused_qk"))


#: Families that only ``rope-rtc demo`` and the benchmark launch (rope_rtc.ops.blog). A production
#: cache never needs them, so ``warm`` leaves them out unless ``--kernels`` names them; the demo
#: and the benchmark compile them on first use.
DEMO_FAMILIES = frozenset({"blog"})


def rope_head_batch(interleaved: bool, small: bool = False, heads_inner: bool = True) -> int:
    """Heads one thread of the general kernel rotates (ROPE_HEAD_BATCH).

    Small launches (decode) are latency-bound and fastest with one head per thread. Prefill:
    half-split pairs gain from sharing the table slice and the index arithmetic across 2 heads;
    interleaved pairs gain from 4 heads when tokens are the denser axis (bhsd) but lose against
    1 head when heads are (bshd, thd).
    """
    if small or (interleaved and heads_inner):
        return 1
    return 4 if interleaved else 2


def rope_head_batches(interleaved: bool) -> tuple[int, ...]:
    """Every head batch the general kernel is built with for this pair style."""
    return tuple(sorted({rope_head_batch(interleaved, small, inner) for small in (False, True)
                         for inner in (False, True)}))


# The general kernel's entry points: 32-bit indices (below 2^31 threads) and the 64-bit loop.
ROPE_ENTRIES = ("rope_apply", "rope_apply_wide")


def rope_spec(dtype: str, interleaved: bool, vec: int, head_batch: int | None = None) -> KernelSpec:
    """The general kernel for one dtype, pair style, vector width and head batch (default: the
    prefill batch)."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype!r} has no kernel; supported: {sorted(DTYPE_CODES)}")
    hb = rope_head_batch(interleaved) if head_batch is None else int(head_batch)
    return KernelSpec(
        "rope", "rope.cu", ROPE_ENTRIES,
        (("ROPE_DTYPE", str(DTYPE_CODES[dtype])), ("ROPE_INTERLEAVED", str(int(interleaved))),
         ("ROPE_VEC", str(vec)), ("ROPE_HEAD_BATCH", str(hb))),
    )


def rope_vector_widths(dtype: str, interleaved: bool) -> tuple[int, ...]:
    """Elements per access the general kernel is built with, widest first."""
    size = ITEMSIZE[dtype]
    widths = [b // size for b in VECTOR_BYTES if b >= size]
    return tuple(w for w in widths if not interleaved or w % 2 == 0)


# The specialised general kernel (cuda_src/rope_fixed.cu): one entry point, 32-bit indices.
FIXED_ENTRIES = ("rope_fixed",)


@dataclass(frozen=True)
class FixedGeometry:
    """What a specialised build of the general kernel fixes: the model's geometry (dtype, pair
    style, q and k head counts, head dim, rotary window), the launch shape chosen for it
    (vector width, heads per thread, thread order) and, where it measured faster, the call's
    position scheme. ``k_heads == 0``: a launch without k."""

    dtype: str
    interleaved: bool
    q_heads: int
    k_heads: int
    head_dim: int
    rotary_offset: int
    rotary_dim: int
    vec: int
    head_batch: int
    order: int  # 0: (token, head group, unit), heads denser; 1: (batch, head group, token, unit), bhsd
    # Multimodal RoPE (rope_rtc.ops.mrope): (style, s0, .., s[n-1]) for n = 2, 3 or 4 position streams (three:
    # (style, t, h, w)), style 1 contiguous sections, 2 interleaved; () for none.
    mrope: tuple = ()
    # cos/sin computed in the kernel (cuda_src/angles.cuh): 0 tables, ANGLE_MODES[inv_freq dtype] otherwise.
    angles: int = 0
    # The position scheme (rope_params.POS_MODES), compile-time (FIX_POS); -1: read from the block.
    pos_mode: int = -1
    # One run-time stride per array (FIX_DENSE: heads, or rows in bhsd, head_dim apart; batches
    # one after another); with an offset, offsets or positions compiled in, every field the
    # kernel reads lies in the block's first two lines.
    dense: bool = False

    def spec(self) -> KernelSpec:
        mrope = () if not self.mrope else mrope_defines(self.mrope)
        if self.angles:
            mrope += (("FIX_ANGLES", str(self.angles)),)
        if self.pos_mode >= 0:
            mrope += (("FIX_POS", str(self.pos_mode)),)
        if self.dense:
            mrope += (("FIX_DENSE", "1"),)
        return KernelSpec(
            "rope_fixed", "rope_fixed.cu", FIXED_ENTRIES,
            (("ROPE_DTYPE", str(DTYPE_CODES[self.dtype])), ("ROPE_INTERLEAVED", str(int(self.interleaved))),
             ("ROPE_VEC", str(self.vec)), ("FIX_HQ", str(self.q_heads)), ("FIX_HK", str(self.k_heads)),
             ("FIX_D", str(self.head_dim)), ("FIX_RO", str(self.rotary_offset)), ("FIX_RD", str(self.rotary_dim)),
             ("FIX_HB", str(self.head_batch)), ("FIX_ORDER", str(self.order))) + mrope)


# The defines of a multimodal build's sections, one per stream (cuda_src/rope_fixed.cu).
MROPE_SECTION_DEFINES = ("FIX_MT", "FIX_MH", "FIX_MW", "FIX_MX")


def mrope_defines(mrope: tuple) -> tuple[tuple[str, str], ...]:
    """The defines of ``FixedGeometry.mrope`` (style, then one section per stream). Three streams
    (Qwen2-VL, Qwen3-VL) keep the defines they always had, so their builds compile exactly the
    source they did; two or four add FIX_MN, the stream count."""
    style, sections = mrope[0], mrope[1:]
    out = (("FIX_MROPE", str(style)),) + tuple((name, str(v)) for name, v in zip(MROPE_SECTION_DEFINES, sections))
    return out if len(sections) == 3 else out + (("FIX_MN", str(len(sections))),)


# Per-head RMSNorm fused with RoPE (cuda_src/qk_norm_rope.cu, rope_rtc/ops/qk_norm.py).
NORM_ENTRIES = ("qk_norm_rope",)
NORM_MODES = {"exact": 0, "transformers": 1}


@dataclass(frozen=True)
class NormGeometry:
    """What a build of the fused QK-norm + RoPE kernel fixes: the model's geometry, the weights'
    type, the numerics and the vector width (head_dim / vec lanes per head)."""

    dtype: str
    interleaved: bool
    q_heads: int
    k_heads: int
    head_dim: int
    rotary_offset: int
    rotary_dim: int
    vec: int
    weights_f32: bool
    numerics: str
    head_batch: int = 1  # heads per lane group (norm_head_batch)
    staged: bool = False  # the vectors through shared memory (norm_stageable; large launches)

    @property
    def split(self) -> bool:
        """Half-split pairs over the whole head: a lane holds both halves of its pairs
        (NORM_SPLIT in cuda_src/qk_norm_rope.cu)."""
        return norm_split(self.interleaved, self.head_dim, self.rotary_offset, self.rotary_dim)

    @property
    def lanes(self) -> int:
        return self.head_dim // self.vec // (2 if self.split else 1)

    def spec(self) -> KernelSpec:
        return KernelSpec(
            "qk_norm_rope", "qk_norm_rope.cu", NORM_ENTRIES,
            (("ROPE_DTYPE", str(DTYPE_CODES[self.dtype])), ("ROPE_INTERLEAVED", str(int(self.interleaved))),
             ("ROPE_VEC", str(self.vec)), ("NORM_HQ", str(self.q_heads)), ("NORM_HK", str(self.k_heads)),
             ("NORM_D", str(self.head_dim)), ("NORM_RO", str(self.rotary_offset)), ("NORM_RD", str(self.rotary_dim)),
             ("NORM_WF32", str(int(self.weights_f32))), ("NORM_MODE", str(NORM_MODES[self.numerics])),
             ("NORM_HB", str(self.head_batch)), ("NORM_STAGED", str(int(self.staged)))))


# Threads from which a fused QK-norm launch takes the staged build: at Qwen3-8B's heads it is
# faster from about 4096 tokens (2^18.3 threads), level at 2048 and slower below, where the trip
# through shared memory lengthens a small launch.
NORM_STAGED_THREADS = 2**18


def norm_stageable(g: NormGeometry) -> bool:
    """Whether build ``g`` has a staged twin: half-split pairs over the whole head, 16-byte vectors
    (cp.async's widest copy, one per vector)."""
    return g.split and g.vec * ITEMSIZE[g.dtype] == 16


def norm_builds(dtype: str, interleaved: bool, q_heads: int, k_heads: int, head_dim: int, rotary_offset: int,
                rotary_dim: int, weights_f32: bool, numerics: str) -> list[NormGeometry]:
    """Every build a fused QK-norm plan of this geometry can launch: one per vector width the
    geometry allows, and the staged twin of each that has one."""
    out = []
    for vec in norm_vector_widths(dtype, interleaved, head_dim, rotary_offset, rotary_dim):
        g = NormGeometry(dtype, interleaved, q_heads, k_heads, head_dim, rotary_offset, rotary_dim, vec, weights_f32,
                         numerics, norm_head_batch(q_heads, k_heads))
        out += [g, replace(g, staged=True)] if norm_stageable(g) else [g]
    return out


def norm_head_batch(q_heads: int, k_heads: int) -> int:
    """Heads one lane group of the fused QK-norm kernel handles: the largest of 4, 2, 1 dividing
    both head counts (the position, table slice and weights are read once per group)."""
    return next(hb for hb in (4, 2, 1) if q_heads % hb == 0 and k_heads % hb == 0)


def norm_split(interleaved: bool, head_dim: int, rotary_offset: int, rotary_dim: int) -> bool:
    """Whether the fused QK-norm kernel gives each lane both halves of its pairs: half-split pairs
    over the whole head (two vectors per lane and head, no partner exchange between lanes)."""
    return not interleaved and rotary_offset == 0 and rotary_dim == head_dim


def norm_vector_widths(dtype: str, interleaved: bool, head_dim: int, rotary_offset: int, rotary_dim: int) -> tuple:
    """Vector widths (elements) the fused QK-norm kernel can use for a geometry, widest first:
    a head must be a power-of-two number of lanes, at most a warp, and the window whole vectors
    (pairs inside a vector for interleaved pairs)."""
    per_lane = 2 if norm_split(interleaved, head_dim, rotary_offset, rotary_dim) else 1
    out = []
    for vec in rope_vector_widths(dtype, interleaved):
        lanes, span = head_dim // (vec * per_lane), rotary_dim if interleaved else rotary_dim // 2
        if (head_dim % (vec * per_lane) or lanes > 32 or lanes & (lanes - 1) or rotary_offset % vec or span % vec
                or (interleaved and vec % 2)):
            continue
        out.append(vec)
    return tuple(out)


# Bytes per access of the specialised build: half-split pairs read two vectors per thread and
# are fastest at 8 bytes each (2-byte types and FP32 alike), 16 bytes per thread as interleaved
# pairs' one 16-byte vector (benchmarks/probes/fixed_sweep.py sweeps the width).
def fixed_vector_bytes(dtype: str, interleaved: bool) -> int:
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype {dtype!r} has no kernel; supported: {sorted(DTYPE_CODES)}")
    return 16 if interleaved else 8


def fixed_geometry(dtype: str, interleaved: bool, q_heads: int, k_heads: int, head_dim: int,
                   rotary_offset: int, rotary_dim: int, tokens_denser: bool, pos_mode: int = -1) -> FixedGeometry | None:
    """The specialised build for a model's geometry, thread order and position scheme
    (``pos_mode``: a ``rope_params.POS_MODES`` code, -1 for a build that reads it from the block),
    or None when the window is not a whole number of the build's vectors (the generic kernel
    serves it)."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype!r} has no kernel; supported: {sorted(DTYPE_CODES)}")
    vec = fixed_vector_bytes(dtype, interleaved) // ITEMSIZE[dtype]
    span = rotary_dim if interleaved else rotary_dim // 2
    if rotary_dim <= 0 or rotary_dim % 2 or span % vec or rotary_offset % vec or q_heads <= 0 or k_heads < 0:
        return None
    order = 1 if tokens_denser else 0
    # One head per thread, but two for 16-bit pairs where a warp walks one head's rows (bhsd):
    # there two share the table slice at no cost, where for FP32 a second head per thread is
    # slower (benchmarks/probes/fixed_sweep.py).
    hb = 2 if (order == 1 and ITEMSIZE[dtype] == 2 and q_heads % 2 == 0 and k_heads % 2 == 0) else 1
    # The position scheme is compile-time, so the index load issues first (faster at decode and on
    # half-split prefill), but for bf16 interleaved pairs in bhsd order, which are slower with it
    # (benchmarks/probes/fixed_sweep.py): they read it from the block.
    if dtype == "bfloat16" and interleaved and order == 1:
        pos_mode = -1
    return FixedGeometry(dtype, bool(interleaved), q_heads, k_heads, head_dim, rotary_offset, rotary_dim, vec, hb,
                         order, pos_mode=pos_mode)


def both_strides(builds: list[FixedGeometry]) -> list[FixedGeometry]:
    """``builds`` and their dense builds (FixedGeometry.dense): what a plan loads and ``warm``
    compiles, since the call's arrays decide which one runs."""
    return list(builds) + [replace(g, dense=True) for g in builds]


def mrope_head_batch(q_heads: int, k_heads: int, interleaved_sections: bool, small: bool,
                     gathered: bool = False) -> int:
    """Heads per thread of a multimodal RoPE build: sharing a thread's table slice across heads
    pays on prefill (2 heads for contiguous sections, 4 for interleaved ones read per thread,
    whose pairs read up to three rows each), one head (two for interleaved sections) on small
    launches such as decode. ``gathered``: interleaved sections whose warps or block gather their
    tokens' merged rows first (token-major order, cuda_src/rope_fixed.cu): two heads on
    prefill, one on small launches (twice the threads share the gather's wait at decode).
    Always a divisor of both head counts."""
    if gathered:
        want = 1 if small else 2
    else:
        want = (2 if interleaved_sections else 1) if small else (4 if interleaved_sections else 2)
    while want > 1 and (q_heads % want or k_heads % want):
        want //= 2
    return want


def mrope_geometries(dtype: str, q_heads: int, k_heads: int, head_dim: int, rotary_dim: int, sections: tuple,
                     interleaved_sections: bool, tokens_denser: bool) -> list[FixedGeometry]:
    """The multimodal RoPE builds of one geometry and thread order: for small launches and large
    ones (their heads per thread differ). Empty when the window is not a whole number of vectors."""
    g = fixed_geometry(dtype, False, q_heads, k_heads, head_dim, 0, rotary_dim, tokens_denser)
    if g is None:
        return []
    mrope = (2 if interleaved_sections else 1,) + tuple(int(v) for v in sections)
    gathered = interleaved_sections and g.order == 0  # MROPE_WARP or MROPE_SHARED in cuda_src/rope_fixed.cu
    return [replace(g, mrope=mrope, head_batch=mrope_head_batch(q_heads, k_heads, interleaved_sections, small,
                                                                gathered))
            for small in (True, False)]


#: Builds that compute cos and sin in the kernel, by the dtype of the inverse frequencies:
#: float64 for numerics "exact", float32 for "transformers" (cuda_src/angles.cuh).
ANGLE_MODES = {"float64": 1, "float32": 2}


def angle_head_batch(q_heads: int, k_heads: int, small: bool) -> int:
    """Heads per thread of a build that computes its angles: the cos/sin of a thread's pairs
    cost about twenty float64 operations each, shared by the thread's heads, so prefill takes up
    to 4 heads per thread (faster than 2 and 8); small launches (decode) one. Always a divisor
    of both head counts."""
    want = 1 if small else 4
    while want > 1 and (q_heads % want or k_heads % want):
        want //= 2
    return want


def angle_geometries(dtype: str, interleaved: bool, q_heads: int, k_heads: int, head_dim: int, rotary_offset: int,
                     rotary_dim: int, inv_freq_dtype: str, tokens_denser: bool, pos_mode: int = -1) -> list[FixedGeometry]:
    """The builds that compute cos and sin from ``inv_freq`` for one geometry and thread order:
    for small launches and large ones (their heads per thread differ). Empty when the window is
    not a whole number of vectors. The small launches' build compiles in the position scheme
    ``pos_mode`` (-1: read from the block), so that its index load is issued first, as the table
    builds' is; the large one reads it from the block, which is faster on prefill."""
    g = fixed_geometry(dtype, interleaved, q_heads, k_heads, head_dim, rotary_offset, rotary_dim, tokens_denser)
    if g is None:
        return []
    mode = ANGLE_MODES[inv_freq_dtype]
    large = replace(g, angles=mode, head_batch=angle_head_batch(q_heads, k_heads, False))
    # Small launches are latency-bound: half the vector, so a thread evaluates half the pairs
    # (measured faster than the table build at decode, where the full vector was slower).
    half = g.vec // 2
    small_vec = half if half >= (2 if interleaved else 1) and rotary_offset % half == 0 else g.vec
    small = replace(g, angles=mode, vec=small_vec, head_batch=angle_head_batch(q_heads, k_heads, True),
                    pos_mode=pos_mode)
    return [small, large]


def model_pos_modes(tokens_denser: bool) -> tuple[int, ...]:
    """The position schemes a thread order serves: cu_seqlens (packed ``thd`` tokens) only the
    token-major one."""
    return tuple(m for m in POS_MODES if not (tokens_denser and m == POS_CU_SEQLENS))


def model_fixed_specs(dtype: str, interleaved: bool, q_heads: int, kv_heads: int, head_dim: int,
                      rotary_dim: int, rotary_offset: int = 0) -> list[KernelSpec]:
    """Every specialised build a model's calls use: q with k, q alone and k alone, in both thread
    orders (bshd/thd/sbhd and bhsd), for each position scheme, strided and dense."""
    out = []
    for hq, hk in ((q_heads, kv_heads), (q_heads, 0), (kv_heads, 0)):
        for denser in (False, True):
            for mode in model_pos_modes(denser):
                g = fixed_geometry(dtype, interleaved, hq, hk, head_dim, rotary_offset, rotary_dim, denser, mode)
                for build in both_strides([g] if g is not None else []):
                    if build.spec() not in out:
                        out.append(build.spec())
    return out


# Geometries warmed by default: the common head layouts of current models at head dim 128.
DEFAULT_FIXED_HEADS = ((32, 8), (32, 32))


# RoPE fused with the paged KV-cache write (cuda_src/rope_cache.cu).
CACHE_ENTRIES = ("rope_cache",)
CACHE_KIND_NAMES = {0: "the input dtype", 1: "fp8_e4m3", 2: "fp8_e5m2"}


def cache_head_batch(q_heads: int, k_heads: int, dtype: str, interleaved: bool, vec: int) -> int:
    """Heads one thread of the fused RoPE + cache-write kernel handles (KV_HB): 2 where one head's
    share of a thread (a vector, or a vector of each half for half-split pairs) is at most 16
    bytes and both head counts are even, else 1. Prefill is fastest with about 32 bytes of q/k in
    flight per thread: 8-byte halves (half-split) and 16-byte vectors (interleaved) with 2 heads;
    FP32 half-split 16-byte halves with 1 head are as fast as 8-byte ones with 2."""
    unit = vec * ITEMSIZE[dtype] * (1 if interleaved else 2)
    return 2 if unit <= 16 and q_heads % 2 == 0 and k_heads % 2 == 0 else 1


def cache_vector_widths(dtype: str, interleaved: bool, kind: int = 0) -> tuple[int, ...]:
    """Elements per access of the fused RoPE + cache-write kernel, in order of preference. Cache
    entries of the input dtype (``kind`` 0): the specialised build's width first (8-byte halves
    for half-split pairs measured fastest here too, or as fast), then the others, widest first.
    FP8 entries: widest first, so an entry store is as wide as it can be (wide entry stores with
    one head per thread beat narrower ones with two heads on prefill)."""
    widths = rope_vector_widths(dtype, interleaved)
    if kind:
        return widths
    first = fixed_vector_bytes(dtype, interleaved) // ITEMSIZE[dtype]
    return tuple([first] + [w for w in widths if w != first]) if first in widths else widths


def cache_spec(dtype: str, interleaved: bool, vec: int, kind: int, q_heads: int, k_heads: int, head_dim: int,
               rotary_dim: int, head_batch: int | None = None) -> KernelSpec:
    """The fused RoPE + cache-write kernel for one geometry, vector width and cache kind
    (``head_batch``: heads per thread, :func:`cache_head_batch` by default)."""
    if head_batch is None:
        head_batch = cache_head_batch(q_heads, k_heads, dtype, interleaved, vec)
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype!r} has no kernel; supported: {sorted(DTYPE_CODES)}")
    if kind not in CACHE_KIND_NAMES:
        raise ValueError(f"cache kind {kind!r}: expected one of {sorted(CACHE_KIND_NAMES)}")
    return KernelSpec(
        "rope_cache", "rope_cache.cu", CACHE_ENTRIES,
        (("ROPE_DTYPE", str(DTYPE_CODES[dtype])), ("ROPE_INTERLEAVED", str(int(interleaved))), ("ROPE_VEC", str(vec)),
         ("CACHE_KIND", str(kind)), ("KV_HQ", str(q_heads)), ("KV_HK", str(k_heads)), ("KV_D", str(head_dim)),
         ("KV_RD", str(rotary_dim)), ("KV_HB", str(head_batch))))


def tail_spec(heads: int, dim: int) -> KernelSpec:
    return KernelSpec("tail", "tail_rope.cu", ("tail_rope_bf16_x1",),
                      (("TAIL_HEADS", str(int(heads))), ("TAIL_DIM", str(int(dim)))))


def all_specs(tail_heads: tuple[int, ...] = DEFAULT_TAIL_HEADS) -> list[KernelSpec]:
    """Every registered specialisation: the library's (:func:`warm_specs`) and the demo's."""
    specs = [blog_spec()]
    for dtype in DTYPE_CODES:
        for interleaved in (False, True):
            specs += [rope_spec(dtype, interleaved, v, hb) for v in rope_vector_widths(dtype, interleaved)
                      for hb in rope_head_batches(interleaved)]
    for dtype in DTYPE_CODES:
        for interleaved in (False, True):
            for hq, hk in DEFAULT_FIXED_HEADS:
                specs += [s for s in model_fixed_specs(dtype, interleaved, hq, hk, 128, 128) if s not in specs]
    specs += [tail_spec(h, d) for d in TAIL_DIMS for h in sorted(set(tail_heads))]
    return specs


def warm_specs(tail_heads: tuple[int, ...] = DEFAULT_TAIL_HEADS) -> list[KernelSpec]:
    """What ``rope-rtc warm`` compiles by default: every registered specialisation the library
    launches, none of ``DEMO_FAMILIES``."""
    return [s for s in all_specs(tail_heads) if s.family not in DEMO_FAMILIES]
