"""Programmatic dependent launch (``pdl=True``), on the CPU: the builds that wait for their
producer (PTX from NVRTC), the launch through ``cuLaunchKernelEx`` with the attribute set, and which
calls of the plans and one-call functions take it (fake device arrays, recorded launches)."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest

from fakes import BF16, fake_cupy
from rope_rtc import RopePlan, apply_rope, apply_rope_qk
from rope_rtc.build import compiler, registry
from rope_rtc.build.toolchain import Target
from rope_rtc.errors import CudaError
from rope_rtc.ops import rope_plan

T, HQ, HK, D, ROWS = 4, 32, 8, 128, 4096


def _ptx(spec, arch: int) -> str:
    result = compiler.compile_source(spec.name, spec.source, spec.defines, Target(arch, "ptx"))
    return result.binary.rstrip(b"\0").decode()


def _decode_specs():
    g = registry.fixed_geometry("bfloat16", False, HQ, HK, D, 0, D, False, 2)
    return [g.spec(), registry.rope_spec("bfloat16", False, 8, 1)]


@pytest.mark.parametrize("which", [0, 1], ids=["specialised", "generic"])
def test_a_pdl_build_waits_for_its_producer_before_its_first_load(which):
    spec = _decode_specs()[which]
    plain, pdl = _ptx(spec, 90), _ptx(registry.waiting_for_producer(spec), 90)
    assert "griddepcontrol" not in plain
    for entry in spec.entries:
        body = pdl[pdl.index(f".entry {entry}"):]
        body = body[:body.index("\n}")]
        assert "griddepcontrol.wait" in body and "griddepcontrol.launch_dependents" in body
        first_load = re.search(r"\bld\.global", body)
        assert first_load is not None and body.index("griddepcontrol.wait") < first_load.start()


def test_a_pdl_build_for_an_older_architecture_is_the_plain_build():
    spec = _decode_specs()[0]
    assert "griddepcontrol" not in _ptx(registry.waiting_for_producer(spec), 80)


def _fake_driver(calls: list, status: int = 0):
    """cuda.bindings' driver with ``cuLaunchKernelEx`` recorded (the structs are the real ones)."""
    from cuda.bindings import driver as real

    def launch_ex(config, f, params, extra):
        attr = config.attrs[0]
        calls.append({"grid": (config.gridDimX, config.gridDimY, config.gridDimZ),
                      "block": (config.blockDimX, config.blockDimY, config.blockDimZ),
                      "shared": config.sharedMemBytes, "stream": int(config.hStream), "f": int(f),
                      "params": params, "attrs": config.numAttrs, "attr": attr.id,
                      "allowed": attr.value.programmaticStreamSerializationAllowed})
        return (real.CUresult(status),)

    return types.SimpleNamespace(CUlaunchAttribute=real.CUlaunchAttribute, CUlaunchConfig=real.CUlaunchConfig,
                                 CUlaunchAttributeID=real.CUlaunchAttributeID, CUfunction=real.CUfunction,
                                 CUresult=real.CUresult, cuGetErrorString=lambda s: (real.CUresult(0), b""),
                                 cuLaunchKernelEx=launch_ex)


def test_a_programmatic_launcher_launches_with_the_attribute_and_never_replays(monkeypatch):
    pytest.importorskip("cupy")
    from rope_rtc.core import driver
    from rope_rtc.core import launcher as L

    calls = []
    launcher = L.Launcher(1234, device=0)
    launcher._get_device = lambda: 0
    monkeypatch.setattr(driver, "_drv", lambda: _fake_driver(calls))
    launcher.launch_programmatically()
    assert launcher.replay is False
    prefix = (0xF00, 3, 1, 1, 128, 1, 1, 0)
    for token in (None, object(), object()):
        launcher(prefix, 0x70, token)
    launcher.launch(prefix, 0x71)
    assert [c["stream"] for c in calls] == [0x70, 0x70, 0x70, 0x71]
    assert calls[0] == {"grid": (3, 1, 1), "block": (128, 1, 1), "shared": 0, "stream": 0x70, "f": 0xF00,
                        "params": 1234, "attrs": 1, "allowed": 1,
                        "attr": driver._drv().CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION}


