"""Fixtures shared by the cache, cache-trust and CLI tests (import them into a test module).

``isolated`` (autouse where imported): no ROPE_RTC_* switch leaks in from the environment, a
private default cache directory, and fresh process-wide store and warning memories.
``compiles``: the kernel names of every NVRTC compile the build lifecycle makes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rope_rtc import build
from rope_rtc.cache import store as store_mod
from rope_rtc.cache.store import CacheStore, DiskStore


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("ROPE_RTC_") and name != "ROPE_RTC_REQUIRE_GPU":
            monkeypatch.delenv(name)
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path / "default-cache"))
    monkeypatch.setattr(store_mod, "_stores", {})
    monkeypatch.setattr(store_mod, "_warned", set())


@pytest.fixture
def compiles(monkeypatch):
    """Count the NVRTC compiles the build lifecycle makes."""
    calls: list[str] = []
    real = build.compile_source

    def spy(kernel, *args, **kwargs):
        calls.append(kernel)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(build, "compile_source", spy)
    return calls


def fresh_store(directory: Path, **kw) -> CacheStore:
    """A store with an empty memory layer, as a new process would have."""
    return CacheStore(DiskStore(directory, **kw))
