"""benchmarks/ring_depth.py without root or a memory cap: its goal from measured rows, the checks that refuse a
figure no measurement gives, and a short run of two depths."""

from __future__ import annotations

import json

import pytest

from benchmarks import figure_checks, ring_depth

SPECEXEC = "SpecExec budget 64"


def _run(depth, specexec_speed: float, equal: bool = True) -> dict:
    methods = {"plain generate": {"tokens_per_second": 5.0, "all_equal_plain_greedy": True},
               SPECEXEC: {"tokens_per_second": specexec_speed, "all_equal_plain_greedy": equal}}
    return {"depth": depth, "label": f"{depth}", "methods": methods}


def test_the_goal_compares_the_slower_default_run_with_the_best_hand_set_depth():
    runs = [_run("default", 15.0), _run(4, 12.0), _run(14, 16.0), _run("default", 14.0)]
    goal = ring_depth.goals(runs, SPECEXEC)
    assert goal["best_hand_set"] == "14" and goal["default_over_best"] == pytest.approx(14.0 / 16.0)
    assert not goal["met"]  # 0.875 < 0.9
    assert ring_depth.goals([_run("default", 15.0), _run(14, 16.0)], SPECEXEC)["met"]
    assert not ring_depth.goals([_run("default", 16.0), _run(14, 16.0, equal=False)], SPECEXEC)["met"]


@pytest.mark.parametrize("bad", [0.0, -3.0, float("nan"), float("inf")])
def test_a_figure_no_measurement_gives_fails_the_run(bad):
    with pytest.raises(figure_checks.FigureError, match="is not a finite number above zero"):
        ring_depth.goals([_run("default", bad), _run(14, 16.0)], SPECEXEC)


def test_depths_parse_as_default_auto_or_a_positive_count():
    assert ring_depth.parse_args(["--depths", "default", "auto", "3", "--no-cap"]).depths == ["default", "auto", 3]
    with pytest.raises(SystemExit):
        ring_depth.parse_args(["--depths", "0"])


@pytest.mark.slow
def test_a_short_uncapped_run_writes_its_table_and_matches_plain_greedy(tmp_path):
    argv = ["--no-cap", "--depths", "default", "2", "--prompts", "1", "--max-new-tokens", "4", "--budget", "8",
            "--threads", "1", "--out", str(tmp_path)]
    assert ring_depth.main(argv) == 0
    report = json.loads((tmp_path / "ring_depth.json").read_text())
    assert [run["depth"] for run in report["runs"]] == ["default", 2]
    assert report["runs"][1]["prefetch"] == 2
    assert report["goals"]["all_outputs_identical"]
    assert "default depth" in (tmp_path / "ring_depth.md").read_text()
