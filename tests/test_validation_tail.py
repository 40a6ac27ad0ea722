"""Validation of the prepared BF16 tail RoPE API, on a CPU, with fake device arrays and TensorDesc.

``check_support`` rejects what the seed's contract excludes; ``execute`` checks addresses,
contiguity and overlap. ``execute`` is driven to its launch by :class:`fakes.FakeGPU` (fake
function handles and a recording launcher), so an error with no recorded launch is an error
raised before any launch. The interface cannot name bfloat16, so ``x`` and ``out`` are fake CuPy
arrays; the tables are ``__cuda_array_interface__`` fakes.
"""

from __future__ import annotations

import re
import sys
import warnings

import ml_dtypes
import numpy as np
import pytest

from fakes import BF16, HostDLPack, FakeDeviceArray, FakeTorchTensor, fake_cupy, fake_torch_bf16_cai
from rope_rtc import TailRoPEForward, TensorDesc, TupleDict, tail_rope
from rope_rtc.core import arrays as A
from rope_rtc.ops import tail as tail_mod
from rope_rtc.reference import tail_rope_reference

T, H, D = 4, 2, 128
NAMES = ("x", "cosine", "sine", "out")


def arrays(t=T, h=H, d=D, rank=3, device=0):
    shape = (t, h, d) if rank == 3 else (t, d)
    # sine speaks __cuda_array_interface__, whose device is the current one (0) when no driver can say.
    sine = FakeDeviceArray((t, 32), np.float32) if device == 0 else fake_cupy((t, 32), np.float32, device=device)
    return (fake_cupy(shape, BF16, device=device), fake_cupy((t, 32), np.float32, device=device), sine,
            fake_cupy(shape, BF16, device=device))


def descs(t=T, h=H, d=D, device=None):
    return (TensorDesc(BF16, (t, h, d), device=device), TensorDesc(np.float32, (t, 32), device=device),
            TensorDesc(np.float32, (t, 32), device=device), TensorDesc(BF16, (t, h, d), device=device))


def _replace(args, name, value):
    args = list(args)
    args[NAMES.index(name)] = value
    return args


# ---------------------------------------------------------------------------------------------
# check_support

@pytest.mark.parametrize("source", ["arrays", "descs"])
def test_supported_plan(source):
    plan = TailRoPEForward(*(arrays() if source == "arrays" else descs()))
    assert plan.check_support() is plan
    assert (plan.heads, plan.dim, plan.rank, plan.device) == (H, D, 3, 0)
    plan2 = TailRoPEForward(*arrays(rank=2, d=512)).check_support()
    assert (plan2.heads, plan2.dim, plan2.rank) == (1, 512, 2)


def test_scratch_workspace_is_zero():
    plan = TailRoPEForward(*descs())
    assert plan.scratch_workspace_bytes() == 0
    assert plan.check_support().scratch_workspace_bytes() == 0


@pytest.mark.parametrize("name,value,exc,pattern", [
    ("x", fake_cupy((T, H, D), np.float16), TypeError,
     r"x: dtype float16 is not supported \(tail RoPE is BF16\); expected bfloat16$"),
    ("x", FakeDeviceArray((T, H, D), np.float32), TypeError, r"x: dtype float32"),
    ("x", fake_torch_bf16_cai((T, H, D)), TypeError, r"x: dtype .V2 .*DLPack"),
    ("out", fake_cupy((T, H, D), np.float32), TypeError, r"out: dtype float32"),
    ("cosine", FakeDeviceArray((T, 32), np.float64), TypeError, r"cosine: dtype float64 is not supported; expected float32$"),
    ("sine", fake_cupy((T, 32), BF16), TypeError, r"sine: dtype bfloat16"),
    ("x", fake_cupy((D,), BF16), ValueError, r"x: expected \[T, D\] or \[T, H, D\], got shape \(128,\)"),
    ("x", fake_cupy((T, H, 1, D), BF16), ValueError, r"x: expected \[T, D\] or \[T, H, D\]"),
    ("x", fake_cupy((T, H, 256), BF16), ValueError, r"x: channel count D=256 is not supported"),
    ("x", fake_cupy((T, H, 64), BF16), ValueError, r"x: channel count D=64"),
    ("x", fake_cupy((T, 0, D), BF16), ValueError, r"x: head count H must be positive"),
    ("x", np.zeros((T, H, D), BF16), TypeError, r"x: a NumPy \(host\) array"),
    ("cosine", np.zeros((T, 32), np.float32), TypeError, r"cosine: a NumPy \(host\) array"),
    ("sine", np.zeros((T, 32), np.float32), TypeError, r"sine: a NumPy \(host\) array"),
    ("out", np.zeros((T, H, D), BF16), TypeError, r"out: a NumPy \(host\) array"),
    ("x", FakeTorchTensor((T, H, D), np.float16), TypeError, r"x requires grad"),
    ("cosine", FakeTorchTensor((T, 32), np.float32), TypeError, r"cosine requires grad"),
    ("sine", FakeTorchTensor((T, 32), np.float32), TypeError, r"sine requires grad"),
    ("out", FakeTorchTensor((T, H, D), np.float16), TypeError, r"out requires grad"),
    ("cosine", FakeDeviceArray((T + 1, 32), np.float32), ValueError, r"cosine: expected shape \(4, 32\), got \(5, 32\)"),
    ("sine", FakeDeviceArray((T, 16), np.float32), ValueError, r"sine: expected shape \(4, 32\)"),
    ("cosine", FakeDeviceArray((T, 32, 1), np.float32), ValueError, r"cosine: expected shape"),
    ("out", fake_cupy((T, H + 1, D), BF16), ValueError, r"out: shape \(4, 3, 128\) differs from x's"),
    ("sine", fake_cupy((T, 32), np.float32, device=1), ValueError, r"sine is on device 1 but x \(device 0\)"),
    ("x", [[0.0]], TypeError, r"x: expected a CuPy or NumPy array"),
])
def test_check_support_rejects(name, value, exc, pattern):
    args = _replace(arrays(), name, value)
    plan = TailRoPEForward(*args)
    with pytest.raises(exc, match=pattern):
        plan.check_support()
    with pytest.raises(exc, match=pattern):
        plan.compile()  # compile checks support first, and fails the same way before touching a GPU
    if isinstance(value, FakeTorchTensor):
        assert value.dlpack_calls == 0


