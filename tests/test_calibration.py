"""The greedy draft temperature: the fit recovers a known temperature, and generate() ranks trees with it."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st

from specexec_hf import SpecExecStats
from specexec_hf.tools.calibrate import (
    GREEDY_TEMPERATURE_ATTRIBUTE,
    calibrate_draft_temperature,
    calibration_prompts,
    fit_temperature,
)
from specexec_hf.tools.distill.generate import plan_jobs
from specexec_hf.tools.distill.sources import read_prompts


@given(temperature=st.floats(0.3, 3.0), seed=st.integers(0, 2**16))
def test_fit_recovers_the_temperature_labels_were_drawn_at(temperature: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(20_000, 12, generator=generator, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)[:, 0]
    fit = fit_temperature(logits, labels)
    assert fit.temperature == pytest.approx(temperature, rel=0.08)
    assert fit.positions == 20_000
    assert fit.cross_entropy <= fit.cross_entropy_at_one + 1e-9


@given(temperature=st.floats(0.2, 5.0), seed=st.integers(0, 2**16))
def test_fit_is_the_cross_entropy_minimum(temperature: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(500, 9, generator=generator, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits[:, :-1] / temperature, dim=-1), 1, generator=generator)[:, 0]
    logits[:, -1] = -math.inf  # a token outside a restricted draft vocabulary

    def cross_entropy(temperature: float) -> float:
        return float(torch.nn.functional.cross_entropy(logits[:, :-1] / temperature, labels))

    fit = fit_temperature(logits, labels)
    assert fit.cross_entropy == pytest.approx(cross_entropy(fit.temperature), rel=1e-9)
    for factor in (0.97, 1.03):
        assert fit.cross_entropy <= cross_entropy(fit.temperature * factor) + 1e-12


def test_fit_refuses_labels_the_draft_cannot_propose() -> None:
    logits = torch.tensor([[0.0, -math.inf]])
    with pytest.raises(ValueError, match="finite draft logit"):
        fit_temperature(logits, torch.tensor([1]))
    with pytest.raises(ValueError, match="non-empty answers"):
        fit_temperature(logits[:0], torch.tensor([], dtype=torch.long))


def _greedy_steps(target, draft, prompt: torch.Tensor, **kwargs) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """Per step: tokens accepted and draft forwards (both depend on the tree's shape); and the output. Online
    acceptance calibration is off: it would carry what earlier calls learnt into later calls' trees."""
    stats = SpecExecStats()
    output = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                             assistant_model=draft, speculator="specexec", budget=24, specexec_stats=stats,
                             acceptance_calibration=False, **kwargs)
    return [(step.accepted, step.draft_forwards) for step in stats.steps], output


def test_greedy_generate_ranks_trees_with_the_calibrated_temperature() -> None:
    target = tiny_model("llama", seed=3)
    draft = perturbed_copy(target, 0.02, seed=1)
    prompt = torch.tensor([[5, 9, 2, 7]])
    uncalibrated, _ = _greedy_steps(target, draft, prompt)
    fit = calibrate_draft_temperature(target, draft, [prompt], max_new_tokens=24)
    assert getattr(draft.config, GREEDY_TEMPERATURE_ATTRIBUTE) == fit.temperature
    calibrated, output = _greedy_steps(target, draft, prompt)
    assert target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                           do_sample=False).tolist() == output.tolist()
    assert calibrated == _greedy_steps(target, draft, prompt, draft_temperature=fit.temperature)[0]
    assert calibrated != uncalibrated  # this pair's fit is far from 1, so its trees differ (here: fewer steps)
    # A call that names its own temperature wins over the draft's.
    assert _greedy_steps(target, draft, prompt, draft_temperature=1.0)[0] == uncalibrated


def test_calibration_prompts_skip_the_ones_distillation_used() -> None:
    train = read_prompts("train")
    used = {train[job.prompt_index] for job in plan_jobs(len(train), 0, seed=0)[:100]}
    chosen = calibration_prompts("train", 20, after_distilled=100)
    assert len(set(chosen)) == 20 and not used & set(chosen)
    with pytest.raises(SystemExit, match="--count"):
        calibration_prompts("train", len(train), after_distilled=100)
