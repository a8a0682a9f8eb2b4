"""Context matching: next-token guesses copied from earlier in the sequence, mixed into the tree's ranking.

Chat answers repeat themselves: list items, code, names from the prompt and, for small models, whole loops. Where
the last ``k`` tokens of a node's context occurred before, the tokens that followed them are good guesses of what
comes next, often better than a small draft's. At such a node the tree is ranked by the mixture

    q(x) = (1 - w_k) * p_draft(x) + w_k * count(x) / total

where ``k`` is the longest such match (at most ``len(weights)`` tokens), ``count(x)`` how often ``x`` followed it
and ``w_k`` a weight per match length, fitted like the draft temperature
(:func:`specexec_hf.tools.calibrate.fit_context_match_weights`). Only the tree changes: the target verifies it, so
outputs stay exactly the target's. Matches are looked up in the committed tokens; a node's own path can end a
match but is not searched for earlier occurrences (paths are short and rarely repeat within themselves).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Followers = dict[int, int]
"""Token -> how often it followed a matched n-gram."""


class ContextIndex:
    """What followed every n-gram (``n`` = 1 .. ``max_order``) of a token history, extended as the history grows.

    Args:
        max_order: Longest n-gram indexed, so the longest match :meth:`longest_match` can find.
    """

    def __init__(self, max_order: int):
        if max_order < 1:
            raise ValueError(f"ContextIndex needs max_order >= 1, got {max_order}.")
        self.max_order = max_order
        self.tokens: list[int] = []
        self._followers: dict[tuple[int, ...], Followers] = {}

    def sync(self, history: Sequence[int]) -> None:
        """Indexes ``history``: only its new tokens when it continues the indexed ones, else from scratch."""
        history = list(history)
        indexed = len(self.tokens)
        if history[:indexed] != self.tokens:
            self.tokens, self._followers, indexed = [], {}, 0
        for end in range(max(indexed, 1), len(history)):  # history[end] follows the n-grams ending before it
            follower = history[end]
            for order in range(1, min(self.max_order, end) + 1):
                followers = self._followers.setdefault(tuple(history[end - order : end]), {})
                followers[follower] = followers.get(follower, 0) + 1
        self.tokens = history

    def longest_match(self, context: Sequence[int]) -> tuple[int, Followers]:
        """The longest suffix of ``context`` (at most ``max_order`` tokens) that occurred in the history with a
        token after it, and the tokens that followed it; ``(0, {})`` when even its last token is new.

        The followers are a copy: the index's own counts grow as the history does, and a match kept past the next
        :meth:`sync` (an offline fit collecting every position's match) must not see the tokens that came after it.
        """
        for order in range(min(self.max_order, len(context)), 0, -1):
            followers = self._followers.get(tuple(context[-order:]))
            if followers:
                return order, dict(followers)
        return 0, {}


def mix_context_guesses(
    logprobs: torch.Tensor, matches: Sequence[tuple[int, Followers]], weights: Sequence[float]
) -> torch.Tensor:
    """Turns each row's draft log-probs into the log of the mixture ``(1 - w_k) p + w_k * followers / total``.

    Works in log space on the touched entries only: every other token just scales by ``1 - w_k``, so no row is
    exponentiated. Rows without a match (order 0) or whose weight is 0 are unchanged.

    Args:
        logprobs: ``[rows, vocab]`` normalized draft log-probs; updated in place and returned.
        matches: Per row, ``(k, followers)`` from :meth:`ContextIndex.longest_match`.
        weights: ``weights[k - 1]`` is the guess weight for a longest match of ``k`` tokens, each in ``[0, 1)``.
    """
    rows, tokens, guess_logprobs = [], [], []
    row_scale = torch.zeros(len(matches), dtype=logprobs.dtype)
    for row, (order, followers) in enumerate(matches):
        weight = weights[order - 1] if order else 0.0
        if weight == 0.0:
            continue
        row_scale[row] = math.log1p(-weight)
        total = sum(followers.values())
        for token, count in followers.items():
            rows.append(row)
            tokens.append(token)
            guess_logprobs.append(math.log(weight * count / total))
    if not rows:
        return logprobs
    logprobs += row_scale.to(logprobs.device)[:, None]
    index = (torch.tensor(rows, device=logprobs.device), torch.tensor(tokens, device=logprobs.device))
    guesses = torch.tensor(guess_logprobs, dtype=logprobs.dtype, device=logprobs.device)
    logprobs[index] = torch.logaddexp(logprobs[index], guesses)
    return logprobs
