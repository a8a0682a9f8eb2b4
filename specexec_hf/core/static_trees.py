"""Baseline tree-growth policies for benchmarks: a SpecInfer-style tree and a Sequoia-style static tree.

Both are *static* trees: the shape (which node hangs under which parent, as the draft's rank-r choice there) is
fixed before drafting, and the draft only fills in the tokens. They are :class:`~.search.SearchPolicy` objects
like SpecExec's ``grow_tree`` and registered by name (``"specinfer"``, ``"sequoia"``), so
``generate(tree_search=...)``, batched drafting, verification and the KV caches are shared and only the policy
differs. The fill (:class:`StaticTreeFill`) expands one tree level per draft forward, all of that level's parents in
one batched call. The shape fixes each child's rank, so an acceptance map cannot re-rank the children and they
cannot be drawn (both capability flags stay off).

- SpecInfer (Miao et al., 2024), expansion-based construction ``<k, 1, 1, ...>``: the draft's top-k tokens
  under the root, each continued greedily, i.e. k independent draft beams merged at the root.
- Sequoia (Chen et al., 2024): the shape that maximises the expected number of accepted tokens under a
  measured per-rank acceptance vector ``p`` (``p[r]``: how likely the target's choice is the draft's rank-r
  token), assuming acceptance is independent of the position in the tree.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import SpecExecConfig
from .search import DeviceLike, SearchPolicy, SearchResult, TopCandidates, register_tree_policy
from .tree import TokenTree


@dataclass(frozen=True)
class TreeShape:
    """A tree of draft ranks, in level order: depth first, then parent, then rank.

    Args:
        parents: Each node's parent (node 0, the root, has -1); parents come before their children.
        ranks: Which of the parent's draft candidates the node takes (0: the draft's top token); -1 for the root.
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    @classmethod
    def from_nodes(cls, parents: Sequence[int], ranks: Sequence[int]) -> TreeShape:
        """Re-indexes any tree whose parents precede their children into level order."""
        depth = [0] * len(parents)
        for node in range(1, len(parents)):
            depth[node] = depth[parents[node]] + 1
        new_index = {0: 0}
        order = [0]
        for level in range(1, max(depth, default=0) + 1):
            level_nodes = sorted(
                (n for n in range(len(parents)) if depth[n] == level), key=lambda n: (new_index[parents[n]], ranks[n])
            )
            for node in level_nodes:
                new_index[node] = len(order)
                order.append(node)
        return cls(
            parents=tuple(-1 if n == 0 else new_index[parents[n]] for n in order),
            ranks=tuple(-1 if n == 0 else ranks[n] for n in order),
        )

    @property
    def num_nodes(self) -> int:
        return len(self.parents)


class StaticTreeSearch(SearchPolicy):
    """A tree-growth policy that fills a precomputed shape with the draft's ranked tokens.

    Subclasses define ``shape(budget, max_depth, vocab_size)``; shapes are cached per ``(budget, max_depth,
    vocab_size)`` because the depth limit only changes near the end of a generation.
    """

    def __init__(self) -> None:
        self._shapes: dict[tuple[int, int, int], TreeShape] = {}

    def shape(self, budget: int, max_depth: int, vocab_size: int) -> TreeShape:
        """The shape with at most ``budget`` nodes below the root and at most ``max_depth`` levels.

        Args:
            budget: Draft tokens in the tree.
            max_depth: Deepest level.
            vocab_size: Ranks must stay below it.
        """
        raise NotImplementedError

    def cached_shape(self, budget: int, max_depth: int, vocab_size: int) -> TreeShape:
        """:meth:`shape`, computed once per ``(budget, max_depth, vocab_size)`` (one policy may serve drafts of
        other vocabularies)."""
        key = (budget, max_depth, vocab_size)
        if key not in self._shapes:
            self._shapes[key] = self.shape(budget, max_depth, vocab_size)
        return self._shapes[key]

    def start(
        self, root_token: int, config: SpecExecConfig, max_depth: int | None = None, device: DeviceLike = None
    ) -> StaticTreeFill:
        return StaticTreeFill(self, root_token, config, max_depth, device)


