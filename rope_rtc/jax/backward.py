"""Where the cotangents of the fused cache write go (``rope_and_cache``'s backward).

The forward writes ``k_cache[slot(t)] = rotated k[t]`` and ``v_cache[slot(t)] = v[t]`` for each
token with a slot in the cache, and leaves every other entry as it was. So a written entry's
cotangent belongs to its token (added to k's before the inverse rotation, v's as it is), and the
input caches receive theirs with the written entries zeroed. An FP8 cache's entries are integers:
nothing flows back through them.
"""

from __future__ import annotations

from .checks import CacheCall
from .jnp_rope import at_slots, slot_index


def cache_cotangents(call: CacheCall, gk, gk_cache, gv_cache, slots) -> tuple:
    """``(k's cotangent, v's cotangent, (k_cache's, v_cache's))`` from the results' cotangents;
    None where none flows (FP8)."""
    if call.kv_cache_dtype != "auto":
        return gk, None, None
    block, offset = slot_index(call, slots, gk_cache.shape)
    # A token without a slot in the cache reads zeros ("fill"), and zeroes nothing ("drop").
    gk = gk + at_slots(call, gk_cache, block, offset).get(mode="fill", fill_value=0)
    gv = at_slots(call, gv_cache, block, offset).get(mode="fill", fill_value=0)
    caches = (at_slots(call, gk_cache, block, offset).set(0, mode="drop"),
              at_slots(call, gv_cache, block, offset).set(0, mode="drop"))
    return gk, gv, caches
