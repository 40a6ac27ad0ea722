"""The prepared-launch core as a whole (CPU: fake device arrays, recorded launches): the Python it
writes per template is readable in a traceback, one cold call validates once, and the ops reach
the core only through its public names."""

from __future__ import annotations

import ast
import gc
import linecache
import traceback
from pathlib import Path

import numpy as np
import pytest

from fakes import BF16, FakeGPU, fake_cupy
from rope_rtc.core import codegen
from rope_rtc.ops.rope_plan import RopePlan

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "rope_rtc"
B, HQ, HK, D, ROWS = 8, 32, 8, 128, 4096


def _calls_of_builtin(tree: ast.AST, names: set) -> list[int]:
    """Lines of calls to the builtins ``names`` (by bare name or through ``builtins.``)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in names:
            lines.append(node.lineno)
        elif (isinstance(f, ast.Attribute) and f.attr in names and isinstance(f.value, ast.Name)
              and f.value.id in ("builtins", "__builtins__")):
            lines.append(node.lineno)
    return lines


def test_only_the_code_generator_compiles_python_source():
    """Generated Python lives in one module (core/codegen.py), which files its source with
    linecache; nowhere else in the library runs ``exec``, ``eval`` or ``compile`` on a string."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "core" / "codegen.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        offenders += [f"{path.relative_to(REPO)}:{n}" for n in _calls_of_builtin(tree, {"exec", "eval", "compile"})]
    assert offenders == []
    assert _calls_of_builtin(ast.parse((PACKAGE / "core" / "codegen.py").read_text()), {"exec"})


def test_the_scan_sees_exec_and_compile():
    tree = ast.parse("exec(s)\nx = compile(s, 'f', 'exec')\nimport re\nre.compile('a')\nplan.compile()\n")
    assert _calls_of_builtin(tree, {"exec", "eval", "compile"}) == [1, 2]


def test_a_generated_function_has_a_readable_name_and_source():
    """Each function has its own file name, its qualified name, and linecache serves its source
    while it lives (and drops it after)."""
    one = codegen.generated("check", "x", "    return x.shape == (1,)\n", title="a check", qualname="Thing.check")
    two = codegen.generated("check", "x", "    return x.shape == (2,)\n", title="a check", qualname="Thing.check")
    f1, f2 = one.__code__.co_filename, two.__code__.co_filename
    assert f1 != f2 and f1.startswith("<rope_rtc generated: a check #") and f1.endswith(">")
    assert one.__name__ == "check" and one.__qualname__ == "Thing.check"
    assert linecache.getline(f1, 2) == "    return x.shape == (1,)\n"
    linecache.checkcache()  # an entry with no file behind it stays
    assert linecache.getline(f2, 2) == "    return x.shape == (2,)\n"
    del one
    gc.collect()
    assert f1 not in linecache.cache and f2 in linecache.cache


def test_an_error_inside_a_generated_check_shows_its_line():
    """Failed while generated functions were exec'd from a string: the traceback named the file
    ``<string>`` and showed no source line."""

    class Shapeless:
        @property
        def shape(self):
            raise RuntimeError("shape is not known")

    fn = codegen.generated("check", "x", "    ok = x is not None\n    return ok and x.shape == (1,)\n",
                           title="a shape check", qualname="Thing.check")
    with pytest.raises(RuntimeError) as info:
        fn(Shapeless())
    text = "".join(traceback.format_exception(info.value))
    assert 'File "<rope_rtc generated: a shape check #' in text
    assert "return ok and x.shape == (1,)" in text
    assert "in check" in text or "in Thing.check" in text


