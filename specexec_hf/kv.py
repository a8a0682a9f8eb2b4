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


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[queries, keys]`` (or ``[batch, queries, keys]``) bool to the ``[batch, 1, queries, keys]`` additive float
    mask HF attention expects (batch 1 for a 2-D pattern)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.view(-1, 1, *visible.shape[-2:])


def chain_and_tree_mask(cache_length: int, num_chain: int, ancestors: torch.Tensor) -> torch.Tensor:
    """Visibility for a forward that feeds a causal chain, then tree nodes 1.. of a tree rooted at its end.

    Args:
        cache_length: Tokens already in the cache.
        num_chain: Committed tokens fed first; the last of them is the tree's root.
        ancestors: The tree's ``ancestor_mask()``, ``[N, N]``.

    Returns:
        ``[num_chain + N - 1, cache_length + num_chain + N - 1]`` bool.
    """
    num_tree = ancestors.shape[0] - 1
    queries, keys = num_chain + num_tree, cache_length + num_chain + num_tree
    visible = torch.zeros(queries, keys, dtype=torch.bool, device=ancestors.device)
    visible[:, :cache_length] = True
    visible[:num_chain, cache_length : cache_length + num_chain] = torch.ones(
        num_chain, num_chain, dtype=torch.bool, device=ancestors.device
    ).tril()
    visible[num_chain:, cache_length : cache_length + num_chain] = True
    visible[num_chain:, cache_length + num_chain :] = ancestors[1:, 1:]
    return visible


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
