"""The repeat path's address checks (prepared.address_predicate) against the plain reading of
their rules, on random templates and pointers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rope_rtc.core.codegen import address_predicate


def reference(same_view, pairs, natural, aligned, align, p) -> bool:
    if any(p[o] != p[own] for o, own in same_view):
        return False
    for o, j, lo, hi, validated in pairs:
        d = p[j] - p[o]
        if lo < d < hi and d != validated:
            return False
    if any(p[i] & mask for i, mask in natural):
        return False
    return not (align and any(p[i] % align for i in aligned))


N = 9
index = st.integers(0, N - 1)
bound = st.integers(-4096, 4096)
templates = st.tuples(
    st.lists(st.tuples(index, index), max_size=2),
    st.lists(st.tuples(index, index, bound, bound, bound), max_size=8),
    st.lists(st.tuples(index, st.sampled_from([0, 1, 3, 7])), max_size=3),
    st.lists(index, max_size=4),
    st.sampled_from([0, 2, 4, 8, 16]),
)
# Pointers near each other (so extents meet, views coincide and alignments vary).
pointers = st.lists(st.integers(1 << 20, (1 << 20) + 8192), min_size=N, max_size=N)


@settings(max_examples=400, deadline=None)
@given(templates, pointers, st.data())
def test_the_predicate_is_the_rules(template, ptrs, data):
    same_view, pairs, natural, aligned, align = template
    # Equal pointers and validated offsets are where the rules turn: hit them often.
    if same_view and data.draw(st.booleans()):
        o, own = same_view[0]
        ptrs[o] = ptrs[own]
    if pairs and data.draw(st.booleans()):
        o, j, lo, hi, _ = pairs[0]
        pairs[0] = (o, j, lo, hi, ptrs[j] - ptrs[o])
    ok = address_predicate(tuple(same_view), tuple(pairs), tuple(natural), tuple(aligned), align)
    assert ok(tuple(ptrs)) is reference(same_view, pairs, natural, aligned, align, ptrs)


def test_no_checks_accept_everything():
    assert address_predicate((), (), ())((1, 2, 3)) is True
