"""The forward path: what a model is fed over its KV cache, and the float32 logits it gives back.

A :class:`Feed` is one sequence's share of a forward (its cache, tokens, positions, attention pattern and how many
trailing logits are needed, plus the target's per-token inputs and span positions); the draft's feeds
(:mod:`.draft_cache`) and the target's verification forward (:mod:`.decoder`) both use it. Feeds become a model's
inputs here only: :meth:`Feed.inputs` for one sequence, :func:`packed_inputs` for several packed over one batched
cache, both through :func:`forward_inputs`. :func:`model_logits` runs one feed, :func:`packed_logits` a packed
batch, and :func:`node_logits` the target's tree with its LM head applied lazily (:class:`NodeLogits`). Whether a
model can take these forwards at all is :mod:`.compat`'s question.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache, PreTrainedModel

from ..core.batch_packing import pack_rows, padded_stack
from ..core.masks import additive_mask, causal_pattern
from ..core.products import head_product
from ..core.tree import TokenTree
from .attention_spans import attention_spans, span_masks
from .kv import record_positions

# Families whose attention is known to honour a custom 4-D mask together with explicit position_ids, and whose
# logits are their plain LM head applied to the last hidden state; the test suite checks each of them against plain
# generate(). Others are probed numerically per configuration (compat), and their head runs inside their forward.
VERIFIED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
WALK_ROWS_PER_HEAD_CALL = 8
"""Rows one lazy LM-head call computes: a node and its likeliest descendants. The head's weights are read once per
call, and a walk rarely accepts more than 8 nodes in a row (see :func:`_head_rows` for what the rows cost)."""
_WEIGHTS_STAY_LOADED = "_specexec_weights_stay_loaded"
_HEAD_ROWS_LOCK = threading.Lock()


def mark_weights_stay_loaded(module: torch.nn.Module) -> None:
    """Tells the walk that ``module``'s weights stay in place between forwards although a hook runs before it (an
    offload executor's unit with a buffer of its own), so that a resident LM head is applied to a few rows lazily
    instead of to every tree node inside the forward."""
    setattr(module, _WEIGHTS_STAY_LOADED, True)


@dataclass
class Feed:
    """One sequence's share of a forward.

    Args:
        cache: The sequence's KV cache; the fed tokens are appended to it.
        tokens: ``[n]`` tokens to feed.
        positions: ``[n]`` their positions.
        visible: ``[n, cache_length + n]`` bool attention pattern; ``None`` means causal.
        num_logits: How many trailing tokens need logits.
        extra_inputs: Per-token model inputs (``token_type_ids``, ``[1, n]``) beside the tokens.
        span_positions: ``[n]`` where the tokens sit for sliding windows and chunks (see :func:`forward_inputs`);
            ``None``: ``positions``.
    """

    cache: Cache
    tokens: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor | None
    num_logits: int
    extra_inputs: dict[str, torch.Tensor] | None = None
    span_positions: torch.Tensor | None = None

    def visibility(self) -> torch.Tensor:
        """``visible``, with the causal pattern spelled out when it is ``None``."""
        if self.visible is not None:
            return self.visible
        return causal_pattern(self.tokens.numel(), self.cache.get_seq_length(), self.tokens.device)

    def inputs(self, model: PreTrainedModel) -> dict[str, Any]:
        """:func:`forward_inputs` for this one sequence, as a batch of one."""
        return forward_inputs(
            model, self.tokens[None], self.positions[None], self.cache,
            None if self.visible is None else self.visible[None], self.extra_inputs,
            None if self.span_positions is None else self.span_positions[None],
        )


def forward_inputs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Cache,
    visible: torch.Tensor | None,
    extra_inputs: dict[str, torch.Tensor] | None = None,
    span_positions: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Keyword arguments of a cached forward over ``[batch, n]`` tokens with an optional bool attention pattern
    ``[batch, n, cache_length + n]`` (``None``: causal), for the model or its decoder stack.

    Sliding and chunked layers get the pattern limited to their span, measured in ``span_positions`` (a dict of
    masks keyed by layer type when the model mixes types), which are recorded beside the cache.

    Args:
        span_positions: ``[batch, n]`` where the tokens sit for sliding windows and chunks, which transformers
            measures in sequence indices; ``None``: ``position_ids`` (they differ only where an attention mask
            with holes shifts the positions).
    """
    kwargs: dict[str, Any] = dict(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
    kwargs.update(extra_inputs or {})
    spans = attention_spans(model.config)
    span_positions = position_ids if span_positions is None else span_positions
    key_positions = record_positions(cache, span_positions)
    if all(span.is_full for span in spans.values()):
        if visible is not None:
            kwargs["attention_mask"] = attention_mask_for(model, visible)
        return kwargs
    if visible is None:
        count = position_ids.shape[-1]
        visible = causal_pattern(count, key_positions.shape[-1] - count, position_ids.device)
        visible = visible.expand(position_ids.shape[0], -1, -1)
    masks = {kind: attention_mask_for(model, mask) for kind, mask in
             span_masks(visible, span_positions, key_positions, spans).items()}
    kwargs["attention_mask"] = next(iter(masks.values())) if len(set(spans.values())) == 1 else masks
    return kwargs


def attention_mask_for(model: PreTrainedModel, visible: torch.Tensor) -> torch.Tensor:
    """The ``[batch, 1, queries, keys]`` mask ``model``'s attention takes for a bool pattern, in the format
    transformers itself gives it: bool for SDPA, additive float for eager attention. The two differ on a query that
    sees no key (masked tokens under a sliding window): SDPA returns zeros for a bool mask, softmax averages all
    values under a float one."""
    if model.config._attn_implementation == "sdpa":
        return visible.view(-1, 1, *visible.shape[-2:])
    return additive_mask(visible, model.dtype)


def packed_inputs(
    model: PreTrainedModel, feeds: Sequence[Feed], cache: Cache, cached: Sequence[int]
) -> dict[str, Any]:
    """Keyword arguments of one forward over several sequences' feeds packed over one batched cache, in the layout of
    :mod:`specexec_hf.core.batch_packing`: row ``r`` of ``cache`` holds feed ``r``'s ``cached[r]`` tokens in its first
    slots, its feed goes after the cache's last slot, padded to the longest feed, and its pattern (its ``visible``,
    causal over its own ``cache`` when ``None``) is spread over that layout; its per-token inputs are padded alike.

    Args:
        model: The model the forward runs.
        feeds: One per batch row.
        cache: The batched cache; the fed tokens (padding included) are appended to it.
        cached: Per row, how many of its own tokens ``cache`` holds.
    """
    packed = pack_rows(
        [feed.tokens for feed in feeds], [feed.positions for feed in feeds],
        [feed.positions if feed.span_positions is None else feed.span_positions for feed in feeds],
        [feed.visibility() for feed in feeds], cached, cache.get_seq_length(),
    )
    longest = packed.tokens.shape[1]
    extra_inputs = {
        name: padded_stack([(feed.extra_inputs or {})[name] for feed in feeds], longest)
        for name in feeds[0].extra_inputs or {}
    }
    return forward_inputs(
        model, packed.tokens, packed.positions, cache, packed.visible, extra_inputs, packed.span_positions
    )


def packed_logits(
    model: PreTrainedModel, feeds: Sequence[Feed], cache: Cache, cached: Sequence[int], keep: int | torch.Tensor
) -> torch.Tensor:
    """One forward over ``feeds`` packed over ``cache`` (see :func:`packed_inputs`); float32 logits
    ``[batch, kept, vocab]`` of the positions ``keep`` names: the last ``keep`` of the padded feed, or a 1-D tensor
    of its positions."""
    return _kept_logits(model, packed_inputs(model, feeds, cache, cached), keep)


def _kept_logits(model: PreTrainedModel, kwargs: dict[str, Any], keep: int | torch.Tensor) -> torch.Tensor:
    """The forward's float32 logits ``[batch, kept, vocab]``, through ``logits_to_keep`` where the model takes it."""
    if model._supports_logits_to_keep():
        if isinstance(keep, int):
            # The last rows by index, not by slice: over several fed tokens a slice of the hidden states is a strided
            # view, whose product with the head makes torch (2.13, CPU) copy the whole transposed head every call
            # (200 MB for a 1.7B model); gathered rows are contiguous and take the plain product.
            fed = kwargs["position_ids"].shape[-1]
            keep = torch.arange(fed - keep, fed, device=kwargs["position_ids"].device)
        return model(**kwargs, logits_to_keep=keep).logits.float()
    logits = model(**kwargs).logits
    return (logits[:, -keep:] if isinstance(keep, int) else logits[:, keep]).float()


class NodeLogits:
    """The target's float32 logits for each tree node, computed from its last hidden states on first use.

    The acceptance walk reads the logits of the nodes it visits (the accepted path plus one), typically a handful
    out of hundreds. Applying the LM head to those rows only, instead of to every node, saves most of the head's
    cost: on SmolLM2-135M the head is about a fifth of a forward's work per token. The head's weights are read once
    per call whatever the rows, so a missing row comes with those of its likeliest descendants (the path the walk
    takes when the draft was right), up to :data:`WALK_ROWS_PER_HEAD_CALL`: one call per miss of the draft instead
    of one per accepted node.

    Args:
        hidden: ``[num_nodes, hidden]`` final hidden states, or ``None`` when ``logits`` are given.
        head: The model's output embedding (a bias-free linear layer).
        logits: ``[num_nodes, vocab]`` precomputed logits, for models whose head cannot be applied lazily.
        outputs: The model's whole output, when its hidden states or attention weights were asked for.
        tree: The tree the nodes belong to, whose likeliest paths the lazy head computes ahead; ``None``: one row
            per call.
    """

    def __init__(
        self,
        hidden: torch.Tensor | None = None,
        head: torch.nn.Module | None = None,
        logits: torch.Tensor | None = None,
        outputs: Any = None,
        tree: TokenTree | None = None,
    ):
        self.hidden, self.head, self.outputs = hidden, head, outputs
        self._rows: dict[int, torch.Tensor] = {}
        self._logits = logits
        self._tree = tree
        self._likeliest_child: list[int] | None = None

    def row(self, node: int) -> torch.Tensor:
        """``[1, vocab]`` logits of ``node``, computed once; a copy, so callers that keep it (``output_logits``)
        do not keep the whole tree's logits alive."""
        if node not in self._rows:
            if self._logits is not None:
                self._rows[node] = self._logits[node : node + 1].clone()
            else:
                nodes = self._likeliest_path(node)
                rows = _head_rows(self.head, self.hidden[nodes]).float()
                for index, path_node in enumerate(nodes):
                    self._rows[path_node] = rows[index : index + 1].clone()
        return self._rows[node]

    def all(self) -> torch.Tensor:
        """``[num_nodes, vocab]`` the logits of every node (the head applied to all of them at once)."""
        return self._logits if self._logits is not None else self.head(self.hidden).float()

    def _likeliest_path(self, node: int) -> list[int]:
        """``node`` and its likeliest descendants whose rows are not computed yet, at most
        :data:`WALK_ROWS_PER_HEAD_CALL` nodes."""
        if self._tree is None:
            return [node]
        if self._likeliest_child is None:
            self._likeliest_child = self._tree.likeliest_children()
        path = [node]
        while len(path) < WALK_ROWS_PER_HEAD_CALL:
            child = self._likeliest_child[path[-1]]
            if child < 0 or child in self._rows:
                break
            path.append(child)
        return path


def _head_rows(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)`` for the few rows a walk asks for, multiplied in the order of
    :func:`~specexec_hf.core.products.head_product` (on a CPU with MKL the walk's head then cost 13.7 ms per step
    instead of 30.0 at budget 16 and 16.7 instead of 35.2 at 64: ``benchmarks/results/walk_head``), with the head's
    hooks run as in any call."""
    # The product replaces the forward for this one call, so that the head's hooks (an offload executor's
    # read-ahead) run around it as around any call. The lock keeps walks in other threads from overlapping it; a
    # call of the same head from another thread outside a walk meanwhile gets the same order (rounding only).
    with _HEAD_ROWS_LOCK:
        if "forward" in vars(head):  # someone else's per-instance forward (a wrapper): leave it alone
            return head(hidden)
        head.forward = lambda rows: head_product(rows, head.weight)
        try:
            return head(hidden)
        finally:
            del head.forward


def head_applies_lazily(model: PreTrainedModel) -> bool:
    """Whether ``logits == lm_head(last hidden state)`` can be applied outside the forward.

    That holds for the verified families' plain linear heads held in memory; heads wrapped by offloading hooks
    (weights streamed in around each call) or quantized layers go through the model's own forward instead.
    """
    head = model.get_output_embeddings()
    hooked = bool(head._forward_pre_hooks or head._forward_hooks)
    return (
        model.config.model_type in VERIFIED_MODEL_TYPES
        and type(head) is torch.nn.Linear
        and head.bias is None
        and head.weight.device.type != "meta"
        and (not hooked or getattr(head, _WEIGHTS_STAY_LOADED, False))
        and not hasattr(head, "_hf_hook")
        and model.base_model is not model
    )


def model_logits(model: PreTrainedModel, feed: Feed) -> torch.Tensor:
    """One forward over ``feed``; the float32 logits ``[num_logits, vocab]`` of its last ``num_logits`` tokens."""
    return _kept_logits(model, feed.inputs(model), feed.num_logits)[0]


def node_logits(
    model: PreTrainedModel,
    feed: Feed,
    hidden_states: bool = False,
    attentions: bool = False,
    tree: TokenTree | None = None,
) -> NodeLogits:
    """One target forward over ``feed``, whose last ``num_logits`` tokens are tree nodes; their logits, per node
    on demand.

    Args:
        model: The target.
        feed: The pending committed tokens and the tree's nodes.
        hidden_states, attentions: Also keep every token's hidden states / attention weights, as
            ``generate(output_hidden_states=..., output_attentions=...)`` asks, in ``NodeLogits.outputs`` (through
            the model's own forward, which returns them).
        tree: The tree of the nodes, whose likeliest paths a lazy head computes together (see :class:`NodeLogits`).
    """
    traced = hidden_states or attentions
    if not (traced or head_applies_lazily(model)):
        return NodeLogits(logits=model_logits(model, feed))
    kwargs, num_nodes = feed.inputs(model), feed.num_logits
    if traced:
        outputs = model(**kwargs, output_hidden_states=hidden_states, output_attentions=attentions)
        return NodeLogits(logits=outputs.logits[0, -num_nodes:].float(), outputs=outputs)
    hidden = model.base_model(**kwargs).last_hidden_state
    return NodeLogits(hidden=hidden[0, -num_nodes:], head=model.get_output_embeddings(), tree=tree)
