"""The maintainer's pages stay what they are for: docs/design.md opens with the picture of a
call and maps every module; docs/performance.md is a product page whose figures live on the
generated benchmark page; code comments give reasons, not measured figures; every repository
path a comment or page names exists."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PERFORMANCE_LINES = 200
DESIGN_LINES = 250
# A figure in microseconds (0.3 µs, 5-8 us): measured on one host, stale on the next.
MICROSECONDS = re.compile(r"\d\s?(µs|us)\b")
# The package's layers, top to bottom: each folder's modules are mapped one by one.
LAYER_FOLDERS = ("ops", "core", "numerics", "build")


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_design_opens_with_the_picture_and_maps_every_module():
    text = (DOCS / "design.md").read_text()
    assert len(text.splitlines()) <= DESIGN_LINES
    before_first_section = text[: text.index("\n## ")]
    assert "```" in before_first_section, "the picture of a call comes before the first section"
    picture = before_first_section.split("```")[1]
    for stage in ("validation", "argument block", "launcher", "driver", "registry", "sources", "compiler",
                  "NVRTC", "disk"):
        assert stage in picture, stage
    modules = _section(text, "Modules")
    package = REPO / "rope_rtc"
    # The top level and each layer folder, module by module; a package inside them (benchmark/,
    # build/cache/) is named as a whole.
    folders = [package] + [package / layer for layer in LAYER_FOLDERS]
    assert all((f / "__init__.py").is_file() for f in folders), "a layer folder is missing"
    names = [p.stem for f in folders for p in f.glob("*.py") if p.name != "__init__.py" or f == package]
    names += [p.name for f in folders for p in f.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    missing = sorted(n for n in names if f"`{n}`" not in modules and f"`{n}/`" not in modules)
    assert not missing, f"docs/design.md's module map lacks {missing}"


def test_performance_page_is_a_product_page():
    text = (DOCS / "performance.md").read_text()
    assert len(text.splitlines()) <= PERFORMANCE_LINES
    assert "benchmarks.md" in text
    for diary in ("not kept", "the run before", "round 1", "rounds 1", "superseded", "shipped:"):
        assert diary not in text.lower(), diary


def test_links_of_the_maintainers_pages_resolve():
    for page in ("design.md", "performance.md"):
        text = (DOCS / page).read_text()
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if "://" in target:
                continue
            assert (DOCS / target).exists(), f"{page} links to {target}, which does not exist"


def _python_comments_and_docstrings(path: Path):
    source = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc


def _cuda_comments(path: Path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if "//" in line:
            yield number, line[line.index("//"):]


def _code_comments() -> list[tuple[Path, int, str]]:
    """(file, line, text) of every comment and docstring of the package and the CUDA sources."""
    found = []
    for path in sorted((REPO / "rope_rtc").rglob("*.py")):
        found += [(path, n, t) for n, t in _python_comments_and_docstrings(path)]
    for path in sorted((REPO / "cuda_src").iterdir()):
        if path.suffix in (".cu", ".cuh"):
            found += [(path, n, t) for n, t in _cuda_comments(path)]
    return found


def test_code_comments_quote_no_measured_figures_and_no_performance_page():
    found = _code_comments()
    bad = [f"{p.relative_to(REPO)}:{n}: {t.strip()[:80]}" for p, n, t in found
           if MICROSECONDS.search(t) or "docs/performance.md" in t]
    assert not bad, "comments quoting measured figures or docs/performance.md:\n" + "\n".join(bad)


# A repository path a comment, docstring or page names: rope_rtc/ops/rope.py, cuda_src/rope.cu,
# benchmarks/probes/kernel_case.py, scripts/bench.py.
# Not inside a longer path or an address (github.com/x/y/blob/main/tests/...).
NAMED_PATH = re.compile(r"(?<![\w/.-])((?:rope_rtc|cuda_src|benchmarks|scripts|tests)/[\w/]*\w\.(?:py|cu|cuh|sh|md))\b")


def test_every_repository_path_a_comment_or_page_names_exists():
    """A module moved without its mentions sends a newcomer to a file that is not there."""
    found = [(p, n, t) for p, n, t in _code_comments() if p.suffix == ".py"]
    texts = [REPO / "README.md", *sorted(DOCS.glob("*.md")), *sorted((REPO / "benchmarks").rglob("*.md"))]
    texts += [p for p in sorted((REPO / "cuda_src").iterdir()) if p.suffix in (".cu", ".cuh")]  # #error lines too
    for path in texts:
        found += [(path, n, line) for n, line in enumerate(path.read_text().splitlines(), 1)]
    bad = [f"{p.relative_to(REPO)}:{n}: {m}" for p, n, t in found for m in NAMED_PATH.findall(t)
           if not (REPO / m).exists()]
    assert not bad, "paths that do not exist:\n" + "\n".join(bad)
