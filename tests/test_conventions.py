"""The engines' conventions on the CPU: one combined ``cos_sin_cache`` read in place (two strided
views, no copy), flat ``[T, H * D]`` q/k with ``layout="thd"`` and ``head_dim=``, and the table
builder; on the NumPy backend against the reference, and on fake device arrays down to the
argument block."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import BF16, FakeDeviceArray, FakeGPU, fake_cupy
from rope_rtc import RopePlan, apply_rope, apply_rope_qk, cos_sin_cache, inverse_frequencies, rope_tables
from rope_rtc.reference import rope_reference


def vllm_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> np.ndarray:
    """The cache as vLLM's ``RotaryEmbedding._compute_cos_sin_cache`` builds it: float32 inv_freq
    (``1 / base ** (arange(0, rd, 2) / rd)``), float32 positions, their float32 outer product,
    then ``cat(cos, sin, -1)``. The frequencies are ours (``numerics="transformers"``: the same
    float32 arithmetic)."""
    inv_freq, _ = inverse_frequencies(rotary_dim, base=base, numerics="transformers")
    t = np.arange(max_position, dtype=np.float32)
    freqs = np.multiply.outer(t, inv_freq.astype(np.float32))  # float32 products, as einsum in float32
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1).astype(np.float32)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [128, 64])
def test_vllm_convention_matches_the_reference(is_neox, rotary_dim):
    T, Hq, Hk, D, P = 11, 4, 2, 128, 256
    rng = np.random.default_rng(0)
    cache = vllm_cos_sin_cache(P, rotary_dim)
    positions = rng.integers(0, P, T).astype(np.int64)
    q = rng.standard_normal((T, Hq * D)).astype(np.float32)
    k = rng.standard_normal((T, Hk * D)).astype(np.float32)
    qo, ko = apply_rope_qk(q, k, cos_sin_cache=cache, positions=positions, layout="thd", head_dim=D,
                           interleaved=not is_neox, rotary_dim=rotary_dim, backend="numpy")
    assert qo.shape == q.shape and ko.shape == k.shape  # returned in the caller's flat shape
    cos, sin = cache[:, :rotary_dim // 2], cache[:, rotary_dim // 2:]
    for got, x, H in ((qo, q, Hq), (ko, k, Hk)):
        ref = rope_reference(x.reshape(T, H, D), cos, sin, positions, interleaved=not is_neox, rotary_dim=rotary_dim)
        np.testing.assert_allclose(got.reshape(T, H, D), ref, rtol=1e-6, atol=1e-6)


def test_in_place_flat_arrays_and_given_outputs():
    T, H, D = 5, 3, 64
    rng = np.random.default_rng(1)
    cache = cos_sin_cache(32, D)
    x = rng.standard_normal((T, H * D)).astype(np.float32)
    want = apply_rope(x, cos_sin_cache=cache, offset=4, layout="thd", head_dim=D, backend="numpy")
    out = np.full_like(x, np.nan)
    assert apply_rope(x, cos_sin_cache=cache, offset=4, layout="thd", head_dim=D, out=out, backend="numpy") is out
    np.testing.assert_array_equal(out, want)
    y = x.copy()
    assert apply_rope(y, cos_sin_cache=cache, offset=4, layout="thd", head_dim=D, out=y, backend="numpy") is y
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
@pytest.mark.parametrize("numerics", ["exact", "transformers"])
def test_cos_sin_cache_is_the_tables_side_by_side(scaling, numerics):
    cache = cos_sin_cache(300, 64, scaling=scaling, numerics=numerics)
    cos, sin = rope_tables(300, 64, scaling=scaling, numerics=numerics)
    assert cache.dtype == np.float32 and cache.shape == (300, 64)
    np.testing.assert_array_equal(cache[:, :32], cos)
    np.testing.assert_array_equal(cache[:, 32:], sin)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"cos_sin_cache": np.zeros((8, 63), np.float32)}, ValueError, "even"),
    ({"cos_sin_cache": np.zeros((8, 64), np.float16)}, TypeError,
     r"cos_sin_cache: expected float32, got float16; .*cos_sin_cache\.astype\(float32\), or \.float\(\) for a torch"),
    ({"cos_sin_cache": np.zeros((8, 2, 64), np.float32)}, ValueError, "2-d"),
    ({"cos_sin_cache": np.ones((8, 64), np.float32), "cos": np.ones((8, 32), np.float32)}, TypeError, "instead of"),
    ({}, TypeError, "cos: expected an array"),
    ({"cos_sin_cache": np.ones((8, 64), np.float32), "head_dim": 64, "layout": "bshd"}, ValueError, "thd"),
    ({"cos_sin_cache": np.ones((8, 64), np.float32), "head_dim": 48, "layout": "thd"}, ValueError, "head_dim=48"),
    ({"cos_sin_cache": np.ones((8, 64), np.float32), "head_dim": 0, "layout": "thd"}, ValueError, "head_dim"),
    ({"cos_sin_cache": np.ones((8, 64), np.float32), "head_dim": 64.0, "layout": "thd"}, TypeError, "head_dim"),
])
def test_convention_errors_name_the_argument(kwargs, exc, match):
    x = np.ones((2, 128), np.float32)
    before = x.copy()
    kw = {"layout": "thd", **kwargs}
    if "head_dim" not in kw and kw["layout"] == "thd":
        x = x.reshape(2, 2, 64)
    with pytest.raises(exc, match=match):
        apply_rope(x, out=x, backend="numpy", **{n: v for n, v in kw.items() if n not in ("cos",)},
                   **({"cos": kw["cos"]} if "cos" in kw else {}))
    np.testing.assert_array_equal(x.reshape(before.shape), before)


def test_a_numpy_integer_head_dim_is_an_int():
    """As rotary_dim and rotary_offset take NumPy integers, so does head_dim."""
    x = np.random.default_rng(1).standard_normal((3, 128)).astype(np.float32)
    cache = cos_sin_cache(8, 64)
    want = apply_rope(x, cos_sin_cache=cache, layout="thd", head_dim=64, backend="numpy")
    got = apply_rope(x, cos_sin_cache=cache, layout="thd", head_dim=np.int64(64), backend="numpy")
    np.testing.assert_array_equal(got, want)


def test_flat_arrays_need_no_layout():
    """Flat [T, H * D] q/k with head_dim= are packed tokens whatever the caller says of the layout:
    without one they are "thd", as said explicitly; a 4-d array with head_dim= is refused."""
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((6, 4 * 64)).astype(np.float32), rng.standard_normal((6, 2 * 64)).astype(np.float32)
    cache, pos = cos_sin_cache(16, 64), rng.integers(0, 16, 6).astype(np.int64)
    want = apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=64, backend="numpy")
    got = apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, head_dim=64, backend="numpy")
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    x = np.ones((1, 6, 4, 64), np.float32)
    with pytest.raises(ValueError, match=r"x: with head_dim=64, expected a flat \[T, H \* 64\] array"):
        apply_rope(x, cos_sin_cache=cache, head_dim=64, backend="numpy")
    with FakeGPU(fixed=True) as gpu:
        fq, fk, fpos = fake_cupy((8, 32 * 128), BF16), fake_cupy((8, 8 * 128), BF16), fake_cupy((8,), np.int64)
        fcache = fake_cupy((4096, 128), np.float32)
        for layout in (None, "thd"):
            plan = RopePlan(fq, fk, cos_sin_cache=fcache, positions=fpos, layout=layout, head_dim=128).compile()
            assert plan.layout == "thd"
            plan.execute(fq, fk, positions=fpos, cos_sin_cache=fcache)
            apply_rope_qk(fq, fk, cos_sin_cache=fcache, positions=fpos, layout=layout, head_dim=128, q_out=fq,
                          k_out=fk)
        blocks = [bytes(r["fixed"]) for r in gpu.launches]
        assert len(set(blocks)) == 1


def test_a_flat_array_without_a_contiguous_last_axis_is_refused():
    # UnsupportedLayoutError, as for the same [T, H, D] array and every other layout refusal (it
    # was a plain ValueError here).
    from rope_rtc.errors import UnsupportedLayoutError

    x = np.ones((4, 256), np.float32)[:, ::2]
    with pytest.raises(UnsupportedLayoutError, match="contiguous last axis"):
        apply_rope(x, cos_sin_cache=np.ones((8, 64), np.float32), layout="thd", head_dim=64, backend="numpy")
    with FakeGPU() as gpu:
        q, k = fake_cupy((6, 512), BF16)[:, ::2], fake_cupy((6, 128), BF16)
        cache, pos = fake_cupy((128, 64), np.float32), fake_cupy((6,), np.int64)
        with pytest.raises(UnsupportedLayoutError, match="q: a flat"):
            apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=64)
        with pytest.raises(UnsupportedLayoutError, match="q: a flat"):
            RopePlan(q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=64)
        assert gpu.launches == []


def test_an_empty_step_of_flat_arrays_as_made_fresh_is_taken():
    """A fresh empty array (numpy.zeros((0, n)), cupy.empty((0, n))) has strides (0, 0): zero
    tokens in the flat convention run nothing, as the same step as [0, H, D] does (the last-axis
    stride check refused them)."""
    cache = cos_sin_cache(64, 128)
    q, k = np.zeros((0, 512), np.float32), np.zeros((0, 256), np.float32)
    pos = np.zeros(0, np.int64)
    rq, rk = apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, head_dim=128, backend="numpy")
    assert rq.shape == (0, 512) and rk.shape == (0, 256)
    with FakeGPU(fixed=True) as gpu:
        c, p = fake_cupy((64, 128), np.float32), fake_cupy((0,), np.int64)
        fq, fk = fake_cupy((0, 512), np.float32, strides=(0, 0)), fake_cupy((0, 256), np.float32, strides=(0, 0))
        assert apply_rope_qk(fq, fk, cos_sin_cache=c, positions=p, head_dim=128, q_out=fq, k_out=fk) == (fq, fk)
        plan = RopePlan(fake_cupy((4, 512), np.float32), fake_cupy((4, 256), np.float32), cos_sin_cache=c,
                        positions=fake_cupy((4,), np.int64), head_dim=128).compile()
        plan.execute(fq, fk, cos_sin_cache=c, positions=p)
        assert gpu.launches == []


@pytest.mark.parametrize("case,exc,match", [
    ("a list", TypeError, "cos_sin_cache: expected a 2-d float32 array"),
    ("rows of 64, rotary_dim 32", ValueError,
     r"^cos_sin_cache: rows of 64 values \(cos then sin of 32 frequencies\), but rotary_dim 32 needs rows of 32$"),
    ("rows of 32, head dim 64", ValueError,
     r"^cos_sin_cache: rows of 32 values .*rotary_dim 64 needs rows of 64 \(rotary_dim defaults to the head dim 64; "
     r"to rotate only the first 32 channels pass rotary_dim=32\)$"),
    ("columns strided", ValueError, "^cos_sin_cache: the last dimension must be contiguous"),
    ("on the host", TypeError, r"^cos_sin_cache: a NumPy \(host\) array"),
    ("inside q", ValueError, "q_out overlaps cos_sin_cache"),
])
def test_cos_sin_cache_errors_name_the_cache(case, exc, match):
    """The cache is split into cos and sin views before validation, whose messages named those
    (and suggested slicing tables the caller never passed)."""
    with FakeGPU() as gpu:
        q, k, pos = fake_cupy((6, 4 * 64), BF16), fake_cupy((6, 2 * 64), BF16), fake_cupy((6,), np.int64)
        rotary_dim = None
        if case == "a list":
            cache = [[0.0] * 64] * 128
        elif case == "rows of 64, rotary_dim 32":
            cache, rotary_dim = fake_cupy((128, 64), np.float32), 32
        elif case == "rows of 32, head dim 64":
            cache = fake_cupy((128, 32), np.float32)
        elif case == "columns strided":
            cache = fake_cupy((128, 128), np.float32)[:, ::2]
        elif case == "on the host":
            cache = np.zeros((128, 64), np.float32)
        else:
            cache = fake_cupy((128, 64), np.float32, ptr=q.data.ptr)  # in q's own memory
        for call in (lambda: apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=64,
                                           rotary_dim=rotary_dim, q_out=q, k_out=k),
                     lambda: RopePlan(q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=64,
                                      rotary_dim=rotary_dim)):
            with pytest.raises(exc, match=match):
                call()
        assert gpu.launches == []


def test_the_cache_is_read_in_place_on_the_device():
    """On (fake) device arrays both table pointers lie inside the one cache, row stride rotary_dim."""
    cache = fake_cupy((4096, 128), np.float32)
    q, k = fake_cupy((8, 32 * 128), BF16), fake_cupy((8, 8 * 128), BF16)
    pos = fake_cupy((8,), np.int64)
    with FakeGPU(fixed=True) as gpu:
        qo, ko = apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=128, q_out=q, k_out=k)
        assert qo is q and ko is k
        rec = gpu.launches[-1]
        p = rec["fixed"]
        assert (p.cos, p.sin, p.table_stride) == (cache.data.ptr, cache.data.ptr + 64 * 4, 128)
        assert (p.in_[0], p.in_sh[0], p.in_ss[0]) == (q.data.ptr, 128, 32 * 128)
        assert (rec["geometry"].q_heads, rec["geometry"].k_heads) == (32, 8)
        # Out of place with allocated outputs: returned flat.
        qo, ko = apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=128)
        assert qo.shape == q.shape and ko.shape == k.shape


class InterfaceOnly:
    """An array that speaks __cuda_array_interface__ and nothing else: no shape, no reshape."""

    def __init__(self, fake: FakeDeviceArray) -> None:
        self._fake = fake

    @property
    def __cuda_array_interface__(self) -> dict:
        return self._fake.__cuda_array_interface__


def test_interface_only_arrays_take_the_engines_conventions():
    """Flat q/k and a combined cache that speak only the array interface are viewed, not copied."""
    cache, q, k = FakeDeviceArray((4096, 128), np.float32), FakeDeviceArray((8, 32 * 128), np.float16), \
        FakeDeviceArray((8, 8 * 128), np.float16)
    pos = fake_cupy((8,), np.int64)
    with FakeGPU(fixed=True) as gpu:
        qi, ki = InterfaceOnly(q), InterfaceOnly(k)
        assert apply_rope_qk(qi, ki, cos_sin_cache=InterfaceOnly(cache), positions=pos, layout="thd", head_dim=128,
                             q_out=qi, k_out=ki) == (qi, ki)
        p = gpu.launches[-1]["fixed"]
        assert (p.cos, p.sin, p.table_stride) == (cache.ptr, cache.ptr + 64 * 4, 128)
        assert (p.in_[0], p.in_[1], p.in_sh[0], p.in_ss[0]) == (q.ptr, k.ptr, 128, 32 * 128)
        out = apply_rope(InterfaceOnly(q), cos_sin_cache=InterfaceOnly(cache), positions=pos, layout="thd",
                         head_dim=128)
        assert out.shape == (8, 32 * 128)  # allocated, and returned flat as x came


def test_a_plan_keeps_its_views_while_the_same_objects_come_back():
    cache = fake_cupy((4096, 128), np.float32)
    q, k = fake_cupy((8, 32 * 128), BF16), fake_cupy((8, 8 * 128), BF16)
    pos = fake_cupy((8,), np.int64)
    with FakeGPU(fixed=True) as gpu:
        plan = RopePlan(q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=128).compile()
        for _ in range(3):
            assert plan.execute(q, k, positions=pos, cos_sin_cache=cache) == (q, k)
        calls = {id(r["token"]) for r in gpu.launches}
        assert len(gpu.launches) == 3 and len(calls) == 1  # one bound call, replayed: the identity path
        q2 = fake_cupy((8, 32 * 128), BF16)
        plan.execute(q2, k, positions=pos, cos_sin_cache=cache)
        assert gpu.launches[-1]["fixed"].in_[0] == q2.data.ptr


def test_a_plan_declared_with_the_engines_conventions():
    """TensorDesc declarations of flat q/k and of a combined cache build the plan; arrays run it."""
    from rope_rtc import TensorDesc

    with FakeGPU(fixed=True) as gpu:
        plan = RopePlan(TensorDesc(BF16, (8, 32 * 128), device=0), TensorDesc(BF16, (8, 8 * 128), device=0),
                        cos_sin_cache=TensorDesc(np.float32, (4096, 128), device=0),
                        positions=TensorDesc(np.int64, (8,), device=0), layout="thd", head_dim=128).compile()
        assert (plan.q_heads, plan.k_heads, plan.head_dim, plan.rotary_dim) == (32, 8, 128, 128)
        cache = fake_cupy((4096, 128), np.float32)
        q, k, pos = fake_cupy((8, 32 * 128), BF16), fake_cupy((8, 8 * 128), BF16), fake_cupy((8,), np.int64)
        plan.execute(q, k, positions=pos, cos_sin_cache=cache)
        p = gpu.launches[-1]["fixed"]
        assert (p.cos, p.sin, p.table_stride, p.in_[0]) == (cache.data.ptr, cache.data.ptr + 256, 128, q.data.ptr)


def test_an_in_place_plan_refuses_at_construction_what_every_execute_would_refuse():
    """Omitted outputs mean in place: a table inside q was accepted by RopePlan(...) and refused by
    every execute (rope_and_cache's and the multimodal plans refused it when made)."""
    with FakeGPU() as gpu:
        q, k, pos = fake_cupy((6, 4, 64), BF16), fake_cupy((6, 2, 64), BF16), fake_cupy((6,), np.int64)
        table = fake_cupy((128, 32), np.float32, ptr=q.data.ptr)
        with pytest.raises(ValueError, match="q_out overlaps cos"):
            RopePlan(q, k, table, fake_cupy((128, 32), np.float32), positions=pos, layout="thd")
        RopePlan(q, k, fake_cupy((128, 32), np.float32), fake_cupy((128, 32), np.float32), positions=pos,
                 layout="thd").execute(q, k, fake_cupy((128, 32), np.float32), fake_cupy((128, 32), np.float32),
                                       positions=pos)
        assert len(gpu.launches) == 1


def test_a_plan_in_the_engines_convention_takes_new_flat_arrays_without_views(monkeypatch):
    """RopePlan.execute(flat q, k, cos_sin_cache=...) with new arrays each call split the cache and
    viewed every array again, then took the core's path for new views (about nine times a plan call
    with tables); now the template's generated checks run on the flat arrays and the cache itself.
    Every block equals a fresh plan's for the same arguments."""
    from fakes import counted
    from rope_rtc.ops import conventions, rope_plan, rope_request

    T, HQ, HK, D = 8, 4, 2, 64
    with FakeGPU(fixed=True) as gpu:
        cache = fake_cupy((128, D), np.float32)
        sets = [(fake_cupy((T, HQ * D), BF16), fake_cupy((T, HK * D), BF16), fake_cupy((T,), np.int64))
                for _ in range(6)]
        plan = RopePlan(sets[0][0], sets[0][1], cos_sin_cache=cache, positions=sets[0][2], layout="thd", head_dim=D)
        plan.execute(*sets[0][:2], positions=sets[0][2], cos_sin_cache=cache)
        counts: dict = {}
        for owner, name in ((conventions, "unflatten_heads"), (rope_plan, "unflatten_heads"),
                            (rope_plan, "split_cos_sin_cache"), (rope_plan, "validate"), (rope_request, "validate")):
            counted(monkeypatch, owner, name, counts)
        blocks = []
        for i in range(1, 13):
            q, k, pos = sets[i % len(sets)]
            assert plan.execute(q, k, positions=pos, cos_sin_cache=cache) == (q, k)
            blocks.append(bytes(gpu.launches[-1]["fixed"]))
        assert counts == {}
        other = fake_cupy((T + 1, HQ * D), BF16), fake_cupy((T + 1, HK * D), BF16), fake_cupy((T + 1,), np.int64)
        plan.execute(*other[:2], positions=other[2], cos_sin_cache=cache)  # another token count: the full way
        assert gpu.launches[-1]["fixed"].total != 0 and counts.get("validate")
    monkeypatch.undo()
    with FakeGPU(fixed=True) as gpu:
        for i in range(1, 13):
            q, k, pos = sets[i % len(sets)]
            fresh = RopePlan(q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=D)
            fresh.execute(q, k, positions=pos, cos_sin_cache=cache)
            assert bytes(gpu.launches[-1]["fixed"]) == blocks[i - 1]


def test_a_plan_of_flat_arrays_with_separate_tables_takes_new_arrays_the_same_way(monkeypatch):
    from fakes import counted
    from rope_rtc.ops import rope_request

    T, HQ, HK, D = 8, 4, 2, 64
    with FakeGPU(fixed=True) as gpu:
        cos, sin = fake_cupy((128, D // 2), np.float32), fake_cupy((128, D // 2), np.float32)
        sets = [(fake_cupy((T, HQ * D), BF16), fake_cupy((T, HK * D), BF16)) for _ in range(4)]
        plan = RopePlan(*sets[0], cos, sin, offset=3, layout="thd", head_dim=D)
        plan.execute(*sets[0], cos, sin, offset=3)
        counts: dict = {}
        counted(monkeypatch, rope_request, "validate", counts)
        for i in range(1, 8):
            q, k = sets[i % len(sets)]
            plan.execute(q, k, cos, sin, offset=i)
            f = gpu.launches[-1]["fixed"]
            assert (f.in_[0], f.in_[1], f.cos, f.sin, f.offset) == (q.data.ptr, k.data.ptr, cos.data.ptr, sin.data.ptr, i)
        assert counts == {}
        with pytest.raises(ValueError, match="offset"):
            plan.execute(*sets[1], cos, sin, offset=126)  # positions 126..133 outside the table's 128 rows


def test_a_call_the_repeat_path_declines_reports_what_full_validation_reports():
    """The repeat paths resolved the stream before their checks: a call with a bad stream and a
    wrong cache reported the stream warm and the cache cold. A declined call now goes the full way
    first (found in review)."""
    from fakes import in_a_fresh_thread

    with FakeGPU(fixed=True) as gpu:
        cache, pos = fake_cupy((128, 64), np.float32), fake_cupy((6,), np.int64)

        def call(q, k, c, **kw):
            return apply_rope_qk(q, k, cos_sin_cache=c, positions=pos, layout="thd", head_dim=64, q_out=q, k_out=k,
                                 **kw)

        for _ in range(3):
            call(fake_cupy((6, 4 * 64), BF16), fake_cupy((6, 2 * 64), BF16), cache)
        q, k, wide = fake_cupy((6, 4 * 64), BF16), fake_cupy((6, 2 * 64), BF16), fake_cupy((128, 128), np.float32)
        errors = []
        for run in (lambda f: f(), in_a_fresh_thread):
            try:
                run(lambda: call(q, k, wide, stream=-1))
            except ValueError as exc:
                errors.append(str(exc))
        assert len(errors) == 2 and errors[0] == errors[1] and errors[0].startswith("cos_sin_cache: rows of 128")
        n = len(gpu.launches)
        with pytest.raises(ValueError, match="stream: -1"):  # an accepted call with a bad stream: no launch
            call(q, k, cache, stream=-1)
        assert len(gpu.launches) == n
