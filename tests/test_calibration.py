"""The greedy draft temperature: the fit recovers a known temperature, and generate() ranks trees with it."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from tolerances import rounding_bound

from specexec_hf import SpecExecStats, models
from specexec_hf.core.acceptance_map import AcceptanceMap
from specexec_hf.hf.calibrated import (
    ACCEPTANCE_MAP_ATTRIBUTE,
    ACCEPTANCE_MAP_KEY,
    CONTEXT_MATCH_ATTRIBUTE,
    starting_acceptance_map,
)
from specexec_hf.hf.learnt_state import LearntState, learnt_state_of
from specexec_hf.models import CONTEXT_MATCH_KEY, GREEDY_TEMPERATURE_KEY
from specexec_hf.tools import calibrate
from specexec_hf.tools.calibrate import (
    GREEDY_TEMPERATURE_ATTRIBUTE,
    calibrate_draft_acceptance_map,
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


def test_offline_acceptance_map_of_a_draft_equal_to_its_target_trusts_the_top_token() -> None:
    target = tiny_model("llama", seed=3, sharpness=1.0)
    draft = perturbed_copy(target, 0.0, seed=4)
    prompts = [torch.tensor([[5, 9, 2, 7]]), torch.tensor([[1, 30, 12]])]
    acceptance_map = calibrate_draft_acceptance_map(target, draft, prompts, max_new_tokens=20, max_branch=6)
    assert acceptance_map.trials.sum() == 2 * 20 * 6  # one walk node per answer token, six candidates each
    assert torch.equal(acceptance_map.accepted[0], acceptance_map.trials[0])  # the top token always wins
    assert acceptance_map.accepted[1:].sum() == 0
    record = getattr(draft.config, ACCEPTANCE_MAP_ATTRIBUTE)
    assert (record["temperature"], record["context_match_weights"], record["max_branch"]) == (1.0, [], 6)


def test_generation_starts_from_the_offline_map_at_its_setting_only() -> None:
    target = tiny_model("llama", seed=3)
    draft = perturbed_copy(target, 0.02, seed=1)
    fitted = calibrate_draft_acceptance_map(target, draft, [torch.tensor([[5, 9, 2, 7]])], max_new_tokens=16)
    start = starting_acceptance_map(draft, False, 1.0, ())
    assert start.state() == fitted.state()
    start.observe(torch.tensor([-0.1]), torch.tensor([0]), torch.tensor([False]))
    assert starting_acceptance_map(draft, False, 1.0, ()).state() == fitted.state()  # each start is a fresh copy
    empty = AcceptanceMap().state()
    assert starting_acceptance_map(draft, True, 1.0, ()).state() == empty  # fitted on greedy walks
    assert starting_acceptance_map(draft, False, 0.7, ()).state() == empty  # another ranking temperature
    assert starting_acceptance_map(draft, False, 1.0, (0.5,)).state() == empty  # other context-match weights
    assert starting_acceptance_map(perturbed_copy(target, 0.02, seed=1), False, 1.0, ()).state() == empty


def test_an_offline_map_fills_the_first_call_s_forwards_and_keeps_the_output() -> None:
    """Draft == target: an online map learns over a few calls that the top token always wins; the offline fit
    knows it from the first call on. Only the tree changes: the output is the target's greedy one."""
    target = tiny_model("llama", seed=3, sharpness=1.0)
    prompt = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    held_out = [torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(seed)) for seed in (7, 8)]
    expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64, do_sample=False)
    per_forward = {}
    for offline in (False, True):
        draft = perturbed_copy(target, 0.0, seed=4)
        if offline:
            calibrate_draft_acceptance_map(target, draft, held_out, max_new_tokens=32)
        stats = SpecExecStats()
        output = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64, do_sample=False,
                                 assistant_model=draft, speculator="specexec", budget=32, specexec_stats=stats,
                                 min_draft_gain=0.0)  # the whole budget: the map, not the stopping rule, is tested
        assert output.tolist() == expected.tolist()
        per_forward[offline] = stats.tokens_per_target_forward
    assert per_forward[True] >= 0.9 * 32  # 64 tokens in two forwards of budget + 1 = 33, the last one capped
    assert per_forward[True] > per_forward[False]


