"""The online acceptance map: a sound prior, monotone estimates, learning what the target accepts."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st

import specexec_hf  # noqa: F401  (installs speculator="specexec")
from specexec_hf import SpecExecStats
from specexec_hf.core.acceptance_map import RANK_GROUPS, AcceptanceMap
from specexec_hf.core.config import SpecExecConfig
from specexec_hf.core.search import TopCandidates, grow_tree

observations = st.lists(
    st.tuples(st.floats(1e-6, 1.0), st.integers(0, 20), st.booleans()), min_size=0, max_size=200
)


def observe_all(acceptance_map: AcceptanceMap, records) -> None:
    if records:
        probs, ranks, accepted = zip(*records)
        acceptance_map.observe(torch.log(torch.tensor(probs)), torch.tensor(ranks), torch.tensor(accepted))


@given(records=observations)
def test_estimates_never_fall_as_the_draft_grows_surer(records):
    acceptance_map = AcceptanceMap()
    observe_all(acceptance_map, records)
    for rank in range(RANK_GROUPS):
        rates = acceptance_map.acceptance(rank)
        assert bool((rates[1:] >= rates[:-1] - 1e-12).all()) and bool(((rates >= 0) & (rates <= 1)).all())
    logprobs = torch.log(torch.linspace(1e-6, 1.0, 500))
    for rank in range(RANK_GROUPS):
        scores = acceptance_map(logprobs, torch.full_like(logprobs, rank, dtype=torch.long))
        assert bool((scores[1:] > scores[:-1]).all())  # a likelier candidate always ranks first within a rank


@given(records=observations, later=observations, prior_strength=st.floats(0.5, 20.0))
def test_a_map_read_back_from_json_ranks_and_learns_as_the_original(records, later, prior_strength):
    original = AcceptanceMap(prior_strength=prior_strength)
    observe_all(original, records)
    restored = AcceptanceMap.from_state(json.loads(json.dumps(original.state())))
    assert restored.state() == original.state()
    logprobs = torch.log(torch.linspace(1e-6, 1.0, 50)).expand(RANK_GROUPS + 1, -1)
    ranks = torch.arange(RANK_GROUPS + 1)[:, None].expand_as(logprobs)
    assert torch.equal(restored(logprobs, ranks), original(logprobs, ranks))
    before = original.state()
    observe_all(restored, later)  # the copy learns on its own
    assert original.state() == before
    observe_all(original, later)
    assert torch.equal(restored(logprobs, ranks), original(logprobs, ranks))


def test_a_state_from_other_settings_is_refused():
    state = AcceptanceMap().state()
    with pytest.raises(ValueError, match="lacks \\['trials'\\]"):
        AcceptanceMap.from_state({key: value for key, value in state.items() if key != "trials"})
    with pytest.raises(ValueError, match="other settings"):
        AcceptanceMap.from_state({**state, "edges": [0.0, 0.5, 1.0]})
    with pytest.raises(ValueError, match="accepted <= trials"):
        AcceptanceMap.from_state({**state, "accepted": [[1.0] * len(row) for row in state["trials"]]})


def test_without_evidence_the_draft_order_stands():
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    scores = AcceptanceMap()(logprobs, torch.arange(4)[None])
    assert scores.argsort(descending=True).tolist() == [[0, 1, 2, 3]]
    assert scores[0, 0] > scores[0, 1] + math.log(1.2)  # the prior is the draft's probability, not a flat map


def test_learns_that_the_top_token_wins_under_greedy_verification():
    """A confident, correct draft: its top token is always the target's argmax, whatever its probability."""
    acceptance_map = AcceptanceMap()
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        probs = torch.softmax(torch.randn(8, generator=generator), -1).sort(descending=True).values
        acceptance_map.observe(torch.log(probs), torch.arange(8), torch.arange(8) == 0)
    scores = acceptance_map(torch.log(torch.tensor([[0.2, 0.3]])), torch.tensor([[0, 1]]))
    assert scores[0, 0] > scores[0, 1]  # a 20% top token outranks a 30% runner-up
    assert float(acceptance_map.acceptance(0)[7]) > 0.85  # the [0.2, 0.3) bin of top tokens (prior: 0.245)


def test_recovers_a_known_acceptance_curve():
    acceptance_map = AcceptanceMap()
    generator = torch.Generator().manual_seed(1)
    probs = torch.rand(20000, generator=generator)
    accepted = torch.rand(20000, generator=generator) < probs.sqrt()
    acceptance_map.observe(torch.log(probs), torch.zeros(20000, dtype=torch.long), accepted)
    rates = acceptance_map.acceptance(0)
    centres = torch.tensor([0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85])  # bins 7..13 are [0.2, 0.3) ... [0.8, 0.9)
    assert torch.allclose(rates[7:14], centres.sqrt().double(), atol=0.05)


