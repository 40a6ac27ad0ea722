"""The specialised build of the general kernel on the CPU: which geometry a model's calls get,
when a call runs it and when the generic kernel does, and the argument block the plan writes
for it (fake device arrays, recorded launches; the kernels themselves: test_gpu_fixed.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fakes import BF16, FakeGPU, fake_cupy
from rope_rtc import apply_rope, apply_rope_qk
from rope_rtc.build import registry
from rope_rtc.ops import rope, rope_launch, rope_plan
from rope_rtc.build.registry import fixed_geometry, model_fixed_specs


@pytest.fixture
def gpu():
    with FakeGPU(fixed=True) as g:
        yield g


def _switch(monkeypatch, name, value):
    """Set one of rope_launch's build switches or limits, and drop the one-call functions' plans
    (they chose their builds under the old value)."""
    monkeypatch.setattr(rope_launch, name, value)
    rope.ONE_CALL.forget()


def _table(rows=64, half=64):
    return fake_cupy((rows, half), np.float32), fake_cupy((rows, half), np.float32)


def test_geometry_rules():
    g = fixed_geometry("bfloat16", False, 32, 8, 128, 0, 128, False)
    assert (g.vec, g.head_batch, g.order) == (4, 1, 0)  # 8-byte halves, one head per thread
    g = fixed_geometry("bfloat16", False, 32, 8, 128, 0, 128, True)
    assert (g.vec, g.head_batch, g.order) == (4, 2, 1)  # bhsd, 16-bit half-split: two heads per thread
    for dtype, interleaved in (("float32", False), ("float32", True)):
        assert fixed_geometry(dtype, interleaved, 32, 8, 128, 0, 128, True).head_batch == 1  # measured faster
    for dtype in ("bfloat16", "float16"):  # 16-bit interleaved pairs in bhsd order: two heads too
        assert fixed_geometry(dtype, True, 32, 8, 128, 0, 128, True).head_batch == 2
    assert fixed_geometry("bfloat16", False, 3, 1, 128, 0, 128, True).head_batch == 1  # odd heads
    assert fixed_geometry("float32", True, 32, 32, 128, 0, 128, True).vec == 4  # 16 bytes
    assert fixed_geometry("float16", True, 32, 32, 128, 0, 128, False).vec == 8
    assert fixed_geometry("bfloat16", False, 32, 8, 128, 0, 12, False) is None  # 6 pairs: not whole vectors
    assert fixed_geometry("bfloat16", False, 32, 8, 128, 2, 64, False) is None  # window start off a vector
    with pytest.raises(ValueError, match="dtype"):
        fixed_geometry("int8", False, 32, 8, 128, 0, 128, False)
    # The position scheme is compile-time, but for bf16 interleaved pairs in bhsd order (measured).
    assert fixed_geometry("float16", True, 32, 8, 128, 0, 128, True, 2).pos_mode == 2
    assert fixed_geometry("bfloat16", True, 32, 8, 128, 0, 128, False, 2).pos_mode == 2
    assert fixed_geometry("bfloat16", True, 32, 8, 128, 0, 128, True, 2).pos_mode == -1


def test_model_specs_cover_q_with_k_q_alone_k_alone_both_orders_each_position_scheme_and_both_strides():
    specs = model_fixed_specs("bfloat16", False, 32, 8, 128, 128)
    keys = {tuple(dict(s.defines).get(d, "0") for d in ("FIX_HQ", "FIX_HK", "FIX_ORDER", "FIX_POS", "FIX_DENSE"))
            for s in specs}
    # cu_seqlens (scheme 3) is packed thd tokens: the token-major order only.
    assert keys == {(h, k, o, m, d) for h, k in (("32", "8"), ("32", "0"), ("8", "0")) for o in ("0", "1")
                    for m in ("0", "1", "2", "3") if not (o == "1" and m == "3") for d in ("0", "1")}
    assert len(specs) == len(keys)
    # Every default specialisation is in the registry's enumeration (what `rope-rtc warm` builds).
    names = {s.name for s in registry.all_specs()}
    assert {s.name for s in specs} <= names


@pytest.mark.parametrize("scheme,mode", [("offset", 0), ("offsets", 1), ("positions", 2), ("cu_seqlens", 3)])
def test_the_build_fixes_the_calls_position_scheme(gpu, scheme, mode):
    """The specialised build is compiled for the call's position scheme (FIX_POS): the kernel
    reads no scheme from its block."""
    cos, sin = _table(64, 64)
    q, k = fake_cupy((10, 32, 128), BF16), fake_cupy((10, 8, 128), BF16)
    kw = {"offset": {"offset": 3}, "offsets": {"offset": fake_cupy((1,), np.int32)},
          "positions": {"positions": fake_cupy((10,), np.int64)},
          "cu_seqlens": {"cu_seqlens": fake_cupy((3,), np.int32)}}[scheme]
    apply_rope_qk(q, k, cos, sin, layout="thd", q_out=q, k_out=k, **kw)
    rec = gpu.launches[-1]
    assert rec["fn"][0] == "rope_fixed" and rec["geometry"].pos_mode == mode
    assert dict(rec["geometry"].spec().defines)["FIX_POS"] == str(mode)
    assert rec["fixed"].pos_mode == mode  # the block still says it (the generic build's field)


def test_an_aligned_call_runs_the_specialised_build_with_its_block(gpu):
    cos, sin = _table(64, 64)
    q, k = fake_cupy((2, 5, 32, 128), BF16), fake_cupy((2, 5, 8, 128), BF16)
    pos = fake_cupy((2, 5), np.int64)
    apply_rope_qk(q, k, cos, sin, positions=pos, q_out=q, k_out=k, layout="bshd")
    rec = gpu.launches[-1]
    assert rec["fn"][0] == "rope_fixed"
    g, p = rec["geometry"], rec["fixed"]
    assert (g.q_heads, g.k_heads, g.head_dim, g.rotary_dim, g.order) == (32, 8, 128, 128, 0)
    assert (p.in_[0], p.out[0], p.in_[1], p.out[1]) == (q.data.ptr, q.data.ptr, k.data.ptr, k.data.ptr)
    assert (p.in_sb[0], p.in_ss[0], p.in_sh[0]) == (5 * 32 * 128, 32 * 128, 128)
    assert (p.in_sb[1], p.in_ss[1], p.in_sh[1]) == (5 * 8 * 128, 8 * 128, 128)
    assert (p.positions, p.pos_mode, p.index_flags) == (pos.data.ptr, 2, 1)
    assert (p.cos, p.sin, p.table_rows, p.table_stride) == (cos.data.ptr, sin.data.ptr, 64, 64)
    units = 64 // g.vec
    assert p.total == 10 * 40 * units and p.num_tokens == 10 and p.seq_len == 5
    (gx, _, _), (bx, _, _) = rec["grid"], rec["block"]
    assert gx * bx >= p.total > (gx - 1) * bx


def test_a_misaligned_call_runs_the_generic_kernel(gpu):
    cos, sin = _table(64, 64)
    x = fake_cupy((1, 5, 4, 128), BF16, byte_offset=2)  # 2-byte aligned: narrower than 8-byte vectors
    apply_rope(x, cos, sin, out=x, layout="bshd")
    assert gpu.launches[-1]["fn"][0] == "rope_apply"


def test_out_of_place_partial_window_runs_the_generic_kernel(gpu):
    cos, sin = _table(64, 32)
    x, y = fake_cupy((1, 5, 4, 128), BF16), fake_cupy((1, 5, 4, 128), BF16)
    apply_rope(x, cos, sin, rotary_dim=64, out=y, layout="bshd")
    assert gpu.launches[-1]["fn"][0] == "rope_apply" and gpu.launches[-1]["params"].copy_passthrough == 1
    apply_rope(x, cos, sin, rotary_dim=64, out=x, layout="bshd")  # in place nothing is copied: specialised
    assert gpu.launches[-1]["fn"][0] == "rope_fixed"


def test_the_generic_switch(gpu, monkeypatch):

    cos, sin = _table(64, 64)
    x = fake_cupy((1, 5, 4, 128), BF16)
    _switch(monkeypatch, "USE_FIXED", False)
    apply_rope(x, cos, sin, out=x, layout="bshd")
    assert gpu.launches[-1]["fn"][0] == "rope_apply"


def test_a_new_int_offset_is_written_into_the_specialised_block(gpu):
    """The rescalar path (same arrays, new offset) writes FixedParams.offset, not the generic
    block's offset field (another field of the specialised block)."""
    cos, sin = _table(64, 64)
    q = fake_cupy((1, 5, 4, 128), BF16)
    plan = rope_plan.RopePlan(q, None, cos, sin, layout="bshd").compile()
    for offset in (0, 9, 30, 9):
        plan.execute(q, None, cos, sin, offset=offset)
        rec = gpu.launches[-1]
        assert rec["fn"][0] == "rope_fixed"
        assert rec["fixed"].offset == offset
        assert rec["fixed"].total == 5 * 4 * (64 // rec["geometry"].vec)  # nothing else moved


def test_specialised_and_generic_blocks_alternate_on_one_plan(gpu):
    """One plan, aligned and misaligned arrays of one signature in turn: each launch gets the
    block of its own build."""
    cos, sin = _table(64, 64)
    a = fake_cupy((1, 5, 4, 128), BF16)
    b = fake_cupy((1, 5, 4, 128), BF16, byte_offset=2)
    plan = rope_plan.RopePlan(a, None, cos, sin, layout="bshd").compile()
    for x in (a, b, a, b):
        plan.execute(x, None, cos, sin, offset=3)
        rec = gpu.launches[-1]
        if x is a:
            assert rec["fn"][0] == "rope_fixed" and rec["fixed"].in_[0] == a.data.ptr and rec["fixed"].offset == 3
        else:
            assert rec["fn"][0] == "rope_apply" and rec["params"].q_in == b.data.ptr and rec["params"].offset == 3


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(["float32", "float16", BF16]), interleaved=st.booleans(),
       layout=st.sampled_from(["bshd", "bhsd", "sbhd", "thd"]), heads=st.tuples(st.integers(1, 9), st.integers(0, 5)),
       tokens=st.tuples(st.integers(1, 4), st.integers(1, 9)), window=st.sampled_from([(None, 0), (32, 0), (32, 32)]),
       shift=st.sampled_from([0, 1, 2, 4, 8]), in_place=st.booleans())
