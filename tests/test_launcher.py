"""The launcher's graph-replay decisions, on the CPU: the driver calls are replaced by recorders,
so what is checked is which launch path each call takes and when a graph is instantiated."""

from __future__ import annotations

import pytest

from rope_rtc.core import graphs, recent
from rope_rtc.core import launcher as L
from rope_rtc.errors import CudaError

PREFIX = (0xF00, 1, 1, 1, 256, 1, 1, 0)  # an int function handle, as CUfunction converts to


class FakeStream:
    def __init__(self, ptr: int = 7) -> None:
        self.ptr = ptr
        self.capturing = False
        self.fail = False

    def is_capturing(self) -> bool:
        if self.fail:
            raise RuntimeError("cudaErrorStreamCaptureImplicit")
        return self.capturing


@pytest.fixture
def rig(monkeypatch):
    """A launcher whose driver calls are recorded: ("plain", stream) / ("graph", token id, stream)."""
    pytest.importorskip("cupy")
    calls, made = [], []
    stream = FakeStream()
    launcher = L.Launcher(1234, device=0)
    launcher._get_device = lambda: 0
    launcher._current_stream = lambda device: stream
    launcher._capturing = lambda handle: stream.is_capturing()
    launcher._launch = lambda *argv: calls.append(("plain", argv[8]))

    class Exec:
        def __init__(self, token):
            self.token, self.handle_int = token, id(token)
            self.handle, self.node, self.params = ("exec", id(token)), "node", "params"

    def instantiate(self, prefix, token):
        made.append(id(token))
        return Exec(token)

    monkeypatch.setattr(L.Launcher, "_instantiate", instantiate)
    launcher._graph_launch = lambda handle, stream_ptr: calls.append(("graph", handle, stream_ptr))
    launcher._set_node = lambda handle, node, params: calls.append(("set", handle[1], node, params)) or (0,)
    launcher.replay = True
    return launcher, stream, calls, made


def test_second_launch_of_a_set_instantiates_then_replays(rig):
    launcher, stream, calls, made = rig
    token = ("argument set",)
    for _ in range(4):
        launcher(PREFIX, None, token)
    assert calls == [("plain", 7)] + [("graph", id(token), 7)] * 3
    assert made == [id(token)]