def test_the_offline_fit_observes_every_node_a_greedy_walk_observes() -> None:
    """A greedy walk visits nodes on the target's own answer, so what generate() learns online is a part of what
    the offline fit counts on the same prompt: every position at most once, with the same candidates."""
    target = tiny_model("llama", seed=3)
    draft = perturbed_copy(target, 0.01, seed=2)
    prompt = torch.tensor([[5, 9, 2, 7]])
    offline = calibrate_draft_acceptance_map(target, draft, [prompt], max_new_tokens=24, max_branch=6)
    target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                    assistant_model=draft, speculator="specexec", budget=12, max_branch=6)
    (online,) = learnt_state_of(draft).acceptance_maps.values()
    # The call started from a copy of the offline fit (same setting), so what it observed is the difference.
    observed_trials, observed_accepted = online.trials - offline.trials, online.accepted - offline.accepted
    assert observed_trials.sum() > 0
    assert bool((observed_trials <= offline.trials).all()) and bool((observed_accepted <= offline.accepted).all())
    assert observed_accepted.sum() >= 12  # the walks accepted half the answer's tokens or more: a real overlap


def test_a_learnt_state_passed_to_generate_learns_apart_from_the_drafts_own() -> None:
    """generate(learnt_state=...) reads and teaches that state only, and a later call with it goes on learning;
    without one, the state the draft carries learns, the same from the same walks."""
    target = tiny_model("llama", seed=3)
    draft = perturbed_copy(target, 0.05, seed=2)
    prompt = torch.tensor([[5, 9, 2, 7]])
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False, assistant_model=draft,
                  speculator="specexec", budget=8)
    session = LearntState()
    target.generate(prompt, learnt_state=session, **kwargs)
    assert learnt_state_of(draft).acceptance_maps == {}
    (learnt,) = session.acceptance_maps.values()
    first_trials = learnt.trials.sum()
    assert first_trials > 0
    target.generate(prompt, **kwargs)
    (own,) = learnt_state_of(draft).acceptance_maps.values()
    assert own is not learnt and torch.equal(own.trials, learnt.trials) and torch.equal(own.accepted, learnt.accepted)
    target.generate(prompt, learnt_state=session, **kwargs)
    assert learnt.trials.sum() > first_trials


@pytest.mark.parametrize("map_only", [False, True])
def test_calibrate_command_stores_the_acceptance_map_beside_the_fits_it_ranks_with(tmp_path, monkeypatch, map_only):
    target = tiny_model("llama", seed=3)
    draft = perturbed_copy(target, 0.01, seed=2)
    stored = {GREEDY_TEMPERATURE_KEY: {"temperature": 0.8}, CONTEXT_MATCH_KEY: {"weights": [0.1, 0.3]}, "other": 1}
    export = tmp_path / "draft.safetensors"
    export.write_bytes(b"")
    export.with_suffix(".json").write_text(json.dumps(stored))

    def load_export(_target, _path):
        setattr(draft.config, GREEDY_TEMPERATURE_ATTRIBUTE, stored[GREEDY_TEMPERATURE_KEY]["temperature"])
        setattr(draft.config, CONTEXT_MATCH_ATTRIBUTE, tuple(stored[CONTEXT_MATCH_KEY]["weights"]))
        return draft

    monkeypatch.setattr(models, "load_default_target", lambda: (target, None))
    monkeypatch.setattr(models, "load_draft_export", load_export)
    monkeypatch.setattr(calibrate, "encode_chats", lambda _tokenizer, prompts: [[5, 9, 2, 7 + i] for i in range(3)])
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    options = ["--draft", str(export), "--count", "3", "--max-new-tokens", "12", "--context-match-orders", "2",
               "--threads", "1", "--write"]
    assert calibrate.run(parser.parse_args(options + ["--acceptance-map-only"] * map_only)) == 0
    meta = json.loads(export.with_suffix(".json").read_text())
    record = meta[ACCEPTANCE_MAP_KEY]
    assert record["temperature"] == meta[GREEDY_TEMPERATURE_KEY]["temperature"]
    assert record["context_match_weights"] == meta[CONTEXT_MATCH_KEY]["weights"]
    assert sum(map(sum, record["trials"])) == 3 * 12 * 16 and meta["other"] == 1
    assert (meta[GREEDY_TEMPERATURE_KEY] == stored[GREEDY_TEMPERATURE_KEY]) == map_only  # fitted anew, or kept


