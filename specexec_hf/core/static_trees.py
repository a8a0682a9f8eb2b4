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
  per-rank acceptance vector ``p`` (``p[r]``: how likely the target's choice is the draft's rank-r token),
  assuming acceptance is independent of the position in the tree. The vector is learnt online from the walks
  (:meth:`SequoiaSearch.observe`) and, given the measured cost of a step (``budget="auto"``), the tree's size and
  depth are Sequoia's hardware-aware choice: the most expected tokens per second.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .config import SpecExecConfig
from .search import DeviceLike, SearchPolicy, SearchResult, TopCandidates, register_tree_policy, walked_nodes
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

    Attributes:
        recorded_ranks: The draft's top tokens the fill keeps at each expanded node for :meth:`observe`
            (:attr:`SearchResult.draft_top_tokens`); 0 for a policy that does not learn.
    """

    recorded_ranks: int = 0

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
        self.config = config
        self.depth_limit = config.depth_limit(max_depth)
        self.pool = TokenTree.from_root(root_token, device=device)
        self.forwards = 0
        self.parents: torch.Tensor | None = None  # the shape's, once the vocabulary size is known
        self.ranks: torch.Tensor | None = None
        # Per expansion, the expanded nodes and the draft's top policy.recorded_ranks tokens there.
        self.recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
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
        if self.parents is None or self.ranks is None:  # both set together, once
            shape = self.policy.cached_shape(self.config.resolved_budget, self.depth_limit, logprobs.shape[-1])
            self.parents = torch.tensor(shape.parents, dtype=torch.long, device=pool.device)
            self.ranks = torch.tensor(shape.ranks, dtype=torch.long, device=pool.device)
        parents, ranks = self.parents, self.ranks
        # In level order the parents are non-decreasing, so the children of the current level are the next
        # contiguous run of shape nodes, added in shape order: pool indices equal shape indices.
        first = pool.num_nodes
        last = int(torch.searchsorted(parents, first))
        child_parents, child_ranks = parents[first:last], ranks[first:last]
        top = max(int(child_ranks.max()) + 1, min(self.policy.recorded_ranks, logprobs.shape[-1]))
        top_logprobs, top_tokens = logprobs.float().topk(top, dim=-1)
        if self.policy.recorded_ranks:
            self.recorded.append((nodes, top_tokens[:, : self.policy.recorded_ranks]))
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
        top_tokens = None
        if self.recorded:
            width = self.recorded[0][1].shape[-1]
            top_tokens = torch.full((pool.num_nodes, width), -1, dtype=torch.long, device=pool.device)
            for nodes, tokens in self.recorded:
                top_tokens[nodes.to(pool.device)] = tokens.to(pool.device)
        return SearchResult(
            pool, pool, torch.arange(pool.num_nodes, device=pool.device), self.forwards, draft_top_tokens=top_tokens
        )


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


@dataclass(frozen=True)
class StepCost:
    """Modelled seconds of one step with a static tree: the target's forward over the root and the tree's nodes,
    plus one draft forward per level that has children.

    Args:
        target_seconds: The target's forward time over ``n`` tokens (e.g. ``budget="auto"``'s measured profile,
            :class:`~specexec_hf.hf.autobudget.ForwardProfile`).
        draft_forward_seconds: The time of one draft forward.
    """

    target_seconds: Callable[[int], float]
    draft_forward_seconds: float

    def __call__(self, nodes: int, depth: int) -> float:
        """Seconds of a step whose tree has ``nodes`` nodes below the root and ``depth`` levels."""
        return self.target_seconds(nodes + 1) + depth * self.draft_forward_seconds


class SequoiaSearch(StaticTreeSearch):
    """Sequoia's static tree: optimal for a per-rank acceptance vector learnt online, sized by the step's cost.

    Sequoia's dynamic program maximises ``sum over nodes of prod(p[rank] along the node's path)``, the expected
    number of accepted tokens when acceptance depends only on ranks. Every factor is at most 1, so a node
    never scores above its parent, and the ``budget`` best nodes therefore always form a tree: enumerating
    nodes best first (a heap over "next child of a node" and "next sibling" moves) yields exactly the DP's
    optimum in ``O(budget log budget)`` instead of its ``O(budget^2 * ranks * depth)``.

    The vector starts from ``acceptance`` and is learnt from every walk (:meth:`observe`): at each visited node
    the draft expanded, which of its top ``len(acceptance)`` tokens the target chose (or, sampling, the probability
    that it chose each), whatever the shape held there, so ranks the tree does not hold are learnt too. The shapes
    are rebuilt when a rank's rate has moved by more than ``rebuild_tolerance`` since they were built, not every
    step. The evidence is a :class:`RankAcceptance`, which several policies can share (:meth:`learn_into`): a policy
    chosen by name (``generate(..., tree_search="sequoia")``) is built for its call around the vector kept in the
    call's :class:`~specexec_hf.hf.learnt_state.LearntState`, so later calls with the same draft go on learning; a
    policy object passed to several calls keeps its own.

    Size: by default the ``budget`` best nodes. Given the step's cost (:meth:`size_by_cost`, which
    ``generate(budget="auto")`` calls with the forward-time profile it measures, or ``step_cost``), Sequoia's
    hardware-aware choice: the size (up to ``budget``) and depth limit with the most expected tokens per modelled
    second (:func:`sized_nodes`).

    Args:
        acceptance: ``p[r]`` for ranks ``0..R-1`` (ranks beyond are never used), the starting vector.
            ``None``: :data:`PRIOR_ACCEPTANCE`.
        learn: Learn the vector from the walks; False keeps ``acceptance`` (a fixed-prior baseline).
        prior_strength: How many visited nodes the starting vector is worth.
        rebuild_tolerance: Largest change of a rank's learnt rate that keeps the current shapes.
        step_cost: The modelled cost of a step, to size the tree by; ``None``: ``budget`` nodes.
    """

    def __init__(
        self,
        acceptance: Sequence[float] | None = None,
        learn: bool = True,
        prior_strength: float = 4.0,
        rebuild_tolerance: float = 0.01,
        step_cost: StepCost | None = None,
    ) -> None:
        super().__init__()
        acceptance = PRIOR_ACCEPTANCE if acceptance is None else acceptance
        if not acceptance or any(not 0 <= p <= 1 for p in acceptance):
            raise ValueError(f"acceptance must be a non-empty list of probabilities, got {list(acceptance)!r}.")
        if prior_strength <= 0 or rebuild_tolerance < 0:
            raise ValueError(
                f"prior_strength must be positive and rebuild_tolerance at least 0, got {prior_strength!r} and "
                f"{rebuild_tolerance!r}."
            )
        self.acceptance = [float(p) for p in acceptance]
        self.learn = learn
        self.recorded_ranks = len(self.acceptance) if learn else 0
        self.rebuild_tolerance = rebuild_tolerance
        self.step_cost = step_cost
        # Running evidence per rank, the starting vector counting as prior_strength visited nodes.
        prior = torch.tensor(self.acceptance, dtype=torch.float64)
        self.learnt = RankAcceptance(prior * prior_strength, prior_strength)

    def learnt_acceptance(self) -> list[float]:
        """The current estimate of the per-rank acceptance vector (the shapes follow it within the tolerance)."""
        return self.learnt.rates()

    def learn_into(self, learnt: RankAcceptance) -> None:
        """From now on learns into ``learnt`` (shared with other policies, which then pool what they learn) and
        builds its shapes from ``learnt``'s current rates.

        Args:
            learnt: The running evidence to read and add to; its ranks become the policy's.
        """
        self.learnt = learnt
        self.acceptance = learnt.rates()
        self.recorded_ranks = len(self.acceptance) if self.learn else 0
        self._shapes.clear()

    def observe(
        self, result: SearchResult, choices: Sequence[int], choice_probs: Sequence[torch.Tensor] | None = None
    ) -> None:
        """Counts, at each node the walk visited that the draft expanded, which of its top tokens the target chose
        (sampling: each one's probability under the target's distribution), and rebuilds the shapes when the
        learnt vector has moved past the tolerance.

        Args:
            result: The search whose tree the target verified.
            choices: The target's token at the root and at each accepted node after it.
            choice_probs: When the target samples, the ``[1, vocab]`` distribution each choice was drawn from.
        """
        if not self.learn or result.draft_top_tokens is None:
            return
        visited = walked_nodes(result.tree, choices)
        top_tokens = result.draft_top_tokens[visited]
        expanded = top_tokens[:, 0] >= 0
        if choice_probs is None:
            chosen = torch.tensor(choices[: len(visited)], device=top_tokens.device)
            hits = (top_tokens == chosen[:, None]).double()
        else:
            probs = torch.cat(list(choice_probs[: len(visited)])).to(top_tokens.device)
            hits = probs.gather(-1, top_tokens.clamp(min=0)).double()
        # One host read per walk: the hits per rank, then the number of expanded visited nodes.
        counts = torch.cat([hits[expanded].sum(0), expanded.sum(0, keepdim=True).double()]).cpu()
        # A vocabulary smaller than the ranks never picks the rest.
        self.learnt.hits[: counts.numel() - 1] += counts[:-1]
        self.learnt.visits += float(counts[-1])
        learnt = self.learnt_acceptance()
        if max(abs(new - old) for new, old in zip(learnt, self.acceptance)) > self.rebuild_tolerance:
            self.acceptance = learnt
            self._shapes.clear()

    def size_by_cost(self, target_seconds: Callable[[int], float], draft_forward_seconds: float) -> bool:
        """Sizes the trees by the modelled tokens per second from now on (see :func:`sized_nodes`)."""
        self.step_cost = StepCost(target_seconds, draft_forward_seconds)
        self._shapes.clear()
        return True

    def shape(self, budget: int, max_depth: int, vocab_size: int) -> TreeShape:
        acceptance = self.acceptance[:vocab_size]
        if self.step_cost is None:
            parents, ranks, _ = best_first_nodes(acceptance, budget, max_depth)
        else:
            parents, ranks, _ = sized_nodes(acceptance, budget, max_depth, self.step_cost)
        return TreeShape.from_nodes(parents, ranks)


@dataclass
class RankAcceptance:
    """The running evidence a learning :class:`SequoiaSearch` keeps about its per-rank acceptance vector: the rate
    of rank ``r`` is ``hits[r] / visits``, the starting vector counting as ``prior_strength`` visited nodes.

    Args:
        hits: ``[R]`` float64, per rank, how often (greedy) or how likely (sampling) the target chose the draft's rank-r
            token at a visited node the draft expanded, prior included.
        visits: Visited expanded nodes, prior included.
    """

    hits: torch.Tensor
    visits: float

    def rates(self) -> list[float]:
        """The per-rank acceptance vector learnt so far."""
        return (self.hits / self.visits).tolist()


PRIOR_ACCEPTANCE = tuple(0.5 ** (rank + 1) for rank in range(16))
"""Sequoia's acceptance vector before anything is measured: each rank half as likely as the one before, over the
16 ranks SpecExec considers per node by default (``max_branch``), as ``budget="auto"``'s acceptance profile starts."""

