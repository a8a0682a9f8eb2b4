"""What every benchmark writes: its report as JSON beside a Markdown rendering, Markdown tables, and its goals as
typed records.

A goal is a :class:`Goal`: a short identifier (what code and tests select it by), the claim in words (what the
report shows), the bound, which side of it meets it and the measured figure. The words are for readers only: no
code looks a goal up by them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Goal:
    """One goal of a benchmark and the figure it measured.

    Args:
        key: An identifier, unique within the benchmark's goals (e.g. ``"specexec_vs_plain"``).
        claim: What is measured, in words, for the report (e.g. ``"SpecExec budget 16 vs plain generate"``).
        measured: The measured figure.
        bound: The figure the goal asks for.
        at_least: Whether the goal is met at or above ``bound`` (else at or below it).
    """

    key: str
    claim: str
    measured: float
    bound: float
    at_least: bool = True

    @property
    def met(self) -> bool:
        return self.measured >= self.bound if self.at_least else self.measured <= self.bound

    def line(self) -> str:
        """The goal as a Markdown list item: the claim, the measured figure, the bound and whether it is met."""
        side = ">=" if self.at_least else "<="
        return f"- {self.claim}: {self.measured:.2f} (goal {side} {self.bound:g}: {'met' if self.met else 'NOT met'})"

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Goal:
        """The goal :meth:`as_json` wrote (a report read back to be merged or rendered)."""
        return cls(**{name: value for name, value in record.items() if name != "met"})


def goals_by_key(goals: Iterable[Goal]) -> dict[str, Goal]:
    """``goals`` by their keys; two goals with one key are a bug of the benchmark that made them.

    Raises:
        ValueError: Two goals share a key (both named).
    """
    found: dict[str, Goal] = {}
    for goal in goals:
        if goal.key in found:
            raise ValueError(f"Two goals share the key {goal.key!r}: {found[goal.key].claim!r} and {goal.claim!r}.")
        found[goal.key] = goal
    return found


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], right: Sequence[bool] | None = None) -> list[str]:
    """A Markdown table's lines: ``header``, its rule (columns flagged in ``right`` aligned right, for figures) and
    one line per row; a cell is written with ``str``, ``None`` as an empty cell.

    Raises:
        ValueError: A row or ``right`` has not one entry per column.
    """
    right = [False] * len(header) if right is None else list(right)
    if len(right) != len(header):
        raise ValueError(f"table: {len(header)} columns but {len(right)} alignments.")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if flag else "---" for flag in right) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"table: a row of {len(row)} cells under {len(header)} columns: {list(row)}")
        lines.append("| " + " | ".join("" if cell is None else str(cell) for cell in row) + " |")
    return lines


def write_report(folder: Path, name: str, report: dict[str, Any], markdown: str, indent: int = 2) -> None:
    """Writes ``report`` as ``folder/name.json`` (goals as their records) and ``markdown`` as ``folder/name.md``;
    the JSON by rename, so that a run killed while writing never leaves half a file."""
    folder.mkdir(parents=True, exist_ok=True)
    staged = folder / f"{name}.json.part"
    staged.write_text(json.dumps(report, indent=indent, default=_as_json) + "\n")
    staged.replace(folder / f"{name}.json")
    (folder / f"{name}.md").write_text(markdown.rstrip("\n") + "\n")


def _as_json(value: Any) -> Any:
    return value.as_json() if isinstance(value, Goal) else str(value)