@pytest.mark.parametrize("backend", ["frost", "cudnn", "cuda", "NumPy", None])
def test_unsupported_backend(backend):
    plan = TailRoPEForward(*arrays(), backend=backend)
    with pytest.raises(ValueError, match="backend: .* is not supported"):
        plan.check_support()
    with pytest.raises(ValueError, match="backend: .* is not supported"):
        tail_rope(*arrays()[:3], backend=backend)


def test_the_contracts_backend_name_points_at_this_ones():
    with pytest.raises(ValueError, match="the contract's 'frost' kernels are rope_rtc's 'nvrtc'"):
        tail_rope(*arrays()[:3], backend="frost")


def test_numpy_backend_rejects_device_arrays():
    with pytest.raises(TypeError, match="backend='numpy' takes host arrays"):
        TailRoPEForward(*arrays(), backend="numpy").check_support()
    x = np.zeros((T, H, D), BF16)
    c = np.zeros((T, 32), np.float32)
    with pytest.raises(TypeError, match="backend='numpy' takes host arrays"):
        TailRoPEForward(x, FakeDeviceArray((T, 32), np.float32), c, np.zeros_like(x), backend="numpy").check_support()


def test_tail_rope_on_the_numpy_backend_names_a_device_x():
    with pytest.raises(TypeError, match="x: backend='numpy' takes host arrays"):
        tail_rope(*arrays()[:3], backend="numpy")


def test_a_numpy_backend_plan_may_be_declared():
    # A declaration names a device, always; under the NumPy backend its dtype and shape are what count.
    decl = (TensorDesc(BF16, (T, H, D)), TensorDesc(np.float32, (T, 32)), TensorDesc(np.float32, (T, 32)),
            TensorDesc(BF16, (T, H, D)))
    plan = TailRoPEForward(*decl, backend="numpy").check_support()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((T, H, D)).astype(np.float32).astype(BF16)
    c, s = (rng.standard_normal((T, 32)).astype(np.float32) for _ in range(2))
    out = np.full_like(x, np.nan)
    plan.execute(x, c, s, out)
    from rope_rtc.reference import tail_rope_reference

    assert out.tobytes() == tail_rope_reference(x, c, s).tobytes()


def test_auto_is_the_gpu_where_one_is(gpu):
    """``backend="auto"`` (tail_rope's default, and the plan's when named) means the kernel on a
    machine with a GPU; without one it is the NumPy backend (tests/test_numpy_backend.py)."""
    x, c, s, o = arrays()
    plan = TailRoPEForward(x, c, s, o, backend="auto").check_support()
    assert plan.backend == "nvrtc"
    plan.execute(x, c, s, o)
    tail_rope(x, c, s)
    assert len(gpu.launches) == 2


def test_tail_rope_refuses_host_and_device_arrays_mixed(gpu):
    """Host arrays go to the NumPy backend, or to the GPU and back; host and device arrays in one
    call are refused before anything is allocated or launched, naming the host ones."""
    x, c, s, _ = arrays()
    host_x = np.zeros((T, H, D), BF16)
    host_c = np.zeros((T, 32), np.float32)
    with pytest.raises(TypeError, match="x: host \\(NumPy\\) arrays mixed with device arrays"):
        tail_rope(host_x, c, s)
    with pytest.raises(TypeError, match="cosine: a NumPy \\(host\\) array is not accepted here.*backend='numpy'"):
        tail_rope(x, host_c, s)
    with pytest.raises(TypeError, match="x requires grad"):
        tail_rope(FakeTorchTensor((T, H, D), np.float16), host_c, host_c)
    assert gpu.launches == []


