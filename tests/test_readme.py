"""README.md stays a front page: short enough to read through, its two commands the ones CI runs, and every link
into the repository (a file, and a heading where it names one) still there.

The detail lives in docs/*.md; the README points to it, so a moved or renamed page or heading must not leave a dead
pointer behind.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
README = REPOSITORY / "README.md"
# Issue 54: the README at most this many characters; what does not fit goes to the docs page it points to.
MAX_CHARACTERS = 10_000
SETUP_AND_DEMO = "bash scripts/setup && .venv/bin/python examples/quickstart.py"
TEST_COMMAND = ".venv/bin/python -m pytest -q -n 2"
# An inline Markdown link or image: [text](target) or [text](target "title").
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", flags=re.M | re.S)
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<title>.+?)[ \t]*#*[ \t]*$", flags=re.M)


def relative_links(markdown: str) -> list[str]:
    """Link targets inside the repository (not URLs, not mail): those outside code blocks, in order."""
    prose = FENCE.sub("", markdown)
    return [match["target"] for match in LINK.finditer(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", match["target"])]


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but hyphens and underscores dropped,
    spaces made hyphens, a repeated anchor numbered -1, -2, ..."""
    seen: Counter[str] = Counter()
    anchors = set()
    for match in HEADING.finditer(FENCE.sub("", markdown)):
        anchor = re.sub(r"[^\w\- ]", "", match["title"].strip().lower()).replace(" ", "-")
        anchors.add(anchor if not seen[anchor] else f"{anchor}-{seen[anchor]}")
        seen[anchor] += 1
    return anchors


def broken_links(document: Path) -> list[str]:
    """The document's relative links whose file is missing, or whose #anchor names no heading of a Markdown page."""
    broken = []
    for target in relative_links(document.read_text()):
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        if not linked.is_file():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
            broken.append(f"{target} (no such heading in {linked.name})")
    return broken


def test_readme_is_at_most_ten_thousand_characters():
    length = len(README.read_text())
    assert length <= MAX_CHARACTERS, (
        f"README.md has {length} characters, over {MAX_CHARACTERS}: move detail into the docs page its pointer names "
        "(docs/design.md, docs/offloading.md, docs/drafts.md, docs/vllm.md, docs/benchmarks.md) and point to it"
    )


def test_readme_links_resolve():
    assert relative_links(README.read_text()), "the README points to no docs page"
    assert broken_links(README) == []


@pytest.mark.parametrize("command", [SETUP_AND_DEMO, TEST_COMMAND])
def test_readme_shows_the_two_commands_in_shell_blocks(command):
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.M | re.S)
    assert any(command in block.splitlines() for block in blocks), f"README.md lacks the command line `{command}`"


def test_ci_runs_the_readme_test_command():
    """.ci/run runs the README's test command as it stands, no arguments added (its exit status kept aside)."""
    exact = re.compile(rf"^{re.escape(TEST_COMMAND)}[ \t]*(\|\||;|$)", flags=re.M)
    assert exact.search((REPOSITORY / ".ci" / "run").read_text()), f".ci/run does not run `{TEST_COMMAND}` as such"


def test_broken_links_are_found(tmp_path):
    """The link check itself: a missing file and a missing heading are reported, good links and URLs are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## The knobs\n\n## The knobs\n")
    document = tmp_path / "README.md"
    document.write_text(
        "[ok](docs/page.md) [ok](docs/page.md#the-knobs) [ok](docs/page.md#the-knobs-1) [web](https://example.org/x)\n"
        "[gone](docs/gone.md) [no heading](docs/page.md#limits) [self](#page)\n"
        "```bash\n[in code](nowhere.md)\n```\n# Page\n"
    )
    assert [link.split(" ")[0] for link in broken_links(document)] == ["docs/gone.md", "docs/page.md#limits"]
