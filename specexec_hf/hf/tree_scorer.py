"""A model that scores token trees after a committed sequence in one forward each, its KV cache kept across trees.

The target's verification forward is one (:class:`~.decoder.SpecExecDecoder`); an intermediate draft's is another
(:mod:`.hierarchy`). The cache always holds every committed token but the last, which is the next tree's root; a
forward feeds the committed tokens it has not seen, then the tree, each node seeing the committed tokens and its own
ancestors; :meth:`TreeScorer.keep` then keeps the committed tokens and the accepted nodes.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..core.masks import chain_and_tree_mask
from ..core.tree import TokenTree
from .forward import Feed, NodeLogits, node_logits
from .kv import compact_cache, new_cache
from .request import Request


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
        ending with the root, then ``tree``; the logits of each tree node.

        Each node takes the position after its parent's; sliding windows and chunks count sequence indices, as in
        plain decoding, where a node at depth d would sit at index length - 1 + d.
        """
        request, cached, length = self.request, self.cached, sequence.shape[1] - self.padding
        pending = sequence[0, self.padding + cached :]
        tokens = torch.cat([pending, tree.tokens[1:].to(pending)])
        committed_positions = request.positions_of(cached, length).to(pending)
        depths = tree.depths[1:].to(pending)
        positions = torch.cat([committed_positions, committed_positions[-1] + depths])
        indices = torch.cat([torch.arange(cached, length, device=pending.device), length - 1 + depths])
        visible = chain_and_tree_mask(cached, pending.numel(), tree.ancestor_mask()).to(pending.device)
        if request.has_masked_tokens:  # masked tokens stay in the cache, but no query sees them
            visible[:, :length] &= request.attended_keys(length).to(visible.device)
        extra_inputs = request.inputs_for(cached, length, tree.num_nodes - 1)
        hidden_states, attentions = self.trace
        feed = Feed(self.cache, tokens, positions, visible, tree.num_nodes, extra_inputs, span_positions=indices)
        return node_logits(self.model, feed, hidden_states=hidden_states, attentions=attentions, tree=tree)

    def keep(self, length: int, accepted: list[int]) -> None:
        """After a :meth:`score` of a tree under ``length`` committed tokens (without left padding): keeps those
        tokens and the ``accepted`` tree nodes (ascending, a path from the root's child down), drops the rest."""
        # Tree node i sat at cache slot length + i - 1.
        compact_cache(self.cache, length, length - 1 + torch.tensor(accepted, dtype=torch.long))
        self.cached = length + len(accepted)
