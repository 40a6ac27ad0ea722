"""The driver module's view of the machine: why there is no GPU, in words a user can act on.

CPU only: the driver library is faked where a test needs one; one test asks the real machine.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rope_rtc.core import driver
from rope_rtc.errors import CudaError, NoDeviceError, RopeRtcError, ToolchainError

REPO = Path(__file__).resolve().parents[1]


def _libcuda_loadable() -> bool:
    try:
        ctypes.CDLL(driver.LIBCUDA)
    except OSError:
        return False
    return True


@pytest.fixture
def fresh(monkeypatch):
    """A driver module that has not run cuInit yet; ``fresh(fake)`` installs a fake bindings module."""
    monkeypatch.setattr(driver, "_init_error", [])
    monkeypatch.setattr(driver, "_initialised", False)
    monkeypatch.setattr(driver, "_gpu_found", False, raising=False)

    def install(fake) -> None:
        monkeypatch.setattr(driver, "_drv", lambda: fake)

    return install


class _Status(int):
    """A CUresult as the bindings return it: an int with a name."""

    def __new__(cls, code: int, name: str):
        obj = super().__new__(cls, code)
        obj.name = name
        return obj


class _FakeDriver:
    """cuda.bindings.driver with a chosen cuInit outcome; libcuda "loaded" unless cuInit raises."""

    def __init__(self, init_status: _Status | None = None, init_raises: Exception | None = None, devices: int = 1):
        self.init_status, self.init_raises, self.devices = init_status, init_raises, devices

    def cuInit(self, flags):
        if self.init_raises is not None:
            raise self.init_raises
        return (self.init_status,)

    def cuGetErrorString(self, status):
        return (_Status(0, "CUDA_SUCCESS"), b"as the driver words it")

    def cuDeviceGetCount(self):
        return (_Status(0, "CUDA_SUCCESS"), self.devices)

    def cuDriverGetVersion(self):
        return (_Status(0, "CUDA_SUCCESS"), 12080)


# -- no driver at all ------------------------------------------------------------------------------

@pytest.mark.skipif(_libcuda_loadable(), reason="this machine has a CUDA driver library")
def test_a_machine_without_a_driver_says_no_cuda_driver_found():
    """What a user on a CPU-only machine reads: not "driver version is insufficient"."""
    code = "from rope_rtc.core import driver; print(driver.unavailable_reason())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_RTC_")}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    reason = r.stdout.strip()
    assert reason.startswith("no CUDA driver found"), reason
    assert driver.LIBCUDA in reason and "insufficient" not in reason


def test_driver_library_that_fails_to_load_reads_as_no_driver(fresh, monkeypatch):
    # What cuda-pathfinder raises when libcuda is nowhere on the system search path.
    fresh(_FakeDriver(init_raises=RuntimeError('"cuda" is an NVIDIA driver library and can only be found via '
                                               'system search.')))
    monkeypatch.setattr(driver, "_libcuda_load_error", lambda: f"{driver.LIBCUDA}: cannot open shared object file")
    reason = driver.unavailable_reason()
    assert reason == f"no CUDA driver found ({driver.LIBCUDA}: cannot open shared object file)"
    assert not driver.available()
    with pytest.raises(CudaError, match="no CUDA driver found"):
        driver.init()


def test_the_toolkits_stub_library_reads_as_no_driver(fresh):
    fresh(_FakeDriver(_Status(34, "CUDA_ERROR_STUB_LIBRARY")))
    reason = driver.unavailable_reason()
    assert reason.startswith("no CUDA driver found") and "stub" in reason and "CUDA_ERROR_STUB_LIBRARY" in reason


# -- a driver that is there keeps its own reason ---------------------------------------------------

def test_an_old_driver_keeps_the_real_reason_and_names_its_extra(fresh, monkeypatch):
    fresh(_FakeDriver(_Status(35, "CUDA_ERROR_INSUFFICIENT_DRIVER")))  # a CUDA 12.8 driver
    monkeypatch.setattr(driver, "_libcuda_load_error", lambda: None)
    reason = driver.unavailable_reason()
    assert "CUDA_ERROR_INSUFFICIENT_DRIVER" in reason and "no CUDA driver found" not in reason
    assert "older than" in reason and 'pip install "rope-rtc[cuda12]"' in reason and "cuda13" not in reason


def test_insufficient_driver_without_a_driver_library_reads_as_no_driver(fresh, monkeypatch):
    fresh(_FakeDriver(_Status(35, "CUDA_ERROR_INSUFFICIENT_DRIVER")))
    monkeypatch.setattr(driver, "_libcuda_load_error", lambda: f"{driver.LIBCUDA}: cannot open shared object file")
    assert driver.unavailable_reason() == f"no CUDA driver found ({driver.LIBCUDA}: cannot open shared object file)"


def test_a_driver_with_no_device_says_so(fresh):
    fresh(_FakeDriver(_Status(100, "CUDA_ERROR_NO_DEVICE")))
    reason = driver.unavailable_reason()
    assert reason.startswith("no CUDA device found") and "CUDA_ERROR_NO_DEVICE" in reason


def test_missing_bindings_name_the_extra(fresh, monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'cuda'")

    monkeypatch.setattr(driver, "_drv", missing)
    reason = driver.unavailable_reason()
    assert "cuda-bindings" in reason and "rope-rtc[cuda13]" in reason and "rope-rtc[cuda12]" in reason


# -- require_gpu -------------------------------------------------------------------------------------

def test_require_gpu_raises_a_library_error_with_the_reason_and_the_way_out(fresh, monkeypatch):
    fresh(_FakeDriver(init_raises=RuntimeError("not found")))
    monkeypatch.setattr(driver, "_libcuda_load_error", lambda: "libcuda.so.1: cannot open shared object file")
    with pytest.raises(NoDeviceError) as info:
        driver.require_gpu()
    assert isinstance(info.value, RopeRtcError)
    text = str(info.value)
    assert "no CUDA driver found" in text and "libcuda.so.1" in text and "backend='numpy'" in text


def test_require_gpu_with_a_device_returns(fresh):
    fresh(_FakeDriver(_Status(0, "CUDA_SUCCESS"), devices=1))
    assert driver.require_gpu() is None


def test_require_gpu_with_zero_devices_raises(fresh):
    fresh(_FakeDriver(_Status(0, "CUDA_SUCCESS"), devices=0))
    with pytest.raises(NoDeviceError, match="no CUDA device"):
        driver.require_gpu()


def nested_parentheses(text: str) -> bool:
    """True when a parenthetical opens inside another one."""
    depth = 0
    for ch in text:
        depth += ch == "("
        if depth > 1:
            return True
        depth -= ch == ")" and depth > 0
    return False


def test_nested_parentheses_is_what_it_says():
    assert nested_parentheses("no GPU found (no CUDA driver found (libcuda.so.1))")
    assert not nested_parentheses("no GPU found: no CUDA driver found (libcuda.so.1) (twice)")


NO_GPU_CASES = {
    "no driver library": (dict(init_raises=RuntimeError("not found")), "libcuda.so.1: cannot open shared object file"),
    "stub library": (dict(init_status=_Status(34, "CUDA_ERROR_STUB_LIBRARY")), None),
    "no device": (dict(init_status=_Status(100, "CUDA_ERROR_NO_DEVICE")), None),
    "old driver": (dict(init_status=_Status(35, "CUDA_ERROR_INSUFFICIENT_DRIVER")), None),
    "insufficient, no library": (dict(init_status=_Status(35, "CUDA_ERROR_INSUFFICIENT_DRIVER")),
                                 "libcuda.so.1: cannot open shared object file"),
    "zero devices": (dict(init_status=_Status(0, "CUDA_SUCCESS"), devices=0), None),
}


@pytest.mark.parametrize("case", list(NO_GPU_CASES))
def test_no_reason_nests_a_parenthetical_in_another(fresh, monkeypatch, case):
    """The driver's own words come in parentheses ("CUDA_ERROR_NO_DEVICE (as the driver words
    it)"); a reason or message that quotes them does not wrap them in parentheses again."""
    fake, load_error = NO_GPU_CASES[case]
    fresh(_FakeDriver(**fake))
    monkeypatch.setattr(driver, "_libcuda_load_error", lambda: load_error)
    reason = driver.unavailable_reason()
    with pytest.raises(NoDeviceError) as info:
        driver.require_gpu()
    for text in (reason, str(info.value)):
        assert not nested_parentheses(text), text
    assert reason in str(info.value)


