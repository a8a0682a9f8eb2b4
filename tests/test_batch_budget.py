"""A step's node total for a batch of trees (core/batch_budget.py): its invariants, and one row choosing what
budget="auto" chooses for the same acceptance and forward profile."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specexec_hf.core.batch_budget import forecast_tokens, highest_rate, step_total
from specexec_hf.core.static_trees import best_first_nodes
from specexec_hf.hf.autobudget import AcceptanceProfile, AutoBudget, ForwardProfile

# Log reach probabilities of one tree's nodes: at most 0 (a node is reached no more often than always).
node_scores = st.lists(st.floats(-12.0, 0.0), max_size=24).map(lambda s: torch.tensor(s, dtype=torch.float64))
batches = st.lists(node_scores, min_size=1, max_size=6)


@st.composite
def forward_curves(draw: st.DrawFn) -> ForwardProfile:
    """A measured forward profile: seconds that never fall as the feed grows, flat or rising in places."""
    sizes = sorted(draw(st.sets(st.integers(2, 200), max_size=4)) | {1})  # measured from one token up
    steps = draw(st.lists(st.floats(0.0, 1.0), min_size=len(sizes), max_size=len(sizes)))
    start = draw(st.floats(0.01, 1.0))
    return ForwardProfile({size: start + sum(steps[: i + 1]) for i, size in enumerate(sizes)})


@given(batches, forward_curves(), st.floats(0.0, 1.0))
def test_the_total_stays_within_the_trees_and_gives_every_live_row_a_node(batch, curve, fixed):
    total = step_total(batch, curve, fixed)
    held = sum(scores.numel() for scores in batch)
    live = sum(scores.numel() > 0 for scores in batch)
    assert min(live, held) <= total <= held


@given(batches, forward_curves(), st.floats(0.0, 1.0), st.floats(0.0, 3.0))
def test_more_acceptance_never_gives_fewer_nodes(batch, curve, fixed, gain):
    """Every node likelier reached by the same factor (its log score raised by ``gain``, kept at most 0): each extra
    node buys more, against the same seconds, so the best total does not shrink."""
    floor = max((float(scores.max()) for scores in batch if scores.numel()), default=0.0)
    lowered = [scores - floor - gain for scores in batch]
    assert step_total([scores + gain for scores in lowered], curve, fixed) >= step_total(lowered, curve, fixed)


@given(batches, st.integers(1, 128), st.floats(0.01, 1.0), st.floats(0.0, 1.0))
def test_a_flat_forward_is_filled(batch, flat_up_to, seconds, fixed):
    """A forward costing the same up to ``flat_up_to`` tokens fed and much more after: the step feeds at least that
    many tokens where the trees hold them, whatever the acceptance (any node reached at all is free there)."""
    batch = [scores.clamp(min=-8.0) for scores in batch]  # reached at all: exp(-8) > 0 in float64 sums
    curve = ForwardProfile({1: seconds, flat_up_to: seconds, flat_up_to + 1: seconds * 100})
    total = step_total(batch, curve, fixed)
    held = sum(scores.numel() for scores in batch)
    assert len(batch) + total >= min(flat_up_to, len(batch) + held)


@given(batches)
def test_forecast_tokens_rise_by_at_most_one_per_node(batch):
    tokens = forecast_tokens(batch)
    assert tokens[0] == len(batch)
    gains = tokens.diff()
    assert bool((gains >= 0).all()) and bool((gains <= 1).all())
    assert bool((gains.diff() <= 1e-12).all())  # concave: the best nodes come first


def test_rising_costs_share_the_flat_region_among_more_rows():
    """One row takes its whole tree of 64 into a forward flat to 65 tokens; eight rows' trees of the same shape are cut
    to about the flat region (SpecExec trees of the default pair: reach probabilities falling by rank and depth)."""
    tree = torch.tensor([math.log(0.8**depth * 0.5**rank) for depth in range(1, 9) for rank in range(8)])
    curve = ForwardProfile({1: 0.3, 65: 0.3, 512: 2.4})
    assert step_total([tree], curve, 0.05) == tree.numel()
    eight = step_total([tree] * 8, curve, 0.05)
    assert 65 - 8 <= eight < 2 * 64


def test_highest_rate_prefers_the_smaller_total_on_ties():
    assert highest_rate({64: 2.0, 16: 2.0, 32: 1.0}) == 16
    assert highest_rate({64: 2.0 + 1e-15, 32: 2.0}) == 32  # rounding is no reason for more nodes
    assert highest_rate({64: 2.1, 32: 2.0}) == 64


def test_a_negative_fixed_cost_is_refused():
    with pytest.raises(ValueError, match="fixed seconds"):
        step_total([torch.zeros(2)], lambda tokens: 1.0, -0.5)


@given(st.lists(st.floats(0.0, 0.95), min_size=1, max_size=6), forward_curves())
def test_one_row_chooses_what_auto_budget_chooses(rates, curve):
    """One row whose tree holds the nodes AutoBudget models (the best nodes under the per-rank acceptance), at no
    draft cost: the same budget among AutoBudget's candidates."""
    candidates = (8, 16, 32, 64, 128)
    auto = AutoBudget(curve, 0.0, 4, AcceptanceProfile(hits=list(rates), visits=[1.0] * len(rates)), candidates)
    _, _, values = best_first_nodes(rates, max(candidates), max(candidates))
    scores = torch.tensor(values[1:], dtype=torch.float64).log()
    assert step_total([scores], curve, totals=candidates) == auto.choose()