def test_fuzz_each_launch_fits_its_build(dtype, interleaved, layout, heads, tokens, window, shift, in_place):
    """Whatever a call is, a specialised launch gets aligned addresses and the thread count of
    its geometry; a generic one gets a vector its addresses allow."""
    (hq, hk), (b, s), (rdim, roff) = heads, tokens, window
    D = 64
    shape = {"bshd": lambda h: (b, s, h, D), "bhsd": lambda h: (b, h, s, D), "sbhd": lambda h: (s, b, h, D),
             "thd": lambda h: (b * s, h, D)}[layout]
    shift *= np.dtype(dtype).itemsize * (2 if interleaved else 1)  # whole elements (pairs) off 16 bytes
    q = fake_cupy(shape(hq), dtype, byte_offset=shift)
    k = fake_cupy(shape(hk), dtype) if hk else None
    cos, sin = _table(64, (rdim or D) // 2)
    qo = q if in_place else fake_cupy(q.shape, dtype)
    ko = (k if in_place else fake_cupy(k.shape, dtype)) if hk else None
    with FakeGPU(fixed=True) as gpu:
        if hk:
            apply_rope_qk(q, k, cos, sin, layout=layout, interleaved=interleaved, rotary_dim=rdim, rotary_offset=roff,
                          q_out=qo, k_out=ko, offset=1)
        else:
            apply_rope(q, cos, sin, layout=layout, interleaved=interleaved, rotary_dim=rdim, rotary_offset=roff,
                       out=qo, offset=1)
    (rec,) = gpu.launches
    size = np.dtype(dtype).itemsize
    if rec["fn"][0] == "rope_fixed":
        g, p = rec["geometry"], rec["fixed"]
        assert in_place or (rdim or D) == D
        for ptr in (p.in_[0], p.out[0]) + ((p.in_[1], p.out[1]) if hk else ()):
            assert ptr % (g.vec * size) == 0
        units = ((rdim or D) if interleaved else (rdim or D) // 2) // g.vec
        assert p.total == b * s * ((hq + hk) // g.head_batch) * units
        assert (g.q_heads, g.k_heads, g.order) == (hq, hk, int(layout == "bhsd"))
        assert p.offset == 1
    else:
        vec = rec["vec"]
        p = rec["params"]
        for ptr in (p.q_in, p.q_out) + ((p.k_in, p.k_out) if hk else ()):
            assert ptr % (vec * size) == 0
        # The specialised build declined: misaligned for it, or a partial window copied out of place.
        g = fixed_geometry(np.dtype(dtype).name if dtype is not BF16 else "bfloat16", interleaved, hq, hk, D, roff,
                           rdim or D, layout == "bhsd")
        assert g is None or shift % (g.vec * size) or (not in_place and (rdim or D) < D)


def _uncached(monkeypatch, missing, hint: str = "") -> None:
    """Specialised builds for which ``missing(g)`` holds are not in the cache (as under
    ROPE_RTC_NO_COMPILE); the others load as the fake GPU loads them."""
    from rope_rtc.errors import KernelNotCachedError

    cached = rope_plan.load_fixed_function

    def load(g, device, pdl=False):
        if missing(g):
            raise KernelNotCachedError(f"kernel {g.spec().name} for sm_90 is not in the cache{hint}")
        return cached(g, device)

    monkeypatch.setattr(rope_plan, "load_fixed_function", load)


def test_a_missing_specialised_build_under_no_compile_falls_back_with_a_warning(gpu, monkeypatch):
    """A cache warmed without the model's specialised build still serves every call (the generic
    build), and says once which command adds the build."""
    _uncached(monkeypatch, lambda g: True, "; fill it with: rope-rtc warm --arch sm_90 --model config.json")
    cos, sin = _table(64, 64)
    x = fake_cupy((1, 5, 4, 128), BF16)
    with pytest.warns(RuntimeWarning, match="--model config.json.*generic build"):
        plan = rope_plan.RopePlan(x, None, cos, sin, layout="bshd").compile()
    plan.execute(x, None, cos, sin)
    with pytest.warns(RuntimeWarning, match="generic build"):
        apply_rope(x, cos, sin, out=x, layout="bshd")  # the one-call path too (its own plan warns once)
    assert [r["fn"][0] for r in gpu.launches] == ["rope_apply", "rope_apply"]


def test_the_host_mirror_of_FixedParams_has_the_device_structs_fields_in_its_order():
    """rope_params.FIXED_FIELDS mirrors cuda_src/fixed_params.cuh field for field: the one-call
    path packs the first eleven by offset (rope_plan.FIXED_CALL)."""
    import ctypes
    import re

    from rope_rtc.ops.rope_params import FIXED_FIELDS
    from rope_rtc.build.sources import source_dir

    text = (source_dir() / "fixed_params.cuh").read_text()
    body = re.search(r"struct FixedParams \{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    device = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        ctype, names = decl.split(None, 1)
        for name in names.split(","):
            name = name.strip()
            count = int(re.search(r"\[(\d+)\]", name).group(1)) if "[" in name else 1
            device.append((re.sub(r"\[.*", "", name), DEVICE_TYPES[ctype], count))
    # The element type and count of each host field (a ctypes array: its _type_ and _length_).
    host = [(name.rstrip("_"), t._type_, t._length_) if issubclass(t, ctypes.Array) else (name.rstrip("_"), t, 1)
            for name, t in FIXED_FIELDS]
    assert host == device


def test_a_missing_dense_build_under_no_compile_runs_the_strided_one(gpu, monkeypatch):
    """A cache that holds a model's strided build but not its dense one (warmed for chosen specs)
    serves a dense call with the strided build, not the generic kernel."""
    _uncached(monkeypatch, lambda g: g.dense)
    cos, sin = _table(64, 64)
    x = fake_cupy((1, 5, 4, 128), BF16)
    with pytest.warns(RuntimeWarning, match="not in the cache. Until then this plan runs its strided build"):
        plan = rope_plan.RopePlan(x, None, cos, sin, layout="bshd").compile()
    plan.execute(x, None, cos, sin)
    rec = gpu.launches[-1]
    assert rec["fn"][0] == "rope_fixed" and not rec["geometry"].dense


# What each device type of the argument blocks is on the host: size and signedness (or float) too.
DEVICE_TYPES = {"u64": ctypes.c_uint64, "i64": ctypes.c_int64, "double": ctypes.c_double,
                "unsigned": ctypes.c_uint32, "int": ctypes.c_int32, "float": ctypes.c_float}


# The dense build (FIX_DENSE): one run-time stride per array, every field it reads in the block's
# first two lines. The plan picks it from the call's strides.
@pytest.mark.parametrize("layout,shape,dense,runs", [
    ("bshd", (2, 5, 4, 128), True, (4 * 128,) * 2),           # contiguous: the token stride
    ("thd", (10, 4, 128), True, (4 * 128,) * 2),
    ("bhsd", (2, 4, 5, 128), True, (5 * 128,) * 2),           # contiguous bhsd: the head stride
    ("sbhd", (5, 2, 4, 128), False, None),                     # batches are not one after another
    ("bshd", (1, 1, 4, 128), True, (0, 0)),                    # one token: no stride is ever used
])
def test_dense_arrays_take_the_dense_build_with_one_stride_each(gpu, layout, shape, dense, runs):
    cos, sin = _table(64, 64)
    x = fake_cupy(shape, BF16)
    apply_rope(x, cos, sin, layout=layout, out=x)
    rec = gpu.launches[-1]
    assert rec["fn"][0] == "rope_fixed" and rec["geometry"].dense is dense
    assert ("FIX_DENSE", "1") in rec["geometry"].spec().defines if dense else True
    p = rec["fixed"]
    if dense:
        assert (p.dense_in[0], p.dense_out[0]) == runs
    else:
        assert tuple(p.dense_in) == tuple(p.dense_out) == (0, 0)


def test_fused_qkv_views_are_dense_in_token_major_order(gpu):
    """q and k as views of one [T, Hq + 2 Hkv, D] buffer: heads head_dim apart, a token stride
    of the whole buffer's row: the dense build with that stride."""
    from fakes import fused_qkv

    cos, sin = _table(64, 64)
    _, q, k, _ = fused_qkv(1, 6, 8, 2, 128, BF16, layout="thd", cupy_fake=True)
    apply_rope_qk(q, k, cos, sin, layout="thd", offset=3, q_out=q, k_out=k)
    rec = gpu.launches[-1]
    assert rec["geometry"].dense and rec["fn"][0] == "rope_fixed"
    p = rec["fixed"]
    assert tuple(p.dense_in) == tuple(p.dense_out) == (12 * 128, 12 * 128)


def test_a_head_padded_bhsd_cache_is_dense_and_a_gapped_batch_is_not(gpu):
    cos, sin = _table(64, 64)
    # bhsd rows of 5 tokens inside a 7-token allocation per head: rows dense, head stride 7 * 128.
    x = fake_cupy((2, 4, 5, 128), BF16, strides=(4 * 7 * 256, 7 * 256, 256, 2))
    apply_rope(x, cos, sin, layout="bhsd", out=x)
    rec = gpu.launches[-1]
    assert rec["geometry"].dense and tuple(rec["fixed"].dense_in) == (7 * 128, 0)
    # batches further apart than their heads: the strided build.
    y = fake_cupy((2, 4, 5, 128), BF16, strides=(9 * 5 * 256, 5 * 256, 256, 2))
    apply_rope(y, cos, sin, layout="bhsd", out=y)
    assert not gpu.launches[-1]["geometry"].dense
    # heads further apart than head_dim in token-major order (a padded head): the strided build.
    z = fake_cupy((1, 5, 4, 128), BF16, strides=(5 * 4 * 512, 4 * 512, 512, 2))
    apply_rope(z, cos, sin, out=z, layout="bshd")
    assert not gpu.launches[-1]["geometry"].dense


def test_out_of_place_outputs_carry_their_own_dense_stride(gpu):
    from fakes import fused_qkv

    cos, sin = _table(64, 64)
    _, q, k, _ = fused_qkv(1, 6, 8, 2, 128, BF16, layout="thd", cupy_fake=True)
    qo, ko = fake_cupy((6, 8, 128), BF16), fake_cupy((6, 2, 128), BF16)
    apply_rope_qk(q, k, cos, sin, layout="thd", q_out=qo, k_out=ko)
    p = gpu.launches[-1]["fixed"]
    assert (p.dense_in[0], p.dense_out[0], p.dense_in[1], p.dense_out[1]) == (12 * 128, 8 * 128, 12 * 128, 2 * 128)


def test_the_dense_switch_and_the_plan_loads_both_builds(gpu, monkeypatch):

    cos, sin = _table(64, 64)
    x = fake_cupy((1, 5, 4, 128), BF16)
    _switch(monkeypatch, "USE_DENSE", False)
    apply_rope(x, cos, sin, out=x, layout="bshd")
    assert gpu.launches[-1]["fn"][0] == "rope_fixed" and not gpu.launches[-1]["geometry"].dense
    plan = rope_plan.RopePlan(x, None, cos, sin, layout="bshd").compile()
    assert {g.dense for g in plan._fixed} == {False, True}  # compile loads both: execute never compiles


def test_a_table_too_long_for_the_blocks_32_bit_fields_runs_the_generic_kernel(gpu, monkeypatch):

    cos, sin = _table(64, 64)
    x = fake_cupy((1, 5, 4, 128), BF16)
    _switch(monkeypatch, "TABLE_ROWS_LIMIT", 64)  # a 64-row table stands in for 2^32 rows
    apply_rope(x, cos, sin, out=x, layout="bshd")
    assert gpu.launches[-1]["fn"][0] == "rope_apply"


def test_tables_the_dense_build_cannot_read_in_vectors_run_the_strided_build(gpu):
    """The dense build reads table rows in vectors. A row stride that never allows it gives the
    template the strided build; table addresses that do not allow it (this call only) run the
    strided build on the same block, through the plan and the one-call path alike."""
    x = fake_cupy((1, 5, 4, 128), BF16)
    cos, sin = _table(64, 64)
    apply_rope(x, cos, sin, out=x, layout="bshd")
    assert gpu.launches[-1]["geometry"].dense
    # Rows 65 floats apart: never vector-aligned.
    c65 = fake_cupy((64, 64), np.float32, strides=(65 * 4, 4))
    s65 = fake_cupy((64, 64), np.float32, strides=(65 * 4, 4))
    apply_rope(x, c65, s65, out=x, layout="bshd")
    assert not gpu.launches[-1]["geometry"].dense
    # Rows aligned, but these tables start 4 bytes off a 16-byte boundary.
    c4, s4 = fake_cupy((64, 64), np.float32, byte_offset=4), fake_cupy((64, 64), np.float32, byte_offset=4)
    plan = rope_plan.RopePlan(x, None, cos, sin, layout="bshd").compile()
    for tables, dense in (((cos, sin), True), ((c4, s4), False), ((cos, sin), True), ((c4, s4), False)):
        plan.execute(x, None, *tables)
        assert gpu.launches[-1]["geometry"].dense is dense
        assert gpu.launches[-1]["fixed"].table_vec == int(dense)
    for tables, dense in (((c4, s4), False), ((cos, sin), True), ((c4, s4), False)):
        apply_rope(x, *tables, out=x, layout="bshd")
        assert gpu.launches[-1]["geometry"].dense is dense


def test_large_bhsd_launches_keep_the_strided_build(gpu, monkeypatch):

    cos, sin = _table(64, 64)
    x = fake_cupy((2, 4, 5, 128), BF16)
    _switch(monkeypatch, "DENSE_BHSD_THREADS", 320)  # this launch: 10 rows x 2 head pairs x 16 units
    apply_rope(x, cos, sin, layout="bhsd", out=x)
    assert gpu.launches[-1]["fn"][0] == "rope_fixed" and not gpu.launches[-1]["geometry"].dense
    y = fake_cupy((2, 5, 4, 128), BF16)  # token-major: dense at any size
    apply_rope(y, cos, sin, out=y, layout="bshd")
    assert gpu.launches[-1]["geometry"].dense
    _switch(monkeypatch, "DENSE_BHSD_THREADS", 321)
    apply_rope(x, cos, sin, layout="bhsd", out=x)
    assert gpu.launches[-1]["geometry"].dense


def test_a_new_int_offset_on_the_strided_fallback_is_written_into_the_specialised_block(gpu):
    """A dense plan whose tables sit off the vector boundary runs the strided build; a new int
    offset on the same arrays must land in FixedParams.offset there too, not in the generic
    block's offset field (which is k's head stride in the specialised block)."""
    q, k = fake_cupy((1, 5, 4, 128), BF16), fake_cupy((1, 5, 2, 128), BF16)
    c4, s4 = fake_cupy((64, 64), np.float32, byte_offset=4), fake_cupy((64, 64), np.float32, byte_offset=4)
    plan = rope_plan.RopePlan(q, k, c4, s4, layout="bshd").compile()
    for offset in (0, 3, 7, 3):
        plan.execute(q, k, c4, s4, offset=offset)
        rec = gpu.launches[-1]
        assert not rec["geometry"].dense
        p = rec["fixed"]
        assert p.offset == offset
        assert tuple(p.in_sh) == tuple(p.out_sh) == (128, 128)


def test_tables_read_backwards_keep_the_specialised_builds(gpu):
    """Table rows a negative stride apart are accepted by validation; the specialised block
    carries the signed row stride (multimodal RoPE and the fused QK-norm have no other build)."""
    from rope_rtc import apply_mrope_qk, apply_qk_norm_rope

    cos, sin = _table(64, 64)
    q, k = fake_cupy((6, 4, 128), BF16), fake_cupy((6, 2, 128), BF16)
    apply_rope_qk(q, k, cos[::-1], sin[::-1], layout="thd", offset=2, q_out=q, k_out=k)
    rec = gpu.launches[-1]
    assert rec["fn"][0] == "rope_fixed" and rec["fixed"].table_stride == -64
    positions = fake_cupy((3, 6), np.int32)
    apply_mrope_qk(q, k, cos[::-1], sin[::-1], positions, [16, 24, 24], layout="thd")
    assert gpu.launches[-1]["fixed"].table_stride == -64
    qw, kw = fake_cupy((128,), BF16), fake_cupy((128,), BF16)
    apply_qk_norm_rope(q, k, qw, kw, cos[::-1], sin[::-1], eps=1e-6, layout="thd", offset=2, q_out=q, k_out=k)
    assert gpu.launches[-1]["norm"].table_stride == -64