def test_require_gpu_says_what_to_do_without_a_driver(fresh, monkeypatch):
    fresh(_FakeDriver(init_raises=RuntimeError("not found")))
    monkeypatch.setattr(driver, "_libcuda_load_error", lambda: "libcuda.so.1: cannot open shared object file")
    with pytest.raises(NoDeviceError, match=r"no usable CUDA GPU: no CUDA driver found \(libcuda.so.1: .*\); install "
                                            r"the NVIDIA driver .*backend='numpy'"):
        driver.require_gpu()


def test_require_gpu_without_a_device_does_not_ask_for_a_driver(fresh):
    fresh(_FakeDriver(_Status(100, "CUDA_ERROR_NO_DEVICE")))
    with pytest.raises(NoDeviceError) as info:
        driver.require_gpu()
    assert "install the NVIDIA driver" not in str(info.value) and "NVIDIA GPU" in str(info.value)


def test_require_gpu_asks_the_driver_until_a_device_is_found(fresh, monkeypatch):
    fake = _FakeDriver(_Status(0, "CUDA_SUCCESS"), devices=1)
    fresh(fake)
    calls = []
    monkeypatch.setattr(driver, "unavailable_reason", lambda: calls.append(1))
    driver.require_gpu()
    driver.require_gpu()
    assert len(calls) == 1


