"""Tree growth: the protocol every tree policy implements, and SpecExec's best-first search.

A policy (:class:`SearchPolicy`) starts one :class:`TreeSearch` per tree; the search is driven step by step:
``next_nodes()`` names the pool nodes the draft should expand, ``add_expansion()`` takes the draft's answer, and
``result()`` gives the tree. Whoever drives it owns the draft forwards, so one tree (a callback loop, the policy's
``__call__``) and a batch of trees (one batched forward per round: ``hf.candidate_generator.grow_trees``)
are driven alike whatever the policy. Policies differ in what an expansion may carry, said by capability flags.

SpecExec's best-first search keeps a pool of candidate nodes and, within it, the ``budget + 1`` best (the root
included), ranked by cumulative log-prob with ties going to the lower index. A child's cumulative log-prob never exceeds
its parent's and a child's index always exceeds its parent's, so that ranking puts every parent ahead of its
children: the kept set is always a tree. Each draft forward expands the best kept nodes not yet expanded; the
search stops when none of them could still produce a child that ranks inside the budget.

Policies are also known by name (:data:`TREE_POLICIES`, ``generate(..., tree_search="sequoia")``): each module
registers its policies with one :func:`register_tree_policy` line beside the class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

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


DeviceLike = torch.device | str | None
"""Where a tree's tensors live (``None``: the default device)."""

ExpandFn = Callable[[TokenTree, torch.Tensor], "torch.Tensor | TopCandidates"]
"""``expand(pool, nodes) -> logprobs``: the draft's next-token log-probs ``[len(nodes), vocab]`` at ``nodes`` (or, for
a policy that ``ranks_children``, their best children as :class:`TopCandidates`)."""


@dataclass
class SearchResult:
    """What one tree growth produced.

    Args:
        tree: The kept tree, re-indexed (node 0 is the root).
        pool: Every candidate the search generated, in generation order.
        pool_index: ``[tree.num_nodes]`` position of each kept node in ``pool``.
        draft_forwards: Calls made to ``expand``.
        draft_top_tokens: ``[tree.num_nodes, k]`` the draft's top-k tokens, best first, at each tree node it
            expanded (rows of -1 elsewhere), for a policy that learns per-rank acceptance from the walk
            (:meth:`SearchPolicy.observe`); ``None`` when the search did not record them.
    """

    tree: TokenTree
    pool: TokenTree
    pool_index: torch.Tensor
    draft_forwards: int
    draft_top_tokens: torch.Tensor | None = None


class TreeSearch(Protocol):
    """One tree's growth, driven step by step; what every policy's :meth:`SearchPolicy.start` returns.

    ``pool`` is the candidate pool grown so far (node 0 is the root); the draft attends to it when it expands nodes.
    """

    pool: TokenTree

    def next_nodes(self) -> torch.Tensor | None:
        """The pool nodes the next draft forward expands, or ``None`` once the tree is done."""
        ...

    def add_expansion(self, nodes: torch.Tensor, logprobs: torch.Tensor | TopCandidates) -> None:
        """Takes the draft's next-token log-probs ``[len(nodes), vocab]`` at ``nodes`` (or, when the policy
        ``ranks_children``, their children already chosen) and grows the pool."""
        ...

    def result(self) -> SearchResult:
        """The kept tree, re-indexed root first, and the pool it came from."""
        ...


