"""Near-ties: greedy choices that rounding in a 16-bit target could flip.

A tree forward runs other kernel shapes than a one-token forward (more query rows, other blockings, other
reduction orders), so the same node's logits come out rounded differently. Where the target's top two scores are
further apart than that rounding can move them, both forwards pick the same token; where they are closer, either
may win, and speculative decoding, batched decoding and plain decoding can part ways there. Plain 16-bit greedy
decoding is itself only one of the rounding outcomes: its own logits come from one-token forwards over a cache
that one-token forwards built.

The bound (:func:`rounding_bound`). The target's logit for a token is ``z = h . w``, a dot product of length
``d`` (the LM head's reduction size, the hidden size) whose result is stored in the logits' dtype, with unit
roundoff ``u = eps / 2``. Between two forwards of the same node:

- the stored logit is rounded once per forward: each of the top two logits moves by up to ``u |z|`` in each,
  so their gap moves by up to ``2 u (|z1| + |z2|) = eps (|z1| + |z2|)``;
- the hidden state ``h`` reaches the head rounded to the dtype after a different computation: each of its ``d``
  elements carries its own relative rounding difference of order ``u``, unrelated from element to element, so the
  difference in ``z`` is a sum of ``d`` terms ``h_i w_i u_i`` of random sign, of size about
  ``u sqrt(d) rms(h_i w_i)`` (the probabilistic rounding bound of a length-``d`` dot product). The terms' scale is
  bounded by the logit they add up to only when they share a sign; bounding ``sum |h_i w_i|`` by ``sqrt(d)``
  times ``|z|`` covers partial cancellation, giving ``u sqrt(d) |z| / sqrt(d) * sqrt(d) = u sqrt(d) |z|`` per
  logit, hence ``eps sqrt(d) max(|z1|, |z2|)`` for the gap... scaled by ``HIDDEN_ROUNDINGS``, the rounding steps
  behind ``h`` that the two computations do differently (measured, see ``benchmarks/precision_flips.py``).

A node is near-tied when its top-two gap is within that bound. In float32 the bound is about ``1e-7`` of the
logits: ties there are exact ties in practice.
"""

from __future__ import annotations

import math

import torch

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