def test_head_times_dim_limit():
    # H * D < 2**31: declarations only (no memory), one token.
    def plan(h):
        x = TensorDesc(BF16, (1, h, 512))
        return TailRoPEForward(x, TensorDesc(np.float32, (1, 32)), TensorDesc(np.float32, (1, 32)),
                               TensorDesc(BF16, (1, h, 512)))

    with pytest.raises(ValueError, match=r"x: H\*D = 2147483648 must be below 2\*\*31"):
        plan(2**22).check_support()
    with pytest.raises(ValueError, match=r"H\*D"):
        plan(2**23).check_support()
    assert plan(2**22 - 1).check_support().heads == 2**22 - 1


@pytest.mark.parametrize("name", NAMES)
def test_declared_non_contiguous_layout_is_not_implemented(name):
    strided = {
        "x": TensorDesc(BF16, (T, H, D), strides=(H * 2 * D, 2 * D, 1)),
        "out": TensorDesc(BF16, (T, H, D), strides=(H * D, 1, H)),
        "cosine": TensorDesc(np.float32, (T, 32), strides=(64, 1)),
        "sine": TensorDesc(np.float32, (T, 32), strides=(1, T)),
    }[name]
    with pytest.raises(NotImplementedError, match=f"{name}: non-contiguous layouts are not supported"):
        TailRoPEForward(*_replace(descs(), name, strided)).check_support()
    view = {
        "x": fake_cupy((T, H + 1, D), BF16)[:, :H],
        "out": fake_cupy((T, H, 2 * D), BF16)[..., ::2],
        "cosine": FakeDeviceArray((T, 64), np.float32)[:, :32],
        "sine": FakeDeviceArray((2 * T, 32), np.float32)[::2],
    }[name]
    with pytest.raises(NotImplementedError, match=f"{name}: non-contiguous"):
        TailRoPEForward(*_replace(arrays(), name, view)).check_support()


# ---------------------------------------------------------------------------------------------
# execute: validation at every call, before any launch

def _n_vec(t, h=H, d=D):
    return t * h * d // 8


