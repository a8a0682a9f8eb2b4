"""Near-ties: greedy choices that rounding in a 16-bit target could flip.

A tree forward runs other kernel shapes than a one-token forward (more query rows, so other blockings and
reduction orders in the matmuls), so the same node's logits come out rounded differently, and the differences grow
through the layers (on SmolLM2-135M in bfloat16, the MLP's down projection is the first to differ; logits then
differ by a few units in the last place). Where the target's top two scores are further apart than rounding can
move them, both forwards pick the same token; where they are closer, either may win, and speculative decoding,
batched decoding and plain decoding can part ways there. Plain 16-bit greedy decoding is itself one rounding
outcome: its logits come from one-token forwards over a cache that one-token forwards built, which no tree forward
reproduces bit for bit.

The bound (:func:`rounding_bound`). A logit is a dot product ``z = sum_i h_i w_i`` of length ``d`` (the LM head's
reduction size, the hidden size), accumulated in float32 (unit roundoff ``u32``) and stored in the target's dtype
(unit roundoff ``u = eps / 2``). In one forward, against exact arithmetic on the same weights:

- storing ``z`` rounds it once: at most ``u |z|``;
- the hidden state ``h`` arrives rounded to the dtype: ``h_i (1 + delta_i)`` with ``|delta_i| <= u``, which moves
  ``z`` by at most ``u sum_i |h_i w_i|``, taken as ``u |z|`` (a top logit's terms mostly share its sign);
- accumulating ``d`` terms in float32 adds, with high probability, at most about ``sqrt(d) u32 |z|`` (the
  probabilistic rounding bound of a length-``d`` dot product).

Two forwards of the same node can err in opposite directions, so one logit moves by up to twice that between them,
and the gap of the top two by up to ``(2 eps + sqrt(d) eps32) (|z1| + |z2|)``. That takes the hidden state's
difference as one rounding, which it is not (earlier layers' differences add up), so the bound is an estimate,
checked against every measured flip in ``benchmarks/precision_flips.py``. A node is near-tied when its top-two gap
is within the bound. In bfloat16 that is a gap under about ``4 eps |z|`` (4 to 8 units in the last place of the top
logit); in float32, a few parts in a million of the logits.
"""

from __future__ import annotations

import math
import os

import torch

NATIVE_BFLOAT16_ENV = "SPECEXEC_NATIVE_BFLOAT16"
"""Environment variable that overrides :func:`native_bfloat16_cpu`'s probe (``1`` or ``0``)."""

ACCUMULATOR_EPS = torch.finfo(torch.float32).eps
"""Kernels accumulate 16-bit dot products in float32 (CPU and GPU matmuls alike), float32 ones in float32."""


def rounding_bound(top_two: torch.Tensor, eps: float, reduction: int) -> torch.Tensor:
    """How far rounding can move the gap between two logits between two forwards of the same node.

    Args:
        top_two: ``[..., 2]`` the two logits (the target's top two scores).
        eps: Machine epsilon of the dtype the target computes its logits in (``torch.finfo(dtype).eps``).
        reduction: Length of the dot products behind each logit (the LM head's input width).

    Returns:
        ``[...]`` the bound on the change of ``top_two[..., 0] - top_two[..., 1]``: ``(2 eps + sqrt(reduction)
        ACCUMULATOR_EPS) (|z1| + |z2|)``, derived in the module docstring.
    """
    return (2 * eps + math.sqrt(reduction) * ACCUMULATOR_EPS) * top_two.abs().sum(dim=-1)


def greedy_choice(scores: torch.Tensor, eps: float, reduction: int) -> torch.Tensor:
    """The greedy token and whether it is near-tied, in one tensor, so the caller reads both with one host read.

    Args:
        scores: ``[1, vocab]`` or ``[vocab]`` the target's processed scores at a node.
        eps, reduction: As for :func:`rounding_bound`.

    Returns:
        ``[2]`` int64: the argmax (the first maximum, as plain greedy decoding takes it) and 1 where the gap between
        the top two scores is within :func:`rounding_bound`, else 0.
    """
    row = scores.reshape(-1)
    token = row.argmax()
    if row.numel() < 2:
        return torch.stack([token, torch.zeros_like(token)])
    top_two = row.topk(2).values
    finite = torch.isfinite(top_two).all()
    tied = finite & (top_two[0] - top_two[1] <= rounding_bound(top_two, eps, reduction))
    return torch.stack([token, tied.long()])


def native_bfloat16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512-BF16 or AMX). There a small draft's forward
    in bfloat16 takes about 40% less time than in float32 (SmolLM2's draft on a 2-core EPYC); without, bfloat16
    matmuls convert every operand and a bfloat16 forward over many tokens is several times slower than float32.

    ``SPECEXEC_NATIVE_BFLOAT16=1`` (or ``0``) overrides the probe, so that one machine can run what either kind of
    CPU would choose (CI runs the dtype-dependent tests both ways); any other value is refused."""
    forced = os.environ.get(NATIVE_BFLOAT16_ENV)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"{NATIVE_BFLOAT16_ENV}={forced!r}: set it to 1 or 0, or unset it to probe the CPU.")
        return forced == "1"
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
