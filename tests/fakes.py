"""Fake device arrays for CPU tests: they describe memory that does not exist.

Every fake carries an invented device address. Nothing here ever reads or writes through
one, and neither may the library before it launches a kernel: validation only does address
arithmetic. That is what lets the validation and fuzz tests run on a machine without a GPU.

Three kinds of fake, because the library accepts arrays three ways:

* :class:`FakeDeviceArray` speaks ``__cuda_array_interface__`` (version 3) and nothing else,
  like a Numba device array. Views (slices, transposes, byte offsets) are made with NumPy's
  own indexing on an address-only array, so their pointers and strides are exactly what a
  real library would produce. The interface cannot name bfloat16 (``ml_dtypes.bfloat16``
  reports itself as ``<V2``, as PyTorch's bfloat16 does), so bfloat16 needs the next kind.
* :func:`fake_cupy` returns a real ``cupy.ndarray`` over ``cupy.cuda.UnownedMemory`` at a fake
  address. Building and slicing one needs no GPU (only kernels do), it can be bfloat16, and it
  knows its device, which is how mixed host/device and cross-device inputs are tested.
* :class:`FakeTorchTensor` (``__dlpack__`` + ``requires_grad``) and :func:`fake_torch_bf16_cai`
  (a ``<V2`` interface) stand in for the two PyTorch cases the API must reject.

Fake addresses come from one counter, 256-byte aligned (like ``cudaMalloc``) and separated by
guard gaps, so two independent fakes never overlap; views of one fake share its memory.
"""

from __future__ import annotations

import itertools
import threading
import types

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)

_BASE = 0x7F00_0000_0000  # in the range where CUDA places device allocations on Linux
_GAP = 1 << 20
_ALLOC_ALIGN = 256
_lock = threading.Lock()
_next = [_BASE]
_ids = itertools.count()


def fake_alloc(nbytes: int) -> int:
    """A fresh, 256-byte aligned fake address with ``nbytes`` of room that nothing else uses."""
    nbytes = max(int(nbytes), 1)
    with _lock:
        ptr = _next[0]
        step = -(-(nbytes + _GAP) // _ALLOC_ALIGN) * _ALLOC_ALIGN
        _next[0] += step
    return ptr


def c_strides(shape, itemsize: int) -> tuple[int, ...]:
    """C-contiguous strides in bytes."""
    acc, out = itemsize, []
    for d in reversed(tuple(shape)):
        out.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(out))


def span_bytes(shape, strides, itemsize: int) -> int:
    """Bytes from the lowest to one past the highest byte an array (non-negative strides) touches."""
    if any(d == 0 for d in shape):
        return 0
    return sum((d - 1) * s for d, s in zip(shape, strides)) + itemsize


def _address_view(ptr: int, shape, strides, itemsize: int) -> np.ndarray:
    """A NumPy array of opaque items at ``ptr``: indexing it is pure address arithmetic."""

    class _Addr:
        __array_interface__ = {
            "data": (ptr, False),
            "shape": tuple(shape),
            "strides": tuple(strides),
            "typestr": f"|V{itemsize}",
            "version": 3,
        }

    return np.asarray(_Addr())


def _check_basic_index(index) -> None:
    # Advanced (array) indexing copies, and a copy would read the fake address.
    items = index if isinstance(index, tuple) else (index,)
    for it in items:
        if not (it is None or it is Ellipsis or isinstance(it, (int, np.integer, slice))):
            raise TypeError(f"fake arrays support basic indexing only, got {type(it).__name__}")


