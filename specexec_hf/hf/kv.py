"""KV-cache layout helpers shared by the draft and the target: tree attention masks and cache compaction.

Both models keep their cache as ``[committed tokens | tree nodes in the order they were fed]``. A tree node
attends to every committed token, to its own ancestors wherever they sit in the cache, and to itself; its
position is the root's position plus its depth, so a node sees exactly what it would see as the next token of
its own path. After verification the accepted nodes are moved down behind the committed tokens and the rest
is cut, without recomputing anything.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def compact_cache(cache: DynamicCache, keep_prefix: int, slots: torch.Tensor) -> None:
    """Keeps cache entries ``[0, keep_prefix)`` followed by the entries at ``slots``; drops the rest.

    ``slots`` must be ascending and ``>= keep_prefix``, so each entry only ever moves down and the copy cannot
    overwrite an entry it still has to read.
    """
    kept = keep_prefix + slots.numel()
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(
                f"SpecExec compacts full-attention DynamicCache layers only, got {type(layer).__name__}. "
                "Sliding-window or quantized caches are not supported."
            )
        if not layer.is_initialized:
            continue
        if slots.numel():
            slots = slots.to(layer.keys.device)
            layer.keys[..., keep_prefix:kept, :] = layer.keys[..., slots, :]
            layer.values[..., keep_prefix:kept, :] = layer.values[..., slots, :]
        layer.keys = layer.keys[..., :kept, :]
        layer.values = layer.values[..., :kept, :]
