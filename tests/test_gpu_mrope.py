"""Multimodal RoPE on the GPU: bit for bit against the kernel-arithmetic reference over dtypes,
section styles, layouts, in and out of place (outputs poisoned with NaN first); against
Hugging Face transformers' Qwen2-VL and Qwen3-VL rotary embeddings (the model's own cos/sin
recomposition, then apply_rotary_pos_emb); a plan's new arrays, CUDA graph capture (the graph
launched on a non-blocking stream after the inputs' copies on the current stream, also when that
stream is busy) and the debug check of device positions; with ``ROPE_RTC_STRESS=1``, the capture
again and again under load."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from gpu_util import DTYPES, after_current_stream, bits, host_random, host_tables, keep_busy, poisoned
from rope_rtc.core import dispatch
from rope_rtc.reference import assert_rope_close, mrope_kernel_arithmetic, mrope_reference

pytestmark = pytest.mark.gpu

HQ, HK, D, P = 4, 2, 128, 96
SECTIONS = {False: [16, 24, 24], True: [24, 20, 20]}  # Qwen2-VL's and Qwen3-VL's at head dim 128
TO_LAYOUT = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}


def _canonical(B, S, H, dtype, seed):
    return host_random((B, S, H, D), DTYPES[dtype], seed, 2.0)


def _to_layout(x, layout):
    return x[0] if layout == "thd" else np.ascontiguousarray(np.transpose(x, TO_LAYOUT[layout]))


def _from_layout(y, layout, B, S):
    if layout == "thd":
        return y[None]
    return np.transpose(y, np.argsort(TO_LAYOUT[layout]))


@pytest.mark.parametrize("dtype,interleaved_sections,layout,in_place", list(itertools.product(
    ["bfloat16", "float16", "float32"], [False, True], ["thd", "bshd", "bhsd", "sbhd"], [True, False])))
def test_bit_exact_against_the_kernel_arithmetic(dtype, interleaved_sections, layout, in_place):
    import cupy as cp

    import rope_rtc

    B, S = (1, 11) if layout == "thd" else (2, 5)
    section = SECTIONS[interleaved_sections]
    qh, kh = _canonical(B, S, HQ, dtype, 1), _canonical(B, S, HK, dtype, 2)
    cos, sin = host_tables(P, D // 2, 3)
    pos = np.random.default_rng(4).integers(0, P, (3, B, S)).astype(np.int64)
    dpos = cp.asarray(pos[:, 0] if layout == "thd" else pos)
    q, k = cp.asarray(_to_layout(qh, layout)), cp.asarray(_to_layout(kh, layout))
    q_out = q if in_place else poisoned(cp, q.shape, DTYPES[dtype])
    k_out = k if in_place else poisoned(cp, k.shape, DTYPES[dtype])
    got = rope_rtc.apply_mrope_qk(q, k, cp.asarray(cos), cp.asarray(sin), dpos, section,
                                  interleaved_sections=interleaved_sections, layout=layout, q_out=q_out, k_out=k_out)
    flat_pos = pos.reshape(3, -1)
    for out, host, h in zip(got, (qh, kh), (HQ, HK)):
        want = mrope_kernel_arithmetic(host.reshape(B * S, h, D), cos, sin, flat_pos, section,
                                       interleaved_sections=interleaved_sections)
        actual = _from_layout(cp.asnumpy(out), layout, B, S).reshape(B * S, h, D)
        np.testing.assert_array_equal(bits(actual), bits(want))
        ref = mrope_reference(host.reshape(B * S, h, D), cos, sin, flat_pos, section,
                              interleaved_sections=interleaved_sections)
        assert_rope_close(actual, ref, host.reshape(B * S, h, D), interleaved=False, dtype=np.dtype(DTYPES[dtype]))
    if not in_place:
        np.testing.assert_array_equal(bits(cp.asnumpy(q)), bits(_to_layout(qh, layout)))


@pytest.mark.parametrize("interleaved_sections,layout", list(itertools.product([False, True], ["thd", "bshd", "bhsd"])))
def test_position_streams_not_the_token_count_apart(interleaved_sections, layout):
    """A view of a larger positions buffer runs the strided build (the dense one takes the
    streams to be T apart): the same bits as the same positions in an array of their own."""
    import cupy as cp

    import rope_rtc

    B, S = (1, 9) if layout == "thd" else (2, 4)
    section = SECTIONS[interleaved_sections]
    qh, kh = _canonical(B, S, HQ, "bfloat16", 5), _canonical(B, S, HK, "bfloat16", 6)
    cos, sin = (cp.asarray(t) for t in host_tables(P, D // 2, 7))
    pos = np.random.default_rng(8).integers(0, P, (3, B, S)).astype(np.int32)
    own = cp.asarray(pos[:, 0] if layout == "thd" else pos)
    big = cp.zeros((3, 2) + own.shape[1:], np.int32)
    big[:, 1] = own
    view = big[:, 1]  # streams 2T apart
    outs = []
    for positions in (own, view):
        q, k = cp.asarray(_to_layout(qh, layout)), cp.asarray(_to_layout(kh, layout))
        q_out, k_out = poisoned(cp, q.shape, DTYPES["bfloat16"]), poisoned(cp, k.shape, DTYPES["bfloat16"])
        rope_rtc.apply_mrope_qk(q, k, cos, sin, positions, section, interleaved_sections=interleaved_sections,
                                layout=layout, q_out=q_out, k_out=k_out)
        outs.append([cp.asnumpy(a) for a in (q_out, k_out)])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(bits(a), bits(b))
    want = mrope_kernel_arithmetic(qh.reshape(B * S, HQ, D), cp.asnumpy(cos), cp.asnumpy(sin), pos.reshape(3, -1),
                                   section, interleaved_sections=interleaved_sections)
    actual = _from_layout(outs[1][0], layout, B, S).reshape(B * S, HQ, D)
    np.testing.assert_array_equal(bits(actual), bits(want))


def test_a_partial_window_in_place_leaves_the_rest():
    import cupy as cp

    import rope_rtc

    T, section, R = 9, [8, 12, 12], 64
    x = host_random((T, HQ, D), DTYPES["bfloat16"], 7, 2.0)
    cos, sin = host_tables(P, R // 2, 8)
    pos = np.random.default_rng(9).integers(0, P, (3, T)).astype(np.int32)
    dx = cp.asarray(x)
    rope_rtc.apply_mrope(dx, cp.asarray(cos), cp.asarray(sin), cp.asarray(pos), section, rotary_dim=R, out=dx)
    want = mrope_kernel_arithmetic(x, cos, sin, pos, section, rotary_dim=R)
    np.testing.assert_array_equal(bits(cp.asnumpy(dx)), bits(want))
    np.testing.assert_array_equal(bits(cp.asnumpy(dx)[..., R:]), bits(x[..., R:]))


def _hf_rotary(torch, module, section, inv_freq):
    """A transformers rotary-embedding module of ``module`` with our inverse frequencies and
    sections (built without a model config: the fields its forward reads)."""
    cls = {"qwen2_vl": "Qwen2VLRotaryEmbedding", "qwen3_vl": "Qwen3VLTextRotaryEmbedding"}[module]
    mod = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[cls])
    emb = getattr(mod, cls).__new__(getattr(mod, cls))
    torch.nn.Module.__init__(emb)
    emb.inv_freq = inv_freq
    emb.original_inv_freq = inv_freq
    emb.attention_scaling = 1.0
    emb.mrope_section = list(section)
    emb.rope_type = "default"
    return emb, mod.apply_rotary_pos_emb


@pytest.mark.parametrize("module,interleaved_sections", [("qwen2_vl", False), ("qwen3_vl", True)])
def test_against_transformers(module, interleaved_sections):
    """fp32 q/k [B, H, S, D]: transformers computes cos/sin per stream and recombines them by
    section, then rotates (separate multiply and add); our tables are transformers' own cos/sin
    of positions 0..P-1 (three equal streams), so the two differ by the rotation's rounding only."""
    import cupy as cp
    import torch

    import rope_rtc

    B, S, section = 2, 33, SECTIONS[interleaved_sections]
    inv_freq = (1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))).cuda()
    emb, apply_rotary_pos_emb = _hf_rotary(torch, module, section, inv_freq)
    probe = torch.zeros(1, device="cuda", dtype=torch.float32)
    every = torch.arange(P, device="cuda")[None, None, :].expand(3, 1, P)
    cos_t, sin_t = emb(probe, every)
    cos, sin = cp.asarray(cos_t[0, :, : D // 2].contiguous()), cp.asarray(sin_t[0, :, : D // 2].contiguous())
    pos = torch.randint(0, P, (3, B, S), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    q = torch.randn(B, HQ, S, D, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    k = torch.randn(B, HK, S, D, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    c3, s3 = emb(q, pos)
    want_q, want_k = apply_rotary_pos_emb(q, k, c3, s3)
    got_q, got_k = rope_rtc.apply_mrope_qk(cp.asarray(q), cp.asarray(k), cos, sin, cp.asarray(pos), section,
                                           interleaved_sections=interleaved_sections, layout="bhsd")
    for got, want, x in ((got_q, want_q, q), (got_k, want_k, k)):
        g = np.transpose(cp.asnumpy(got), (0, 2, 1, 3)).reshape(B * S, -1, D)
        w = np.transpose(want.cpu().numpy(), (0, 2, 1, 3)).reshape(B * S, -1, D).astype(np.float64)
        xs = np.transpose(x.cpu().numpy(), (0, 2, 1, 3)).reshape(B * S, -1, D)
        assert_rope_close(g, w, xs, interleaved=False, dtype=np.dtype(np.float32))
        assert np.isfinite(g).all()


CAPTURE_T = 7


def _capture_set(cp, seed):
    """``(host, device)`` q ``[7, HQ, D]``, k ``[7, HK, D]`` (bfloat16) and int64 positions
    ``[3, 7]``: the device arrays copied from the host ones on the current stream."""
    T = CAPTURE_T
    q = host_random((T, HQ, D), DTYPES["bfloat16"], seed, 2.0)
    k = host_random((T, HK, D), DTYPES["bfloat16"], seed + 1, 2.0)
    pos = np.random.default_rng(seed).integers(0, P, (3, T)).astype(np.int64)
    return (q, k, pos), (cp.asarray(q), cp.asarray(k), cp.asarray(pos))


def _check_in_place(cp, host, dev, cos, sin, section):
    for out, x in zip(dev[:2], host[:2]):
        want = mrope_kernel_arithmetic(x, cos, sin, host[2], section)
        np.testing.assert_array_equal(bits(cp.asnumpy(out)), bits(want))


def _captured_replay(cp, plan, dev, dc, ds):
    """Capture the plan's in-place execute of ``dev`` on a non-blocking stream, launch the graph
    there and wait for it.

    ``dev`` was filled on the current stream, which a non-blocking stream does not wait for: the
    launch is ordered after those copies (``after_current_stream``)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        plan.execute(dev[0], dev[1], dc, ds, dev[2], stream=stream)
        graph = stream.end_capture()
    after_current_stream(cp, stream)
    graph.launch(stream)
    stream.synchronize()


def test_plan_new_arrays_graph_capture_and_the_position_check(monkeypatch):
    import cupy as cp

    import rope_rtc

    section = SECTIONS[False]
    cos, sin = host_tables(P, D // 2, 11)
    dc, ds = cp.asarray(cos), cp.asarray(sin)
    h0, d0 = _capture_set(cp, 20)
    plan = rope_rtc.MRopePlan(d0[0], d0[1], dc, ds, d0[2], section).compile()
    plan.execute(d0[0], d0[1], dc, ds, d0[2])
    _check_in_place(cp, h0, d0, cos, sin, section)
    h1, d1 = _capture_set(cp, 30)  # new arrays of the same signature
    plan.execute(d1[0], d1[1], dc, ds, d1[2])
    _check_in_place(cp, h1, d1, cos, sin, section)
    h2, d2 = _capture_set(cp, 40)
    _captured_replay(cp, plan, d2, dc, ds)
    _check_in_place(cp, h2, d2, cos, sin, section)
    # ROPE_RTC_CHECK_POSITIONS=1 reads device positions back and names the bad one
    monkeypatch.setenv("ROPE_RTC_CHECK_POSITIONS", "1")
    bad = d1[2].copy()
    bad[1, 3] = P
    checked = rope_rtc.MRopePlan(d1[0], d1[1], dc, ds, bad, section)
    before = cp.asnumpy(d1[0])
    with pytest.raises(ValueError, match=r"positions: entry \(1, 3\) is 96"):
        checked.execute(d1[0], d1[1], dc, ds, bad)
    np.testing.assert_array_equal(bits(cp.asnumpy(d1[0])), bits(before))


def test_a_captured_replay_waits_for_inputs_copied_on_a_busy_current_stream():
    """The inputs of a captured execute are copied on the current stream while it is busy (as a
    GPU shared with other processes can keep it), and the graph is launched on a non-blocking
    stream: the replay still rotates those inputs. A launch that does not wait for the current
    stream runs before the copies and rotates whatever the memory held (here the pool's
    NaN-poisoned blocks, as a sharded suite's earlier tests leave them)."""
    import cupy as cp

    import rope_rtc

    section = SECTIONS[False]
    cos, sin = host_tables(P, D // 2, 12)
    dc, ds = cp.asarray(cos), cp.asarray(sin)
    h0, d0 = _capture_set(cp, 21)
    plan = rope_rtc.MRopePlan(d0[0], d0[1], dc, ds, d0[2], section).compile()
    plan.execute(d0[0], d0[1], dc, ds, d0[2])
    _check_in_place(cp, h0, d0, cos, sin, section)
    for seed in (41, 42):
        stale = [poisoned(cp, (CAPTURE_T, h, D), DTYPES["bfloat16"]) for h in (HQ, HK)]
        stale.append(cp.full((3, CAPTURE_T), 2**40, np.int64))  # outside the table: NaN if read
        del stale  # the pool's next blocks of these sizes
        keep_busy(cp, cp.cuda.get_current_stream())
        h, d = _capture_set(cp, seed)
        _captured_replay(cp, plan, d, dc, ds)
        _check_in_place(cp, h, d, cos, sin, section)


# The stress run (ROPE_RTC_STRESS=1, tests/conftest.py): rounds of captured replays under load.
STRESS_ROUNDS, STRESS_REPEATS = 10, 100


@pytest.fixture
def gpu_pressure():
    """Another thread, on a non-blocking stream of its own, keeps the copy engines busy (32 MiB
    each way through pinned memory) and NaN-poisoned blocks going through the memory pool until
    the test ends: the load of other test processes sharing the GPU."""
    import cupy as cp

    stop, errors = threading.Event(), []

    def work() -> None:
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            n = 32 << 20
            pinned = cp.cuda.alloc_pinned_memory(n)
            host = np.frombuffer(pinned, np.uint8, n)
            with stream:
                big = cp.empty(n, np.uint8)
                while not stop.is_set():
                    big.set(host, stream=stream)
                    big.get(stream=stream, out=host)
                    junk = [poisoned(cp, (CAPTURE_T, h, D), DTYPES["bfloat16"]) for h in (HQ, HK, 2 * HQ)]
                    del junk
                    stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported by the fixture
            errors.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(60)
    assert not thread.is_alive(), "the pressure thread did not stop"
    assert not errors, errors[0]


@pytest.mark.stress
@pytest.mark.parametrize("round_", range(STRESS_ROUNDS))
def test_stress_captured_replays_of_new_arrays_under_load(round_, gpu_pressure):
    """test_plan_new_arrays_graph_capture_and_the_position_check's capture, STRESS_REPEATS times a
    round, while another thread loads the GPU (``gpu_pressure``): each set's memory held NaN
    just before, the current stream is now and then held for up to about 2 ms before the copies,
    and every third set also takes a plain execute first. Every replay rotates its own inputs."""
    import cupy as cp

    import rope_rtc

    rng = np.random.default_rng(round_)
    section = SECTIONS[False]
    cos, sin = host_tables(P, D // 2, 13)
    dc, ds = cp.asarray(cos), cp.asarray(sin)
    seed = 10_000 * (round_ + 1)
    h, d = _capture_set(cp, seed)
    plan = rope_rtc.MRopePlan(d[0], d[1], dc, ds, d[2], section).compile()
    current = cp.cuda.get_current_stream()
    for i in range(STRESS_REPEATS):
        stale = [poisoned(cp, (CAPTURE_T, heads, D), DTYPES["bfloat16"]) for heads in (HQ, HK)]
        stale.append(cp.full((3, CAPTURE_T), 2**40, np.int64))
        del stale
        if rng.random() < 0.5:
            keep_busy(cp, current, int(rng.integers(1, 4_000_000)))
        if i % 3 == 0:
            h, d = _capture_set(cp, seed + 2 * i + 1)
            plan.execute(d[0], d[1], dc, ds, d[2])
            _check_in_place(cp, h, d, cos, sin, section)
        h, d = _capture_set(cp, seed + 2 * i + 2)
        _captured_replay(cp, plan, d, dc, ds)
        _check_in_place(cp, h, d, cos, sin, section)


@pytest.mark.parametrize("interleaved_sections", [False, True])
@pytest.mark.parametrize("layout", ["thd", "bhsd"])
def test_prefill_builds_with_several_heads_per_thread(interleaved_sections, layout):
    """Launches of 2^14 threads and more take the prefill builds (2 or 4 heads per thread; interleaved
    sections in token-major order gather their merged rows first)."""
    import cupy as cp

    import rope_rtc

    hq, hk = 8, 4
    B, S = (1, 600) if layout == "thd" else (2, 300)
    section = SECTIONS[interleaved_sections]
    qh, kh = host_random((B, S, hq, D), DTYPES["bfloat16"], 51, 2.0), host_random((B, S, hk, D), DTYPES["bfloat16"],
                                                                                  52, 2.0)
    cos, sin = host_tables(P, D // 2, 53)
    pos = np.random.default_rng(54).integers(0, P, (3, B, S)).astype(np.int32)
    q, k = cp.asarray(_to_layout(qh, layout)), cp.asarray(_to_layout(kh, layout))
    dpos = cp.asarray(pos[:, 0] if layout == "thd" else pos)
    q_out, k_out = poisoned(cp, q.shape, DTYPES["bfloat16"]), poisoned(cp, k.shape, DTYPES["bfloat16"])
    rope_rtc.apply_mrope_qk(q, k, cp.asarray(cos), cp.asarray(sin), dpos, section,
                            interleaved_sections=interleaved_sections, layout=layout, q_out=q_out, k_out=k_out)
    for out, host, h in ((q_out, qh, hq), (k_out, kh, hk)):
        want = mrope_kernel_arithmetic(host.reshape(B * S, h, D), cos, sin, pos.reshape(3, -1), section,
                                       interleaved_sections=interleaved_sections)
        actual = _from_layout(cp.asnumpy(out), layout, B, S).reshape(B * S, h, D)
        np.testing.assert_array_equal(bits(actual), bits(want))


@pytest.mark.parametrize("hq,hk", [(4, 2), (28, 4), (8, 8)])
@pytest.mark.parametrize("T", [8, 700])
def test_interleaved_sections_gathered_by_the_block_or_by_each_warp(hq, hk, T):
    """Interleaved sections in token-major order gather each token's merged row by warp shuffles
    when a token's threads are whole warps (28 + 4 and 8 + 8 heads at bf16: 256 and 128 threads a
    token at decode), else through shared memory (4 + 2 heads: 48); both bit for bit, at decode
    and on the prefill builds (700 tokens: two heads per thread), with 32-bit positions."""
    import cupy as cp

    import rope_rtc

    section = SECTIONS[True]
    qh, kh = host_random((T, hq, D), DTYPES["bfloat16"], 71, 2.0), host_random((T, hk, D), DTYPES["bfloat16"], 72, 2.0)
    cos, sin = host_tables(P, D // 2, 73)
    pos = np.random.default_rng(74).integers(0, P, (3, T)).astype(np.int32)
    q_out, k_out = poisoned(cp, qh.shape, DTYPES["bfloat16"]), poisoned(cp, kh.shape, DTYPES["bfloat16"])
    rope_rtc.apply_mrope_qk(cp.asarray(qh), cp.asarray(kh), cp.asarray(cos), cp.asarray(sin), cp.asarray(pos),
                            section, interleaved_sections=True, layout="thd", q_out=q_out, k_out=k_out)
    for out, host in ((q_out, qh), (k_out, kh)):
        want = mrope_kernel_arithmetic(host, cos, sin, pos, section, interleaved_sections=True)
        np.testing.assert_array_equal(bits(cp.asnumpy(out)), bits(want))


@pytest.mark.parametrize("interleaved_sections,section", [(False, [10, 27, 27]), (True, [22, 21, 21])])
def test_sections_off_vector_boundaries_and_positions_outside_the_table(interleaved_sections, section):
    """Contiguous sections that split a thread's pairs between streams take the several-stream
    path; a position outside the table gives NaN on exactly the pairs of its stream."""
    import cupy as cp

    import rope_rtc
    from rope_rtc.reference import mrope_streams

    T = 9
    x = host_random((T, HQ, D), DTYPES["float32"], 61, 2.0)
    cos, sin = host_tables(P, D // 2, 62)
    pos = np.random.default_rng(63).integers(0, P, (3, T)).astype(np.int64)
    bad_token, bad_stream = 4, 1
    pos[bad_stream, bad_token] = P + 5
    out = poisoned(cp, (T, HQ, D), np.float32)
    rope_rtc.apply_mrope(cp.asarray(x), cp.asarray(cos), cp.asarray(sin), cp.asarray(pos), section,
                         interleaved_sections=interleaved_sections, out=out)
    got = cp.asnumpy(out)
    stream = mrope_streams(section, D, interleaved_sections=interleaved_sections)
    nan_pairs = np.flatnonzero(stream == bad_stream)
    good = [t for t in range(T) if t != bad_token]
    want = mrope_kernel_arithmetic(x[good], cos, sin, pos[:, good], section, interleaved_sections=interleaved_sections)
    np.testing.assert_array_equal(bits(got[good]), bits(want))
    row = got[bad_token]
    expect_nan = np.zeros(D, bool)
    expect_nan[nan_pairs] = expect_nan[nan_pairs + D // 2] = True
    assert np.isnan(row[:, expect_nan]).all() and not np.isnan(row[:, ~expect_nan]).any()


@pytest.mark.parametrize("interleaved_sections", [False, True])
@pytest.mark.parametrize("layout", ["thd", "bshd", "bhsd"])
@pytest.mark.parametrize("S", [7, 600])
def test_text_tokens_with_one_position_in_the_three_streams(interleaved_sections, layout, S):
    """Text tokens (temporal == height == width: a generation step's positions) among vision
    tokens: a leading run of text tokens (whole blocks of them), a single vision token among text
    ones, a text token past the table (NaN on every pair), at decode and prefill sizes: the same
    bits as the kernel-arithmetic reference everywhere, outputs poisoned first."""
    import cupy as cp

    import rope_rtc

    B = 1 if layout == "thd" else 2
    section = SECTIONS[interleaved_sections]
    qh, kh = host_random((B, S, HQ, D), DTYPES["bfloat16"], 71, 2.0), host_random((B, S, HK, D), DTYPES["bfloat16"],
                                                                                  72, 2.0)
    cos, sin = host_tables(P, D // 2, 73)
    rng = np.random.default_rng(74)
    flat = np.repeat(rng.integers(0, P, (1, B * S)), 3, axis=0)  # text: one position in all three streams
    vision = rng.random(B * S) < 0.5
    vision[: B * S // 3] = False                # a leading run of text tokens only (whole blocks of them)
    vision[B * S // 3 + 1: B * S // 2] = False  # one vision token among text ones
    vision[B * S // 3] = True
    flat[1:, vision] = rng.integers(0, P, (2, int(vision.sum())))
    flat[:, 2] = P + 3                          # a text token past the table: NaN on every pair
    pos = flat.reshape(3, B, S).astype(np.int32)
    q, k = cp.asarray(_to_layout(qh, layout)), cp.asarray(_to_layout(kh, layout))
    dpos = cp.asarray(pos[:, 0] if layout == "thd" else pos)
    q_out, k_out = poisoned(cp, q.shape, DTYPES["bfloat16"]), poisoned(cp, k.shape, DTYPES["bfloat16"])
    rope_rtc.apply_mrope_qk(q, k, cp.asarray(cos), cp.asarray(sin), dpos, section,
                            interleaved_sections=interleaved_sections, layout=layout, q_out=q_out, k_out=k_out)
    good = np.ones(B * S, bool)
    good[2] = False
    for out, host, h in ((q_out, qh, HQ), (k_out, kh, HK)):
        actual = _from_layout(cp.asnumpy(out), layout, B, S).reshape(B * S, h, D)
        want = mrope_kernel_arithmetic(host.reshape(B * S, h, D)[good], cos, sin, flat[:, good], section,
                                       interleaved_sections=interleaved_sections)
        np.testing.assert_array_equal(bits(actual[good]), bits(want))
        assert np.isnan(actual[2]).all()


@pytest.mark.parametrize("interleaved_sections", [False, True])
def test_one_calls_with_new_arrays_take_the_repeat_path_and_match_a_fresh_thread(interleaved_sections):
    """apply_mrope_qk on new arrays every call: from a signature's second call the thread's generated
    path launches; every call's bits equal the same call's in a thread that has seen nothing."""
    import cupy as cp

    import rope_rtc
    from rope_rtc.ops import mrope

    T = 9
    cos, sin = (cp.asarray(t) for t in host_tables(P, D // 2, 31))
    rng = np.random.default_rng(32)
    calls = []
    for i in range(6):
        q, k = cp.asarray(host_random((T, HQ, D), DTYPES["bfloat16"], 40 + i)), \
            cp.asarray(host_random((T, HK, D), DTYPES["bfloat16"], 50 + i))
        pos = cp.asarray(rng.integers(0, P, (3, T)).astype(np.int64))
        calls.append((q, k, pos, q.copy(), k.copy()))
    for q, k, pos, _, _ in calls:
        rope_rtc.apply_mrope_qk(q, k, cos, sin, pos, SECTIONS[interleaved_sections],
                                interleaved_sections=interleaved_sections, q_out=q, k_out=k)
    assert mrope.ONE_CALL.thread().last is not dispatch.NO_LAST
    for q, k, pos, q0, k0 in calls:
        mrope.ONE_CALL.forget()
        rope_rtc.apply_mrope_qk(q0, k0, cos, sin, pos, SECTIONS[interleaved_sections],
                                interleaved_sections=interleaved_sections, q_out=q0, k_out=k0)
        assert np.array_equal(bits(cp.asnumpy(q)), bits(cp.asnumpy(q0)))
        assert np.array_equal(bits(cp.asnumpy(k)), bits(cp.asnumpy(k0)))