def test_a_plans_repeat_path_fails_with_its_line_in_the_traceback():
    """A RopePlan's generated repeat path (the quick path its core takes for new arrays of a bound
    signature) given an offset it cannot compare (a NumPy array of two offsets): the traceback
    names the plan's repeat path and shows the generated line that compared it."""
    with FakeGPU(fixed=True):
        cos, sin = fake_cupy((ROWS, D // 2), np.float32), fake_cupy((ROWS, D // 2), np.float32)
        q, k = fake_cupy((B, 1, HQ, D), BF16), fake_cupy((B, 1, HK, D), BF16)
        plan = RopePlan(q, k, cos, sin, offset=3, layout="bshd").compile()
        plan.execute(q, k, cos, sin, offset=3)
        fn = plan._core.quick[0]
        q2, k2 = fake_cupy((B, 1, HQ, D), BF16), fake_cupy((B, 1, HK, D), BF16)
        with pytest.raises(ValueError, match="truth value") as info:
            fn(q2, k2, cos, sin, None, q2, k2, None, None, np.array([1, 2]))
    text = "".join(traceback.format_exception(info.value))
    assert 'File "<rope_rtc generated: RopePlan repeat path (q bfloat16[8,1,32,128], k bfloat16[8,1,8,128]' in text
    assert "RopePlan.repeat_path" in text or "in repeat_path" in text
    line = [ln for ln in text.splitlines() if "<= offset <=" in ln]
    assert line and "if not (" in line[0], text


def _count_cold_and_warm(monkeypatch, call) -> tuple[dict, dict]:
    """``(cold, warm)``: the validations, array descriptions and Python function calls of
    ``call()`` made first (a cold call: the thread's caches empty) and then again with new arrays
    of the same signature (the repeat path)."""
    import sys

    from rope_rtc.core import arrays
    from rope_rtc.ops import rope, rope_plan, rope_request

    counts: dict = {}

    def counting(owner, name):
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for module in (rope, rope_plan, rope_request):
        counting(module, "validate")
    counting(arrays, "describe")

    def measured(fn) -> dict:
        counts.clear()
        calls = [0]

        def profile(frame, event, arg):
            if event == "call" or event == "c_call":
                calls[0] += 1

        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
        return dict(counts, python_calls=calls[0])

    return measured(call), measured(call)


def test_a_cold_apply_rope_qk_validates_once(monkeypatch):
    """A cold apply_rope_qk validates its call once and hands the request to the plan and its
    template. Failed while the one-call path validated three times (``_plan_for``, the RopePlan
    constructor, the core's bind). A repeat call still validates nothing."""
    import rope_rtc

    with FakeGPU(fixed=True) as gpu:
        cos, sin = fake_cupy((ROWS, D // 2), np.float32), fake_cupy((ROWS, D // 2), np.float32)

        def call():
            q, k = fake_cupy((B, 1, HQ, D), BF16), fake_cupy((B, 1, HK, D), BF16)
            rope_rtc.apply_rope_qk(q, k, cos, sin, offset=5, layout="bshd")

        cold, warm = _count_cold_and_warm(monkeypatch, call)
        assert len(gpu.launches) == 2 and gpu.launches[0]["fn"][0] == gpu.launches[1]["fn"][0] == "rope_fixed"
    print(f"cold {cold}, warm {warm}")
    assert cold["validate"] == 1, cold
    assert "validate" not in warm and "describe" not in warm, warm


def _fused_calls():
    """Each fused one-call function's cold call on fake arrays, with the validation function of its op:
    ``(name, module, validation function name, how many calls one validation makes, call)``."""
    import rope_rtc

    cos, sin = fake_cupy((ROWS, D // 2), np.float32), fake_cupy((ROWS, D // 2), np.float32)

    def qk_norm():
        q, k = fake_cupy((B, HQ, D), BF16), fake_cupy((B, HK, D), BF16)
        rope_rtc.apply_qk_norm_rope(q, k, fake_cupy((D,), BF16), fake_cupy((D,), BF16), cos, sin,
                                    positions=fake_cupy((B,), np.int64), q_out=q, k_out=k)

    def kv_cache():
        q, k, v = fake_cupy((B, HQ, D), BF16), fake_cupy((B, HK, D), BF16), fake_cupy((B, HK, D), BF16)
        caches = fake_cupy((16, 16, HK, D), BF16), fake_cupy((16, 16, HK, D), BF16)
        rope_rtc.rope_and_cache(q, k, v, cos, sin, fake_cupy((B,), np.int64), fake_cupy((B,), np.int64), *caches)

    def tail():
        rope_rtc.tail_rope(fake_cupy((4, 8, 512), BF16), fake_cupy((4, 32), np.float32),
                           fake_cupy((4, 32), np.float32))

    def mrope():
        q, k = fake_cupy((B, HQ, D), BF16), fake_cupy((B, HK, D), BF16)
        rope_rtc.apply_mrope_qk(q, k, cos, sin, fake_cupy((3, B), np.int64), [16, 24, 24], q_out=q, k_out=k)

    return [("apply_qk_norm_rope", "qk_norm", "validate_qk_norm", qk_norm),
            ("apply_mrope_qk", "mrope", "validate_mrope", mrope),
            ("rope_and_cache", "kv_cache", "validate_cache_call", kv_cache),
            ("tail_rope", "tail", "_describe", tail)]


@pytest.mark.parametrize("case", _fused_calls(), ids=lambda c: c[0])
def test_a_cold_fused_call_validates_once(monkeypatch, case):
    """A cold one-call function of a fused op validates its call once: the dispatcher's
    ``validate`` hook hands its request to the new plan and to the plan's bind. Failed while
    apply_qk_norm_rope and apply_mrope_qk validated three times (the hook, the plan constructor, the bind),
    rope_and_cache twice and tail_rope described its arrays twice."""
    import importlib

    _, module_name, fn_name, call = case
    module = importlib.import_module(f"rope_rtc.ops.{module_name}")
    owner = module.TailRoPEForward if fn_name == "_describe" else module
    counts = {"n": 0}
    inner = getattr(owner, fn_name)

    def counted(*args, **kwargs):
        counts["n"] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(owner, fn_name, counted)
    with FakeGPU(fixed=True) as gpu:
        call()
        assert counts["n"] == 1 and len(gpu.launches) == 1
        call()  # new arrays of the signature: the thread's last path, no validation
        assert counts["n"] == 1 and len(gpu.launches) == 2


def _private_imports_between_ops() -> list[str]:
    """``module: name from other`` for each underscore name an ops/ module imports from another
    ops/ module (``from .other import _name``, ``from . import other`` then ``other._name``)."""
    found = []
    ops = PACKAGE / "ops"
    for path in sorted(ops.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        modules = set()  # sibling modules imported as names
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            sibling = node.level == 1 and node.module is not None
            absolute = node.level == 0 and (node.module or "").startswith("rope_rtc.ops.")
            if node.level == 1 and node.module is None:
                modules.update(a.asname or a.name for a in node.names)
            elif sibling or absolute:
                other = node.module.rsplit(".", 1)[-1]
                found += [f"{path.stem}: {a.name} from {other}" for a in node.names
                          if a.name.startswith("_") and other != path.stem]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{path.stem}: {node.attr} from {node.value.id}")
    return sorted(set(found))


def test_no_op_imports_another_ops_private_names():
    """What the fused ops share with the general op is public inside the package (or in core):
    no ops/ module reaches into another's underscore names."""
    assert _private_imports_between_ops() == []


def test_ops_launch_only_through_the_core():
    """No ops/ module builds a launcher or calls the driver's launch itself: launches go through
    the core (a plan's Prepared, or prepared.direct_launcher)."""
    found = []
    for path in sorted((PACKAGE / "ops").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in ("Launcher", "cuLaunchKernel"):
                found.append(f"{path.stem}:{node.lineno} {name}")
    assert found == []
