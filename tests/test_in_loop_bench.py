"""benchmarks.gpu_offload.in_loop: the loop's arithmetic on given numbers, bad figures failing, and a tiny run of the
real code path on the CPU (the synthetic pair: the default pair's GGUF may be absent)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.figure_checks import MEASURED, STAND_IN, FigureAudit, FigureError
from benchmarks.gpu_offload import in_loop
from benchmarks.gpu_offload.end_to_end import synthetic_pair
from benchmarks.shapes import GB, SHAPES
from benchmarks.timing import Deadline, timed_generate

CPU = torch.device("cpu")
positive_floats = st.floats(min_value=1e-3, max_value=1e3)


def test_loop_tokens_per_second_leaves_out_the_small_target():
    assert in_loop.loop_tokens_per_second(48, 4.0, 1.0) == pytest.approx(16.0)
    assert in_loop.loop_tokens_per_second(10, 2.0, 0.0) == pytest.approx(5.0)


def test_ideal_and_its_normalisation_on_given_numbers():
    # 4 tokens per forward over a 25 GB/s link, 1 GB streamed per forward: 100 tok/s at best.
    assert in_loop.ideal_tokens_per_second(4.0, 25.0, GB) == pytest.approx(100.0)
    assert in_loop.share_of_ideal(85.0, 100.0, MEASURED) == pytest.approx(0.85)
    # The same share and tokens per forward over a 55 GB/s link with 10x the bytes (the whole shape).
    assert in_loop.at_link(0.85, 4.0, 55.0, 10 * GB) == pytest.approx(0.85 * 4 * 5.5)
    # 8.6 tok/s at 85% of the ideal over PCIe 4.0 x16 with 35 GB per forward needs 8.6 / (0.85 * 25 / 35) tokens.
    assert in_loop.tokens_per_forward_needed(8.6, 0.85, 25.0, 35 * GB) == pytest.approx(8.6 / (0.85 * 25 / 35))


@given(positive_floats, st.floats(min_value=0.05, max_value=1.0), positive_floats, positive_floats)
def test_needed_tokens_per_forward_reach_the_published_rate(rate, share, link_gbps, gigabytes):
    needed = in_loop.tokens_per_forward_needed(rate, share, link_gbps, gigabytes * GB)
    assert in_loop.at_link(share, needed, link_gbps, gigabytes * GB) == pytest.approx(rate)


@given(positive_floats, positive_floats, positive_floats, st.floats(min_value=0.01, max_value=1.0))
def test_a_loop_at_a_share_of_its_ideal_is_measured_back_at_that_share(tokens_per_forward, link_gbps, gigabytes, share):
    ideal = in_loop.ideal_tokens_per_second(tokens_per_forward, link_gbps, gigabytes * GB)
    assert in_loop.share_of_ideal(share * ideal, ideal, MEASURED) == pytest.approx(share)


@pytest.mark.parametrize("bad", [
    lambda: in_loop.loop_tokens_per_second(0, 1.0, 0.0),  # no token
    lambda: in_loop.loop_tokens_per_second(8, 1.0, 2.0),  # the small target took longer than the whole loop
    lambda: in_loop.loop_tokens_per_second(8, -1.0, 0.0),  # negative seconds
    lambda: in_loop.loop_tokens_per_second(8, 1.0, math.nan),
    lambda: in_loop.ideal_tokens_per_second(2.0, 25.0, 0),  # nothing streamed: no link-bound ideal
    lambda: in_loop.share_of_ideal(12.0, 10.0, MEASURED),  # faster than the link allows
    lambda: in_loop.share_of_ideal(-1.0, 10.0, MEASURED),
])
def test_bad_figures_fail(bad):
    with pytest.raises(FigureError):
        bad()


def test_a_failing_figure_fails_the_target_and_is_recorded(monkeypatch):
    methods = {"SpecExec budget 4": {"status": "measured", "tokens_per_second": 3.0, "tokens_per_forward": 2.0}}
    monkeypatch.setattr(in_loop, "measure_target", lambda *args: {
        "bytes_per_forward": 0, "full_shape_bytes_per_forward": 0, "methods": methods})
    audit = FigureAudit(STAND_IN)
    big = in_loop.BigTarget("int4 stand-in", torch.nn.Linear(1, 1), 0, 0, headline=False)
    entry = in_loop.target_figures(big, None, [4], 4, 25.0, CPU, Deadline(60), audit)
    assert "ideal" not in entry and "goals" not in entry
    assert [failure["section"] for failure in audit.failures] == [in_loop.SECTION]
    assert "bytes per forward" in audit.failures[0]["figure"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return synthetic_pair(3, tmp_path_factory.mktemp("in_loop_pair"))


def test_the_big_target_keeps_the_pairs_commits(pair, tmp_path):
    """Every SpecExec step and every assisted step is one forward of the big target, and its cache follows what the
    pair committed: all tokens but the last, which is the next tree's root."""
    targets = in_loop.big_targets([(SHAPES["tiny"], SHAPES["tiny"].layers, None)], CPU, tmp_path)
    big = next(targets)  # placed while the generator is open: the next step frees it
    prompt = pair.prompts[0]
    for kwargs in ({"assistant_model": pair.draft, "speculator": "specexec", "budget": 8},
                   {"assistant_model": pair.draft}):
        verifier = in_loop.BigVerifier(big.model, prompt["input_ids"], CPU)
        with in_loop.verified_by(verifier):
            row = timed_generate(pair.reference, prompt, 6, CPU, **kwargs)
        assert verifier.forwards == row["target_forwards"] > 0
        assert verifier.scorer.cached == prompt["input_ids"].shape[1] + len(row["tokens"]) - 1
    targets.close()


