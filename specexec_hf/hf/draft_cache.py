"""The draft's KV cache and what it is fed: one sequence's cache kept across trees, and batched draft forwards.

A :class:`DraftCache` holds one sequence's draft KV cache and the bookkeeping that lets it be reused: the committed
tokens it holds, and while a tree grows, which pool node sits in which cache slot and which fed nodes each one sees.
It only ever needs the token history: on each tree it keeps the longest part of its cache that matches the history
(the committed tokens plus any accepted tree nodes it had already fed), cuts the rest, and feeds the draft only the
tokens it has not seen. That serves the Hugging Face loop (history grows by the accepted tokens) and serving engines
(history may be anything) with the same code. :func:`forward_feeds` runs several sequences' :class:`Feed`
records in one batched forward; within :func:`scored_columns`, a draft whose head scores part of the vocabulary
returns only those columns.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import DynamicCache, PreTrainedModel

from ..core.tree import TokenTree
from ..core.uploads import upload
from .compat import execution_device
from .draft_graphs import StaticDraftCache, release_static_cache, reused_static_cache
from .forward import Feed, model_logits, packed_logits
from .kv import compact_cache, new_cache, record_positions, slot_positions


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftCache:
    """One sequence's draft KV cache, reused across trees, and the feeds that grow a tree's nodes into it.

    Per tree: :meth:`sync` takes the new history, then for each draft forward :meth:`feed` says what to run and
    :meth:`record_feed` notes where the fed tokens landed.

    Args:
        draft_model: The draft; its execution device is where the feeds and the tree's bookkeeping live.
        static: Keep the cache in preallocated buffers and run the draft over padded feeds, replayed as CUDA graphs
            on a GPU (:class:`~.draft_graphs.StaticDraftCache`, taken over from a finished drafter of the same draft
            where there is one, its graphs already captured); else a ``DynamicCache``.
    """

    def __init__(self, draft_model: PreTrainedModel, static: bool = False):
        self.draft_model = draft_model
        self.cache: DynamicCache | StaticDraftCache = reused_static_cache(draft_model) if static else new_cache()
        if isinstance(self.cache, StaticDraftCache):  # its buffers and graphs serve the draft's next drafter
            weakref.finalize(self, release_static_cache, self.cache)
        self.cached_ids: list[int] = []
        # The history of the tree being grown; its last token is the root.
        self.history: list[int] = []
        # The last search's candidate pool, whose root is cached_ids[-1], and each pool node's cache slot (-1: not
        # fed). Accepted nodes that were fed are kept on the next call instead of being fed again.
        self._pool: TokenTree | None = None
        self._pool_slots = torch.empty(0, dtype=torch.long)
        # Row k + 1: which of the tree's fed slots (the cache after cached_ids) the k-th fed node sees; row 0, the
        # root's, none (the root is committed). Columns past a row's own slot stay False.
        self._fed_rows = torch.zeros(1, 0, dtype=torch.bool)

    @property
    def device(self) -> torch.device:
        """Where the draft runs: the draft may live on a faster device than the target (offloading)."""
        return execution_device(self.draft_model)

    def sync(self, history: list[int]) -> None:
        """Takes the history of the next tree and cuts the cache back to the longest stretch that still matches it,
        minus its last token (the root, fed by the tree's first forward)."""
        self.history = history
        keep = min(_common_prefix_length(self.cached_ids, history), len(history) - 1)
        accepted_slots: list[int] = []
        if self._pool is not None and keep == len(self.cached_ids):
            # The history continues from the last tree's root: keep the fed nodes along that continuation. The
            # pool's lists and its slots come in one read; child_index then reads nothing.
            _, _, slots = self._pool.host_lists_and(self._pool_slots)
            child_of = self._pool.child_index()
            node = 0
            for token in history[keep : len(history) - 1]:
                node = child_of.get((node, token), -1)
                if node < 0 or node >= len(slots) or slots[node] < 0:
                    break
                accepted_slots.append(slots[node])
        _compact(self.cache, keep, upload(accepted_slots, torch.long, self.device))
        self.cached_ids = history[: keep + len(accepted_slots)]
        self._pool = None

    def sync_to_subtree(self, history: list[int], depth_limit: int) -> tuple[TokenTree, torch.Tensor] | None:
        """Takes the history of the next tree when it continues the last tree's root down pool nodes the draft has
        already fed, and keeps the subtree under the new root: the next search starts from it instead of from the
        root alone. ``None`` (nothing changed; call :meth:`sync`) when the history goes elsewhere.

        The cache keeps the committed tokens, the continuation (the root among them: fed, so cached), then the
        subtree's fed nodes in the order they were fed; each still sees exactly its ancestors.

        Args:
            history: The next tree's history (its last token the root).
            depth_limit: The next tree's depth limit: deeper subtree nodes are dropped.

        Returns:
            ``(pool, kept)``: the subtree re-rooted (depths and cumulative log-probs from the new root) and the old
            pool indices of its nodes, ascending.
        """
        pool, root_history = self._pool, self.history
        if pool is None or len(history) <= len(root_history) or history[: len(root_history)] != root_history:
            return None
        _, _, slots = pool.host_lists_and(self._pool_slots)  # one read; child_index then reads nothing
        child_of = pool.child_index()
        node, continuation = 0, []
        for token in history[len(root_history) :]:
            node = child_of.get((node, token), -1)
            if node < 0 or node >= len(slots) or slots[node] < 0:
                return None
            continuation.append(slots[node])
        parents, _ = pool.host_lists()
        depths = pool.depths.tolist()
        inside, kept = {node}, [node]
        for candidate in range(node + 1, pool.num_nodes):
            if parents[candidate] in inside and depths[candidate] - depths[node] <= depth_limit:
                inside.add(candidate)
                kept.append(candidate)
        fed = sorted((slots[n], n) for n in kept[1:] if n < len(slots) and slots[n] >= 0)
        committed = len(history)
        _compact(self.cache, len(root_history), torch.tensor(continuation + [slot for slot, _ in fed]))
        self.history, self.cached_ids = history, list(history)
        position = {old: new for new, old in enumerate(kept)}
        new_slots = torch.full((len(kept),), -1, dtype=torch.long)
        new_slots[0] = committed - 1
        rows = torch.zeros(1 + len(fed), max(len(fed), 1), dtype=torch.bool)
        for order, (_, old) in enumerate(fed):
            new_slots[position[old]] = committed + order
            if parents[old] != node:  # under a fed ancestor: what it sees, and itself
                rows[1 + order] = rows[1 + int(new_slots[position[parents[old]]]) - committed]
            rows[1 + order, order] = True
        index = torch.tensor(kept, dtype=torch.long, device=pool.device)
        subtree = pool.select(index)
        subtree = TokenTree(
            subtree.tokens, subtree.parents, subtree.depths - subtree.depths[0], subtree.logprobs - subtree.logprobs[0]
        )
        self._pool, self._pool_slots = subtree, new_slots.to(pool.device)
        self._fed_rows = rows.to(pool.device)
        return subtree, index

    def feed(self, pool: TokenTree, nodes: torch.Tensor) -> Feed:
        """What the draft must run to expand pool ``nodes``: on a tree's first forward, the unseen history (ending
        with the root); afterwards the nodes themselves, each seeing the history and its own fed ancestors."""
        history = self.history
        if self._pool is None:
            device = self.device
            self._fed_rows = torch.zeros(1, 0, dtype=torch.bool, device=device)
            pending = upload(history[len(self.cached_ids) :], torch.long, device)
            positions = torch.arange(len(self.cached_ids), len(history), device=device)
            return Feed(self.cache, pending, positions, None, 1)
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
        return Feed(self.cache, pool.tokens[nodes], positions, visible, count)

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

    def record_feed(self, pool: TokenTree, nodes: torch.Tensor) -> None:
        """Notes where the tokens of the feed that expanded ``nodes`` now sit in the cache (after the forward)."""
        if self._pool is None:
            self.cached_ids = list(self.history)
            slots = torch.full((1,), len(self.history) - 1, dtype=torch.long, device=self.device)
        else:
            # The pool has grown since the last feed: its new nodes have no slot (-1) until they are fed.
            slots = torch.full((pool.num_nodes,), -1, dtype=torch.long, device=pool.device)
            slots[: self._pool_slots.numel()] = self._pool_slots
            fed_from = self.cache.get_seq_length() - nodes.numel()
            slots[nodes] = torch.arange(fed_from, fed_from + nodes.numel(), device=pool.device)
        self._pool, self._pool_slots = pool, slots


def _compact(cache: DynamicCache | StaticDraftCache, keep_prefix: int, slots: torch.Tensor) -> None:
    """Keeps the cache's entries ``[0, keep_prefix)`` followed by those at ``slots``, whichever kind it is."""
    if isinstance(cache, StaticDraftCache):
        cache.compact(keep_prefix, slots)
    else:
        compact_cache(cache, keep_prefix, slots)


@contextmanager
def scored_columns(model: PreTrainedModel) -> Iterator[torch.Tensor | None]:
    """Within it, in this thread, a draft whose LM head scores only part of the vocabulary returns logits over those
    columns only, and it yields their vocabulary ids (``[columns]``, ascending); any other draft returns full rows,
    and it yields ``None``.

    A head opts in with a ``compact_scores()`` context manager that yields its ids, as
    :class:`~specexec_hf.models.vocab.SubsetLMHead` does: SmolLM2's shipped draft scores 8,192 of 49,152 tokens,
    and ranking a node's children over full rows spent most of its time on the ``-inf`` columns.
    """
    compact_scores = getattr(model.get_output_embeddings(), "compact_scores", None)
    if compact_scores is None:
        yield None
        return
    with compact_scores() as token_ids:
        yield token_ids


def forward_feeds(
    model: PreTrainedModel, feeds: Sequence[Feed], columns: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Runs several sequences' feeds through ``model``, batching those of similar length.

    Feeds are sorted by length and grouped so that padding is at most half of each batch: a long prompt prefill
    runs alone instead of padding every tree expansion to its length. A feed over a
    :class:`~.draft_graphs.StaticDraftCache` runs alone, over its own buffers.

    Args:
        model: The draft.
        feeds: One per sequence.
        columns: What :func:`scored_columns` yielded around this call (a static cache's graph keeps the head's
            output width it was captured with).

    Returns:
        Per feed, in order, the float32 logits of its last ``num_logits`` tokens.
    """
    logits: list[torch.Tensor | None] = [None] * len(feeds)
    dynamic = []
    for i, feed in enumerate(feeds):
        if isinstance(feed.cache, StaticDraftCache):
            logits[i] = feed.cache.logits(feed, scored_columns=columns is not None)
        else:
            dynamic.append(i)
    order = sorted(dynamic, key=lambda i: feeds[i].tokens.numel())
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
    for group in groups:
        if len(group) == 1:
            logits[group[0]] = model_logits(model, feeds[group[0]])
        else:
            for i, group_logits in zip(group, _batched_logits(model, [feeds[i] for i in group])):
                logits[i] = group_logits
    return logits


def _batched_logits(model: PreTrainedModel, feeds: Sequence[Feed]) -> list[torch.Tensor]:
    """One forward for several sequences with separate caches.

    Row ``r`` of a batched cache holds feed ``r``'s cache in key slots ``[0, cache_length_r)`` (zeros up to the
    longest cache), and the forward packs the feeds over it (:func:`~.forward.packed_inputs`: row ``r``'s new tokens
    at ``[longest_cache, longest_cache + n_r)``). Afterwards each feed's new keys and values are appended to its own
    cache.
    """
    device = feeds[0].tokens.device
    cache_lengths = [feed.cache.get_seq_length() for feed in feeds]
    counts = [feed.tokens.numel() for feed in feeds]
    longest_cache = max(cache_lengths)

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
    logits = packed_logits(model, feeds, batch_cache, cache_lengths, keep)

    for feed in feeds:  # before the keys arrive: a cache without a record takes its length for its positions
        record_positions(feed.cache, feed.positions[None])
    for index, layer in enumerate(batch_cache.layers):
        for row, (feed, count) in enumerate(zip(feeds, counts)):
            new = slice(longest_cache, longest_cache + count)
            keys, values = layer.keys[row : row + 1, :, new].clone(), layer.values[row : row + 1, :, new].clone()
            feed.cache.update(keys, values, index)
    return [logits[row, torch.searchsorted(keep, rows)] for row, rows in enumerate(needed)]
