"""Helpers shared by the CPU and GPU tests: the layouts' shapes and axis orders, and bit patterns.

They restate the layouts here rather than import rope_rtc's own tables, so that a test checks the
library against an independent statement of what each layout means."""

from __future__ import annotations

import numpy as np

# The axis permutation taking each layout's array to (B, S, H, D); thd is (T, H, D) already.
TO_BSHD = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3), "thd": (0, 1, 2)}


def layout_shape(layout: str, b: int, s: int, h: int, d: int) -> tuple[int, ...]:
    """The shape of a ``layout`` array of batch ``b``, sequence ``s``, ``h`` heads of ``d`` channels."""
    return {"bshd": (b, s, h, d), "bhsd": (b, h, s, d), "sbhd": (s, b, h, d), "thd": (b * s, h, d)}[layout]


def token_rows(a: np.ndarray, layout: str) -> np.ndarray:
    """A ``layout`` array as [tokens, H, D], its tokens in (b, s) order (the references' form)."""
    c = np.transpose(a, TO_BSHD[layout])
    return c.reshape(int(np.prod(c.shape[:-2])), c.shape[-2], c.shape[-1])


def bits(a: np.ndarray) -> np.ndarray:
    """The bit patterns of ``a`` as unsigned integers of its width: comparing them tells -0.0
    from 0.0 and one NaN from another, which comparing values does not."""
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


CACHE_ARGS = ("q", "k", "v", "cos", "sin", "positions", "slot_mapping", "k_cache", "v_cache")


def cache_write_reference(host: dict, kind: str, kv_layout: str, num_slots: int, k_scale=None, v_scale=None):
    """The NumPy reference of ``rope_and_cache`` on a dict of host arrays named as its arguments
    (``CACHE_ARGS``); a slot past the cache's ``num_slots`` writes nothing, as in the kernel (the
    reference itself refuses such a slot)."""
    from rope_rtc.reference import rope_and_cache_reference

    slots = host["slot_mapping"].copy()
    slots[slots >= num_slots] = -1
    return rope_and_cache_reference(*(host[n] for n in CACHE_ARGS[:6]), slots, host["k_cache"], host["v_cache"],
                                    kv_layout=kv_layout, kv_cache_dtype=kind, k_scale=k_scale, v_scale=v_scale)
