"""The wording helpers of error messages (rope_rtc.errors): a single choice is not "one of" it,
and a count agrees with its words."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import FakeDeviceArray
from rope_rtc.core import arrays as A
from rope_rtc.errors import count, one_of


def test_one_of_a_single_choice_is_that_choice():
    assert one_of(("float32",)) == "float32"
    assert one_of(["int32", "int64"]) == "one of int32, int64"
    assert one_of(map(repr, ("nhd", "hnd"))) == "one of 'nhd', 'hnd'"


def test_count_agrees_with_its_number():
    assert count(1, "of them is", "of them are") == "1 of them is"
    assert count(2, "of them is", "of them are") == "2 of them are"
    assert count(0, "entry", "entries") == "0 entries"


@pytest.mark.parametrize("allowed,expected", [
    (("float32",), "expected float32$"),
    (("int32", "int64"), "expected one of int32, int64$"),
])
def test_a_dtype_check_offers_one_of_several_choices_only(allowed, expected):
    info = A.describe(FakeDeviceArray((4,), np.float16), "cos")
    with pytest.raises(TypeError, match=rf"cos: dtype float16 is not supported; {expected}"):
        A.check_dtype(info, allowed)
