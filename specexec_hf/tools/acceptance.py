"""Scoring a target's continuations with a draft: the per-rank acceptance vector Sequoia-style trees need."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel


@torch.no_grad()
def continuation_logits(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    sequences: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence, the target's and the draft's float logits at the positions that predict its continuation.

    Args:
        target: The target model.
        draft: The draft model.
        sequences: ``[L]`` token ids, prompt then continuation.
        prompt_lengths: Prompt length of each sequence; the logits start at the position predicting token
            ``prompt_length``.
    """
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"Got {len(sequences)} sequences but {len(prompt_lengths)} prompt lengths.")
    for sequence, prompt_length in zip(sequences, prompt_lengths):
        ids = sequence.reshape(1, -1)
        target_logits = target(ids.to(target.device)).logits[0, prompt_length - 1 : -1].float()
        draft_logits = draft(ids.to(draft.device)).logits[0, prompt_length - 1 : -1].float()
        yield target_logits, draft_logits.to(target_logits.device)


@torch.no_grad()
def measure_acceptance(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    sequences: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    ranks: int,
    temperature: float = 0.0,
    top_p: float | None = None,
) -> list[float]:
    """Sequoia's acceptance vector: how likely the target's next token is the draft's rank-r token.

    Both models score each sequence in one forward; at every generated position the target's probability of
    the draft's rank-r token is averaged (a one-hot argmax when ``temperature`` is 0).

    Args:
        target: The target model.
        draft: The draft model.
        sequences: ``[L]`` token ids, prompt then the target's continuation.
        prompt_lengths: Prompt length of each sequence; positions before it are not counted.
        ranks: Length of the returned vector.
        temperature: Target sampling temperature (0: greedy).
        top_p: Nucleus threshold applied to the target's distribution when sampling.
    """
    totals = torch.zeros(ranks, dtype=torch.float64)
    positions = 0
    for target_logits, draft_logits in continuation_logits(target, draft, sequences, prompt_lengths):
        if temperature > 0:
            probs = _top_p(torch.softmax(target_logits / temperature, dim=-1), top_p)
        else:
            probs = torch.nn.functional.one_hot(target_logits.argmax(-1), target_logits.shape[-1]).float()
        draft_top = draft_logits.topk(ranks, dim=-1).indices.to(probs.device)
        totals += probs.gather(-1, draft_top).sum(0).double().cpu()
        positions += probs.shape[0]
    return (totals / max(positions, 1)).tolist()


def _top_p(probs: torch.Tensor, top_p: float | None) -> torch.Tensor:
    """Renormalised nucleus of each row of ``probs`` (the smallest set of top tokens holding ``top_p``)."""
    if top_p is None or top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # tokens whose predecessors already hold top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0)
    nucleus = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return nucleus / nucleus.sum(-1, keepdim=True)