def _learn_sampling_with_draft_equal_to_target(sampled_children: bool):
    target = tiny_model("llama", seed=3)
    draft = perturbed_copy(target, 0.0, seed=4)
    prompt = torch.tensor([[5, 9, 2, 7]])
    torch.manual_seed(0)
    target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=True,
                    temperature=0.7, top_k=None, top_p=None, assistant_model=draft, speculator="specexec", budget=8,
                    sampled_children=sampled_children)
    (learnt,) = learnt_state_of(draft).acceptance_maps.values()
    return learnt


# Draft and target probabilities come from two forwards' float32 logits through a softmax over tiny_model's 64-token
# vocabulary: equal only up to that rounding (see tolerances), per visited node.
PROBABILITY_ROUNDING = rounding_bound(torch.float32, reduction=64)


def test_sampling_teaches_the_map_the_target_s_probability_of_each_candidate() -> None:
    """Under sampling, a top-token candidate counts as accepted by the probability the target had of sampling it,
    not by whether the one draw picked it. With draft == target at the sampling temperature those probabilities are
    the draft's own, so every bin's learnt rate is the mean draft probability of its candidates: inside the bin. One
    0/1 draw per candidate would leave most bins at 0 or 1, outside them."""
    learnt = _learn_sampling_with_draft_equal_to_target(sampled_children=False)
    edges = torch.tensor(learnt.state()["edges"], dtype=torch.float64)
    seen = learnt.trials > 0
    rates = learnt.accepted[seen] / learnt.trials[seen]
    lower, upper = edges[:-1].expand_as(learnt.trials)[seen], edges[1:].expand_as(learnt.trials)[seen]
    assert seen.sum() >= 5
    inside = (rates >= lower * (1 - PROBABILITY_ROUNDING)) & (rates <= upper * (1 + PROBABILITY_ROUNDING))
    assert bool(inside.all()), (rates, lower, upper)


def test_drawn_children_teach_the_map_the_rejection_chain_s_probability_of_taking_each() -> None:
    """With drawn children, a candidate counts as accepted by the probability that the rejection chain takes it.
    With draft == target the fixed top token is taken with its own probability and, when it is not, the first drawn
    child for certain: per visited node the two add up to 1, and no later child is ever taken."""
    learnt = _learn_sampling_with_draft_equal_to_target(sampled_children=True)
    visits = float(learnt.trials[0].sum())
    assert visits >= 10 and float(learnt.trials[1].sum()) == visits
    assert abs(float(learnt.accepted[:2].sum()) - visits) < PROBABILITY_ROUNDING * visits
    assert 0.05 * visits < float(learnt.accepted[1].sum()) < 0.95 * visits  # both kinds of child are taken
    assert float(learnt.accepted[2:].max()) < PROBABILITY_ROUNDING * visits


def test_context_match_fit_finds_nothing_to_copy_in_independent_tokens() -> None:
    """On i.i.d. random tokens, what followed a context earlier predicts the next token no better than chance, so
    the fitted weights stay near 0. (Each position's match must hold only what followed its context before it:
    when later tokens leaked into it, the fit put ~0.98 on unigram matches.)"""
    generator = torch.Generator().manual_seed(0)
    vocab, prompt_length, answer_length = 200, 30, 100
    sequences, positions = [], []
    for _ in range(20):
        sequence = torch.randint(vocab, (prompt_length + answer_length,), generator=generator)
        sequences.append(sequence)
        positions.append((sequence[prompt_length:], torch.randn(answer_length, vocab, generator=generator)))
    fit = calibrate.fit_greedy_context_match(sequences, [prompt_length] * 20, positions, temperature=1.0)
    assert fit.positions[0] > 300  # plenty of unigram matches to fit on
    assert fit.weights[0] < 0.05, fit
    assert fit.cross_entropy >= fit.cross_entropy_without - 0.05
