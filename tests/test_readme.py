"""The README and docs/ as a user meets them: the README is a front page whose commands CI runs,
every Python example runs as written (the README's first, NumPy, and the docs' CPU ones
everywhere; the others on a GPU, in test_gpu_readme.py), shell lines are safe to paste, and the pages read as a product.

A docs page marks each Python example with the line before its fence: ``<!-- example: cpu -->``
(runs anywhere) or ``<!-- example: gpu -->`` (needs a GPU and CuPy)."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

import rope_rtc

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
TEXT = {page: page.read_text() for page in PAGES}

PYTHON = re.compile(r"```python\n(.*?)```", re.S)
MARKED = re.compile(r"<!-- example: (\w+) -->\n```python\n(.*?)```", re.S)
BASH = re.compile(r"```bash\n(.*?)```", re.S)

BLOCKS = PYTHON.findall(TEXT[README])
DOC_EXAMPLES = [(f"{page.name}[{i}]", kind, code)
                for page in DOCS for i, (kind, code) in enumerate(MARKED.findall(TEXT[page]))]
GPU_EXAMPLES = ([(f"README.md[{i}]", code) for i, code in enumerate(BLOCKS) if i > 0]
                + [(name, code) for name, kind, code in DOC_EXAMPLES if kind == "gpu"])
CPU_EXAMPLES = [(name, code) for name, kind, code in DOC_EXAMPLES if kind == "cpu"]
SHELL_BLOCKS = [block for page in PAGES for block in BASH.findall(TEXT[page])]

# Words that narrate how the work was done rather than what the product is (git keeps history).
NOTEBOOK = re.compile(r"\bsessions? [0-9]|\brun [0-9]+\b|superseded|\b(this|that|another|other) instances?\b|"
                      r"instances of the same|\$OUT\b|probe run|no package index", re.I)
# Calls whose 4-d arrays need layout= (a [B, S, H, D] array looks like a [B, H, S, D] one).
LAYOUT_CALLS = {"apply_rope", "apply_rope_qk", "RopePlan", "apply_qk_norm_rope", "QKNormRopePlan"}


def _run(name: str, code: str) -> None:
    exec(compile(code, name, "exec"), {"__name__": f"example {name}"})


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_is_a_front_page():
    lines = TEXT[README].splitlines()
    assert len(lines) < 250, f"README has {len(lines)} lines: move reference material to docs/"
    first_code = next(i for i, ln in enumerate(lines) if ln == "```python")
    assert first_code < 40, f"the first example starts at line {first_code + 1}, past the first screen"
    quick = PYTHON.findall(_section(TEXT[README], "Quick start"))
    assert len(quick) >= 2, "the quick start shows NumPy and a torch tensor"
    code_lines = [ln for block in quick for ln in block.splitlines() if ln.strip()]
    assert len(code_lines) <= 15, f"the quick start has {len(code_lines)} lines of code"


def test_readme_holds_the_commands_ci_runs():
    """.ci/run runs the line after each '# README: ...' comment: the README must show it as is."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [ci[i + 1].strip() for i, ln in enumerate(ci[:-1]) if ln.startswith("# README:")]
    assert len(commands) >= 2
    shown = {ln.split(" #", 1)[0].strip() for block in BASH.findall(TEXT[README]) for ln in block.splitlines()}
    missing = [c for c in commands if c not in shown]
    assert not missing, f"README's shell blocks lack what CI runs: {missing}"


def test_readme_has_examples():
    assert len(BLOCKS) >= 2
    assert len(GPU_EXAMPLES) >= 10, "the docs pages lost their examples, or their markers"


def test_first_example_runs_anywhere():
    assert "cupy" not in BLOCKS[0] and "torch" not in BLOCKS[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no GPU: the NumPy fallback says so once
        _run("README.md[0]", BLOCKS[0])


@pytest.mark.parametrize(("name", "code"), CPU_EXAMPLES, ids=[n for n, _ in CPU_EXAMPLES])
def test_cpu_examples_run_anywhere(name, code):
    assert "cupy" not in code and "torch" not in code, f"{name} is marked cpu but needs a GPU library"
    _run(name, code)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_examples_say_where_they_run(page):
    blocks, marked = PYTHON.findall(TEXT[page]), MARKED.findall(TEXT[page])
    assert len(blocks) == len(marked), (f"{page.name}: put <!-- example: cpu --> or <!-- example: gpu --> on the "
                                        "line before each ```python fence (or fence a snippet as ```text)")
    assert {kind for kind, _ in marked} <= {"cpu", "gpu"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_examples_name_the_layout_of_their_arrays(page):
    missing = []
    for code in PYTHON.findall(TEXT[page]):
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                if name in LAYOUT_CALLS and not any(kw.arg == "layout" for kw in node.keywords):
                    missing.append(ast.unparse(node)[:80])
    assert not missing, f"{page.name}: pass layout= explicitly: {missing}"


def test_every_public_name_is_documented():
    docs = "\n".join(TEXT.values())
    missing = [name for name in rope_rtc.__all__ if name != "__version__" and f"`{name}" not in docs
               and f"rope_rtc.{name}" not in docs]
    assert not missing, f"no page documents {missing}"


def test_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\(docs/([^)#\s]+)", TEXT[README]))
    unlinked = [p.name for p in DOCS if p.name not in linked]
    assert not unlinked, f"README does not link {unlinked}"


def test_shell_lines_run_one_rope_rtc_command_each():
    """A pasted line must not chain commands: `list | verify | clear` once emptied a user's cache."""
    lines = [ln.split(" #", 1)[0] for block in SHELL_BLOCKS for ln in block.splitlines()]
    assert any("rope-rtc cache list" in ln for ln in lines)
    chained = [ln for ln in lines if ln.count("rope-rtc") > 1]
    assert not chained, f"one command per line: {chained}"


def test_no_shell_block_clears_the_cache():
    """Pasting a whole block of commands must never be destructive."""
    assert not [b for b in SHELL_BLOCKS if "cache clear" in b]


def test_no_page_asks_for_interleaved_where_the_model_type_says_so():
    """`warm --model` reads adjacent-pair models (Cohere, GLM, Llama 4, ...) from their model_type."""
    hits = [ln for page in PAGES for ln in TEXT[page].splitlines() if re.search(r"\bneeds? `--interleaved`", ln)]
    assert not hits, hits


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_read_as_a_product_not_a_notebook(page):
    hits = [ln for ln in TEXT[page].splitlines() if NOTEBOOK.search(ln)]
    assert not hits, f"{page.name}: {hits[:3]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", TEXT[page])
    local = [t for t in targets if "://" not in t]
    missing = [t for t in local if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"