register_tree_policy("sequoia", SequoiaSearch)


def sized_nodes(
    acceptance: Sequence[float], budget: int, max_depth: int, step_cost: StepCost
) -> tuple[list[int], list[int], list[float]]:
    """Sequoia's hardware-aware tree: among the optimal trees of every size up to ``budget`` and every depth limit
    up to ``max_depth``, the one with the most expected tokens per step (accepted nodes plus the bonus token) per
    modelled second of the step.

    The optimal tree of ``n`` nodes under a depth limit is the first ``n`` of :func:`best_first_nodes` under that
    limit, so one enumeration per depth limit gives every size; raising the limit past the depth the
    unconstrained enumeration reaches changes nothing, so the search stops there.

    Args:
        acceptance: ``p[r]``, as for :func:`best_first_nodes`.
        budget: Most nodes below the root.
        max_depth: Deepest level allowed.
        step_cost: Modelled seconds of a step by node count and depth.

    Returns:
        ``(parents, ranks, values)`` of the chosen tree, as :func:`best_first_nodes` gives them (at least one node
        below the root when the budget and depth allow one).
    """
    best: tuple[float, int, int] | None = None  # (tokens per second, depth limit, nodes)
    for depth_limit in range(1, max_depth + 1):
        parents, _, values = best_first_nodes(acceptance, budget, depth_limit)
        depths, tokens, deepest = [0], 1.0, 0
        for node in range(1, len(parents)):
            depths.append(depths[parents[node]] + 1)
            tokens, deepest = tokens + values[node], max(deepest, depths[node])
            rate = tokens / step_cost(node, deepest)
            if best is None or rate > best[0]:  # ties keep the smaller, shallower tree
                best = (rate, depth_limit, node)
        if deepest < depth_limit:  # the enumeration no longer reaches the limit: deeper limits repeat it
            break
    if best is None:
        return [-1], [-1], [1.0]
    parents, ranks, values = best_first_nodes(acceptance, budget, best[1])
    return parents[: best[2] + 1], ranks[: best[2] + 1], values[: best[2] + 1]


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
