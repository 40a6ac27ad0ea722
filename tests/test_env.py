"""The environment switches: each one parsed, and each one documented on the cache page (docs/cache.md)."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest

from rope_rtc import env

CACHE_PAGE = (Path(__file__).resolve().parent.parent / "docs" / "cache.md").read_text()

#: (variable, Settings attribute) of every on/off switch
FLAGS = [
    ("ROPE_RTC_DISABLE_DISK_CACHE", "disable_disk_cache"),
    ("ROPE_RTC_NO_COMPILE", "no_compile"),
    ("ROPE_RTC_SAVE_SOURCE", "save_source"),
    ("ROPE_RTC_LOG_COMPILES", "log_compiles"),
    ("ROPE_RTC_TRUST_SHARED_CACHE", "trust_shared_cache"),
    ("ROPE_RTC_NO_GRAPH_REPLAY", "no_graph_replay"),
    ("ROPE_RTC_CHECK_POSITIONS", "check_positions"),
]
STRICT_FLAGS = [f for f in FLAGS if f[0] != "ROPE_RTC_TRUST_SHARED_CACHE"]
ON = ["1", "true", "yes", "on", "TRUE", "Yes", "ON", " on ", "oN"]
OFF = ["0", "false", "no", "off", "", "FALSE", "No", "OFF", " 0 ", "  "]
UNKNOWN = ["disabled", "none", "2", "enable", "y", "n", "-1", "1.0", "true!", "ja", "null"]


@pytest.fixture(autouse=True)
def _no_switches(monkeypatch):
    for name in list(os.environ):
        if name.startswith("ROPE_RTC_"):
            monkeypatch.delenv(name)


def test_every_switch_is_on_the_cache_page():
    names = set(re.findall(r"``(ROPE_RTC_[A-Z_]+)", env.__doc__))
    assert {"ROPE_RTC_NO_GRAPH_REPLAY", "ROPE_RTC_CHECK_POSITIONS"} <= names
    missing = [n for n in sorted(names) if f"`{n}" not in CACHE_PAGE]
    assert not missing, f"docs/cache.md's table lacks {missing}"


def test_every_switch_is_documented_and_read():
    documented = set(re.findall(r"``(ROPE_RTC_[A-Z_]+)", env.__doc__))
    assert documented == set(env.VARIABLES)
    assert {name for name, _ in FLAGS} <= documented


def test_cache_page_states_the_accepted_switch_values():
    for word in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        assert f"`{word}`" in CACHE_PAGE, f"docs/cache.md does not list the switch value `{word}`"


@pytest.mark.parametrize(("variable", "attribute"), FLAGS)
def test_unset_switch_is_off(variable, attribute):
    assert getattr(env.settings(), attribute) is False


@pytest.mark.parametrize(("variable", "attribute"), FLAGS)
@pytest.mark.parametrize("value", ON)
def test_switch_on_words(monkeypatch, variable, attribute, value):
    monkeypatch.setenv(variable, value)
    assert getattr(env.settings(), attribute) is True


@pytest.mark.parametrize(("variable", "attribute"), FLAGS)
@pytest.mark.parametrize("value", OFF)
def test_switch_off_words(monkeypatch, variable, attribute, value):
    monkeypatch.setenv(variable, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(env.settings(), attribute) is False


@pytest.mark.parametrize(("variable", "attribute"), STRICT_FLAGS)
@pytest.mark.parametrize("value", UNKNOWN)
def test_unknown_switch_value_is_an_error_naming_the_variable(monkeypatch, variable, attribute, value):
    # Before: every value but ""/0/false/no/off counted as on (NO_COMPILE=disabled forbade compiling).
    monkeypatch.setenv(variable, value)
    s = env.settings()
    with pytest.raises(ValueError) as info:
        getattr(s, attribute)
    message = str(info.value)
    assert variable in message and repr(value) in message
    for word in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        assert re.search(rf"\b{word}\b", message), message


def test_unknown_value_raises_only_where_that_switch_is_read(monkeypatch):
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "disabled")
    monkeypatch.setenv("ROPE_RTC_NO_GRAPH_REPLAY", "1")
    s = env.settings()  # reading the environment is not reading that switch
    assert s.no_graph_replay is True and s.disable_disk_cache is False
    with pytest.raises(ValueError, match="ROPE_RTC_NO_COMPILE"):
        s.no_compile


@pytest.mark.parametrize("value", UNKNOWN)
def test_unknown_trust_value_is_off_with_a_warning(monkeypatch, value):
    # Before: ROPE_RTC_TRUST_SHARED_CACHE=none trusted (and loaded) a mode-666 entry.
    monkeypatch.setenv("ROPE_RTC_TRUST_SHARED_CACHE", value)
    with pytest.warns(UserWarning, match=r"ROPE_RTC_TRUST_SHARED_CACHE=.*not trusted"):
        assert env.settings().trust_shared_cache is False


def test_settings_are_a_snapshot(monkeypatch):
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "1")
    s = env.settings()
    monkeypatch.setenv("ROPE_RTC_NO_COMPILE", "0")
    assert s.no_compile is True and env.settings().no_compile is False


# --------------------------------------------------------------------------- ROPE_RTC_CACHE_DIR


def test_cache_dir_unset_or_empty_is_the_default(monkeypatch):
    assert env.settings().cache_dir is None
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", "")
    assert env.settings().cache_dir is None


def test_cache_dir_absolute_and_home_relative(monkeypatch, tmp_path):
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", str(tmp_path / "c"))
    assert env.settings().cache_dir == str(tmp_path / "c")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", "~/cache")
    assert env.settings().cache_dir == str(tmp_path / "cache")


@pytest.mark.parametrize("value", ["false", "0", "1", "TRUE", "off", " no ", "Yes", "on"])
def test_cache_dir_switch_word_is_an_error(monkeypatch, value):
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", value)
    with pytest.raises(ValueError, match=r"ROPE_RTC_CACHE_DIR.*ROPE_RTC_DISABLE_DISK_CACHE"):
        env.settings().cache_dir


@pytest.mark.parametrize("value", ["cache", "./cache", "rope/cache", "."])
def test_cache_dir_relative_path_is_an_error(monkeypatch, value):
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", value)
    with pytest.raises(ValueError, match=r"ROPE_RTC_CACHE_DIR.*absolute"):
        env.settings().cache_dir


def test_cache_dir_false_creates_no_directory(monkeypatch, tmp_path):
    # Before: ROPE_RTC_CACHE_DIR=false put the cache in ./false/.
    from rope_rtc.build.cache import cache_root, open_store, versioned_cache_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ROPE_RTC_CACHE_DIR", "false")
    for call in (cache_root, versioned_cache_dir, open_store):
        with pytest.raises(ValueError, match="ROPE_RTC_CACHE_DIR"):
            call()
    assert list(tmp_path.iterdir()) == []
