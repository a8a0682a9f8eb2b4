"""The draft side's tree ranking and learning: a generator that grows token trees with a small causal LM.

One :class:`SpecExecCandidateGenerator` drafts for one sequence. It owns that sequence's
:class:`~.draft_cache.DraftCache` (the draft's KV cache and feeds, kept across trees) and does what is about the
tree: the draft's log-probs turned into ranked children (temperature, context matching, the acceptance map, drawn
children), and what the map learns once the target has walked the tree. :func:`grow_trees` grows the trees of
several generators at once (a serving batch): each round of their searches becomes one batched draft forward,
padded per request, whatever the policy.

The class is a transformers :class:`~transformers.generation.candidate_generator.CandidateGenerator`: in
transformers' own assisted loop it proposes the tree's most promising chain (:meth:`~.TokenTree.best_chain`, the
chain vLLM's chain mode proposes) and learns from the target's verdict, as any candidate generator does. SpecExec's
own step (:mod:`.decoder`) verifies the whole tree instead, through the tree methods above the interface.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from ..core.acceptance_map import AcceptanceMap
from ..core.config import SpecExecConfig
from ..core.context_match import ContextIndex, Followers, mix_context_guesses
from ..core.device_context_match import DeviceContextMatch
from ..core.round_search import RoundPolicy
from ..core.search import (
    BestFirstPolicy,
    BestFirstSearch,
    SearchPolicy,
    SearchResult,
    TopCandidates,
    TreeSearch,
    grow_tree,
    walked_nodes,
)
from ..core.tree import TokenTree
from ..core.verify import rejection_chain, taken_probabilities
from .compat import check_supported, logits_width, usable_vocabulary_size
from .draft_cache import DraftCache, forward_feeds, scored_columns
from .draft_graphs import DraftGraphs, StaticDraftCache, uses_draft_graphs
from .forward import Feed

SAMPLED_AFTER = 1
"""With ``sampled_children``, how many of a node's children are its top tokens, fixed, before the drawn ones: where
the target is confident (often one-hot after top-p) its draw hits the draft's top token more often than a draw from
the draft would be accepted."""
STAND_IN_TOKEN = 0
"""What the draft reads in place of a committed token it has no embedding for (a padded target's id past the draft's
vocabulary): any id would do, since the history only shapes the draft's guesses, never the output."""


