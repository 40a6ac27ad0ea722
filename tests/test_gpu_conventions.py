"""The engines' conventions on the GPU: vLLM's float32 ``cos_sin_cache`` read in place, flat
``[T, H * D]`` q/k with ``head_dim=``, through the one-call function and a plan, NaN-poisoned
outputs, against the float64 reference of the same call."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_util import DTYPES, host_random, poisoned
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