def test_a_failed_programmatic_launch_names_cuLaunchKernelEx(monkeypatch):
    pytest.importorskip("cupy")
    from rope_rtc.core import driver
    from rope_rtc.core import launcher as L

    launcher = L.Launcher(1234, device=0)
    launcher._get_device = lambda: 0
    monkeypatch.setattr(driver, "_drv", lambda: _fake_driver([], status=1))
    launcher.launch_programmatically()
    with pytest.raises(CudaError, match=r"cuLaunchKernelEx\(grid=\(3, 1, 1\), block=\(128, 1, 1\)"):
        launcher((0xF00, 3, 1, 1, 128, 1, 1, 0), 0x70)


def _arrays():
    q, k = fake_cupy((T, HQ, D), BF16), fake_cupy((T, HK, D), BF16)
    cos, sin = fake_cupy((ROWS, D // 2), np.float32), fake_cupy((ROWS, D // 2), np.float32)
    return q, k, cos, sin, fake_cupy((T,), np.int32)


@pytest.mark.parametrize("arch, programmatic", [(90, True), (100, True), (80, False)])
def test_a_pdl_plan_launches_programmatically_from_sm_90(gpu, monkeypatch, arch, programmatic):
    monkeypatch.setattr(rope_plan, "device_arch", lambda device: arch)
    q, k, cos, sin, pos = _arrays()
    plan = RopePlan(q, k, cos, sin, positions=pos, layout="thd", pdl=True)
    for _ in range(3):  # the same arrays: a remembered set, never a graph
        plan.execute(q, k, cos, sin, positions=pos)
    plan.execute(*_arrays()[:2], cos, sin, positions=pos)  # new arrays of the signature
    assert [r["programmatic"] for r in gpu.launches] == [programmatic] * 4
    assert all((r["fn"][-1] == "pdl") is programmatic for r in gpu.launches)


def test_plans_without_pdl_are_untouched(gpu, monkeypatch):
    monkeypatch.setattr(rope_plan, "device_arch", lambda device: pytest.fail("the arch is asked only for pdl"))
    q, k, cos, sin, pos = _arrays()
    RopePlan(q, k, cos, sin, positions=pos, layout="thd").execute(q, k, cos, sin, positions=pos)
    assert [r["programmatic"] for r in gpu.launches] == [False]
    assert gpu.launches[0]["fn"][-1] != "pdl"


def test_one_call_functions_keep_a_plan_per_pdl_option(gpu, monkeypatch):
    monkeypatch.setattr(rope_plan, "device_arch", lambda device: 90)
    q, k, cos, sin, pos = _arrays()
    seq = [True, True, False, False, True]  # the second of each runs the thread's last path
    for pdl in seq:
        apply_rope_qk(q, k, cos, sin, positions=pos, q_out=q, k_out=k, pdl=pdl)
    x = fake_cupy((T, HQ, D), BF16)
    for pdl in seq:
        apply_rope(x, cos, sin, positions=pos, out=x, pdl=pdl)
    apply_rope(x, cos, sin, positions=pos, pdl=True)  # an allocated output
    assert [r["programmatic"] for r in gpu.launches] == seq + seq + [True]


@pytest.mark.parametrize("bad", [1, "yes", None, np.bool_(True)])
def test_pdl_must_be_true_or_false(gpu, bad):
    q, k, cos, sin, pos = _arrays()
    with pytest.raises(TypeError, match="pdl: expected True or False"):
        RopePlan(q, k, cos, sin, positions=pos, layout="thd", pdl=bad)
    with pytest.raises(TypeError, match="pdl: expected True or False"):
        apply_rope_qk(q, k, cos, sin, positions=pos, q_out=q, k_out=k, pdl=bad)
    with pytest.raises(TypeError, match="pdl: expected True or False"):
        apply_rope(q, cos, sin, positions=pos, pdl=bad)
    assert gpu.launches == []