class SpecExecCandidateGenerator(CandidateGenerator):
    """Grows token trees with a draft model, reusing the draft's KV cache across calls, and learns from their walks.

    Per tree: :meth:`start_tree` syncs the draft cache with the new history and starts the policy's search; for each
    draft forward, :meth:`feed` says what the draft runs and :meth:`expansion` turns its logits into what the search
    takes; after the target's walk, :meth:`observe` teaches the acceptance map. :meth:`grow_tree` does the forwards
    for one tree, :func:`grow_trees` for several at once.

    As a transformers ``CandidateGenerator`` (the interface of transformers' assisted loop, ``_assisted_decoding``):
    :meth:`get_candidates` grows a tree and proposes its most promising chain, :meth:`update_candidate_strategy`
    teaches the acceptance map the target's choices along it. transformers 5.17-5.19 build the loop's generator in
    ``GenerationMixin._get_candidate_generator`` and take none from the caller: to run this one there, have that
    method return it (``tests/test_candidate_generator.py`` does). The chain is one root-to-leaf path of the tree,
    so the loop's target forward checks fewer tokens than SpecExec's tree verification would.

    Args:
        draft_model: A causal LM sharing the target's tokenizer.
        config: Tree-growth knobs.
        temperature: Temperature applied to the draft's logits before ranking the tree.
        search: The tree-growth policy; SpecExec's best-first ``grow_tree`` unless a baseline is being measured.
        context_match_weights: Guess weights per match length for context matching (see
            :mod:`specexec_hf.core.context_match`); empty for none.
        acceptance_map: Ranks candidates by their estimated acceptance (fed by :meth:`observe`); ``None`` ranks by
            the draft's probability. Needs a policy that ``ranks_children``.
        sampled_children: After each node's top token, draw its other ``max_branch - 1`` candidates from the
            draft's distribution without replacement (Gumbel-top-k) instead of taking its next tokens, for a sampling
            target that verifies them by recursive rejection sampling
            (:func:`~specexec_hf.core.verify.rejection_chain` with ``fixed=SAMPLED_AFTER``, fed by
            :meth:`draft_probs`). A drawn candidate's ranking score is that of the draft's token of the same rank:
            it must not depend on which token was drawn, or keeping the candidate would bias the draw. Needs a
            policy that ``draws_children``.
        target_vocab_size: How many logits the target produces per token. A draft sharing the target's tokenizer
            may be padded to another size: it proposes only the ids both produce (an id only one side has is never
            proposed; the target's own choice still comes as the bonus token), reads a committed id it lacks as
            :data:`STAND_IN_TOKEN`, and its drawn children's distributions span the target's ids. ``None``: the
            draft's own size.
        draft_graphs: Run the draft over a preallocated cache and padded feeds, each shape replayed as a CUDA
            graph on a GPU (:class:`~.draft_graphs.StaticDraftCache`, the same logits): ``"auto"`` for a CUDA draft
            with ``search=RoundPolicy(...)`` (``tree_search="rounds"``, whose rounds keep the feed's width fixed)
            when the static cache can hold the draft's (full-attention layers of a verified family), falling back
            to the dynamic cache otherwise; ``"on"`` always (eagerly on a CPU; a ``ValueError`` for a draft it
            cannot hold); ``"off"`` never.
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        config: SpecExecConfig,
        temperature: float = 1.0,
        search: SearchPolicy = grow_tree,
        context_match_weights: Sequence[float] = (),
        acceptance_map: AcceptanceMap | None = None,
        sampled_children: bool = False,
        target_vocab_size: int | None = None,
        draft_graphs: DraftGraphs = "auto",
    ):
        check_supported(draft_model, "draft")
        if not isinstance(search, SearchPolicy):
            raise TypeError(
                f"search must be a tree policy (specexec_hf.core.search.SearchPolicy), got {search!r}: subclass "
                "SearchPolicy and define start(), which returns a step-by-step TreeSearch."
            )
        if acceptance_map is not None and not search.ranks_children:
            raise ValueError(
                f"acceptance_map re-ranks each node's children, which {type(search).__name__} fixes by its shape: "
                "pass acceptance_map=None with this search."
            )
        if sampled_children and not search.draws_children:
            raise ValueError(
                f"sampled_children draws each node's children, which {type(search).__name__} takes by draft rank: "
                "pass sampled_children=False with this search."
            )
        if config.draft_ahead and (sampled_children or not isinstance(search, BestFirstPolicy)):
            raise ValueError(
                "draft_ahead grows SpecExec's best-first search on while the target verifies, and the next tree "
                "starts from it, which a drawn child's verification (sampled_children) and other tree policies do "
                "not allow: pass draft_ahead=False, or the default search without sampled_children."
            )
        self.draft_model = draft_model
        self.config = config
        self.temperature = temperature
        self.search = search
        self.context_match_weights = tuple(context_match_weights)
        self.acceptance_map = acceptance_map
        self.sampled_children = sampled_children
        self.target_vocab_size = logits_width(draft_model) if target_vocab_size is None else target_vocab_size
        # The ids (0 up to it) the draft reads and proposes: those both models have.
        self.shared_vocab_size = min(usable_vocabulary_size(draft_model), self.target_vocab_size)
        self._draft_width = logits_width(draft_model)
        # Scored columns below shared_vocab_size, per column set (one host read per head, not per forward).
        self._shared_columns: tuple[torch.Tensor, int] | None = None
        self.draft_cache = DraftCache(
            draft_model, static=uses_draft_graphs(draft_graphs, draft_model, isinstance(search, RoundPolicy))
        )
        # This tree's expansions, for acceptance_map to learn from and the walk to verify sampled children against;
        # kept on the device until the walk needs a few rows.
        self._expansions: list[_Expansion] = []
        # Per node of the last verified tree, the (expansion, row) that expanded it (None: a leaf); read once per tree.
        self._tree_rows: tuple[SearchResult, list[tuple[int, int] | None]] | None = None
        self._context = ContextIndex(len(self.context_match_weights)) if any(self.context_match_weights) else None
        # A policy that grows its trees without host reads has the guesses computed on the device as well.
        self._device_context = (
            DeviceContextMatch(self.context_match_weights, self.draft_cache.device)
            if self._context is not None and isinstance(search, RoundPolicy) else None
        )
        # The last tree's search, which draft_ahead grows on during verification and the next tree may start from.
        self._search: TreeSearch | None = None
        self._grown_ahead = False
        self.seeded_trees = 0  # trees that started from a subtree grown ahead
        # The last get_candidates' search and the history length it grew under, for update_candidate_strategy.
        self._proposed: tuple[SearchResult, int] | None = None

    @property
    def cache(self) -> DynamicCache | StaticDraftCache:
        """The draft's KV cache for this sequence."""
        return self.draft_cache.cache

    @property
    def cached_ids(self) -> list[int]:
        """The committed tokens the draft cache holds, in order."""
        return self.draft_cache.cached_ids

    def grow_tree(self, input_ids: torch.Tensor, max_depth: int | None = None) -> SearchResult:
        """Grows the tree whose root is the last token of ``input_ids`` (shape ``[1, L]``)."""
        return grow_trees([(self, input_ids, max_depth)]).results[0]

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """transformers' candidate step: grows the tree under the last token of ``input_ids`` (``[1, L]``) and
        proposes its most promising chain (:meth:`~.TokenTree.best_chain`).

        Returns:
            ``[1, L + k]`` ``input_ids`` followed by the chain's ``k`` tokens, and ``[1, k, target_vocab_size]``
            float32 logits of the distribution each candidate was drawn from: a point mass on it (0 at the
            candidate, ``-inf`` elsewhere), since the chain is chosen, not drawn. transformers' speculative
            sampling then accepts a candidate with the target's probability of it and otherwise draws from the
            target's distribution without it, which is the target's own draw; greedy decoding ignores the logits
            (unless ``assistant_ensemble_weight`` mixes them in). ``None`` instead when the tree has no node
            beyond its root (no candidate).
        """
        result = self.grow_tree(input_ids)
        chain = result.tree.best_chain().to(input_ids.device)
        self._proposed = (result, input_ids.shape[1])
        if not chain.numel():
            return input_ids, None
        point_masses = torch.full(
            (1, chain.numel(), self.target_vocab_size), -math.inf, dtype=torch.float32, device=input_ids.device
        )
        point_masses.scatter_(-1, chain.view(1, -1, 1), 0.0)
        return torch.cat([input_ids, chain[None].to(input_ids.dtype)], dim=1), point_masses

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """transformers' feedback after its target checked the last :meth:`get_candidates` chain: the committed
        tokens since (``input_ids`` now ``[1, L']``) are the target's choices down that tree from its root, which
        :meth:`observe` teaches the tree policy and the acceptance map, as after SpecExec's own walk.

        Args:
            input_ids: The committed tokens, the accepted candidates and the target's next token included.
            scores: The target's processed logits at the candidates (unused: the committed tokens are its choices,
                greedy or drawn, and the map learns each candidate's acceptance from them without bias).
            num_matches: Candidates accepted (unused: the committed tokens say it).
        """
        if self._proposed is None:
            return
        result, proposed_at = self._proposed
        self._proposed = None
        self.observe(result, input_ids[0, proposed_at:].tolist())

    def start_tree(self, input_ids: torch.Tensor, max_depth: int | None = None) -> TreeSearch:
        """Takes the new token history, cuts the draft cache back to what still matches it, and starts the search
        for the tree under its last token.

        Args:
            input_ids: ``[1, L]`` the committed tokens; the last is the root.
            max_depth: Tighter depth limit for this tree.
        """
        if input_ids.shape[0] != 1:
            raise ValueError(f"SpecExec drafts one sequence at a time; got a batch of {input_ids.shape[0]}.")
        history = input_ids[0].tolist()
        if self.shared_vocab_size < self.target_vocab_size:  # the target may have committed ids the draft lacks
            history = [token if token < self.shared_vocab_size else STAND_IN_TOKEN for token in history]
        self._expansions, self._tree_rows = [], None
        grown_ahead, self._grown_ahead = self._grown_ahead, False
        search = None
        if grown_ahead:
            seed = self.draft_cache.sync_to_subtree(history, self.config.depth_limit(max_depth))
            if seed is not None:
                pool, kept = seed
                search = BestFirstSearch.seeded(pool, self._search.expanded[kept], self.config, max_depth)
                self.seeded_trees += 1
        if search is None:
            self.draft_cache.sync(history)
            search = self.search.start(history[-1], self.config, max_depth, self.draft_cache.device)
        if self._device_context is not None:
            self._device_context.sync(history)
        elif self._context is not None:
            self._context.sync(history)
        self._search = search
        return search

    def grow_ahead(self, done: Callable[[], bool], budget: int) -> int:
        """Grows the last tree's search on, one draft forward at a time, until ``done()`` (checked before each
        forward) or until no node of its best ``budget`` can still grow: while the target verifies the tree, the
        likeliest subtrees below it grow, and the next tree starts from the one under its root when the draft
        already fed that root (see ``SpecExecConfig.draft_ahead``). Returns the draft forwards made.

        Args:
            done: Whether to stop (the verification has finished).
            budget: Most nodes the grown-on search keeps.
        """
        search = self._search
        if not isinstance(search, BestFirstSearch):
            return 0
        search.extend(budget)
        self._grown_ahead = True
        forwards = 0
        with _scored_columns_for(self.draft_model, [self]) as columns:
            while not done() and (nodes := search.next_nodes()) is not None:
                (logits,) = forward_feeds(self.draft_model, [self.feed(search.pool, nodes)], columns)
                search.add_expansion(nodes, self.expansion(search.pool, nodes, logits, columns))
                forwards += 1
        return forwards

    @property
    def takes_scored_columns(self) -> bool:
        """Whether :meth:`expansion` can take logits over part of the vocabulary (:func:`.scored_columns`): when
        it returns each node's best children (an acceptance map, no drawn children) rather than whole rows."""
        return self.acceptance_map is not None and not self.sampled_children

    def feed(self, pool: TokenTree, nodes: torch.Tensor) -> Feed:
        """What the draft runs to expand the search's pool ``nodes`` (see :meth:`.DraftCache.feed`)."""
        return self.draft_cache.feed(pool, nodes)

    def expansion(
        self, pool: TokenTree, nodes: torch.Tensor, logits: torch.Tensor, columns: torch.Tensor | None = None
    ) -> torch.Tensor | TopCandidates:
        """Turns the draft's ``logits`` at ``nodes`` (from their :meth:`feed`) into what the search takes: their
        log-probs, or with an acceptance map or drawn children their best ``max_branch`` children per node.

        Args:
            pool: The search's pool.
            nodes: The pool nodes fed.
            logits: ``[nodes, vocab]`` the draft's logits there, or ``[nodes, columns]`` over ``columns`` only.
            columns: The vocabulary ids of the logits' columns, ascending, every other token impossible
                (:func:`.scored_columns`); ``None``: the whole vocabulary. Only when :attr:`takes_scored_columns`.
        """
        if columns is not None and not self.takes_scored_columns:
            raise ValueError(
                "Logits over part of the vocabulary need a generator that ranks children (an acceptance map, no "
                "sampled_children); pass full-vocabulary logits."
            )
        self.draft_cache.record_feed(pool, nodes)
        logits, columns = self._shared_ids(logits, columns)
        # Dividing by 1.0 would still copy the [nodes, vocab] logits.
        scaled = logits if self.temperature == 1.0 else logits / self.temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        if self._device_context is not None:
            logprobs, columns = self._device_context.mix(logprobs, pool, nodes, columns)
        elif self._context is not None:
            matches = self._context_matches(pool, nodes)
            if columns is not None:
                logprobs, columns, matches = _guesses_as_columns(logprobs, columns, matches)
            logprobs = mix_context_guesses(logprobs, matches, self.context_match_weights)
        if self.acceptance_map is None and not self.sampled_children:
            return logprobs
        return self._ranked_children(nodes, logprobs, columns)

    def _shared_ids(
        self, logits: torch.Tensor, columns: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's scores of the ids below :attr:`shared_vocab_size` alone (and their columns): a draft padded wider
        than the target, or with fewer embedding rows than logits, never proposes an id the other side lacks."""
        if self.shared_vocab_size == self._draft_width:
            return logits, columns
        if columns is None:
            return logits[..., : self.shared_vocab_size], None
        if self._shared_columns is None or self._shared_columns[0] is not columns:
            self._shared_columns = (columns, int(torch.searchsorted(columns, self.shared_vocab_size)))
        kept = self._shared_columns[1]
        return logits[..., :kept], columns[:kept]

    def _ranked_children(
        self, nodes: torch.Tensor, logprobs: torch.Tensor, columns: torch.Tensor | None = None
    ) -> TopCandidates:
        """Each node's best ``max_branch`` children (the first drawn, with ``sampled_children``), scored by the
        acceptance map; kept to learn from once the target has walked the tree. ``columns``: as :meth:`expansion`
        (then without drawn children)."""
        # The search keeps each node's best max_branch candidates, which a monotone map does not reorder.
        branch = min(self.config.max_branch, logprobs.shape[-1])
        top_logprobs, top_tokens = logprobs.topk(branch, dim=-1)
        if columns is not None:
            top_tokens = columns[top_tokens]
        ranks = torch.arange(branch, device=top_tokens.device).expand(top_tokens.shape)
        if self.sampled_children and branch > SAMPLED_AFTER:
            # Gumbel-top-k: the order of log q + Gumbel noise (log q - log E, E ~ Exp(1)) is a draw without
            # replacement from q, here from q without the fixed top tokens. Tokens of zero probability sort last
            # and, like their rank's score, are -inf.
            keys = logprobs - torch.empty_like(logprobs).exponential_().log()
            keys.scatter_(-1, top_tokens[:, :SAMPLED_AFTER], -math.inf)
            drawn = keys.topk(branch - SAMPLED_AFTER, dim=-1).indices
            top_tokens = torch.cat([top_tokens[:, :SAMPLED_AFTER], drawn], dim=-1)
        drawn_from = logprobs if self.sampled_children else None
        self._expansions.append(_Expansion(nodes, top_tokens, top_logprobs, drawn_from))
        scores = top_logprobs if self.acceptance_map is None else self.acceptance_map(top_logprobs, ranks)
        if self.sampled_children:
            # Kept children must be the fixed ones, then a prefix of the draw: scores may not rise with rank.
            scores = scores.cummin(dim=-1).values
        return TopCandidates(top_tokens, scores)

    def draft_probs(self, result: SearchResult, node: int) -> torch.Tensor:
        """``[vocab]`` the draft distribution tree ``node``'s children were drawn from (``sampled_children`` only)."""
        found = self._rows_of(result)[node]
        if found is None or self._expansions[found[0]].logprobs is None:
            raise ValueError(f"Tree node {node} has no drawn children in this generator's last search.")
        return self._drawn_from(*found)

    def _drawn_from(self, expansion: int, row: int) -> torch.Tensor:
        """``[target_vocab_size]`` the draft distribution an expansion row's children were drawn from (zero past the
        draft's ids), beside the target's distribution at the node."""
        probs = torch.softmax(self._expansions[expansion].logprobs[row].double(), dim=-1)
        return torch.nn.functional.pad(probs, (0, self.target_vocab_size - probs.numel()))

    def _rows_of(self, result: SearchResult) -> list[tuple[int, int] | None]:
        """Per node of ``result.tree``, the ``(expansion, row)`` of this tree's search that expanded it, or ``None``
        (two host reads per tree: the expanded nodes and the tree's pool indices)."""
        if self._tree_rows is None or self._tree_rows[0] is not result:
            nodes = iter(torch.cat([expansion.nodes for expansion in self._expansions]).tolist())
            expanded = {
                next(nodes): (index, row)
                for index, expansion in enumerate(self._expansions)
                for row in range(expansion.nodes.numel())
            }
            self._tree_rows = (result, [expanded.get(node) for node in result.pool_index.tolist()])
        return self._tree_rows[1]

    def observe(
        self, result: SearchResult, choices: Sequence[int], choice_probs: Sequence[torch.Tensor] | None = None
    ) -> None:
        """Teaches the tree policy (:meth:`~specexec_hf.core.search.SearchPolicy.observe`) and the acceptance map
        what the target chose at each node its walk visited.

        Args:
            result: The search whose tree the target verified.
            choices: The target's token at the root and at each accepted node after it (the walk's tokens).
            choice_probs: When the target samples, the ``[1, vocab]`` distribution it sampled each choice from. The
                map then learns each candidate's probability of being sampled instead of whether it was: the same
                expectation (what the map estimates), without the noise of one draw per node.
        """
        self.search.observe(result, choices, choice_probs)
        if self.acceptance_map is None or not self._expansions:
            return
        visited = walked_nodes(result.tree, choices)  # the tree nodes where the target made each choice
        rows = self._rows_of(result)
        observed = [(index, rows[node]) for index, node in enumerate(visited) if rows[node] is not None]
        if not observed:
            return
        tokens = torch.stack([self._expansions[expansion].tokens[row] for _, (expansion, row) in observed])
        logprobs = torch.stack([self._expansions[expansion].top_logprobs[row] for _, (expansion, row) in observed])
        if self.sampled_children and choice_probs is not None:
            # What the map estimates for a drawn candidate: the probability that the rejection chain takes it.
            accepted = torch.stack([
                taken_probabilities(rejection_chain(
                    choice_probs[index][0], self._drawn_from(expansion, row), candidates, SAMPLED_AFTER
                )[0])
                for (index, (expansion, row)), candidates in zip(observed, tokens.cpu())
            ])
        elif choice_probs is None:
            chosen = torch.tensor([choices[index] for index, _ in observed], device=tokens.device)
            accepted = tokens == chosen[:, None]
        else:
            probs = torch.cat([choice_probs[index] for index, _ in observed]).to(tokens.device)
            accepted = probs.gather(-1, tokens)
        ranks = torch.arange(tokens.shape[-1]).expand(tokens.shape)
        self.acceptance_map.observe(logprobs, ranks, accepted)

    def _context_matches(self, pool: TokenTree, nodes: torch.Tensor) -> list[tuple[int, dict[int, int]]]:
        """Each node's longest context match: its context is the history followed by the node's path."""
        parents, tokens = pool.host_lists()
        longest = self._context.max_order
        matches = []
        for node in nodes.tolist():
            path: list[int] = []
            while node > 0 and len(path) < longest:
                path.append(tokens[node])
                node = parents[node]
            context = self.draft_cache.history[len(path) - longest :] if len(path) < longest else []
            matches.append(self._context.longest_match(context + path[::-1]))
        return matches


@dataclass
class _Expansion:
    """One draft forward's expanded pool ``nodes``, their ``[n, max_branch]`` candidate ``tokens`` (the draft's top
    tokens, or a draw without replacement), the draft's top ``[n, max_branch]`` log-probs, and with sampled children
    the ``[n, vocab]`` log-probs they were drawn from."""

    nodes: torch.Tensor
    tokens: torch.Tensor
    top_logprobs: torch.Tensor
    logprobs: torch.Tensor | None


@dataclass
class TreeBatch:
    """Trees grown together by :func:`grow_trees`.

    Args:
        results: One search result per request, in order.
        draft_calls: Draft forward calls made for all of them together.
    """

    results: list[SearchResult]
    draft_calls: int


@torch.no_grad()  # called outside generate() too (benchmarks, the vLLM proposer): autograd would record the draft
def grow_trees(requests: Sequence[tuple[SpecExecCandidateGenerator, torch.Tensor, int | None]]) -> TreeBatch:
    """Grows one tree per request, sharing each round's draft forward among all requests.

    Every round asks each unfinished search for its next nodes and runs all of them in one batched draft call
    (see :func:`~.draft_cache.forward_feeds`), so ``R`` requests cost about as many draft calls as the slowest one
    alone. Each tree is the one its generator would grow alone, whatever its tree policy.

    Args:
        requests: ``(generator, input_ids [1, L], max_depth)`` per request; one generator per sequence, all on
            the same draft model.
    """
    if not requests:
        return TreeBatch([], 0)
    generators = [generator for generator, _, _ in requests]
    model = generators[0].draft_model
    if any(g.draft_model is not model for g in generators) or len({id(g) for g in generators}) < len(generators):
        raise ValueError("grow_trees needs one generator per request, all sharing one draft model.")
    searches = [generator.start_tree(input_ids, max_depth) for generator, input_ids, max_depth in requests]
    calls = 0
    with _scored_columns_for(model, generators) as columns:
        while True:
            work = [(i, nodes) for i, search in enumerate(searches) if (nodes := search.next_nodes()) is not None]
            if not work:
                break
            feeds = [generators[i].feed(searches[i].pool, nodes) for i, nodes in work]
            calls += 1
            for (i, nodes), logits in zip(work, forward_feeds(model, feeds, columns)):
                searches[i].add_expansion(nodes, generators[i].expansion(searches[i].pool, nodes, logits, columns))
    return TreeBatch([search.result() for search in searches], calls)


def _scored_columns_for(model: PreTrainedModel, generators: Sequence[SpecExecCandidateGenerator]):
    """:func:`.scored_columns` of ``model`` where every generator takes them, else full rows (yields ``None``)."""
    if all(generator.takes_scored_columns for generator in generators):
        return scored_columns(model)
    return nullcontext()


def _guesses_as_columns(
    logprobs: torch.Tensor, columns: torch.Tensor, matches: Sequence[tuple[int, Followers]]
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, Followers]]]:
    """Context guesses over log-probs that cover only ``columns`` (ascending vocabulary ids): a guessed token
    outside them gets a column of its own (``-inf`` before the mix, as in a full row), and every guess names its
    column instead of its token. Returns the widened log-probs, their columns and the matches in column terms."""
    guessed = sorted({token for _, followers in matches for token in followers})
    if not guessed:
        return logprobs, columns, list(matches)
    tokens = torch.tensor(guessed, dtype=columns.dtype, device=columns.device)
    at = torch.searchsorted(columns, tokens).clamp(max=columns.numel() - 1)
    scored = columns[at] == tokens
    extra = tokens[~scored]
    column_of = dict(zip(guessed, at.tolist()))
    column_of.update(zip(extra.tolist(), range(columns.numel(), columns.numel() + extra.numel())))
    if extra.numel():
        logprobs = torch.cat([logprobs, logprobs.new_full((logprobs.shape[0], extra.numel()), -math.inf)], dim=-1)
        columns = torch.cat([columns, extra])
    in_columns = [(order, {column_of[token]: n for token, n in followers.items()}) for order, followers in matches]
    return logprobs, columns, in_columns
