"""The general kernel's flat index space, on a CPU.

``rope_apply`` (cuda_src/rope.cu: narrow_thread) maps a thread index to (token, head group, unit)
with multiply-shift divisions by host-computed constants. These tests check the constants are
exact and, with a Python model of that mapping over the parameters ``fill_params`` writes, that
every rotated unit and every copied unit is visited exactly once.
"""

from __future__ import annotations

import numpy as np
import pytest

from fakes import FakeDeviceArray, fake_like, rope_host_steps
from rope_rtc.ops import rope_launch as RL
from rope_rtc.ops.rope_request import validate
from rope_rtc.build.registry import rope_head_batch
from rope_rtc.ops.rope_params import fast_div, fast_divisor


def _exact(d: int, ns: np.ndarray) -> None:
    packed = fast_divisor(d)
    mul, shift = np.uint64(packed & 0xFFFFFFFF), np.uint64(packed >> 32)
    ns = ns.astype(np.uint64)
    # (umulhi(n, m) + n) >> l, in uint64: the product of two 32-bit values fits.
    got = (((ns * mul) >> np.uint64(32)) + ns) >> shift
    bad = np.nonzero(got != ns // np.uint64(d))[0]
    assert bad.size == 0, f"d={d}: n={int(ns[bad[0]])} gives {int(got[bad[0]])}, not {int(ns[bad[0]]) // d}"


def _boundary_ns(d: int, rng) -> np.ndarray:
    top = 2**31 - 1
    near = [q * d + e for q in (1, 2, 3, top // d - 1, top // d) for e in (-1, 0, 1)]
    ns = np.array([n for n in near if 0 <= n <= top] + [0, 1, top, top - 1], dtype=np.int64)
    return np.concatenate([ns, rng.integers(0, 2**31, 4000)])


def test_fast_divisor_is_exact_below_2_31():
    rng = np.random.default_rng(7)
    divisors = set(range(1, 1025))
    divisors |= {2**k + e for k in range(1, 31) for e in (-1, 0, 1) if 2**k + e < 2**31}
    divisors |= set(int(d) for d in rng.integers(1, 2**31, 300))
    divisors |= {3 * 5 * 7 * 11 * 13, 4096 * 40, 16384 * 3, 2**31 - 1}
    for d in sorted(divisors):
        _exact(d, _boundary_ns(d, rng))


def test_fast_divisor_every_n_for_small_divisors():
    ns = np.arange(0, 1 << 20, dtype=np.int64)
    for d in (1, 3, 5, 6, 7, 24, 40, 48, 96, 127, 320):
        _exact(d, ns)


def test_fast_divisor_rejects_what_the_kernel_cannot_divide_by():
    for d in (0, -3, 2**31):
        with pytest.raises(ValueError, match="divisor"):
            fast_divisor(d)
    assert fast_div(2**31 - 1, fast_divisor(7)) == (2**31 - 1) // 7


def _model_visits(p, heads: int, hb: int):
    """What narrow_thread computes for every thread: rotated (token, head, unit) and copied
    (token, head, unit) triples, as Counters of visits."""
    from collections import Counter

    rot, cop = Counter(), Counter()
    for i in range(p.total):
        is_rot = i < p.rot_total
        j = i if is_rot else i - p.rot_total
        per, across = (p.units, p.groups) if is_rot else (p.copy_units, heads)
        r = fast_div(j, p.div_units if is_rot else p.div_copy_units)
        u = j - r * per
        r2 = fast_div(r, p.div_tile)
        tt = r - r2 * p.tile
        tile = fast_div(r2, p.div_groups if is_rot else p.div_heads)
        h = r2 - tile * across
        assert 0 <= u < per and 0 <= tt < p.tile and 0 <= h < across
        t = tile * p.tile + tt
        if t >= p.num_tokens:
            continue
        if is_rot:
            for k in range(hb):
                if h * hb + k < heads:
                    rot[(t, h * hb + k, u)] += 1
        else:
            cop[(t, h, u)] += 1
        b = fast_div(t, p.div_seq)
        assert 0 <= b < max(p.num_tokens // p.seq_len, 1) and 0 <= t - b * p.seq_len < p.seq_len
    return rot, cop


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("B,S,H,HK,D,R_,out_of_place", [
    (2, 3, 5, 3, 64, 64, False),
    (1, 7, 32, 8, 128, 128, False),
    (3, 5, 4, 0, 64, 32, True),    # partial window, out of place: the outside is copied
    (2, 1, 9, 1, 128, 64, True),
    (1, 13, 3, 2, 256, 256, False),
    (28, 300, 2, 0, 64, 64, False),  # 16800 token-heads: the prefill head batch
    (33, 13, 40, 0, 64, 64, True),  # 17160 token-heads, 13 = 6 tiles of 2 tokens and a padded one
])
def test_narrow_mapping_covers_every_unit_once(layout, interleaved, B, S, H, HK, D, R_, out_of_place):
    shape = (lambda h: (B, S, h, D)) if layout == "bshd" else (lambda h: (B, h, S, D))
    q = fake_like(shape(H), np.float16)
    k = fake_like(shape(HK), np.float16) if HK else None
    c = s = FakeDeviceArray((S + 4, R_ // 2), np.float32)
    kw = {}
    if out_of_place:
        kw["q_out"] = fake_like(q.shape, np.float16)
        if k is not None:
            kw["k_out"] = fake_like(k.shape, np.float16)
    req = validate(q, k, c, s, layout=layout, interleaved=interleaved, rotary_dim=R_, **kw)
    vec, p, (gx, _, _), (bx, _, _) = rope_host_steps(req)
    assert p.narrow == 1 and gx * bx >= p.total > gx * bx - bx  # one thread per index, no spare block
    heads = H + HK
    bhsd = layout == "bhsd" and S > 1 and H > 1
    assert p.tile == (min(RL.TILE_THREADS // p.units, B * S) if bhsd else 1)
    small = B * S * (H + HK) < RL.SMALL_TOKEN_HEADS
    assert RL.head_batch(req) == rope_head_batch(interleaved, small, heads_inner=not bhsd)
    rot, cop = _model_visits(p, heads, RL.head_batch(req))
    units = (R_ if interleaved else R_ // 2) // vec
    assert set(rot) == {(t, h, u) for t in range(B * S) for h in range(heads) for u in range(units)}
    assert set(rot.values()) == {1}
    copy_units = (D - R_) // vec if out_of_place else 0
    assert set(cop) == {(t, h, u) for t in range(B * S) for h in range(heads) for u in range(copy_units)}
    assert not cop or set(cop.values()) == {1}


def test_wide_entry_past_2_31_indices():
    """Past 2^31 indices the plan takes the 64-bit entry (rope_apply_wide), grid capped at the limit."""
    T, H, D = 2**27, 32, 128  # 2^27 tokens x 8 head groups x 8 units: 2^33 indices
    q = fake_like((T, H, D), np.float16)
    c = s = FakeDeviceArray((T, D // 2), np.float32)
    req = validate(q, None, c, s, layout="thd")
    vec, p, (gx, _, _), _ = rope_host_steps(req)
    assert p.total >= 2**31 and p.narrow == 0 and gx <= RL.GRID_LIMIT
    assert not RL.is_narrow(req, vec)
