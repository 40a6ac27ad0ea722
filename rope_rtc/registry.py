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


def rope_head_batch(interleaved: bool) -> int:
    """Heads one thread of the general kernel rotates (ROPE_HEAD_BATCH).

    Measured on the H200 with cold L2 (scripts/rope_variants.py, 2026-11-30): 1 or 2 heads leave
    62-88% of the copy rate; 4 gives 90-95% for half-split pairs; interleaved pairs touch one
    vector per head instead of two and need 8 to reach 93-94%.
    """
    return 8 if interleaved else 4


def rope_spec(dtype: str, interleaved: bool, vec: int) -> KernelSpec:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype!r} has no kernel; supported: {sorted(DTYPE_CODES)}")
    return KernelSpec(
        "rope", "rope.cu", ("rope_apply",),
        (("ROPE_DTYPE", str(DTYPE_CODES[dtype])), ("ROPE_INTERLEAVED", str(int(interleaved))),
         ("ROPE_VEC", str(vec)), ("ROPE_HEAD_BATCH", str(rope_head_batch(interleaved)))),
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
            specs += [rope_spec(dtype, interleaved, v) for v in rope_vector_widths(dtype, interleaved)]
    specs += [tail_spec(h, d) for d in TAIL_DIMS for h in sorted(set(tail_heads))]
    return specs
