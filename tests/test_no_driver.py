"""On a machine with no usable GPU, every GPU path says so in the library's own words first.

CuPy reports a missing driver as "CUDA driver version is insufficient for CUDA runtime version",
which sends a user looking for a driver upgrade. Each call here reaches the point where it would
need the device (a stream, an allocation, a kernel load) with arrays that are valid, so the only
thing wrong is the machine: the error must be :class:`rope_rtc.NoDeviceError` naming the reason
and the way out. CPU only: with a GPU the fake pointers would reach a real launch.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import rope_rtc
from fakes import fake_cupy
from rope_rtc import TensorDesc
from rope_rtc.core import driver, launcher, outputs

pytestmark = pytest.mark.skipif(driver.available(), reason="this machine has a usable GPU")

T, H, D, ROWS = 4, 2, 64, 16
WAY_OUT = r"no usable CUDA GPU: .*backend='numpy'"


@pytest.fixture(autouse=True)
def nothing_remembered(monkeypatch):
    """CuPy's current-stream lookup and allocator are looked up once per process: as if for the first time."""
    current = launcher.CURRENT_STREAM[0]  # a list the dispatcher shares: emptied and refilled, not replaced
    launcher.CURRENT_STREAM[0] = None
    monkeypatch.setattr(outputs, "_EMPTY", [])
    yield
    launcher.CURRENT_STREAM[0] = current


def _rope_arrays():
    q, k = fake_cupy((T, H, D)), fake_cupy((T, H, D))
    cos, sin = fake_cupy((ROWS, D // 2)), fake_cupy((ROWS, D // 2))
    return q, k, cos, sin


def test_the_reason_says_no_driver_where_there_is_none():
    if driver._libcuda_load_error() is None:
        pytest.skip("this machine has a CUDA driver library (and no usable device)")
    with pytest.raises(rope_rtc.NoDeviceError, match=rf"no CUDA driver found .*install the NVIDIA driver"):
        driver.require_gpu()


def test_device_cupy():
    with pytest.raises(rope_rtc.NoDeviceError, match=WAY_OUT):
        driver.device_cupy()


def test_apply_rope_with_the_nvrtc_backend_on_host_arrays():
    x = np.zeros((1, T, H, D), np.float32)
    c, s = np.zeros((ROWS, D // 2), np.float32), np.zeros((ROWS, D // 2), np.float32)
    with pytest.raises(rope_rtc.NoDeviceError, match=WAY_OUT):
        rope_rtc.apply_rope(x, c, s, backend="nvrtc")


@pytest.mark.parametrize("fn", ["apply_rope", "apply_rope_qk", "tail_rope"])
def test_auto_with_device_arrays_says_there_is_no_gpu(fn):
    """backend='auto' settles on NumPy without a GPU; device arrays then need the GPU, and the
    error says why there is none, not that the NumPy backend (never asked for) takes host arrays."""
    q, k, cos, sin = _rope_arrays()
    with pytest.raises(rope_rtc.NoDeviceError, match=WAY_OUT):
        if fn == "apply_rope":
            rope_rtc.apply_rope(q, cos, sin)
        elif fn == "apply_rope_qk":
            rope_rtc.apply_rope_qk(q, k, cos, sin)
        else:
            x = fake_cupy((T, H, 128), "bfloat16")
            rope_rtc.tail_rope(x, fake_cupy((T, 32)), fake_cupy((T, 32)))


def test_a_plan_of_declarations_compiles_to_the_librarys_error():
    """Declaring is GPU-free; loading a kernel is the first step that needs the device."""
    f32 = np.float32
    plan = rope_rtc.RopePlan(TensorDesc(f32, (1, T, H, D)), TensorDesc(f32, (1, T, H, D)),
                             TensorDesc(f32, (ROWS, D // 2)), TensorDesc(f32, (ROWS, D // 2)), layout="bshd")
    with pytest.raises(rope_rtc.NoDeviceError, match=WAY_OUT):
        plan.compile()


def test_a_tail_plan_of_declarations_compiles_to_the_librarys_error():
    bf16 = ml_dtypes.bfloat16
    plan = rope_rtc.TailRoPEForward(TensorDesc(bf16, (T, H, 128)), TensorDesc(np.float32, (T, 32)),
                                    TensorDesc(np.float32, (T, 32)), TensorDesc(bf16, (T, H, 128)))
    with pytest.raises(rope_rtc.NoDeviceError, match=WAY_OUT):
        plan.compile()


def test_apply_mrope_qk():
    q, k, cos, sin = _rope_arrays()
    with pytest.raises(rope_rtc.NoDeviceError, match=WAY_OUT):
        rope_rtc.apply_mrope_qk(q, k, cos, sin, fake_cupy((3, T), "int32"), [16, 8, 8])


def test_apply_qk_norm_rope():
    q, k, cos, sin = _rope_arrays()
    with pytest.raises(rope_rtc.NoDeviceError, match=WAY_OUT):
        rope_rtc.apply_qk_norm_rope(q, k, fake_cupy((D,)), fake_cupy((D,)), cos, sin,
                                    positions=fake_cupy((T,), "int32"))


@pytest.mark.parametrize("host_slots", [False, True], ids=["device-slots", "host-slots"])
def test_rope_and_cache(host_slots):
    q, k, cos, sin = _rope_arrays()
    slots = np.arange(T, dtype=np.int64) if host_slots else fake_cupy((T,), "int64")
    caches = fake_cupy((4, 4, H, D)), fake_cupy((4, 4, H, D))
    with pytest.raises(rope_rtc.NoDeviceError, match=WAY_OUT):
        rope_rtc.rope_and_cache(q, k, fake_cupy((T, H, D)), cos, sin, fake_cupy((T,), "int32"), slots, *caches)


@pytest.mark.parametrize("stream", [None, 0], ids=["current-stream", "handle-0"])
def test_onnx_rotary_embedding(stream):
    from rope_rtc import onnx

    x = fake_cupy((1, T, H * D))
    with pytest.raises(rope_rtc.NoDeviceError, match=WAY_OUT):
        onnx.rotary_embedding(x, fake_cupy((1, T, D // 2)), fake_cupy((1, T, D // 2)), num_heads=H, stream=stream)


def test_the_first_stream_lookup_and_allocation():
    with pytest.raises(rope_rtc.NoDeviceError, match=WAY_OUT):
        launcher.stream_handle(None, 0)
    with pytest.raises(rope_rtc.NoDeviceError, match=WAY_OUT):
        outputs.empty((4,), np.dtype(np.float32))
