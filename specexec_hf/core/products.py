"""A few rows times an LM head's tall weight, in the order a CPU's BLAS computes fastest.

The acceptance walk multiplies 2-8 hidden states by the target's head (SmolLM2's 49,152 x 576), a draft forward
2-16 by the draft's (the shipped draft's 8,192 x 576 subset head). With MKL on the 2-core EPYC VM (AVX2, float32)
``F.linear(rows, weight)`` took longer for 2-8 rows than for one, while the same product taken as
``(weight @ rows.T).T`` took 5-10 ms against 17-19 for the target's head, 0.7-1.5 against 1.8-2.8 for the draft's
(``benchmarks/results/walk_head``). Elsewhere (another device, another dtype, one row) ``F.linear`` runs as usual.
The two orders round differently: a draft's rounding changes its proposals at most, and a target's head rounds
differently over several rows than over one anyway (see :mod:`.precision`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def head_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(rows, weight)``, as ``(weight @ rows.T).T`` for 2 or more float32 rows on the CPU.

    Args:
        rows: ``[n, in]`` hidden states.
        weight: ``[out, in]`` the head's weight (no bias).

    Returns:
        ``[n, out]``, contiguous.
    """
    few_float32_rows_on_cpu = rows.device.type == "cpu" and rows.dtype == weight.dtype == torch.float32
    if rows.dim() != 2 or rows.shape[0] < 2 or not few_float32_rows_on_cpu:
        return F.linear(rows, weight)
    return (weight @ rows.T).T.contiguous()
