"""The draft side: a transformers ``CandidateGenerator`` that grows SpecExec trees with a small causal LM.

One generator drafts for one sequence and keeps that sequence's draft KV cache. :func:`grow_trees` grows the
trees of several generators at once (a serving batch): each round of the best-first searches becomes one
batched draft forward, padded per request, instead of one forward per request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from ..core.acceptance_map import AcceptanceMap
from ..core.config import SpecExecConfig
from ..core.context_match import ContextIndex, mix_context_guesses
from ..core.masks import causal_pattern
from ..core.search import BestFirstSearch, SearchFn, SearchResult, TopCandidates, grow_tree
from ..core.tree import TokenTree
from ..core.verify import rejection_chain, taken_probabilities
from .compat import batch_logits, check_supported, model_logits
from .kv import compact_cache, new_cache, record_positions, slot_positions

SAMPLED_AFTER = 1
"""With ``sampled_children``, how many of a node's children are its top tokens, fixed, before the drawn ones: where
the target is confident (often one-hot after top-p) its draw hits the draft's top token more often than a draw from
the draft would be accepted."""


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class DraftFeed:
    """One sequence's share of a draft forward.

    Args:
        cache: The sequence's draft KV cache; the fed tokens are appended to it.
        tokens: ``[n]`` tokens to feed.
        positions: ``[n]`` their positions.
        visible: ``[n, cache_length + n]`` bool attention pattern; ``None`` means causal.
        num_logits: How many trailing tokens need logits.
    """

    cache: DynamicCache
    tokens: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor | None
    num_logits: int

    def visibility(self) -> torch.Tensor:
        """``visible``, with the causal pattern spelled out when it is ``None``."""
        if self.visible is not None:
            return self.visible
        return causal_pattern(self.tokens.numel(), self.cache.get_seq_length(), self.tokens.device)


class SpecExecCandidateGenerator(CandidateGenerator):
    """Grows SpecExec token trees with a draft model, reusing the draft's KV cache across calls.

    The generator only ever needs the token history: on each call it keeps the longest part of its cache that
    matches the history (the committed tokens plus any accepted tree nodes it had already fed), cuts the rest,
    and feeds the draft only the tokens it has not seen. That serves the Hugging Face loop (history grows by the
    accepted tokens) and serving engines (history may be anything) with the same code.

    Args:
        draft_model: A causal LM sharing the target's tokenizer.
        config: Tree-growth knobs.
        temperature: Temperature applied to the draft's logits before ranking the tree.
        search: The tree-growth policy; SpecExec's best-first ``grow_tree`` unless a baseline is being measured.
        context_match_weights: Guess weights per match length for context matching (see
            :mod:`specexec_hf.core.context_match`); empty for none.
        acceptance_map: Ranks candidates by their estimated acceptance (fed by :meth:`observe`); ``None`` ranks by
            the draft's probability.
        sampled_children: After each node's top token, draw its other ``max_branch - 1`` candidates from the
            draft's distribution without replacement (Gumbel-top-k) instead of taking its next tokens, for a sampling
            target that verifies them by recursive rejection sampling
            (:func:`~specexec_hf.core.verify.rejection_chain` with ``fixed=SAMPLED_AFTER``, fed by
            :meth:`draft_probs`). A drawn candidate's ranking score is that of the draft's token of the same rank:
            it must not depend on which token was drawn, or keeping the candidate would bias the draw.
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        config: SpecExecConfig,
        temperature: float = 1.0,
        search: SearchFn = grow_tree,
        context_match_weights: Sequence[float] = (),
        acceptance_map: AcceptanceMap | None = None,
        sampled_children: bool = False,
    ):
        check_supported(draft_model, "draft")
        if acceptance_map is not None and search is not grow_tree:
            raise ValueError(
                "acceptance_map ranks the children of SpecExec's best-first search (grow_tree) only; a static tree "
                "fixes its own shape: pass acceptance_map=None with this search."
            )
        self.draft_model = draft_model
        self.config = config
        self.temperature = temperature
        self.search = search
        self.context_match_weights = tuple(context_match_weights)
        self.acceptance_map = acceptance_map
        self.sampled_children = sampled_children
        # This tree's expansions, for acceptance_map to learn from and the walk to verify sampled children against;
        # kept on the device until the walk needs a few rows.
        self._expansions: list[_Expansion] = []
        # Per node of the last verified tree, the (expansion, row) that expanded it (None: a leaf); read once per tree.
        self._tree_rows: tuple[SearchResult, list[tuple[int, int] | None]] | None = None
        self._context = ContextIndex(len(self.context_match_weights)) if any(self.context_match_weights) else None
        self.cache = new_cache()
        self.cached_ids: list[int] = []
        # The last search's candidate pool, whose root is cached_ids[-1], and each pool node's cache slot (-1: not
        # fed). Accepted nodes that were fed are kept on the next call instead of being fed again.
        self._pool: TokenTree | None = None
        self._pool_slots = torch.empty(0, dtype=torch.long)
        # The history of the tree being grown.
        self._history: list[int] = []
        # Row k + 1: which of the tree's fed slots (the cache after cached_ids) the k-th fed node sees; row 0, the
        # root's, none (the root is committed). Columns past a row's own slot stay False.
        self._fed_rows = torch.zeros(1, 0, dtype=torch.bool)

    @property
    def _device(self) -> torch.device:
        # The draft may live on a faster device than the target (offloading): grow the tree where the draft is.
        return self.draft_model.device

    def grow_tree(self, input_ids: torch.Tensor, max_depth: int | None = None) -> SearchResult:
        """Grows the tree whose root is the last token of ``input_ids`` (shape ``[1, L]``)."""
        self._begin_tree(input_ids)

        def expand(pool: TokenTree, nodes: torch.Tensor) -> torch.Tensor | TopCandidates:
            feed = self._feed(pool, nodes)
            return self._absorb(pool, nodes, forward_feeds(self.draft_model, [feed])[0])

        return self.search(self._history[-1], expand, self.config, max_depth=max_depth, device=self._device)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, None]:
        """The tree's chain with the highest expected acceptance, appended to ``input_ids`` (for chain verifiers)."""
        result = self.grow_tree(input_ids, max_depth=kwargs.get("max_depth"))
        chain = result.tree.tokens[result.tree.best_path()]
        return torch.cat([input_ids, chain[None].to(input_ids)], dim=-1), None

    def _logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        # Dividing by 1.0 would still copy the [nodes, vocab] logits.
        scaled = logits if self.temperature == 1.0 else logits / self.temperature
        return torch.log_softmax(scaled, dim=-1)

    def _begin_tree(self, input_ids: torch.Tensor) -> None:
        """Takes the new token history and cuts the cache back to what still matches it."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"SpecExec drafts one sequence at a time; got a batch of {input_ids.shape[0]}.")
        self._history = input_ids[0].tolist()
        self._expansions, self._tree_rows = [], None
        self._sync_cache(self._history)
        if self._context is not None:
            self._context.sync(self._history)

    def _feed(self, pool: TokenTree, nodes: torch.Tensor) -> DraftFeed:
        """What the draft must run to expand pool ``nodes``: on a tree's first forward, the unseen history (ending
        with the root); afterwards the nodes themselves, each seeing the history and its own fed ancestors."""
        history = self._history
        if self._pool is None:
            self._fed_rows = torch.zeros(1, 0, dtype=torch.bool, device=self._device)
            pending = torch.tensor(history[len(self.cached_ids) :], dtype=torch.long, device=self._device)
            positions = torch.arange(len(self.cached_ids), len(history), device=self._device)
            return DraftFeed(self.cache, pending, positions, None, 1)
        committed = len(self.cached_ids)
        fed = self.cache.get_seq_length() - committed
        count = nodes.numel()
        # A node sees the committed tokens, what its parent sees (every ancestor of a node being expanded was itself
        # expanded, hence fed) and itself. Gathering the parents' rows needs no host read, unlike climbing the tree.
        parent_rows = self._fed_rows[self._pool_slots[pool.parents[nodes]] - committed + 1, :fed]
        own = torch.eye(count, dtype=torch.bool, device=pool.device)
        visible = torch.cat([parent_rows.new_ones(count, committed), parent_rows, own], dim=1)
        self._note_fed_rows(fed, visible[:, committed:])
        positions = pool.positions(len(history) - 1)[nodes]
        return DraftFeed(self.cache, pool.tokens[nodes], positions, visible, count)

    def _note_fed_rows(self, fed: int, rows: torch.Tensor) -> None:
        """Stores the visibility ``rows`` of the nodes fed after the first ``fed`` tree nodes, growing the store
        geometrically so that a tree of ``n`` nodes copies it ``O(log n)`` times."""
        needed = 1 + fed + rows.shape[0]
        if needed > self._fed_rows.shape[0]:
            capacity = max(needed, 2 * self._fed_rows.shape[0])
            grown = self._fed_rows.new_zeros(capacity, capacity - 1)
            grown[: self._fed_rows.shape[0], : self._fed_rows.shape[1]] = self._fed_rows
            self._fed_rows = grown
        self._fed_rows[1 + fed : needed, : rows.shape[1]] = rows

    def _absorb(self, pool: TokenTree, nodes: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | TopCandidates:
        """Records where the fed tokens now sit in the cache; returns the expansion's log-probs, or with an acceptance
        map its best ``max_branch`` children per node, ranked by estimated acceptance."""
        if self._pool is None:
            self.cached_ids = list(self._history)
            slots = torch.full((1,), len(self._history) - 1, dtype=torch.long, device=self._device)
        else:
            # The pool has grown since the last feed: its new nodes have no slot (-1) until they are fed.
            slots = torch.full((pool.num_nodes,), -1, dtype=torch.long, device=pool.device)
            slots[: self._pool_slots.numel()] = self._pool_slots
            fed_from = self.cache.get_seq_length() - nodes.numel()
            slots[nodes] = torch.arange(fed_from, fed_from + nodes.numel(), device=pool.device)
        self._pool, self._pool_slots = pool, slots
        logprobs = self._logprobs(logits)
        if self._context is not None:
            logprobs = mix_context_guesses(logprobs, self._context_matches(pool, nodes), self.context_match_weights)
        if self.acceptance_map is None and not self.sampled_children:
            return logprobs
        # The search keeps each node's best max_branch candidates, which a monotone map does not reorder; they are
        # kept to learn from once the target has walked the tree.
        branch = min(self.config.max_branch, logprobs.shape[-1])
        top_logprobs, top_tokens = logprobs.topk(branch, dim=-1)
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
        return torch.softmax(self._expansions[expansion].logprobs[row].double(), dim=-1)

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
        """Teaches the acceptance map what the target chose at each node its walk visited.

        Args:
            result: The search whose tree the target verified.
            choices: The target's token at the root and at each accepted node after it (the walk's tokens).
            choice_probs: When the target samples, the ``[1, vocab]`` distribution it sampled each choice from. The
                map then learns each candidate's probability of being sampled instead of whether it was: the same
                expectation (what the map estimates), without the noise of one draw per node.
        """
        if self.acceptance_map is None or not self._expansions:
            return
        children = result.tree.child_index()
        visited, node = [], 0  # the tree nodes where the target made each choice
        for choice in choices:
            visited.append(node)
            node = children.get((node, choice), -1)
            if node < 0:
                break
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
            context = self._history[len(path) - longest :] if len(path) < longest else []
            matches.append(self._context.longest_match(context + path[::-1]))
        return matches

    def _sync_cache(self, history: list[int]) -> None:
        """Cuts the cache back to the longest stretch that still matches ``history``, minus its last token."""
        keep = min(_common_prefix_length(self.cached_ids, history), len(history) - 1)
        accepted_slots: list[int] = []
        if self._pool is not None and keep == len(self.cached_ids):
            # The history continues from the last tree's root: keep the fed nodes along that continuation.
            child_of = self._pool.child_index()
            slots = self._pool_slots.tolist()
            node = 0
            for token in history[keep : len(history) - 1]:
                node = child_of.get((node, token), -1)
                if node < 0 or node >= len(slots) or slots[node] < 0:
                    break
                accepted_slots.append(slots[node])
        compact_cache(self.cache, keep, torch.tensor(accepted_slots, dtype=torch.long))
        self.cached_ids = history[: keep + len(accepted_slots)]
        self._pool = None


@dataclass
class _Expansion:
    """One draft forward's expanded pool ``nodes``, their ``[n, max_branch]`` candidate ``tokens`` (the draft's top
    tokens, or a draw without replacement), the draft's top ``[n, max_branch]`` log-probs, and with sampled children
    the ``[n, vocab]`` log-probs they were drawn from."""

    nodes: torch.Tensor
    tokens: torch.Tensor
    top_logprobs: torch.Tensor
    logprobs: torch.Tensor | None


def forward_feeds(model: PreTrainedModel, feeds: Sequence[DraftFeed]) -> list[torch.Tensor]:
    """Runs several sequences' feeds through ``model``, batching those of similar length.

    Feeds are sorted by length and grouped so that padding is at most half of each batch: a long prompt prefill
    runs alone instead of padding every tree expansion to its length.

    Returns:
        Per feed, in order, the float32 logits of its last ``num_logits`` tokens.
    """
    order = sorted(range(len(feeds)), key=lambda i: feeds[i].tokens.numel())
    groups: list[list[int]] = []
    real = 0
    for i in order:
        length = feeds[i].tokens.numel()
        if groups and length * (len(groups[-1]) + 1) <= 2 * (real + length):
            groups[-1].append(i)
            real += length
        else:
            groups.append([i])
            real = length
    logits: list[torch.Tensor | None] = [None] * len(feeds)
    for group in groups:
        if len(group) == 1:
            feed = feeds[group[0]]
            logits[group[0]] = model_logits(
                model, feed.tokens, feed.positions, feed.cache, feed.num_logits, feed.visible
            )
        else:
            for i, group_logits in zip(group, _batched_logits(model, [feeds[i] for i in group])):
                logits[i] = group_logits
    return logits


def _batched_logits(model: PreTrainedModel, feeds: Sequence[DraftFeed]) -> list[torch.Tensor]:
    """One forward for several sequences with separate caches.

    Row ``r`` of the batch holds feed ``r``'s cache in key slots ``[0, cache_length_r)`` (zeros up to the longest
    cache) and its new tokens at ``[longest_cache, longest_cache + n_r)``; its mask is its own ``visible`` spread
    over that layout. Padding queries see only themselves, so no softmax row is empty. Afterwards each feed's new
    keys and values are appended to its own cache.
    """
    device = feeds[0].tokens.device
    cache_lengths = [feed.cache.get_seq_length() for feed in feeds]
    counts = [feed.tokens.numel() for feed in feeds]
    longest_cache, longest_feed = max(cache_lengths), max(counts)
    tokens = torch.zeros(len(feeds), longest_feed, dtype=torch.long, device=device)
    positions = torch.zeros_like(tokens)
    visible = torch.zeros(len(feeds), longest_feed, longest_cache + longest_feed, dtype=torch.bool, device=device)
    diagonal = torch.arange(longest_feed, device=device)
    visible[:, diagonal, longest_cache + diagonal] = True
    for row, (feed, cached, count) in enumerate(zip(feeds, cache_lengths, counts)):
        own = feed.visibility()
        tokens[row, :count], positions[row, :count] = feed.tokens, feed.positions
        visible[row, :count, :cached] = own[:, :cached]
        visible[row, :count, longest_cache : longest_cache + count] = own[:, cached:]

    batch_cache = new_cache()
    record_positions(batch_cache, torch.stack([
        torch.nn.functional.pad(slot_positions(feed.cache, 1, device)[0], (0, longest_cache - cached))
        for feed, cached in zip(feeds, cache_lengths)
    ]))
    if longest_cache:
        template = next(feed.cache for feed, cached in zip(feeds, cache_lengths) if cached)
        for index, layer in enumerate(template.layers):
            keys = layer.keys.new_zeros(len(feeds), *layer.keys.shape[1:-2], longest_cache, layer.keys.shape[-1])
            values = layer.values.new_zeros(
                len(feeds), *layer.values.shape[1:-2], longest_cache, layer.values.shape[-1]
            )
            for row, (feed, cached) in enumerate(zip(feeds, cache_lengths)):
                if cached:
                    keys[row, ..., :cached, :] = feed.cache.layers[index].keys[0]
                    values[row, ..., :cached, :] = feed.cache.layers[index].values[0]
            batch_cache.update(keys, values, index)

    # Logits only where some feed needs them: its last num_logits tokens.
    needed = [torch.arange(count - feed.num_logits, count, device=device) for feed, count in zip(feeds, counts)]
    keep = torch.unique(torch.cat(needed))
    logits = batch_logits(model, tokens, positions, batch_cache, keep, visible)

    for feed in feeds:  # before the keys arrive: a cache without a record takes its length for its positions
        record_positions(feed.cache, feed.positions[None])
    for index, layer in enumerate(batch_cache.layers):
        for row, (feed, count) in enumerate(zip(feeds, counts)):
            new = slice(longest_cache, longest_cache + count)
            keys, values = layer.keys[row : row + 1, :, new].clone(), layer.values[row : row + 1, :, new].clone()
            feed.cache.update(keys, values, index)
    return [logits[row, torch.searchsorted(keep, rows)] for row, rows in enumerate(needed)]


@dataclass
class TreeBatch:
    """Trees grown together by :func:`grow_trees`.

    Args:
        results: One search result per request, in order.
        draft_calls: Draft forward calls made for all of them together.
    """

    results: list[SearchResult]
    draft_calls: int


def grow_trees(requests: Sequence[tuple[SpecExecCandidateGenerator, torch.Tensor, int | None]]) -> TreeBatch:
    """Grows one SpecExec tree per request, sharing each round's draft forward among all requests.

    Every round asks each unfinished search for its next nodes and runs all of them in one batched draft call
    (see :func:`forward_feeds`), so ``R`` requests cost about as many draft calls as the slowest one alone. The
    trees are the ones each generator's own :meth:`~SpecExecCandidateGenerator.grow_tree` would grow.

    Args:
        requests: ``(generator, input_ids [1, L], max_depth)`` per request; one generator per sequence, all on
            the same draft model and using SpecExec's best-first search.
    """
    if not requests:
        return TreeBatch([], 0)
    generators = [generator for generator, _, _ in requests]
    model = generators[0].draft_model
    if any(g.draft_model is not model for g in generators) or len({id(g) for g in generators}) < len(generators):
        raise ValueError("grow_trees needs one generator per request, all sharing one draft model.")
    if any(g.search is not grow_tree for g in generators):
        raise ValueError("grow_trees batches SpecExec's best-first search only; grow baseline trees one by one.")
    searches = []
    for generator, input_ids, max_depth in requests:
        generator._begin_tree(input_ids)
        searches.append(BestFirstSearch(generator._history[-1], generator.config, max_depth, generator._device))
    calls = 0
    while True:
        work = [(i, nodes) for i, search in enumerate(searches) if (nodes := search.next_nodes()) is not None]
        if not work:
            break
        feeds = [generators[i]._feed(searches[i].pool, nodes) for i, nodes in work]
        calls += 1
        for (i, nodes), logits in zip(work, forward_feeds(model, feeds)):
            searches[i].add_expansion(nodes, generators[i]._absorb(searches[i].pool, nodes, logits))
    return TreeBatch([search.result() for search in searches], calls)
