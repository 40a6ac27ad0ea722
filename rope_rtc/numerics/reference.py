"""NumPy reference implementations of rope_rtc's numerical contracts.

Two contracts live here (docs/design.md, "Numerical contracts"):

* **General RoPE** is held to a float64 reference fed the same FP32 cos/sin tables as the GPU.
  :func:`rope_reference` computes it, :func:`rope_error_bound` states how far a correct FP32,
  FP16 or BF16 result may be from it, and :func:`assert_rope_close` applies that bound to a
  whole tensor and reports the worst offender.
* **Tail RoPE** (the prepared BF16 tail seed) is bit-exact. :func:`tail_rope_reference`
  reproduces it exactly, using :func:`fma_f32` (a correctly rounded FP32 fused multiply-add,
  emulated because NumPy has none) and :func:`bf16_rne`.

The code is one module per contract (``ref_rope``, ``ref_tail``, ``ref_cache``, ``ref_mla``, ``ref_mrope``,
``ref_qk_norm``) over the shared arithmetic of ``rounding``; this module gathers their public
names. Pure NumPy and ml_dtypes: no GPU, no CuPy. Everything is vectorised; nothing loops over
tokens.
"""

from __future__ import annotations

from .ref_cache import FP8_DTYPES, FP8_MAX, fp8_quantize, rope_and_cache_reference  # noqa: F401
from .ref_mla import mla_rope_and_cache_reference  # noqa: F401
from .ref_mrope import (MROPE_STREAM_COUNTS, mrope_kernel_arithmetic, mrope_reference, mrope_sections,  # noqa: F401
                        mrope_streams)
from .ref_qk_norm import (qk_norm_error_bound, qk_norm_reference, qk_norm_rope_reference,  # noqa: F401
                          qk_norm_rope_transformers_reference)
from .ref_rope import assert_rope_close, rope_error_bound, rope_kernel_arithmetic, rope_reference  # noqa: F401
from .ref_tail import TAIL_CHANNELS, TAIL_HEAD_DIMS, TAIL_TABLE_COLUMNS, tail_rope_reference  # noqa: F401
from .rounding import BFLOAT16, bf16_rne, fma_f32, round_to_dtype  # noqa: F401

__all__ = [
    "TAIL_CHANNELS",
    "TAIL_HEAD_DIMS",
    "TAIL_TABLE_COLUMNS",
    "assert_rope_close",
    "bf16_rne",
    "fma_f32",
    "rope_error_bound",
    "rope_reference",
    "round_to_dtype",
    "tail_rope_reference",
]
