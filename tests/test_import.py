"""``import rope_rtc`` is cheap and GPU-free; its version is the one packaging reports."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rope_rtc

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys, time
t0 = time.perf_counter()
import {modules}
elapsed = time.perf_counter() - t0
heavy = sorted(m for m in sys.modules
               if m == "cupy" or m.startswith("cupy.") or m.startswith("cuda.bindings.driver")
               or m.startswith("cuda.bindings.runtime") or m == "torch" or m == "jax")
print(json.dumps({{"heavy": heavy, "seconds": elapsed}}))
"""


def fresh_interpreter(code: str):
    """What ``code`` prints last, as JSON, run in a fresh interpreter on this checkout (no
    ``ROPE_RTC_*`` setting)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_RTC_")}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def probe(modules: str) -> dict:
    return fresh_interpreter(PROBE.format(modules=modules))


def test_import_rope_rtc_loads_neither_cupy_nor_the_cuda_driver():
    result = probe("rope_rtc")
    assert result["heavy"] == []
    assert result["seconds"] < 1.0, f"import rope_rtc took {result['seconds']:.2f} s"


def test_offline_tooling_imports_no_device_library():
    """The cache, the compiler, warm and the CLI run on build machines without a GPU."""
    result = probe("rope_rtc.cli, rope_rtc.warm, rope_rtc.build.kernels, rope_rtc.build.compiler, rope_rtc.build.cache, "
                   "rope_rtc.build.registry")
    assert result["heavy"] == []


def _pyproject() -> dict:
    text = (REPO / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads(text)


def test_version_matches_the_dynamic_version_in_pyproject():
    meta = _pyproject()
    assert "version" in meta["project"]["dynamic"]
    attr = meta["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module, _, name = attr.rpartition(".")
    assert getattr(importlib.import_module(module), name) == rope_rtc.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?(a|b|rc|dev|post)\d*)?", rope_rtc.__version__)


def test_installed_metadata_agrees_when_installed():
    try:
        installed = importlib.metadata.version("rope-rtc")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("rope-rtc is not installed in this environment (running from a checkout)")
    assert installed == rope_rtc.__version__, "stale installed metadata: reinstall (pip install -e .)"


def test_console_script_points_at_the_cli():
    meta = _pyproject()
    target = meta["project"]["scripts"]["rope-rtc"]
    module, _, func = target.partition(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_lazy_exports_resolve_and_unknown_names_raise():
    assert rope_rtc.KernelNotCachedError.__name__ == "KernelNotCachedError"
    assert rope_rtc.CompileError.__module__ == "rope_rtc.errors"
    assert "__version__" in rope_rtc.__all__
    with pytest.raises(AttributeError, match="no_such_name"):
        rope_rtc.no_such_name  # noqa: B018



# -- public import paths ------------------------------------------------------------------------

# Modules users import by path; the code lives in the layer folders, these paths are aliases of it.
PUBLIC_MODULES = {"rope_rtc.tables": "rope_rtc.numerics.tables", "rope_rtc.reference": "rope_rtc.numerics.reference",
                  "rope_rtc.onnx": "rope_rtc.ops.onnx", "rope_rtc.blog": "rope_rtc.ops.blog"}
ALIASES = """
import importlib, json, sys
public = {public!r}
order = {order!r}
seen = {{}}
for name in order:
    importlib.import_module(name)
import rope_rtc
for alias, real in public.items():
    seen[alias] = (sys.modules[alias] is sys.modules[real]
                   and getattr(rope_rtc, alias.rpartition(".")[2]) is sys.modules[real])
print(json.dumps(seen))
"""


@pytest.mark.parametrize("alias_first", [True, False], ids=["alias-first", "real-first"])
def test_public_module_paths_are_the_real_modules(alias_first):
    """``import rope_rtc.tables`` (and ``reference``, ``onnx``) gives the module in its layer folder,
    imported first or second, in a fresh interpreter, and ``rope_rtc.tables`` is that module too."""
    order = list(PUBLIC_MODULES) + list(PUBLIC_MODULES.values())
    if not alias_first:
        order.reverse()
    seen = fresh_interpreter(ALIASES.format(public=PUBLIC_MODULES, order=order))
    assert seen == {alias: True for alias in PUBLIC_MODULES}


ATTRIBUTE_PATHS = """
import json, sys
import rope_rtc
got = {{}}
for name in {names!r}:
    module = getattr(rope_rtc, name)
    got[name] = module.__name__
