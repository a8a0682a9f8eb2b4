"""Every ```python block of README.md and docs/*.md runs as written.

A block may use the names a reader brings to it (the ``context`` fixture: the target and draft, their tokenizer, a
prompt's ``inputs``, checkpoint paths): here they are tiny random models saved in a temporary directory, so the blocks
run in seconds; whatever else a block uses, it imports or defines itself. A block that loads the real default pair runs
with the slow tests. A block that needs what this machine may lack says so in a ``# requires: <name>`` comment, and
it is skipped only where ``REQUIREMENTS`` says why; every block, skipped or not, must compile.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer

from specexec_hf.tools.prompts import chat_inputs

REPOSITORY = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
# A fenced block opened with ```python (or ```py), at any indentation (blocks inside list items), closed by a fence
# at the same indentation.
PYTHON_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)```(?:python|py)[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", flags=re.M | re.S
)
REQUIRES = re.compile(r"^[ \t]*# requires: *(?P<names>.+?) *$", re.M)
# Calls that load the real SmolLM2 pair: a block with one runs with the slow tests.
DEFAULT_PAIR_CALL = re.compile(r"\b(load_default_pair|load_default_target|export_default_pair|default_target_dir)\(")
# What a block may say it needs, and how the test treats it: marks (a `cuda` block runs where a GPU is) or a skip
# with the reason.
REQUIREMENTS: dict[str, tuple[pytest.MarkDecorator, ...]] = {
    "cuda": (pytest.mark.cuda,),
    # Marked vllm too, so the default run deselects it rather than reporting the skip.
    "vllm": (
        pytest.mark.vllm,
        pytest.mark.skip(
            reason="starts a vLLM engine (minutes on a CPU); tests/test_vllm.py and tests/test_vllm_offload.py start "
            "engines with these settings"
        ),
    ),
}
PROMPT = "the quick brown fox"
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
# Layers of the tiny target: enough for the docs' layer self-drafts ("self:exit:8").
TARGET_LAYERS = 12


@dataclass(frozen=True)
class Snippet:
    """One ```python block: where it is, its code (dedented) and the requirements its comments name."""

    document: str
    line: int
    code: str
    requires: frozenset[str]

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"


def snippets() -> list[Snippet]:
    """Every ```python block of README.md and docs/*.md, in order."""
    found = []
    for path in DOCUMENTS:
        text = path.read_text()
        for block in PYTHON_BLOCK.finditer(text):
            code = textwrap.dedent(block["code"])
            requires = frozenset(
                name.strip() for match in REQUIRES.finditer(code) for name in match["names"].split(",")
            )
            line = text.count("\n", 0, block.start()) + 2  # the block's first line of code
            found.append(Snippet(str(path.relative_to(REPOSITORY)), line, code, requires))
    return found


def with_marks(snippet: Snippet) -> Any:
    marks = [mark for name in sorted(snippet.requires) if name in REQUIREMENTS for mark in REQUIREMENTS[name]]
    if DEFAULT_PAIR_CALL.search(re.sub(r"#.*", "", snippet.code)):  # a call, not a comment naming one
        marks.append(pytest.mark.slow)
    return pytest.param(snippet, marks=marks, id=snippet.name)


SNIPPETS = snippets()


def test_every_python_fence_is_found():
    """The pattern misses no block: each ```python / ```py fence opened in the documents is one snippet."""
    fences = sum(len(re.findall(r"^[ \t]*```(?:python|py)[ \t]*$", path.read_text(), re.M)) for path in DOCUMENTS)
    assert fences == len(SNIPPETS) > 0


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda snippet: snippet.name)
def test_snippet_compiles_and_names_known_requirements(snippet):
    compile(snippet.code, snippet.name, "exec")
    unknown = snippet.requires - REQUIREMENTS.keys()
    assert not unknown, f"{snippet.name}: `# requires:` names {sorted(unknown)}; known: {sorted(REQUIREMENTS)}"


@pytest.fixture
def context(tmp_path, monkeypatch) -> dict[str, Any]:
    """The names a block may take from its reader, bound to tiny stand-ins; the working directory is a fresh
    temporary one (blocks write offload folders)."""
    target = tiny_model("llama", seed=0, num_layers=TARGET_LAYERS, dtype=torch.float32)
    draft = tiny_model("llama", seed=1, num_layers=2, dtype=torch.float32)  # a smaller model, the same tokenizer
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    monkeypatch.chdir(tmp_path)
    target_dir = str(tmp_path / "target")
    return {
        "target": target,
        "draft": draft,
        "tokenizer": tokenizer,
        "inputs": chat_inputs(tokenizer, PROMPT),
        "model": tiny_model("llama", seed=2, dtype=torch.float32),  # a model of the reader's, in memory
        "path": target_dir,
        "path_or_model": target_dir,
        "TARGET": target_dir,
        "DRAFT": str(tmp_path / "draft"),
    }


@pytest.mark.parametrize("snippet", [with_marks(snippet) for snippet in SNIPPETS])
def test_snippet_runs(snippet, context):
    exec(compile(snippet.code, snippet.name, "exec"), {"__name__": "__snippet__", **context})
