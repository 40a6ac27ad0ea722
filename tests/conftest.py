"""Shared pytest configuration.

Markers
-------
``gpu``     needs a CUDA device (and CuPy). Skipped with a reason when none is present.
``device``  needs something only the device machine has (a GPU, PyTorch, transformers).

With ``ROPE_RTC_REQUIRE_GPU=1`` (set by ``scripts/device_check.sh``) a skip of a test
carrying either marker becomes a failure: on the device those tests are not optional.
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
    if reason is None:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not _require_gpu() or not report.skipped:
        return
    if "gpu" in item.keywords or "device" in item.keywords:
        report.outcome = "failed"
        report.longrepr = (
            f"ROPE_RTC_REQUIRE_GPU=1 but this device test was skipped: {report.longrepr}"
        )
