"""Host values copied to the device without making the host wait for it.

A copy from pageable host memory to a CUDA device synchronises the stream (the host waits for all the work queued
before it); a copy from pinned memory runs asynchronously, and the pinned block is not reused before it has run.
The drafter uploads a few values per tree (the history's new tokens, the kept cache slots, the context-match
history), so on a GPU each would otherwise be one more synchronisation per tree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence[int | float], dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, through pinned memory on CUDA, asynchronously.

    Args:
        values: The host values.
        dtype: Their tensor's dtype.
        device: Where the tensor goes (``None``: the CPU).
    """
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device or "cpu").type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
