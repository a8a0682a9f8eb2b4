"""Context matching: the n-gram index against brute force, the mixture's math, its weight fit, and that trees
ranked with it keep greedy output identical to plain generate() while saving target forwards on repetitive text."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st

from specexec_hf import SpecExecConfig, SpecExecStats
from specexec_hf.core.context_match import ContextIndex, mix_context_guesses
from specexec_hf.hf.calibrated import CONTEXT_MATCH_ATTRIBUTE
from specexec_hf.tools.calibrate import fit_context_match_weights

tokens = st.lists(st.integers(0, 3), max_size=40)  # a small vocabulary, so that n-grams recur


def brute_force_match(history: list[int], context: list[int], max_order: int) -> tuple[int, dict[int, int]]:
    for order in range(min(max_order, len(context)), 0, -1):
        suffix = context[len(context) - order :]
        followers: dict[int, int] = {}
        for start in range(len(history) - order):
            if history[start : start + order] == suffix:
                follower = history[start + order]
                followers[follower] = followers.get(follower, 0) + 1
        if followers:
            return order, followers
    return 0, {}


@given(history=tokens, path=st.lists(st.integers(0, 3), max_size=6), max_order=st.integers(1, 6),
       cut=st.integers(0, 40), other=tokens)
def test_longest_match_equals_brute_force_after_any_sync_sequence(history, path, max_order, cut, other):
    index = ContextIndex(max_order)
    index.sync(other)  # an unrelated history first: the next sync must rebuild
    index.sync(history[:cut])
    index.sync(history)  # and then extend incrementally
    context = history + path
    assert index.longest_match(context) == brute_force_match(history, context, max_order)


@given(seed=st.integers(0, 2**16), weights=st.lists(st.floats(0.0, 0.99), min_size=1, max_size=4),
       history=tokens, vocab=st.integers(4, 9))
def test_mixture_is_the_weighted_average_of_draft_and_guesses(seed, weights, history, vocab):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, vocab, generator=generator, dtype=torch.float64)
    logits[:, 0] = -math.inf  # a token a restricted draft head cannot propose
    logprobs = torch.log_softmax(logits, dim=-1)
    index = ContextIndex(len(weights))
    index.sync(history)
    contexts = [history + [row % 4] for row in range(5)]
    matches = [index.longest_match(context) for context in contexts]
    mixed = mix_context_guesses(logprobs.clone(), matches, weights)
    for row, (order, followers) in enumerate(matches):
        weight = weights[order - 1] if order else 0.0
        guesses = torch.zeros(vocab, dtype=torch.float64)
        for token, count in followers.items():
            guesses[token] = count / sum(followers.values())
        expected = (1 - weight) * logprobs[row].exp() + weight * guesses
        assert torch.allclose(mixed[row].exp(), expected, atol=1e-12)
    assert torch.allclose(torch.logsumexp(mixed, dim=-1), torch.zeros(5, dtype=torch.float64), atol=1e-9)


@given(weight=st.floats(0.1, 0.9), seed=st.integers(0, 2**16))
def test_fit_recovers_the_mixture_weight_labels_were_drawn_with(weight, seed):
    generator = torch.Generator().manual_seed(seed)
    draft = torch.softmax(2 * torch.randn(20_000, 10, generator=generator, dtype=torch.float64), dim=-1)
    guess = torch.randint(0, 10, (20_000,), generator=generator)
    mixture = (1 - weight) * draft + weight * torch.nn.functional.one_hot(guess, 10)
    labels = torch.multinomial(mixture, 1, generator=generator)[:, 0]
    orders = torch.ones(20_000, dtype=torch.long)
    fit = fit_context_match_weights(draft.gather(-1, labels[:, None])[:, 0], (labels == guess).double(), orders, 2)
    assert fit.weights[0] == pytest.approx(weight, abs=0.03)
    assert fit.weights[1] == 0.0 and fit.positions == (20_000, 0)
    assert fit.cross_entropy <= fit.cross_entropy_without


def test_fit_needs_matched_positions():
    with pytest.raises(ValueError, match="No position with a context match"):
        fit_context_match_weights(torch.ones(3), torch.zeros(3), torch.zeros(3, dtype=torch.long), 2)


@pytest.mark.parametrize("weights", [[1.0], [-0.1], "0.5", [None], 0.5])
def test_bad_weights_are_refused_with_the_fix(weights):
    with pytest.raises(ValueError, match=r"context_match_weights must be None or a sequence of numbers in \[0, 1\)"):
        SpecExecConfig(context_match_weights=weights)


@given(seed=st.integers(0, 2**16), budget=st.integers(1, 24), noise=st.sampled_from([0.05, 2.0]),
       weights=st.lists(st.floats(0.0, 0.99), min_size=1, max_size=5), calibrated=st.booleans())
def test_greedy_output_is_unchanged_by_context_matching(seed, budget, noise, weights, calibrated):
    target = tiny_model("llama", seed=seed)
    draft = perturbed_copy(target, noise, seed=seed + 1)
    ids = torch.randint(0, 4, (1, 12), generator=torch.Generator().manual_seed(seed))  # repetitive prompt
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    if calibrated:  # the route greedy generate() takes for a draft calibrated by `specexec-hf calibrate`
        setattr(draft.config, CONTEXT_MATCH_ATTRIBUTE, tuple(weights))
        knob = {}
    else:
        knob = {"context_match_weights": weights}
    got = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft, speculator="specexec",
                          budget=budget, **knob)
    assert got.tolist() == expected.tolist()


def test_guesses_save_target_forwards_when_the_target_repeats_itself():
    target = tiny_model("llama", seed=3)
    draft = tiny_model("llama", seed=4)  # unrelated to the target: it rarely guesses right on its own
    ids = torch.tensor([[5, 6, 7, 8] * 4])
    expected = target.generate(ids, max_new_tokens=48, do_sample=False)
    answer = expected[0, ids.shape[1]:].tolist()
    # The case context matching is for: the target's answer repeats itself (a small random model loops).
    assert len(set(answer)) <= len(answer) // 4
    forwards = {}
    for weights in ((), (0.5, 0.8, 0.9, 0.95)):
        stats = SpecExecStats()
        got = target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=draft, speculator="specexec",
                              budget=8, context_match_weights=weights, specexec_stats=stats)
        assert got.tolist() == expected.tolist()
        forwards[weights] = stats.target_forwards
    assert forwards[(0.5, 0.8, 0.9, 0.95)] < forwards[()]
