"""Axial RoPE of vision towers: the cos/sin tables whose columns each carry their own axis's
frequency (``axial_tables``) and the (height, width) positions of a tower's patches in the order
it lays them out (``vision_positions``).

A patch at (h, w) rotates the half-split pairs of its head (``rotate_half`` over the whole head):
pair columns ``[0, D/4)`` by ``h * a_i``, columns ``[D/4, D/2)`` by ``w * b_i``. That is
multimodal RoPE with two position streams and contiguous sections ``[D/4, D/4]``
(:func:`rope_rtc.apply_mrope_qk`), reading a table whose column j holds its axis's frequency: the
same kernel, no new one. The styles differ only in the frequencies:

``"same"`` (Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers)
    ``a = b = base ** (-4i / D)``, ``i < D/4``: the ordinary frequencies of a D/2-wide rotation,
    used once per axis.
``"split"`` (Pixtral, Gemma 4 vision)
    ``a = inv[0::2]``, ``b = inv[1::2]`` of the ordinary ``inv = base ** (-2i / D)``, ``i < D/2``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .frequencies import inverse_frequencies, table_overflow
from .frequency_checks import (_DEFAULT_BASE, MAX_POSITIONS, MAX_ROTARY_DIM, MAX_TABLE_ENTRIES, _array_module,
                               _positive_int)
from .tables import table_rows

__all__ = ["AXIAL_STYLES", "axial_frequencies", "axial_tables", "vision_positions"]

#: The frequency styles of :func:`axial_tables`.
AXIAL_STYLES = ("same", "split")

def _head_dim(value: Any) -> int:
    dim = _positive_int("head_dim", value, MAX_ROTARY_DIM)
    if dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 (a quarter of the head per axis), got {dim}")
    return dim


def axial_frequencies(head_dim: int, *, base: float = _DEFAULT_BASE, style: str = "same",
                      numerics: str = "exact") -> np.ndarray:
    """The ``head_dim / 2`` frequencies of an axial table's columns: ``[a, b]``, the height axis's
    then the width axis's (:mod:`rope_rtc.numerics.axial` gives both styles). float64 for
    ``numerics="exact"``, float32 computed as transformers computes them for ``"transformers"``
    (``1.0 / base ** (arange(0, dim, 2).float() / dim)``: ``dim = head_dim / 2`` for ``"same"``,
    ``head_dim`` for ``"split"``)."""
    dim = _head_dim(head_dim)
    if not isinstance(style, str) or style not in AXIAL_STYLES:
        raise ValueError(f"style must be one of {', '.join(map(repr, AXIAL_STYLES))} ('same': Qwen2-VL, Qwen2.5-VL, "
                         f"Qwen3-VL vision; 'split': Pixtral, Gemma 4 vision), got {style!r}")
    if style == "same":
        inv, _ = inverse_frequencies(dim // 2, base=base, numerics=numerics)
        return np.concatenate([inv, inv])
    inv, _ = inverse_frequencies(dim, base=base, numerics=numerics)
    return np.concatenate([inv[0::2], inv[1::2]])


def axial_tables(max_positions: int, head_dim: int, *, base: float = _DEFAULT_BASE, style: str = "same",
                 numerics: str = "exact", xp: Any = np) -> tuple[Any, Any]:
    """cos and sin tables of a vision tower's axial RoPE, for positions ``0 .. max_positions - 1``
    along either axis: ``cos[p, j] = cos(p * f[j])`` where ``f`` (:func:`axial_frequencies`) holds
    the height axis's frequencies in columns ``[0, D/4)`` and the width axis's in ``[D/4, D/2)``.

    Pass them to :func:`rope_rtc.apply_mrope_qk` with ``mrope_section=[D/4, D/4]`` (contiguous)
    and the ``[2, N]`` positions of :func:`vision_positions`: the height stream reads the first
    quarter's columns at row h, the width stream the second quarter's at row w.

    Parameters
    ----------
    max_positions : int
        Rows: more than the largest height or width index (patches per side).
    head_dim : int
        The tower's head dim (``hidden_size / num_heads``: 80 for Qwen2.5-VL, 64 for Pixtral), a
        multiple of 4; the tables have ``head_dim / 2`` columns.
    base : float, default 10000.0
        The RoPE base (theta; Pixtral's ``rope_theta``).
    style : {"same", "split"}
        ``"same"``: both axes ``base ** (-4i / D)``, ``i < D/4`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL
        vision). ``"split"``: the ordinary ``inv = base ** (-2i / D)``, height ``inv[0::2]``, width
        ``inv[1::2]`` (Pixtral, Gemma 4 vision).
    numerics : {"exact", "transformers"}
        As :func:`rope_rtc.rope_tables`: ``"exact"`` (default) frequencies and angles in float64,
        cos/sin rounded once to float32; ``"transformers"`` the frequencies in float32 as
        transformers' vision rotary embeddings compute them, angles ``float32(p) * f`` rounded to
        float32 (``torch.outer`` of float32 positions and frequencies), cos/sin of those angles
        (correctly rounded; torch's own float32 cos/sin are within an ulp or two of them).
    xp : module, default numpy
        Array module of the result (``numpy`` or ``cupy``), through ``xp.asarray``.

    Returns
    -------
    cos, sin : float32 arrays ``[max_positions, head_dim // 2]`` of module ``xp``

    Raises
    ------
    TypeError, ValueError
        Naming the argument: a non-int size, a head dim not a multiple of 4, an unknown style or
        numerics, a non-finite base or one whose angles overflow, tables past ``MAX_TABLE_ENTRIES``.
    """
    rows = _positive_int("max_positions", max_positions, MAX_POSITIONS)
    freqs = axial_frequencies(head_dim, base=base, style=style, numerics=numerics)
    why = table_overflow(freqs, rows, freqs.dtype.type)
    if why is not None:  # as rope_tables refuses it
        raise ValueError(f"base={base} gives {why} with head_dim {head_dim} and numerics {numerics!r}: the tables "
                         "would not be finite (typical bases are 1e4 to 1e7)")
    if rows * freqs.size > MAX_TABLE_ENTRIES:
        raise ValueError(f"max_positions={rows} and head_dim={head_dim} ask for tables of {rows * freqs.size} entries "
                         f"each; the limit is {MAX_TABLE_ENTRIES}")
    _array_module(xp)
    return table_rows(rows, freqs, 1.0, xp)


def vision_positions(grid_thw, *, spatial_merge_size: int, xp: Any = np) -> Any:
    """The ``[2, N]`` (height, width) positions of a vision tower's patches, in the order the tower
    lays them out, for :func:`rope_rtc.apply_mrope_qk` with :func:`axial_tables`.

    Each image or video of ``grid_thw`` (rows ``(t, h, w)``: frames and patches per side, as the
    processors return ``image_grid_thw``) contributes ``t * h * w`` patches, one after another.
    Within a frame the patches go in blocks of ``m x m`` (``m = spatial_merge_size``, the patches
    one merged token covers): blocks row-major over the ``(h/m, w/m)`` grid, patches row-major
    inside each block; every frame repeats the frame's positions. That is Qwen2-VL's and
    Qwen2.5-VL's ``rot_pos_emb`` (positions reshaped to ``(h/m, m, w/m, m)`` and permuted to
    ``(0, 2, 1, 3)``) with ``m = 2``; ``m = 1`` is plain row-major order, Pixtral's. Qwen2.5-VL
    then reorders whole blocks by its window index: take ``pos.reshape(2, -1, m * m)[:,
    window_index].reshape(2, -1)`` with the same index it applies to the hidden states.

    Parameters
    ----------
    grid_thw : array-like of ints, ``[images, 3]``
        ``(t, h, w)`` per image or video, each positive, h and w multiples of ``m``.
    spatial_merge_size : int
        ``m`` (the vision config's ``spatial_merge_size``: 2 for Qwen2-VL and Qwen2.5-VL; 1 for
        plain row-major order, Pixtral).
    xp : module, default numpy
        Array module of the result (``numpy`` or ``cupy``), through ``xp.asarray``.

    Returns
    -------
    int64 array ``[2, N]``: row 0 the height positions, row 1 the width positions.

    Raises
    ------
    TypeError, ValueError
        Naming the argument: ``grid_thw`` not ``[images, 3]`` positive ints, h or w not a multiple
        of ``spatial_merge_size``, a merge size that is not a positive int.
    """
    m = _positive_int("spatial_merge_size", spatial_merge_size, MAX_POSITIONS)
    grid = _grid(grid_thw)
    _array_module(xp)
    parts = []
    for index, (t, h, w) in enumerate(grid):
        if h % m or w % m:
            raise ValueError(f"grid_thw: row {index} is (t, h, w) = ({t}, {h}, {w}); h and w must be multiples of "
                             f"spatial_merge_size {m} (the patches one merged token covers)")
        # Patch (h, w) sits in block (h // m, w // m) at (h % m, w % m): order by block row, block
        # column, row inside the block, column inside it.
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        order = np.lexsort(((ww % m).ravel(), (hh % m).ravel(), (ww // m).ravel(), (hh // m).ravel()))
        frame = np.stack([hh.ravel()[order], ww.ravel()[order]])
        parts.append(np.tile(frame, (1, t)))
    out = np.concatenate(parts, axis=1) if parts else np.empty((2, 0), np.int64)
    return xp.asarray(out.astype(np.int64))


def _grid(grid_thw) -> list[tuple[int, int, int]]:
    """``grid_thw`` as ``(t, h, w)`` Python ints, each positive; ``TypeError``/``ValueError`` naming it."""
    try:
        if (not isinstance(grid_thw, np.ndarray) and hasattr(grid_thw, "__dlpack__")
                and int(getattr(grid_thw, "__dlpack_device__", lambda: (0, 0))()[0]) == 1):  # kDLCPU
            grid_thw = np.from_dlpack(grid_thw)  # a host array of another library (a torch CPU tensor)
        grid = np.asarray(grid_thw.get() if hasattr(grid_thw, "get") and not isinstance(grid_thw, dict)
                          else grid_thw)
    except (TypeError, ValueError, BufferError, RuntimeError) as exc:
        raise TypeError(f"grid_thw: expected an integer array [images, 3] of (t, h, w), got {grid_thw!r}") from exc
    if grid.ndim == 1 and grid.size == 3:
        grid = grid[None, :]
    if grid.ndim != 2 or grid.shape[1] != 3 or not (np.issubdtype(grid.dtype, np.integer) or grid.size == 0):
        raise TypeError(f"grid_thw: expected an integer array [images, 3] of (t, h, w), got {grid.dtype} "
                        f"{grid.shape}")
    if (grid <= 0).any():
        raise ValueError(f"grid_thw: every t, h and w must be positive, got {grid.tolist()}")
    if int(grid.astype(object).prod(axis=1).sum()) > MAX_POSITIONS:
        raise ValueError(f"grid_thw: {grid.tolist()} gives more than {MAX_POSITIONS} patches")
    return [tuple(int(v) for v in row) for row in grid]
