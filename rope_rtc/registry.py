"""Every kernel specialisation rope_rtc can build, as one enumerable list.

A :class:`KernelSpec` names a source file, its compile-time defines and the ``extern "C"``
entry points it provides. ``rope-rtc warm`` compiles ``all_specs()``; the API modules build
their specs with the functions here, so what is warmed is exactly what is launched.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def blog_spec() -> KernelSpec:
    return KernelSpec("blog", "blog_kernels.cu",
                      ("rope_blog_baseline", "rope_blog_vectorized", "rope_blog_fused_qk"))


def rope_head_batch(interleaved: bool, small: bool = False, heads_inner: bool = True) -> int:
    """Heads one thread of the general kernel rotates (ROPE_HEAD_BATCH).

    Small launches (decode) are latency-bound and fastest with one head per thread. Prefill:
    half-split pairs gain from sharing the table slice and the index arithmetic across 2 heads;
    interleaved pairs gain from 4 heads when tokens are the denser axis (bhsd) but lose against
    1 head when heads are (bshd, thd). The measurements are in docs/performance.md.
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


def tail_spec(heads: int, dim: int) -> KernelSpec:
    return KernelSpec("tail", "tail_rope.cu", ("tail_rope_bf16_x1",),
                      (("TAIL_HEADS", str(int(heads))), ("TAIL_DIM", str(int(dim)))))


def all_specs(tail_heads: tuple[int, ...] = DEFAULT_TAIL_HEADS) -> list[KernelSpec]:
    specs = [blog_spec()]
    for dtype in DTYPE_CODES:
        for interleaved in (False, True):
            specs += [rope_spec(dtype, interleaved, v, hb) for v in rope_vector_widths(dtype, interleaved)
                      for hb in rope_head_batches(interleaved)]
    specs += [tail_spec(h, d) for d in TAIL_DIMS for h in sorted(set(tail_heads))]
    return specs
