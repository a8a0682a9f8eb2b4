"""The import rule: layers import downwards only, no module imports itself through a cycle, core is torch only.

Layers, lowest first (CONTRIBUTING.md): ``core`` (the algorithm) <- ``hf`` (the transformers adapter) <-
``models`` / ``offload`` / ``patches`` <- the package facade ``specexec_hf/__init__.py`` <- ``integrations`` <-
``tools`` <- ``benchmarks`` (the floor: it may import the library, nothing in the library imports it; within it,
the shared modules import no benchmark). A module may import its own layer and the layers below it; imports inside
functions count too. No import cycle anywhere in the repository: the tests, examples and scripts included.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Import name -> source folder, as pyproject.toml's [tool.setuptools.package-dir] installs them.
PACKAGE_DIRS = {
    "specexec_hf": "specexec_hf",
    "specexec_hf.integrations": "integrations",
    "specexec_hf.patches": "patches",
    "benchmarks": "benchmarks",
}
LAYERS = {
    "specexec_hf.core": 0,
    "specexec_hf.hf": 1,
    "specexec_hf.models": 2,
    "specexec_hf.offload": 2,
    "specexec_hf.patches": 2,
    "specexec_hf": 3,
    "specexec_hf.integrations": 4,
    "specexec_hf.tools": 5,
    "benchmarks": 6,
}
# What the benchmarks share (timers, the report writer, model shapes, figure checks, the memory cap, the synthetic
# pair): each imports the library and the others only, never a benchmark.
SHARED_BENCHMARK_MODULES = {f"benchmarks.{name}" for name in (
    "timing", "report", "shapes", "figure_checks", "memory_cap", "synthetic_models")}
# Folders of loose modules outside the packages: tests import each other by bare name (pytest puts tests/ on the
# path), examples and scripts are run as files.
LOOSE_FOLDERS = ("tests", "examples", "scripts")
CORE_THIRD_PARTY = {"torch"}

Edges = Mapping[str, set[str]]


def layer_of(module: str) -> str:
    """The most specific layer holding ``module``."""
    return max((layer for layer in LAYERS if module == layer or module.startswith(layer + ".")), key=len)


def discover_modules() -> dict[str, Path]:
    """The packages' modules by import name (``specexec_hf.*``, ``benchmarks.*``)."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imported_modules(module: str, path: Path, known: Iterable[str]) -> tuple[set[str], set[str]]:
    """``(package modules, other top-level names)`` that ``module`` imports anywhere in its file."""
    known = set(known)
    roots = {name.split(".")[0] for name in known}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    inside, outside = set(), set()

    def add(name: str) -> None:
        if name.split(".")[0] in roots:
            while name and name not in known:  # an attribute imported from a module: the module
                name = name.rpartition(".")[0]
            if name:
                inside.add(name)
        else:
            outside.add(name.split(".")[0])

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            if source == "__future__":
                continue
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                add(candidate if candidate in known else source)
    inside.discard(module)
    return inside, outside


def upward_imports(edges: Edges) -> list[str]:
    """Edges from a layer to a higher one, or between two different layers of the same rank."""
    bad = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            source_layer, target_layer = layer_of(source), layer_of(target)
            if source_layer != target_layer and LAYERS[target_layer] >= LAYERS[source_layer]:
                bad.append(f"{source} ({source_layer}) imports {target} ({target_layer})")
    return bad


def find_cycle(edges: Edges) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def loose_modules() -> dict[str, Path]:
    """The modules of :data:`LOOSE_FOLDERS` by the name their importers use: a test helper's bare file name
    (``conftest``, ``vllm_helpers``), ``examples.NAME`` and ``scripts.NAME`` for the rest (nothing imports those)."""
    modules = {}
    for folder in LOOSE_FOLDERS:
        for path in sorted((ROOT / folder).glob("*.py")):
            modules[path.stem if folder == "tests" else f"{folder}.{path.stem}"] = path
    return modules


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = discover_modules()
    inside, outside = {}, {}
    for name, path in modules.items():
        inside[name], outside[name] = imported_modules(name, path, modules)
    return inside, outside


def test_the_checks_catch_an_upward_import_and_a_cycle() -> None:
    edges = {"specexec_hf.core.tree": {"specexec_hf.hf.kv"}, "specexec_hf.hf.kv": {"specexec_hf.core.tree"}}
    assert upward_imports(edges) == [
        "specexec_hf.core.tree (specexec_hf.core) imports specexec_hf.hf.kv (specexec_hf.hf)"
    ]
    assert find_cycle(edges) == ["specexec_hf.core.tree", "specexec_hf.hf.kv", "specexec_hf.core.tree"]
    assert upward_imports({"specexec_hf.models.drafts": {"specexec_hf.offload.stream"}})  # siblings stay apart
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_every_layer_has_modules(graph) -> None:
    inside, _ = graph
    assert {layer_of(module) for module in inside} == set(LAYERS)


def test_imports_point_down_only(graph) -> None:
    inside, _ = graph
    assert upward_imports(inside) == []


def test_no_import_cycles(graph) -> None:
    inside, _ = graph
    assert find_cycle(inside) is None


def test_no_import_cycle_anywhere_in_the_repository() -> None:
    """The packages, the benchmarks, the tests and their helpers, the examples and the scripts: one graph, no cycle."""
    modules = {**discover_modules(), **loose_modules()}
    edges = {name: imported_modules(name, path, modules)[0] for name, path in modules.items()}
    assert {"conftest", "benchmarks.gpu_offload.cli", "specexec_hf.core.tree"} <= set(edges)  # all of it is read
    assert find_cycle(edges) is None


def test_the_library_never_imports_the_benchmarks(graph) -> None:
    """Benchmarks stand on the library; the library (specexec_hf, integrations, patches) runs without them."""
    inside, _ = graph
    library = {source: targets for source, targets in inside.items() if layer_of(source) != "benchmarks"}
    assert [f"{source} imports {target}" for source, targets in sorted(library.items()) for target in sorted(targets)
            if layer_of(target) == "benchmarks"] == []


def test_shared_benchmark_modules_import_no_benchmark(graph) -> None:
    inside, _ = graph
    assert SHARED_BENCHMARK_MODULES <= set(inside)
    benchmarks_imported = {source: {target for target in inside[source] if layer_of(target) == "benchmarks"}
                           for source in SHARED_BENCHMARK_MODULES}
    assert {source: sorted(targets - SHARED_BENCHMARK_MODULES) for source, targets in benchmarks_imported.items()
            if targets - SHARED_BENCHMARK_MODULES} == {}


def test_benchmarks_run_as_modules_of_their_package() -> None:
    """``python -m benchmarks.NAME``: no module edits ``sys.path`` or loads a file by its path (which gave the
    scripts a second, cycle-prone way to import each other and the library)."""
    tricks = ("sys.path.insert", "sys.path.append", "spec_from_file_location")
    found = [f"{path.relative_to(ROOT)}: {trick}" for path in sorted((ROOT / "benchmarks").rglob("*.py"))
             for trick in tricks if trick in path.read_text()]
    assert found == []


def test_core_needs_only_torch(graph) -> None:
    _, outside = graph
    for module, names in outside.items():
        if layer_of(module) == "specexec_hf.core":
            assert names - set(sys.stdlib_module_names) <= CORE_THIRD_PARTY, module


def test_importing_the_package_leaves_the_tools_out() -> None:
    code = "import sys, specexec_hf; print(sorted(m for m in sys.modules if m.startswith('specexec_hf.tools')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == "[]"
