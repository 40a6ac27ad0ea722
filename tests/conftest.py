"""Shared pytest configuration.

Markers
-------
``gpu``     needs a CUDA device (and CuPy). Without one, every such test is skipped with the
            same reason ("no CUDA driver found (...)", ...), which ``-ra`` prints once.
``device``  needs something only the device machine has (a GPU, PyTorch, transformers).
``multigpu`` needs two or more CUDA devices.
``stress``  repeats a scenario many times under load (a minute at most on the device): deselected
            unless ``ROPE_RTC_STRESS=1``, so the suite never runs it by default, e.g.
            ``ROPE_RTC_STRESS=1 ROPE_RTC_REQUIRE_GPU=1 python -m pytest -q -m stress tests``.
``slow``    a slow CPU test worth keeping (every kernel compiled for three architectures, a
            model's kernels warmed): deselected unless a ``-m`` expression is given or the test
            is named by its node id, so ``python -m pytest -q`` stays quick; CI runs them after
            the suite with ``python -m pytest -q -m slow``.

Fixtures shared by every module: ``gpu`` (a ``fakes.FakeGPU`` recording what the host logic
would launch, for CPU tests), ``no_device`` (the driver probe says there is no GPU) and ``cp``
(CuPy, for GPU tests). Helpers shared by several modules live in ``helpers.py`` (CPU and GPU),
``fakes.py`` (fake device arrays) and ``gpu_util.py`` (GPU only).

One rule tells CPU tests from GPU tests by the file name: a test carrying ``gpu``, ``device`` or
``multigpu`` lives in a ``tests/test_gpu_*.py`` file, and every test of such a file carries one of
them (``pytestmark`` at the top of the module does it). Collection stops with an error naming each
test that breaks the rule.

With ``ROPE_RTC_REQUIRE_GPU=1`` (set by ``scripts/device_check.sh``) a skip of a test
carrying ``gpu`` or ``device`` becomes a failure: on the device those tests are not optional.
``ROPE_RTC_REQUIRE_MULTI_GPU=1`` (set by the script when it sees two GPUs) does the same for
``multigpu``.

``ROPE_RTC_TEST_SHARD=i/n`` keeps shard i (0-based) of n and deselects the rest, so that n
processes run the suite side by side (``device_check.sh --shards n``): the device's 10-minute
command limit no longer fits the suite in one process. The split is made on what ``-k``, ``-m``
and ``--deselect`` selected: modules of at most 50 selected tests stay whole, larger ones are
dealt out a test at a time, each piece to the shard holding the fewest tests so far. A shard
can still be left empty (fewer pieces than shards); the script counts that as passed.
"""

from __future__ import annotations

import collections
import os

import pytest


# JAX (the README's and rope_rtc.jax's GPU tests) would otherwise take most of the GPU's memory on its
# first use, leaving too little for the CuPy tests that run after it in the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _require_gpu() -> bool:
    return os.environ.get("ROPE_RTC_REQUIRE_GPU", "") not in ("", "0")


_SESSION_CACHE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    # Never write test kernels into the user's cache: one private cache per test session,
    # removed at the end of the session (pytest_unconfigure).
    if not os.environ.get("ROPE_RTC_CACHE_DIR"):
        import tempfile

        _SESSION_CACHE.append(tempfile.mkdtemp(prefix="rope_rtc_test_cache_"))
        os.environ["ROPE_RTC_CACHE_DIR"] = _SESSION_CACHE[-1]
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and CuPy")
    config.addinivalue_line("markers", "device: needs the device machine (GPU, torch, transformers)")
    config.addinivalue_line("markers", "multigpu: needs two or more CUDA devices")
    config.addinivalue_line("markers", "stress: repeats a scenario under load; runs only with ROPE_RTC_STRESS=1")
    config.addinivalue_line("markers", "slow: a slow CPU test; runs only under -m (CI: -m slow) or named by node id")


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    while _SESSION_CACHE:
        path = _SESSION_CACHE.pop()
        if os.environ.get("ROPE_RTC_CACHE_DIR") == path:
            del os.environ["ROPE_RTC_CACHE_DIR"]
        shutil.rmtree(path, ignore_errors=True)


