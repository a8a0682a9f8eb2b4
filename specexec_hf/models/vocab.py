"""A draft LM head over a subset of the vocabulary.

A small draft spends most of its forward in the LM head (SmolLM2's 49,152 x 576 head is as large as 8 of its
decoder layers). Tokens the target almost never produces are not worth proposing, so the draft can score only
the most frequent ones and report every other token as impossible (``-inf``): the tree never proposes them, and
the target's bonus token still produces them when they come. Outputs stay exactly the target's; only the draft's
cost and reach change.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PreTrainedModel

from ..core.products import head_product

_COMPACT = threading.local()  # .heads: ids of the heads returning compact scores in this thread


class SubsetLMHead(nn.Module):
    """``hidden -> logits`` over the full vocabulary, computed only for ``token_ids`` (``-inf`` elsewhere).

    Args:
        weight: ``[vocab_size, hidden]`` the full output embedding; only the subset's rows are kept.
        token_ids: Vocabulary ids the head scores.
    """

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor):
        super().__init__()
        token_ids = torch.unique(token_ids.long().to(weight.device))  # sorted
        if token_ids.numel() == 0:
            raise ValueError("A subset head needs at least one token id, got none.")
        if int(token_ids[0]) < 0 or int(token_ids[-1]) >= weight.shape[0]:
            raise ValueError(
                f"A subset head needs token ids in [0, {weight.shape[0]}), got ids ranging "
                f"{int(token_ids[0])}..{int(token_ids[-1])}."
            )
        self.out_features = weight.shape[0]  # as nn.Linear names its output width
        self.register_buffer("token_ids", token_ids)
        self.weight = nn.Parameter(weight.detach()[token_ids].clone(), requires_grad=False)

    @contextmanager
    def compact_scores(self) -> Iterator[torch.Tensor]:
        """Within it, in this thread only, the head returns just its scored columns, ``[..., len(token_ids)]``,
        and it yields their vocabulary ids (ascending): a tree's ranking then skips the ``-inf`` columns, which a
        full-vocabulary row spends most of its log-softmax and top-k on (``hf.draft_cache.scored_columns``)."""
        heads = _COMPACT.__dict__.setdefault("heads", set())
        outermost = id(self) not in heads
        heads.add(id(self))
        try:
            yield self.token_ids
        finally:
            if outermost:
                heads.discard(id(self))

    def scores(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, hidden] -> [n, len(token_ids)]``: the scored columns only."""
        return head_product(rows, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = self.scores(hidden.reshape(-1, hidden.shape[-1])).reshape(*hidden.shape[:-1], -1)
        if id(self) in getattr(_COMPACT, "heads", ()):
            return scores
        logits = scores.new_full((*scores.shape[:-1], self.out_features), float("-inf"))
        return logits.index_copy_(-1, self.token_ids, scores)

    def extra_repr(self) -> str:
        return f"scores {self.token_ids.numel()} of {self.out_features} tokens"


def restrict_draft_vocabulary(draft: PreTrainedModel, token_ids: torch.Tensor) -> PreTrainedModel:
    """Makes ``draft`` score only ``token_ids`` (in place; its input embedding is untouched).

    Args:
        draft: A causal LM whose output embedding is a plain ``[vocab, hidden]`` projection without bias.
        token_ids: The tokens it may still propose, e.g. :func:`frequent_tokens` of the target's outputs.

    Returns:
        ``draft``, whose logits keep the full vocabulary width with ``-inf`` outside ``token_ids``.
    """
    head = draft.get_output_embeddings()
    if isinstance(head, SubsetLMHead):
        raise ValueError("This draft's head is already restricted; restrict the original full-vocabulary draft.")
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(
            f"restrict_draft_vocabulary needs a bias-free linear LM head, found {type(head).__name__}; "
            "this draft cannot be restricted."
        )
    draft.config.tie_word_embeddings = False  # the subset head must never be re-tied to the full embedding
    draft.set_output_embeddings(SubsetLMHead(head.weight, token_ids))
    return draft


def frequent_tokens(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids (ascending), ties to the lower id.

    Args:
        token_counts: ``[vocab_size]`` how often each token occurred (e.g. in the target's own generations).
        size: How many ids to keep.
    """
    if not 0 < size <= token_counts.numel():
        raise ValueError(f"A draft vocabulary of {size} tokens is outside 1..{token_counts.numel()}.")
    order = torch.argsort(-token_counts.double(), stable=True)
    return order[:size].sort().values
