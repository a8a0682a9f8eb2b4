"""SpecExec tree growth: best-first search over cumulative draft log-probability.

The search keeps a pool of candidate nodes and, within it, the ``budget + 1`` best (the root included),
ranked by cumulative log-prob with ties going to the lower index. A child's cumulative log-prob never exceeds
its parent's and a child's index always exceeds its parent's, so that ranking puts every parent ahead of its
children: the kept set is always a tree. Each draft forward expands the best kept nodes not yet expanded; the
search stops when none of them could still produce a child that ranks inside the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import SpecExecConfig
from .tree import TokenTree

ExpandFn = Callable[[TokenTree, torch.Tensor], torch.Tensor]
"""``expand(pool, nodes) -> logprobs``: the draft's next-token log-probs ``[len(nodes), vocab]`` at ``nodes``."""

SearchFn = Callable[..., "SearchResult"]
"""``search(root_token, expand, config, max_depth=None, device=None) -> SearchResult``: a tree-growth policy.
``grow_tree`` is SpecExec's; other policies (static trees, independent beams) plug into the same drafting and
verification machinery through ``SpecExecCandidateGenerator(..., search=...)``."""


@dataclass
class SearchResult:
    """What one tree growth produced.

    Args:
        tree: The kept tree, re-indexed (node 0 is the root).
        pool: Every candidate the search generated, in generation order.
        pool_index: ``[tree.num_nodes]`` position of each kept node in ``pool``.
        draft_forwards: Calls made to ``expand``.
    """

    tree: TokenTree
    pool: TokenTree
    pool_index: torch.Tensor
    draft_forwards: int


def rank_nodes(logprobs: torch.Tensor) -> torch.Tensor:
    """Node indices best first: higher cumulative log-prob first, lower index first among equals."""
    return torch.argsort(-logprobs, stable=True)


def grow_tree(
    root_token: int,
    expand: ExpandFn,
    config: SpecExecConfig,
    max_depth: int | None = None,
    device: torch.device | str | None = None,
) -> SearchResult:
    """Grows the SpecExec tree under ``root_token``.

    Args:
        root_token: The last committed token.
        expand: Runs the draft on a batch of pool nodes and returns their next-token log-probs.
        config: ``budget``, ``max_depth``, ``max_branch``, ``expand_per_forward`` and ``max_draft_forwards``.
        max_depth: Tighter depth limit for this tree (e.g. the tokens still allowed, minus the bonus token).
        device: Where the tree's tensors live.
    """
    depth_limit = config.depth_limit(max_depth)
    forward_limit = None if config.max_draft_forwards is None else 1 + config.max_draft_forwards
    pool = TokenTree.from_root(root_token, device=device)
    expanded = torch.zeros(1, dtype=torch.bool, device=pool.device)
    kept = torch.zeros(1, dtype=torch.long, device=pool.device)  # best first
    forwards = 0
    while forward_limit is None or forwards < forward_limit:
        frontier = kept[~expanded[kept] & (pool.depths[kept] < depth_limit)]
        tree_is_full = kept.numel() == config.budget + 1
        # A child ranks after its parent and after every node of equal log-prob, so only a parent strictly
        # better than the worst kept node can still place a child inside a full tree.
        worst_kept = pool.logprobs[kept[-1]]
        if tree_is_full:
            frontier = frontier[pool.logprobs[frontier] > worst_kept]
        if frontier.numel() == 0:
            break
        nodes = frontier[: config.expand_per_forward]
        logprobs = expand(pool, nodes)
        forwards += 1
        expanded[nodes] = True

        child_logprobs, child_tokens = logprobs.float().topk(min(config.max_branch, logprobs.shape[-1]), dim=-1)
        cumulative = pool.logprobs[nodes, None] + child_logprobs.to(pool.device)
        useful = torch.isfinite(cumulative)
        if tree_is_full:
            useful &= cumulative > worst_kept
        parents = nodes[:, None].expand_as(cumulative)
        pool.add_children(parents[useful], child_tokens.to(pool.device)[useful], cumulative[useful])
        expanded = torch.cat([expanded, expanded.new_zeros(pool.num_nodes - expanded.numel())])
        kept = rank_nodes(pool.logprobs)[: config.budget + 1]

    pool_index = kept.sort().values
    return SearchResult(pool.select(pool_index), pool, pool_index, forwards)
