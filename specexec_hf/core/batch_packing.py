"""Several sequences' feeds packed into one batched forward over a shared KV cache, and what each keeps after it.

Layout: the cache is one ``[batch, ..., width, ...]`` tensor per layer; row ``r`` holds its own ``cached[r]`` tokens
in slots ``[0, cached[r])`` and junk after them up to ``width`` (left by shorter rows' compaction), never visible.
A forward appends every row's feed at slots ``[width, width + longest feed)``: row ``r``'s ``n_r`` new tokens in its
first ``n_r`` columns, padding after them. Each row's own attention pattern (over its ``cached[r] + n_r`` keys) is
spread over that layout; a padding query sees only itself, so no softmax row is empty. After the walk each row keeps
its prefix and moves the fed slots it keeps down behind it (:func:`kept_feed_slots`), so the rows never need
re-aligning: the shared cache costs one copy of each kept slot, as one sequence's compaction does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    """One batched forward's inputs.

    Args:
        tokens: ``[batch, longest]`` each row's fed tokens, then padding (token 0).
        positions: ``[batch, longest]`` their positions (0 for padding).
        span_positions: ``[batch, longest]`` their sequence indices for sliding windows (0 for padding).
        visible: ``[batch, longest, width + longest]`` bool attention pattern over the shared cache and the feed.
        counts: Fed tokens per row.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    span_positions: torch.Tensor
    visible: torch.Tensor
    counts: list[int]


def padded_stack(rows: Sequence[torch.Tensor], width: int, fill: int = 0) -> torch.Tensor:
    """``[len(rows), width]``: each 1-D (or ``[1, n]``) row, then ``fill`` up to ``width``."""
    flat = [row.reshape(-1) for row in rows]
    return torch.stack([torch.nn.functional.pad(row, (0, width - row.numel()), value=fill) for row in flat])


def pack_rows(
    tokens: Sequence[torch.Tensor],
    positions: Sequence[torch.Tensor],
    span_positions: Sequence[torch.Tensor],
    visible: Sequence[torch.Tensor],
    cached: Sequence[int],
    width: int,
) -> PackedRows:
    """Packs per-row feeds over the shared cache layout (see the module docstring).

    Args:
        tokens, positions, span_positions: Per row, ``[n_r]``.
        visible: Per row, ``[n_r, cached[r] + n_r]`` its own pattern: its cached tokens, then its feed.
        cached: Per row, how many of its tokens the cache holds (slots ``[0, cached[r])``).
        width: The shared cache's slot count (at least every ``cached[r]``).

    Raises:
        ValueError: when a row's cached tokens or pattern do not fit the layout.
    """
    counts = [row.numel() for row in tokens]
    if any(count > width for count in cached) or any(
        pattern.shape != (count, own + count) for pattern, count, own in zip(visible, counts, cached)
    ):
        raise ValueError(
            "pack_rows: each row's pattern must be [fed, cached + fed] with its cached tokens within the shared "
            f"width {width}; got cached={list(cached)}, fed={counts}, patterns={[tuple(v.shape) for v in visible]}."
        )
    longest = max(counts)
    device = tokens[0].device
    packed = torch.zeros(len(counts), longest, width + longest, dtype=torch.bool, device=device)
    diagonal = torch.arange(longest, device=device)
    packed[:, diagonal, width + diagonal] = True  # padding queries see themselves
    for row, (pattern, count, own) in enumerate(zip(visible, counts, cached)):
        packed[row, :count, :own] = pattern[:, :own]
        packed[row, :count, width : width + count] = pattern[:, own:]
    return PackedRows(
        padded_stack(tokens, longest), padded_stack(positions, longest), padded_stack(span_positions, longest),
        packed, counts,
    )


def kept_feed_slots(width: int, pending: int, accepted: Sequence[int]) -> torch.Tensor:
    """The cache slots a row keeps after a packed forward that fed its ``pending`` committed tokens and then a tree's
    nodes 1.. at slots ``width, width + 1, ...``: the pending tokens' and the ``accepted`` nodes' (tree node ``i`` sat
    at ``width + pending + i - 1``), ascending."""
    nodes = torch.tensor(list(accepted), dtype=torch.long)
    return torch.cat([torch.arange(width, width + pending), width + pending - 1 + nodes])
