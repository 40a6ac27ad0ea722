"""The README as a user meets it: its Python examples run as written (the first, NumPy, everywhere;
the CuPy ones on a GPU), its shell lines are safe to paste, and it and docs/ read as a product."""

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


DOCS = sorted((README.parent / "docs").glob("*.md"))
SHELL_BLOCKS = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
# Words that narrate how the work was done rather than what the product is (git keeps history).
NOTEBOOK = re.compile(r"\bsessions? [0-9]|\brun [0-9]+\b|superseded|\b(this|that|another|other) instances?\b|"
                      r"instances of the same|\$OUT\b|probe run|no package index", re.I)


def test_shell_lines_run_one_rope_rtc_command_each():
    """A pasted line must not chain commands: `list | verify | clear` once emptied a user's cache."""
    lines = [ln.split(" #", 1)[0] for block in SHELL_BLOCKS for ln in block.splitlines()]
    assert any("rope-rtc cache list" in ln for ln in lines)
    chained = [ln for ln in lines if ln.count("rope-rtc") > 1]
    assert not chained, f"one command per line: {chained}"


def test_no_shell_block_clears_the_cache():
    """Pasting a whole block of commands must never be destructive."""
    assert not [b for b in SHELL_BLOCKS if "cache clear" in b]


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_pages_read_as_a_product_not_a_notebook(page):
    hits = [ln for ln in page.read_text().splitlines() if NOTEBOOK.search(ln)]
    assert not hits, f"{page.name}: {hits[:3]}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    targets = re.findall(r"\]\(([^)#\s]+)\)", page.read_text())
    local = [t for t in targets if "://" not in t]
    missing = [t for t in local if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"