def test_execute_launches_and_returns_tuple_dict(gpu):
    x, c, s, o = arrays()
    plan = TailRoPEForward(x, c, s, o)
    result = plan.execute(x, c, s, o)
    assert isinstance(result, TupleDict) and result["out"] is o
    (launch,) = gpu.launches
    assert launch["fn"] == "tail_rope_bf16_x1"  # one 16-byte vector per thread at this size
    assert launch["grid"] == (-(-_n_vec(T) // tail_mod.BLOCK), 1, 1) and launch["block"] == (tail_mod.BLOCK, 1, 1)
    v = plan._core.block
    assert (v.x, v.out, v.n) == (x.data.ptr, o.data.ptr, _n_vec(T))
    assert v.cos == c.data.ptr and v.sin == A.describe(s, "sine").ptr
    # The same arrays again: no re-validation needed, one more launch.
    plan.execute(x, c, s, o)
    assert len(gpu.launches) == 2


def test_the_same_arrays_reshaped_in_place_are_validated_again(gpu):
    x, c, s, o = arrays()
    plan = TailRoPEForward(x, c, s, o)
    plan.execute(x, c, s, o)
    x.shape = (T, H * D)  # CuPy reshapes in place: the same object, another shape
    with pytest.raises(ValueError, match=r"x: rank 2 differs from the plan's 3"):
        plan.execute(x, c, s, o)
    assert len(gpu.launches) == 1


@pytest.mark.parametrize("which", ["sine", "out"])
def test_every_array_reshaped_in_place_is_validated_again(gpu, which):
    """Not only x and the cosine table: a sine table or output reshaped in place under the same
    object is a call of another shape, which the contract refuses."""
    x, c, _, o = arrays()
    s = fake_cupy((T, 32), np.float32)  # every array CuPy's: the plan remembers the set
    plan = TailRoPEForward(x, c, s, o)
    plan.execute(x, c, s, o)
    plan.execute(x, c, s, o)  # remembered
    a = {"sine": s, "out": o}[which]
    a.shape = (a.size // 4, 4) if which == "sine" else (a.size,)
    with pytest.raises(ValueError, match=rf"{which}: .*shape"):
        plan.execute(x, c, s, o)
    assert len(gpu.launches) == 2


def test_one_problem_raises_one_type_on_the_first_and_a_later_call(gpu):
    """A non-contiguous cosine of the wrong token count: the layout is named first both when the
    call is validated from scratch (check_support's order) and when a plan of its signature exists."""
    x, c, s, o = arrays()
    bad = FakeDeviceArray((T + 1, 64), np.float32)[:, 32:]  # not contiguous, and T + 1 rows
    with pytest.raises(NotImplementedError, match="cosine: non-contiguous"):
        TailRoPEForward(x, bad, s, o).check_support()
    plan = TailRoPEForward(x, c, s, o)
    plan.execute(x, c, s, o)
    with pytest.raises(NotImplementedError, match="cosine: non-contiguous"):
        plan.execute(x, bad, s, o)
    tail_rope(x, c, s)
    with pytest.raises(NotImplementedError, match="cosine: non-contiguous"):
        tail_rope(x, bad, s)  # the thread's plan for this signature exists now


def test_execute_large_inputs_cover_every_vector(gpu):
    from rope_rtc.build.registry import tail_spec

    t, h, d = 16384, 64, 512
    x, c, s, o = arrays(t, h, d)
    plan = TailRoPEForward(*descs(1, h, d)).check_support()
    plan.execute(x, c, s, o)
    (launch,) = gpu.launches
    assert launch["fn"] in tail_spec(h, d).entries
    per_thread = 4 if launch["fn"].endswith("x4") else 1  # vectors per thread of the entry
    assert launch["block"] == (tail_mod.BLOCK, 1, 1)
    assert launch["grid"][0] == -(-_n_vec(t, h, d) // (tail_mod.BLOCK * per_thread))
    assert plan._core.block.n == _n_vec(t, h, d)


def test_token_count_changes_including_zero(gpu):
    plan = TailRoPEForward(*descs(t=1)).check_support().compile()
    for t in (0, 5, 257, 4096, 0, 1):
        x, c, s, o = arrays(t)
        out = plan.execute(x, c, s, o)["out"]
        assert out is o
    assert len(gpu.launches) == 4  # T = 0 launches nothing
    assert [g["grid"][0] for g in gpu.launches] == [-(-_n_vec(t) // tail_mod.BLOCK) for t in (5, 257, 4096, 1)]


def test_zero_tokens_with_zero_strides(gpu):
    # CuPy (and NumPy) give freshly made empty arrays all-zero strides: still "contiguous".
    import cupy

    mem = cupy.cuda.UnownedMemory(0x7F0000000000, 256, None, device_id=0)
    x = cupy.ndarray((0, H, D), BF16, memptr=cupy.cuda.MemoryPointer(mem, 0))
    c = cupy.ndarray((0, 32), np.float32, memptr=cupy.cuda.MemoryPointer(mem, 0))
    assert set(x.strides) == {0}
    plan = TailRoPEForward(*descs()).check_support()
    assert plan.execute(x, c, c, cupy.ndarray((0, H, D), BF16, memptr=cupy.cuda.MemoryPointer(mem, 0)))["out"].size == 0
    assert gpu.launches == []


@pytest.mark.parametrize("name,offset", [("x", 2), ("x", 8), ("out", 8), ("out", 2), ("cosine", 4), ("sine", 8),
                                         ("sine", 12)])
def test_execute_rejects_misaligned(gpu, name, offset):
    plan = TailRoPEForward(*descs()).check_support()
    args = list(arrays())
    i = NAMES.index(name)
    dt = BF16 if name in ("x", "out") else np.float32
    shape = args[i].shape
    args[i] = fake_cupy(shape, dt, byte_offset=offset) if dt == BF16 else FakeDeviceArray(shape, dt).shifted(offset)
    with pytest.raises(ValueError, match=rf"{name}: data pointer .* is not 16-byte aligned"):
        plan.execute(*args)
    assert gpu.launches == []


@pytest.mark.parametrize("name", NAMES)
def test_execute_rejects_non_contiguous(gpu, name):
    plan = TailRoPEForward(*descs()).check_support()
    view = {
        "x": fake_cupy((T, H + 1, D), BF16)[:, 1:],
        "out": fake_cupy((2 * T, H, D), BF16)[::2],
        "cosine": FakeDeviceArray((T, 64), np.float32)[:, 32:],
        "sine": FakeDeviceArray((2 * T, 32), np.float32)[::2],
    }[name]
    # The same problem raises the same type at check_support and at execute.
    with pytest.raises(NotImplementedError, match=rf"{name}: non-contiguous layouts are not supported"):
        plan.execute(*_replace(arrays(), name, view))
    assert gpu.launches == []


def test_execute_rejects_out_overlapping_each_input(gpu):
    plan = TailRoPEForward(*descs()).check_support()
    x, c, s, o = arrays()
    with pytest.raises(ValueError, match="out overlaps x"):
        plan.execute(x, c, s, x)
    # A partial overlap: out starts one token into x's buffer.
    buf = fake_cupy((2 * T, H, D), BF16)
    with pytest.raises(ValueError, match="out overlaps x"):
        plan.execute(buf[:T], c, s, buf[1 : T + 1])
    big = fake_cupy((T * H * D,), BF16)  # as many bytes as x: lay each table inside it
    for name in ("cosine", "sine"):
        table = FakeDeviceArray((T, 32), np.float32, ptr=big.data.ptr + 64)
        args = _replace((x, c, s, big.reshape(T, H, D)), name, table)
        with pytest.raises(ValueError, match=f"out overlaps {name}: the output must be disjoint"):
            plan.execute(*args)
    assert gpu.launches == []
    # Inputs may overlap each other (they are only read): the same table for cosine and sine.
    plan.execute(x, c, c, o)
    assert len(gpu.launches) == 1


@pytest.mark.parametrize("case", ["table_rows", "table_cols", "heads", "dim", "rank", "out_shape", "declaration",
                                  "host", "other_device", "dtype", "requires_grad"])
def test_execute_rejects_mismatch(gpu, case):
    plan = TailRoPEForward(*descs()).check_support()
    x, c, s, o = arrays()
    exc = ValueError
    if case == "table_rows":
        args, pattern = (x, FakeDeviceArray((T + 1, 32), np.float32), s, o), r"cosine: expected shape \(4, 32\)"
    elif case == "table_cols":
        args, pattern = (x, c, FakeDeviceArray((T, 33), np.float32), o), r"sine: expected shape"
    elif case == "heads":
        args, pattern = arrays(h=H + 1), r"x: shape \(4, 3, 128\) does not match the plan's H=2, D=128"
    elif case == "dim":
        args, pattern = arrays(d=512), r"does not match the plan's H=2, D=128"
    elif case == "rank":
        args, pattern = arrays(rank=2), r"x: rank 2 differs from the plan's 3"
    elif case == "out_shape":
        args, pattern = (x, c, s, fake_cupy((T + 1, H, D), BF16)), r"out: shape"
    elif case == "declaration":
        args, pattern = (TensorDesc(BF16, (T, H, D)), c, s, o), r"x: execute\(\) needs arrays, not declarations"
        exc = TypeError
    elif case == "host":
        args, pattern = (x, c, s, np.zeros((T, H, D), BF16)), r"out: a NumPy \(host\) array"
        exc = TypeError
    elif case == "other_device":
        args, pattern = arrays(device=1), r"is on device 1 but the plan's device 0"
    elif case == "dtype":
        args, pattern = (x, c, s, fake_cupy((T, H, D), np.float16)), r"out: dtype float16"
        exc = TypeError
    elif case == "requires_grad":
        args, pattern = (x, FakeTorchTensor((T, 32), np.float32), s, o), r"cosine requires grad"
        exc = TypeError
    with pytest.raises(exc, match=pattern):
        plan.execute(*args)
    assert gpu.launches == []


def test_execute_rank_two_plan_given_rank_three(gpu):
    plan = TailRoPEForward(*arrays(rank=2)).check_support()
    with pytest.raises(ValueError, match="x: rank 3 differs from the plan's 2"):
        plan.execute(*arrays(rank=3))
    with pytest.raises(ValueError, match="x: rank 0 differs"):
        plan.execute(fake_cupy((), BF16), *arrays(rank=2)[1:])
    assert gpu.launches == []


def test_execute_checks_the_grid_limit(gpu):
    # Enough tokens that even the wide kernel needs more than 2**31 - 1 blocks (fake memory: no bytes).
    per_block = tail_mod.BLOCK * 4  # the most vectors a block of any tail entry covers
    t = (2**31) * per_block * 8 // (64 * 512) + 1
    x, c, s, o = arrays(t, 64, 512)
    plan = TailRoPEForward(*descs(1, 64, 512)).check_support()
    with pytest.raises(ValueError, match="above the CUDA grid limit"):
        plan.execute(x, c, s, o)
    assert gpu.launches == []


def test_plan_keeps_its_declared_device(gpu, monkeypatch):
    import cupy

    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 2)
    declared = descs(device="cuda")
    assert {d.device for d in declared} == {2}
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)  # another device becomes current
    plan = TailRoPEForward(*declared).check_support()
    assert plan.device == 2
    with pytest.raises(ValueError, match="is on device 0 but the plan's device 2"):
        plan.execute(*arrays())
    plan.execute(*arrays(device=2))
    assert len(gpu.launches) == 1
    assert TailRoPEForward(*descs(device="cuda:1")).check_support().device == 1


# ---------------------------------------------------------------------------------------------
# TensorDesc and TupleDict

def test_tensor_desc_binds_a_device():
    from rope_rtc.core import driver

    current = 0
    if driver.available():
        import cupy

        current = cupy.cuda.runtime.getDevice()
    assert TensorDesc(BF16, (1, 128)).device == current
    assert TensorDesc(BF16, (1, 128), device="cuda").device == current
    assert TensorDesc(BF16, (1, 128), device="cuda:3").device == 3
    assert TensorDesc(BF16, (1, 128), device=2).device == 2
    assert TensorDesc(BF16, (1, 128), device=np.int64(2)).device == 2
    for bad in ("cuda:x", "gpu", "cuda:-1", "cpu", "cuda:", "CUDA", -1, np.int32(-1)):
        with pytest.raises(ValueError, match="TensorDesc: device"):
            TensorDesc(BF16, (1, 128), device=bad)
    for bad in (True, np.bool_(False), 1.5, 0.0, b"cuda", [0]):
        with pytest.raises(TypeError, match=f"TensorDesc: device.*{re.escape(repr(bad))}"):
            TensorDesc(BF16, (1, 128), device=bad)


def test_tensor_desc_fields():
    d = TensorDesc(BF16, (4, 2, 128))
    assert d.strides == (256, 128, 1) and d.dtype == BF16 and d.dtype_name == "bfloat16"
    assert "bfloat16" in repr(d)
    assert TensorDesc("float32", [3, 32]).shape == (3, 32)
    assert TensorDesc(np.float32, (0, 32)).strides == (32, 1)
    with pytest.raises(TypeError, match="TensorDesc: dtype"):
        TensorDesc("not-a-dtype", (1,))
    with pytest.raises(ValueError, match="negative extent"):
        TensorDesc(BF16, (-1, 128))
    with pytest.raises(ValueError, match="do not match shape"):
        TensorDesc(BF16, (4, 128), strides=(1,))
    info = A.describe(d, "x")
    assert (info.ptr, info.shape, info.strides, info.dtype, info.device) == (0, (4, 2, 128), (256, 128, 1),
                                                                           "bfloat16", 0)


@pytest.mark.parametrize("shape,bad", [
    ((2, 3.5, 4, 64), "3.5"),
    ((2, True, 4, 64), "True"),
    ((2, "3", 4, 64), "'3'"),
    ((2, np.float32(3), 4, 64), "3.0"),
    ((2, np.bool_(True), 4, 64), "True"),
    ((2, None, 4, 64), "None"),
])
def test_tensor_desc_refuses_a_shape_that_is_not_ints(shape, bad):
    """An extent is a Python int or a NumPy integer: anything else was truncated or converted
    (3.5 became 3, True 1, '3' 3) and described an array the caller never declared."""
    with pytest.raises(TypeError, match=rf"TensorDesc: shape .*{re.escape(bad)}"):
        TensorDesc(np.float32, shape)


@pytest.mark.parametrize("strides,bad", [
    ((768.9, 192, 64, 1), "768.9"),
    ((768, 192, False, 1), "False"),
    ((768, "192", 64, 1), "'192'"),
    ((768, 192, 64, 1.0), "1.0"),
])
def test_tensor_desc_refuses_strides_that_are_not_ints(strides, bad):
    with pytest.raises(TypeError, match=rf"TensorDesc: strides .*{re.escape(bad)}"):
        TensorDesc(np.float32, (2, 3, 4, 64), strides=strides)


@pytest.mark.parametrize("shape", ["1234", 4, b"12", 2.0, {1, 2}])
def test_tensor_desc_refuses_a_shape_that_is_not_a_sequence(shape):
    with pytest.raises(TypeError, match="TensorDesc: shape"):
        TensorDesc(np.float32, shape)


def test_tensor_desc_refuses_strides_that_are_not_a_sequence():
    for strides in ("64", 64, 1.0):
        with pytest.raises(TypeError, match="TensorDesc: strides"):
            TensorDesc(np.float32, (64,), strides=strides)


def test_tensor_desc_takes_numpy_integers_as_python_ints():
    d = TensorDesc(np.float32, (np.int64(2), np.int32(3), np.uint8(64)), strides=[np.int64(192), 64, np.intp(1)])
    assert d.shape == (2, 3, 64) and d.strides == (192, 64, 1)
    assert all(type(v) is int for v in d.shape + d.strides)
    assert TensorDesc(np.float32, np.array([2, 64])).shape == (2, 64)
    assert TensorDesc(np.float32, ()).shape == ()


def test_tensor_desc_refuses_none_as_a_dtype():
    """np.dtype(None) is float64: a missing dtype would declare a float64 array."""
    with pytest.raises(TypeError, match="TensorDesc: dtype None"):
        TensorDesc(None, (2, 64))


def test_tuple_dict():
    o = object()
    r = TupleDict(out=o)
    (out,) = r
    assert out is o and r["out"] is o and r[0] is o
    assert dict(r) == {"out": o}
    assert len(r) == 1 and "out" in r and list(r.keys()) == ["out"] and list(r.items()) == [("out", o)]
    assert r.get("missing") is None
    with pytest.raises(TypeError):
        r["out"] = 1
    with pytest.raises(TypeError):
        del r["out"]
    with pytest.raises(AttributeError):
        r.out = 1
    with pytest.raises(AttributeError):
        r._items = {}
    with pytest.raises(KeyError):
        r["x"]
    assert not hasattr(r, "__dict__")
    two = TupleDict(a=1, b=2)
    assert tuple(two) == (1, 2) and two == {"a": 1, "b": 2}


def test_reused_validation_keeps_pointer_checks(gpu):
    # Plans re-use a validated signature (all CuPy arguments) and re-check only the pointers.
    def cupy_arrays():
        return (fake_cupy((T, H, D), BF16), fake_cupy((T, 32), np.float32), fake_cupy((T, 32), np.float32),
                fake_cupy((T, H, D), BF16))

    plan = TailRoPEForward(*cupy_arrays())
    plan.execute(*cupy_arrays())
    plan.execute(*cupy_arrays())
    assert len(gpu.launches) == 2
    x, c, s, o = cupy_arrays()
    with pytest.raises(ValueError, match=r"sine: data pointer .* is not 16-byte aligned"):
        plan.execute(x, c, fake_cupy((T, 32), np.float32, byte_offset=4), o)
    with pytest.raises(ValueError, match="out overlaps cosine"):
        plan.execute(x, c, s, fake_cupy((T, H, D), BF16, ptr=c.data.ptr - 64, byte_offset=64 + 32))
    with pytest.raises(ValueError, match="out overlaps x"):
        plan.execute(x, c, s, x)
    assert len(gpu.launches) == 2


def test_recent_argument_sets_restore_their_own_pointers(gpu):
    from fakes import fake_cupy
    from rope_rtc.ops import tail as tail_mod

    def arrays(T=5):
        return (fake_cupy((T, 4, 128), BF16), fake_cupy((T, 32), np.float32), fake_cupy((T, 32), np.float32),
                fake_cupy((T, 4, 128), BF16))

    # More sets than the plan remembers, cycled (the quick path: each call's block its own), then
    # a rotation of as many as it remembers (bound and remembered on their second call, restored
    # from the recent sets from their third), with a call that launches nothing among them.
    many = [arrays() for _ in range(tail_mod.RECENT_SETS + 2)]
    rotation = many[:tail_mod.RECENT_SETS - 1] + [arrays(T=0)]
    plan = TailRoPEForward(*many[0]).check_support().compile()
    v = plan._core.block
    for sets in [many] * 2 + [rotation] * 3:
        for x, c, s, o in sets:
            plan.execute(x, c, s, o)
            if x.size:
                assert (v.x, v.cos, v.sin, v.out, v.n) == (x.data.ptr, c.data.ptr, s.data.ptr, o.data.ptr, x.size // 8)
    assert len(plan._core.recent) == tail_mod.RECENT_SETS
    assert len(gpu.launches) == 2 * len(many) + 3 * (len(rotation) - 1)  # T = 0 launches nothing


def _tail_record(rec) -> tuple:
    return (rec["fn"], rec["grid"], rec["block"], rec["stream"], rec["args"])


def test_the_repeat_paths_launch_what_a_cold_call_launches():
    """Episodes of tail_rope calls (one H, D and rank each; new arrays every call, now and then
    another token count, an array off the 16-byte alignment, a non-contiguous x) and of a plan's
    execute: each warm call (the thread's last repeat path, its signature dictionary; the plan's
    quick path) launches the same entry, grid, stream and block bytes as the same call in a fresh
    thread or a fresh plan, or raises the same."""
    from fakes import FakeGPU, warm_and_cold

    rng = np.random.default_rng(31)
    calls, planned = [], []
    for _ in range(45):
        h, d, rank = int(rng.choice([1, 2, 4])), int(rng.choice([128, 512])), int(rng.choice([2, 3]))
        stream = None if rng.random() < 0.7 else 77
        for _ in range(6):
            t = int(rng.choice([4, 4, 4, 7, 0]))
            shape = (t, h, d) if rank == 3 else (t, h * d)
            odd = rng.random()
            x = fake_cupy(shape, BF16, byte_offset=2 if odd < 0.06 else 0)
            if 0.06 <= odd < 0.1:
                x = fake_cupy(shape[:-1] + (2 * shape[-1],), BF16)[..., :shape[-1]]
            c = fake_cupy((t, 32), np.float32, byte_offset=4 if 0.1 <= odd < 0.14 else 0)
            calls.append((x, c, fake_cupy((t, 32), np.float32), stream))
            if x.shape[0] and rank == 3:
                planned.append((x, c, calls[-1][2], fake_cupy(shape, BF16), stream))
    with FakeGPU() as gpu:
        warm, cold = warm_and_cold(gpu, [lambda a=a: tail_rope(*a[:3], stream=a[3]) for a in calls], _tail_record)
        # A plan per H, D of rank 3, made from its first call, and the same calls on a fresh one.
        first = {}
        for x, c, s, o, stream in planned:
            if x._c_contiguous and not (x.data.ptr | c.data.ptr) % 16:
                first.setdefault(x.shape[1:], (x, c, s, o))
        planned = [a for a in planned if a[0].shape[1:] in first]
        plans = {key: TailRoPEForward(*a).check_support().compile() for key, a in first.items()}
        run_plan = [lambda a=a, p=plans[a[0].shape[1:]]: p.execute(*a[:4], current_stream=a[4]) for a in planned]
        run_fresh = [lambda a=a: TailRoPEForward(*first[a[0].shape[1:]]).check_support().compile().execute(
            *a[:4], current_stream=a[4]) for a in planned]
        from fakes import launch_outcome

        warm += [launch_outcome(gpu, run, _tail_record) for run in run_plan]
        cold += [launch_outcome(gpu, run, _tail_record) for run in run_fresh]
    assert len(warm) == len(cold) == len(calls) + len(planned)
    assert [i for i, (w, c) in enumerate(zip(warm, cold)) if w != c] == []
    launched = [w for w in warm if w and w[0] != "error"]
    assert len(launched) > 200 and len(warm) - len(launched) > 10


# -- host arrays of other libraries, and tail_rope without CuPy ------------------------------------


def _host_inputs(T=4, H=2, D=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H, D)).astype(np.float32).astype(ml_dtypes.bfloat16)
    c, s = (rng.standard_normal((T, 32)).astype(np.float32) for _ in range(2))
    return x, c, s


@pytest.mark.parametrize("which", ["cosine", "sine"])
def test_numpy_backend_computes_with_a_host_dlpack_table(which):
    # Validated as its NumPy view, then the object itself went to the reference: "cosine must be
    # float32, got object".
    x, c, s = _host_inputs()
    args = [x, HostDLPack(c) if which == "cosine" else c, HostDLPack(s) if which == "sine" else s]
    want = tail_rope_reference(x, c, s).view(np.uint16)
    out = np.full_like(x, np.nan)
    TailRoPEForward(*args, out, backend="numpy").execute(*args, out)
    np.testing.assert_array_equal(out.view(np.uint16), want)
    np.testing.assert_array_equal(tail_rope(*args, backend="numpy")["out"].view(np.uint16), want)


@pytest.fixture
def no_cupy(monkeypatch):
    """An install without CuPy (it comes with the cuda12/cuda13 extras only)."""
    from rope_rtc.core import prepared

    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(prepared, "_NDARRAY", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "auto" falls back to NumPy with a warning
        yield


@pytest.mark.parametrize("bad", [None, [[0.0] * 128] * 4])
def test_auto_without_cupy_names_a_bad_x(no_cupy, bad):
    # CuPy was imported before x was looked at: ToolchainError instead of the TypeError naming x.
    c = np.zeros((4, 32), np.float32)
    with pytest.raises(TypeError, match="^x: expected"):
        tail_rope(bad, c, c)


def test_auto_without_cupy_runs_a_host_ndarray_subclass_on_numpy(no_cupy, tmp_path):
    from rope_rtc.core import driver

    if driver.available():
        pytest.skip("a GPU is present: 'auto' means the GPU")
    x, c, s = _host_inputs()
    mm = np.memmap(tmp_path / "x.bin", dtype=x.dtype, mode="w+", shape=x.shape)
    mm[...] = x
    out = tail_rope(mm, c, s)["out"]  # ToolchainError (the GPU backend needs CuPy) before the fix
    np.testing.assert_array_equal(out.view(np.uint16), tail_rope_reference(x, c, s).view(np.uint16))


def test_misaligned_and_plan_mismatch_errors_name_the_fix():
    x, c, s = _host_inputs()
    plan = TailRoPEForward(x, c, s, np.empty_like(x), backend="numpy").check_support()
    buf = np.zeros(x.size + 1, x.dtype)
    with pytest.raises(ValueError, match=r"x: data pointer .* is not 16-byte aligned; pass a fresh allocation"):
        plan.execute(buf[1:].reshape(x.shape), c, s, np.empty_like(x))
    x2 = x.reshape(4, 256)[:, :128].copy()
    with pytest.raises(ValueError, match=r"x: rank 2 differs from the plan's 3; reshape x to the plan's rank"):
        plan.execute(x2, c, s, np.empty_like(x2))
    x3, c3, s3 = _host_inputs(H=3)
    with pytest.raises(ValueError, match=r"x: shape .* does not match the plan's H=2, D=128; make a plan"):
        plan.execute(x3, c3, s3, np.empty_like(x3))
