"""Shared pytest configuration.

Markers
-------
``gpu``     needs a CUDA device (and CuPy). Skipped with a reason when none is present.
``device``  needs something only the device machine has (a GPU, PyTorch, transformers).
``multigpu`` needs two or more CUDA devices.

With ``ROPE_RTC_REQUIRE_GPU=1`` (set by ``scripts/device_check.sh``) a skip of a test
carrying ``gpu`` or ``device`` becomes a failure: on the device those tests are not optional.
``ROPE_RTC_REQUIRE_MULTI_GPU=1`` (set by the script when it sees two GPUs) does the same for
``multigpu``.
"""

from __future__ import annotations

import os

import pytest


def _require_gpu() -> bool:
    return os.environ.get("ROPE_RTC_REQUIRE_GPU", "") not in ("", "0")


def pytest_configure(config: pytest.Config) -> None:
    # Never write test kernels into the user's cache: one private cache per test session.
    if not os.environ.get("ROPE_RTC_CACHE_DIR"):
        import tempfile

        os.environ["ROPE_RTC_CACHE_DIR"] = tempfile.mkdtemp(prefix="rope_rtc_test_cache_")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and CuPy")
    config.addinivalue_line("markers", "device: needs the device machine (GPU, torch, transformers)")
    config.addinivalue_line("markers", "multigpu: needs two or more CUDA devices")


_GPU_REASON: list[str | None] = []


def gpu_unavailable_reason() -> str | None:
    """Why GPU tests cannot run here, or None when they can (computed once)."""
    if not _GPU_REASON:
        reason = None
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                reason = "no CUDA device found"
        except ImportError:
            reason = "CuPy is not installed"
        except Exception as exc:  # no driver, no device
            reason = f"no usable CUDA device ({type(exc).__name__}: {exc})"
        _GPU_REASON.append(reason)
    return _GPU_REASON[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = gpu_unavailable_reason()
    count = 0
    if reason is None:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    for item in items:
        if reason is not None and ("gpu" in item.keywords or "multigpu" in item.keywords):
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))
        elif "multigpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs two CUDA devices, found {count}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped:
        return
    required = _require_gpu() and ("gpu" in item.keywords or "device" in item.keywords)
    required |= os.environ.get("ROPE_RTC_REQUIRE_MULTI_GPU", "") not in ("", "0") and "multigpu" in item.keywords
    if required:
        report.outcome = "failed"
        report.longrepr = (
            f"ROPE_RTC_REQUIRE_GPU=1 but this device test was skipped: {report.longrepr}"
        )