class FakeDeviceArray:
    """An object exposing only ``__cuda_array_interface__`` (v3) for memory that does not exist.

    Parameters
    ----------
    shape : tuple of int
    dtype : NumPy dtype (not bfloat16: the interface cannot name it; see :func:`fake_cupy`)
    ptr : int, optional
        The address; default a fresh one from :func:`fake_alloc`.
    strides : tuple of int, optional
        In bytes; ``None`` (the default) reports ``strides: None`` (C-contiguous).
    readonly : bool
    typestr : str, optional
        Overrides the reported typestr (``"<V2"`` is how PyTorch reports bfloat16).
    """

    def __init__(self, shape, dtype="float32", *, ptr=None, strides=None, readonly=False, typestr=None):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.strides = None if strides is None else tuple(int(s) for s in strides)
        self.ptr = fake_alloc(span_bytes(self.shape, self.byte_strides, self.itemsize)) if ptr is None else int(ptr)
        self.readonly = bool(readonly)
        self.typestr = self.dtype.str if typestr is None else typestr

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": self.shape,
            "typestr": self.typestr,
            "data": (self.ptr, self.readonly),
            "strides": self.strides,
            "version": 3,
        }

    @property
    def byte_strides(self) -> tuple[int, ...]:
        return self.strides if self.strides is not None else c_strides(self.shape, self.itemsize)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def _from_address_view(self, v: np.ndarray) -> "FakeDeviceArray":
        return FakeDeviceArray(v.shape, self.dtype, ptr=v.__array_interface__["data"][0], strides=v.strides,
                               readonly=self.readonly, typestr=self.typestr)

    def _addr(self) -> np.ndarray:
        return _address_view(self.ptr, self.shape, self.byte_strides, self.itemsize)

    def __getitem__(self, index) -> "FakeDeviceArray":
        """A view, exactly as NumPy would slice it (basic indexing only)."""
        _check_basic_index(index)
        return self._from_address_view(self._addr()[index])

    def transpose(self, *axes) -> "FakeDeviceArray":
        return self._from_address_view(self._addr().transpose(*axes))

    @property
    def T(self) -> "FakeDeviceArray":
        return self.transpose()

    def reshape(self, *shape) -> "FakeDeviceArray":
        """A reshaped view; raises when NumPy would need a copy (it never makes one)."""
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        v = self._addr().view()
        v.shape = shape  # assigning .shape raises instead of copying
        return self._from_address_view(v)

    def shifted(self, nbytes: int) -> "FakeDeviceArray":
        """The same shape and strides ``nbytes`` further on (misaligned when not a multiple of 16)."""
        return FakeDeviceArray(self.shape, self.dtype, ptr=self.ptr + nbytes, strides=self.strides,
                               readonly=self.readonly, typestr=self.typestr)

    def with_strides(self, strides) -> "FakeDeviceArray":
        """Same address and shape, explicit byte strides."""
        return FakeDeviceArray(self.shape, self.dtype, ptr=self.ptr, strides=strides, readonly=self.readonly,
                               typestr=self.typestr)

    def __repr__(self) -> str:
        return f"FakeDeviceArray({self.shape}, {self.dtype}, ptr={self.ptr:#x}, strides={self.strides})"


def fake_strided(shape, dtype="float32", *, pad_elems=0, byte_offset=0) -> FakeDeviceArray:
    """A fake whose rows are padded: every axis but the last has ``pad_elems`` extra elements per step
    of the axis after it, the last axis stays contiguous. ``byte_offset`` shifts the pointer."""
    dt = np.dtype(dtype)
    shape = tuple(shape)
    strides, acc = [], dt.itemsize
    for i, d in enumerate(reversed(shape)):
        strides.append(acc)
        acc = acc * max(d, 1) + (pad_elems * dt.itemsize if i == 0 else 0)
    strides = tuple(reversed(strides))
    base = fake_alloc(span_bytes(shape, strides, dt.itemsize) + abs(byte_offset) + 64)
    return FakeDeviceArray(shape, dt, ptr=base + byte_offset, strides=strides)


def fake_cupy(shape, dtype="float32", *, byte_offset=0, strides=None, device=0, ptr=None):
    """A real ``cupy.ndarray`` over fake memory: no GPU is needed to build, slice or describe it.

    ``strides`` are in bytes (default C-contiguous); ``byte_offset`` shifts the start for
    misalignment tests; ``device`` is the ordinal the array reports.
    """
    import cupy

    dt = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    st = c_strides(shape, dt.itemsize) if strides is None else tuple(int(s) for s in strides)
    nbytes = span_bytes(shape, st, dt.itemsize) + abs(byte_offset)
    base = fake_alloc(nbytes + 64) if ptr is None else int(ptr)
    mem = cupy.cuda.UnownedMemory(base, max(nbytes, 1) + 64, None, device_id=device)
    return cupy.ndarray(shape, dt, memptr=cupy.cuda.MemoryPointer(mem, byte_offset), strides=st)


