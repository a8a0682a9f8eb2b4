"""The benchmark harness on tiny models: every method runs, counts add up, greedy outputs match."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch
from conftest import perturbed_copy, tiny_model

from specexec_hf.core.config import SpecExecConfig
from specexec_hf.hf import autobudget
from specexec_hf.hf.learnt_state import LearntState, learnt_state_of
from specexec_hf.tools.bench import (
    Bench,
    Run,
    add_arguments,
    aligned_draft,
    goals,
    mark_greedy_matches,
    plan,
    summarize,
    write_markdown,
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXEC_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(autobudget, "_profiles", {})


def test_each_run_learns_in_its_own_maps_after_its_warmup():
    """Each run's maps learn from its warm-up prompt and its measured prompt only, exactly as a generate() session
    over those two prompts would; the draft's shared maps never see them."""
    target = tiny_model("llama", seed=0)
    draft = perturbed_copy(target, 0.05, seed=1)
    warmup, prompt = (torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(i)) for i in (7, 8))
    bench = Bench(target, draft, [prompt], max_new_tokens=16, top_p=0.9, seed=0, warmup_prompts=[warmup])
    runs = [Run("specexec", 0.0, budget=6), Run("specexec", 0.0, budget=12)]
    list(bench.measure(runs, lambda: None))
    assert learnt_state_of(draft).acceptance_maps == {}
    for run in runs:
        session = LearntState()
        replace(bench, prompts=[warmup]).generate(run, 0, session)
        bench.generate(run, 0, session)
        ((setting, expected),) = session.acceptance_maps.items()
        learnt = bench.learnt_states[run].acceptance_maps[setting]
        assert expected.trials.sum() > 0
        assert torch.equal(learnt.trials, expected.trials) and torch.equal(learnt.accepted, expected.accepted)


def test_every_method_runs_and_matches_greedy_generate(tmp_path):
    target = tiny_model("llama", seed=0)
    draft = perturbed_copy(target, 0.05, seed=1)
    prompts = [torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    bench = Bench(target, draft, prompts, max_new_tokens=12, top_p=0.9, seed=0, acceptance={0.0: [0.6, 0.2, 0.1]})
    runs = [
        Run("autoregressive", 0.0), Run("hf_assisted", 0.0), Run("hf_assisted", 0.0, assistant_tokens=3),
        Run("specinfer", 0.0, budget=8), Run("sequoia", 0.0, budget=8), Run("specexec", 0.0, budget=8),
        Run("specexec_auto", 0.0, budget="auto"), Run("specexec_raw", 0.0, budget=8),
    ]
    original_config = draft.generation_config
    rounds = list(bench.measure(runs, lambda: None))
    assert draft.generation_config is original_config  # each run's assisted settings stay its own
    assert [[len(result["records"]) for result in results] for results in rounds] == [[1] * len(runs), [2] * len(runs)]
    results = rounds[-1]
    mark_greedy_matches(results)
    assert [result.get("matches_autoregressive") for result in results] == [None] + [True] * (len(runs) - 1)
    reference = [record["output"] for record in results[0]["records"]]
    for result in results:
        assert [record["output"] for record in result["records"]] == reference, result["label"]
        assert result["new_tokens"] == 24
        assert result["target_forwards"] >= 2 and result["peak_rss_bytes"] > 0
    assert results[0]["target_forwards"] == 24 and results[0]["draft_forwards"] == 0
    assert all(size <= 9 for size in results[3]["records"][0]["tree_sizes"])
    for result in results[3:6]:  # tree methods: exactly one target forward per step, however its head is applied
        assert result["target_forwards"] == sum(len(record["tree_sizes"]) for record in result["records"])

    report = {
        "environment": {
            "command": "test", "arguments": {"max_new_tokens": 12, "max_depth": 4, "max_branch": 3},
            "machine": {"cpu": "cpu", "torch_threads": 1},
            "versions": {"torch": "t", "transformers": "t"},
        },
        "models": {
            "target": {"name": "tiny", "parameters": 1, "offload": None}, "draft": {"name": "tiny", "parameters": 1}
        },
        "prompts": ["a", "b"], "top_p": 0.9, "complete": True, "acceptance": {}, "results": results,
        "goals": goals(results),
    }
    write_markdown(report, tmp_path / "bench.md")
    markdown = (tmp_path / "bench.md").read_text()
    assert "| specexec@8 |" in markdown and "max_depth 4, max_branch 3" in markdown


def test_plan_puts_autoregressive_first_and_expands_settings():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--methods", "specexec", "autoregressive", "hf_assisted", "specinfer",
                              "--budgets", "16", "64", "--tree-budgets", "64", "--assistant-tokens", "4",
                              "--temperatures", "0", "0.6"])
    labels = [(run.temperature, run.label) for run in plan(args)]
    assert labels == [
        (0.0, "autoregressive"), (0.0, "specexec@16"), (0.0, "specexec@64"), (0.0, "hf_assisted"),
        (0.0, "hf_assisted@4"), (0.0, "specinfer@64"),
        (0.6, "autoregressive"), (0.6, "specexec@16"), (0.6, "specexec@64"), (0.6, "hf_assisted"),
        (0.6, "hf_assisted@4"), (0.6, "specinfer@64"),
    ]


