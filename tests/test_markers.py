"""Every test that needs vllm is marked ``vllm`` where it is written, so the default run deselects it.

A test needs vllm when it calls ``pytest.importorskip("vllm")``, takes the ``vllm_env`` fixture, or takes a
fixture of its module that does (at any depth); a module-level ``importorskip`` makes every test of the module
need it. The marker counts on the test (``@pytest.mark.vllm``) or on the module (``pytestmark``). Without it, the
default run (pyproject's ``-m 'not ... vllm'``) would run the test, and report it skipped where vllm is absent.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MARKER = "vllm"


def is_vllm_skip(node: ast.AST) -> bool:
    """``pytest.importorskip("vllm")``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "importorskip"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "vllm"
    )


def marks(expression: ast.AST) -> set[str]:
    """The ``pytest.mark.<name>`` names in a decorator or a ``pytestmark`` value (a mark or a list of them)."""
    return {
        node.attr
        for node in ast.walk(expression)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
    }


def is_fixture(function: ast.FunctionDef) -> bool:
    return any("fixture" in ast.unparse(decorator) for decorator in function.decorator_list)


def unmarked_vllm_tests(source: str) -> list[str]:
    """The test functions of a module's source that need vllm and carry no ``vllm`` marker."""
    module = ast.parse(source)
    module_marks: set[str] = set()
    module_skips = False
    functions = [node for node in module.body if isinstance(node, ast.FunctionDef)]
    for node in module.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            module_marks |= marks(node.value)
        if isinstance(node, ast.Expr) and is_vllm_skip(node.value):
            module_skips = True
    if MARKER in module_marks:
        return []
    needs = {"vllm_env"}
    fixtures = [function for function in functions if is_fixture(function)]
    grew = True
    while grew:  # fixtures that take a fixture needing vllm need it too
        grew = False
        for fixture in fixtures:
            if fixture.name not in needs and {arg.arg for arg in fixture.args.args} & needs:
                needs.add(fixture.name)
                grew = True
    unmarked = []
    for function in functions:
        if not function.name.startswith("test_") or is_fixture(function):
            continue
        needs_vllm = (
            module_skips
            or bool({arg.arg for arg in function.args.args} & needs)
            or any(is_vllm_skip(node) for node in ast.walk(function))
        )
        marked = any(MARKER in marks(decorator) for decorator in function.decorator_list)
        if needs_vllm and not marked:
            unmarked.append(function.name)
    return unmarked


def test_every_test_that_needs_vllm_is_marked_vllm():
    unmarked = {
        path.name: names for path in sorted(TESTS.glob("test_*.py")) if (names := unmarked_vllm_tests(path.read_text()))
    }
    assert unmarked == {}, "mark these @pytest.mark.vllm (or the module: pytestmark = pytest.mark.vllm)"


def test_the_check_follows_fixtures_and_module_marks():
    source = '''
import pytest

@pytest.fixture
def engine(vllm_env):
    yield

@pytest.fixture
def served(engine, tmp_path):
    yield

def test_served(served): ...

@pytest.mark.vllm
def test_marked(served): ...

def test_skips_itself():
    pytest.importorskip("vllm")

def test_without_vllm(tmp_path): ...
'''
    assert unmarked_vllm_tests(source) == ["test_served", "test_skips_itself"]
    assert unmarked_vllm_tests("import pytest\npytest.importorskip('vllm')\ndef test_a(): ...\n") == ["test_a"]
    assert unmarked_vllm_tests("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.vllm]\n"
                               "def test_a(vllm_env): ...\n") == []