class SearchPolicy:
    """A tree-growth policy: starts one :class:`TreeSearch` per tree and says what its expansions may carry.

    A new policy subclasses this and defines :meth:`start`; drafting, batching, verification and the KV caches are
    shared, so the output stays exact whatever tree it grows.

    Attributes:
        ranks_children: ``add_expansion`` takes each node's children already chosen and scored
            (:class:`TopCandidates`), so the drafter may rank them by estimated acceptance instead of draft
            probability. A policy that fixes which rank goes where (a static shape) cannot.
        draws_children: The chosen children may be a draw from the draft rather than its top tokens (for a
            sampling target verifying them by rejection sampling); implies ``ranks_children``.
    """

    ranks_children: bool = False
    draws_children: bool = False

    def start(
        self, root_token: int, config: SpecExecConfig, max_depth: int | None = None, device: DeviceLike = None
    ) -> TreeSearch:
        """A new search for the tree under ``root_token``.

        Args:
            root_token: The last committed token.
            config: The tree-growth knobs; ``budget`` and ``depth_limit`` bind every policy.
            max_depth: Tighter depth limit for this tree (e.g. the tokens still allowed, minus the bonus token).
            device: Where the tree's tensors live.
        """
        raise NotImplementedError

    def __call__(
        self,
        root_token: int,
        expand: ExpandFn,
        config: SpecExecConfig,
        max_depth: int | None = None,
        device: DeviceLike = None,
    ) -> SearchResult:
        """Grows one tree under ``root_token``, calling ``expand`` once per draft forward.

        Args:
            root_token: The last committed token.
            expand: Runs the draft on a batch of pool nodes and returns their next-token log-probs.
            config: The tree-growth knobs.
            max_depth: Tighter depth limit for this tree.
            device: Where the tree's tensors live.
        """
        search = self.start(root_token, config, max_depth, device)
        while (nodes := search.next_nodes()) is not None:
            search.add_expansion(nodes, expand(search.pool, nodes))
        return search.result()

    def observe(
        self, result: SearchResult, choices: Sequence[int], choice_probs: Sequence[torch.Tensor] | None = None
    ) -> None:
        """Learns from the target's walk down a tree this policy grew; the drafter calls it after every walk.
        Does nothing unless the policy learns (Sequoia's learns its per-rank acceptance vector).

        Args:
            result: The search whose tree the target verified.
            choices: The target's token at the root and at each accepted node after it (the walk's tokens).
            choice_probs: When the target samples, the ``[1, vocab]`` distribution it sampled each choice from.
        """

    def size_by_cost(self, target_seconds: Callable[[int], float], draft_forward_seconds: float) -> bool:
        """Offers the measured cost of a step (``budget="auto"``): a policy that picks its own tree size from it
        takes it and returns True, and ``budget`` is then only its upper bound; the default declines, and
        ``budget="auto"`` picks the budget before every step instead.

        Args:
            target_seconds: The target's forward time over ``n`` tokens (the root and ``n - 1`` tree nodes).
            draft_forward_seconds: The time of one draft forward.
        """
        return False


def walked_nodes(tree: TokenTree, choices: Sequence[int]) -> list[int]:
    """The tree nodes where the target made each of ``choices``: the root, then each child it chose, until a choice
    leaves the tree (one host read of the tree).

    Args:
        tree: The verified tree.
        choices: The walk's tokens, the choice at the root first.
    """
    children = tree.child_index()
    visited, node = [], 0
    for choice in choices:
        visited.append(node)
        node = children.get((node, choice), -1)
        if node < 0:
            break
    return visited


def rank_nodes(logprobs: torch.Tensor) -> torch.Tensor:
    """Node indices best first: higher cumulative log-prob first, lower index first among equals."""
    return torch.argsort(-logprobs, stable=True)


