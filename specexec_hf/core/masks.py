"""Tree attention masks: a node sees the committed tokens, its own ancestors and itself."""

from __future__ import annotations

import torch


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[queries, keys]`` (or ``[batch, queries, keys]``) bool to the ``[batch, 1, queries, keys]`` additive float
    mask HF attention expects (batch 1 for a 2-D pattern)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.view(-1, 1, *visible.shape[-2:])


def causal_pattern(count: int, cache_length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[count, cache_length + count]`` bool: ``count`` new tokens seeing the whole cache and, causally, each other."""
    visible = torch.ones(count, cache_length + count, dtype=torch.bool, device=device)
    visible[:, cache_length:] = visible[:, cache_length:].tril()
    return visible


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
    visible[:num_chain, : cache_length + num_chain] = causal_pattern(num_chain, cache_length, ancestors.device)
    visible[num_chain:, : cache_length + num_chain] = True
    visible[num_chain:, cache_length + num_chain :] = ancestors[1:, 1:]
    return visible