_GPU_REASON: list[str | None] = []
# Every GPU skip is raised from one line of this file with one reason, so ``-ra`` prints one
# summary line for all of them; their progress mark is dropped (pytest_report_teststatus).
GPU_SKIP = "GPU test: "


def gpu_unavailable_reason() -> str | None:
    """Why GPU tests cannot run here, or None when they can (computed once).

    The driver is asked first: without one, CuPy's runtime reports "CUDA driver version is
    insufficient", which sends a user after the wrong fix.
    """
    if not _GPU_REASON:
        from rope_rtc.core import driver
        from rope_rtc.errors import ToolchainError

        reason = driver.unavailable_reason()
        if reason is None:
            try:
                cupy = driver.import_cupy()
                if cupy.cuda.runtime.getDeviceCount() < 1:
                    reason = "CuPy sees no CUDA device"
            except ToolchainError as exc:
                reason = str(exc)
            except Exception as exc:  # a CuPy built for another CUDA major than the driver's
                reason = f"CuPy cannot use the GPU ({type(exc).__name__}: {exc})"
        _GPU_REASON.append(reason)
    return _GPU_REASON[0]


@pytest.fixture
def gpu():
    """A fake GPU (tests/fakes.py) for the CPU tests of host logic: records what would launch."""
    from fakes import FakeGPU

    with FakeGPU() as fake:
        yield fake


@pytest.fixture
def no_device(monkeypatch):
    """rope_rtc's driver probe answers that this machine has no GPU, whatever it has."""
    from rope_rtc.core import driver

    monkeypatch.setattr(driver, "available", lambda: False)
    # Shaped as the real reason: the loader's words in parentheses.
    monkeypatch.setattr(driver, "unavailable_reason", lambda: "no CUDA driver found (libcuda.so.1: simulated)")


@pytest.fixture(scope="session")
def cp():
    """CuPy, for the GPU tests (each is skipped before its fixtures where no GPU can run it)."""
    import cupy

    return cupy


def _gpu_count() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def _shard() -> tuple[int, int] | None:
    value = os.environ.get("ROPE_RTC_TEST_SHARD", "")
    if not value:
        return None
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise pytest.UsageError(f"ROPE_RTC_TEST_SHARD={value!r}: expected i/n with 0 <= i < n, e.g. 0/4")
    return index, count


# A module of at most this many tests goes to one shard whole: a few modules end with a test that
# reads what the module's other tests recorded (test_gpu_fuzz's counts).
_WHOLE_MODULE = 50


def _shard_items(items: list[pytest.Item], index: int, count: int) -> list[pytest.Item]:
    """The tests of shard ``index`` of ``count``: the same split in every process.

    Small modules are kept whole; larger ones are dealt out a test at a time, so the long
    parametrised files do not land on one process. Each group goes to the shard holding the
    fewest tests so far.
    """
    modules = [item.nodeid.split("::")[0] for item in items]
    sizes = collections.Counter(modules)
    groups: dict[str, list[pytest.Item]] = {}
    for n, (item, module) in enumerate(zip(items, modules)):
        groups.setdefault(module if sizes[module] <= _WHOLE_MODULE else f"{module}#{n}", []).append(item)
    load = [0] * count
    mine: set[int] = set()
    for group in groups.values():
        target = load.index(min(load))
        load[target] += len(group)
        if target == index:
            mine.update(id(item) for item in group)
    return [item for item in items if id(item) in mine]


GPU_MARKERS = ("gpu", "device", "multigpu")
GPU_FILE_PREFIX = "test_gpu_"


_MISPLACED = pytest.StashKey[list]()


