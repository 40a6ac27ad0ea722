"""The host mirror of ``struct RopeParams`` in cuda_src/rope.cu (every field 8 bytes, same order)."""

from __future__ import annotations

import ctypes

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
    ("table_vec", _I64), ("heads_inner", _I64),
]


class RopeParams(ctypes.Structure):
    _fields_ = FIELDS


# pos_mode codes (rope.cu: POS_*)
POS_OFFSET, POS_OFFSETS, POS_POSITIONS, POS_CU_SEQLENS = 0, 1, 2, 3
# index_flags bits (rope.cu: IDX_*)
IDX_POSITIONS_I64, IDX_OFFSETS_I64, IDX_CU_SEQLENS_I64 = 1, 2, 4
