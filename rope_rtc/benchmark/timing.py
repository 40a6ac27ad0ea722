"""Timing: round-robin rotation over buffer sets, the CUDA-event / host-timer :class:`Clock`
with adaptive call counts, and CUDA-graph capture through CuPy or torch."""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from functools import partial

from .device_state import summarize


# =============================================================================================
# timing


class Rotation:
    """Callables taken round-robin, continuing where the last batch stopped (so a cold rotation
    never restarts on a set that may still be in L2)."""

    def __init__(self, fns: list) -> None:
        self.fns = fns
        self.pos = 0

    def take(self, k: int) -> list:
        n = len(self.fns)
        out = [self.fns[(self.pos + i) % n] for i in range(k)]
        self.pos = (self.pos + k) % n
        return out


@contextlib.contextmanager
def _no_gc():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Clock:
    """CUDA events and host timers on one stream, with adaptive call counts."""

    def __init__(self, cp, stream, quick: bool) -> None:
        self.cp = cp
        self.stream = stream
        self.reps = 7 if quick else 15
        self.warmup = 10 if quick else 50
        self.sample_s = 1e-3 if quick else 2e-3       # aim: each sample lasts at least this
        self.min_total = 50 if quick else 200         # timed calls per figure, when affordable
        self.max_s = 0.15 if quick else 0.4           # cap on one figure's timed calls
        self.max_calls = 5000
        # ``monitor.read()`` after every timed burst, outside the timed window
        # (device_state.DeviceMonitor); None: no readings.
        self.monitor = None

    def _gpu_seconds(self, lead, seq: list) -> float:
        """GPU seconds of the calls of ``seq``, after an untimed call of ``lead``: the GPU works on
        the lead call while the start event and the first timed calls are issued, so the window
        holds the calls' GPU time and not the host latency of the first call after a
        synchronisation, which is longer for a one-call function than for ``RopePlan.execute``
        and would otherwise fall on the slower-to-issue call alone."""
        cp = self.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        lead()
        start.record(self.stream)
        for f in seq:
            f()
        end.record(self.stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) * 1e-3

    def _warm(self, rot: Rotation) -> None:
        t0 = time.perf_counter()
        for f in rot.take(self.warmup):
            f()
            if time.perf_counter() - t0 > 0.25:
                break
        self.stream.synchronize()

    def _calls(self, est: float) -> int:
        est = max(est, 1e-7)
        calls = max(math.ceil(self.sample_s / est), math.ceil(self.min_total / self.reps))
        affordable = max(1, int(self.max_s / (self.reps * est)))
        return max(1, min(calls, affordable, self.max_calls))

    @staticmethod
    def _stats(per_call_s: list[float], calls: int, reps: int, divisor: int, sets: int) -> dict:
        us = [s * 1e6 / divisor for s in per_call_s]
        return {"us": statistics.median(us), "min_us": min(us), "samples_us": [round(x, 4) for x in us],
                "calls": calls, "reps": reps, "divisor": divisor, "sets": sets}

    def events(self, fns: list, divisor: int = 1, sets: int | None = None) -> dict:
        """GPU time per call: CUDA events around ``calls`` back-to-back calls, median of reps."""
        return self.events_in_turns([fns], divisor, sets)[0]

    def events_in_turns(self, rows: list[list], divisor: int = 1, sets: int | None = None) -> list[dict]:
        """GPU time per call of several rows (as :meth:`events`), their samples taken in turns:
        each rep times every row once, in order, so that a drift of the clocks over the
        measurement falls on all of them. For rows whose difference is small."""
        rots = [Rotation(fns) for fns in rows]
        with _no_gc():
            counts = []
            for rot in rots:
                self._warm(rot)
                seq = rot.take(4)
                counts.append(self._calls(self._gpu_seconds(seq[0], seq[1:]) / 3))
            samples: list[list[float]] = [[] for _ in rots]
            readings: list[list[dict]] = [[] for _ in rots]
            for _ in range(self.reps):
                for rot, calls, out, seen in zip(rots, counts, samples, readings):
                    seq = rot.take(calls + 1)
                    out.append(self._gpu_seconds(seq[0], seq[1:]) / calls)
                    if self.monitor is not None:
                        seen.append(self.monitor.read())
        stats = [self._stats(s, c, self.reps, divisor, sets or len(fns)) for s, c, fns in zip(samples, counts, rows)]
        if self.monitor is not None:
            for st, seen in zip(stats, readings):
                st["device"] = summarize(seen)
        return stats

    # Calls per timed burst of a host measurement.
    HOST_BURST = 100
    # How long ``hold`` keeps the GPU busy before a burst: this many times the burst's estimated
    # host time, plus a margin, so the whole burst is issued while the GPU is still held.
    HOLD_FACTOR = 3.0
    HOLD_MARGIN_US = 50.0
    hold = None  # ``hold(us)``: keep the stream's GPU busy for ``us`` µs (runner.GpuHold); None: no hold

    def host(self, fns: list) -> dict:
        """Host time per call of one row (:meth:`host_rows`); raises what a call raised."""
        res = self.host_rows([fns])[0]
        if isinstance(res, BaseException):
            raise res
        return res

    def host_rows(self, rows: list[list]) -> list:
        """Host time per call of each row (a list of callables, taken round-robin): the wall time
        of bursts of calls, per call; per row a result dict, or the exception one of its calls
        raised (the row is dropped from then on).

        Before each burst the stream is synchronised (untimed) and, when ``hold`` is set, a GPU
        kernel that outlasts the burst is enqueued: the calls queue behind it, so none of them
        waits for the GPU. Without it a call whose GPU work outlasts its host work (a graph launch
        on a slow GPU clock, say) makes later calls of the burst wait, and the figure would be GPU
        time. A burst that lasts as long as the hold waited for it (a call that synchronises):
        such calls are measured from an idle GPU instead (``held`` False in the result).

        The rows' samples are taken in turns, one sample of each row per round, so that every
        row's median covers the same stretch of time: on a shared host the time per call of the
        same code moved by up to 2x from one stretch of ~0.1 s to the next, and rows measured one
        after the other compared stretches, not calls."""
        rots = [Rotation(fns) for fns in rows]
        sync = self.stream.synchronize
        plans: list = []  # per row: [calls, hold µs or None], or the exception
        samples: list[list[float]] = [[] for _ in rows]
        with _no_gc():
            for rot, got in zip(rots, samples):
                try:
                    self._warm(rot)
                    seq = rot.take(20)
                    sync()
                    t0 = time.perf_counter()
                    for f in seq:
                        f()
                    est = (time.perf_counter() - t0) / 20
                    sync()
                    calls = max(self.HOST_BURST, -(-self._calls(est) // self.HOST_BURST) * self.HOST_BURST)
                    hold_us = self.HOST_BURST * est * 1e6 * self.HOLD_FACTOR + self.HOLD_MARGIN_US
                    plan = [calls, hold_us if self.hold is not None else None]
                    self._one_sample(rot, plan, got)  # the first sample says whether holding works
                    plans.append(plan)
                except Exception as exc:  # noqa: BLE001 - recorded per row
                    plans.append(exc)
                    sync_quietly(self.stream)
            for _ in range(self.reps - 1):
                for i, rot in enumerate(rots):
                    if isinstance(plans[i], BaseException):
                        continue
                    try:
                        self._one_sample(rot, plans[i], samples[i])
                    except Exception as exc:  # noqa: BLE001 - recorded per row
                        plans[i] = exc
                        sync_quietly(self.stream)
            sync()
        return [plan if isinstance(plan, BaseException) else
                {**self._stats(got, plan[0], len(got), 1, len(fns)), "held": plan[1] is not None}
                for plan, got, fns in zip(plans, samples, rows)]

    def _one_sample(self, rot: Rotation, plan: list, samples: list) -> None:
        """Append one sample (seconds per call over ``plan[0]`` calls) to ``samples``. A held burst
        that lasted as long as the hold: the row is measured from an idle GPU from now on, its
        held samples dropped."""
        calls, hold_us = plan
        got = self._host_samples(rot, calls, hold_us, 1)
        if got is None:
            plan[1] = None
            samples.clear()
            got = self._host_samples(rot, calls, None, 1)
        samples += got

    def _host_samples(self, rot: Rotation, calls: int, hold_us: float | None, reps: int) -> list[float] | None:
        """Seconds per call of each rep; None when a burst lasted as long as the GPU was held."""
        sync, burst = self.stream.synchronize, self.HOST_BURST
        samples = []
        for _ in range(reps):
            total = 0.0
            for _ in range(calls // burst):
                seq = rot.take(burst)
                sync()
                if hold_us is not None:
                    self.hold(hold_us)
                t0 = time.perf_counter()
                for f in seq:
                    f()
                dt = time.perf_counter() - t0
                if hold_us is not None and dt * 1e6 >= 0.9 * hold_us:
                    return None
                total += dt
            samples.append(total / calls)
        return samples


# Seconds of small launches before a process's first small GPU timing (settle).
SETTLE_S = 6.0


def settle(cp, stream, seconds: float = SETTLE_S) -> None:
    """``seconds`` of small launches on ``stream``, before a process's first small GPU timing. In
    a process's first seconds of GPU work every small launch (a copy node as much as a kernel) ran
    measurably faster than afterwards, at the same clocks, so small timings of those seconds could
    not be compared with later ones; after this, each is timed in the state a running engine is in."""
    x = cp.zeros(1 << 16, cp.float32)
    end = time.monotonic() + seconds
    with stream:
        while time.monotonic() < end:
            for _ in range(200):
                x += 1
            stream.synchronize()


def sync_quietly(stream) -> None:
    """Synchronise ``stream`` after a failed call, ignoring what that raises."""
    with contextlib.suppress(Exception):
        stream.synchronize()


def capture_cupy(stream, seq: list):
    """A CUDA graph of ``seq`` captured on ``stream`` (CuPy stream capture); returns its launcher
    and what must outlive it: the graph and the results (see :func:`capture_torch`)."""
    stream.begin_capture()
    try:
        results = _results_per_callable(seq)
    except BaseException:
        with contextlib.suppress(Exception):
            stream.end_capture()
        raise
    graph = stream.end_capture()
    return partial(graph.launch, stream), (graph, results)


def capture_torch(torch, seq: list):
    """A CUDA graph of ``seq`` captured with ``torch.cuda.graph`` (torch's allocator knows of it);
    returns its launcher and what must outlive it: the graph and the results.

    The last result of each distinct callable in ``seq`` (one per buffer set) is kept, so that a
    peer writes as many output buffers as ours do: one per set in a "cold" graph, one set in a
    hot one. A result dropped during capture goes back to the graph's pool and the next call
    gets the same block: every call of a cold graph wrote one buffer that stayed in L2."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        results = _results_per_callable(seq)
    return g.replay, (g, results)


def _results_per_callable(seq: list) -> dict:
    """Call each of ``seq`` in order; the last result of each distinct callable, by identity."""
    results = {}
    for f in seq:
        results[id(f)] = (f, f())
    return results