def test_draft_equal_to_target_fills_the_forward():
    """With the target as its own draft, every top token is accepted: once learnt, the tree is one deep chain and
    a step commits (nearly) budget + 1 tokens."""
    target = tiny_model("llama", seed=3, sharpness=1.0)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    for calibrated, floor in ((False, 0.0), (True, 0.9)):
        draft = perturbed_copy(target, 0.0, seed=4)
        for _ in range(4):  # the first calls teach the map, the last one is measured
            stats = SpecExecStats()
            target.generate(ids, max_new_tokens=64, do_sample=False, assistant_model=draft, speculator="specexec",
                            budget=32, acceptance_calibration=calibrated, specexec_stats=stats)
        best = 32  # 64 tokens in two forwards of budget + 1 = 33, the last one capped by the tokens left
        assert stats.tokens_per_target_forward >= floor * best
        if not calibrated:
            raw = stats.tokens_per_target_forward
    assert stats.tokens_per_target_forward > 2 * raw


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_calibrated_trees_forecast_the_tokens_the_target_accepts(noise):
    """Each step's forecast (the sum of its nodes' estimated path acceptance) matches, over a call, the tokens the
    walks accepted once the map has learnt; ranked by the draft's raw probability, the forecast is several times
    too low for a draft equal to its target (its top tokens are never certain, yet always accepted) and several
    times too high for a noisy draft."""
    target = tiny_model("llama", seed=3, sharpness=1.0)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    ratios = {}
    for calibrated in (False, True):
        draft = perturbed_copy(target, noise, seed=4)
        for _ in range(4):  # the first calls teach the map, the last one is measured
            stats = SpecExecStats()
            target.generate(ids, max_new_tokens=64, do_sample=False, assistant_model=draft, speculator="specexec",
                            budget=32, acceptance_calibration=calibrated, specexec_stats=stats)
        ratios[calibrated] = stats.forecast_ratio
        assert stats.summary()["forecast_ratio"] == ratios[calibrated]
    assert 0.7 < ratios[True] < 1.4, ratios
    assert not 0.5 < ratios[False] < 2, ratios


def test_a_handful_of_walks_moves_the_whole_curve():
    """The smooth prior learns from every bin of a rank group: five walks in which the draft's top token always won
    (at probabilities from 0.5 up) lift the top-token bins no walk visited, and sink the runners-up."""
    acceptance_map = AcceptanceMap()
    for top in (0.55, 0.65, 0.75, 0.85, 0.95):
        probs = torch.tensor([top, (1 - top) * 0.6, (1 - top) * 0.3, (1 - top) * 0.1])
        acceptance_map.observe(torch.log(probs), torch.arange(4), torch.arange(4) == 0)
    assert acceptance_map.trials[0, :10].sum() == 0  # no top token below 0.5 was seen
    assert float(acceptance_map.acceptance(0)[6]) > 2 * 0.1414  # bin [0.1, 0.2): prior 0.141
    assert float(acceptance_map.acceptance(1)[8]) < 0.5 * 0.3464  # bin [0.3, 0.4) of runners-up: prior 0.346


@given(
    seed=st.integers(0, 2**16),
    budget=st.integers(1, 40),
    max_branch=st.integers(1, 8),
    expand_per_forward=st.integers(1, 6),
)
def test_chosen_candidates_grow_the_tree_a_full_score_matrix_grows(seed, budget, max_branch, expand_per_forward):
    """An expansion may return each node's best children (TopCandidates) instead of vocabulary-wide scores in which
    every other token is -inf: the search keeps the same tree either way."""
    vocab = 12
    config = SpecExecConfig(budget=budget, max_branch=max_branch, expand_per_forward=expand_per_forward)

    def scores_at(pool, nodes):
        # A node's draft distribution depends on its token and depth only, so both searches see the same draft.
        rows = [torch.randn(vocab, generator=torch.Generator().manual_seed(seed * 997 + int(token) * 31 + int(depth)))
                for token, depth in zip(pool.tokens[nodes], pool.depths[nodes])]
        rows = torch.stack(rows)
        return torch.log_softmax(rows, -1)

    def full(pool, nodes):
        top = scores_at(pool, nodes).topk(max_branch, -1)
        return torch.full((nodes.numel(), vocab), -math.inf).scatter_(-1, top.indices, top.values)

    def chosen(pool, nodes):
        top = scores_at(pool, nodes).topk(max_branch, -1)
        return TopCandidates(top.indices, top.values)

    a, b = grow_tree(0, full, config), grow_tree(0, chosen, config)
    assert torch.equal(a.tree.tokens, b.tree.tokens) and torch.equal(a.tree.parents, b.tree.parents)
    assert torch.equal(a.tree.logprobs, b.tree.logprobs)  # the same scores, summed along the same paths