def misplaced(item: pytest.Item) -> str | None:
    """How ``item`` breaks the file-name rule, with the way out, or None: a GPU-marked test
    outside a ``test_gpu_*.py`` file, or an unmarked test inside one."""
    in_gpu_file = item.path.name.startswith(GPU_FILE_PREFIX)
    marked = [name for name in GPU_MARKERS if item.get_closest_marker(name) is not None]
    if marked and not in_gpu_file:
        return (f"{item.nodeid}: marked {marked[0]!r} outside a {GPU_FILE_PREFIX}*.py file; move it to one "
                f"(tests that need a GPU live there)")
    if in_gpu_file and not marked:
        return (f"{item.nodeid}: a test in a {GPU_FILE_PREFIX}*.py file without a gpu, device or multigpu "
                f"marker; mark it, or move it to a CPU test file")
    return None


# Every collected test, before -k or -m choose: the rule holds for the whole suite.
def pytest_itemcollected(item: pytest.Item) -> None:
    problem = misplaced(item)
    if problem is not None:
        item.config.stash.setdefault(_MISPLACED, []).append(problem)


def _named_by_node_id(config: pytest.Config, item: pytest.Item) -> bool:
    """Whether the command line names this test (``file.py::test``, a parametrisation or a class)."""
    for arg in config.args:
        path, sep, rest = arg.partition("::")
        if not sep or (config.invocation_params.dir / path).resolve() != item.path.resolve():
            continue
        name = item.nodeid.split("::", 1)[1]
        if name == rest or name.startswith((rest + "[", rest + "::")):
            return True
    return False


# Last: after pytest's own -k/-m/--deselect filtering (a conftest's hooks otherwise run before
# the built-in plugins'), so the shards split what was selected.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problems = config.stash.get(_MISPLACED, [])
    if problems:
        raise pytest.UsageError("tests on the wrong side of the CPU/GPU file-name rule (tests/conftest.py):\n  "
                                + "\n  ".join(problems))
    if os.environ.get("ROPE_RTC_STRESS", "") in ("", "0"):
        # Deselected rather than skipped: under ROPE_RTC_REQUIRE_GPU=1 a skipped GPU test fails.
        stress = [item for item in items if "stress" in item.keywords]
        if stress:
            config.hook.pytest_deselected(items=stress)
            items[:] = [item for item in items if "stress" not in item.keywords]
    if not config.option.markexpr:
        slow = [item for item in items if item.get_closest_marker("slow") and not _named_by_node_id(config, item)]
        if slow:
            config.hook.pytest_deselected(items=slow)
            slow_ids = {id(item) for item in slow}
            items[:] = [item for item in items if id(item) not in slow_ids]
    shard = _shard()
    if shard is not None:
        kept = _shard_items(items, *shard)
        kept_ids = {id(item) for item in kept}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
        items[:] = kept
    if gpu_unavailable_reason() is not None:
        return  # pytest_runtest_setup skips them
    count = _gpu_count()
    for item in items:
        if "multigpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs two CUDA devices, found {count}"))


@pytest.fixture(autouse=True)
def _no_fake_left_behind():
    """A test must not leave a FakeGPU's fakes behind (``fakes.leaked_fakes``): every later test,
    the GPU ones included, would launch fake kernels. Torn down after the test's monkeypatch."""
    yield
    import fakes

    left = fakes.leaked_fakes()
    if left:
        fakes.restore_originals()
        pytest.fail(f"left behind after the test: {'; '.join(left)}. Inside a FakeGPU, change what it patched "
                    "with gpu.patch(owner, name, value), which it undoes in order, not with monkeypatch")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = gpu_unavailable_reason()
    if reason is not None and ("gpu" in item.keywords or "multigpu" in item.keywords):
        pytest.skip(GPU_SKIP + reason)


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    longrepr = report.longrepr
    if (report.skipped and report.when == "setup" and isinstance(longrepr, tuple)
            and str(longrepr[2]).startswith(f"Skipped: {GPU_SKIP}")):
        return "skipped", "", "SKIPPED"  # counted and summarised, without an "s" per test
    return None


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
