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


@dataclass
class TopCandidates:
    """Each expanded node's best children, already chosen: what an expansion returns when it has ranked them itself
    (by estimated acceptance, say) and a vocabulary-wide score matrix would be waste.

    Args:
        tokens: ``[nodes, k]`` child tokens.
        scores: ``[nodes, k]`` their ranking scores (log-scale, added to the parent's cumulative score).
    """

    tokens: torch.Tensor
    scores: torch.Tensor


ExpandFn = Callable[[TokenTree, torch.Tensor], "torch.Tensor | TopCandidates"]
"""``expand(pool, nodes) -> logprobs``: the draft's next-token log-probs ``[len(nodes), vocab]`` at ``nodes`` (or, for
:class:`BestFirstSearch`, their best children as :class:`TopCandidates`)."""

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


class BestFirstSearch:
    """SpecExec's tree growth, one draft forward at a time.

    ``next_nodes()`` names the pool nodes the draft should expand next (``None`` once the search is done) and
    ``add_expansion()`` takes their next-token log-probs. :func:`grow_tree` drives one search through a callback;
    a caller holding several searches can serve all their requests with one batched draft forward per round.

    Args:
        root_token: The last committed token.
        config: ``budget``, ``max_depth``, ``max_branch``, ``expand_per_forward`` and ``max_draft_forwards``.
        max_depth: Tighter depth limit for this tree (e.g. the tokens still allowed, minus the bonus token).
        device: Where the tree's tensors live.
    """

    def __init__(
        self,
        root_token: int,
        config: SpecExecConfig,
        max_depth: int | None = None,
        device: torch.device | str | None = None,
    ):
        self.config = config
        self.depth_limit = config.depth_limit(max_depth)
        self.forward_limit = None if config.max_draft_forwards is None else 1 + config.max_draft_forwards
        self.pool = TokenTree.from_root(root_token, device=device)
        self.expanded = torch.zeros(1, dtype=torch.bool, device=self.pool.device)
        self.kept = torch.zeros(1, dtype=torch.long, device=self.pool.device)  # best first
        self.forwards = 0

    def _tree_is_full(self) -> bool:
        return self.kept.numel() == self.config.budget + 1

    def next_nodes(self) -> torch.Tensor | None:
        """The best kept nodes that could still place a child inside the budget, or ``None`` when none can."""
        if self.forward_limit is not None and self.forwards >= self.forward_limit:
            return None
        pool, kept = self.pool, self.kept
        eligible = ~self.expanded[kept] & (pool.depths[kept] < self.depth_limit)
        if self._tree_is_full():
            # A child ranks after its parent and after every node of equal log-prob, so only a parent strictly
            # better than the worst kept node can still place a child inside a full tree.
            eligible &= pool.logprobs[kept] > pool.logprobs[kept[-1]]
        frontier = kept[eligible]  # the search's one host read per draft forward: how many nodes to expand
        if frontier.numel() == 0:
            return None
        return frontier[: self.config.expand_per_forward]

    def add_expansion(self, nodes: torch.Tensor, logprobs: torch.Tensor | TopCandidates) -> None:
        """Adds the best ``max_branch`` children of each of ``nodes`` and re-ranks the kept set.

        Args:
            nodes: What :meth:`next_nodes` returned.
            logprobs: ``[len(nodes), vocab]`` the draft's next-token log-probs at ``nodes``, or their best children
                already chosen (at most ``max_branch`` per node).
        """
        pool = self.pool
        self.forwards += 1
        self.expanded[nodes] = True
        if isinstance(logprobs, TopCandidates):
            child_logprobs, child_tokens = logprobs.scores.float(), logprobs.tokens
        else:
            child_logprobs, child_tokens = logprobs.float().topk(min(self.config.max_branch, logprobs.shape[-1]), -1)
        cumulative = pool.logprobs[nodes, None] + child_logprobs.to(pool.device)
        useful = torch.isfinite(cumulative)
        if self._tree_is_full():
            useful &= cumulative > pool.logprobs[self.kept[-1]]
        added = useful.flatten().nonzero().squeeze(1)  # one host read for the three selections below
        parents = nodes[:, None].expand_as(cumulative).flatten()[added]
        tokens = child_tokens.to(pool.device).flatten()[added]
        first_new = pool.num_nodes
        pool.add_children(parents, tokens, cumulative.flatten()[added])
        self.expanded = torch.cat([self.expanded, self.expanded.new_zeros(pool.num_nodes - self.expanded.numel())])
        # Adding nodes never reorders the old ones, so the new kept set comes from the old one and the new nodes.
        # Those follow the old kept set, in index order, and the stable sort breaks ties by index as rank_nodes does.
        contenders = torch.cat([self.kept, torch.arange(first_new, pool.num_nodes, device=pool.device)])
        self.kept = contenders[rank_nodes(pool.logprobs[contenders])][: self.config.budget + 1]

    def result(self) -> SearchResult:
        """The kept tree (re-indexed, root first) and the pool it came from."""
        pool_index = self.kept.sort().values
        return SearchResult(self.pool.select(pool_index), self.pool, pool_index, self.forwards)


def grow_tree(
    root_token: int,
    expand: ExpandFn,
    config: SpecExecConfig,
    max_depth: int | None = None,
    device: torch.device | str | None = None,
) -> SearchResult:
    """Grows the SpecExec tree under ``root_token``, calling ``expand`` once per draft forward.

    Args:
        root_token: The last committed token.
        expand: Runs the draft on a batch of pool nodes and returns their next-token log-probs.
        config: ``budget``, ``max_depth``, ``max_branch``, ``expand_per_forward`` and ``max_draft_forwards``.
        max_depth: Tighter depth limit for this tree (e.g. the tokens still allowed, minus the bonus token).
        device: Where the tree's tensors live.
    """
    search = BestFirstSearch(root_token, config, max_depth, device)
    while (nodes := search.next_nodes()) is not None:
        search.add_expansion(nodes, expand(search.pool, nodes))
    return search.result()
