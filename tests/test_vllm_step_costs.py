"""step_budget="auto" in the vLLM proposer without an engine: the setting, the forward cost learnt from timed steps,
the totals it chooses and the trees' growth budgets."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")  # the package imports vLLM

from specexec_hf.core.batch_budget import TREE_HEADROOM
from specexec_hf.hf.autobudget import PROBE_EVERY
from specexec_hf.vllm.settings import ProposerSettings
from specexec_hf.vllm.step_costs import StepCosts

pytestmark = pytest.mark.vllm

# One SpecExec-like tree of 64 nodes: reach probabilities falling with depth and rank.
TREE = torch.tensor([math.log(0.8**depth * 0.5**rank) for depth in range(1, 9) for rank in range(8)])


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def streamed_forward(tokens: int) -> float:
    """A target streamed from disk: 0.3 s up to 65 tokens fed, then 5 ms per token more."""
    return 0.3 + 0.005 * max(tokens - 65, 0)


def run_steps(costs: StepCosts, clock: Clock, rows: int, steps: int, rest: float = 0.05) -> list[int]:
    """Steps of ``rows`` requests, each with a tree like ``TREE`` grown to the costs' tree budget, timed on
    ``clock`` by :func:`streamed_forward`; the totals chosen."""
    totals = []
    for _ in range(steps):
        tree = TREE[: costs.tree_budget(rows, TREE.numel())]
        total = costs.choose([tree] * rows)
        totals.append(total)
        costs.forward_started(rows + total)
        clock.now += streamed_forward(rows + total)
        costs.forward_finished()
        clock.now += rest
        costs.proposed()
    return totals


def test_step_budget_auto_is_a_setting():
    settings = ProposerSettings.from_sources({"draft_model": "d", "tree_verification": True, "step_budget": "auto"}, {})
    assert settings.step_budget == "auto"
    from_env = ProposerSettings.from_sources({"draft_model": "d", "tree_verification": True},
                                             {"SPECEXEC_STEP_BUDGET": "AUTO"})  # fmt: skip
    assert from_env.step_budget == "auto"
    with pytest.raises(ValueError, match="tree_verification=true"):
        ProposerSettings.from_sources({"draft_model": "d", "step_budget": "auto"}, {})
    with pytest.raises(ValueError, match="not a number"):
        ProposerSettings.from_sources({"draft_model": "d", "tree_verification": True, "step_budget": "most"}, {})


def test_the_sweep_finds_the_flat_region_and_the_batch_shares_it():
    """The first steps double the total from one node per request until the forward stops being flat; then eight
    requests share about the flat region's 65 tokens, and one request keeps about its whole tree."""
    clock = Clock()
    costs = StepCosts(clock)
    sweep = run_steps(costs, clock, rows=8, steps=5)
    assert sweep == [8, 16, 32, 64, 128] and costs.swept  # fed 136 tokens at 0.655 s, over 1.5 x 0.3 s
    assert costs.measured() == {16: 0.3, 24: 0.3, 40: 0.3, 72: 0.335, 136: 0.655}
    settled = run_steps(costs, clock, rows=8, steps=4 * PROBE_EVERY)[-PROBE_EVERY + 1 :]
    chosen = sorted(settled)[len(settled) // 2]  # the probe steps' neighbours aside
    assert 65 - 8 - 8 <= chosen <= 65 - 8, settled  # within a bucket of the knee
    assert all(chosen / 1.5 <= total <= chosen * 1.5 for total in settled), settled
    one = run_steps(costs, clock, rows=1, steps=PROBE_EVERY)[-PROBE_EVERY + 1 :]
    assert all(TREE.numel() - 4 <= total <= TREE.numel() for total in one), one  # its last nodes barely reached


def test_a_sweep_over_small_trees_ends_where_they_end():
    clock = Clock()
    costs = StepCosts(clock)
    assert run_steps(costs, clock, rows=1, steps=9)[:8] == [1, 2, 4, 8, 16, 32, 64, 64] and costs.swept


@given(st.lists(st.tuples(st.integers(1, 4096), st.floats(0.001, 10.0)), min_size=1, max_size=30))
def test_the_learnt_curve_never_falls_nor_falls_below_its_smallest_feed(forwards):
    """Noisy forwards (a smaller feed timed slower than a larger one) still read as a cost that never falls as the
    feed grows, and feeds below the smallest timed cost what it cost (no extrapolation towards zero seconds)."""
    costs = StepCosts()
    for tokens, seconds in forwards:
        costs.observe_forward(tokens, seconds)
    curve = costs.forward_curve()
    seconds = [curve(tokens) for tokens in range(1, 2 * max(tokens for tokens, _ in forwards))]
    assert all(later >= earlier for earlier, later in zip(seconds, seconds[1:]))
    smallest = min(tokens for tokens, _ in forwards)
    assert curve(1) == curve(smallest) > 0


@given(st.integers(1, 64), st.integers(0, 4096), st.integers(1, 256))
def test_each_tree_grows_to_its_share_of_the_expected_total_with_headroom(rows, last_total, cap):
    costs = StepCosts()
    assert costs.tree_budget(rows, cap) == cap  # before any step: the budget setting
    costs.last_total = last_total
    sweeping = costs.tree_budget(rows, cap)
    assert 1 <= sweeping <= cap
    assert sweeping == cap or rows * sweeping >= TREE_HEADROOM * 2 * last_total  # the sweep doubles the total
    costs.swept = True
    budget = costs.tree_budget(rows, cap)
    assert 1 <= budget <= sweeping
    assert budget == cap or rows * budget >= TREE_HEADROOM * last_total
