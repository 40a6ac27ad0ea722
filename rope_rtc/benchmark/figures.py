"""Figures derived from a result record: timings per regime, GB/s, % of the copy, checks, the
fastest peer."""

from __future__ import annotations

from .cases import COPY, PEERS


# =============================================================================================
# derived figures


def rows_by_impl(case_rec: dict) -> dict[str, dict]:
    return {r["impl"]: r for r in case_rec["rows"]}


def resolved(row: dict | None, regime: str) -> str:
    """The regime ``regime`` names for ``row``. ``"cold*"`` is the device time with cold L2: the
    CUDA graph replay where one was taken (small cases, where a loop of calls measures the host's
    launch rate rather than the GPU), else the event-timed loop. A graph whose capture failed is
    not replaced by the loop: the row has no cold figure then, rather than one of another kind."""
    if regime != "cold*":
        return regime
    return "graph_cold" if row and "graph_cold" in row.get("timings", {}) else "cold"


def timing(row: dict | None, regime: str) -> float | None:
    """Median µs per call of ``regime`` (see :func:`resolved` for ``"cold*"``)."""
    if not row:
        return None
    t = row.get("timings", {}).get(resolved(row, regime))
    if not t or "us" not in t:
        return None
    return float(t["us"])


def gbps(case_rec: dict, row: dict | None, regime: str) -> float | None:
    us = timing(row, regime)
    return case_rec["bytes_moved"] / us / 1e3 if us else None


def pct_of_copy(case_rec: dict, row: dict | None, regime: str) -> float | None:
    """The copy's time over ``row``'s, in %: None unless both were timed in the same regime."""
    copy = rows_by_impl(case_rec).get(COPY)
    if resolved(row, regime) != resolved(copy, regime):
        return None
    us, cu = timing(row, regime), timing(copy, regime)
    return 100.0 * cu / us if us and cu else None


def ok(row: dict | None) -> bool:
    return bool(row) and str(row.get("check", "")).startswith(("ok", "bit-exact"))


def fastest_peer(case_rec: dict, regime: str, like: dict | None = None) -> tuple[str, float] | None:
    """The peer with the least time in ``regime``, among those timed as ``like`` was (the copy by
    default: a failed graph capture is not set against a graph)."""
    best = None
    like = like or rows_by_impl(case_rec).get(COPY)
    for r in case_rec["rows"]:
        if r["impl"] in PEERS and ok(r) and (like is None or resolved(r, regime) == resolved(like, regime)):
            us = timing(r, regime)
            if us and (best is None or us < best[1]):
                best = (r["impl"], us)
    return best