def test_a_plan_launch_of_many_threads_is_never_replayed(rig):
    """A launch of REPLAY_THREADS threads or more keeps cuLaunchKernel (its GPU time hides the
    host's, and a graph launch costs the GPU more); one just below replays as before."""
    launcher, stream, calls, made = rig
    big = (0xF00, graphs.REPLAY_THREADS // 256, 1, 1, 256, 1, 1, 0)
    token = ("big set",)
    for _ in range(4):
        launcher(big, None, token)
    assert calls == [("plain", 7)] * 4 and made == []
    calls.clear()
    edge = (0xF00, graphs.REPLAY_THREADS // 256 - 1, 1, 1, 256, 1, 1, 0)
    token = ("set below the bound",)
    for _ in range(3):
        launcher(edge, None, token)
    assert calls == [("plain", 7)] + [("graph", id(token), 7)] * 2 and len(made) == 1


def test_a_capturing_stream_always_gets_the_kernel_launch(rig):
    launcher, stream, calls, made = rig
    token = ("set",)
    launcher(PREFIX, None, token)
    launcher(PREFIX, None, token)  # graph made and replayed
    stream.capturing = True
    launcher(PREFIX, None, token)
    stream.capturing = False
    launcher(PREFIX, None, token)
    assert [c[0] for c in calls] == ["plain", "graph", "plain", "graph"]


def test_no_instantiation_while_capturing(rig):
    launcher, stream, calls, made = rig
    token = ("set",)
    launcher(PREFIX, None, token)
    stream.capturing = True
    launcher(PREFIX, None, token)
    assert made == [] and [c[0] for c in calls] == ["plain", "plain"]
    stream.capturing = False
    launcher(PREFIX, None, token)
    assert made == [id(token)] and calls[-1][0] == "graph"


def test_a_failing_capture_query_means_no_graph(rig):
    launcher, stream, calls, made = rig
    token = ("set",)
    stream.fail = True
    for _ in range(3):
        launcher(PREFIX, None, token)
    assert made == [] and [c[0] for c in calls] == ["plain"] * 3


def test_new_argument_sets_each_call_never_instantiate(rig):
    launcher, stream, calls, made = rig
    for step in range(40):  # a decode loop with a new scalar offset every step
        launcher(PREFIX, None, ("offset", step))
    assert made == [] and {c[0] for c in calls} == {"plain"}
    assert len(launcher._seen) <= recent.RECENT_SETS


def test_alternating_sets_each_get_a_graph_and_the_cache_is_bounded(rig):
    launcher, stream, calls, made = rig
    tokens = [("set", i) for i in range(recent.RECENT_SETS + 4)]
    for _ in range(2):
        for t in tokens[:2]:
            launcher(PREFIX, None, t)
    assert made == [id(tokens[0]), id(tokens[1])]
    for t in tokens:
        launcher(PREFIX, None, t)
        launcher(PREFIX, None, t)
    assert len(launcher._graphs) == recent.RECENT_SETS
    launcher.forget()
    assert not launcher._graphs and not launcher._seen


def test_a_set_launched_all_along_keeps_its_graph_while_others_come_and_go(rig):
    """The graph cache drops the least recently launched graph, not the oldest one: an engine's
    steady argument set, launched between ever new ones, is instantiated once."""
    launcher, stream, calls, made = rig
    hot = ("steady set",)
    others = [("passing set", i) for i in range(3 * recent.RECENT_SETS)]
    for other in others:
        launcher(PREFIX, None, hot)
        launcher(PREFIX, None, other)
        launcher(PREFIX, None, other)  # each passing set gets a graph too
    assert made.count(id(hot)) == 1
    assert len(launcher._graphs) == recent.RECENT_SETS


def test_one_call_graphs_are_dropped_least_recently_launched_first(rig):
    launcher, stream, calls, made = rig
    hot = (0xF01, 1, 1, 1, 256, 1, 1, 0)
    others = [(0xF02 + i, 1, 1, 1, 256, 1, 1, 0) for i in range(3 * recent.RECENT_SETS)]
    for other in others:
        launcher.launch(hot, 7)
        launcher.launch(other, 7)
    assert made.count(id(hot)) == 1
    assert len(launcher._updated) == recent.RECENT_SETS


def test_replay_off_never_instantiates(rig):
    launcher, stream, calls, made = rig
    launcher.replay = False
    token = ("set",)
    for _ in range(3):
        launcher(PREFIX, None, token)
    assert made == [] and [c[0] for c in calls] == ["plain"] * 3


def test_an_instantiation_failure_falls_back_to_plain_launches(rig, monkeypatch):
    launcher, stream, calls, made = rig

    def fail(self, prefix, token):
        raise CudaError("cuGraphInstantiate failed: CUDA_ERROR_OUT_OF_MEMORY", name="CUDA_ERROR_OUT_OF_MEMORY", code=2)

    other = ("set made before",)
    launcher(PREFIX, None, other)
    launcher(PREFIX, None, other)  # a graph, made while the driver could
    monkeypatch.setattr(L.Launcher, "_instantiate", fail)
    token = ("set",)
    launcher(PREFIX, None, token)
    with pytest.warns(RuntimeWarning, match="without graph replay") as w:
        launcher(PREFIX, None, token)
    assert w[0].filename == __file__
    launcher(PREFIX, None, token)
    launcher(PREFIX, None, other)
    assert [c[0] for c in calls] == ["plain", "graph"] + ["plain"] * 4 and launcher.replay is False
    assert not launcher._graphs and not launcher._seen  # nothing kept that will never replay


def test_an_explicit_stream_is_used_as_its_handle(rig):
    launcher, stream, calls, made = rig
    asked = []
    launcher._capturing = lambda handle: asked.append(handle) or False

    class Other:  # a non-CuPy stream object: the handle comes from __cuda_stream__
        def __cuda_stream__(self):
            return (0, 55)

    token, other = ("set",), Other()
    for s in (99, 99, 99, other, other):
        launcher(PREFIX, s, token)
    assert calls == [("plain", 99), ("graph", id(token), 99), ("graph", id(token), 99),
                     ("graph", id(token), 55), ("graph", id(token), 55)]
    assert asked == [99, 99, 55, 55]  # the capture query asks about the stream launched into


def test_a_failed_launch_raises_the_cuda_error_by_name(rig):
    launcher, stream, calls, made = rig

    class DriverError(Exception):
        def __init__(self, status):
            super().__init__(status)
            self.status = status

    def fail(*argv):
        raise DriverError(1)  # CUDA_ERROR_INVALID_VALUE

    launcher._launch, launcher._launch_error = fail, DriverError
    with pytest.raises(CudaError, match=r"cuLaunchKernel\(grid=\(1, 1, 1\).*CUDA_ERROR_INVALID_VALUE") as info:
        launcher(PREFIX, None)
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"


@pytest.mark.parametrize("visible,asks", [(1, False), (2, True), (0, True)])
def test_the_current_device_is_asked_only_when_it_can_differ(monkeypatch, visible, asks):
    """One visible device: the current device is the plan's, so a launch does not ask the runtime
    (0: the count is unknown, so it asks)."""
    pytest.importorskip("cupy")
    monkeypatch.setattr(L, "_visible_devices", lambda: visible)
    launcher = L.Launcher(1234, device=0)
    asked = []
    launcher._get_device = lambda: asked.append(1) or 0
    launcher._current_stream = lambda device: FakeStream()
    launcher._launch = lambda *argv: None
    launcher(PREFIX, None)
    assert bool(asked) is asks


# --- launch(): the one-call functions' launch, a new argument block every call ------------------


def test_one_call_launches_update_one_graph_per_prefix(rig):
    """Each launch writes the block's values into the prefix's graph node, then launches the
    graph; the graph is made once per prefix, on the first launch, and remembered (bounded)."""
    launcher, stream, calls, made = rig
    for _ in range(3):
        launcher.launch(PREFIX, 7)
    assert made == [id(PREFIX)]
    assert calls == [("set", id(PREFIX), "node", "params"), ("graph", id(PREFIX), 7)] * 3
    other = (0xBEE, 2, 1, 1, 128, 1, 1, 0)
    launcher.launch(other, 9)
    launcher.launch(PREFIX, 9)  # another stream: a graph of its own (below)
    assert made == [id(PREFIX), id(other), id(PREFIX)] and calls[-1] == ("graph", id(PREFIX), 9)
    prefixes = [(0xC00 + i, 1, 1, 1, 32, 1, 1, 0) for i in range(recent.RECENT_SETS + 3)]
    for p in prefixes:
        launcher.launch(p, 7)
    assert len(launcher._updated) == recent.RECENT_SETS
    launcher.forget()
    assert not launcher._updated and launcher._last_updated is None


def test_each_stream_gets_its_own_graph(rig):
    """Launches of one graph exec are ordered one after another whatever their streams: a graph
    shared by two streams made a launch on one wait for the other's queue. One-call launches and
    a plan's replayed sets alike get a graph per stream."""
    launcher, stream, calls, made = rig
    for handle in (7, 9, 7, 9):
        launcher.launch(PREFIX, handle)
    assert made == [id(PREFIX)] * 2 and len(launcher._updated) == 2
    assert set(launcher._updated) == {(id(PREFIX), 7), (id(PREFIX), 9)}
    token = ("argument set",)
    for handle in (7, 7, 9, 9, 7):
        launcher(PREFIX, handle, token)
    assert len(launcher._graphs) == 2 and set(launcher._graphs) == {(id(token), 7), (id(token), 9)}
    assert calls[-4:] == [("graph", id(token), 7), ("graph", id(token), 9), ("graph", id(token), 9),
                          ("graph", id(token), 7)]


def test_a_failed_graph_launch_raises_the_cuda_error_by_name(rig):
    """As a failed kernel launch does: a CudaError, not CuPy's own runtime error."""
    import cupy

    from rope_rtc.errors import CudaError

    launcher, stream, calls, made = rig

    def failing(handle, stream_ptr):
        raise cupy.cuda.runtime.CUDARuntimeError(1)  # cudaErrorInvalidValue

    launcher._graph_launch = failing
    with pytest.raises(CudaError, match="cudaGraphLaunch.*cudaErrorInvalidValue") as info:
        launcher.launch(PREFIX, 7)
    assert info.value.code == 1
    token = ("set",)
    launcher(PREFIX, 7, token)
    with pytest.raises(CudaError, match="cudaGraphLaunch"):
        launcher(PREFIX, 7, token)


def test_one_call_launches_into_a_capturing_stream_are_kernel_launches(rig):
    launcher, stream, calls, made = rig
    stream.capturing = True
    launcher.launch(PREFIX, 7)
    stream.capturing, stream.fail = False, True  # the query itself fails: no graph either
    launcher.launch(PREFIX, 7)
    assert calls == [("plain", 7), ("plain", 7)] and made == []


def test_one_call_launches_without_replay_are_kernel_launches(rig):
    launcher, stream, calls, made = rig
    launcher.replay = False
    launcher.launch(PREFIX, 7)
    assert calls == [("plain", 7)] and made == []


def test_a_failed_node_update_falls_back_to_plain_launches(rig):
    """A node that does not take the block is never launched; the call still runs (cuLaunchKernel),
    with a warning, and the launcher stops replaying, as when a graph cannot be instantiated."""
    from cuda.bindings import driver as drv

    launcher, stream, calls, made = rig
    launcher._set_node = lambda handle, node, params: (drv.CUresult.CUDA_ERROR_INVALID_VALUE,)
    with pytest.warns(RuntimeWarning, match=r"without graph replay.*cuGraphExecKernelNodeSetParams.*INVALID_VALUE") as w:
        launcher.launch(PREFIX, 7)
    assert w[0].filename == __file__  # the caller's line, not the launcher's
    assert calls == [("plain", 7)]  # nothing launched with a block it did not take
    launcher.launch(PREFIX, 7)
    launcher(PREFIX, None, ("set",))
    launcher(PREFIX, None, ("set",))
    assert [c[0] for c in calls] == ["plain"] * 4 and launcher.replay is False and not launcher._updated


def test_one_call_launches_of_many_threads_are_kernel_launches(rig):
    """A launch whose GPU time hides the host's (more than GRAPH_NODE_THREADS threads) takes
    cuLaunchKernel: no graph is made for it."""
    launcher, stream, calls, made = rig
    big = (0xF00, graphs.GRAPH_NODE_THREADS // 256 + 1, 1, 1, 256, 1, 1, 0)
    edge = (0xF00, graphs.GRAPH_NODE_THREADS // 256, 1, 1, 256, 1, 1, 0)
    launcher.launch(big, 7)
    launcher.launch(big, 7)
    assert calls == [("plain", 7), ("plain", 7)] and made == []
    launcher.launch(edge, 7)
    assert made == [id(edge)] and calls[-1] == ("graph", id(edge), 7)


def test_remembering_a_key_already_held_drops_no_other_entry():
    """A plan re-binds a remembered argument set whose arrays were reshaped in place under the same
    key: the cache keeps its other entries (before: a full cache dropped its oldest one, leaving
    15), and the key becomes the newest."""
    cache: dict = {}
    for i in range(recent.RECENT_SETS):
        recent.remember(cache, i, str(i))
    recent.remember(cache, 5, "again")
    assert len(cache) == recent.RECENT_SETS and 0 in cache and list(cache)[-1] == 5 and cache[5] == "again"
    recent.remember(cache, "new", "x")
    assert len(cache) == recent.RECENT_SETS and 0 not in cache and 1 in cache


@pytest.mark.parametrize("stream,exc,match", [
    (True, TypeError, "stream: expected None, an int handle.*got bool True"),
    (-5, ValueError, "stream: -5 is not a CUDA stream handle"),
    (2**64, ValueError, "is not a CUDA stream handle"),
    (1.0, TypeError, "stream: expected None"),
])
def test_a_stream_that_is_no_handle_is_refused(stream, exc, match):
    """The contract's "an optional stream is a raw CUDA stream handle": True was read as handle 1
    (the legacy default stream) and -5 reached the driver, after the output was allocated."""
    with pytest.raises(exc, match=match):
        L.stream_handle(stream, 0)


def test_numpy_integer_handles_are_handles():
    import numpy as np

    assert L.stream_handle(np.uint64(2**63), 0) == 2**63 and type(L.stream_handle(np.int64(7), 0)) is int


def test_a_bad_stream_is_refused_before_anything_is_allocated_or_launched():
    import numpy as np

    from fakes import BF16, FakeGPU, fake_cupy
    from rope_rtc import apply_rope_qk, tail_rope

    with FakeGPU(fixed=True) as gpu:
        q, k = fake_cupy((2, 1, 4, 64), BF16), fake_cupy((2, 1, 2, 64), BF16)
        cos, sin = fake_cupy((16, 32), np.float32), fake_cupy((16, 32), np.float32)
        for _ in range(3):  # the repeat path included
            with pytest.raises(TypeError, match="stream"):
                apply_rope_qk(q, k, cos, sin, q_out=q, k_out=k, stream=True)
            apply_rope_qk(q, k, cos, sin, q_out=q, k_out=k, layout="bshd")
        n = len(gpu.launches)
        x = fake_cupy((2, 8, 128), BF16)
        with pytest.raises(ValueError, match="stream: -5"):
            tail_rope(x, fake_cupy((2, 32), np.float32), fake_cupy((2, 32), np.float32), stream=-5)
        assert len(gpu.launches) == n


@pytest.mark.parametrize("folder", ["ops", "core", "build", "."])
def test_warnings_point_past_every_frame_of_the_package(folder):
    """A warning the launcher raises names the caller's line: the first frame outside rope_rtc,
    whichever of the package's folders the frames between come from (an op's module calls it)."""
    from pathlib import Path

    where = Path(L.__file__).resolve().parents[1] / folder / "caller.py"
    from rope_rtc.errors import caller_stacklevel

    namespace = {"caller_stacklevel": caller_stacklevel}
    exec(compile("def inside():\n    return caller_stacklevel()\n", str(where), "exec"), namespace)
    assert namespace["inside"]() == 2  # 1 is the package's frame, 2 this test's
