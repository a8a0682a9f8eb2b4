"""benchmarks/draft_graphs.py on the CPU: the rehearsal's report, and the checks that withhold a figure no measurement
gives."""

from __future__ import annotations

import json

import pytest

from benchmarks import draft_graphs, figure_checks
from specexec_hf import TokenTree


def _way(tree_ms: float, draft_ms: float, syncs: float | None = 3) -> dict:
    return {"tree_ms": tree_ms, "draft_ms": draft_ms, "forwards": 7, "syncs": syncs, "tree": TokenTree.from_root(1)}


def test_the_goal_is_the_graphed_tree_within_twice_the_drafts_busy_time_and_four_syncs():
    audit = figure_checks.FigureAudit(figure_checks.MEASURED)
    ways = {"dynamic": _way(40.0, 30.0, 250), "static": _way(30.0, 25.0), "graphed": _way(9.0, 5.0)}
    figures = draft_graphs.summary(ways, audit)
    assert audit.failures == []
    assert figures["goal"] == {"tree_over_busy": pytest.approx(1.8), "syncs": 3, "met": True}
    assert figures["graphed"]["speedup_over_dynamic"] == pytest.approx(40.0 / 9.0)
    assert not draft_graphs.summary({**ways, "graphed": _way(11.0, 5.0)}, audit)["goal"]["met"]
    assert not draft_graphs.summary({**ways, "graphed": _way(9.0, 5.0, syncs=5)}, audit)["goal"]["met"]
    assert not draft_graphs.summary({**ways, "graphed": _way(9.0, 5.0, syncs=None)}, audit)["goal"]["met"]


@pytest.mark.parametrize("bad", [0.0, -3.0, float("nan"), float("inf")])
def test_a_figure_no_measurement_gives_is_withheld_and_reported(bad):
    audit = figure_checks.FigureAudit(figure_checks.MEASURED)
    ways = {"dynamic": _way(40.0, 30.0), "static": _way(30.0, 25.0), "graphed": _way(9.0, bad)}
    figures = draft_graphs.summary(ways, audit)
    assert "draft_ms" not in figures["graphed"] and "goal" not in figures
    assert {failure["figure"] for failure in audit.failures} >= {"graphed draft_ms"}


def test_the_rehearsal_writes_its_checked_report(tmp_path):
    assert draft_graphs.main(["--rehearse", "--out", str(tmp_path), "--trees", "1", "--warmup", "0",
                              "--history", "16"]) == 0
    report = json.loads((tmp_path / "draft_graphs.json").read_text())
    assert report["failures"] == []
    assert set(report["figures"]) == {"dynamic", "static", "graphed", "goal"}
    assert report["figures"]["static"]["max_logprob_gap"] < 1e-4  # the same tree, float32 rounding
    assert "Goal (graphed)" in (tmp_path / "draft_graphs.md").read_text()
