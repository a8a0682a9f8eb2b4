"""A step's node total for a batch of trees: the one that maximises forecast tokens per second.

One target forward scores every running row's tree, so a step's cost is the forward over the rows' roots plus the
total of tree nodes kept, and what it buys is each row's committed token plus the expected accepted nodes. When the
step keeps the ``total`` nodes that rank best over all the trees (:func:`~.step_budget.kept_nodes`) and a node's
score is the log of the (calibrated) probability that the target's walk reaches it, the forecast tokens at a total
``T`` are ``rows + sum of exp(the T best scores)``: concave in ``T``, since each further node is likelier rejected
than the last. Against a forward cost that is flat up to some feed size (a target streamed from disk or RAM costs
about its weights' reading whatever it scores) and rising after, the best total fills the flat region and goes past
it only as far as the extra nodes pay for the extra seconds; with more rows, the same flat region is shared by more
trees, each getting fewer nodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

# Rates this close to the best are ties: summation order alone (a node reached with probability 1e-17) must not
# decide for more nodes.
RATE_TIE = 1e-9


def highest_rate(rates: Mapping[int, float]) -> int:
    """The key with the highest rate (tokens per second), the smallest key on ties (within a relative
    :data:`RATE_TIE`): no more nodes than pay.

    Args:
        rates: ``{total or budget: forecast tokens per second}``, not empty.
    """
    best = max(rates.values())
    return min(total for total, rate in rates.items() if rate >= best * (1 - RATE_TIE))


def forecast_tokens(node_scores: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[N + 1]`` forecast tokens of a step at each node total ``0..N`` (``N``: every tree's nodes): one per row
    plus the summed reach probabilities of the best ``T`` nodes.

    Args:
        node_scores: Per row, its tree's non-root nodes' log-probabilities of being reached by the walk (an empty
            tensor for a row without a tree, which still commits one token).
    """
    scores = torch.cat([scores.detach().double().cpu().flatten() for scores in node_scores] + [torch.zeros(0)])
    reach = scores.exp().clamp(max=1.0).sort(descending=True).values
    return len(node_scores) + torch.cat([torch.zeros(1, dtype=torch.float64), reach.cumsum(0)])


def step_total(
    node_scores: Sequence[torch.Tensor],
    feed_seconds: Callable[[int], float],
    fixed_seconds: float = 0.0,
    totals: Sequence[int] | None = None,
) -> int:
    """The step's node total (roots excluded) with the most forecast tokens per second.

    A step feeds each row's root and the kept nodes, and costs ``fixed_seconds + feed_seconds(rows + total)``; it
    commits :func:`forecast_tokens`. The total is never above the nodes the trees hold and never below one node per
    row that has a tree (fewer only where the trees hold fewer).

    Args:
        node_scores: Per row, its tree's non-root nodes' log-probabilities of being reached by the target's walk
            (:func:`~.step_budget.path_scores` without the root, calibrated by the acceptance map); an empty tensor
            for a row without a tree.
        feed_seconds: The target forward's seconds by tokens fed, not falling as the feed grows.
        fixed_seconds: The rest of a step's time (drafting, scheduling, the walk), paid whatever the total.
        totals: The totals to choose among (those above the trees' nodes are left out); ``None``: every total.
    """
    if fixed_seconds < 0:
        raise ValueError(f"A step's fixed seconds cannot be negative, got {fixed_seconds}.")
    tokens = forecast_tokens(node_scores)
    held = len(tokens) - 1
    live_rows = sum(scores.numel() > 0 for scores in node_scores)
    floor = min(live_rows, held)
    candidates = sorted({min(max(total, floor), held) for total in (range(held + 1) if totals is None else totals)})
    rows = len(node_scores)
    # A curve extrapolated below its measured feeds may reach zero seconds; a step never costs nothing.
    seconds = {total: max(fixed_seconds + feed_seconds(rows + total), 1e-9) for total in candidates}
    return highest_rate({total: float(tokens[total]) / seconds[total] for total in candidates})


# A row's tree grows to this many times its even share of the step's expected total: enough to feed that total even
# when the best nodes gather in a few trees, and room for the total to grow.
TREE_HEADROOM = 2


def row_tree_budget(rows: int, expected_total: int | None, cap: int) -> int:
    """Nodes each of ``rows`` trees grows to when a step keeps about ``expected_total`` of them in all:
    :data:`TREE_HEADROOM` times its even share, between 1 and ``cap`` (``cap`` when no total is expected yet).

    Args:
        rows: The trees grown this step.
        expected_total: The node total the step is expected to keep (``None``: not known yet).
        cap: The most nodes one tree may grow to.
    """
    if rows < 1 or expected_total is None:
        return cap
    return max(1, min(cap, math.ceil(TREE_HEADROOM * expected_total / rows)))
