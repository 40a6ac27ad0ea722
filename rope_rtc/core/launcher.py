"""Loading binaries onto devices once, and launching them with as little host work as possible.

The launch path does no disk access, no allocation on the device, no synchronisation and no
compilation. Arguments live in a pre-packed ctypes block whose fields are updated in place;
``cuLaunchKernel`` copies them at launch, so the block can be reused at once (also during CUDA
graph capture, which records the copied values). The :class:`Launcher` chooses, launch by launch,
between ``cuLaunchKernel`` and the replay of a graph; the graphs themselves are made, updated
and dropped in :mod:`rope_rtc.core.graphs`.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from ..build.kernels import Binary, get_binary
from ..build.registry import KernelSpec
from ..build.toolchain import target_for
from . import driver
from .graphs import GRAPH_NODE_THREADS, REPLAY_THREADS, GraphReplay, launch_threads
from .recent import recall, remember


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


# [cupy.cuda.get_current_stream] once CuPy is imported (None before): the one-call functions look the
# current stream up through it inline, as every repeated call does.
CURRENT_STREAM: list = [None]


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
        current = CURRENT_STREAM[0]
        if current is None:  # CuPy is imported on first use; the lookup is kept (it is on every call's path)
            current = CURRENT_STREAM[0] = driver.device_cupy().cuda.get_current_stream
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


def _visible_devices() -> int:
    """CUDA devices this process sees (0 when it cannot tell: the launcher then checks the
    current device on every launch)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


_SINGLE_DEVICE: list = []  # [whether this process sees exactly one device], once asked


def single_device() -> bool:
    """Whether this process sees exactly one CUDA device (asked once)."""
    if not _SINGLE_DEVICE:
        _SINGLE_DEVICE.append(_visible_devices() == 1)
    return _SINGLE_DEVICE[0]


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


def _programmatic_launch() -> tuple:
    """``(launch, error type)`` as :func:`_kernel_launch` gives, launching through
    ``cuLaunchKernelEx`` with programmatic stream serialization: the kernel may start before the
    kernel ahead of it on the stream has finished (a build that waits for its producer,
    ``ROPE_PDL``). Its launch configuration is made once and updated per launch."""
    drv = driver._drv()
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = drv.CUlaunchConfig()
    config.attrs = [attr]
    config.numAttrs = 1
    launch_ex, functions = drv.cuLaunchKernelEx, {}

    def launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        f = functions.get(fn)
        if f is None:
            f = functions[fn] = drv.CUfunction(fn)
        config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
        config.blockDimX, config.blockDimY, config.blockDimZ = bx, by, bz
        config.sharedMemBytes, config.hStream = shared, stream
        status = launch_ex(config, f, params, extra)[0]
        if status:
            raise _LaunchFailed(int(status))

    return launch, _LaunchFailed


class _LaunchFailed(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Launcher(GraphReplay):
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

    __slots__ = ("_launch", "_launch_error", "_launch_name", "_current_stream", "_get_device", "_capturing",
                 "args_address", "device", "_check_device", "_stream_device", "_prefix", "_handle", "_argv")

    def __init__(self, args_address: int, device: int | None = None) -> None:
        import cupy

        self._launch, self._launch_error = _kernel_launch()
        self._launch_name = "cuLaunchKernel"
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
        self._init_graphs()

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

    def launch_programmatically(self) -> None:
        """Launch every call with programmatic stream serialization (``cuLaunchKernelEx``), for a
        build that waits for its producer (``ROPE_PDL``): its launch overlaps the tail of the
        kernel before it on the stream. No graph replay: a kernel in a graph launched on its own
        cannot overlap the kernel before the graph; a capture records the launch with its
        programmatic edge."""
        self.replay = False
        self._launch, self._launch_error = _programmatic_launch()
        self._launch_name = "cuLaunchKernelEx"

    def _plain(self, argv: tuple, prefix: tuple, handle: int) -> None:
        try:
            self._launch(*argv)
        except self._launch_error as exc:
            status = getattr(exc, "status", None)
            if status is None:
                raise
            driver.check((driver._drv().CUresult(status),),
                         f"{self._launch_name}(grid={prefix[1:4]}, block={prefix[4:7]}, stream={handle:#x})")

    def _resolve(self, stream) -> int:
        if stream is None:
            return self._current_stream(self._stream_device).ptr
        return stream if type(stream) is int and 0 <= stream < HANDLE_LIMIT else stream_handle(stream, self.device)

    def _pack(self, prefix: tuple, handle: int) -> tuple:
        # Holding ``prefix`` keeps its identity from being reused while it is remembered.
        self._prefix, self._handle = prefix, handle
        self._argv = (int(prefix[0]), *prefix[1:], handle, self.args_address, 0)
        return self._argv
