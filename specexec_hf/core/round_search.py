"""SpecExec's tree growth in fixed-shape rounds, with no host read between the draft forwards.

:class:`~.search.BestFirstSearch` reads the device after every draft forward: which kept nodes are still worth
expanding, which children to add, whether the forecast still grows. On a GPU each read makes the host wait for the
device, and a small draft's forward is shorter than the wait. :class:`RoundSearch` grows the same best-first tree
with every decision left on the device:

- Round 0 expands the root; every later round expands the ``width`` best unexpanded pool nodes (ranked by cumulative
  score, lower index first among equals) and adds each one's top ``max_branch`` children. A round's shapes depend
  only on its number (the pool grows by a fixed count per round), so the host never needs to look: the nodes fed
  to the draft, its width and the scores are tensors whose sizes the host knows in advance.
- A node that cannot place a child (expanded, at the depth limit, impossible) still fills its row of a round that
  has fewer worthwhile nodes than its width: its children score ``-inf`` and are never kept. Such a row is padding,
  as a captured draft forward needs.
- The kept tree is the ``budget + 1`` best pool nodes, as best-first keeps them: a child never scores above its
  parent and has a larger index, so they form a tree. Those are the nodes best-first keeps after the same number of
  draft forwards: both expand the best unexpanded candidates, and the only other candidates this search expands
  rank below every kept node, so their children never enter.
- The rounds come in batches whose length is fixed when the batch starts, since stopping when the tree stops
  improving would be a read per round. The end of a batch is the search's only host read: how many of the best
  nodes are possible candidates, and after how many forwards best-first would have stopped (no frontier node could
  still place a child inside the budget, or a forward gained less than ``min_draft_gain`` asks). While best-first
  would go on, another batch follows; :class:`RoundPolicy` sizes the first batch from the earlier trees' stops.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from .config import SpecExecConfig
from .search import DeviceLike, SearchPolicy, SearchResult, TopCandidates, rank_nodes, register_tree_policy
from .tree import TokenTree

NEVER = 2**62
"""The expansion round recorded for a pool node no round has expanded."""

LEARNT_TREES = 32
"""How many recent trees per budget :class:`RoundPolicy` sizes the rounds from."""


class RoundSearch:
    """One tree grown in fixed-shape rounds (a :class:`~.search.TreeSearch`; its policy is :class:`RoundPolicy`).

    The rounds come in batches: ``rounds`` of them, then, while best-first would still be growing the tree and
    ``extensions`` are left, another ``extension_rounds``. The end of a batch is the only place the search reads the
    device: how many of the best nodes are possible and after how many forwards best-first would have stopped.

    Args:
        root_token: The last committed token.
        config: ``budget``, ``max_depth``, ``max_branch`` (children per expanded node), ``expand_per_forward`` (the
            round width, at most ``budget``), ``max_draft_forwards`` (caps the rounds) and ``min_draft_gain`` (one of
            best-first's stopping rules, which decide whether to extend).
        rounds: Draft forwards in the first batch, the root's included.
        max_depth: Tighter depth limit for this tree.
        device: Where the tree's tensors live.
        policy: Told, once the tree is done, after how many forwards best-first would have stopped.
        extensions: How many more batches the tree may grow by, each after one read.
        extension_rounds: Draft forwards in each later batch; ``None``: ``rounds``.
    """

    def __init__(
        self,
        root_token: int,
        config: SpecExecConfig,
        rounds: int,
        max_depth: int | None = None,
        device: DeviceLike = None,
        policy: RoundPolicy | None = None,
        extensions: int = 0,
        extension_rounds: int | None = None,
    ):
        extension_rounds = rounds if extension_rounds is None else extension_rounds
        if min(rounds, extension_rounds) < 1 or extensions < 0:
            raise ValueError(
                f"A round search needs at least one round per batch (the root's) and no negative count of extensions, "
                f"got rounds={rounds}, extension_rounds={extension_rounds} and extensions={extensions}."
            )
        self.budget = config.resolved_budget
        self.branch = config.max_branch
        self.width = min(config.expand_per_forward, self.budget)
        self.min_draft_gain = config.min_draft_gain
        self.depth_limit = config.depth_limit(max_depth)
        self.most_rounds = rounds + extensions * extension_rounds
        if config.max_draft_forwards is not None:
            self.most_rounds = min(self.most_rounds, 1 + config.max_draft_forwards)
        if self.depth_limit < 1:  # no room for a draft token: the tree is the root alone, grown by no forward
            self.most_rounds = 0
        self.extension_rounds = extension_rounds
        self.limit = min(rounds, self.most_rounds)  # where the current batch ends
        self.policy = policy
        self.pool = TokenTree.from_root(root_token, device=device)
        device = self.pool.device
        # Per pool node, the round that created it (the root: -1) and the round that expanded it (NEVER: none yet).
        self.created_in = torch.full((1,), -1, dtype=torch.long, device=device)
        self.expanded_in = torch.full((1,), NEVER, dtype=torch.long, device=device)
        self.forwards = 0
        self.unexpanded = 1  # pool nodes no round has expanded: a count the host keeps without reading anything
        self.best_first_forwards: int | None = None  # after how many forwards best-first would have stopped, once read
        self._nodes = torch.zeros(1, dtype=torch.long, device=device)
        self._placing = torch.ones(1, dtype=torch.bool, device=device)  # which of _nodes may place children
        # When read: (forwards, the best nodes, how many of them are possible, best-first's forwards).
        self._read: tuple[int, torch.Tensor, int, int] | None = None

    def next_nodes(self) -> torch.Tensor | None:
        """The round's nodes: the root first, then the ``width`` best unexpanded nodes; ``None`` once the tree is
        done. Reads the device only at the end of a batch of rounds."""
        if self.forwards >= self.limit and not self._extended():
            return None
        if self.forwards > 0:
            pool = self.pool
            unexpanded = self.expanded_in == NEVER
            placing = unexpanded & (pool.depths < self.depth_limit) & torch.isfinite(pool.logprobs)
            # Padding rows come after every node that can place a child: unexpanded nodes first, so that no node is
            # fed twice while another never was.
            key = torch.where(
                placing, pool.logprobs, torch.where(unexpanded, torch.finfo(pool.logprobs.dtype).min, -math.inf)
            )
            self._nodes = rank_nodes(key)[: min(self.width, self.unexpanded)]
            self._placing = placing[self._nodes]
        return self._nodes

    def _extended(self) -> bool:
        """At the end of a batch: reads the device and, when best-first would still be growing the tree and a batch
        is left, starts the next one."""
        if self.forwards == 0:
            return False
        best_first_forwards = self._read_device()[3]
        if best_first_forwards <= self.forwards or self.limit >= self.most_rounds:
            return False
        self.limit = min(self.limit + self.extension_rounds, self.most_rounds)
        return True

    def _read_device(self) -> tuple[int, torch.Tensor, int, int]:
        """The search's one host read per batch: how many of the ``budget + 1`` best pool nodes are possible, and
        after how many forwards best-first would have stopped; returns what it keeps as ``_read``."""
        pool = self.pool
        ranked = rank_nodes(pool.logprobs)[: self.budget + 1]
        possible = torch.isfinite(pool.logprobs[ranked]).sum(0, keepdim=True)
        count, self.best_first_forwards = torch.cat([possible, self._best_first_forwards()]).tolist()
        self._read = (self.forwards, ranked, count, self.best_first_forwards)
        return self._read

    def add_expansion(self, nodes: torch.Tensor, logprobs: torch.Tensor | TopCandidates) -> None:
        """Adds the top children of each of ``nodes`` (what :meth:`next_nodes` returned), ``-inf`` under a padding
        row.

        Args:
            nodes: What :meth:`next_nodes` returned.
            logprobs: ``[len(nodes), vocab]`` the draft's next-token log-probs at ``nodes``, or their best children
                already chosen.
        """
        pool = self.pool
        if isinstance(logprobs, TopCandidates):
            child_scores, child_tokens = logprobs.scores.float(), logprobs.tokens
        else:
            child_scores, child_tokens = logprobs.float().topk(min(self.branch, logprobs.shape[-1]), dim=-1)
        cumulative = pool.logprobs[nodes, None] + child_scores.to(pool.device)
        cumulative = torch.where(self._placing[:, None], cumulative, -math.inf)
        pool.add_children(
            nodes[:, None].expand_as(cumulative).flatten(), child_tokens.to(pool.device).flatten(), cumulative.flatten()
        )
        added = cumulative.numel()
        self.expanded_in[nodes] = self.forwards
        self.expanded_in = torch.cat([self.expanded_in, self.expanded_in.new_full((added,), NEVER)])
        self.created_in = torch.cat([self.created_in, self.created_in.new_full((added,), self.forwards)])
        self.unexpanded += added - nodes.numel()
        self.forwards += 1

    def result(self) -> SearchResult:
        """The ``budget + 1`` best pool nodes (fewer when the pool holds fewer possible ones), re-indexed root first.
        Reads the device only if the search was not driven to its end (the last batch's read has the answer)."""
        if self.forwards == 0:
            kept = torch.zeros(1, dtype=torch.long, device=self.pool.device)
            return SearchResult(self.pool.select(kept), self.pool, kept, 0)
        read = self._read if self._read is not None and self._read[0] == self.forwards else self._read_device()
        _, ranked, count, best_first_forwards = read
        if self.policy is not None:
            self.policy.learn_rounds(self.budget, self.forwards, best_first_forwards)
        kept = ranked[:count].sort().values
        return SearchResult(self.pool.select(kept), self.pool, kept, self.forwards)

    def _best_first_forwards(self) -> torch.Tensor:
        """``[1]``: after how many of this tree's forwards best-first would have stopped, ``forwards + 1`` if it would
        have gone on. After round ``r`` its pool is this one's nodes created by round ``r`` (those rank the same), and
        it stops when none of its kept nodes can still place a child inside the budget, or (``min_draft_gain``) when
        the round raised the kept nodes' forecast by less than that share of ``1 + forecast``."""
        pool = self.pool
        rounds = torch.arange(self.forwards, device=pool.device)[:, None]
        scores = torch.where(self.created_in <= rounds, pool.logprobs, -math.inf)  # [rounds, pool]
        kept = torch.argsort(-scores, dim=-1, stable=True)[:, : self.budget + 1]
        kept_scores = scores.gather(1, kept)
        possible = torch.isfinite(kept_scores)
        forecast = kept_scores[:, 1:].double().exp().sum(-1)
        full = possible[:, -1:] if kept.shape[1] == self.budget + 1 else torch.zeros_like(possible[:, :1])
        # A child ranks after its parent and every node of equal score: in a full tree only a parent strictly better
        # than the worst kept node can still place one.
        can_place = (
            possible
            & (self.expanded_in[kept] > rounds)
            & (pool.depths[kept] < self.depth_limit)
            & (~full | (kept_scores > kept_scores[:, -1:]))
        )
        stops = ~can_place.any(-1)
        if self.min_draft_gain > 0:
            gained = forecast - torch.cat([forecast.new_zeros(1), forecast[:-1]])
            stops |= gained < self.min_draft_gain * (1 + forecast)
        first = torch.argmax(stops.int()) + 1  # the first maximum: the first round that stops
        return torch.where(stops.any(), first, self.forwards + 1)[None]


class RoundPolicy(SearchPolicy):
    """SpecExec's best-first tree grown in fixed-shape rounds (:class:`RoundSearch`), with no host read between the
    draft forwards; children may be ranked by estimated acceptance and drawn, as best-first's.

    A tree grows in batches of rounds whose size is fixed before it starts; at the end of a batch the search reads
    the device once and, while best-first would still be growing the tree, goes on with another batch (at most
    ``extensions`` more, each half as long as the first). With ``rounds=None`` the first batch is learnt per budget:
    each tree reports after how many forwards best-first would have stopped (one more than it made when best-first
    would have gone on), and the next tree's first batch is as many rounds as covered ``coverage`` of the last
    :data:`LEARNT_TREES` trees at that budget. Rounds past best-first's stop only refine the tree (more draft
    forwards, a tree at least as good); a tree that runs out of batches first keeps the best nodes grown so far.

    The defaults trade draft forwards for reads: on the default pair's held-out prompts (22 of them, budgets 16-256,
    float32) the trees took 1.15-1.24x best-first's draft forwards and 1.4-1.6 reads per tree for 0.98-1.01x its
    tokens per target forward; a first batch covering 90% with one extension as long took 1.55x the forwards.

    Args:
        rounds: Draft forwards in the first batch, the root's included; ``None``: learnt.
        coverage: With learnt rounds, the share of recent trees whose best-first growth the first batch covers.
        extensions: Further batches a tree may grow by, each after one host read.
    """

    ranks_children = True
    draws_children = True

    def __init__(self, rounds: int | None = None, coverage: float = 0.5, extensions: int = 2) -> None:
        if rounds is not None and rounds < 1:
            raise ValueError(f"rounds must be at least 1 (the root's draft forward) or None (learnt), got {rounds!r}.")
        if not 0 < coverage <= 1 or extensions < 0:
            raise ValueError(
                f"coverage must be a share in (0, 1] and extensions a count of batches (0 or more), got "
                f"coverage={coverage!r} and extensions={extensions!r}."
            )
        self.rounds = rounds
        self.coverage = coverage
        self.extensions = extensions
        # Per budget, after how many forwards best-first would have stopped on each recent tree.
        self._stops: dict[int, deque[int]] = {}

    def rounds_for(self, budget: int) -> int:
        """The first batch of rounds of the next tree at ``budget``.

        Before any tree at that budget, ``3 + ceil(log2(budget) / 2)``: on the default pair's held-out prompts
        best-first (``min_draft_gain=0.03``) stopped within 5, 6 and 7 forwards on half of its trees at budgets 16, 64
        and 256.
        """
        if self.rounds is not None:
            return self.rounds
        stops = sorted(self._stops.get(budget, ()))
        if not stops:
            return 3 + math.ceil(math.log2(max(budget, 1)) / 2)
        return stops[math.ceil(self.coverage * len(stops)) - 1]

    def learn_rounds(self, budget: int, forwards: int, stop: int) -> None:
        """Notes that a tree at ``budget`` grown by ``forwards`` draft forwards would have stopped after ``stop``
        best-first forwards (``forwards + 1``: it would have gone on).

        Args:
            budget: The tree's budget.
            forwards: The draft forwards that grew it.
            stop: Best-first's forwards on it, at most ``forwards + 1``.
        """
        if self.rounds is None:
            self._stops.setdefault(budget, deque(maxlen=LEARNT_TREES)).append(min(stop, forwards + 1))

    def start(
        self, root_token: int, config: SpecExecConfig, max_depth: int | None = None, device: DeviceLike = None
    ) -> RoundSearch:
        rounds = self.rounds_for(config.resolved_budget)
        return RoundSearch(
            root_token, config, rounds, max_depth, device, self, self.extensions, extension_rounds=math.ceil(rounds / 2)
        )


register_tree_policy("rounds", RoundPolicy)