def fused_qkv(B, S, Hq, Hkv, D, dtype="float32", *, layout="bshd", cupy_fake=False):
    """One fused buffer ``[B, S, Hq + 2*Hkv, D]`` (or its ``bhsd``/``sbhd``/``thd`` equivalent) and
    ``q``, ``k``, ``v`` as strided views of it along the head axis, never copied."""
    H = Hq + 2 * Hkv
    if layout == "thd":
        shape, head_axis = (B * S, H, D), 1
    elif layout == "bshd":
        shape, head_axis = (B, S, H, D), 2
    elif layout == "bhsd":
        shape, head_axis = (B, H, S, D), 1
    elif layout == "sbhd":
        shape, head_axis = (S, B, H, D), 2
    else:
        raise ValueError(layout)
    buf = fake_cupy(shape, dtype) if cupy_fake else FakeDeviceArray(shape, dtype)

    def heads(lo, hi):
        idx = [slice(None)] * len(shape)
        idx[head_axis] = slice(lo, hi)
        return buf[tuple(idx)]

    return buf, heads(0, Hq), heads(Hq, Hq + Hkv), heads(Hq + Hkv, H)


class FakeTorchTensor:
    """A PyTorch-like CUDA tensor: ``__dlpack__``, ``__dlpack_device__`` (kDLCUDA, 0), a
    ``__cuda_array_interface__`` and ``requires_grad``. Its ``__dlpack__`` must never be called
    when ``requires_grad`` is true: such a tensor is rejected first."""

    def __init__(self, shape, dtype="float32", *, requires_grad=True, typestr=None):
        self._cai = FakeDeviceArray(shape, dtype, typestr=typestr)
        self.shape = self._cai.shape
        self.requires_grad = requires_grad
        self.dlpack_calls = 0

    @property
    def __cuda_array_interface__(self) -> dict:
        return self._cai.__cuda_array_interface__

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, *args, **kwargs):
        self.dlpack_calls += 1
        raise RuntimeError("FakeTorchTensor has no memory to export")


def fake_torch_bf16_cai(shape) -> FakeDeviceArray:
    """What PyTorch's ``__cuda_array_interface__`` says of a bfloat16 tensor: typestr ``<V2``."""
    return FakeDeviceArray(shape, np.float16, typestr="<V2")


# ---------------------------------------------------------------------------------------------
# A stand-in for the GPU step, so that the public APIs can be driven to the launch on a CPU.


_FAKE_STATE: list = []
# (owner, name) -> the value a FakeGPU found there the first time it patched it (the library's own).
_ORIGINALS: dict = {}
# What the library itself changes for good (a GPU seen, CuPy's array type): not a fake left behind.
_STATE_FLAGS = ("_gpu_present", "_NDARRAY")


def _value_of(owner, name):
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def restore_originals() -> None:
    """Put back what :func:`leaked_fakes` finds left behind (so that one leak fails one test)."""
    fake_state = fake_thread_state_type() if _FAKE_STATE else None
    for (owner, name), original in _ORIGINALS.items():
        if name == "_local":
            if type(_value_of(owner, name)) is fake_state:
                owner.forget()
        elif name not in _STATE_FLAGS:
            setattr(owner, name, original)


def leaked_fakes() -> list[str]:
    """What a FakeGPU patched that is not the library's own again: a fake kernel loader, launcher or
    per-thread state left behind (by a ``monkeypatch`` inside the context, say), which would serve
    fake kernels to every later test."""
    fake_state = fake_thread_state_type() if _FAKE_STATE else None
    left = []
    for (owner, name), original in _ORIGINALS.items():
        value = _value_of(owner, name)
        if name == "_local":
            if type(value) is fake_state:
                left.append(f"{owner!r}._local (a FakeGPU's per-thread state)")
        elif name not in _STATE_FLAGS and value is not original:
            left.append(f"{getattr(owner, '__name__', owner)!s}.{name}")
    return left


def fake_thread_state_type() -> type:
    """The type of a one-call function's per-thread state inside a FakeGPU (plans of fake kernels),
    made once: ``tests/conftest.py`` fails a test that leaves one behind."""
    if not _FAKE_STATE:
        from rope_rtc.core import dispatch

        class FakeThreadState(dispatch.ThreadState):
            pass

        _FAKE_STATE.append(FakeThreadState)
    return _FAKE_STATE[0]