def test_a_tiny_run_through_the_loop(pair, tmp_path):
    audit = FigureAudit(STAND_IN)
    shapes = [(SHAPES["tiny"], SHAPES["tiny"].layers, None)]
    result = in_loop.in_loop(pair, shapes, [8], 4, 10.0, CPU, Deadline(300), tmp_path, audit)
    assert audit.failures == []
    (entry,) = result["targets"].values()
    assert entry["status"] == "measured"
    assert list(entry["methods"]) == ["SpecExec budget 8", "HF assisted", "plain streamed"]
    assert entry["methods"]["plain streamed"]["tokens_per_forward"] == pytest.approx(1.0)
    assert {goal["key"] for goal in entry["goals"]} == {"in_loop_specexec_over_plain", "in_loop_specexec_over_assisted"}
    assert in_loop.in_loop_markdown(result)[0].startswith("## In one loop")


def test_no_optimum_quanto_is_a_note(monkeypatch, tmp_path):
    def no_quanto(*args, **kwargs):
        raise ImportError("optimum-quanto is not installed")

    monkeypatch.setattr(in_loop, "placed_target", no_quanto)
    (note,) = in_loop.big_targets([(SHAPES["tiny"], 2, "int4")], CPU, Path(tmp_path))
    assert "not run" in note and "optimum-quanto" in note


def test_an_int4_target_is_measured_against_its_ideal(pair, tmp_path):
    pytest.importorskip("optimum.quanto")
    audit = FigureAudit(STAND_IN)
    shapes = [(SHAPES["tiny"], SHAPES["tiny"].layers, "int4")]  # fewer tiny layers all stay loaded: nothing streams
    result = in_loop.in_loop(pair, shapes, [8], 4, 10.0, CPU, Deadline(300), tmp_path, audit)
    assert audit.failures == []
    (entry,) = result["targets"].values()
    assert set(entry["methods"]) == {"SpecExec budget 8"}  # no ratio goal here: plain and assisted are not run
    ideal = entry["ideal"]
    assert ideal["share_of_ideal"] == pytest.approx(entry["methods"]["SpecExec budget 8"]["tokens_per_second"]
                                                    / ideal["ideal_tokens_per_second"])
    assert ideal["full_shape_tokens_per_second_pcie4"] == pytest.approx(
        ideal["full_shape_tokens_per_second"] * in_loop.PCIE4_X16_GBPS / 10.0)  # the whole tiny shape was built
    assert [goal["key"] for goal in entry["goals"]] == ["in_loop_int4_share_of_ideal"]
    assert {row["system"].split(" (")[0].split(" README")[0] for row in ideal["published"]} == {"SpecExec paper",
                                                                                               "UMbreLLa"}


def test_a_target_that_raises_is_an_error_and_the_next_one_still_runs(pair, tmp_path, monkeypatch):
    calls = []

    def figures(big, *args):
        calls.append(big.label)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return {"status": "measured"}

    monkeypatch.setattr(in_loop, "target_figures", figures)
    shapes = [(SHAPES["tiny"], SHAPES["tiny"].layers, None), (SHAPES["tiny"], 2, None)]
    result = in_loop.in_loop(pair, shapes, [8], 4, 10.0, CPU, Deadline(60), tmp_path, FigureAudit(STAND_IN))
    assert len(calls) == 2 and len(result["errors"]) == 1 and "out of memory" in result["errors"][0]["traceback"]
    assert result["targets"][calls[0]]["status"] == "error: RuntimeError: out of memory"


def test_the_goals_methods_run_first_and_a_target_past_the_deadline_is_a_note(pair, tmp_path):
    assert list(in_loop.methods(pair, [256, 1024], headline=True)) == [
        "SpecExec budget 256", "HF assisted", "plain streamed", "SpecExec budget 1024"]
    assert list(in_loop.methods(pair, [256, 1024], headline=False)) == ["SpecExec budget 256", "SpecExec budget 1024"]
    (note,) = in_loop.big_targets([(SHAPES["tiny"], 2, None)], CPU, tmp_path, Deadline(1.0))
    assert "not run: the time budget" in note
