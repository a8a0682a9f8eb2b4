"""benchmarks/draft_graphs.py on the CPU: the rehearsal's report, and the checks that withhold a figure no measurement
gives."""

from __future__ import annotations

import json

import pytest

from specexec_hf import TokenTree

from benchmarks import draft_graphs, figure_checks


def _way(tree_ms: float, draft_ms: float, syncs: float | None = 3) -> dict:
    return {"tree_ms": tree_ms, "draft_ms": draft_ms, "forwards": 7, "syncs": syncs, "tree": TokenTree.from_root(1)}


def test_the_goals_are_the_graphed_tree_within_twice_the_drafts_busy_time_and_four_syncs():
    audit = figure_checks.FigureAudit(figure_checks.MEASURED)
    ways = {"dynamic": _way(40.0, 30.0, 250), "static": _way(30.0, 25.0), "graphed": _way(9.0, 5.0)}
    figures = draft_graphs.summary(ways, audit)
    goals = {goal.key: goal for goal in draft_graphs.goals(figures, audit)}
    assert audit.failures == []
    assert goals["tree_over_busy"].measured == pytest.approx(1.8) and goals["tree_over_busy"].met
    assert goals["syncs_per_tree"].measured == 3 and goals["syncs_per_tree"].met
    assert figures["graphed"]["speedup_over_dynamic"] == pytest.approx(40.0 / 9.0)

    def met(graphed: dict) -> dict[str, bool]:
        found = draft_graphs.goals(draft_graphs.summary({**ways, "graphed": graphed}, audit), audit)
        return {goal.key: goal.met for goal in found}

    assert met(_way(11.0, 5.0)) == {"tree_over_busy": False, "syncs_per_tree": True}
    assert met(_way(9.0, 5.0, syncs=5)) == {"tree_over_busy": True, "syncs_per_tree": False}
    assert met(_way(9.0, 5.0, syncs=None)) == {"tree_over_busy": True}  # a CPU: no syncs to count


@pytest.mark.parametrize("bad", [0.0, -3.0, float("nan"), float("inf")])
def test_a_figure_no_measurement_gives_is_withheld_and_reported(bad):
    audit = figure_checks.FigureAudit(figure_checks.MEASURED)
    ways = {"dynamic": _way(40.0, 30.0), "static": _way(30.0, 25.0), "graphed": _way(9.0, bad)}
    figures = draft_graphs.summary(ways, audit)
    assert "draft_ms" not in figures["graphed"]
    assert [goal.key for goal in draft_graphs.goals(figures, audit)] == ["syncs_per_tree"]  # no ratio from it
    assert {failure["figure"] for failure in audit.failures} >= {"graphed draft_ms"}


def test_the_rehearsal_writes_its_checked_report(tmp_path):
    assert draft_graphs.main(["--rehearse", "--out", str(tmp_path), "--trees", "1", "--warmup", "0",
                              "--history", "16"]) == 0
    report = json.loads((tmp_path / "draft_graphs.json").read_text())
    assert report["failures"] == []
    assert set(report["figures"]) == {"dynamic", "static", "graphed"}
    assert report["figures"]["static"]["max_logprob_gap"] < 1e-4  # the same tree, float32 rounding
    assert [goal["key"] for goal in report["goals"]] == ["tree_over_busy"]
    assert "syncs per tree: not counted" in (tmp_path / "draft_graphs.md").read_text()