class FakeGPU:
    """Replaces only what needs a GPU, and records what would have been launched.

    Inside ``with FakeGPU() as gpu:`` the public APIs run their real host code down to the
    launch: the one-call functions' plan caches, the plans' validation, templates and argument
    blocks (rope_rtc.core.prepared). Replaced are the bottom layers alone:

    * the kernel loaders (``rope_plan.load_rope_functions``, ``load_fixed_function``,
      ``tail.load_tail_function``, ``qk_norm.load_norm_function``) return descriptive tuples/names instead of function handles;
      the specialised build serves the calls it fits only with ``FakeGPU(fixed=True)``;
    * every core's launcher is a recorder that appends ``{"fn", "grid", "block", "stream",
      "token", "thread", "params"}`` to ``gpu.launches`` (``params``: a copy of the general kernel's
      argument block, for ``rope_apply`` launches; ``fixed``: the specialised build's block and
      ``geometry`` its FixedGeometry, for ``rope_fixed`` launches; ``args``: the tail kernel's
      block, as bytes);
    * output allocation makes fake CuPy arrays, stream resolution returns the handle given (0
      for ``None``), and the one-call functions' per-thread plan caches start empty.

    An error raised inside a call therefore shows as an exception with ``gpu.launches``
    unchanged: that is how the tests prove a check runs before any launch. A plain context
    manager (not a pytest fixture) so that hypothesis tests can use it too.
    """

    def __init__(self, num_sms: int = 132, *, fixed: bool = False) -> None:
        self.num_sms = num_sms
        self.fixed = fixed  # whether the specialised build serves the calls it fits (rope_launch.USE_FIXED)
        self.launches: list[dict] = []
        self._saved: list[tuple[object, str, object]] = []
        # replay_allocations: the call whose outputs are being allocated, and how many it has had.
        self._replay: list = [None, 0]
        self._replayed: dict = {}

    def _patch(self, owner, name, value) -> None:
        current = _value_of(owner, name)
        _ORIGINALS.setdefault((owner, name), current)
        self._saved.append((owner, name, current))
        setattr(owner, name, value)

    def patch(self, owner, name, value) -> None:
        """Set ``owner.name`` for the rest of the context; restored when it exits, before its own
        patches. A test that changes inside the context something the context patched must use this,
        not ``monkeypatch``: monkeypatch would restore, after the test, the fake the context had set
        (``tests/conftest.py`` fails a test that leaves a fake behind)."""
        self._patch(owner, name, value)

    def replay_allocations(self, call) -> None:
        """From now on, the ``n``-th output allocated is at the address that the ``n``-th of an
        earlier ``replay_allocations(call)`` got (``None``: fresh addresses again), so that one
        call made twice launches the same argument block, allocated outputs and all."""
        self._replay[:] = [call, 0]

    def _allocate(self, shape, dtype, device):
        call, n = self._replay
        if call is None:
            return fake_cupy(tuple(shape), np.dtype(dtype), device=device)
        self._replay[1] = n + 1
        key = (call, n, tuple(shape), np.dtype(dtype), device)
        if key not in self._replayed:
            self._replayed[key] = fake_alloc(span_bytes(shape, c_strides(shape, np.dtype(dtype).itemsize),
                                                        np.dtype(dtype).itemsize) + 64)
        return fake_cupy(tuple(shape), np.dtype(dtype), device=device, ptr=self._replayed[key])

    def launcher(self, args_address: int, device: int) -> "_RecordingLauncher":
        return _RecordingLauncher(self, args_address)

    def __enter__(self) -> "FakeGPU":
        from rope_rtc.core import dispatch, driver, outputs, prepared
        from rope_rtc.core import launcher as launch

        FakeThreadState = fake_thread_state_type()
        from rope_rtc.ops import rope, rope_plan, tail

        def load_rope_functions(dtype, interleaved, vec, head_batch, device, pdl=False):
            from rope_rtc.build.registry import ROPE_ENTRIES

            return tuple((e, dtype, interleaved, vec, head_batch) + (("pdl",) if pdl else ()) for e in ROPE_ENTRIES)

        def load_tail_function(heads, dim, device):
            from rope_rtc.build.registry import tail_spec

            return tail_spec(heads, dim).entries[0]

        def allocate(shape, dtype, device, stream, current=False):
            return self._allocate(shape, dtype, device)

        def stream_handle(stream, device=None):  # the real checks of a given stream; 0 for the current one
            return 0 if stream is None else launch.stream_handle(stream, device)

        def load_fixed_function(g, device, pdl=False):
            return ("rope_fixed", g) + (("pdl",) if pdl else ())

        def load_cache_function(creq, device):
            return ("rope_cache", creq.without_arrays())  # a real entry point holds no caller's array either

        from rope_rtc.ops import kv_cache, mla

        self._patch(mla, "load_mla_function", lambda req, device: ("mla_rope_cache", req.without_arrays()))
        self._patch(mla, "stream_handle", stream_handle)
        self._patch(mla, "current_device", lambda: 0)
        self._patch(mla.ONE_CALL, "_local", FakeThreadState())
        self._patch(kv_cache, "load_cache_function", load_cache_function)
        self._patch(kv_cache, "stream_handle", stream_handle)
        self._patch(kv_cache, "current_device", lambda: 0)
        self._patch(kv_cache.ONE_CALL, "_local", FakeThreadState())
        self._patch(rope_plan, "load_rope_functions", load_rope_functions)
        self._patch(rope_plan, "load_fixed_function", load_fixed_function)
        from rope_rtc.ops import rope_launch

        self._patch(rope_launch, "USE_FIXED", self.fixed)
        self._patch(tail, "load_tail_function", load_tail_function)
        self._patch(prepared.Prepared, "_new_launcher", staticmethod(self.launcher))
        self._patch(outputs, "allocate", allocate)
        self._patch(rope, "stream_handle", stream_handle)
        self._patch(dispatch, "stream_handle", stream_handle)
        self._patch(dispatch, "CURRENT_STREAM", [lambda device: _CURRENT_STREAM_ZERO])  # the repeat path's lookup
        self._patch(rope, "CURRENT_STREAM", [lambda device: _CURRENT_STREAM_ZERO])
        self._patch(tail, "stream_handle", stream_handle)
        from rope_rtc.ops import mrope

        self._patch(mrope, "stream_handle", stream_handle)
        self._patch(mrope.ONE_CALL, "_local", FakeThreadState())
        from rope_rtc.ops import qk_norm

        self._patch(qk_norm, "load_norm_function", lambda g, device: ("qk_norm_rope", g))
        self._patch(qk_norm, "stream_handle", stream_handle)
        self._patch(qk_norm.ONE_CALL, "_local", FakeThreadState())
        import cupy

        from rope_rtc.core import backends

        self._patch(backends, "_gpu_present", True)
        self._patch(rope, "_gpu_present", True)
        self._patch(rope, "_NDARRAY", cupy.ndarray)
        self._patch(driver, "require_gpu", lambda: None)
        self._patch(rope.ONE_CALL, "_local", FakeThreadState())
        self._patch(rope.CONVENTION, "_local", FakeThreadState())
        self._patch(tail.ONE_CALL, "_local", FakeThreadState())
        self._patch(tail, "_gpu_present", False)  # the first call resolves the backend, as on a real GPU
        self._patch(rope_plan, "current_device", lambda: 0)
        self._patch(tail, "current_device", lambda: 0)
        return self

    def __exit__(self, *exc) -> bool:
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)
        return False


