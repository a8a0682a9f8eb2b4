"""benchmarks/related_systems.py without root or a memory cap: the methods it compares, its per-mode summary and
table from measured rows, its arguments, and a --quick --no-cap run of every method on the real pair."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import related_systems as related


def test_methods_cover_every_option_with_its_draft_budget_and_policy():
    draft, int4, layer = object(), object(), object()
    args = SimpleNamespace(budgets=[16, 64], int4_budgets=[16, 64], layer_draft_budgets=[16], sequoia_budgets=None,
                           hierarchy_budgets=[16])
    compared = related.methods(draft, int4, {"self:skip:10-20": layer}, args, {"self:int4": int4})
    assert list(compared) == [
        "plain generate",
        "SpecExec, shipped draft, budget 16", "SpecExec, shipped draft, budget 64",
        "SpecExec, self:int4, budget 16", "SpecExec, self:int4, budget 64", "SpecExec, self:skip:10-20, budget 16",
        "Sequoia online, shipped draft, budget 16", "Sequoia online, shipped draft, budget 64",
        "hierarchy, shipped draft -> self:int4, budget 16",
    ]
    hierarchy = compared["hierarchy, shipped draft -> self:int4, budget 16"]
    assert (hierarchy["assistant_model"], hierarchy["intermediate_model"], hierarchy["budget"]) == (draft, int4, 16)
    only_sequoia_32 = related.methods(draft, int4, {}, SimpleNamespace(
        budgets=[16], int4_budgets=[], layer_draft_budgets=[], sequoia_budgets=[32], hierarchy_budgets=[]))
    assert list(only_sequoia_32) == [
        "plain generate", "SpecExec, shipped draft, budget 16", "Sequoia online, shipped draft, budget 32"]
    assert compared["plain generate"] == {}
    assert compared["SpecExec, self:int4, budget 16"]["assistant_model"] is int4
    assert compared["SpecExec, self:skip:10-20, budget 16"]["assistant_model"] is layer
    sequoia = compared["Sequoia online, shipped draft, budget 64"]
    assert (sequoia["assistant_model"], sequoia["budget"], sequoia["tree_search"]) == (draft, 64, "sequoia")
    assert all(kwargs["speculator"] == "specexec" and "tree_search" not in kwargs
               for label, kwargs in compared.items() if label.startswith("SpecExec"))


def test_long_prompts_put_the_question_after_a_document_of_at_least_the_tokens_asked(monkeypatch):
    monkeypatch.setattr(related, "load_prompts", lambda split: [f"note {i} " + "word " * 9 for i in range(50)])

    def words(text: str) -> dict:
        return {"input_ids": text.split()}

    assert related.with_context(words, "Why?", 0) == "Why?"
    long = related.with_context(words, "Why?", 100)
    assert long.endswith("answer this: Why?") and len(long.split()) >= 100
    assert "9. note 8" in long and "10. note 9" not in long  # no more notes than the tokens asked need
    with pytest.raises(ValueError, match="fewer than --context-tokens 10000"):
        related.with_context(words, "Why?", 10_000)


def rows() -> list[dict]:
    def row(mode, method, tokens, seconds, forwards, equal, tree_seconds=None):
        extra = {} if tree_seconds is None else {"tree_seconds": tree_seconds}
        return {"prompt": 0, "mode": mode, "method": method, "tokens": [1] * tokens, "seconds": seconds,
                "target_forwards": forwards, "equals_plain_greedy": equal, **extra}

    return [
        row("greedy", "plain generate", 8, 4.0, 8, True),
        row("greedy", "SpecExec, shipped draft, budget 16", 8, 1.0, 2, True, 0.5),
        row("greedy", "SpecExec, self:int4, budget 16", 8, 2.0, 4, False, 1.0),
        row("t=0.6", "plain generate", 6, 3.0, 6, None),
        row("t=0.6", "SpecExec, shipped draft, budget 16", 8, 2.0, 4, None, 0.2),
        row("t=0.6", "SpecExec, self:int4, budget 16", 8, 8.0, 2, None, 0.1),
    ]


def test_summaries_are_per_mode_against_that_modes_plain_and_only_greedy_claims_identity():
    summary = related.summaries(rows())
    greedy, sampled = summary["greedy"], summary["t=0.6"]
    assert greedy["SpecExec, shipped draft, budget 16"]["speedup_vs_plain"] == 4.0
    assert greedy["SpecExec, shipped draft, budget 16"]["tokens_per_target_forward"] == 4.0
    assert greedy["SpecExec, shipped draft, budget 16"]["draft_seconds_per_step"] == 0.25
    assert not greedy["SpecExec, self:int4, budget 16"]["all_equal_plain_greedy"]
    assert sampled["plain generate"]["speedup_vs_plain"] == 1.0
    assert sampled["SpecExec, self:int4, budget 16"]["speedup_vs_plain"] == 0.5  # 1 tok/s against plain's 2
    assert sampled["SpecExec, self:int4, budget 16"]["tokens_per_target_forward"] == 4.0
    assert all("all_equal_plain_greedy" not in figures for figures in sampled.values())


def test_table_has_a_row_per_method_and_flags_a_greedy_difference():
    report = {"environment": {"command": "c", "machine": "m", "torch": "t", "transformers": "x", "threads": 2,
                              "cap": "none", "load_before": [1.0], "cache_fraction": 0.45},
              "measured": {"prompts": 1, "max_new_tokens": 8, "ring_bytes": 1e6, "prefetch": 1,
                           "rows": rows(), "summary": related.summaries(rows())}}
    table = [line for line in related.markdown(report).splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 3  # the header and one row per method
    assert table[0].split(" | ")[1:4] == ["greedy tok/s", "greedy vs plain", "greedy tokens / target fwd"]
    int4 = next(line for line in table if "self:int4" in line).split(" | ")
    assert int4[5] == "NO" and int4[6:9] == ["1.00", "0.50x", "4.00 |"]
    assert "(nothing measured yet)" in related.markdown({"environment": report["environment"]})


def test_arguments_quick_defaults():
    args = related.parse_args(["--quick", "--prompts", "2"])
    assert (args.prompts, args.max_new_tokens, args.budgets, args.prefetch) == (2, 4, [8], 1)  # given options win
    defaults = related.parse_args([])
    assert (defaults.budgets, defaults.int4_budgets, defaults.layer_draft_budgets) == ([16, 64], [16], [16])
    assert defaults.layer_drafts == ["self:skip:10-20"]
    assert defaults.prefetch == "auto"


@pytest.mark.slow
def test_quick_run_measures_every_method_in_both_modes(tmp_path):
    """The smoke path: every method, small, on the real default pair streamed from disk (so marked slow)."""
    assert related.main(["--quick", "--no-cap", "--threads", "1", "--out", str(tmp_path)]) == 0
    assert {path.name for path in tmp_path.iterdir()} == {"related_systems.json", "related_systems.md"}
    report = json.loads((tmp_path / "related_systems.json").read_text())
    summary = report["measured"]["summary"]
    assert set(summary) == {"greedy", "t=0.6"}
    expected = {"plain generate", "SpecExec, shipped draft, budget 8", "SpecExec, self:int4, budget 8",
                "SpecExec, self:exit:2, budget 8", "Sequoia online, shipped draft, budget 8",
                "hierarchy, shipped draft -> self:int4, budget 4"}
    assert all(set(methods) == expected for methods in summary.values())
    assert all(figures["all_equal_plain_greedy"] for figures in summary["greedy"].values())
    assert all(figures["tokens_per_target_forward"] >= 1 for mode in summary.values() for figures in mode.values())
    assert len(report["measured"]["rows"]) == 2 * len(expected)
