"""Recursive rejection sampling over children drawn from the draft: exactly the target's distribution.

Over a vocabulary of a few tokens every ordered draw of ``k`` candidates without replacement can be enumerated, so
the output distribution of :func:`rejection_chain` is computed exactly, not sampled.
"""

from __future__ import annotations

import itertools

import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from specexec_hf import SpecExecConfig
from specexec_hf.core.acceptance_map import AcceptanceMap
from specexec_hf.core.verify import rejection_chain, rejection_sample, taken_probabilities
from specexec_hf.hf.candidate_generator import SpecExecCandidateGenerator

DRAFT = tiny_model("llama", seed=5, vocab_size=12, sharpness=1.0)


@st.composite
def distributions(draw, vocab: int) -> torch.Tensor:
    """A distribution over ``vocab`` tokens, some of them possibly impossible."""
    weights = [draw(st.one_of(st.just(0.0), st.floats(0.01, 1.0))) for _ in range(vocab)]
    if sum(weights) == 0:
        weights[draw(st.integers(0, vocab - 1))] = 1.0
    weights = torch.tensor(weights, dtype=torch.float64)
    return weights / weights.sum()


@st.composite
def chain_cases(draw):
    """A target and a draft distribution, tokens fixed in advance, and how many to draw after them."""
    vocab = draw(st.integers(2, 5))
    target, draft = draw(distributions(vocab)), draw(distributions(vocab))
    fixed = draw(st.lists(st.integers(0, vocab - 1), max_size=2, unique=True))
    left = int((draft.index_fill(0, torch.tensor(fixed, dtype=torch.long), 0.0) > 0).sum())
    count = draw(st.integers(0 if fixed else 1, left)) if left else 0
    return target, draft, fixed, count


def draws_without_replacement(draft: torch.Tensor, count: int, fixed: list[int] = ()):
    """Every ordered draw of ``count`` distinct tokens from ``draft`` without replacement and without ``fixed``, with
    its probability, each after the fixed tokens."""
    left = draft.index_fill(0, torch.tensor(list(fixed), dtype=torch.long), 0.0)
    possible = (left > 0).nonzero().flatten().tolist()
    for order in itertools.permutations(possible, count):
        probability, remaining = 1.0, left.clone()
        for token in order:
            probability *= float(remaining[token] / remaining.sum())
            remaining[token] = 0.0
        yield torch.tensor([*fixed, *order], dtype=torch.long), probability


@given(chain_cases())
def test_rejection_chain_emits_exactly_the_target_distribution(case):
    target, draft, fixed, count = case
    emitted = torch.zeros_like(target)
    for candidates, probability in draws_without_replacement(draft, count, fixed):
        accept, residual = rejection_chain(target, draft, candidates, fixed=len(fixed))
        assert bool(((accept >= 0) & (accept <= 1)).all())
        taken = taken_probabilities(accept)
        emitted.index_add_(0, candidates, probability * taken)
        emitted += probability * (1 - taken.sum()) * residual
    assert torch.allclose(emitted, target, atol=1e-9), (emitted, target)


@given(chain_cases())
def test_a_draft_equal_to_the_target_has_its_first_drawn_candidate_accepted_and_fixed_ones_at_their_probability(case):
    _, draft, fixed, count = case
    candidates = next(draws_without_replacement(draft, count, fixed))[0]
    accept, _ = rejection_chain(draft, draft, candidates, fixed=len(fixed))
    left = 1.0
    for token, rate in zip(fixed, accept.tolist()):
        if left < 1e-9:  # the fixed tokens before took all the mass: this one is never reached
            break
        assert abs(rate - float(draft[token]) / left) < 1e-9  # the target's own draw, given the fixed ones before
        left -= float(draft[token])
    if count and left > 1e-9:
        assert abs(float(accept[len(fixed)]) - 1.0) < 1e-9


def test_rejection_sample_follows_the_target_and_takes_a_candidate_at_least_sum_min_p_q_of_the_time():
    """Seeded draws of two candidates each from the draft, then the sampler: the target's frequencies, and a drawn
    candidate at least as often as the first candidate alone is accepted, ``sum min(p, q)``."""
    target = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    draft = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    torch.manual_seed(0)
    draws, taken = [], 0
    for _ in range(4000):
        candidates = torch.multinomial(draft, 2, replacement=False)  # without replacement, in draw order
        draws.append(rejection_sample(target, draft, candidates))
        taken += draws[-1] in candidates.tolist()
    frequencies = torch.bincount(torch.tensor(draws), minlength=4).double() / len(draws)
    assert torch.allclose(frequencies, target, atol=0.03), frequencies
    assert taken / len(draws) > float(torch.minimum(target, draft).sum()) + 0.05


@given(st.integers(0, 2**16), st.integers(2, 24))
@settings(max_examples=15, deadline=None)
def test_drawn_children_kept_in_a_tree_are_the_first_of_their_draw(seed, budget):
    """A node's children in the tree must be the first ``k`` tokens of its draw without replacement, whatever the
    ranking: the rejection chain is exact only for a prefix of the draw. The map here favours later ranks (the draft's
    second token is accepted far more often than its first), which would otherwise keep later draws alone."""
    acceptance_map = AcceptanceMap()
    acceptance_map.observe(torch.full((400,), -2.0), torch.arange(400) % 4, torch.arange(400) % 4 != 0)
    generator = SpecExecCandidateGenerator(
        # min_draft_gain=0: the tree fills its budget, so every kept child is checked
        DRAFT, SpecExecConfig(budget=budget, max_branch=5, expand_per_forward=3, min_draft_gain=0.0),
        acceptance_map=acceptance_map, sampled_children=True,
    )
    torch.manual_seed(seed)
    result = generator.grow_tree(torch.tensor([[5, 9, 2, 7]]))
    drawn = {node: tokens for expansion in generator._expansions
             for node, tokens in zip(expansion.nodes.tolist(), expansion.tokens.tolist())}
    tree_parents, tree_tokens = result.tree.host_lists()
    pool_index = result.pool_index.tolist()
    assert result.tree.num_nodes == budget + 1
    for node in range(result.tree.num_nodes):
        children = [tree_tokens[child] for child in range(1, result.tree.num_nodes) if tree_parents[child] == node]
        if children:
            assert children == drawn[pool_index[node]][: len(children)]