class _StreamZero:
    """The current stream under :class:`FakeGPU`: handle 0, as its ``stream_handle`` gives."""

    ptr = 0


_CURRENT_STREAM_ZERO = _StreamZero()


class _RecordingLauncher:
    """A core's launcher under :class:`FakeGPU`: records each launch with a copy of the block."""

    def __init__(self, gpu: FakeGPU, args_address: int) -> None:
        import ctypes

        self.gpu = gpu
        self.replay = True
        self.programmatic = False
        # Both argument kinds (StructArg, ArgPack) start with a pointer to the block.
        self._block = ctypes.c_void_p.from_address(args_address).value

    def __call__(self, prefix, stream=None, token=None) -> None:
        import ctypes
        import threading

        from rope_rtc.ops.rope_params import RopeParams

        fn = prefix[0]
        record = {"fn": fn, "grid": tuple(prefix[1:4]), "block": tuple(prefix[4:7]), "stream": stream,
                  "token": token, "thread": threading.get_ident(), "programmatic": self.programmatic}
        if isinstance(fn, tuple) and fn[0].startswith("rope_apply"):
            record["params"] = RopeParams.from_buffer_copy(ctypes.string_at(self._block, ctypes.sizeof(RopeParams)))
            record["vec"] = fn[3]
            record["itemsize"] = {"float32": 4, "float16": 2, "bfloat16": 2}[fn[1]]
        elif isinstance(fn, tuple) and fn[0] == "rope_cache":
            from rope_rtc.ops.rope_params import CacheParams

            record["cache"] = CacheParams.from_buffer_copy(ctypes.string_at(self._block, ctypes.sizeof(CacheParams)))
            record["request"] = fn[1]
        elif isinstance(fn, tuple) and fn[0] == "mla_rope_cache":
            from rope_rtc.ops.mla_request import MlaParams

            record["mla"] = MlaParams.from_buffer_copy(ctypes.string_at(self._block, ctypes.sizeof(MlaParams)))
            record["request"] = fn[1]
        elif isinstance(fn, tuple) and fn[0] == "qk_norm_rope":
            from rope_rtc.ops.rope_params import NormParams

            record["norm"] = NormParams.from_buffer_copy(ctypes.string_at(self._block, ctypes.sizeof(NormParams)))
            record["geometry"] = fn[1]
            record["vec"] = fn[1].vec
        elif isinstance(fn, tuple) and fn[0] == "rope_fixed":
            from rope_rtc.ops.rope_params import FixedParams

            record["fixed"] = FixedParams.from_buffer_copy(ctypes.string_at(self._block, ctypes.sizeof(FixedParams)))
            record["geometry"] = fn[1]
            record["vec"] = fn[1].vec
        elif isinstance(fn, str) and fn.startswith("tail_rope"):
            from rope_rtc.ops.tail import _ARGS

            record["args"] = ctypes.string_at(self._block, _ARGS.size)
        self.gpu.launches.append(record)

    def launch(self, prefix, handle) -> None:
        """The one-call functions' launch (no token), recorded the same way."""
        self(prefix, handle)

    def launch_on(self, prefix, stream=None) -> None:
        """A plan's launch of a block bound for one call (no token), recorded the same way."""
        self(prefix, stream)

    def forget(self) -> None:
        """No graphs to drop."""

    def launch_programmatically(self) -> None:
        """Later launches are recorded as programmatic (``Launcher.launch_programmatically``)."""
        self.programmatic = True
        self.replay = False


