"""benchmarks/int4_flat.py without root or a memory cap: the split of a streamed int4 forward (waits, compute, the
reads alone), its checks on bad figures, and a tiny-shape run end to end."""

from __future__ import annotations

import json

import pytest
from conftest import importable

from benchmarks import int4_flat
from benchmarks.figure_checks import MEASURED, FigureAudit

pytestmark = pytest.mark.skipif(not importable("optimum.quanto"), reason="needs optimum-quanto")


def forwards(seconds: float, wait: float) -> dict[str, float]:
    return {"forward": seconds, "wait": wait, "compute_in_units": seconds - wait, "cpu": seconds}


def test_split_overlap_and_ratio_from_interleaved_rounds():
    runs = {"read": [0.30, 0.25, 0.26], "forwards": {
        "1": [forwards(0.30, 0.25), forwards(0.26, 0.24), forwards(0.28, 0.25)],
        "16": [forwards(0.33, 0.05), forwards(0.32, 0.04), forwards(0.31, 0.06)],
    }}
    audit = FigureAudit(MEASURED)
    figures = int4_flat.summary(runs, read_bytes=10**9, bound_gbps=5.0, audit=audit)
    assert audit.failures == []
    assert figures["read_seconds"] == 0.26 and figures["read_gbps"] == pytest.approx(1 / 0.26)
    sixteen = figures["widths"]["16"]
    assert sixteen["over_one_token"] == pytest.approx(0.32 / 0.28)
    assert sixteen["compute_seconds"] == pytest.approx(0.28)  # medians of forward less waits
    # reads 0.26 s and compute 0.28 s in a 0.32 s forward: 0.22 s of the reads hidden
    assert sixteen["overlap"] == pytest.approx((0.26 + 0.28 - 0.32) / 0.26)


def test_figures_that_cannot_be_true_are_withheld_and_reported():
    runs = {"read": [0.1], "forwards": {
        "1": [forwards(0.30, 0.45)],  # waited longer than the forward took
        "16": [forwards(0.10, 0.01)],  # faster over 16 tokens than over 1
    }}
    audit = FigureAudit(MEASURED)
    figures = int4_flat.summary(runs, read_bytes=10**9, bound_gbps=5.0, audit=audit)  # 10 GB/s read: over the bound
    assert "1" not in figures["widths"]
    assert {failure["section"] for failure in audit.failures} == {"reads", "forward", "width 1"}


def test_a_tiny_run_writes_checked_figures_and_deletes_its_files(tmp_path):
    out = tmp_path / "out"
    arguments = ["--shape", "tiny", "--no-cap", "--rounds", "1", "--threads", "1", "--shape-dir", str(tmp_path / "w"),
                 "--out", str(out)]
    int4_flat.main(arguments)  # the tiny shape's timings are noise: its exit status may say a check failed
    report = json.loads((out / "int4_flat.json").read_text())
    assert report["prefetch"] >= 1 and report["read_bytes"] > 0
    for entry in report["figures"]["widths"].values():
        assert entry["forward_seconds"] > 0
        assert len(entry["compute_by_unit"]) == len(entry["wait_by_unit"]) == len(report["units"])  # layers, head
        assert sum(entry["compute_by_unit"]) <= entry["forward_seconds"]
    assert (out / "int4_flat.md").is_file()
    assert list((tmp_path / "w").iterdir()) == []
