"""The shipped prompt sets: well-formed, and the eval set really held out from the training set."""

from __future__ import annotations

import re

import pytest

from specexec_hf.tools.prompts import load_prompt_records, prompt_file


def _words(prompt: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z0-9]+", prompt.lower()))


@pytest.mark.parametrize("split", ["train", "eval"])
def test_records_are_well_formed_with_unique_ids_and_prompts(split: str) -> None:
    records = load_prompt_records(prompt_file(split))
    assert all(record.get("id") and record.get("category") and record["prompt"].strip() for record in records)
    assert len({record["id"] for record in records}) == len(records)
    assert len({record["prompt"] for record in records}) == len(records)


def test_eval_set_is_large_varied_and_disjoint_from_training_prompts() -> None:
    train = load_prompt_records(prompt_file("train"))
    evaluation = load_prompt_records(prompt_file("eval"))
    assert len(evaluation) >= 50 and len({record["category"] for record in evaluation}) >= 8
    train_words = [_words(record["prompt"]) for record in train]
    for record in evaluation:
        words = _words(record["prompt"])
        # Near-copies count as leaks too: flag any training prompt sharing 80% of its words with an eval prompt.
        closest = max(len(words & other) / len(words | other) for other in train_words)
        assert closest < 0.8, f"eval prompt {record['id']} is (nearly) in the training set: {record['prompt']!r}"