def rope_host_steps(req, num_sms: int = 132):
    """What the general API does on the host before a launch: ``(vec, params, grid, block)``."""
    from rope_rtc.ops import rope_launch
    from rope_rtc.ops.rope_params import RopeParams

    vec = rope_launch.choose_vector(req)
    params = RopeParams()
    rope_launch.fill_params(params, req, vec)
    grid, block = rope_launch.launch_shape(req, vec)
    return vec, params, tuple(grid), tuple(block)


def _np_dtype(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


def fake_like(shape, dtype, **kw):
    """A fake device array of any float dtype: ``__cuda_array_interface__`` where it can name the
    dtype, a fake CuPy array for bfloat16 (which the interface cannot name)."""
    dt = _np_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    if dt == BF16:
        return fake_cupy(shape, dt, **kw)
    if kw:
        raise TypeError("use FakeDeviceArray / fake_strided for options")
    return FakeDeviceArray(shape, dt)


def counted(monkeypatch, owner, name: str, counts: dict) -> None:
    """Replace ``owner.name`` with a wrapper that counts its calls in ``counts[name]``."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def launch_outcome(gpu: FakeGPU, call, describe) -> tuple:
    """What ``call()`` did under ``gpu``: ``describe(record)`` of each launch it made, or
    ``("error", type name, message)`` for the error it raised (what warm-against-cold tests compare)."""
    n = len(gpu.launches)
    try:
        call()
    except (TypeError, ValueError, NotImplementedError) as exc:
        return ("error", type(exc).__name__, str(exc))
    return tuple(describe(r) for r in gpu.launches[n:])


def in_a_fresh_thread(fn):
    """``fn()``'s result, run in a new thread: one whose thread-local caches (the one-call
    functions' plans and repeat paths) are empty. What it raises is raised here."""
    import threading

    box = []

    def run():
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box.append((False, exc))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def warm_and_cold(gpu: FakeGPU, calls, describe) -> tuple[list, list]:
    """Each of ``calls`` (functions of no argument) made in order in this thread (warm: its
    thread-local caches and repeat paths are those the calls before it left), then each again
    in a fresh thread (cold): the two lists of :func:`launch_outcome`. The outputs a call has
    allocated for it get the same addresses both times, so its argument blocks compare."""

    def outcome(i):
        gpu.replay_allocations(i)
        return launch_outcome(gpu, calls[i], describe)

    try:
        warm = [outcome(i) for i in range(len(calls))]
        cold = [in_a_fresh_thread(lambda: outcome(i)) for i in range(len(calls))]
    finally:
        gpu.replay_allocations(None)
    return warm, cold


class HostDLPack:
    """A host (CPU) array known only through DLPack, as a torch or JAX CPU tensor is: ``_a`` is
    the NumPy array it wraps."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class HostTensor(HostDLPack):
    """:class:`HostDLPack` with a shape, a dtype and ``reshape``, but no indexing."""

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)

    def reshape(self, *shape):
        return HostTensor(self._a.reshape(*shape))
