"""KV-cache layout helpers shared by the draft and the target: tree attention masks and cache compaction.

Both models keep their cache as ``[committed tokens | tree nodes in the order they were fed]``. A tree node
attends to every committed token, to its own ancestors wherever they sit in the cache, and to itself; its
position is the root's position plus its depth, so a node sees exactly what it would see as the next token of
its own path. After verification the accepted nodes are moved down behind the committed tokens and the rest
is cut, without recomputing anything.

Every layer keeps a full cache (also sliding and chunked ones, whose spans the masks apply, see
:mod:`specexec_hf.hf.attention_spans`), and the position of each cached slot is remembered beside the cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Positions of each cache's slots, ``[batch, slots]``; a cache without an entry holds a plain sequence.
_slot_positions: weakref.WeakKeyDictionary[DynamicCache, torch.Tensor] = weakref.WeakKeyDictionary()


def new_cache() -> DynamicCache:
    """An empty cache whose every layer keeps all its keys and values (sliding layers included)."""
    return DynamicCache()


def slot_positions(cache: DynamicCache, batch: int = 1, device: torch.device | str | None = None) -> torch.Tensor:
    """``[batch, cache length]`` position of every cached slot."""
    recorded = _slot_positions.get(cache)
    if recorded is not None:
        return recorded.to(device).expand(batch, -1)
    return torch.arange(cache.get_seq_length(), device=device).expand(batch, -1)


def record_positions(cache: DynamicCache, positions: torch.Tensor) -> torch.Tensor:
    """Notes that the tokens at ``[batch, n]`` ``positions`` are being appended to ``cache``; returns the positions
    of all its slots with them, ``[batch, cache length + n]``."""
    previous = slot_positions(cache, positions.shape[0], positions.device)
    _slot_positions[cache] = torch.cat([previous, positions], dim=-1)
    return _slot_positions[cache]


def compact_cache(cache: DynamicCache, keep_prefix: int, slots: torch.Tensor) -> None:
    """Keeps cache entries ``[0, keep_prefix)`` followed by the entries at ``slots``; drops the rest (every batch row
    alike).

    ``slots`` must be ascending and ``>= keep_prefix``, so each entry only ever moves down and the copy cannot
    overwrite an entry it still has to read.
    """
    _compact(cache, [(slice(None), keep_prefix, slots)])


def compact_rows(cache: DynamicCache, prefixes: Sequence[int], slots: Sequence[torch.Tensor]) -> None:
    """:func:`compact_cache` per batch row: row ``r`` keeps its entries ``[0, prefixes[r])`` followed by those at
    ``slots[r]``; the cache is cut to the longest row, shorter rows leaving stale entries after theirs (a batch of
    sequences sharing one cache, see :mod:`specexec_hf.core.batch_packing`)."""
    rows = [slice(row, row + 1) for row in range(len(prefixes))]  # slices: an int index would move the slot axis
    _compact(cache, list(zip(rows, prefixes, slots)))


def _compact(cache: DynamicCache, moves: Sequence[tuple[slice, int, torch.Tensor]]) -> None:
    """Per ``(rows, keep_prefix, slots)``: those rows' entries at ``slots`` moved down behind their first
    ``keep_prefix``; then every layer cut to the longest kept row."""
    kept = max(prefix + slots.numel() for _, prefix, slots in moves)
    for layer in _full_layers(cache):
        keys, values = layer.keys, layer.values
        if keys is None or values is None:  # not initialized
            continue
        for rows, prefix, slots in moves:
            if slots.numel():
                slots = slots.to(keys.device)
                end = prefix + slots.numel()
                keys[rows, ..., prefix:end, :] = keys[rows, ..., slots, :]
                values[rows, ..., prefix:end, :] = values[rows, ..., slots, :]
        layer.keys, layer.values = keys[..., :kept, :], values[..., :kept, :]
    recorded = _slot_positions.get(cache)
    if recorded is not None:
        positions = recorded.clone()
        for rows, prefix, slots in moves:
            positions[rows, prefix : prefix + slots.numel()] = positions[rows, slots.to(positions.device)]
        _slot_positions[cache] = positions[:, :kept]


def select_rows(cache: DynamicCache, rows: torch.Tensor, length: int) -> None:
    """Keeps batch ``rows`` of ``cache`` (in that order) and its first ``length`` slots: sequences that left a
    shared batch cache take their rows with them."""
    for layer in _full_layers(cache):
        keys, values = layer.keys, layer.values
        if keys is not None and values is not None:  # an initialized layer
            layer.keys = keys[rows.to(keys.device), ..., :length, :]
            layer.values = values[rows.to(values.device), ..., :length, :]
    recorded = _slot_positions.get(cache)
    if recorded is not None:
        _slot_positions[cache] = recorded[rows.to(recorded.device), :length]


def _full_layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers, every one a full :class:`DynamicLayer` (as :func:`new_cache` makes them).

    Raises:
        TypeError: for any other layer, whose entries SpecExec cannot move.
    """
    layers = []
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(
                f"SpecExec compacts full DynamicCache layers only (see new_cache), got {type(layer).__name__}."
            )
        layers.append(layer)
    return layers
