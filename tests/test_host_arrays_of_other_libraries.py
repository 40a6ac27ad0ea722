"""Host arrays of other libraries (DLPack on the CPU, as torch and JAX CPU tensors are) through every
op's NumPy backend, and the arguments' errors on an install without CuPy."""

from __future__ import annotations

import ctypes
import sys
import warnings

import ml_dtypes
import numpy as np
import pytest

import rope_rtc
from fakes import HostDLPack, HostTensor
from rope_rtc.onnx import rotary_embedding

T, H, HK, D = 6, 4, 2, 16
POS = np.array([3, 1, 4, 1, 5, 9])


def _f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _tables(rd=D):
    return rope_rtc.rope_tables(32, rd)


def _rope(o):
    c, s = _tables()
    return rope_rtc.apply_rope(_f32(T, H, D), c, s, positions=POS, layout="thd", out=o["out"], backend="numpy"), \
        (o["out"],)


def _rope_in_place(o):
    c, s = _tables()
    return rope_rtc.apply_rope(o["x"], c, s, positions=POS, layout="thd", out=o["x"], backend="numpy"), (o["x"],)


def _rope_qk(o):
    c, s = _tables()
    return rope_rtc.apply_rope_qk(_f32(T, H, D), _f32(T, HK, D, seed=1), c, s, positions=POS, layout="thd",
                                  q_out=o["q_out"], k_out=o["k_out"], backend="numpy"), (o["q_out"], o["k_out"])


def _cache(o):
    c, s = _tables()
    caches = [np.zeros((2, 4, HK, D), np.float32) for _ in range(2)]
    return rope_rtc.rope_and_cache(o["q"], o["k"], _f32(T, HK, D, seed=2), c, s, POS, np.arange(T), *caches,
                                   backend="numpy"), (o["q"], o["k"])


def _mla(o):
    c, s = _tables(8)
    return rope_rtc.mla_rope_and_cache(o["q24"], o["k_pe"], _f32(T, 32), c, s, POS, np.arange(T),
                                       np.zeros((2, 4, 40), np.float32), backend="numpy"), (o["q24"], o["k_pe"], None)


def _mrope(o):
    c, s = _tables()
    return rope_rtc.apply_mrope_qk(_f32(T, H, D), _f32(T, HK, D, seed=1), c, s, np.stack([POS] * 3), [4, 2, 2],
                                   q_out=o["q_out"], k_out=o["k_out"], backend="numpy"), (o["q_out"], o["k_out"])


def _qk_norm(o):
    c, s = _tables()
    w = np.ones(D, np.float32)
    return rope_rtc.apply_qk_norm_rope(_f32(T, H, D), _f32(T, HK, D, seed=1), w, w, c, s, positions=POS, layout="thd",
                                       q_out=o["q_out"], k_out=o["k_out"], backend="numpy"), (o["q_out"], o["k_out"])


def _onnx(o):
    c, s = _tables()
    return rotary_embedding(_f32(1, H, T, D), c, s, POS[None], out=o["onnx_out"], backend="numpy"), (o["onnx_out"],)


@pytest.mark.parametrize("call", [_rope, _rope_in_place, _rope_qk, _cache, _mla, _mrope, _qk_norm, _onnx])
def test_host_dlpack_outputs_are_returned_as_given_and_written_through(call):
    # The NumPy backend returned the NumPy views it wrote through, not the objects given (the
    # ONNX op, fixed before, and the GPU path return the given ones).
    shapes = dict(out=(T, H, D), x=(T, H, D), q_out=(T, H, D), k_out=(T, HK, D), q=(T, H, D), k=(T, HK, D),
                  q24=(T, H, 24), k_pe=(T, 8), onnx_out=(1, H, T, D))
    plain = {n: _f32(*shape, seed=7) for n, shape in shapes.items()}
    want, _ = call({n: a.copy() for n, a in plain.items()})
    boxes = {n: HostDLPack(a) for n, a in plain.items()}
    got, given = call(boxes)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for r, g, w in zip(got, given, want):
        if g is not None:
            assert r is g
            np.testing.assert_array_equal(g._a, w)  # the caller's memory holds the result