got["heavy"] = sorted(m for m in sys.modules if m == "cupy" or m.startswith("cupy.") or m == "torch" or m == "jax")
print(json.dumps(got))
"""


def test_public_modules_are_attributes_after_import_rope_rtc_alone():
    """``import rope_rtc`` then ``rope_rtc.tables.cos_sin_cache`` (or ``rope_rtc.reference``,
    ``rope_rtc.onnx``, ``rope_rtc.blog``, ``rope_rtc.errors``), as the docs write them, in a fresh
    interpreter where nothing imported those modules first: each resolves to its module on first
    use, loading no device library."""
    names = [alias.rpartition(".")[2] for alias in PUBLIC_MODULES] + ["errors"]
    want = {**{alias.rpartition(".")[2]: real for alias, real in PUBLIC_MODULES.items()},
            "errors": "rope_rtc.errors", "heavy": []}
    assert fresh_interpreter(ATTRIBUTE_PATHS.format(names=names)) == want


def test_public_paths_import(monkeypatch):
    """Every public name resolves through ``rope_rtc``; the public module paths are the real modules,
    so ``from rope_rtc.tables import _private`` and a monkeypatch through the public path reach the code."""
    import rope_rtc.numerics.reference
    import rope_rtc.numerics.tables
    import rope_rtc.ops.onnx
    import rope_rtc.reference
    import rope_rtc.tables
    from rope_rtc import onnx, reference, tables
    from rope_rtc.tables import _DEFAULT_BASE

    for name in rope_rtc.__all__:
        assert getattr(rope_rtc, name) is not None, name
    for alias, real in PUBLIC_MODULES.items():
        assert importlib.import_module(alias) is importlib.import_module(real), alias
    assert rope_rtc.tables is tables is rope_rtc.numerics.tables
    assert rope_rtc.reference is reference is rope_rtc.numerics.reference
    assert rope_rtc.onnx is onnx is rope_rtc.ops.onnx
    assert _DEFAULT_BASE == rope_rtc.numerics.tables._DEFAULT_BASE
    monkeypatch.setattr("rope_rtc.tables._DEFAULT_BASE", 500000.0)
    assert rope_rtc.numerics.tables._DEFAULT_BASE == 500000.0
    assert rope_rtc.rope_tables is rope_rtc.numerics.tables.rope_tables
    import rope_rtc.numerics.axial

    assert rope_rtc.axial_tables is rope_rtc.numerics.axial.axial_tables
    assert rope_rtc.vision_positions is rope_rtc.numerics.axial.vision_positions
    assert rope_rtc.onnx.rotary_embedding.__module__ == "rope_rtc.ops.onnx"

# -- the module import graph -------------------------------------------------------------------

PACKAGE = REPO / "rope_rtc"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_graph(package: Path = PACKAGE, *, module_level_only: bool = False) -> dict[str, set[str]]:
    """The library's modules and, for each, the library modules it imports: ``import x``,
    ``from x import y`` (``y`` counts as the module ``x.y`` where that is a module, else ``x``),
    at module level and, unless ``module_level_only``, inside functions and classes too."""
    files = {_module_name(p, package.parent): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = tree.body if module_level_only else ast.walk(tree)
        if module_level_only:  # module level includes the bodies of its try/if blocks
            nodes, todo = [], list(tree.body)
            while todo:
                node = todo.pop()
                nodes.append(node)
                if isinstance(node, (ast.If, ast.Try)):
                    todo.extend(node.body + node.orelse + getattr(node, "finalbody", [])
                                + [n for h in getattr(node, "handlers", []) for n in h.body])
        for node in nodes:
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node.level, node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_import_graph_reads_this_package():
    graph = import_graph()
    assert "rope_rtc.core.dtypes" in graph["rope_rtc.core.arrays"]
    assert "rope_rtc.core.descriptors" in graph["rope_rtc.core.arrays"]
    assert "rope_rtc.build.cache.store" in graph and "rope_rtc.errors" in graph["rope_rtc.core.descriptors"]


@pytest.mark.parametrize("module_level_only", [True, False], ids=["module-level", "every-import"])
def test_arrays_and_descriptors_do_not_import_each_other(module_level_only):
    """``arrays`` checks arrays and declarations; ``descriptors`` declares them: one direction only,
    counting imports inside functions too (a deferred import is still a cycle in the design)."""
    graph = import_graph(module_level_only=module_level_only)
    assert "rope_rtc.core.arrays" not in graph["rope_rtc.core.descriptors"]
    for cycle in import_cycles(graph):
        assert not {"rope_rtc.core.arrays", "rope_rtc.core.descriptors"} & set(cycle), cycle


@pytest.mark.parametrize("module_level_only", [True, False], ids=["module-level", "every-import"])
def test_the_library_has_no_import_cycle(module_level_only):
    """Modules import downwards only (docs/design.md): a cycle anywhere names its modules here."""
    assert import_cycles(import_graph(module_level_only=module_level_only)) == []


# What each layer of the package may import besides itself (docs/design.md, "Imports, top to
# bottom"): ops -> core -> build, with numerics beside core (the references and model configs
# name the registry's builds), and errors, env and _version under everything. The top level (the
# tools, the benchmark, the public aliases) may import any of them.
LAYERS = {"ops": {"core", "build", "numerics", "leaf"}, "core": {"build", "numerics", "leaf"},
          "numerics": {"build", "leaf"}, "build": {"leaf"}, "leaf": {"leaf"}}


def _layer(module: str) -> str:
    part = module.split(".")[1] if "." in module else ""
    if part in ("errors", "env", "_version"):
        return "leaf"
    return part if part in LAYERS else "top"


@pytest.mark.parametrize("module_level_only", [True, False], ids=["module-level", "every-import"])
def test_the_layers_import_downwards_only(module_level_only):
    """An arrow between the folders only ever points down: no build module imports an op, no core
    module imports an op, nothing below the tools imports them."""
    upward = []
    for importer, imported in import_graph(module_level_only=module_level_only).items():
        here = _layer(importer)
        if importer == "rope_rtc" or here == "top":
            continue
        upward += [f"{importer} -> {m}" for m in sorted(imported) if _layer(m) not in LAYERS[here] | {here}]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)

def test_the_dtype_names_keep_their_import_path_through_arrays():
    from rope_rtc.core import arrays, descriptors, dtypes

    assert arrays.dtype_name is dtypes.dtype_name and arrays.numpy_dtype is dtypes.numpy_dtype
    assert arrays.BFLOAT16 is dtypes.BFLOAT16 and arrays.FLOAT_DTYPES is dtypes.FLOAT_DTYPES
    assert rope_rtc.TensorDesc is descriptors.TensorDesc


if __name__ == "__main__":  # python tests/test_import.py: every cycle of the library's imports
    for only in (True, False):
        print("module-level imports" if only else "every import (functions' too)")
        for cycle in import_cycles(import_graph(module_level_only=only)) or [["none"]]:
            print("  " + " <-> ".join(cycle))

# The benchmark's entry point (``rope-rtc bench``, ``python -m rope_rtc.bench``): part of the
# benchmark, kept beside the library only so that its module name is short.
BENCHMARK_ENTRY_POINTS = {"rope_rtc/bench.py"}


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module of the rope_rtc package."""
    import ast

    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            # ``from . import benchmark`` names the package in the alias.
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


