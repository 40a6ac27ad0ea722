"""The host mirror of ``struct RopeParams`` in cuda_src/rope.cu (every field 8 bytes, same order)."""

from __future__ import annotations

import ctypes

# The pos_mode codes are the registry's (a build fixes one), here beside the blocks that carry them.
from ..build.registry import POS_CU_SEQLENS, POS_MODES, POS_OFFSET, POS_OFFSETS, POS_POSITIONS  # noqa: F401

_U64 = ctypes.c_uint64
_I64 = ctypes.c_int64

FIELDS = [
    ("q_in", _U64), ("q_out", _U64), ("k_in", _U64), ("k_out", _U64),
    ("q_in_sb", _I64), ("q_in_ss", _I64), ("q_in_sh", _I64),
    ("q_out_sb", _I64), ("q_out_ss", _I64), ("q_out_sh", _I64),
    ("k_in_sb", _I64), ("k_in_ss", _I64), ("k_in_sh", _I64),
    ("k_out_sb", _I64), ("k_out_ss", _I64), ("k_out_sh", _I64),
    ("cos", _U64), ("sin", _U64), ("positions", _U64), ("offsets", _U64), ("cu_seqlens", _U64),
    ("offset", _I64), ("num_tokens", _I64), ("seq_len", _I64), ("num_seqs", _I64),
    ("table_rows", _I64), ("table_stride", _I64),
    ("q_heads", _I64), ("k_heads", _I64), ("head_dim", _I64), ("rot_offset", _I64), ("rot_half", _I64),
    ("pos_mode", _I64), ("index_flags", _I64), ("inverse", _I64), ("copy_passthrough", _I64),
    ("table_vec", _I64), ("tile", _I64),
    ("units", _I64), ("groups", _I64), ("copy_units", _I64), ("rot_total", _I64), ("total", _I64),
    ("narrow", _I64),
    ("div_units", _U64), ("div_groups", _U64), ("div_tile", _U64), ("div_seq", _U64),
    ("div_copy_units", _U64), ("div_heads", _U64),
]


class RopeParams(ctypes.Structure):
    _fields_ = FIELDS


# index_flags bits (rope.cu: IDX_*)
IDX_POSITIONS_I64, IDX_OFFSETS_I64, IDX_CU_SEQLENS_I64 = 1, 2, 4


def fast_divisor(d: int) -> int:
    """``d`` packed for the kernel's ``fast_div``: ``m | l << 32`` with ``l = ceil(log2 d)`` and
    ``m = floor(2**32 * (2**l - d) / d) + 1``, so that ``(umulhi(n, m) + n) >> l == n // d`` for
    every ``n < 2**31`` (Granlund and Montgomery's invariant-divisor method)."""
    if not 1 <= d < 2**31:
        raise ValueError(f"fast_divisor: divisor {d} is outside [1, 2**31)")
    shift = (d - 1).bit_length()
    mul = (2**32 * (2**shift - d)) // d + 1
    return mul | shift << 32


def fast_div(n: int, packed: int) -> int:
    """What the kernel computes for ``n // d`` (the host-side model, for tests)."""
    mul, shift = packed & 0xFFFFFFFF, packed >> 32
    return (((n * mul) >> 32) + n) >> shift


# The host mirror of ``struct FixedParams`` in cuda_src/fixed_params.cuh ([0] is q, [1] is k). A dense
# build reads only the first two 64-byte lines; the plan sends a call whose counts or strides do
# not fit these 32-bit fields to the generic kernel (rope_launch.fits_fixed_block).
_PAIR = _I64 * 2
_U32, _I32 = ctypes.c_uint32, ctypes.c_int32
FIXED_FIELDS = [
    # What a call binds, in one run (rope_plan.FIXED_CALL packs them at once).
    ("in_", _U64 * 2), ("out", _U64 * 2),
    ("cos", _U64), ("sin", _U64), ("positions", _U64), ("offsets", _U64), ("cu_seqlens", _U64),
    ("offset", _U32), ("table_vec", _U32),
    # What the plan fixes.
    ("div_seq", _U64),
    ("total", _U32), ("table_rows", _U32), ("seq_len", _U32), ("table_stride", _I32),
    ("index_flags", _I32), ("sin_sign", ctypes.c_float),
    ("dense_in", _I32 * 2), ("dense_out", _I32 * 2),  # dense builds (FIX_DENSE): one stride per array
    # Read by some builds only, at the start of the block's third line.
    ("attention", ctypes.c_double),  # angles computed in the kernel only: the factor on cos and sin
    ("mrope_stride", _I32),  # multimodal RoPE builds only: elements between the position streams
    ("pos_mode", _I32),  # builds that read the position scheme from the block
    ("in_sb", _PAIR), ("in_ss", _PAIR), ("in_sh", _PAIR),
    ("out_sb", _PAIR), ("out_ss", _PAIR), ("out_sh", _PAIR),
    ("num_seqs", _I64), ("num_tokens", _I64),
]
# Where the dense builds' reads end (bytes): the block's first two lines.
DENSE_END = 128


class FixedParams(ctypes.Structure):
    _fields_ = FIXED_FIELDS
assert FixedParams.dense_out.offset + FixedParams.dense_out.size == DENSE_END
assert FixedParams.pos_mode.offset + FixedParams.pos_mode.size <= DENSE_END + 64  # the next line
assert ctypes.sizeof(FixedParams) <= ctypes.sizeof(RopeParams)  # they share a plan's block


# The host mirror of ``struct NormParams`` in cuda_src/qk_norm_rope.cu: FixedParams, then the
# weights (q's, k's) and eps. The same field names, so what fills a FixedParams fills its start.
NORM_FIELDS = FIXED_FIELDS + [("weight", _U64 * 2), ("eps", ctypes.c_float),
                              ("zero", ctypes.c_uint32)]  # never written: the staged build reads it as 0


class NormParams(ctypes.Structure):
    _fields_ = NORM_FIELDS
assert ctypes.sizeof(NormParams) <= ctypes.sizeof(RopeParams)  # they share a plan's block


# The host mirror of ``struct CacheParams`` in cuda_src/rope_cache.cu ([0] q, [1] k, [2] v).
_TRIPLE = _I64 * 3
CACHE_FIELDS = [
    ("in_", _U64 * 3), ("out", _U64 * 2),
    ("in_st", _TRIPLE), ("in_sh", _TRIPLE), ("out_st", _PAIR), ("out_sh", _PAIR),
    ("k_cache", _U64), ("v_cache", _U64),
    ("cache_sb", _I64), ("cache_so", _I64), ("cache_sh", _I64),
    ("num_slots", _I64), ("block_size", _I64),
    ("slot_mapping", _U64), ("k_scale", _U64), ("v_scale", _U64),
    ("cos", _U64), ("sin", _U64), ("positions", _U64), ("offsets", _U64), ("cu_seqlens", _U64),
    ("offset", _I64), ("num_tokens", _I64), ("num_seqs", _I64), ("table_rows", _I64), ("table_stride", _I64),
    ("pos_mode", _I64), ("index_flags", _I64), ("slot_i64", _I64), ("total", _I64),
    ("div_block", _U64),
]


class CacheParams(ctypes.Structure):
    _fields_ = CACHE_FIELDS