def test_summary_pools_tokens_per_forward_and_takes_quantiles_across_prompts():
    records = [
        {"new_tokens": 10, "seconds": 1.0, "target_forwards": 5, "draft_forwards": 9, "target_seconds": 0.5,
         "draft_seconds": 0.3, "tokens_per_target_forward": 2.0, "tree_sizes": [3, 5]},
        {"new_tokens": 10, "seconds": 1.0, "target_forwards": 2, "draft_forwards": 4, "target_seconds": 0.5,
         "draft_seconds": 0.3, "tokens_per_target_forward": 5.0, "tree_sizes": [4]},
    ]
    summary = summarize(records)
    assert summary["tokens_per_target_forward"] == 20 / 7
    assert summary["tokens_per_target_forward_p10"] == pytest.approx(2.3)
    assert summary["tokens_per_target_forward_p90"] == pytest.approx(4.7)
    assert summary["host_share"] == pytest.approx(0.2) and summary["mean_tree_size"] == 4


def test_specexec_runs_take_their_own_depth_and_raw_turns_calibration_off():
    target = tiny_model("llama", seed=0)
    bench = Bench(target, target, [], max_new_tokens=4, top_p=0.9, seed=0, tree=SpecExecConfig(max_depth=5))
    raw, static = bench.method_kwargs(Run("specexec_raw", 0.0, budget=8)), bench.method_kwargs(Run("specinfer", 0.0, 8))
    assert raw["acceptance_calibration"] is False and raw["specexec_config"].max_depth is None
    assert static["specexec_config"].max_depth == 5 and "acceptance_calibration" not in static
    assert "acceptance_calibration" not in bench.method_kwargs(Run("specexec", 0.0, budget=8))


def test_aligned_drafts_are_a_copy_of_the_target_or_its_self_drafts():
    pytest.importorskip("optimum.quanto")
    target = tiny_model("llama", seed=0)
    copy = aligned_draft(target, "target")
    assert copy is not target  # forward hooks must count the two apart
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), target.state_dict().values()))
    assert aligned_draft(target, "self:int8") is aligned_draft(target, "self:int8")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--draft", "self:int4"]).draft == "self:int4"


def test_position_independent_ratio_matches_closed_forms() -> None:
    """A chain of n tokens accepted with probability a each yields 1 + a + ... + a^n; with only the top rank ever
    accepted the best tree is that chain, so the ratio is the deeper chain's over the best given chain."""
    from benchmarks import tokens_per_forward

    a = 0.8

    def chain(n: int) -> float:
        return sum(a**k for k in range(n + 1))

    assert tokens_per_forward.position_independent_ratio([a], 64, [4, 16]) == pytest.approx(chain(64) / chain(16))
    assert tokens_per_forward.position_independent_ratio([1.0], 256, [16, 32]) == pytest.approx(257 / 33)
    # A second rank worth accepting makes the tree bushier and better than any chain of the same size.
    assert tokens_per_forward.position_independent_ratio([0.8, 0.15], 32, [32]) > 1.0
