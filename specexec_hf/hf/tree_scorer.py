"""A model that scores token trees after a committed sequence in one forward each, its KV cache kept across trees.

The target's verification forward is one (:class:`~.decoder.SpecExecDecoder`); an intermediate draft's is another
(:mod:`.intermediate_draft`). The cache always holds every committed token but the last, which is the next tree's
root; a forward feeds the committed tokens it has not seen, then the tree, each node seeing the committed tokens and
its own ancestors; :meth:`TreeScorer.keep` then keeps the committed tokens and the accepted nodes.
:class:`BatchTreeScorer` does the same for a batch of sequences in one forward (``generate()`` with several prompts,
:mod:`.batch`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from ..core.batch_packing import kept_feed_slots
from ..core.masks import chain_and_tree_mask
from ..core.tree import TokenTree
from .forward import Feed, NodeLogits, head_applies_lazily, node_logits, packed_inputs
from .kv import compact_cache, compact_rows, new_cache, select_rows
from .request import Request


def tree_feed(request: Request, cache: DynamicCache, cached: int, committed: torch.Tensor, tree: TokenTree) -> Feed:
    """One sequence's feed of a tree forward: its committed tokens (``[1, L]``, without left padding) not among the
    ``cached`` ones, ending with the root, then ``tree``'s nodes 1..; its pattern covers the ``cached`` tokens and the
    feed.

    Each node takes the position after its parent's; sliding windows and chunks count sequence indices, as in plain
    decoding, where a node at depth d would sit at index length - 1 + d.
    """
    length = committed.shape[1]
    pending = committed[0, cached:]
    tokens = torch.cat([pending, tree.tokens[1:].to(pending)])
    committed_positions = request.positions_of(cached, length).to(pending)
    depths = tree.depths[1:].to(pending)
    positions = torch.cat([committed_positions, committed_positions[-1] + depths])
    indices = torch.cat([torch.arange(cached, length, device=pending.device), length - 1 + depths])
    visible = chain_and_tree_mask(cached, pending.numel(), tree.ancestor_mask()).to(pending.device)
    if request.has_masked_tokens:  # masked tokens stay in the cache, but no query sees them
        visible[:, :length] &= request.attended_keys(length).to(visible.device)
    extra_inputs = request.inputs_for(cached, length, tree.num_nodes - 1)
    return Feed(cache, tokens, positions, visible, tree.num_nodes, extra_inputs, span_positions=indices)


class TreeScorer:
    """Scores trees after the committed tokens with ``model``, owning its KV cache.

    Args:
        model: The scoring causal LM.
        request: The checked inputs (padding, positions, per-token inputs, masked tokens).
        trace: Keep the hidden states and attention weights (``output_hidden_states`` / ``output_attentions``).
    """

    def __init__(self, model: PreTrainedModel, request: Request, trace: tuple[bool, bool] = (False, False)):
        self.model, self.request, self.trace = model, request, trace
        self.padding = request.left_padding.shape[1]
        self.cache = new_cache()  # generate()'s own (empty) cache would keep sliding layers to one window
        self.cached = 0  # committed tokens (without left padding) in the cache

    def score(self, sequence: torch.Tensor, tree: TokenTree) -> NodeLogits:
        """One forward: the committed tokens of ``sequence`` (``[1, L]``, left padding included) not yet cached,
        ending with the root, then ``tree``; the logits of each tree node."""
        feed = tree_feed(self.request, self.cache, self.cached, sequence[:, self.padding :], tree)
        hidden_states, attentions = self.trace
        return node_logits(self.model, feed, hidden_states=hidden_states, attentions=attentions, tree=tree)

    def keep(self, length: int, accepted: list[int]) -> None:
        """After a :meth:`score` of a tree under ``length`` committed tokens (without left padding): keeps those
        tokens and the ``accepted`` tree nodes (ascending, a path from the root's child down), drops the rest."""
        # Tree node i sat at cache slot length + i - 1.
        compact_cache(self.cache, length, length - 1 + torch.tensor(accepted, dtype=torch.long))
        self.cached = length + len(accepted)


class BatchTreeScorer:
    """Scores one tree per sequence of a batch in one forward, the sequences sharing one KV cache whose rows each keep
    their own committed tokens (the layout of :mod:`specexec_hf.core.batch_packing`): what :class:`TreeScorer` does for
    one sequence, for several at the cost of one pass over the weights.

    Args:
        model: The scoring causal LM.
        requests: One checked request per row, in the cache's row order.
    """

    def __init__(self, model: PreTrainedModel, requests: Sequence[Request]):
        self.model, self.requests = model, list(requests)
        self.cache = new_cache()
        self.cached = [0] * len(self.requests)  # per row, committed tokens (without left padding) in the cache
        self._fed: tuple[int, list[int]] | None = None  # the last forward's starting width and pending tokens per row

    def score(self, committed: Sequence[torch.Tensor], trees: Sequence[TokenTree]) -> list[NodeLogits]:
        """One forward over every row: its committed tokens (``[1, L_r]``, without left padding) not yet cached, ending
        with the root, then its tree; per row, the logits of each of its tree's nodes."""
        width = self.cache.get_seq_length()
        feeds = [
            tree_feed(request, self.cache, cached, row, tree)
            for request, cached, row, tree in zip(self.requests, self.cached, committed, trees)
        ]
        kwargs = packed_inputs(self.model, feeds, self.cache, self.cached)
        pending = [row.shape[1] - cached for row, cached in zip(committed, self.cached)]
        self._fed = (width, pending)
        # Row r's tree nodes: its root (the last pending token), then nodes 1.. right after it.
        columns = [slice(count - 1, count - 1 + tree.num_nodes) for count, tree in zip(pending, trees)]
        if head_applies_lazily(self.model):
            hidden = self.model.base_model(**kwargs).last_hidden_state
            head = self.model.get_output_embeddings()
            return [NodeLogits(hidden=hidden[r, rows], head=head, tree=tree)
                    for r, (rows, tree) in enumerate(zip(columns, trees))]
        logits = self.model(**kwargs).logits
        return [NodeLogits(logits=logits[r, rows].float()) for r, rows in enumerate(columns)]

    def keep(self, accepted: Sequence[Sequence[int]]) -> None:
        """After a :meth:`score`: per row, keeps its committed tokens and its ``accepted`` tree nodes (ascending, a
        path from the root's child down), drops the rest."""
        if self._fed is None:
            raise RuntimeError("BatchTreeScorer.keep follows a score() of the same rows.")
        width, pending = self._fed
        self._fed = None
        slots = [kept_feed_slots(width, count, path) for count, path in zip(pending, accepted)]
        compact_rows(self.cache, self.cached, slots)
        self.cached = [cached + len(row_slots) for cached, row_slots in zip(self.cached, slots)]

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keeps only batch ``rows`` (in that order): the other sequences have left the batch."""
        self.requests = [self.requests[row] for row in rows]
        self.cached = [self.cached[row] for row in rows]
        select_rows(self.cache, torch.tensor(list(rows), dtype=torch.long), max(self.cached, default=0))