class StaticTreeFill:
    """One static tree's fill (a :class:`~.search.TreeSearch`): one draft forward per level with children.

    The root's expansion (which also feeds the draft the unseen history) tells the vocabulary size and so the
    shape; each later expansion fills the next level's children with the draft's tokens of the shape's ranks.

    Args:
        policy: Gives the shape for ``config.budget`` and the depth limit.
        root_token: The last committed token.
        config: ``budget`` and ``max_depth`` (``max_branch`` and ``expand_per_forward`` belong to SpecExec).
        max_depth: Tighter depth limit for this tree.
        device: Where the tree's tensors live.
    """

    def __init__(
        self,
        policy: StaticTreeSearch,
        root_token: int,
        config: SpecExecConfig,
        max_depth: int | None = None,
        device: DeviceLike = None,
    ):
        self.policy = policy
        self.budget = config.budget
        self.depth_limit = config.depth_limit(max_depth)
        self.pool = TokenTree.from_root(root_token, device=device)
        self.forwards = 0
        self.parents: torch.Tensor | None = None  # the shape's, once the vocabulary size is known
        self.ranks: torch.Tensor | None = None
        # The nodes the next forward expands; none when there is no room for draft tokens (the target then adds its
        # bonus token alone).
        self.level = torch.zeros(1, dtype=torch.long, device=self.pool.device) if self.depth_limit >= 1 else None

    def next_nodes(self) -> torch.Tensor | None:
        """The current level's parents, or ``None`` once the shape is filled."""
        return self.level

    def add_expansion(self, nodes: torch.Tensor, logprobs: torch.Tensor | TopCandidates) -> None:
        """Adds the children of ``nodes`` (the current level) the shape asks for.

        Args:
            nodes: What :meth:`next_nodes` returned.
            logprobs: ``[len(nodes), vocab]`` the draft's next-token log-probs at ``nodes``.
        """
        if isinstance(logprobs, TopCandidates):
            raise TypeError("A static tree takes each child by its draft rank: expand with the full log-probs.")
        pool = self.pool
        self.forwards += 1
        if self.parents is None:
            shape = self.policy.cached_shape(self.budget, self.depth_limit, logprobs.shape[-1])
            self.parents = torch.tensor(shape.parents, dtype=torch.long, device=pool.device)
            self.ranks = torch.tensor(shape.ranks, dtype=torch.long, device=pool.device)
        parents, ranks = self.parents, self.ranks
        # In level order the parents are non-decreasing, so the children of the current level are the next
        # contiguous run of shape nodes, added in shape order: pool indices equal shape indices.
        first = pool.num_nodes
        last = int(torch.searchsorted(parents, first))
        child_parents, child_ranks = parents[first:last], ranks[first:last]
        top_logprobs, top_tokens = logprobs.float().topk(int(child_ranks.max()) + 1, dim=-1)
        rows = torch.searchsorted(nodes, child_parents)
        pool.add_children(
            child_parents,
            top_tokens.to(pool.device)[rows, child_ranks],
            pool.logprobs[child_parents] + top_logprobs.to(pool.device)[rows, child_ranks],
        )
        level = torch.unique(parents[last : int(torch.searchsorted(parents, last))])
        self.level = level if level.numel() > 0 else None

    def result(self) -> SearchResult:
        """The filled tree; every pool node is kept."""
        pool = self.pool
        return SearchResult(pool, pool, torch.arange(pool.num_nodes, device=pool.device), self.forwards)