def test_no_library_module_imports_the_benchmark():
    """The dependency points one way: the benchmark imports the library, never the reverse, so the
    library (and the demo) run where the benchmark's modules are absent or broken."""
    offenders = []
    for path in sorted((REPO / "rope_rtc").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("rope_rtc/benchmark/") or rel in BENCHMARK_ENTRY_POINTS:
            continue
        for line, name in _imported_modules(path):
            if name == "rope_rtc.benchmark" or name.startswith("rope_rtc.benchmark."):
                offenders.append(f"{rel}:{line} imports {name}")
    assert not offenders, "library modules import the benchmark:\n" + "\n".join(offenders)


def test_the_import_scan_sees_relative_and_absolute_imports(tmp_path, monkeypatch):
    sample = REPO / "rope_rtc" / "demo.py"
    names = {name for _, name in _imported_modules(sample)}
    assert "rope_rtc.measure" in names and "rope_rtc.ops.rope" in names  # relative imports resolved
    fake = tmp_path / "rope_rtc" / "sub" / "mod.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from .. import benchmark\nfrom ..benchmark.runner import x\nimport rope_rtc.benchmark.cli\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    names = {name for _, name in _imported_modules(fake)}
    assert {"rope_rtc.benchmark", "rope_rtc.benchmark.runner", "rope_rtc.benchmark.cli"} <= names

