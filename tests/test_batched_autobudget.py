"""A batch of prompts with budget="auto" / step_budget="auto": each row still what the target gives it alone, each
step's node total following the target's forward profile, sampling still the target's distribution."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conftest import chi_square_p, perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from test_batched_generate import (
    PAD,
    assert_each_row_is_what_the_target_gives_it_alone,
    batch_cases,
    left_padded,
    random_prompts,
    specexec,
)
from test_sampling import NEW_TOKENS, PROMPT, SAMPLES, VOCAB, exact_distribution, processors

from specexec_hf import SpecExecStats
from specexec_hf.core.tree import TokenTree
from specexec_hf.hf import autobudget
from specexec_hf.hf.autobudget import ForwardProfile
from specexec_hf.hf.batch import AutoStepTotal
from specexec_hf.hf.learnt_state import LearntState

# Seconds by tokens fed: a streamed target, flat up to 64 tokens, and an in-memory one, rising from the first token.
FLAT = ForwardProfile({1: 1.0, 64: 1.0, 1025: 16.0})
STEEP = ForwardProfile({1: 0.01, 64: 0.64, 1025: 10.25})


def profiled(profile: ForwardProfile):
    """``budget="auto"``'s forward profiles (target and draft) stubbed to ``profile``: nothing timed."""
    return mock.patch.object(autobudget, "forward_profile", lambda model, sizes, use_disk=True: profile)


def chain(nodes: int, step_logprob: float) -> TokenTree:
    """A chain of ``nodes`` non-root nodes, each reached with ``exp(step_logprob)`` once its parent was."""
    depths = torch.arange(nodes + 1)
    return TokenTree(depths.clone(), depths - 1, depths, step_logprob * depths.float())


@given(
    case=batch_cases(),
    knobs=st.sampled_from([
        {"budget": "auto"}, {"budget": "auto", "step_budget": "auto"}, {"budget": 12, "step_budget": "auto"},
    ]),
    profile=st.sampled_from([FLAT, STEEP]),
)
def test_each_row_is_what_the_target_gives_it_alone(case, knobs, profile):
    target, draft, prompts, ids, mask, settings = case
    with profiled(profile):
        got = specexec(target, draft, ids, mask, max_depth=6, learnt_state=LearntState(), **knobs, **settings)
    assert_each_row_is_what_the_target_gives_it_alone(target, prompts, ids, mask, settings, got)


def test_the_total_follows_the_forward_profile():
    """Four rows of likely chains: a forward flat to 64 tokens takes every node it can feed; one whose seconds
    rise from the first token takes fewer."""
    trees = [chain(30, -0.05) for _ in range(4)]
    flat, steep = (AutoStepTotal(profile, 0.01, cap=30).choose(trees, draft_forwards=8) for profile in (FLAT, STEEP))
    assert flat == 60  # the 64-token flat region less the four roots
    assert steep < flat


def test_the_trees_grow_to_twice_their_share_of_the_last_total():
    totals = AutoStepTotal(FLAT, 0.01, cap=30)
    assert totals.tree_budget(4) == 30  # no total yet: the cap
    totals.choose([chain(30, -0.05) for _ in range(4)], draft_forwards=8)
    assert totals.tree_budget(4) == 30 and totals.tree_budget(8) == 15


def test_a_batch_with_step_budget_auto_cuts_its_trees_to_the_profiles_totals():
    """The same batch under a flat and a steep forward: the steep one verifies fewer nodes per step."""
    target = tiny_model("llama", seed=3)
    draft = perturbed_copy(target, 0.0, seed=4)
    ids, mask = left_padded(random_prompts(5, [4, 6, 3, 5]))
    fed = {}
    for name, profile in (("flat", FLAT), ("steep", STEEP)):
        stats = SpecExecStats()
        with profiled(profile):
            specexec(target, draft, ids, mask, max_new_tokens=12, pad_token_id=PAD, budget=24, step_budget="auto",
                     specexec_stats=stats, learnt_state=LearntState())
        fed[name] = max(step.tree_size for step in stats.steps)
    assert fed["steep"] < fed["flat"]


@pytest.mark.parametrize("knobs", [{"budget": "auto"}, {"budget": 6, "step_budget": "auto"}])
def test_each_rows_samples_follow_the_targets_distribution(knobs):
    target = tiny_model("llama", seed=11, vocab_size=VOCAB, sharpness=3.0)
    draft = perturbed_copy(target, 0.3, seed=12)
    ids, mask = left_padded([PROMPT, PROMPT, torch.tensor([[4, 1, 1, 3, 0, 2]])])
    sampling = {"temperature": 0.5}
    torch.manual_seed(2024)
    counts: dict = {}
    state = LearntState()
    with profiled(STEEP):
        for _ in range(SAMPLES):
            out = target.generate(
                ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, top_k=None,
                top_p=None, **sampling, assistant_model=draft, speculator="specexec", max_branch=3,
                learnt_state=state, **knobs,
            )
            outcome = tuple(out[1, ids.shape[1] :].tolist())
            counts[outcome] = counts.get(outcome, 0) + 1
    assert chi_square_p(counts, exact_distribution(target, processors(sampling))) > 1e-3


def test_step_budget_auto_leaves_one_prompt_as_its_budget_grows_it():
    target = tiny_model("llama", seed=3)
    draft = perturbed_copy(target, 0.05, seed=4)
    stats = SpecExecStats()
    got = target.generate(
        PROMPT, max_new_tokens=8, do_sample=False, assistant_model=draft, speculator="specexec", budget=5,
        step_budget="auto", specexec_stats=stats,
    )
    assert got.tolist() == target.generate(PROMPT, max_new_tokens=8, do_sample=False).tolist()
    assert max(step.tree_size for step in stats.steps) == 5 + 1


def test_a_fixed_step_budget_beside_budget_auto_is_refused_naming_step_budget_auto():
    target = tiny_model("llama", seed=3)
    ids, mask = left_padded(random_prompts(1, [3, 4]))
    with pytest.raises(ValueError, match='step_budget="auto"'):
        specexec(target, target, ids, mask, max_new_tokens=4, budget="auto", step_budget=8)