class BestFirstSearch:
    """SpecExec's tree growth, one draft forward at a time (a :class:`TreeSearch`; its policy is :data:`grow_tree`).

    ``next_nodes()`` names the pool nodes the draft should expand next (``None`` once the search is done) and
    ``add_expansion()`` takes their next-token log-probs, or their children already chosen (:class:`TopCandidates`).

    Args:
        root_token: The last committed token.
        config: ``budget``, ``max_depth``, ``max_branch``, ``expand_per_forward`` and ``max_draft_forwards``.
        max_depth: Tighter depth limit for this tree (e.g. the tokens still allowed, minus the bonus token).
        device: Where the tree's tensors live.
    """

    def __init__(
        self, root_token: int, config: SpecExecConfig, max_depth: int | None = None, device: DeviceLike = None
    ):
        self.config = config
        self.depth_limit = config.depth_limit(max_depth)
        self.forward_limit = None if config.max_draft_forwards is None else 1 + config.max_draft_forwards
        self.pool = TokenTree.from_root(root_token, device=device)
        self.expanded = torch.zeros(1, dtype=torch.bool, device=self.pool.device)
        self.kept = torch.zeros(1, dtype=torch.long, device=self.pool.device)  # best first
        self.forwards = 0
        self.forecast = 0.0  # expected accepted tokens of the kept tree (the root excluded)
        self.stalled = False  # the last forward gained less than min_draft_gain asks
        # Children that cannot rank inside a full tree are dropped, unless a later tree may start from a subtree.
        self.prunes_children = True

    @classmethod
    def seeded(
        cls, pool: TokenTree, expanded: torch.Tensor, config: SpecExecConfig, max_depth: int | None = None
    ) -> BestFirstSearch:
        """A search that goes on from an already grown ``pool`` (node 0 its root, cumulative log-probs from it):
        a subtree an earlier search grew under what is now the root (see :meth:`extend`).

        Args:
            pool: The candidates so far; no node deeper than the depth limit.
            expanded: ``[pool.num_nodes]`` which of them the draft has expanded.
            config: As for the constructor.
            max_depth: As for the constructor.
        """
        search = cls(int(pool.tokens[0]), config, max_depth, pool.device)
        search.pool, search.expanded = pool, expanded.to(pool.device)
        search.kept = rank_nodes(pool.logprobs)[: config.resolved_budget + 1]
        search.forecast = float(pool.logprobs[search.kept[1:]].double().exp().sum())
        return search

    def extend(self, budget: int) -> None:
        """Lets a finished search grow on towards ``budget`` kept nodes, with no draft-forward cap or gain stop: the
        draft's work while the target verifies this search's tree, which a next tree under one of its nodes starts
        from (:meth:`seeded`)."""
        self.config = replace(self.config, budget=budget, max_draft_forwards=None, min_draft_gain=0.0)
        self.forward_limit, self.stalled = None, False
        # Under a later root every child may rank inside the budget: an expanded node keeps all its children.
        self.prunes_children = False

    def _tree_is_full(self) -> bool:
        return self.kept.numel() == self.config.resolved_budget + 1

    def next_nodes(self) -> torch.Tensor | None:
        """The best kept nodes that could still place a child inside the budget, or ``None`` when none can."""
        if self.stalled or (self.forward_limit is not None and self.forwards >= self.forward_limit):
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
        if self._tree_is_full() and self.prunes_children:
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
        self.kept = contenders[rank_nodes(pool.logprobs[contenders])][: self.config.resolved_budget + 1]
        if self.config.min_draft_gain > 0:
            forecast = float(pool.logprobs[self.kept[1:]].double().exp().sum())
            self.stalled = forecast - self.forecast < self.config.min_draft_gain * (1 + forecast)
            self.forecast = forecast

    def result(self) -> SearchResult:
        """The kept tree (re-indexed, root first) and the pool it came from."""
        pool_index = self.kept.sort().values
        return SearchResult(self.pool.select(pool_index), self.pool, pool_index, self.forwards)


class BestFirstPolicy(SearchPolicy):
    """SpecExec's policy: :class:`BestFirstSearch`, whose children may be ranked by estimated acceptance and drawn."""

    ranks_children = True
    draws_children = True

    def start(
        self, root_token: int, config: SpecExecConfig, max_depth: int | None = None, device: DeviceLike = None
    ) -> BestFirstSearch:
        return BestFirstSearch(root_token, config, max_depth, device)


grow_tree = BestFirstPolicy()
"""SpecExec's tree growth, the default policy: ``grow_tree(root_token, expand, config, max_depth=None, device=None)``
grows one tree through the ``expand`` callback; ``grow_tree.start(...)`` gives the step-by-step search."""

TREE_POLICIES: dict[str, Callable[..., SearchPolicy]] = {}
"""Tree policies by name: each factory's keyword arguments are the policy's options (see :func:`tree_policy`)."""


def register_tree_policy(name: str, factory: Callable[..., SearchPolicy]) -> None:
    """Makes a policy selectable by name, as ``generate(..., tree_search=name)`` and :func:`tree_policy`.

    Args:
        name: The policy's name; must not be registered already.
        factory: Builds the policy; called with no arguments when selected by name alone.
    """
    if name in TREE_POLICIES:
        raise ValueError(f"A tree policy named {name!r} is already registered: pick another name.")
    TREE_POLICIES[name] = factory


def tree_policy(name: str, **options: Any) -> SearchPolicy:
    """The registered policy ``name``, built with ``options`` (e.g. ``tree_policy("sequoia", acceptance=[...])``).

    Args:
        name: A key of :data:`TREE_POLICIES`.
        options: Keyword arguments for the policy's factory.
    """
    if name not in TREE_POLICIES:
        raise ValueError(
            f"Unknown tree policy {name!r}: the registered ones are {sorted(TREE_POLICIES)}. Pass one of those, a "
            "SearchPolicy object, or register yours with specexec_hf.core.search.register_tree_policy."
        )
    return TREE_POLICIES[name](**options)


register_tree_policy("specexec", lambda: grow_tree)
