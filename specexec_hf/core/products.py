"""A few rows times an LM head's tall weight, in the order a CPU's BLAS computes fastest.

The acceptance walk multiplies 2-8 hidden states by the target's head (SmolLM2's 49,152 x 576), a draft forward
2-16 by the draft's (the shipped draft's 8,192 x 576 subset head). With MKL on the 2-core EPYC VM (AVX2, float32)
``F.linear(rows, weight)`` took longer for 2-8 rows than for one, while the same product taken as
``(weight @ rows.T).T`` took 5.6-10.4 ms against 16.2-17.8 for the target's head, 0.8-1.5 against 2.0-2.4 for the
draft's (``benchmarks/results/walk_head``). That order is slow for some row counts above 8 (a throwaway timing of both
heads, not kept: 13-15 and 23-31 rows took longer than with ``F.linear``), so there the rows are padded with zeros
to a multiple of :data:`ROW_BLOCK`, which in that same timing was faster than ``F.linear`` at every count from 9 to
100 on both heads (the kept benchmark has 13, 16, 27 and 32 rows). Elsewhere
(another device, another dtype, one row) ``F.linear`` runs as usual. The two orders round differently: a draft's
rounding changes its proposals at most, and a target's head rounds differently over several rows than over one
anyway (see :mod:`.precision`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_BLOCK = 8
"""More rows than this are padded to a multiple of it."""


def head_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(rows, weight)``, as ``(weight @ rows.T).T`` for 2 or more float32 rows on the CPU (more than
    :data:`ROW_BLOCK` padded to a multiple of it).

    Args:
        rows: ``[n, in]`` hidden states.
        weight: ``[out, in]`` the head's weight (no bias).

    Returns:
        ``[n, out]``, contiguous.
    """
    float32_on_cpu = rows.device.type == "cpu" and rows.dtype == weight.dtype == torch.float32
    if rows.dim() != 2 or rows.shape[0] < 2 or not float32_on_cpu:
        return F.linear(rows, weight)
    count = rows.shape[0]
    if count > ROW_BLOCK and count % ROW_BLOCK:
        padded = rows.new_zeros(count + ROW_BLOCK - count % ROW_BLOCK, rows.shape[1])
        padded[:count] = rows
        rows = padded
    return (weight @ rows.T)[:, :count].T.contiguous()
