"""benchmarks/results/INDEX.md: one table row per current results folder, and every results folder README.md or a
docs page cites is there (issue 54: every figure traceable through INDEX.md to one folder)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
RESULTS = REPOSITORY / "benchmarks" / "results"
INDEX = RESULTS / "INDEX.md"
COLUMNS = ["claim", "figure", "folder", "commit", "date", "machine", "weights cached"]
# A results path as README.md and the docs write it: in a link or in code, up to its last character that can be
# part of a folder or file name, or a glob over names (``head_ab_*``).
CITED = re.compile(r"benchmarks/results/(?P<path>[A-Za-z0-9_./*-]*[A-Za-z0-9_*])")


def index_rows(text: str) -> list[dict[str, str]]:
    """The rows of the index's table, by column name."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    if header != COLUMNS:
        raise ValueError(f"INDEX.md's columns are {header}, not {COLUMNS}")
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def listed_folders(text: str) -> set[str]:
    """The folders the index lists: each row's folder cell links to one (``[name/](name/)``)."""
    folders = set()
    for row in index_rows(text):
        link = re.fullmatch(r"\[[^\]]+\]\((?P<target>[^)]+)/\)", row["folder"])
        if link is None:
            raise ValueError(f"INDEX.md: the folder cell {row['folder']!r} is not a link to a folder")
        folders.add(link["target"])
    return folders


def cited_folders(document: str, results: Path) -> set[str]:
    """The results folders ``document`` cites: a cited file's folder, a cited folder itself, the folder a glob
    ranges over (none for a glob over the results' own folders, ``vllm_*``)."""
    folders = set()
    for match in CITED.finditer(document):
        path = match["path"]
        if "*" in path or (results / path).is_file():
            path = str(Path(path).parent)
        if path != ".":
            folders.add(path)
    return folders


def unlisted_citations(documents: dict[str, str], results: Path, listed: set[str]) -> list[str]:
    """``document: folder`` for each cited results folder that is missing or not in the index."""
    problems = []
    for name, text in documents.items():
        for folder in sorted(cited_folders(text, results)):
            if not (results / folder).is_dir():
                problems.append(f"{name}: benchmarks/results/{folder} does not exist")
            elif folder not in listed:
                problems.append(f"{name}: benchmarks/results/{folder} is not listed in INDEX.md")
    return problems


def documents() -> dict[str, str]:
    pages = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
    return {str(page.relative_to(REPOSITORY)): page.read_text() for page in pages}


def test_every_results_folder_cited_by_the_readme_or_docs_exists_and_is_in_the_index():
    assert unlisted_citations(documents(), RESULTS, listed_folders(INDEX.read_text())) == []


def test_the_readme_s_figures_link_into_the_index():
    assert "benchmarks/results/INDEX.md" in (REPOSITORY / "README.md").read_text()


def test_every_row_names_a_folder_that_is_there_with_its_commit_and_date():
    rows = index_rows(INDEX.read_text())
    assert rows
    for row in rows:
        assert all(row[column] for column in COLUMNS), row
        assert re.fullmatch(r"[0-9a-f]{7,40}", row["commit"]), row
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), row
    missing = sorted(folder for folder in listed_folders(INDEX.read_text()) if not (RESULTS / folder).is_dir())
    assert missing == []


def test_every_top_level_results_folder_is_in_the_index():
    """No folder of results that the index does not account for: each holds a current run, or is gone."""
    listed = listed_folders(INDEX.read_text())
    assert sorted(path.name for path in RESULTS.iterdir() if path.is_dir() and path.name not in listed) == []


def test_the_check_catches_a_missing_and_an_unlisted_folder(tmp_path):
    (tmp_path / "ssd" / "run").mkdir(parents=True)
    (tmp_path / "ssd" / "README.md").write_text("notes")
    (tmp_path / "loaders").mkdir()
    page = ("[a](benchmarks/results/ssd/README.md), `benchmarks/results/ssd/run/`, benchmarks/results/gone, "
            "(../benchmarks/results/loaders), `benchmarks/results/loaders/ab_*` and `benchmarks/results/vllm_*`.")
    assert cited_folders(page, tmp_path) == {"ssd", "ssd/run", "gone", "loaders"}
    assert unlisted_citations({"page.md": page}, tmp_path, {"ssd", "loaders"}) == [
        "page.md: benchmarks/results/gone does not exist",
        "page.md: benchmarks/results/ssd/run is not listed in INDEX.md",
    ]
    with pytest.raises(ValueError, match="columns"):
        index_rows("| claim | figure |\n|---|---|\n")
