"""Sliding-window and chunked attention in a tree: each layer type's span, measured in positions.

transformers limits a sliding layer's query at position ``p`` to keys at positions ``> p - window`` and a chunked
layer's to keys in the same chunk of ``chunk`` positions, computing both from cache slot indices, which equal
positions in a plain sequence. In a tree they do not: a node at depth ``d`` sits at position ``root + d`` but
in some slot after all the nodes fed before it. So SpecExec keeps full caches for every layer, remembers the
position of every cached slot (:mod:`specexec_hf.hf.kv`), and builds one mask per layer type from positions along
each node's own path; transformers takes such a mask per layer type as a dict keyed by layer type.

Full caches cost memory on sliding layers: the whole context instead of one window of keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"
SUPPORTED_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION)


@dataclass(frozen=True)
class AttentionSpan:
    """Which earlier positions a layer type lets a query see, on top of causality and the tree's ancestry.

    Args:
        window: Sliding window: keys at positions ``> query_position - window``.
        chunk: Chunked attention: keys in the query's chunk, ``key_position // chunk == query_position // chunk``.
    """

    window: int | None = None
    chunk: int | None = None

    @property
    def is_full(self) -> bool:
        return self.window is None and self.chunk is None

    def reach(self) -> int:
        """How many positions back the span can limit attention (0 for full attention)."""
        return max(self.window or 0, self.chunk or 0)

    def allows(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """``[..., queries, keys]`` bool: which keys the span leaves visible, from ``[..., queries]`` and
        ``[..., keys]`` positions."""
        queries, keys = query_positions[..., :, None], key_positions[..., None, :]
        allowed = torch.ones(torch.broadcast_shapes(queries.shape, keys.shape), dtype=torch.bool, device=keys.device)
        if self.window is not None:
            allowed &= keys > queries - self.window
        if self.chunk is not None:
            allowed &= torch.div(keys, self.chunk, rounding_mode="floor") == torch.div(
                queries, self.chunk, rounding_mode="floor"
            )
        return allowed

    def sees_no_key(self, attended: torch.Tensor) -> torch.Tensor:
        """``[n]`` bool: which tokens of a sequence with ``[n]`` bool ``attended`` keys have no attended key at all
        in their span (themselves and earlier tokens, measured in sequence indices)."""
        counts = torch.nn.functional.pad(attended.long().cumsum(0), (1, 0))  # counts[i]: attended keys before i
        indices = torch.arange(attended.numel(), device=attended.device)
        first = torch.zeros_like(indices)
        if self.window is not None:
            first = torch.maximum(first, indices - self.window + 1)
        if self.chunk is not None:
            first = torch.maximum(first, indices - indices % self.chunk)
        return counts[indices + 1] == counts[first]


FULL = AttentionSpan()


def decoder_layer_types(config: Any) -> list[str]:
    """The attention type of each decoder layer, as transformers infers it for its caches."""
    decoder = config.get_text_config(decoder=True)
    declared = getattr(decoder, "layer_types", None)
    if declared:
        return list(declared)
    if getattr(decoder, "sliding_window", None) is not None and getattr(decoder, "use_sliding_window", True):
        kind = SLIDING_ATTENTION
    elif getattr(decoder, "attention_chunk_size", None) is not None:
        kind = CHUNKED_ATTENTION
    else:
        kind = FULL_ATTENTION
    # A config without a layer count (a composite one whose decoder lives elsewhere) declares no layer type.
    return [kind] * (getattr(decoder, "num_hidden_layers", None) or 0)


def attention_spans(config: Any) -> dict[str, AttentionSpan]:
    """The span of each supported layer type ``config``'s decoder uses (other types are left out: see
    :func:`specexec_hf.hf.compat.check_supported`)."""
    decoder = config.get_text_config(decoder=True)
    spans = {}
    for kind in dict.fromkeys(decoder_layer_types(config)):
        if kind == FULL_ATTENTION:
            spans[kind] = FULL
        elif kind == SLIDING_ATTENTION:
            spans[kind] = AttentionSpan(window=decoder.sliding_window)
        elif kind == CHUNKED_ATTENTION:
            spans[kind] = AttentionSpan(chunk=decoder.attention_chunk_size)
    return spans


def span_masks(
    visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor, spans: dict[str, AttentionSpan]
) -> dict[str, torch.Tensor]:
    """Per layer type, ``visible`` limited to the type's span.

    Args:
        visible: ``[batch, queries, keys]`` bool pattern of causality and tree ancestry.
        query_positions: ``[batch, queries]`` positions of the queries.
        key_positions: ``[batch, keys]`` positions of the keys (cached slots, then the queries).
        spans: From :func:`attention_spans`.
    """
    return {kind: visible if span.is_full else visible & span.allows(query_positions, key_positions)
            for kind, span in spans.items()}