def test_device_cupy_without_a_gpu_raises_the_librarys_error_first(fresh, monkeypatch):
    fresh(_FakeDriver(init_raises=RuntimeError("not found")))
    monkeypatch.setattr(driver, "_libcuda_load_error", lambda: "libcuda.so.1: cannot open shared object file")
    with pytest.raises(NoDeviceError, match="no CUDA driver found"):
        driver.device_cupy()


def test_device_cupy_with_a_gpu_is_cupy(fresh):
    cupy = pytest.importorskip("cupy")
    fresh(_FakeDriver(_Status(0, "CUDA_SUCCESS"), devices=1))
    assert driver.device_cupy() is cupy


# -- CuPy ----------------------------------------------------------------------------------------------

def test_import_cupy_without_cupy_names_the_extras(fresh, monkeypatch):
    fresh(_FakeDriver(init_raises=RuntimeError("not found")))
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(ToolchainError) as info:
        driver.import_cupy()
    text = str(info.value)
    assert 'pip install "rope-rtc[cuda13]"' in text and '"rope-rtc[cuda12]"' in text
    assert isinstance(info.value.__cause__, ImportError)


def test_import_cupy_names_the_extra_of_the_drivers_cuda_version(fresh, monkeypatch):
    fresh(_FakeDriver(_Status(0, "CUDA_SUCCESS")))  # a CUDA 12.8 driver with one device
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ToolchainError) as info:
        driver.import_cupy()
    assert 'pip install "rope-rtc[cuda12]"' in str(info.value) and "cuda13" not in str(info.value)


def test_import_cupy_returns_the_module():
    cupy = pytest.importorskip("cupy")
    assert driver.import_cupy() is cupy


# -- the test suite's own GPU skips -----------------------------------------------------------------

@pytest.mark.skipif(driver.available(), reason="this machine has a GPU: GPU tests run")
def test_gpu_tests_skip_under_one_reason_without_a_progress_mark_each(tmp_path):
    """``python -m pytest -q`` on a CPU machine: one summary line for every GPU skip, not one per test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_RTC_")}
    env["ROPE_RTC_CACHE_DIR"] = str(tmp_path / "cache")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu_tail.py",
                        "tests/test_gpu_blog.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    skipped = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1, "\n".join(skipped)
    total = int(r.stdout.rsplit(" skipped", 1)[0].rsplit(None, 1)[-1])
    assert total > 20 and skipped[0].startswith(f"SKIPPED [{total}] ")
    assert "GPU test" in skipped[0]
    if not _libcuda_loadable():
        assert "no CUDA driver found" in skipped[0] and "insufficient" not in skipped[0]
    assert "s" * 10 not in r.stdout, "a progress mark per skipped GPU test"