class SpecInferSearch(StaticTreeSearch):
    """SpecInfer-style tree: the draft's top-k tokens under the root, each continued by its draft's top-1 chain.

    With ``beams=None`` the tree is as deep as allowed and ``k = ceil(budget / max_depth)`` so that it uses
    the whole budget, which is what an equal-budget comparison needs (it may exceed SpecExec's ``max_branch``).

    Args:
        beams: Fixed number of beams ``k``; the chains then share the budget equally.
    """

    def __init__(self, beams: int | None = None) -> None:
        super().__init__()
        self.beams = beams

    def shape(self, budget: int, max_depth: int, vocab_size: int) -> TreeShape:
        beams = min(self.beams or math.ceil(budget / max_depth), budget, vocab_size)
        parents, ranks = [-1], [-1]
        for beam in range(beams):
            # Beams take the budget's remainder first so the chain lengths differ by at most one.
            length = min(budget // beams + (beam < budget % beams), max_depth)
            parent, rank = 0, beam
            for _ in range(length):
                parents.append(parent)
                ranks.append(rank)
                parent, rank = len(parents) - 1, 0
        return TreeShape.from_nodes(parents, ranks)


register_tree_policy("specinfer", SpecInferSearch)


class SequoiaSearch(StaticTreeSearch):
    """Sequoia-style static tree, optimal for a per-rank acceptance vector.

    Sequoia's dynamic program maximises ``sum over nodes of prod(p[rank] along the node's path)``, the expected
    number of accepted tokens when acceptance depends only on ranks. Every factor is at most 1, so a node
    never scores above its parent, and the ``budget`` best nodes therefore always form a tree: enumerating
    nodes best first (a heap over "next child of a node" and "next sibling" moves) yields exactly the DP's
    optimum in ``O(budget log budget)`` instead of its ``O(budget^2 * ranks * depth)``.

    By name (``generate(..., tree_search="sequoia")``) it starts from :data:`PRIOR_ACCEPTANCE`, the geometric
    prior ``p[r] = 2**-(r+1)`` that ``budget="auto"``'s acceptance profile also starts from, and does not learn:
    a policy sees no walk. For the measured vector pass it, as ``tree_policy("sequoia", acceptance=p)`` (``p``
    from :func:`~specexec_hf.tools.acceptance.measure_acceptance`, or the rates ``budget="auto"`` has learnt:
    ``AutoBudget.acceptance.rates()``).

    Args:
        acceptance: ``p[r]`` for ranks ``0..R-1``; ranks beyond are unused. ``None``: :data:`PRIOR_ACCEPTANCE`.
    """

    def __init__(self, acceptance: Sequence[float] | None = None) -> None:
        super().__init__()
        acceptance = PRIOR_ACCEPTANCE if acceptance is None else acceptance
        if not acceptance or any(not 0 <= p <= 1 for p in acceptance):
            raise ValueError(f"acceptance must be a non-empty list of probabilities, got {list(acceptance)!r}.")
        self.acceptance = [float(p) for p in acceptance]

    def shape(self, budget: int, max_depth: int, vocab_size: int) -> TreeShape:
        parents, ranks, _ = best_first_nodes(self.acceptance[:vocab_size], budget, max_depth)
        return TreeShape.from_nodes(parents, ranks)


PRIOR_ACCEPTANCE = tuple(0.5 ** (rank + 1) for rank in range(8))
"""Sequoia's acceptance vector before anything is measured: each rank half as likely as the one before."""

register_tree_policy("sequoia", SequoiaSearch)


def best_first_nodes(
    acceptance: Sequence[float], budget: int, max_depth: int
) -> tuple[list[int], list[int], list[float]]:
    """The ``budget`` nodes of highest expected acceptance under a per-rank vector, best first.

    Args:
        acceptance: ``p[r]``, the probability that the target's choice is the draft's rank-r token.
        budget: Nodes to produce below the root.
        max_depth: Deepest level.

    Returns:
        ``(parents, ranks, values)`` for the root (index 0, value 1) and the nodes in the order produced;
        ``values[i]`` is the probability that node i is accepted.
    """
    # Siblings are taken in order of acceptance, so each next sibling is worth at most the previous one (a
    # measured vector need not decrease with rank).
    by_acceptance = sorted(range(len(acceptance)), key=lambda r: -acceptance[r])
    parents, ranks, values, depths = [-1], [-1], [1.0], [0]
    # Entries: (-value, tie-break, parent, sibling slot). The tie-break keeps earlier pushes first.
    heap: list[tuple[float, int, int, int]] = []
    counter = 0

    def push(parent: int, slot: int) -> None:
        nonlocal counter
        if slot < len(by_acceptance) and depths[parent] < max_depth:
            heapq.heappush(heap, (-values[parent] * acceptance[by_acceptance[slot]], counter, parent, slot))
            counter += 1

    push(0, 0)
    while heap and len(parents) <= budget:
        negative_value, _, parent, slot = heapq.heappop(heap)
        parents.append(parent)
        ranks.append(by_acceptance[slot])
        values.append(-negative_value)
        depths.append(depths[parent] + 1)
        push(len(parents) - 1, 0)  # the new node's best child
        push(parent, slot + 1)  # the new node's next sibling
    return parents, ranks, values
