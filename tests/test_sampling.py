"""Sampling: SpecExec's output distribution is exactly the target's processed distribution.

With a 5-token vocabulary the target's distribution over 2-token continuations can be enumerated exactly
(25 outcomes); many seeded SpecExec samples are then compared with it by a chi-square test. Each case also
checks that the same samples are rejected against the *unprocessed* distribution, so the test has the power
to notice a sampler that ignores temperature, top-k or top-p.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import chi_square_p, on_device, perturbed_copy, tiny_model
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import specexec_hf  # noqa: F401  (installs speculator="specexec")

VOCAB, NEW_TOKENS, SAMPLES = 5, 2, 1500
PROMPT = torch.tensor([[1, 3, 0, 2]])


def processors(settings: dict) -> LogitsProcessorList:
    """The warpers generate() builds for these settings, in its order."""
    warpers = LogitsProcessorList()
    if "temperature" in settings:
        warpers.append(TemperatureLogitsWarper(settings["temperature"]))
    if "top_k" in settings:
        warpers.append(TopKLogitsWarper(settings["top_k"]))
    if "top_p" in settings:
        warpers.append(TopPLogitsWarper(settings["top_p"]))
    return warpers


@torch.no_grad()
def exact_distribution(model, warpers: LogitsProcessorList) -> dict[tuple[int, ...], float]:
    def next_probs(ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids).logits[:, -1].float()
        return torch.softmax(warpers(ids, logits), dim=-1)[0]

    distribution = {}
    for continuation in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        probability, ids = 1.0, PROMPT.to(model.device)
        for token in continuation:
            probability *= float(next_probs(ids)[token])
            ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=-1)
        distribution[continuation] = probability
    return distribution




CASES = {
    "temperature": ({"temperature": 0.5}, {}),
    "top_k": ({"temperature": 1.5, "top_k": 3}, {}),
    "top_p": ({"temperature": 1.2, "top_p": 0.7}, {}),
    # trees also ranked by guesses copied from the prompt
    "context_match": ({"temperature": 0.5}, {"context_match_weights": (0.6, 0.9)}),
    # children after the top token drawn from the draft and verified by recursive rejection sampling
    "drawn_children": ({"temperature": 0.5}, {"sampled_children": True}),
    "drawn_children_top_p": ({"temperature": 1.2, "top_p": 0.7}, {"sampled_children": True}),
    # the next tree starts from a subtree the draft grew while the target verified the last one
    "draft_ahead": ({"temperature": 0.5}, {"draft_ahead": True}),
    # a draft hierarchy: the draft's tree of 12 re-ranked by the target's first layer and cut to the budget
    "hierarchy": ({"temperature": 0.5}, {"intermediate_model": "self:exit:1", "draft_budget": 12}),
}
# On CUDA two cases, so that `pytest -m cuda` fits a GPU check of a few minutes: the device changes where the
# sampling runs, not which processors shape the distribution.
CUDA_CASES = ("temperature", "drawn_children_top_p")


@pytest.mark.parametrize(
    "settings, knobs, device",
    [pytest.param(*CASES[name], "cpu", id=name) for name in CASES]
    + [pytest.param(*CASES[name], "cuda", id=f"{name}-cuda", marks=pytest.mark.cuda) for name in CUDA_CASES],
)
def test_samples_follow_the_targets_processed_distribution(settings, knobs, device):
    target = tiny_model("llama", seed=11, vocab_size=VOCAB, sharpness=3.0)
    target, draft, prompt = on_device(device, target, perturbed_copy(target, 0.3, seed=12), PROMPT)
    distribution = exact_distribution(target, processors(settings))
    assert sum(distribution.values()) == pytest.approx(1.0)

    torch.manual_seed(2024)  # seeds the CUDA generators too
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(SAMPLES):
        out = target.generate(
            prompt, do_sample=True, max_new_tokens=NEW_TOKENS, **{"top_k": None, "top_p": None, **settings},
            assistant_model=draft, speculator="specexec", budget=6, max_branch=3, **knobs,
        )
        outcome = tuple(out[0, PROMPT.shape[1] :].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1

    assert chi_square_p(counts, distribution) > 1e-3
    assert chi_square_p(counts, exact_distribution(target, LogitsProcessorList())) < 1e-3
