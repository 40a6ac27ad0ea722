"""``rope-rtc demo`` on a GPU: each blog kernel prepared once before it is timed."""

from __future__ import annotations

import pytest

from rope_rtc import demo

pytestmark = pytest.mark.gpu


def test_gpu_demo_prepares_each_blog_kernel_once_before_timing_it(monkeypatch, capsys):
    """A timed call only launches: validation and the packed table are built before the clock."""
    from rope_rtc.ops import blog

    calls = []
    real = blog.prepare_blog_variant

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(blog, "prepare_blog_variant", counting)
    assert demo.gpu_demo() == 0, capsys.readouterr().out
    # One preparation for the check, one for the timed calls, per blog kernel.
    assert sorted(calls) == sorted(2 * ["baseline", "vectorized", "fused"]), calls
