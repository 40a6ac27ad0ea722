"""The README's Python examples run as written: the first (NumPy) everywhere, the CuPy ones on a GPU."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 5


def test_first_example_runs_anywhere():
    assert "cupy" not in BLOCKS[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no GPU: the NumPy fallback says so once
        exec(compile(BLOCKS[0], "README.md[0]", "exec"), {})


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(1, len(BLOCKS)))
def test_gpu_examples_run(index):
    exec(compile(BLOCKS[index], f"README.md[{index}]", "exec"), {})
