"""The README's and docs/' Python examples that need a GPU and CuPy (``<!-- example: gpu -->``),
run as written; the CPU examples and the pages' other checks are in test_readme.py."""

from __future__ import annotations

import re

import pytest
from test_readme import GPU_EXAMPLES, _run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("name", "code"), GPU_EXAMPLES, ids=[n for n, _ in GPU_EXAMPLES])
def test_gpu_examples_run(name, code):
    for module in ("torch", "jax"):
        if re.search(rf"^import {module}", code, re.M):
            pytest.importorskip(module)
    _run(name, code)
