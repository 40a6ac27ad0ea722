"""Programmatic dependent launch (``pdl=True``) on the GPU: the same bits as the plain launch, from
plans and one-call functions, and correct results when RoPE follows its producer closely: right
behind a kernel that writes q and k on the stream, and inside a captured graph replayed many times
(a missing wait would read q and k before the producer wrote them)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_util import DTYPES, assert_half_split_qk, bits, host_random, host_tables

pytestmark = pytest.mark.gpu

HQ, HK, D, ROWS = 32, 8, 128, 4096


def _inputs(cp, T: int, dtype: str, seed: int):
    q_h = host_random((T, HQ, D), DTYPES[dtype], seed)
    k_h = host_random((T, HK, D), DTYPES[dtype], seed + 1)
    cos_h, sin_h = host_tables(ROWS, D // 2, seed + 2)
    pos_h = np.random.default_rng(seed + 3).integers(0, ROWS, T).astype(np.int32)
    return q_h, k_h, cos_h, sin_h, pos_h


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("T", [1, 64, 3000])
def test_pdl_gives_the_plain_launch_bits(cp, dtype, T):
    import rope_rtc

    q_h, k_h, cos_h, sin_h, pos_h = _inputs(cp, T, dtype, seed=T)
    cos, sin, pos = cp.asarray(cos_h), cp.asarray(sin_h), cp.asarray(pos_h)
    results = []
    for pdl in (False, True):
        q, k = cp.asarray(q_h), cp.asarray(k_h)
        plan = rope_rtc.RopePlan(q, k, cos, sin, positions=pos, layout="thd", pdl=pdl)
        assert plan.programmatic is pdl  # the device machine is sm_90
        plan.execute(q, k, cos, sin, positions=pos)
        qo = cp.full(q.shape, cp.nan, q.dtype)  # out of place through the one-call function
        ko = cp.full(k.shape, cp.nan, k.dtype)
        rope_rtc.apply_rope_qk(cp.asarray(q_h), cp.asarray(k_h), cos, sin, positions=pos, q_out=qo, k_out=ko, pdl=pdl)
        x = rope_rtc.apply_rope(cp.asarray(q_h), cos, sin, positions=pos, pdl=pdl)
        cp.cuda.runtime.deviceSynchronize()
        results.append([bits(cp.asnumpy(a)) for a in (q, k, qo, ko, x)])
    for plain, programmatic in zip(*results):
        np.testing.assert_array_equal(programmatic, plain)
    _check(cp, [q, k, qo, ko, x], [q_h, k_h, q_h, k_h, q_h], cos_h, sin_h, pos_h)


def _check(cp, outs, hosts, cos_h, sin_h, pos_h) -> None:
    """``thd`` outputs against the reference (the helper takes [B, S, H, D]: one sequence)."""
    assert_half_split_qk(cp, outs, [h[None] for h in hosts], cos_h, sin_h, pos_h)


def _producer(cp):
    """A kernel that writes dst = src * 1 slowly (a long tail for RoPE to overlap), element by element."""
    return cp.ElementwiseKernel("T src, int64 spin", "T dst",
                                "long long t0 = clock64(); while (clock64() - t0 < spin) {} dst = src;",
                                "pdl_test_producer")


@pytest.mark.parametrize("T", [1, 64])
def test_pdl_rope_reads_what_the_kernel_before_it_wrote(cp, T):
    import rope_rtc

    q_h, k_h, cos_h, sin_h, pos_h = _inputs(cp, T, "bfloat16", seed=10 + T)
    cos, sin, pos = cp.asarray(cos_h), cp.asarray(sin_h), cp.asarray(pos_h)
    src_q, src_k = cp.asarray(q_h), cp.asarray(k_h)
    q = cp.full(src_q.shape, cp.nan, src_q.dtype)
    k = cp.full(src_k.shape, cp.nan, src_k.dtype)
    plan = rope_rtc.RopePlan(q, k, cos, sin, positions=pos, layout="thd", pdl=True)
    produce = _producer(cp)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.runtime.deviceSynchronize()
    with stream:
        for _ in range(3):
            q.fill(cp.nan)
            k.fill(cp.nan)
            produce(src_q.view(cp.uint16), np.int64(20000), q.view(cp.uint16))
            produce(src_k.view(cp.uint16), np.int64(20000), k.view(cp.uint16))
            plan.execute(q, k, cos, sin, positions=pos, stream=stream)
            stream.synchronize()
            _check(cp, [q, k], [q_h, k_h], cos_h, sin_h, pos_h)


def test_pdl_rope_in_a_captured_graph_replayed(cp):
    import rope_rtc

    T, layers = 16, 8
    q_h, k_h, cos_h, sin_h, pos_h = _inputs(cp, T, "bfloat16", seed=30)
    cos, sin, pos = cp.asarray(cos_h), cp.asarray(sin_h), cp.asarray(pos_h)
    src_q, src_k = cp.asarray(q_h), cp.asarray(k_h)
    qs = [cp.full(src_q.shape, cp.nan, src_q.dtype) for _ in range(layers)]
    ks = [cp.full(src_k.shape, cp.nan, src_k.dtype) for _ in range(layers)]
    plan = rope_rtc.RopePlan(qs[0], ks[0], cos, sin, positions=pos, layout="thd", pdl=True).compile()
    produce = _producer(cp)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.runtime.deviceSynchronize()
    with stream:
        stream.begin_capture()
        for q, k in zip(qs, ks):
            produce(src_q.view(cp.uint16), np.int64(5000), q.view(cp.uint16))
            produce(src_k.view(cp.uint16), np.int64(5000), k.view(cp.uint16))
            plan.execute(q, k, cos, sin, positions=pos, stream=stream)
        graph = stream.end_capture()
        for _ in range(5):
            for q, k in zip(qs, ks):
                q.fill(cp.nan)
                k.fill(cp.nan)
            graph.launch(stream)
            stream.synchronize()
            for q, k in zip(qs, ks):
                _check(cp, [q, k], [q_h, k_h], cos_h, sin_h, pos_h)
