"""Helpers shared by the GPU tests: seeded inputs, poisoned outputs, allocation and compile counters."""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
from helpers import bits  # noqa: F401 (the GPU tests import it from here)

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def host_random(shape, dtype, seed: int, scale: float = 1.0) -> np.ndarray:
    """Normal random data, never zeros, in ``dtype``."""
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def host_tables(rows: int, half: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    ang = np.random.default_rng(seed).uniform(-20.0, 20.0, (rows, half))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def cache_write_host(dtype: str, kind: str, kv_layout: str, seed: int, *, tokens: int, heads: tuple[int, int],
                     head_dim: int, blocks: int, block_size: int, rows: int, rotary_dim: int | None = None,
                     index_dtype=np.int32) -> dict:
    """Host inputs of a paged KV-cache write (``rope_and_cache``): q, k, v ``[tokens, H, head_dim]``
    of ``dtype``; cos/sin tables of ``rows`` rows for ``rotary_dim`` (default: the head); a random
    position per token; random slots, one skipped (-1) and one past the cache; both caches
    (``kv_layout``, FP8 kinds as uint8) filled with random bytes, so that every byte not written
    must stay as it is."""
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    hq, hk = heads
    host = dict(q=host_random((tokens, hq, head_dim), dt, seed + 1, 2.0),
                k=host_random((tokens, hk, head_dim), dt, seed + 2, 2.0),
                v=host_random((tokens, hk, head_dim), dt, seed + 3, 2.0))
    host["cos"], host["sin"] = host_tables(rows, (rotary_dim or head_dim) // 2, seed + 4)
    host["positions"] = rng.integers(0, rows, tokens).astype(index_dtype)
    slots = rng.permutation(blocks * block_size)[:tokens].astype(index_dtype)
    slots[2], slots[5] = -1, blocks * block_size + 3  # a skipped token, and a device slot past the cache
    host["slot_mapping"] = slots
    shape = (blocks, block_size, hk, head_dim) if kv_layout == "nhd" else (blocks, hk, block_size, head_dim)
    cache_dt = np.uint8 if kind != "auto" else dt
    for name in ("k_cache", "v_cache"):
        raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(cache_dt).itemsize, dtype=np.uint8)
        host[name] = raw.view(cache_dt).reshape(shape)
    return host


def poisoned(cp, shape, dtype):
    """An output buffer full of NaN: an element the kernel fails to write stays NaN."""
    return cp.full(shape, np.nan, dtype=dtype)


@contextlib.contextmanager
def count_allocations(cp):
    """Count device allocations made inside the block (through CuPy's allocator)."""
    pool = cp.get_default_memory_pool()
    calls = [0]

    def alloc(nbytes):
        calls[0] += 1
        return pool.malloc(nbytes)

    cp.cuda.set_allocator(alloc)
    try:
        yield calls
    finally:
        cp.cuda.set_allocator(pool.malloc)


@contextlib.contextmanager
def count_compiles(monkeypatch):
    """Count NVRTC compilations made inside the block."""
    from rope_rtc.build import kernels as build

    calls = [0]
    real = build.compile_source

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(build, "compile_source", counting)
    yield calls


def busy_stream_kernel(cp):
    """A kernel that keeps a stream busy for roughly ``cycles`` clocks (stream-ordering tests)."""
    return cp.RawKernel(
        r'''extern "C" __global__ void spin(long long cycles) {
            long long start = clock64();
            while (clock64() - start < cycles) { }
        }''',
        "spin",
    )


def keep_busy(cp, stream, cycles: int = 200_000_000) -> None:
    """Queue ``cycles`` clocks of spinning on ``stream`` (the default, about 0.1 s): work queued
    after it on that stream waits, as it does when other processes share the GPU."""
    with stream:
        busy_stream_kernel(cp)((1,), (1,), (np.int64(cycles),))


def fill_behind_busy_kernel(cp, stream, dst, host: np.ndarray):
    """Queue about 0.1 s of spinning on ``stream``, then the copy of ``host`` into ``dst`` on it.

    The copy is from pinned memory, so it really waits in the stream. Returns the pinned buffer:
    keep it until the stream has run."""
    pinned = cp.cuda.alloc_pinned_memory(host.nbytes)
    src = np.frombuffer(pinned, host.dtype, host.size).reshape(host.shape)
    src[...] = host
    keep_busy(cp, stream)
    dst.set(src, stream=stream)
    return pinned


def after_current_stream(cp, stream) -> None:
    """Make ``stream`` wait for everything queued so far on CuPy's current stream.

    ``cp.asarray(host)`` (a copy staged through pinned memory), ``cp.full`` and ``x[...] = y``
    fill arrays asynchronously on the current stream (the legacy default stream outside a
    ``with stream:`` block), and a stream made with ``non_blocking=True`` does not wait for the legacy stream: a
    launch on it may read an input, or write an output, before such a fill lands there. Call it
    outside ``with stream:`` (inside, the current stream is ``stream`` itself)."""
    stream.wait_event(cp.cuda.get_current_stream().record())


def assert_half_split_qk(cp, outs, hosts, cos_h, sin_h, pos) -> None:
    """Each device output (q, k, ...) against the half-split NumPy reference of its host input."""
    from rope_rtc.reference import assert_rope_close, rope_reference

    for got, x in zip(outs, hosts):
        xc = x.reshape(-1, x.shape[2], x.shape[-1])
        assert_rope_close(cp.asnumpy(got).reshape(xc.shape), rope_reference(xc, cos_h, sin_h, pos, interleaved=False),
                          xc, interleaved=False, dtype=xc.dtype)
