"""The environment switches: each one parsed, and each one documented in the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rope_rtc import env

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_every_switch_is_in_the_readme():
    names = set(re.findall(r"``(ROPE_RTC_[A-Z_]+)", env.__doc__))
    assert "ROPE_RTC_NO_GRAPH_REPLAY" in names
    missing = [n for n in sorted(names) if f"`{n}" not in README]
    assert not missing, f"README's table lacks {missing}"


@pytest.mark.parametrize("value,expected", [("1", True), ("yes", True), ("0", False), ("", False), ("off", False)])
def test_no_graph_replay_flag(monkeypatch, value, expected):
    monkeypatch.setenv("ROPE_RTC_NO_GRAPH_REPLAY", value)
    assert env.settings().no_graph_replay is expected
