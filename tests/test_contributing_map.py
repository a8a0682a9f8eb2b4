"""CONTRIBUTING.md's module map names every module of the installed package, and nothing that is not there.

The map is the ``## Layout`` code block: a line ``  core/    tree.py, search.py (...), ...`` (and its indented
continuation lines) lists the modules of ``specexec_hf/core/``, a line ``  __init__.py  ...`` a module of
``specexec_hf/`` itself, and a top-level line such as ``patches/  installed as specexec_hf.patches (...)`` a folder
pyproject.toml installs inside the package. A folder named inside an entry (``distill/``, ``data/``) stands for
everything in it.
"""

from __future__ import annotations

import re
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
PACKAGE = "specexec_hf"
ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[\w.]+/?)(?: {2,}(?P<text>.*))?$")
NAMED = re.compile(r"(?<![\w./<])(?P<name>\w+(?:\.py|/))(?![\w<])")
# pyproject.toml's [tool.setuptools.package-dir] lines that install a repository folder inside the package.
INSTALLED_FOLDER = re.compile(rf'^"{PACKAGE}\.(?P<subpackage>\w+)" = "(?P<folder>[\w/]+)"$', re.M)


def layout_block(contributing: str) -> list[str]:
    """The lines of the first code block under ``## Layout``."""
    section = contributing.split("## Layout", 1)[1]
    return section.split("```", 2)[1].splitlines()[1:]


def documented(layout: list[str]) -> dict[str, set[str]]:
    """Per folder of the map (``specexec_hf``, ``specexec_hf/core``, ``patches``, ...), the names its entries give:
    modules (``tree.py``) and folders (``distill/``); ``specexec_hf`` holds its subfolders' names too."""
    entries: list[tuple[str | None, str]] = []  # (the folder an entry lists, its text with continuation lines)
    top = ""
    for line in layout:
        match = ENTRY.match(line)
        if match and not match["indent"]:
            top = match["name"].rstrip("/")
            entries.append((top, match["text"] or ""))
        elif match and len(match["indent"]) == 2 and top == PACKAGE:
            name = match["name"]
            entries.append((PACKAGE, name))
            entries.append((f"{PACKAGE}/{name.rstrip('/')}" if name.endswith("/") else None, match["text"] or ""))
        elif entries:  # a continuation line of the entry above
            folder, text = entries[-1]
            entries[-1] = (folder, f"{text} {line.strip()}")
    names: dict[str, set[str]] = {}
    for folder, text in entries:
        if folder is not None:
            names.setdefault(folder, set()).update(match["name"] for match in NAMED.finditer(text))
    return names


def present(folder: Path) -> set[str]:
    """What a folder holds that the map must name: its modules (not ``__init__.py`` of a subpackage) and its
    subfolders, as ``name.py`` and ``name/``."""
    modules = {path.name for path in folder.glob("*.py") if path.name != "__init__.py"}
    folders = {f"{path.name}/" for path in folder.iterdir() if path.is_dir() and path.name != "__pycache__"}
    return modules | folders


def installed_folders() -> dict[str, str]:
    """Repository folders installed inside the package, by their folder: ``{"patches": "specexec_hf.patches"}``."""
    pyproject = (REPOSITORY / "pyproject.toml").read_text()
    return {match["folder"]: f"{PACKAGE}.{match['subpackage']}" for match in INSTALLED_FOLDER.finditer(pyproject)}


def map_problems(contributing: str, repository: Path, installed: dict[str, str]) -> list[str]:
    """Each module or folder the map leaves out, and each name it gives that is not there."""
    names = documented(layout_block(contributing))
    package = repository / PACKAGE
    expected = {PACKAGE: present(package) | {"__init__.py"}}
    subpackages = [path for path in package.iterdir() if (path / "__init__.py").is_file()]
    expected |= {f"{PACKAGE}/{path.name}": present(path) for path in subpackages}
    expected |= {folder: present(repository / folder) for folder in installed}
    problems = []
    for folder, want in sorted(expected.items()):
        have = names.get(folder, set())
        problems += [f"{folder}/{name} is not in CONTRIBUTING.md's module map" for name in sorted(want - have)]
        problems += [f"CONTRIBUTING.md's map names {folder}/{name}, which does not exist"
                     for name in sorted(have - want)]
    problems += [
        f"CONTRIBUTING.md's map does not say that {folder}/ is installed as {subpackage}"
        for folder, subpackage in sorted(installed.items())
        if f"installed as {subpackage}" not in contributing
    ]
    return problems


def test_the_module_map_names_every_module_and_nothing_else():
    contributing = (REPOSITORY / "CONTRIBUTING.md").read_text()
    assert map_problems(contributing, REPOSITORY, installed_folders()) == []


def test_map_problems_finds_a_missing_module_and_a_stale_name(tmp_path):
    """The check itself, on a made-up tree: an unnamed module, a name with no file, an unnamed installed folder."""
    for path in ["pkg/__init__.py", "pkg/core/__init__.py", "pkg/core/tree.py", "pkg/core/new.py",
                 "pkg/tools/__init__.py", "pkg/tools/distill/train.py", "plugins/a.py"]:
        (tmp_path / path.replace("pkg", PACKAGE)).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path.replace("pkg", PACKAGE)).touch()
    contributing = (
        "# Contributing\n\n## Layout\n\n```\n"
        f"{PACKAGE}/\n"
        "  core/         the algorithm: tree.py (trees), gone.py\n"
        "  tools/        distill/ (one module per stage)\n"
        "  __init__.py   the public API\n"
        "plugins/        a.py\n"
        "docs/           design\n"
        "```\n"
    )
    assert map_problems(contributing, tmp_path, {"plugins": f"{PACKAGE}.plugins"}) == [
        f"{PACKAGE}/core/new.py is not in CONTRIBUTING.md's module map",
        f"CONTRIBUTING.md's map names {PACKAGE}/core/gone.py, which does not exist",
        f"CONTRIBUTING.md's map does not say that plugins/ is installed as {PACKAGE}.plugins",
    ]


def test_every_installed_folder_is_read_from_pyproject():
    assert {"integrations", "patches"} <= set(installed_folders())
