"""Bounded caches of recent entries: the argument sets a plan remembers by identity
(:mod:`rope_rtc.core.prepared`), the graphs a launcher keeps (:mod:`rope_rtc.core.graphs`) and the
outputs kept for recycling (:mod:`rope_rtc.core.outputs`)."""

from __future__ import annotations

# Argument sets a plan remembers by identity (rope_rtc.core.prepared), and graphs a launcher keeps:
# engines cycle through a few buffers (per layer, per double-buffered step).
RECENT_SETS = 16


def remember(cache: dict, key, value, limit: int = RECENT_SETS) -> None:
    """Store ``key`` in a bounded cache as its newest entry, dropping the first entry (the oldest,
    or with ``recall`` the least recently used) when a new key finds it full."""
    if cache.pop(key, None) is None and len(cache) >= limit:
        del cache[next(iter(cache))]
    cache[key] = value


def recall(cache: dict, key):
    """``cache[key]`` (None when absent), moved to the newest end: caches that ``remember`` fills
    and ``recall`` reads evict the least recently used entry, so a set launched all along keeps
    its graph while others come and go."""
    value = cache.pop(key, None)
    if value is not None:
        cache[key] = value
    return value