@pytest.mark.parametrize("backend", ["numpy", "auto"])
def test_a_host_cos_sin_cache_with_a_shape_and_no_indexing(backend):
    # It was sliced as cache[:, :half]: "'HostTensor' object is not subscriptable", naming nothing.
    # Against the same call with the NumPy array itself, on the same backend ("auto" is the GPU
    # kernel where one is present, whose float32 results may differ from NumPy's in the last bit).
    x, cache = _f32(T, H * D), rope_rtc.tables.cos_sin_cache(32, D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = rope_rtc.apply_rope(x, cos_sin_cache=cache, head_dim=D, positions=POS, backend=backend)
        got = rope_rtc.apply_rope(x, cos_sin_cache=HostTensor(cache), head_dim=D, positions=POS, backend=backend)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bad", [None, [[0.0] * D] * T])
def test_apply_rope_qk_auto_without_a_gpu_names_q(bad):
    # "auto" on a machine without a GPU named q "x", apply_rope's name.
    from rope_rtc.core import driver

    if driver.available():
        pytest.skip("a GPU is present: 'auto' means the GPU")
    c, s = _tables()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(TypeError, match="^q: expected"):
            rope_rtc.apply_rope_qk(bad, np.zeros((T, HK, D), np.float32), c, s, layout="thd", backend="auto")


class HostBF16:
    """A bfloat16 CPU tensor through DLPack (kDLBfloat, as torch exports one), which NumPy cannot import."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        cap = self._a.view(np.float16).__dlpack__()  # an unversioned DLManagedTensor
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        ctypes.c_uint8.from_address(get(cap, b"dltensor") + 20).value = 4  # DLTensor.dtype.code = kDLBfloat
        return cap

    def __dlpack_device__(self):
        return self._a.view(np.float16).__dlpack_device__()


@pytest.mark.parametrize("op", ["tail_rope", "apply_rope"])
def test_a_host_bfloat16_dlpack_tensor_is_a_type_error_naming_it(op):
    # NumPy's "RuntimeError: Unsupported dtype in DLTensor." came out, naming no argument.
    x = _f32(4, 2, 128).astype(ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="^x: NumPy cannot read this host array through DLPack"):
        if op == "tail_rope":
            rope_rtc.tail_rope(HostBF16(x), _f32(4, 32), _f32(4, 32), backend="numpy")
        else:
            rope_rtc.apply_rope(HostBF16(x), *rope_rtc.rope_tables(8, 128), layout="thd", backend="numpy")


@pytest.mark.parametrize("box", [HostDLPack, HostTensor])
def test_vision_positions_takes_a_host_dlpack_grid(box):
    # np.asarray made a 0-d object array of it: "grid_thw: expected an integer array ..., got object ()".
    grid = np.array([[1, 4, 6], [2, 2, 2]], np.int64)
    np.testing.assert_array_equal(rope_rtc.vision_positions(box(grid), spatial_merge_size=2),
                                  rope_rtc.vision_positions(grid, spatial_merge_size=2))


class DeviceDL:
    """A CUDA tensor known through DLPack (the checks need only its device)."""

    shape, dtype = (T, H, D), np.dtype(np.float32)

    def __dlpack__(self, **kw):
        raise AssertionError("not exported")

    def __dlpack_device__(self):
        return (2, 0)


def test_a_device_dlpack_array_without_cupy(monkeypatch):
    # arrays.describe imported cupy bare: ModuleNotFoundError, for 'auto' without a GPU too.
    from rope_rtc.core import driver, prepared
    from rope_rtc.errors import NoDeviceError, ToolchainError

    if driver.available():
        pytest.skip("a GPU is present")
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(prepared, "_NDARRAY", None)
    c, s = _tables()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(NoDeviceError):
            rope_rtc.apply_rope(DeviceDL(), c, s, layout="thd", backend="auto")
        with pytest.raises((TypeError, ToolchainError)):
            rope_rtc.apply_rope(DeviceDL(), c, s, layout="thd", backend="numpy")
