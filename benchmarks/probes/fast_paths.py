"""What each of the host layer's fast paths saves (docs/design.md, "Fast paths"): host µs per call
of the call it serves with the path on and with it off, in one process, on and off alternated
over several rounds (the median round is reported), decode-sized bf16 calls (B=8, Hq=32, Hkv=8,
D=128, in place, per-sequence offsets; tail T=4, H=64, D=512).

This probe turns each path off by patching rope_rtc's modules (the one probe that patches):

- generated repeat path: the one-call functions' last path (``OneCall.launched`` and ``launched_on``
  decline) and a plan's quick path (``Op.quick_path`` gives none): calls then find their template
  by signature;
- remembered argument sets: a plan's last call and its recent sets are never matched
  (``Prepared._seen_again`` says no, ``Prepared.last`` is cleared): every call takes the quick path;
- graph replay: ``Launcher.replay`` off (per-token graphs and per-prefix graph nodes): every
  launch is a ``cuLaunchKernel``;
- output recycling: ``outputs._FREE = None`` (as on an interpreter whose reference counts cannot
  say an output is free): every output a one-call function allocates is a new array (timed with a
  stream given, as an engine passes one, and with none);
- templates per signature (the core itself, for scale): every call validated in full.

    PYTHONPATH=. python3 benchmarks/probes/fast_paths.py
"""

from __future__ import annotations

import contextlib
import statistics

import ml_dtypes
import numpy as np
from probe_timing import decode_sets, host_us

ROUNDS = 7


@contextlib.contextmanager
def patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def main() -> None:
    import cupy as cp

    import rope_rtc
    from rope_rtc.core import dispatch, outputs, prepared
    from rope_rtc.ops import rope, rope_plan, tail

    bf16 = ml_dtypes.bfloat16
    cos, sin = rope_rtc.rope_tables(4096, 128, xp=cp)
    rng = np.random.default_rng(0)
    sets = decode_sets(cp, rng)
    xs = [cp.asarray(rng.standard_normal((4, 64, 512)).astype(bf16)) for _ in range(64)]
    cosine = cp.asarray(rng.standard_normal((4, 32)).astype(np.float32))
    sine = cp.asarray(rng.standard_normal((4, 32)).astype(np.float32))
    q0, k0, o0 = sets[0]
    plan = rope_rtc.RopePlan(q0, k0, cos, sin, offset=o0, layout="bshd").compile()
    stream = cp.cuda.Stream(non_blocking=True)  # the current stream while timing
    given = cp.cuda.Stream(non_blocking=True)  # a stream passed to the call, as an engine passes its own
    counter = iter(range(10**12))

    def one_call_cycled():
        q, k, o = sets[next(counter) % 64]
        rope_rtc.apply_rope_qk(q, k, cos, sin, offset=o, q_out=q, k_out=k, layout="bshd")

    def plan_cycled():
        q, k, o = sets[next(counter) % 64]
        plan.execute(q, k, cos, sin, offset=o)

    def plan_same():
        plan.execute(q0, k0, cos, sin, offset=o0)

    def plan_same_unremembered():  # as a set never seen: neither the last call nor a recent one
        core = plan._core
        core.last = None
        core.recent.clear()
        plan.execute(q0, k0, cos, sin, offset=o0)

    def tail_cycled():
        tail_rope(xs[next(counter) % 64], cosine, sine)

    def tail_cycled_on_stream():
        tail_rope(xs[next(counter) % 64], cosine, sine, stream=given)

    tail_rope = rope_rtc.tail_rope

    def one_call_validated():
        rope.ONE_CALL.thread().by_signature.clear()
        plan_of = next(iter(rope.ONE_CALL.thread().by_key.values()))
        plan_of._core.templates.clear()
        one_call_cycled()

    def no_replay(p):
        return patched(p._core.launcher, "replay", False)

    def tail_plan():
        return next(iter(tail.ONE_CALL.thread().by_key.values()))

    @contextlib.contextmanager
    def declines():  # both entries of the last path: launched (a stream) and launched_on (a handle)
        with patched(dispatch.OneCall, "launched", lambda self, options, stream, *arrays: False), \
                patched(dispatch.OneCall, "launched_on", lambda self, options, handle, *arrays: False):
            yield

    @contextlib.contextmanager
    def no_quick():
        with patched(rope_plan._RopeOp, "quick_path", lambda self, template, arrays: None), \
                patched(plan._core, "quick", None):
            yield

    def never_seen():
        return patched(prepared.Prepared, "_seen_again", lambda self, key, arrays: False)

    rows = [
        ("generated repeat path", "apply_rope_qk, 64 sets cycled", one_call_cycled, one_call_cycled,
         declines),
        ("generated repeat path", "RopePlan.execute, 64 sets cycled", plan_cycled, plan_cycled, no_quick),
        ("remembered argument sets", "RopePlan.execute, same arrays", plan_same, plan_same_unremembered,
         never_seen),
        ("graph replay", "RopePlan.execute, same arrays", plan_same, plan_same, lambda: no_replay(plan)),
        ("graph replay", "apply_rope_qk, 64 sets cycled", one_call_cycled, one_call_cycled,
         lambda: no_replay(next(iter(rope.ONE_CALL.thread().by_key.values())))),
        ("graph replay", "tail_rope, 64 sets cycled", tail_cycled, tail_cycled, lambda: no_replay(tail_plan())),
        ("output recycling", "tail_rope, 64 sets cycled, stream given", tail_cycled_on_stream, tail_cycled_on_stream,
         lambda: patched(outputs, "_FREE", None)),
        ("output recycling", "tail_rope, 64 sets cycled, no stream", tail_cycled, tail_cycled,
         lambda: patched(outputs, "_FREE", None)),
        ("templates per signature", "apply_rope_qk, 64 sets cycled", one_call_cycled, one_call_validated,
         declines),
    ]
    with stream:
        one_call_cycled(), plan_cycled(), tail_cycled()  # plans made, kernels loaded
        results = {i: ([], []) for i in range(len(rows))}
        for _ in range(ROUNDS):
            for i, (_, _, on_fn, off_fn, off) in enumerate(rows):
                results[i][0].append(host_us(on_fn, 3000, 1, 100))
                with off():
                    results[i][1].append(host_us(off_fn, 3000, 1, 100))
                stream.synchronize()
                given.synchronize()
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; median of {ROUNDS} rounds")
    print(f"{'fast path':26s} {'call':42s} {'on µs':>7s} {'off µs':>7s} {'saves':>7s}")
    for i, (name, call, *_rest) in enumerate(rows):
        on, off = statistics.median(results[i][0]), statistics.median(results[i][1])
        print(f"{name:26s} {call:42s} {on:7.2f} {off:7.2f} {off - on:7.2f}")


if __name__ == "__main__":
    main()
