"""Tensor layouts of the general API, reduced to one canonical view.

Every layout becomes ``(B, S, H, D)`` with element strides ``(sb, ss, sh)`` for the batch,
sequence and head axes; the last axis is always contiguous. ``thd`` (packed tokens) is one
sequence of T tokens: B = 1, S = T.

``layout=None`` (the general API's default) takes a layout only where the array's rank settles
it: a 3-d array is ``thd``. A 4-d array is refused (:func:`default_layout`): ``[B, S, H, D]``
(engines) and ``[B, H, S, D]`` (torch and Hugging Face attention) have the same rank, and
reading one as the other returns wrong values without any error.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("bshd", "bhsd", "sbhd", "thd")


@dataclass(frozen=True)
class Canonical:
    B: int
    S: int
    H: int
    D: int
    sb: int
    ss: int
    sh: int


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r} is not one of {', '.join(map(repr, LAYOUTS))}")


def default_layout(shape: tuple[int, ...], name: str) -> str:
    """The layout of ``name``, of ``shape``, passed without ``layout=``: ``"thd"`` for a 3-d array.
    ``ValueError`` for any other rank, naming the layouts a 4-d array may have."""
    shape = tuple(shape)
    if len(shape) == 3:
        return "thd"
    if len(shape) == 4:
        raise ValueError(f"layout: {name} has shape {shape}, and a 4-d array's axes cannot be told from its shape; "
                         f"pass layout=\"bshd\" for [B, S, H, D] (vLLM, FlashInfer, most engines), layout=\"bhsd\" "
                         f"for [B, H, S, D] (torch and Hugging Face attention) or layout=\"sbhd\" for [S, B, H, D]")
    raise ValueError(f"{name}: expected a 3-d [T, H, D] array, or a 4-d one with layout=\"bshd\", \"bhsd\" or "
                     f"\"sbhd\"; got shape {shape}")


def canonical(shape: tuple[int, ...], strides: tuple[int, ...], layout: str, name: str) -> Canonical:
    want = 3 if layout == "thd" else 4
    if len(shape) != want:
        raise ValueError(f"{name}: layout {layout!r} needs a {want}-d array ({'/'.join(layout.upper())}), got shape {shape}")
    if layout == "bshd":
        (B, S, H, D), (sb, ss, sh) = shape, strides[:3]
    elif layout == "bhsd":
        B, H, S, D = shape
        sb, sh, ss = strides[:3]
    elif layout == "sbhd":
        S, B, H, D = shape
        ss, sb, sh = strides[:3]
    else:
        T, H, D = shape
        B, S, sb, (ss, sh) = 1, T, 0, strides[:2]
    return Canonical(B, S, H, D, sb, ss, sh)


def to_bshd_index(layout: str) -> tuple[int, ...]:
    """The axis permutation taking a layout's array to (B, S, H, D) (thd: (T, H, D))."""
    return {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3), "thd": (0, 1, 2)}[layout]
