"""Loading binaries onto devices once, and launching them with as little host work as possible.

The launch path does no disk access, no allocation on the device, no synchronisation and no
compilation. Arguments live in a pre-packed ctypes block whose fields are updated in place;
``cuLaunchKernel`` copies them at launch, so the block can be reused at once (also during CUDA
graph capture, which records the copied values).
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
import warnings
import weakref

import numpy as np

from ..build.kernels import Binary, get_binary
from ..build.registry import KernelSpec
from ..build.toolchain import target_for
from ..errors import CudaError
from . import driver


class ArgPack:
    """Kernel arguments in one ctypes struct plus the ``void*[]`` that points at its fields."""

    def __init__(self, ctypes_fields: list[tuple[str, type]]) -> None:
        cls = type("Args", (ctypes.Structure,), {"_fields_": ctypes_fields})
        self.values = cls()
        base = ctypes.addressof(self.values)
        self._ptrs = (ctypes.c_void_p * len(ctypes_fields))(
            *(base + getattr(cls, name).offset for name, _ in ctypes_fields)
        )
        self.address = ctypes.addressof(self._ptrs)


class StructArg:
    """A kernel whose single parameter is a by-value struct (``rope_apply``)."""

    def __init__(self, struct_type: type[ctypes.Structure]) -> None:
        self.values = struct_type()
        self._ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(self.values))
        self.address = ctypes.addressof(self._ptrs)


class LoadedKernel:
    """One spec's binary, loaded once per device, with its entry points' function handles."""

    def __init__(self, spec: KernelSpec, device: int, binary: Binary) -> None:
        self.spec = spec
        self.device = device
        self.binary = binary
        module = driver.load_module(device, binary.data)
        self._module = module  # keeps the module alive with the functions
        self.functions = {name: driver.get_function(module, name) for name in spec.entries}


_loaded: dict[tuple[str, int], LoadedKernel] = {}
_loaded_lock = threading.Lock()


def load_kernel(spec: KernelSpec, device: int) -> LoadedKernel:
    """Compile or fetch from the cache, load into ``device``'s primary context; once per device.

    Thread-safe: the table is guarded, and a second thread asking for the same kernel waits for
    the first instead of loading it twice.
    """
    ident = (spec.name, device)
    k = _loaded.get(ident)
    if k is not None:
        return k
    with _loaded_lock:
        k = _loaded.get(ident)
        if k is None:
            driver.require_gpu()  # no driver: say so, and what to do, before the driver is asked for the device
            target = target_for(driver.device_arch(device), driver_version=driver.driver_version())
            k = LoadedKernel(spec, device, get_binary(spec, target))
            _loaded[ident] = k
        return k


def loaded_kernels() -> list[tuple[str, int]]:
    return sorted(_loaded)


_CURRENT_STREAM: list = [None]  # cupy.cuda.get_current_stream, once CuPy is imported


# A raw CUstream is a pointer: 0 (the legacy default stream), the per-thread default stream's 2,
# or an address.
HANDLE_LIMIT = 2**64


def stream_handle(stream, device: int | None = None) -> int:
    """A raw CUstream from ``stream``.

    ``None``: CuPy's current stream (of ``device`` when given); a CuPy stream (``.ptr``); any
    object with ``__cuda_stream__`` (returns ``(version, handle)``); a PyTorch stream
    (``.cuda_stream``); or an integer handle (a non-negative pointer-sized int, NumPy's included;
    a bool is refused, not read as handle 1).
    """
    if stream is None:
        current = _CURRENT_STREAM[0]
        if current is None:  # CuPy is imported on first use; the lookup is kept (it is on every call's path)
            current = _CURRENT_STREAM[0] = driver.device_cupy().cuda.get_current_stream
        return current(-1 if device is None else device).ptr
    if type(stream) is int and 0 <= stream < HANDLE_LIMIT:
        return stream
    if isinstance(stream, (bool, np.bool_)):
        raise TypeError(f"stream: expected None, an int handle, a CuPy stream or an object with __cuda_stream__, got "
                        f"{type(stream).__name__} {stream!r}")
    if isinstance(stream, (int, np.integer)):
        if not 0 <= int(stream) < HANDLE_LIMIT:
            raise ValueError(f"stream: {int(stream)} is not a CUDA stream handle (a raw handle is a non-negative "
                             "pointer-sized int; 0 is the legacy default stream)")
        return int(stream)
    ptr = getattr(stream, "ptr", None)
    if isinstance(ptr, int):
        return ptr
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        return int(value[1])
    raw = getattr(stream, "cuda_stream", None)
    if isinstance(raw, int):
        return raw
    raise TypeError(
        f"stream: expected None, an int handle, a CuPy stream or an object with __cuda_stream__, got {type(stream).__name__}"
    )


# Argument sets a plan remembers by identity (rope_rtc.core.prepared), and graphs a launcher keeps:
# engines cycle through a few buffers (per layer, per double-buffered step).
RECENT_SETS = 16

# Launcher.launch takes a graph node for launches of at most this many threads (decode-sized:
# the host's cost is the call's cost); larger ones, whose GPU time hides the host's, take
# cuLaunchKernel, which keeps one-call prefill level with the plan's (the node made it slower on
# mid-sized launches; docs/design.md, "Launcher").
GRAPH_NODE_THREADS = 1 << 16

# A plan's argument set is replayed from a graph only for launches of fewer than this many
# threads. A graph launch costs the GPU a little more than a kernel launched into the stream,
# which shows on mid-sized launches. From 2^20 threads a launch moves 32 MB or more, whose GPU
# time hides cuLaunchKernel's host time; below, a loop of launches can be host-bound, and replay
# keeps the host's share small (docs/design.md, "Launcher").
REPLAY_THREADS = 1 << 20


def launch_threads(prefix: tuple) -> int:
    """Threads of a launch prefix ``(function, gx, gy, gz, bx, by, bz, shared_bytes)``."""
    return prefix[1] * prefix[2] * prefix[3] * prefix[4] * prefix[5] * prefix[6]


def remember(cache: dict, key, value, limit: int = RECENT_SETS) -> None:
    """Store ``key`` in a bounded cache as its newest entry, dropping the first entry (the oldest,
    or with ``recall`` the least recently used) when a new key finds it full."""
    if cache.pop(key, None) is None and len(cache) >= limit:
        del cache[next(iter(cache))]
    cache[key] = value


def recall(cache: dict, key):
    """``cache[key]`` (None when absent), moved to the newest end: caches that ``remember`` fills
    and ``recall`` reads evict the least recently used entry, so a set launched all along keeps
    its graph while others come and go."""
    value = cache.pop(key, None)
    if value is not None:
        cache[key] = value
    return value


# The package's folder (this module is in its core/ folder): every module of rope_rtc is under it.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning raised here at the caller's line: the first frame
    outside rope_rtc (a plan's ``execute`` or a one-call function reaches the launcher through a
    different number of the package's frames)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def _kernel_launch() -> tuple:
    """``(launch, error type)``: ``launch(function, gx, gy, gz, bx, by, bz, shared_bytes, stream,
    kernel_params, extra)`` with every argument a plain integer, raising ``error type`` (with a
    ``status``) on failure.

    CuPy's own binding of ``cuLaunchKernel`` takes plain integers and costs the host a fraction
    of cuda.bindings' (which converts a handle object and an argument list on every call); the
    argument block is the same pre-packed ``void*[]`` either way. cuda.bindings serves when CuPy
    does not ship that binding."""
    try:
        from cupy_backends.cuda.api.driver import CUDADriverError, launchKernel

        return launchKernel, CUDADriverError
    except ImportError:  # pragma: no cover - every CuPy we support has it
        from cuda.bindings import driver as drv

        def launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            status = drv.cuLaunchKernel(drv.CUfunction(fn), gx, gy, gz, bx, by, bz, shared, drv.CUstream(stream),
                                        params, extra)[0]
            if status:
                raise _LaunchFailed(int(status))

        return launch, _LaunchFailed


def _runtime_error_name(status: int) -> str:
    """The name of a CUDA runtime error code (``cudaErrorInvalidValue``), or the code."""
    try:
        from cuda.bindings import runtime

        return runtime.cudaError_t(int(status)).name
    except Exception:  # the name is a courtesy
        return f"cudaError {int(status)}"


class _LaunchFailed(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _GraphExec:
    """One instantiated one-kernel-node CUDA graph; destroyed with the object. ``node`` and
    ``params``: its kernel node and the node parameters it was made with (the argument block's
    address), for ``cuGraphExecKernelNodeSetParams``."""

    __slots__ = ("handle", "handle_int", "token", "graph", "node", "params")

    def __init__(self, handle, token, graph, node, params) -> None:
        self.handle = handle
        self.handle_int = int(handle)
        self.token = token  # the plan's argument-set tuple, or the launch prefix: held, so its identity stays unique
        # The graph it was instantiated from is kept: node updates name its node.
        self.graph, self.node, self.params = graph, node, params

    def __del__(self) -> None:
        try:
            with driver.relaxed_capture():
                drv = driver._drv()
                driver.check(drv.cuGraphExecDestroy(self.handle), "cuGraphExecDestroy")
                driver.check(drv.cuGraphDestroy(self.graph), "cuGraphDestroy")
        except Exception:  # at interpreter exit the driver may already be gone
            pass


class Launcher:
    """The hot path of the plans: one launch of pre-packed arguments with a checked status.

    ``prefix`` is the prepared ``(function, gx, gy, gz, bx, by, bz, shared_bytes)`` of a plan. The
    launcher resolves the stream (``None``: CuPy's current stream of its device) and keeps the
    whole ``cuLaunchKernel`` argument tuple of its last launch. A plan with a device launches in
    that device's context whichever device is current.

    Graph replay: a plan passes ``token``, an object whose identity changes whenever the
    argument block's values change (a plan's :class:`~rope_rtc.core.prepared.Call`). The second launch of a token
    (among the last ``RECENT_SETS``) instantiates the launch once as a one-kernel-node CUDA
    graph; that launch and later ones of the token replay it, because ``cudaGraphLaunch`` of a
    one-node graph costs the host less than ``cuLaunchKernel`` (the benchmark's host section
    measures both; docs/design.md). A graph
    cannot be launched into a stream that is being captured, so a capturing stream always gets
    ``cuLaunchKernel`` (which the capture records), and so does a launch of ``REPLAY_THREADS``
    threads or more (its GPU time hides the host's, and a graph launch costs the GPU more). ``RECENT_SETS`` graphs at most, the
    least recently launched dropped first.
    """

    __slots__ = ("_launch", "_launch_error", "_current_stream", "_get_device", "_capturing", "args_address",
                 "device", "_check_device", "_stream_device", "_prefix", "_handle", "_argv", "_graph_launch",
                 "_graphs", "_seen", "_set_node", "_updated", "_last_updated", "_last_updated_stream",
                 "replay", "_last_token", "_last_graph", "_last_graph_stream")

    def __init__(self, args_address: int, device: int | None = None) -> None:
        import cupy

        from ..env import settings

        self._launch, self._launch_error = _kernel_launch()
        self._graph_launch = cupy.cuda.runtime.graphLaunch
        self._current_stream = cupy.cuda.get_current_stream
        self._get_device = cupy.cuda.runtime.getDevice
        # CuPy's binding of cudaStreamIsCapturing takes any raw handle and costs the host about
        # half of cuStreamIsCapturing through cuda.bindings; it raises for an invalidated capture.
        self._capturing = cupy.cuda.runtime.streamIsCapturing
        self.args_address = args_address
        self.device = device
        # With one visible device the current device is always the plan's: no need to ask the
        # runtime on every launch (a measurable part of a launch's host time).
        self._check_device = device is not None and _visible_devices() != 1
        self._stream_device = -1 if device is None else device
        self._prefix = self._handle = self._argv = None
        # Graphs are per stream: launches of one graph exec are ordered one after another whatever
        # their streams, so one graph shared by two streams would make each wait for the other.
        self._graphs: dict[tuple, _GraphExec] = {}  # (id(token), stream) -> its graph
        self._seen: dict[int, object] = {}        # id(token) -> token, launched plainly once
        self._last_token = self._last_graph = self._last_graph_stream = None  # the set replayed last
        self._set_node = driver._drv().cuGraphExecKernelNodeSetParams
        self._updated: dict[tuple, _GraphExec] = {}  # (id(prefix), stream) -> its graph, whose node takes each block
        self._last_updated = self._last_updated_stream = None
        self.replay = not settings().no_graph_replay

    def __call__(self, prefix: tuple, stream=None, token=None) -> None:
        device = self.device
        if self._check_device and self._get_device() != device:
            # A plan stays on its device when the caller's current device changes: launch in
            # the plan device's context (the stream must belong to that device too).
            with driver.in_context(device):
                handle = self._resolve(stream)
                self._plain(self._pack(prefix, handle), prefix, handle)
            return
        handle = self._current_stream(self._stream_device).ptr if stream is None else self._resolve(stream)
        if token is not None and self.replay:
            # The hot path: the set launched last time, whose graph is at hand without a lookup.
            graph = (self._last_graph if token is self._last_token and handle == self._last_graph_stream
                     else recall(self._graphs, (id(token), handle)))
            if graph is not None or id(token) in self._seen:
                try:
                    idle = not self._capturing(handle)
                except Exception:  # the legacy stream while another stream captures; an invalidated capture
                    idle = False
                if idle:  # never launch a graph into a capturing stream: that invalidates the capture
                    if graph is None:
                        graph = self._instantiate_or_stop(prefix, token, self._graphs, (id(token), handle))
                    if graph is not None:
                        self._last_token, self._last_graph, self._last_graph_stream = token, graph, handle
                        self._launch_graph(graph, handle, prefix)
                        return
            if self.replay and launch_threads(prefix) < REPLAY_THREADS:  # a larger set is never seen, never replayed
                remember(self._seen, id(token), token)
        argv = self._argv
        if prefix is not self._prefix or handle != self._handle:
            argv = self._pack(prefix, handle)
        self._plain(argv, prefix, handle)

    def launch(self, prefix: tuple, handle: int) -> None:
        """One launch of ``prefix`` with the argument block's current values on the raw stream
        ``handle``: the one-call functions' launch (their block is new on every call).

        With graph replay on, a launch of at most ``GRAPH_NODE_THREADS`` threads goes through one
        one-node graph per prefix and stream (launches of one graph exec wait for each other
        whatever their streams): its node takes the block's values
        (``cuGraphExecKernelNodeSetParams``, which copies them) and the graph is launched. The two
        calls cost the host less than one ``cuLaunchKernel`` (``benchmarks/probes/one_call_cost.py``
        times both). A capturing stream, and a larger launch, get ``cuLaunchKernel`` (which a
        capture records)."""
        if self._check_device and self._get_device() != self.device:
            self(prefix, handle)
            return
        if self.replay:
            graph = self._last_updated
            if graph is None or graph.token is not prefix or handle != self._last_updated_stream:
                graph = recall(self._updated, (id(prefix), handle))
            if graph is not None or launch_threads(prefix) <= GRAPH_NODE_THREADS:
                try:
                    idle = not self._capturing(handle)
                except Exception:  # the legacy stream while another stream captures; an invalidated capture
                    idle = False
                if idle:
                    if graph is None:
                        graph = self._instantiate_or_stop(prefix, prefix, self._updated, (id(prefix), handle))
                    if graph is not None:
                        status = self._set_node(graph.handle, graph.node, graph.params)[0]
                        if not status:
                            self._last_updated, self._last_updated_stream = graph, handle
                            self._launch_graph(graph, handle, prefix)
                            return
                        self._stop_updating(prefix, status)
        argv = self._argv
        if prefix is not self._prefix or handle != self._handle:
            argv = self._pack(prefix, handle)
        self._plain(argv, prefix, handle)

    def launch_on(self, prefix: tuple, stream=None) -> None:
        """``launch`` on ``stream`` as a plan's ``execute`` takes it (None: the current stream of
        the plan's device; a CuPy stream or a raw handle): a plan's launch of a block written for
        one call and not remembered (``Prepared.execute``)."""
        if self._check_device and self._get_device() != self.device:
            self(prefix, stream)
            return
        self.launch(prefix, self._current_stream(self._stream_device).ptr if stream is None else self._resolve(stream))

    def _stop_updating(self, prefix: tuple, status) -> None:
        """A node that did not take the block (``status``): its graph is never launched with
        values it does not hold. As when a graph cannot be instantiated, this launcher stops
        replaying and launches plainly, so the call still succeeds; an error that is the
        context's (a kernel fault) then surfaces from ``cuLaunchKernel``."""
        try:
            driver.check((status,), f"cuGraphExecKernelNodeSetParams(grid={prefix[1:4]}, block={prefix[4:7]})")
        except CudaError as exc:
            self._stop_replay(exc)

    def _stop_replay(self, exc: CudaError) -> None:
        """Launch plainly from now on, after the driver could not make or update a graph (``exc``):
        the graphs and the tokens' arrays, never replayed again, go now."""
        self.forget()
        self.replay = False
        warnings.warn(f"rope_rtc: launching without graph replay from now on: {exc}", RuntimeWarning,
                      stacklevel=_caller_level())

    def _plain(self, argv: tuple, prefix: tuple, handle: int) -> None:
        try:
            self._launch(*argv)
        except self._launch_error as exc:
            status = getattr(exc, "status", None)
            if status is None:
                raise
            driver.check((driver._drv().CUresult(status),),
                         f"cuLaunchKernel(grid={prefix[1:4]}, block={prefix[4:7]}, stream={handle:#x})")

    def _resolve(self, stream) -> int:
        if stream is None:
            return self._current_stream(self._stream_device).ptr
        return stream if type(stream) is int and 0 <= stream < HANDLE_LIMIT else stream_handle(stream, self.device)

    def _pack(self, prefix: tuple, handle: int) -> tuple:
        # Holding ``prefix`` keeps its identity from being reused while it is remembered.
        self._prefix, self._handle = prefix, handle
        self._argv = (int(prefix[0]), *prefix[1:], handle, self.args_address, 0)
        return self._argv

    def _launch_graph(self, graph, handle: int, prefix: tuple) -> None:
        """``cudaGraphLaunch`` of ``graph`` on ``handle``; a failure is a CudaError, as a plain
        launch's is (CuPy's binding raises its own error type)."""
        try:
            self._graph_launch(graph.handle_int, handle)
        except Exception as exc:
            status = getattr(exc, "status", None)
            if status is None:
                raise
            name = _runtime_error_name(status)
            raise CudaError(f"cudaGraphLaunch(grid={prefix[1:4]}, block={prefix[4:7]}, stream={handle:#x}) failed: "
                            f"{name} ({exc})", name=name, code=int(status)) from exc

    def _instantiate_or_stop(self, prefix: tuple, token, graphs: dict, key: tuple) -> "_GraphExec | None":
        """A graph for ``token``, remembered in ``graphs`` under ``key``; if the driver cannot
        make one (out of resources, say), this launcher stops replaying and launches plainly,
        so the call still succeeds."""
        try:
            exe = self._instantiate(prefix, token)
        except CudaError as exc:
            self._stop_replay(exc)
            return None
        remember(graphs, key, exe)
        return exe

    def _instantiate(self, prefix: tuple, token) -> _GraphExec:
        """The launch of ``prefix`` with the argument block's current values, as an executable
        one-node graph (the node copies the values)."""
        drv = driver._drv()
        params = drv.CUDA_KERNEL_NODE_PARAMS()
        params.func = prefix[0]
        params.gridDimX, params.gridDimY, params.gridDimZ = prefix[1:4]
        params.blockDimX, params.blockDimY, params.blockDimZ = prefix[4:7]
        params.sharedMemBytes = prefix[7]
        params.kernelParams = self.args_address
        with driver.relaxed_capture():  # legal while another stream of this thread is capturing
            graph = driver.check(drv.cuGraphCreate(0), "cuGraphCreate")
            try:
                node = driver.check(drv.cuGraphAddKernelNode(graph, None, 0, params), "cuGraphAddKernelNode")
                handle = driver.check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
            except BaseException:
                drv.cuGraphDestroy(graph)
                raise
        return _GraphExec(handle, token, graph, node, params)

    def forget(self) -> None:
        """Drop every graph and remembered token (and with them the arrays the tokens hold)."""
        self._graphs.clear()
        self._seen.clear()
        self._updated.clear()
        self._last_token = self._last_graph = self._last_updated = None


def _visible_devices() -> int:
    """CUDA devices this process sees (0 when it cannot tell: the launcher then checks the
    current device on every launch)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def launch_prefix(function, grid: tuple[int, int, int], block: tuple[int, int, int]) -> tuple:
    return (function, grid[0], grid[1], grid[2], block[0], block[1], block[2], 0)


class _StreamHandle:
    """A raw CUstream handle in the CUDA stream protocol (what ``cupy.cuda.Stream.from_external``
    takes)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def cupy_stream(handle: int):
    """A CuPy stream object for the raw handle ``handle`` (to order CuPy's own work on it)."""
    import cupy

    if handle == cupy.cuda.get_current_stream().ptr:
        return cupy.cuda.get_current_stream()
    return cupy.cuda.Stream.from_external(_StreamHandle(handle))


def allocate(shape: tuple, dtype, device: int, stream: int, current: bool = False):
    """A C-contiguous CuPy array on ``device`` for an output that a one-call function allocates,
    in the order of raw stream ``stream`` (CuPy's pool reuses memory in the order of the stream it
    was allocated on). ``current``: ``stream`` is the current stream of ``device`` (the caller
    passed no stream); with one visible device that is the common case, and CuPy's own defaults
    already say it.

    Small outputs from CuPy's default memory pool are recycled: the thread keeps the last outputs
    of each (shape, dtype, device, stream), and an output whose array, memory pointer and memory
    nothing but this cache references (no view, no alias made from its pointer, no weak
    reference) is handed out again instead of a new one. That is the reuse the pool would make of
    the same memory once it is freed (in the order of the same stream), without the pool's
    allocation, array construction and free, a large share of an allocating call's host time
    (``benchmarks/probes/one_call_cost.py`` times ``cupy.empty``). The default pool lives as long
    as the process, so a kept output's
    memory stays valid; under any other allocator (``set_allocator``, ``using_allocator``: a pool
    of the caller's that may be freed, or plain ``cudaMalloc``) nothing is kept.
    :func:`release_outputs` drops the calling thread's."""
    if not _EMPTY:
        _import_empty()
    _, get_allocator, _, default_pool = _EMPTY[0]
    # The thread's last key first (an engine allocates one signature's outputs call after call):
    # hashing a key with a dtype in it is a good part of a recycled output's cost.
    last = getattr(_recycled, "last", _NO_KEY)
    if (shape == last.shape and dtype is last.dtype and device == last.device and stream == last.stream
            and _FREE is not None):
        slot = last.slot
    else:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > RECYCLE_BYTES or not nbytes or _FREE is None:
            return _new_array(shape, dtype, device, stream, current)
        slot = None
    if getattr(get_allocator(), "__self__", None) is not default_pool:
        return _new_array(shape, dtype, device, stream, current)
    if slot is None:
        key = (shape, dtype, device, stream)
        try:
            kept = _recycled.by_key
        except AttributeError:
            kept = _recycled.by_key = {}
        slot = kept.get(key)
        if slot is None:
            arr = _new_array(shape, dtype, device, stream, current)
            remember(kept, key, [arr], RECYCLE_KEYS)
            _recycled.last = _LastKey(shape, dtype, device, stream, kept[key])
            return arr
        _recycled.last = _LastKey(shape, dtype, device, stream, slot)
    i = _idle(slot, _FREE)
    while i >= 0:
        arr = slot[i]
        # The caller may have reshaped it in place (``a.shape = ...``) before letting it go:
        # dropped by position (``list.remove`` would compare arrays with ``==``, elementwise).
        if arr.shape == shape and arr._c_contiguous and (arr.dtype is dtype or arr.dtype == dtype):
            return arr
        del slot[i], arr
        i = _idle(slot, _FREE)
    arr = _new_array(shape, dtype, device, stream, current)
    if len(slot) >= RECYCLE_PER_KEY:
        del slot[0]
    slot.append(arr)
    return arr


# Outputs of at most this many bytes are recycled (``allocate``): the sizes whose GPU time is
# shorter than the host time an allocation costs. Each thread keeps at most RECYCLE_PER_KEY
# outputs for each of RECYCLE_KEYS signatures: 32 MiB at most.
RECYCLE_BYTES = 1 << 20
RECYCLE_KEYS = 8
# A loop that rebinds its results (``q, k = apply_rope_qk(...)``) still holds the last call's
# outputs when it makes the next call; q_out and k_out of equal shapes share a key: four.
RECYCLE_PER_KEY = 4
_recycled = threading.local()


class _LastKey:
    """A thread's last recycling key and its slot (the list of outputs kept for it)."""

    __slots__ = ("shape", "dtype", "device", "stream", "slot")

    def __init__(self, shape, dtype, device, stream, slot) -> None:
        self.shape, self.dtype, self.device, self.stream, self.slot = shape, dtype, device, stream, slot


# Before a thread's first key: no key.
_NO_KEY = _LastKey(None, None, None, None, None)


def release_outputs() -> None:
    """Drop the outputs the calling thread keeps for recycling (see :func:`allocate`), so that
    their memory goes back to CuPy's pool once nothing else references them."""
    _recycled.__dict__.clear()


def _idle(slot: list, free: tuple | None):
    """The position in ``slot`` of the first array that nothing but ``slot`` references, or -1.

    ``free`` is the reference counts of such an array, its memory pointer and its memory, and
    its weak references, as read here (measured once on this interpreter through this same
    function: ``_calibrate``); None returns the first array's counts instead."""
    for i in range(len(slot)):
        arr = slot[i]
        # What keeps an output's memory in use is any of these: a view holds the array, an alias
        # built on ``a.data`` (``as_strided``) the pointer, a pointer offset from it the memory.
        data = arr.data
        counts = _getrefcount(arr), _getrefcount(data), _getrefcount(data.mem), _getweakrefcount(arr)
        if free is None:
            return counts
        if counts == free:
            return i
    return -1


def _calibrate() -> tuple | None:
    """``_idle``'s counts of an array that only its slot holds, or None (no recycling) where
    reference counts cannot say that: a free-threaded build, or an interpreter on which an array,
    pointer or memory that something else still holds would pass for free."""
    import sysconfig

    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None

    class Probe:
        pass

    def probe():
        arr, arr.data, arr.data.mem = Probe(), Probe(), Probe()
        return arr

    slot = [probe()]
    free = _idle(slot, None)
    for hold in (lambda a: a, lambda a: a.data, lambda a: a.data.mem, weakref.ref):
        held = hold(slot[0])
        if _idle(slot, free) >= 0:
            return None
        del held
    return free if _idle(slot, free) == 0 else None


_getrefcount = sys.getrefcount
_getweakrefcount = weakref.getweakrefcount
_FREE = _calibrate()


def _new_array(shape: tuple, dtype, device: int, stream: int, current: bool):
    if current and single_device():
        return empty(shape, dtype)
    import cupy

    if cupy.cuda.runtime.getDevice() == device and stream == cupy.cuda.get_current_stream().ptr:
        return empty(shape, dtype)  # the current device and stream, without switching either
    with cupy.cuda.Device(device):
        if stream == cupy.cuda.get_current_stream().ptr:
            return empty(shape, dtype)
        with cupy_stream(stream):
            return empty(shape, dtype)


# (cupy.ndarray, cupy.cuda.get_allocator, cupy.empty, CuPy's default memory pool), once CuPy is imported
_EMPTY: list = []


def _import_empty() -> None:
    cupy = driver.device_cupy()

    _EMPTY.append((cupy.ndarray, cupy.cuda.get_allocator, cupy.empty, cupy.get_default_memory_pool()))


def empty(shape: tuple, dtype):
    """``cupy.empty(shape, dtype)`` on the current device and stream, from the current allocator
    (``cupy.cuda.get_allocator()``: the default pool, or what the caller set with
    ``cupy.cuda.set_allocator`` / ``using_allocator``), without ``cupy.empty``'s Python layer:
    the allocator's memory wrapped as a C-contiguous array, cheaper on the host than
    ``cupy.empty``; an empty shape takes ``cupy.empty`` itself."""
    if not _EMPTY:
        _import_empty()
    nd, get_allocator, cupy_empty, _ = _EMPTY[0]
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return cupy_empty(shape, dtype)
    return nd(shape, dtype, get_allocator()(nbytes))


_SINGLE_DEVICE: list = []  # [whether this process sees exactly one device], once asked


def single_device() -> bool:
    """Whether this process sees exactly one CUDA device (asked once)."""
    if not _SINGLE_DEVICE:
        _SINGLE_DEVICE.append(_visible_devices() == 1)
    return _SINGLE_DEVICE[0]
