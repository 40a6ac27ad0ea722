"""Validation of the general RoPE API, on a CPU, with fake device arrays.

Every argument error must be a TypeError/ValueError naming the argument, raised before
anything is launched. The GPU step is replaced by :class:`fakes.FakeGPU`, which runs the real
host-side steps (vector choice, argument packing, grid) and records the launch instead of making
it: an error with no recorded launch is an error before any launch. Valid fake inputs are also
checked where they stop without that stand-in: at the GPU step, with a no-driver error.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import rope_rtc
from fakes import (BF16, FakeDeviceArray, FakeTorchTensor, fake_cupy, fake_like, fake_strided,
                   fake_torch_bf16_cai, fused_qkv, rope_host_steps)
from helpers import layout_shape
from rope_rtc import RopePlan, TensorDesc, apply_rope, apply_rope_qk
from rope_rtc.core import arrays as A
from rope_rtc.ops import rope as R
from rope_rtc.ops import rope_launch as RL
from rope_rtc.core.prepared import RECENT_SETS

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)

from rope_rtc.ops.rope_params import POS_CU_SEQLENS, POS_OFFSET, POS_OFFSETS, POS_POSITIONS

B, S, H, HK, D, ROWS = 2, 8, 4, 2, 64, 16


def _no_gpu_errors():
    return (rope_rtc.NoDeviceError, rope_rtc.CudaError)


def _gpu_present() -> bool:
    from rope_rtc.core import driver

    return driver.available()


needs_no_gpu = pytest.mark.skipif(_gpu_present(), reason="shows where a call stops without a GPU; with one, the "
                                  "fake pointers would reach a real launch")


def tables(rows=ROWS, cols=D // 2, dtype=np.float32):
    return FakeDeviceArray((rows, cols), dtype), FakeDeviceArray((rows, cols), dtype)


def index_array(shape, dtype=np.int32):
    return FakeDeviceArray(shape, dtype)


# ---------------------------------------------------------------------------------------------
# every argument error, through apply_rope, apply_rope_qk and RopePlan construction

API_NAMES = ("apply_rope", "apply_rope_qk", "plan")


def call(api, q, cos, sin, *, k=None, out=None, k_out=None, **kw):
    if api == "apply_rope":
        return apply_rope(q, cos, sin, out=out, backend="nvrtc", **kw)
    if k is None:  # a valid k like q (q's own faults are what the case is about)
        dtype = getattr(q, "dtype", None)
        ok = dtype in (np.float32, np.float16, BF16)
        k = fake_like(q.shape if ok else (B, S, H, D), dtype if ok else np.float16)
    if api == "apply_rope_qk":
        return apply_rope_qk(q, k, cos, sin, q_out=out, k_out=k_out, backend="nvrtc", **kw)
    return RopePlan(q, k, cos, sin, q_out=out, k_out=k_out, **kw)


def base(dtype=np.float16, shape=(B, S, H, D), rows=ROWS, cols=D // 2):
    c, s = tables(rows, cols)
    return dict(q=fake_like(shape, dtype), cos=c, sin=s, kw={"layout": "bshd"})


def _with(case=None, **changes):
    case = dict(case or base())
    kw = dict(case.pop("kw"))
    for key, value in changes.items():
        if key in ("q", "cos", "sin", "k", "out", "k_out"):
            case[key] = value
        else:
            kw[key] = value
    case["kw"] = kw
    return case


def _overlapping_out():
    buf = FakeDeviceArray((2 * B, S, H, D), np.float16)
    return _with(q=buf[0:B], out=buf[1 : B + 1])


def _same_memory_other_view():
    x = FakeDeviceArray((B, S, H, D), np.float16)
    # Same bytes, another layout (bhsd strides on a bshd shape): neither in place nor disjoint.
    return _with(q=x, out=x.with_strides((S * H * D * 2, D * 2, S * D * 2, 2)))


def _out_overlapping_cos():
    c = FakeDeviceArray((ROWS, D // 2), np.float32)
    # A float16 output laid over the cos table's bytes.
    return _with(cos=c, out=FakeDeviceArray((B, S, H, D), np.float16, ptr=c.ptr))


def _broadcast_out():
    x = FakeDeviceArray((B, S, H, D), np.float16)
    out = FakeDeviceArray((B, S, H, D), np.float16, strides=(0, H * D * 2, D * 2, 2))
    return _with(q=x, out=out)


def _thd(**changes):
    c, s = tables()
    case = dict(q=fake_like((B * S, H, D), np.float16), cos=c, sin=s, kw={"layout": "thd"})
    return _with(case, **changes)


# (id, case builder, exception, message pattern with {x} for the first tensor's name, apis)
CASES = [
    ("x_dtype_float64", lambda: base(np.float64), TypeError, r"{x}: dtype float64 is not supported", API_NAMES),
    ("x_dtype_int32", lambda: base(np.int32), TypeError, r"{x}: dtype int32", API_NAMES),
    ("cos_dtype", lambda: _with(cos=FakeDeviceArray((ROWS, D // 2), np.float64)), TypeError, r"cos: dtype float64",
     API_NAMES),
    ("sin_dtype", lambda: _with(sin=FakeDeviceArray((ROWS, D // 2), np.float16)), TypeError, r"sin: dtype float16",
     API_NAMES),
    ("cos_columns_vs_head_dim", lambda: base(cols=D // 4), ValueError, r"cos: has 16 columns but rotary_dim 64",
     API_NAMES),
    ("sin_shape_vs_cos", lambda: _with(sin=FakeDeviceArray((ROWS + 1, D // 2), np.float32)), ValueError,
     r"sin: shape", API_NAMES),
    ("cos_ndim", lambda: _with(cos=FakeDeviceArray((1, ROWS, D // 2), np.float32)), ValueError, r"cos: expected a 2-d",
     API_NAMES),
    ("table_rows_short_of_sequence", lambda: base(rows=S - 1), ValueError, r"offset: positions 0\.\.7", API_NAMES),
    ("offset_past_table", lambda: _with(offset=ROWS - S + 1), ValueError, r"offset: positions", API_NAMES),
    ("negative_offset", lambda: _with(offset=-1), ValueError, r"offset: positions -1", API_NAMES),
    ("rotary_dim_odd", lambda: _with(rotary_dim=63), ValueError, r"rotary_dim: must be a positive even", API_NAMES),
    ("rotary_dim_zero", lambda: _with(rotary_dim=0), ValueError, r"rotary_dim", API_NAMES),
    ("rotary_dim_negative", lambda: _with(rotary_dim=-2), ValueError, r"rotary_dim", API_NAMES),
    ("rotary_dim_too_large", lambda: _with(rotary_dim=D + 2), ValueError, r"rotary_dim/rotary_offset: window \[0, 66\)",
     API_NAMES),
    ("rotary_dim_float", lambda: _with(rotary_dim=32.0), TypeError, r"rotary_dim: expected an int", API_NAMES),
    ("rotary_dim_bool", lambda: _with(rotary_dim=True), TypeError, r"rotary_dim: expected an int", API_NAMES),
    ("rotary_offset_negative", lambda: _with(rotary_offset=-2, rotary_dim=32), ValueError, r"rotary_offset",
     API_NAMES),
    ("rotary_offset_past_head", lambda: _with(rotary_offset=2), ValueError, r"rotary_dim/rotary_offset: window \[2, 66\)",
     API_NAMES),
    ("rotary_offset_float", lambda: _with(rotary_offset=1.0), TypeError, r"rotary_offset: expected an int", API_NAMES),
    ("x_last_dim_strided", lambda: _with(q=FakeDeviceArray((B, S, H, 2 * D), np.float16)[..., ::2]), ValueError,
     r"{x}: the last dimension must be contiguous", API_NAMES),
    ("x_bf16_last_dim_strided", lambda: _with(q=fake_cupy((B, S, H, 2 * D), BF16)[..., ::2]), ValueError,
     r"{x}: the last dimension must be contiguous", API_NAMES),
    ("cos_last_dim_strided", lambda: _with(cos=FakeDeviceArray((ROWS, D), np.float32)[:, ::2]), ValueError,
     r"cos: the last dimension must be contiguous", API_NAMES),
    ("cos_misaligned_float", lambda: _with(cos=FakeDeviceArray((ROWS, D // 2), np.float32).shifted(2)), ValueError,
     r"cos: data pointer .* is not 4-byte aligned", API_NAMES),
    ("layout_unknown", lambda: _with(layout="bsdh"), ValueError, r"layout: 'bsdh' is not one of", API_NAMES),
    ("layout_rank", lambda: _with(layout="thd"), ValueError, r"{x}: layout 'thd' needs a 3-d array", API_NAMES),
    ("interleaved_not_bool", lambda: _with(interleaved="yes"), TypeError, r"interleaved: expected a bool", API_NAMES),
    ("inverse_not_bool", lambda: _with(inverse=1), TypeError, r"inverse: expected a bool", API_NAMES),
    ("positions_float", lambda: _with(positions=FakeDeviceArray((B, S), np.float32)), TypeError,
     r"positions: dtype float32", API_NAMES),
    ("positions_shape", lambda: _with(positions=index_array((B, S + 1))), ValueError,
     r"positions: expected shape \(2, 8\)", API_NAMES),
    ("positions_flat_for_bshd", lambda: _with(positions=index_array((B * S,))), ValueError,
     r"positions: expected shape", API_NAMES),
    ("positions_strided", lambda: _with(positions=index_array((B, 2 * S))[:, ::2]), ValueError,
     r"positions: must be C-contiguous", API_NAMES),
    ("positions_misaligned", lambda: _with(positions=index_array((B, S), np.int64).shifted(4)), ValueError,
     r"positions: data pointer .* is not 8-byte aligned", API_NAMES),
    ("offset_array_shape", lambda: _with(offset=index_array((B + 1,))), ValueError,
     r"offset: an array offset needs shape \(2,\)", API_NAMES),
    ("offset_array_dtype", lambda: _with(offset=FakeDeviceArray((B,), np.float32)), TypeError, r"offset: dtype float32",
     API_NAMES),
    ("offset_float_scalar", lambda: _with(offset=1.5), TypeError, r"offset: expected", API_NAMES),
    ("offset_bool", lambda: _with(offset=True), TypeError, r"offset: expected", API_NAMES),
    ("cu_seqlens_not_thd", lambda: _with(cu_seqlens=index_array((B + 1,))), ValueError,
     r"cu_seqlens: only for layout 'thd'", API_NAMES),
    ("cu_seqlens_dtype", lambda: _thd(cu_seqlens=FakeDeviceArray((B + 1,), np.float32)), TypeError,
     r"cu_seqlens: dtype float32", API_NAMES),
    ("cu_seqlens_too_short", lambda: _thd(cu_seqlens=index_array((1,))), ValueError, r"cu_seqlens: needs at least 2",
     API_NAMES),
    ("cu_seqlens_2d", lambda: _thd(cu_seqlens=index_array((B + 1, 1))), ValueError, r"cu_seqlens: expected a 1-d",
     API_NAMES),
    ("cu_seqlens_offset_shape", lambda: _thd(cu_seqlens=index_array((B + 1,)), offset=index_array((B + 2,))),
     ValueError, r"offset: an array offset needs shape \(2,\)", API_NAMES),
    ("positions_and_cu_seqlens", lambda: _thd(cu_seqlens=index_array((B + 1,)), positions=index_array((B * S,))),
     ValueError, r"positions and cu_seqlens", API_NAMES),
    ("positions_and_offset", lambda: _with(positions=index_array((B, S)), offset=3), ValueError,
     r"positions and offset", API_NAMES),
    ("positions_and_offset_array", lambda: _with(positions=index_array((B, S)), offset=index_array((B,))), ValueError,
     r"positions and offset", API_NAMES),
    ("x_torch_bf16_cai", lambda: _with(q=fake_torch_bf16_cai((B, S, H, D))), TypeError, r"{x}: dtype .V2 is an unnamed 2-byte type.*DLPack",
     API_NAMES),
    ("cos_v2_cai", lambda: _with(cos=FakeDeviceArray((ROWS, D // 2), np.float32, typestr="<V4")), TypeError,
     r"cos: .*DLPack", API_NAMES),
    ("x_ml_dtypes_fp8", lambda: _with(q=fake_cupy((B, S, H, D), FP8)), TypeError,
     r"{x}: dtype float8_e4m3fn is not supported; expected one of", API_NAMES),  # named: not torch's unnamed <V1
    ("x_requires_grad", lambda: _with(q=FakeTorchTensor((B, S, H, D), np.float16)), TypeError, r"{x} requires grad",
     API_NAMES),
    ("sin_requires_grad", lambda: _with(sin=FakeTorchTensor((ROWS, D // 2), np.float32)), TypeError,
     r"sin requires grad", API_NAMES),
    ("x_host_tables_device", lambda: _with(q=np.zeros((B, S, H, D), np.float16)), TypeError, r"host", API_NAMES),
    ("cos_host_x_device", lambda: _with(cos=np.zeros((ROWS, D // 2), np.float32)), TypeError, r"cos.*host", API_NAMES),
    ("positions_host", lambda: _with(positions=np.zeros((B, S), np.int32)), TypeError, r"positions.*host",
     API_NAMES),
    ("cos_other_device", lambda: _with(q=fake_cupy((B, S, H, D), np.float16), cos=fake_cupy((ROWS, D // 2), np.float32,
                                                                                               device=1)),
     ValueError, r"cos is on device 1 but {x} \(device 0\)", API_NAMES),
    ("not_an_array", lambda: _with(q=[[1.0, 2.0]]), TypeError, r"{x}: expected a CuPy or NumPy array", API_NAMES),
    ("declaration_in_one_call_api", lambda: _with(q=TensorDesc(np.float16, (B, S, H, D))), TypeError,
     r"{x}: a TensorDesc declares an array", ("apply_rope", "apply_rope_qk")),
    ("out_dtype", lambda: _with(out=FakeDeviceArray((B, S, H, D), np.float32)), TypeError, r"{o}: dtype float32 differs",
     API_NAMES),
    ("out_shape", lambda: _with(out=FakeDeviceArray((B, S, H + 1, D), np.float16)), ValueError, r"{o}: shape",
     API_NAMES),
    ("out_last_dim_strided", lambda: _with(out=FakeDeviceArray((B, S, H, 2 * D), np.float16)[..., ::2]), ValueError,
     r"{o}: the last dimension must be contiguous", API_NAMES),
    ("out_read_only", lambda: _with(out=FakeDeviceArray((B, S, H, D), np.float16, readonly=True)), ValueError,
     r"{o}: is read-only", API_NAMES),
    ("out_overlaps_x_partially", _overlapping_out, ValueError, r"{o} overlaps {x}", API_NAMES),
    ("out_same_bytes_other_view", _same_memory_other_view, ValueError,
     r"{o} overlaps {x} \(in place needs the very same view", API_NAMES),
    ("out_overlaps_cos", _out_overlapping_cos, ValueError, r"{o} overlaps cos", API_NAMES),
    ("out_overlaps_itself", _broadcast_out, ValueError, r"{o}: its elements overlap each other", API_NAMES),
    ("x_misaligned_element", lambda: _with(q=FakeDeviceArray((B, S, H, D), np.float32).shifted(2)), ValueError,
     r"{x}: addresses or strides are not aligned to 4 bytes", ("apply_rope", "apply_rope_qk")),
    ("bf16_interleaved_odd_pair", lambda: _with(q=fake_cupy((B, S, H, D), BF16, byte_offset=2), interleaved=True),
     ValueError, r"{x}: addresses or strides are not aligned to 4 bytes", ("apply_rope", "apply_rope_qk")),
    ("fp16_interleaved_odd_head_stride",
     lambda: _with(q=FakeDeviceArray((B, S, H, D + 1), np.float16)[..., :D], interleaved=True), ValueError,
     r"{x}: addresses or strides are not aligned to 4 bytes", ("apply_rope", "apply_rope_qk")),
    ("interleaved_odd_rotary_offset", lambda: _with(interleaved=True, rotary_offset=1, rotary_dim=32, cos=tables(
        cols=16)[0], sin=tables(cols=16)[1]), ValueError, r"rotary_offset/rotary_dim: .* not aligned",
     ("apply_rope", "apply_rope_qk")),
]


def _names(api):
    if api == "apply_rope":
        return {"x": "x", "o": "out"}
    return {"x": "q", "o": "q_out"}


# Misalignment is not an error of plan construction (a plan takes addresses at execute, tested
# below); declarations are what plans are built from.
_PARAMS = [pytest.param(api, *case[1:4], id=f"{case[0]}-{api}") for case in CASES for api in API_NAMES
           if api in case[4]]


@pytest.mark.parametrize("api,build,exc,pattern", _PARAMS)
def test_error_named_before_launch(gpu, api, build, exc, pattern):
    case = build()
    with pytest.raises(exc, match=pattern.format(**_names(api))):
        call(api, case["q"], case["cos"], case["sin"], out=case.get("out"), **case["kw"])
    assert gpu.launches == []
    if isinstance(case["q"], FakeTorchTensor):
        assert case["q"].dlpack_calls == 0, "a tensor that requires grad was exported before being rejected"


# errors that only exist with k

QK_CASES = [
    ("k_dtype", lambda q: dict(k=fake_like(q.shape, np.float32)), TypeError, r"k: dtype float32 differs from q's float16"),
    ("k_sequence_length", lambda q: dict(k=fake_like((B, S + 1, HK, D), np.float16)), ValueError,
     r"k: shape .* does not match q's"),
    ("k_head_dim", lambda q: dict(k=fake_like((B, S, HK, D + 2), np.float16)), ValueError, r"k: shape"),
    ("k_last_dim_strided", lambda q: dict(k=FakeDeviceArray((B, S, HK, 2 * D), np.float16)[..., ::2]), ValueError,
     r"k: the last dimension must be contiguous"),
    ("q_out_is_k", lambda q: (lambda k: dict(k=k, out=k, k_out=fake_like(k.shape, np.float16)))(
        fake_like((B, S, H, D), np.float16)), ValueError, r"q_out overlaps k"),
    ("k_out_overlaps_q", lambda q: dict(out=fake_like(q.shape, np.float16), k_out=q), ValueError, r"k_out overlaps q"),
    ("outputs_overlap_each_other", lambda q: (lambda o: dict(out=o, k_out=o))(fake_like(q.shape, np.float16)),
     ValueError, r"overlaps"),
    ("k_requires_grad", lambda q: dict(k=FakeTorchTensor((B, S, HK, D), np.float16)), TypeError, r"k requires grad"),
    ("k_host", lambda q: dict(k=np.zeros((B, S, HK, D), np.float16)), TypeError, r"host"),
]


@pytest.mark.parametrize("api", ("apply_rope_qk", "plan"))
@pytest.mark.parametrize("name,build,exc,pattern", QK_CASES, ids=[c[0] for c in QK_CASES])
def test_qk_error_named_before_launch(gpu, api, name, build, exc, pattern):
    q = fake_like((B, S, H, D), np.float16)
    c, s = tables()
    extra = build(q)
    with pytest.raises(exc, match=pattern):
        call(api, q, c, s, layout="bshd", **extra)
    assert gpu.launches == []


def test_apply_rope_qk_needs_k():
    q = fake_like((B, S, H, D), np.float16)
    c, s = tables()
    with pytest.raises(TypeError, match="k: expected an array"):
        apply_rope_qk(q, None, c, s, backend="nvrtc")
    with pytest.raises(ValueError, match="k_out: given without k"):
        R.validate(q, None, c, s, k_out=fake_like((B, S, H, D), np.float16), layout="bshd")


def test_backend_named(gpu):
    q = fake_like((B, S, H, D), np.float16)
    c, s = tables()
    with pytest.raises(ValueError, match=r"backend: 'cuda' is not one of"):
        apply_rope(q, c, s, backend="cuda")
    assert gpu.launches == []


def test_the_blog_kernels_are_not_an_api_option(gpu):
    # The blog's kernels live in rope_rtc.ops.blog (benchmark, demo); the API has one kernel family.
    q = fake_like((B, S, H, D), np.float16)
    c, s = tables()
    with pytest.raises(TypeError, match="variant"):
        apply_rope(q, c, s, backend="nvrtc", variant="baseline")
    from rope_rtc.ops.blog import prepare_blog_variant

    with pytest.raises(ValueError, match=r"variant: 'fastest' is not one of"):
        prepare_blog_variant("fastest", q, None, c, s, q_out=q)
    with pytest.raises(ValueError, match=r"variant: 'baseline' is the blog's kernel"):  # fp16 bshd
        prepare_blog_variant("baseline", q, None, c, s, q_out=q)
    assert gpu.launches == []


def test_numpy_backend_rejects_device_arrays():
    c, s = tables()
    for q in (FakeDeviceArray((B, S, H, D), np.float16), fake_cupy((B, S, H, D), BF16)):
        with pytest.raises(TypeError, match="backend='numpy' takes host"):
            apply_rope(q, c, s, backend="numpy", layout="bshd")


def test_cai_device_array_is_never_taken_for_host_memory():
    # The driver cannot name the device of a fake pointer (none here): a __cuda_array_interface__
    # is still device memory, never "host" (which would mix it with NumPy arrays unnoticed).
    info = A.describe(FakeDeviceArray((B, S, H, D), np.float16), "x")
    assert info.device is not None
    empty = A.describe(FakeDeviceArray((0, S, H, D), np.float16, ptr=0), "x")
    assert empty.device is not None


@pytest.mark.parametrize("which", ["q", "k", "cos"])
def test_cupy_strides_off_the_item_size_are_refused_before_any_launch(gpu, which):
    """CuPy builds views whose byte strides are not multiples of the item size (as_strided); no
    kernel can address their elements, and rounding the strides down addressed other bytes."""
    kw = dict(q=fake_cupy((2, 4, 8, 64), BF16), k=fake_cupy((2, 4, 2, 64), BF16),
              cos=fake_cupy((16, 32), np.float32), sin=fake_cupy((16, 32), np.float32))
    a = kw[which]
    odd = (a.strides[0] + 1,) + a.strides[1:]
    kw[which] = fake_cupy(a.shape, a.dtype, strides=odd)
    with pytest.raises(ValueError, match=f"{which}: strides .* not multiples of the item size"):
        apply_rope_qk(kw["q"], kw["k"], kw["cos"], kw["sin"], layout="bshd")
    assert gpu.launches == []


def test_an_int_offset_at_the_table_end_with_cu_seqlens_is_refused_on_every_path(gpu):
    """With cu_seqlens every sequence starts at the int offset: offset == table rows puts a
    token's position outside the table (NaN), on the first call, a plan's new offset and the
    one-call repeat path alike."""
    c, s = tables()
    rows = c.shape[0]
    t = fake_cupy((B * S, H, D), np.float16)
    cu = fake_cupy((B + 1,), np.int32)
    with pytest.raises(ValueError, match=f"offset: {rows} is not a position"):
        apply_rope(t, c, s, layout="thd", cu_seqlens=cu, offset=rows, out=t)
    apply_rope(t, c, s, layout="thd", cu_seqlens=cu, offset=rows - 1, out=t)  # the last row: fine
    apply_rope(t, c, s, layout="thd", cu_seqlens=cu, offset=rows - 1, out=t)  # the repeat path
    with pytest.raises(ValueError, match="offset"):
        apply_rope(t, c, s, layout="thd", cu_seqlens=cu, offset=rows, out=t)
    plan = RopePlan(t, None, c, s, layout="thd", cu_seqlens=cu, offset=1)
    plan.execute(t, None, c, s, cu_seqlens=cu, offset=1)
    with pytest.raises(ValueError, match="offset"):
        plan.execute(t, None, c, s, cu_seqlens=cu, offset=rows)
    assert len(gpu.launches) == 3


def test_numpy_strides_off_the_item_size_are_refused_and_nothing_is_written():
    """As for CuPy arrays: with byte strides rounded down, the overlap checks saw two outputs that
    share memory (or one that overlaps itself) as disjoint, and the host path wrote one over the
    other."""
    c, s = (np.ones((8, 1), np.float32) for _ in range(2))
    base = np.zeros(64, np.float32)
    q = np.ones((2, 1, 2, 2), np.float32)
    k = np.ones((2, 1, 1, 2), np.float32)
    q_out = np.ndarray((2, 1, 2, 2), np.float32, base.data, 0, (10, 8, 8, 4))  # rows 10 bytes apart
    before = base.copy()
    with pytest.raises(ValueError, match=r"q_out: strides \(10, 8, 8, 4\) \(bytes\) are not multiples"):
        apply_rope_qk(q, k, c, s, q_out=q_out, k_out=np.zeros_like(k), backend="numpy", rotary_dim=2, layout="bshd")
    np.testing.assert_array_equal(base, before)


def test_a_float_or_bool_offset_is_a_type_error_with_positions_too(gpu):
    c, s = tables()
    x = fake_cupy((B, S, H, D), np.float16)
    positions = fake_cupy((B, S), np.int32)
    for offset in (True, 0.0, 1.5):
        with pytest.raises(TypeError, match="offset: expected an int"):
            apply_rope(x, c, s, positions=positions, offset=offset, layout="bshd")


def test_malformed_cuda_array_interface_is_a_type_error():
    class Bad:
        __cuda_array_interface__ = {"shape": (2, 4), "typestr": "<f4", "data": (0x7F0000000000, False),
                                    "strides": (16,), "version": 3}

    with pytest.raises(TypeError, match="x: malformed __cuda_array_interface__"):
        A.describe(Bad(), "x")

    class NoData:
        __cuda_array_interface__ = {"shape": (2, 4), "typestr": "<f4", "version": 3}

    with pytest.raises(TypeError, match="x: malformed"):
        A.describe(NoData(), "x")


# ---------------------------------------------------------------------------------------------
# layout: taken from the array only where its rank settles it

# torch / Hugging Face attention's [B, H, S, D], which the rank alone cannot tell from [B, S, H, D]
HF_SHAPE = (2, 32, 128, 64)
BOTH_READINGS = (r"layout: {x} has shape \(2, 32, 128, 64\).*layout=\"bshd\" for \[B, S, H, D\] \(vLLM, "
                 r"FlashInfer, most engines\), layout=\"bhsd\" for \[B, H, S, D\] \(torch and Hugging Face "
                 r"attention\) or layout=\"sbhd\" for \[S, B, H, D\]")


@pytest.mark.parametrize("api", API_NAMES)
def test_a_4d_array_without_a_layout_is_refused_naming_both_readings(gpu, api):
    # S = 128 rows of positions would fit even if the 32 heads were read as the sequence.
    c, s = tables(rows=4096, cols=32)
    with pytest.raises(ValueError, match=BOTH_READINGS.format(**_names(api))):
        call(api, fake_like(HF_SHAPE, np.float16), c, s)
    assert gpu.launches == []
    for layout in ("bshd", "bhsd", "sbhd"):  # said explicitly, each is taken as it was
        call(api, fake_like(HF_SHAPE, np.float16), c, s, layout=layout)


def test_a_bhsd_array_without_a_layout_is_never_read_as_bshd_on_the_cpu():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(HF_SHAPE).astype(np.float32)
    cos, sin = rope_rtc.rope_tables(4096, 64)
    for fn, args in ((apply_rope, (x,)), (apply_rope_qk, (x, x.copy()))):
        with pytest.raises(ValueError, match=r"layout: (x|q) has shape \(2, 32, 128, 64\).*\"bshd\".*\"bhsd\""):
            fn(*args, cos, sin, backend="numpy")
    got = apply_rope(x, cos, sin, layout="bhsd", backend="numpy")
    want = apply_rope(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), cos, sin, layout="bshd", backend="numpy")
    np.testing.assert_array_equal(got, want.transpose(0, 2, 1, 3))


def test_a_3d_array_without_a_layout_is_thd():
    rng = np.random.default_rng(1)
    t = rng.standard_normal((B * S, H, D)).astype(np.float32)
    k = rng.standard_normal((B * S, HK, D)).astype(np.float32)
    cos, sin = rope_rtc.rope_tables(ROWS, D)
    np.testing.assert_array_equal(apply_rope(t, cos, sin, backend="numpy"),
                                  apply_rope(t, cos, sin, layout="thd", backend="numpy"))
    cu = np.array([0, 3, B * S], np.int32)
    for a, b in zip(apply_rope_qk(t, k, cos, sin, cu_seqlens=cu, backend="numpy"),
                    apply_rope_qk(t, k, cos, sin, cu_seqlens=cu, layout="thd", backend="numpy")):
        np.testing.assert_array_equal(a, b)
    req = R.validate(t, k, cos, sin)
    assert req.layout == "thd" and (req.cq.B, req.cq.S) == (1, B * S)


@pytest.mark.parametrize("api", API_NAMES)
def test_a_3d_device_array_without_a_layout_launches_as_thd(gpu, api):
    c, s = tables()
    q = fake_like((B * S, H, D), np.float16)
    k = fake_like((B * S, HK, D), np.float16)
    plans = []
    for layout in (None, "thd"):
        if api == "plan":
            plan = RopePlan(q, k, c, s, layout=layout)
            assert plan.layout == "thd" and plan._opts["layout"] == "thd"
            plan.execute(q, k, c, s)
            plans.append(plan)
        else:
            call(api, q, c, s, k=k, out=q, k_out=k, **({} if layout is None else {"layout": layout}))
    a, b = (bytes(rec["params"]) for rec in gpu.launches[-2:])
    assert a == b
    if plans:  # a plan settled by q's rank refuses what a "thd" plan refuses
        with pytest.raises(ValueError, match=r"q: layout 'thd' needs a 3-d array"):
            plans[0].execute(fake_like((B, S, H, D), np.float16), fake_like((B, S, HK, D), np.float16), c, s)


def test_other_ranks_without_a_layout_are_refused(gpu):
    c, s = tables()
    for shape in ((B * S, H * D), (1, B, S, H, D)):
        with pytest.raises(ValueError, match=r"x: expected a 3-d \[T, H, D\] array, or a 4-d one with "
                                             r"layout=\"bshd\", \"bhsd\" or \"sbhd\"; got shape"):
            apply_rope(fake_like(shape, np.float16), c, s, backend="nvrtc")
    assert gpu.launches == []


# ---------------------------------------------------------------------------------------------
# valid fake inputs: they stop at the GPU step, never before

@needs_no_gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["float32", "float16", "bfloat16"])
def test_valid_call_fails_only_at_the_gpu_step(dtype):
    q = fake_like((B, S, H, D), dtype)
    k = fake_like((B, S, HK, D), dtype)
    c, s = tables()
    errors = _no_gpu_errors()
    # The one-call functions say so in the library's own words, not CuPy's "driver version is insufficient".
    with pytest.raises(rope_rtc.NoDeviceError, match="no usable CUDA GPU"):
        apply_rope(q, c, s, backend="nvrtc")
    with pytest.raises(rope_rtc.NoDeviceError):
        apply_rope_qk(q, k, c, s, backend="nvrtc")
    with pytest.raises(rope_rtc.NoDeviceError):
        apply_rope(q, c, s, out=q, backend="nvrtc")
    plan = RopePlan(q, k, c, s, layout="bshd")  # construction validates, and needs no GPU
    with pytest.raises(errors):
        plan.execute(q, k, c, s)


def _canonical_strides(layout, shape):
    acc, st = 1, {}
    for axis, d in zip(reversed(layout), reversed(shape)):
        st[axis] = acc
        acc *= d
    if layout == "thd":
        return 0, st["t"], st["h"]
    return st["b"], st["s"], st["h"]


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd", "thd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["float32", "float16", "bfloat16"])
def test_request_canonical_view(layout, dtype):
    shape = layout_shape(layout, B, S, H, D)
    q = fake_like(shape, dtype)
    k = fake_like(layout_shape(layout, B, S, HK, D), dtype)
    c, s = tables(rows=B * S)
    req = R.validate(q, k, c, s, layout=layout)
    sb, ss, sh = _canonical_strides(layout, shape)
    nb, ns = (1, B * S) if layout == "thd" else (B, S)
    assert (req.cq.B, req.cq.S, req.cq.H, req.cq.D) == (nb, ns, H, D)
    assert (req.cq.sb, req.cq.ss, req.cq.sh) == (sb, ss, sh)
    assert req.ck.H == HK and (req.ck.B, req.ck.S, req.ck.D) == (nb, ns, D)
    assert req.num_tokens == B * S
    assert req.pos_mode == POS_OFFSET and req.offset == 0
    assert not req.in_place
    assert req.q.array is q and req.k.array is k  # no copy
    assert req.dtype == A.dtype_name(dtype)
    assert RL.choose_vector(req) * req.q.itemsize == 16


def test_request_position_schemes():
    q = fake_like((B, S, H, D), np.float16)
    c, s = tables()
    assert R.validate(q, None, c, s, offset=3, layout="bshd").pos_mode == POS_OFFSET
    assert R.validate(q, None, c, s, offset=3, layout="bshd").offset == 3
    assert R.validate(q, None, c, s, offset=index_array((B,)), layout="bshd").pos_mode == POS_OFFSETS
    assert R.validate(q, None, c, s, offset=index_array((B,), np.int64), layout="bshd").pos_mode == POS_OFFSETS
    assert R.validate(q, None, c, s, positions=index_array((B, S), np.int64), layout="bshd").pos_mode == POS_POSITIONS
    assert R.validate(q, None, c, s, positions=index_array((B, S)), offset=None,
                      layout="bshd").pos_mode == POS_POSITIONS
    t = fake_like((B * S, H, D), np.float16)
    assert R.validate(t, None, c, s, layout="thd", positions=index_array((B * S,))).pos_mode == POS_POSITIONS
    cu = R.validate(t, None, c, s, layout="thd", cu_seqlens=index_array((B + 1,)), offset=index_array((B,)))
    assert cu.pos_mode == POS_CU_SEQLENS and cu.offsets is not None
    _, p, _, _ = rope_host_steps(cu)
    assert (p.pos_mode, p.num_seqs, p.num_tokens, p.seq_len) == (POS_CU_SEQLENS, B, B * S, B * S)
    # An offset beyond the table is not checked with cu_seqlens (positions restart per sequence).
    assert R.validate(t, None, c, s, layout="thd", cu_seqlens=index_array((B + 1,)), offset=5).offset == 5


def test_request_in_place_flags():
    q = fake_like((B, S, H, D), np.float16)
    k = fake_like((B, S, HK, D), np.float16)
    c, s = tables(cols=16)
    assert R.validate(q, None, c, s, rotary_dim=32, q_out=q, layout="bshd").in_place
    assert R.validate(q, None, c, s, rotary_dim=32, q_out=q[...],
                      layout="bshd").in_place  # the same view, another object
    assert not R.validate(q, None, c, s, rotary_dim=32, q_out=fake_like(q.shape, np.float16), layout="bshd").in_place
    assert R.validate(q, k, c, s, rotary_dim=32, q_out=q, k_out=k, layout="bshd").in_place
    # q in place, k out of place: the channels outside k's window must still be copied.
    mixed = R.validate(q, k, c, s, rotary_dim=32, q_out=q, k_out=fake_like(k.shape, np.float16), layout="bshd")
    assert not mixed.in_place
    assert rope_host_steps(mixed)[1].copy_passthrough == 1
    full = R.validate(q, k, c, s, rotary_dim=32, q_out=q, k_out=k, layout="bshd")
    assert rope_host_steps(full)[1].copy_passthrough == 0


def _vec_bytes(q, c, s, layout="bshd", **kw):
    req = R.validate(q, None, c, s, layout=layout, **kw)
    return RL.choose_vector(req) * req.q.itemsize


def test_choose_vector_widths():
    c, s = tables()
    for dtype in (np.float32, np.float16, BF16):
        assert _vec_bytes(fake_like((B, S, H, D), dtype), c, s) == 16
        assert _vec_bytes(fake_like((B, S, H, D), dtype), c, s, interleaved=True) == 16
    f32 = FakeDeviceArray((B, S, H, D), np.float32)
    assert _vec_bytes(f32.shifted(8), c, s) == 8
    assert _vec_bytes(f32.shifted(4), c, s) == 4
    with pytest.raises(ValueError, match="not aligned to 8 bytes"):  # an FP32 pair is one 8-byte access
        _vec_bytes(f32.shifted(4), c, s, interleaved=True)
    f16 = FakeDeviceArray((B, S, H, D), np.float16)
    assert _vec_bytes(f16.shifted(2), c, s) == 2
    assert _vec_bytes(f16.shifted(4), c, s, interleaved=True) == 4
    bf16 = fake_cupy((B, S, H, D), BF16, byte_offset=8)
    assert _vec_bytes(bf16, c, s) == 8
    # A head stride of 68 fp16 elements (a padded buffer) is only 8-byte aligned.
    padded = FakeDeviceArray((B, S, H, D + 4), np.float16)[..., :D]
    assert _vec_bytes(padded, c, s) == 8
    assert _vec_bytes(fake_strided((B, S, H, D), np.float16, pad_elems=4), c, s) == 8
    assert _vec_bytes(fake_strided((B, S, H, D), np.float16, pad_elems=8), c, s) == 16
    assert _vec_bytes(fake_strided((B, S, H, D), np.float16, pad_elems=8, byte_offset=6), c, s) == 2
    # Windows: the rotated halves start at rotary_offset and rotary_offset + rotary_dim / 2.
    c16, s16 = tables(cols=16)
    c18, s18 = tables(cols=18)
    assert _vec_bytes(fake_like((B, S, H, D), np.float16), c16, s16, rotary_dim=32) == 16
    assert _vec_bytes(fake_like((B, S, H, D), np.float16), c16, s16, rotary_dim=32, rotary_offset=4) == 8
    assert _vec_bytes(fake_like((B, S, H, D), np.float16), c18, s18, rotary_dim=36) == 4
    assert _vec_bytes(fake_like((B, S, H, D), np.float32), c18, s18, rotary_dim=36, rotary_offset=2) == 8


def test_choose_vector_copied_channels_need_the_head_dim_aligned():
    # One token, one head, D = 68: only the copy of channels outside the window cares about D.
    q = FakeDeviceArray((1, 1, 1, 68), np.float16)
    c, s = tables(cols=32)
    assert _vec_bytes(q, c, s, rotary_dim=64, q_out=q) == 16  # in place: nothing is copied
    assert _vec_bytes(q, c, s, rotary_dim=64, q_out=FakeDeviceArray((1, 1, 1, 68), np.float16)) == 8


def test_choose_vector_names_the_misaligned_array():
    c, s = tables()
    q = fake_like((B, S, H, D), np.float16)
    k = FakeDeviceArray((B, S, HK, D), np.float16).shifted(1)
    with pytest.raises(ValueError, match=r"^k: addresses or strides are not aligned"):
        RL.choose_vector(R.validate(q, k, c, s, layout="bshd"))
    k_out = FakeDeviceArray((B, S, HK, D), np.float16).shifted(1)
    with pytest.raises(ValueError, match=r"^k_out: addresses"):
        RL.choose_vector(R.validate(q, fake_like((B, S, HK, D), np.float16), c, s, q_out=q,
                                   k_out=k_out, layout="bshd"))
    # An odd stride along a used axis: no width works for interleaved pairs.
    odd = FakeDeviceArray((B, S, H, D + 1), np.float16)[..., :D]
    with pytest.raises(ValueError, match=r"^x: addresses or strides are not aligned to 4 bytes"):
        RL.choose_vector(R.validate(odd, None, c, s, interleaved=True, names=("x", "k"), layout="bshd"))


@pytest.mark.parametrize("tokens,heads,k_heads", [(0, 4, 0), (1, 32, 8), (3, 4, 2), (17, 1, 0), (4097, 32, 8),
                                                 (1 << 20, 64, 0), (2, 0, 3), (5, 0, 0)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_launch_shape_is_sane(tokens, heads, k_heads, interleaved):
    c, s = tables(rows=max(tokens, 1))
    q = fake_like((tokens, heads, D), np.float16)
    k = fake_like((tokens, k_heads, D), np.float16) if k_heads else None
    req = R.validate(q, k, c, s, layout="thd", interleaved=interleaved)
    sms = 132
    vec, params, (gx, gy, gz), (bx, by, bz) = rope_host_steps(req, sms)
    assert vec * 2 == 16
    assert min(gx, gy, gz, bx, by, bz) >= 1  # never a zero dimension, even with no heads
    assert bx * by * bz <= RL.BLOCK_THREADS
    assert gx <= 2**31 - 1 and gy <= 65535 and gz == 1 and bz == 1
    all_heads = heads + k_heads
    if tokens >= 4 * sms:
        assert gy == 1  # enough tokens: heads are never split across blocks
    if gy > 1:
        assert tokens < 4 * sms and gy * by < all_heads + by  # split only to fill the device, never idle
    assert params.num_tokens == tokens and params.q_heads == heads and params.k_heads == k_heads


# ---------------------------------------------------------------------------------------------
# fused QKV: q and k as views of one buffer, no copy, not overlapping, in place too

@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd", "thd"])
@pytest.mark.parametrize("cupy_fake", [False, True], ids=["cai", "cupy"])
def test_fused_qkv_views(gpu, layout, cupy_fake):
    Hq, Hkv = 8, 2
    buf, q, k, v = fused_qkv(B, S, Hq, Hkv, D, np.float16, layout=layout, cupy_fake=cupy_fake)
    c, s = tables(rows=B * S)
    for q_out, k_out in ((None, None), (q, k)):
        req = R.validate(q, k, c, s, layout=layout, q_out=q_out, k_out=k_out)
        assert req.q.array is q and req.k.array is k
        assert req.cq.H == Hq and req.ck.H == Hkv
        assert req.in_place == (q_out is not None)
        assert not A.overlaps(req.q, req.k)
        assert RL.choose_vector(req) == 8  # 16 bytes: head slices of an aligned buffer stay aligned
    # k's bytes start right after q's heads.
    head_stride = {"bshd": D, "bhsd": S * D, "sbhd": D, "thd": D}[layout]
    assert A.describe(k, "k").ptr - A.describe(q, "q").ptr == Hq * head_stride * 2
    # The one-call API and a plan run on the views, in place, without a copy.
    qo, ko = apply_rope_qk(q, k, c, s, layout=layout, q_out=q, k_out=k, backend="nvrtc")
    assert qo is q and ko is k
    launch = gpu.launches[-1]
    assert launch["params"].q_in == launch["params"].q_out == A.describe(q, "q").ptr
    assert launch["params"].k_heads == Hkv and launch["params"].q_heads == Hq
    plan = RopePlan(q, k, c, s, layout=layout)
    assert plan.in_place
    assert plan.execute(q, k, c, s) == (q, k)
    assert len(gpu.launches) == 2
    # ...but k rotated into q's first heads, or q's output shifted by one head, is an overlap.
    axis = {"bshd": 2, "bhsd": 1, "sbhd": 2, "thd": 1}[layout]

    def heads(lo, hi):
        idx = [slice(None)] * buf.ndim
        idx[axis] = slice(lo, hi)
        return buf[tuple(idx)]

    with pytest.raises(ValueError, match="q_out overlaps k_out"):
        R.validate(q, k, c, s, layout=layout, q_out=q, k_out=heads(0, Hkv))
    with pytest.raises(ValueError, match="k_out overlaps q"):
        R.validate(q, k, c, s, layout=layout, q_out=fake_like(q.shape, np.float16), k_out=heads(0, Hkv))
    with pytest.raises(ValueError, match=r"q_out overlaps q \(in place needs the very same view"):
        R.validate(q, k, c, s, layout=layout, q_out=heads(1, Hq + 1), k_out=k)
    with pytest.raises(ValueError, match="k_out overlaps"):
        R.validate(q, k, c, s, layout=layout, q_out=q, k_out=heads(Hq + 1, Hq + Hkv + 1))


# ---------------------------------------------------------------------------------------------
# RopePlan: construction from TensorDesc, and execute-time checks (with the fake GPU step)

def _descs(dtype=np.float16, device=None):
    return (TensorDesc(dtype, (B, S, H, D), device=device), TensorDesc(dtype, (B, S, HK, D), device=device),
            TensorDesc(np.float32, (ROWS, D // 2), device=device), TensorDesc(np.float32, (ROWS, D // 2), device=device))


def test_plan_from_declarations():
    q, k, c, s = _descs()
    plan = RopePlan(q, k, c, s, layout="bshd")
    assert plan.in_place and plan.device == 0 and (plan.q_heads, plan.k_heads, plan.head_dim) == (H, HK, D)
    # An out-of-place plan from declarations: distinct declarations are neither the same view
    # nor overlapping (they have no addresses yet).
    qo, ko = TensorDesc(np.float16, (B, S, H, D)), TensorDesc(np.float16, (B, S, HK, D))
    out_plan = RopePlan(q, k, c, s, q_out=qo, k_out=ko, layout="bshd")
    assert not out_plan.in_place
    assert RopePlan(q, k, c, s, q_out=q, k_out=k, layout="bshd").in_place
    assert RopePlan(q, k, c, s, q_out=q, layout="bshd").in_place
    with pytest.raises(ValueError, match="k_out: an out-of-place plan"):
        RopePlan(q, k, c, s, q_out=qo, layout="bshd")
    assert RopePlan(*_descs(device="cuda:1"), layout="bshd").device == 1


@pytest.mark.parametrize("change,exc,pattern", [
    (dict(q=TensorDesc(np.float64, (B, S, H, D))), TypeError, r"q: dtype float64"),
    (dict(c=TensorDesc(np.float16, (ROWS, D // 2))), TypeError, r"cos: dtype float16"),
    (dict(c=TensorDesc(np.float32, (ROWS, D // 4)), s=TensorDesc(np.float32, (ROWS, D // 4))), ValueError,
     r"cos: has 16 columns"),
    (dict(q=TensorDesc(np.float16, (B, S, H, D), strides=(S * H * 2 * D, H * 2 * D, 2 * D, 2))), ValueError,
     r"q: the last dimension must be contiguous"),
    (dict(q=TensorDesc(np.float16, (B, S, H, D), device="cuda:1")), ValueError, r"is on device"),
    (dict(c=TensorDesc(np.float32, (ROWS, D // 2), device=2)), ValueError, r"cos is on device 2"),
    (dict(q=TensorDesc(BF16, (B, S, H, D))), TypeError, r"k: dtype float16 differs from q's bfloat16"),
])
def test_plan_from_declarations_errors(change, exc, pattern):
    q, k, c, s = _descs()
    q, k, c, s = change.get("q", q), change.get("k", k), change.get("c", c), change.get("s", s)
    with pytest.raises(exc, match=pattern):
        RopePlan(q, k, c, s, layout="bshd")


def test_plan_declaration_options_are_validated():
    q, k, c, s = _descs()
    with pytest.raises(ValueError, match="rotary_dim"):
        RopePlan(q, k, c, s, rotary_dim=63, layout="bshd")
    with pytest.raises(ValueError, match="layout"):
        RopePlan(q, k, c, s, layout="bhds")
    with pytest.raises(ValueError, match="positions: expected shape"):
        RopePlan(q, k, c, s, positions=TensorDesc(np.int32, (B,)), layout="bshd")
    plan = RopePlan(q, k, c, s, positions=TensorDesc(np.int64, (B, S)), layout="bshd")
    assert plan.pos_mode == POS_POSITIONS


def _plan_arrays(dtype=np.float16, tokens=S):
    q = fake_like((B, tokens, H, D), dtype)
    k = fake_like((B, tokens, HK, D), dtype)
    c, s = tables()
    return q, k, c, s


def test_plan_execute_launches_and_token_count_changes(gpu):
    q, k, c, s = _descs()
    plan = RopePlan(q, k, c, s, layout="bshd")
    for tokens in (S, 1, 0, 3, S):
        qa, ka, ca, sa = _plan_arrays(tokens=tokens)
        assert plan.execute(qa, ka, ca, sa) == (qa, ka)
    assert len(gpu.launches) == 4  # T = 0 launches nothing
    for launch in gpu.launches:
        assert min(launch["grid"]) >= 1 and min(launch["block"]) >= 1
        assert launch["fn"][3] * 2 == 16
    # Repeating the same arrays re-uses the validated launch; a new scalar offset only moves the offset.
    qa, ka, ca, sa = _plan_arrays(tokens=4)
    plan.execute(qa, ka, ca, sa)
    plan.execute(qa, ka, ca, sa, offset=5)
    assert plan._core.block.offset == 5
    with pytest.raises(ValueError, match="offset: positions 13..16"):
        plan.execute(qa, ka, ca, sa, offset=13)


@pytest.mark.parametrize("name", [
    "dtype", "heads", "head_dim", "k_heads", "misaligned_q", "misaligned_k", "x_last_dim", "host_q", "declaration",
    "other_device", "positions_given", "missing_k", "q_out_not_q", "overlap_tables", "requires_grad", "v2",
])
def test_plan_execute_errors_before_launch(gpu, name):
    plan = RopePlan(*_plan_arrays(), layout="bshd")
    q, k, c, s = _plan_arrays()
    kw = {}
    exc, pattern = ValueError, None
    if name == "dtype":
        q, k = fake_like(q.shape, np.float32), fake_like(k.shape, np.float32)
        pattern = r"execute: dtype float32 \(plan: float16\)"
    elif name == "heads":
        q = fake_like((B, S, H + 1, D), np.float16)
        pattern = r"q heads/dim"
    elif name == "head_dim":
        q, k = fake_like((B, S, H, D + 2), np.float16), fake_like((B, S, HK, D + 2), np.float16)
        c, s = tables(cols=D // 2 + 1)
        pattern = r"q heads/dim"
    elif name == "k_heads":
        k = fake_like((B, S, HK + 1, D), np.float16)
        pattern = r"k heads"
    elif name == "misaligned_q":
        q = FakeDeviceArray(q.shape, np.float16).shifted(1)
        pattern = r"q: addresses or strides are not aligned"
    elif name == "misaligned_k":
        k = FakeDeviceArray(k.shape, np.float16).shifted(1)
        pattern = r"k: addresses or strides are not aligned"
    elif name == "x_last_dim":
        q = FakeDeviceArray((B, S, H, 2 * D), np.float16)[..., ::2]
        pattern = r"q: the last dimension"
    elif name == "host_q":
        q = np.zeros(q.shape, np.float16)
        exc, pattern = TypeError, r"q: a NumPy \(host\) array is not accepted"
    elif name == "declaration":
        q = TensorDesc(np.float16, q.shape)
        exc, pattern = TypeError, r"q: a TensorDesc declares an array"
    elif name == "other_device":
        q, k = fake_cupy(q.shape, np.float16, device=1), fake_cupy(k.shape, np.float16, device=1)
        c, s = fake_cupy(c.shape, np.float32, device=1), fake_cupy(s.shape, np.float32, device=1)
        pattern = r"is on device 1 but the plan's device 0"
    elif name == "positions_given":
        kw = {"positions": index_array((B, S))}
        pattern = r"position scheme"
    elif name == "missing_k":
        k = None
        exc, pattern = TypeError, r"k: this plan was built with k"
    elif name == "q_out_not_q":
        kw = {"q_out": fake_like(q.shape, np.float16)}
        pattern = r"q_out: this plan rotates in place"
    elif name == "overlap_tables":
        plan = RopePlan(q, k, c, s, q_out=fake_like(q.shape, np.float16), k_out=fake_like(k.shape, np.float16),
                        layout="bshd")
        kw = {"q_out": fake_like(q.shape, np.float16), "k_out": FakeDeviceArray(k.shape, np.float16, ptr=c.ptr)}
        pattern = r"k_out overlaps cos"
    elif name == "requires_grad":
        q = FakeTorchTensor(q.shape, np.float16)
        exc, pattern = TypeError, r"q requires grad"
    elif name == "v2":
        c = FakeDeviceArray(c.shape, np.float32, typestr="<V4")
        exc, pattern = TypeError, r"cos: .*DLPack"
    with pytest.raises(exc, match=pattern):
        plan.execute(q, k, c, s, **kw)
    assert gpu.launches == []


def test_plan_execute_fast_path_rejects_positions_with_offset(gpu):
    q, k, c, s = _plan_arrays()
    pos = index_array((B, S))
    plan = RopePlan(q, k, c, s, positions=pos, layout="bshd")
    plan.execute(q, k, c, s, positions=pos)
    assert len(gpu.launches) == 1
    with pytest.raises(ValueError, match="positions and offset"):
        plan.execute(q, k, c, s, positions=pos, offset=3)
    assert len(gpu.launches) == 1


def test_plan_out_of_place_needs_outputs(gpu):
    q, k, c, s = _plan_arrays()
    qo, ko = fake_like(q.shape, np.float16), fake_like(k.shape, np.float16)
    plan = RopePlan(q, k, c, s, q_out=qo, k_out=ko, layout="bshd")
    assert not plan.in_place
    with pytest.raises(TypeError, match="q_out/k_out"):
        plan.execute(q, k, c, s)
    with pytest.raises(ValueError, match="q_out overlaps q"):
        plan.execute(q, k, c, s, q_out=FakeDeviceArray(q.shape, np.float16, ptr=A.describe(q, "q").ptr + 2 * D),
                     k_out=ko)
    assert gpu.launches == []
    assert plan.execute(q, k, c, s, q_out=qo, k_out=ko) == (qo, ko)
    params = plan._core.block
    assert params.q_out == A.describe(qo, "q_out").ptr and params.k_out == A.describe(ko, "k_out").ptr
    assert params.q_in == A.describe(q, "q").ptr and len(gpu.launches) == 1


def test_one_call_api_records_the_launch(gpu):
    q = fake_like((B, S, H, D), np.float16)
    c, s = tables()
    out = apply_rope(q, c, s, backend="nvrtc", offset=3, layout="bshd")
    assert out is not q and out.shape == q.shape
    launch = gpu.launches[-1]
    assert launch["params"].offset == 3 and launch["params"].q_in == A.describe(q, "x").ptr
    assert launch["params"].q_out == out.data.ptr
    assert apply_rope(q, c, s, backend="nvrtc", out=q, layout="bshd") is q
    # Zero tokens: nothing to launch.
    empty = fake_like((B, 0, H, D), np.float16)
    assert apply_rope(empty, c, s, backend="nvrtc", layout="bshd").shape == empty.shape
    assert len(gpu.launches) == 2
    # q with no heads still rotates k.
    qk = apply_rope_qk(fake_like((B, S, 0, D), np.float16), fake_like((B, S, HK, D), np.float16), c, s,
                       backend="nvrtc", layout="bshd")
    assert len(gpu.launches) == 3 and qk[1].shape == (B, S, HK, D)


def test_empty_arrays_with_zero_strides_validate():
    # NumPy and CuPy give freshly made empty arrays all-zero strides.
    import cupy

    mem = cupy.cuda.UnownedMemory(0x7F0000000000, 256, None, device_id=0)
    q = cupy.ndarray((B, 0, H, D), np.float16, memptr=cupy.cuda.MemoryPointer(mem, 0))
    assert set(q.strides) == {0}
    c, s = tables()
    req = R.validate(q, None, c, s, layout="bshd")
    assert req.num_tokens == 0
    host = np.zeros((0, H, D), np.float16)
    assert R.validate(host, None, np.zeros((4, D // 2), np.float32), np.zeros((4, D // 2), np.float32),
                      layout="thd").num_tokens == 0


def test_plan_reused_validation_keeps_every_check(gpu):
    # A plan validates an argument signature (CuPy arrays' shapes, strides, dtypes) once and then
    # re-checks only what depends on the pointers; every pointer-dependent error must survive.
    def arrays():
        return (fake_cupy((B, S, H, D), np.float16), fake_cupy((B, S, HK, D), np.float16),
                fake_cupy((ROWS, D // 2), np.float32), fake_cupy((ROWS, D // 2), np.float32),
                fake_cupy((B, S), np.int64))

    q, k, c, s, pos = arrays()
    plan = RopePlan(q, k, c, s, positions=pos, layout="bshd")
    plan.execute(q, k, c, s, positions=pos)
    q2, k2, c2, s2, pos2 = arrays()
    plan.execute(q2, k2, c2, s2, positions=pos2)  # same signature, new pointers: fine
    assert len(gpu.launches) == 2
    with pytest.raises(ValueError, match="positions and offset"):
        plan.execute(q2, k2, c2, s2, positions=pos2, offset=3)
    with pytest.raises(ValueError, match=r"cos: data pointer .* is not 4-byte aligned"):
        plan.execute(q2, k2, fake_cupy((ROWS, D // 2), np.float32, byte_offset=2), s2, positions=pos2)
    with pytest.raises(ValueError, match=r"positions: data pointer .* is not 8-byte aligned"):
        plan.execute(q2, k2, c2, s2, positions=fake_cupy((B, S), np.int64, byte_offset=4))
    with pytest.raises(ValueError, match=r"k: addresses or strides are not aligned"):
        plan.execute(q2, fake_cupy((B, S, HK, D), np.float16, byte_offset=1), c2, s2, positions=pos2)
    assert len(gpu.launches) == 2


def test_plan_recent_argument_sets_restore_their_own_arguments(gpu):
    """Alternating among remembered argument sets (by identity) writes each set's own pointers
    and offset; more sets than RECENT_SETS evict the oldest; an offset out of the table on a
    remembered set is still rejected, and the plan keeps working."""
    def arrays():
        return (fake_cupy((B, S, H, D), np.float16), fake_cupy((B, S, HK, D), np.float16),
                fake_cupy((ROWS, D // 2), np.float32), fake_cupy((ROWS, D // 2), np.float32))

    sets = [arrays() for _ in range(RECENT_SETS + 3)]
    plan = RopePlan(*sets[0], layout="bshd").compile()
    p = plan._core.block
    for rnd in range(3):
        for i, (q, k, c, s) in enumerate(sets):
            plan.execute(q, k, c, s, offset=(i + rnd) % (ROWS - S + 1))
            assert (p.q_in, p.q_out, p.k_in, p.k_out, p.cos, p.sin) == (q.data.ptr, q.data.ptr, k.data.ptr,
                                                                         k.data.ptr, c.data.ptr, s.data.ptr)
            assert p.offset == (i + rnd) % (ROWS - S + 1)
    assert len(plan._core.recent) == RECENT_SETS
    q, k, c, s = sets[-1]
    with pytest.raises(ValueError, match="offset"):
        plan.execute(q, k, c, s, offset=ROWS)
    plan.execute(*sets[-2], offset=1)
    assert (p.q_in, p.offset) == (sets[-2][0].data.ptr, 1)
    assert len(gpu.launches) == 3 * len(sets) + 1


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("S", [3, 4096])
def test_plan_launches_the_build_the_launch_chooses(gpu, layout, interleaved, S):
    """Decode-sized and prefill-sized plans in every layout launch the head batch and entry that
    head_batch/is_narrow choose, from the kernels compile() loaded (a missing one is a KeyError)."""
    shape = {"bshd": (4, S, 32, 128), "bhsd": (4, 32, S, 128), "sbhd": (S, 4, 32, 128), "thd": (4 * S, 32, 128)}
    q = fake_cupy(shape[layout], np.float16)
    k = fake_cupy(shape[layout], np.float16)
    c, s = fake_cupy((4 * S, 64), np.float32), fake_cupy((4 * S, 64), np.float32)
    plan = RopePlan(q, k, c, s, layout=layout, interleaved=interleaved).compile()
    plan.execute(q, k, c, s)
    req = R.validate(q, k, c, s, layout=layout, interleaved=interleaved, allow_host=False)
    entry, _, _, vec, hb = gpu.launches[-1]["fn"]
    assert (entry, vec, hb) == ("rope_apply", RL.choose_vector(req), RL.head_batch(req))
    assert (hb > 1) == (S == 4096 and (not interleaved or layout == "bhsd"))
