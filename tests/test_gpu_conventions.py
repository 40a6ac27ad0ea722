"""The engines' conventions on the GPU: vLLM's float32 ``cos_sin_cache`` read in place, flat
``[T, H * D]`` q/k with ``head_dim=``, through the one-call function and a plan, NaN-poisoned
outputs, against the float64 reference of the same call."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_util import DTYPES, host_random, poisoned
from rope_rtc.core import dispatch
from rope_rtc.reference import assert_rope_close, rope_reference
from test_conventions import vllm_cos_sin_cache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [128, 64])
@pytest.mark.parametrize("api", ["one-call", "plan"])
@pytest.mark.parametrize("in_place", [False, True])
def test_vllm_cache_and_flat_tokens(dtype, is_neox, rotary_dim, api, in_place):
    import cupy as cp

    import rope_rtc

    T, Hq, Hk, D, P = 19, 8, 2, 128, 512
    dt = DTYPES[dtype]
    cache = vllm_cos_sin_cache(P, rotary_dim)
    positions = np.random.default_rng(2).integers(0, P, T).astype(np.int64)
    q, k = host_random((T, Hq * D), dt, 3), host_random((T, Hk * D), dt, 4)
    qd, kd, cd, pd = cp.asarray(q), cp.asarray(k), cp.asarray(cache), cp.asarray(positions)
    if in_place:
        qo, ko = qd, kd
    else:  # NaN-poisoned: an element left unwritten (the copied channels included) fails the check
        qo, ko = poisoned(cp, q.shape, dt), poisoned(cp, k.shape, dt)
    kw = dict(positions=pd, layout="thd", head_dim=D, interleaved=not is_neox, rotary_dim=rotary_dim)
    if api == "one-call":
        got = rope_rtc.apply_rope_qk(qd, kd, cos_sin_cache=cd, q_out=qo, k_out=ko, **kw)
    else:
        plan = rope_rtc.RopePlan(qd, kd, cos_sin_cache=cd, q_out=None if in_place else qo,
                                 k_out=None if in_place else ko, **kw).compile()
        got = plan.execute(qd, kd, positions=pd, cos_sin_cache=cd, q_out=qo, k_out=ko)
    assert got[0] is qo and got[1] is ko
    half = rotary_dim // 2
    for out, x, H in ((qo, q, Hq), (ko, k, Hk)):
        xc = x.reshape(T, H, D)
        ref = rope_reference(xc, cache[:, :half], cache[:, half:], positions, interleaved=not is_neox,
                             rotary_dim=rotary_dim)
        assert_rope_close(cp.asnumpy(out).reshape(T, H, D), ref, xc, interleaved=not is_neox, rotary_dim=rotary_dim,
                          dtype=np.dtype(dt))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("api", ["one-call", "plan"])
def test_new_flat_arrays_every_call_take_the_repeat_path_and_match_the_first_call(dtype, in_place, api):
    """An engine's layer loop: new flat q/k (and outputs) every call with one cos_sin_cache. From a
    signature's third call the one-call function (a plan: from its second) runs its generated
    checks on the flat arrays and the cache (sin at the second half of each row); every call's
    bits equal those of the same arguments in a thread that has seen nothing (rope.ONE_CALL's
    cleared; a fresh plan)."""
    import cupy as cp

    import rope_rtc
    from rope_rtc.ops import rope

    def call(q, k, pos, qo, ko, cache, plan=None):
        if plan is None:
            return rope_rtc.apply_rope_qk(q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=D,
                                          q_out=qo, k_out=ko)
        return plan.execute(q, k, positions=pos, cos_sin_cache=cache, q_out=qo, k_out=ko)

    def new_plan(q, k, pos, qo, ko, cache):
        return rope_rtc.RopePlan(q, k, cos_sin_cache=cache, positions=pos, layout="thd", head_dim=D,
                                 q_out=None if in_place else qo, k_out=None if in_place else ko).compile()

    T, Hq, Hk, D, P = 7, 8, 2, 128, 512
    dt = DTYPES[dtype]
    cache = cp.asarray(vllm_cos_sin_cache(P, D))
    rng = np.random.default_rng(5)
    calls = []
    for i in range(6):
        q, k = cp.asarray(host_random((T, Hq * D), dt, 10 + i)), cp.asarray(host_random((T, Hk * D), dt, 20 + i))
        pos = cp.asarray(rng.integers(0, P, T).astype(np.int64))
        qo, ko = (q, k) if in_place else (poisoned(cp, q.shape, dt), poisoned(cp, k.shape, dt))
        calls.append((q, k, pos, qo, ko, q.copy(), k.copy()))
    plan = new_plan(*calls[0][:5], cache) if api == "plan" else None
    for q, k, pos, qo, ko, _, _ in calls:
        call(q, k, pos, qo, ko, cache, plan)
    if plan is None:
        assert rope.CONVENTION.thread().last is not dispatch.NO_LAST
    else:
        assert plan._flat_quick is not None
    for q, k, pos, qo, ko, q0, k0 in calls:
        rope.ONE_CALL.forget()
        want_q, want_k = (q0.copy(), k0.copy()) if in_place else (poisoned(cp, q.shape, dt), poisoned(cp, k.shape, dt))
        a, b = (want_q, want_k) if in_place else (q0, k0)
        call(a, b, pos, want_q, want_k, cache, new_plan(a, b, pos, want_q, want_k, cache) if api == "plan" else None)
        cp.testing.assert_array_equal(qo.view(cp.uint16 if dt != np.float32 else cp.uint32),
                                      want_q.view(cp.uint16 if dt != np.float32 else cp.uint32))
        cp.testing.assert_array_equal(ko.view(cp.uint16 if dt != np.float32 else cp.uint32),
                                      want_k.view(cp.uint16 if dt != np.float32 else cp.uint32))
