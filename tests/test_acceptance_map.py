"""The online acceptance map: a sound prior, monotone estimates, learning what the target accepts."""

from __future__ import annotations

import math

import torch
from conftest import perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st

import specexec_hf  # noqa: F401  (installs speculator="specexec")
from specexec_hf import SpecExecStats
from specexec_hf.core.acceptance_map import RANK_GROUPS, AcceptanceMap

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
