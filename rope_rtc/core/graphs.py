"""The CUDA graphs a :class:`~rope_rtc.core.launcher.Launcher` replays: one per argument set it
has launched before (per-token graphs, for the plans) and one per launch prefix whose kernel node
takes each new argument block (per-prefix graph nodes, for the one-call functions).

Made, updated, launched and dropped here; which launch takes a graph is the launcher's choice,
on its hot path. A graph that cannot be made, or a node that does not take a block, turns replay
off for that launcher (with a warning), and it launches with ``cuLaunchKernel`` from then on.
"""

from __future__ import annotations

import warnings

from ..errors import CudaError, caller_stacklevel
from . import driver
from .recent import remember

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


def _runtime_error_name(status: int) -> str:
    """The name of a CUDA runtime error code (``cudaErrorInvalidValue``), or the code."""
    try:
        from cuda.bindings import runtime

        return runtime.cudaError_t(int(status)).name
    except Exception:  # the name is a courtesy
        return f"cudaError {int(status)}"


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


class GraphReplay:
    """The graph state of a launcher and the graph work done off its hot path: making a graph,
    launching one, giving up on replay. Graphs are per stream: launches of one graph exec are
    ordered one after another whatever their streams, so one graph shared by two streams would
    make each wait for the other. The launcher that mixes it in holds the argument block
    (``args_address``) the graphs' nodes read."""

    __slots__ = ("_graph_launch", "_graphs", "_seen", "_set_node", "_updated", "_last_updated",
                 "_last_updated_stream", "replay", "_last_token", "_last_graph", "_last_graph_stream")

    def _init_graphs(self) -> None:
        import cupy

        from ..env import settings

        self._graph_launch = cupy.cuda.runtime.graphLaunch
        self._graphs: dict[tuple, _GraphExec] = {}  # (id(token), stream) -> its graph
        self._seen: dict[int, object] = {}        # id(token) -> token, launched plainly once
        self._last_token = self._last_graph = self._last_graph_stream = None  # the set replayed last
        self._set_node = driver._drv().cuGraphExecKernelNodeSetParams
        self._updated: dict[tuple, _GraphExec] = {}  # (id(prefix), stream) -> its graph, whose node takes each block
        self._last_updated = self._last_updated_stream = None
        self.replay = not settings().no_graph_replay

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
                      stacklevel=caller_stacklevel())

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
