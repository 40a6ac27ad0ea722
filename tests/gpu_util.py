"""Helpers shared by the GPU tests: seeded inputs, poisoned outputs, allocation and compile counters."""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def host_random(shape, dtype, seed: int, scale: float = 1.0) -> np.ndarray:
    """Normal random data, never zeros, in ``dtype``."""
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def host_tables(rows: int, half: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    ang = np.random.default_rng(seed).uniform(-20.0, 20.0, (rows, half))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def poisoned(cp, shape, dtype):
    """An output buffer full of NaN: an element the kernel fails to write stays NaN."""
    return cp.full(shape, np.nan, dtype=dtype)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


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
    from rope_rtc import build

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
