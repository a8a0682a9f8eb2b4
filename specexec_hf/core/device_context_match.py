"""Context matching on the device: :mod:`.context_match`'s guesses computed with tensors, no host read.

:class:`~.context_match.ContextIndex` looks each expanded node's context up in a host dictionary, so it reads the
node's path from the device on every draft forward. :class:`DeviceContextMatch` finds the same longest match by
comparing the node's last ``k`` context tokens with every ``k``-token window of the history, and mixes the same
guesses into the draft's log-probs as :func:`~.context_match.mix_context_guesses` (up to the last bit of float32
rounding). Its work per forward is ``nodes x history x max_order`` comparisons and a ``nodes x vocab`` count, all of
fixed shape, which is what a tree grown without host reads (:mod:`.round_search`) needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .tree import TokenTree
from .uploads import upload

NO_TOKEN = -1
"""Stands for a context token before the start of the history: no history token equals it."""
NO_WINDOW = -2
"""Pads the history before its start, so that no window reaching there matches a context (whose padding is
:data:`NO_TOKEN`)."""


class DeviceContextMatch:
    """One tree's context guesses on the device: its history, and per expanded node the longest match of its context
    and the tokens that followed it.

    Args:
        weights: ``weights[k - 1]``, the guess weight for a longest match of ``k`` tokens, each in ``[0, 1)``.
        device: The draft's device.
    """

    def __init__(self, weights: Sequence[float], device: torch.device | str | None = None):
        if not weights or any(not 0 <= weight < 1 for weight in weights):
            raise ValueError(f"Context-match weights must be a non-empty list of values in [0, 1), got {weights!r}.")
        self.max_order = len(weights)
        # Indexed by match length: no match (0) weighs nothing.
        self.weights = torch.tensor([0.0, *weights], dtype=torch.float64, device=device)
        self.device = self.weights.device
        self.history = torch.empty(0, dtype=torch.long, device=self.device)
        self.distinct_followers = torch.empty(0, dtype=torch.long, device=self.device)
        self._columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def sync(self, history: Sequence[int]) -> None:
        """Takes the next tree's history (its last token the root), in one copy to the device."""
        distinct = sorted(set(history[1:]))
        both = upload([*history, *distinct], torch.long, self.device)
        self.history, self.distinct_followers = both[: len(history)], both[len(history) :]
        self._columns = None

    def contexts(self, pool: TokenTree, nodes: torch.Tensor) -> torch.Tensor:
        """``[nodes, max_order]`` each node's last ``max_order`` context tokens (the history, then the node's path
        below the root), oldest first, :data:`NO_TOKEN` before the history's start."""
        history = torch.cat([self.history.new_full((self.max_order,), NO_TOKEN), self.history])
        end = history.numel() - 1
        depth, ancestor = pool.depths[nodes], nodes
        tokens = []
        for back in range(self.max_order):  # back steps before the node's own token
            from_history = history[(end - (back - depth)).clamp(0, end)]
            tokens.append(torch.where(depth > back, pool.tokens[ancestor], from_history))
            ancestor = pool.parents[ancestor].clamp(min=0)
        return torch.stack(tokens[::-1], dim=-1)

    def longest_matches(self, contexts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per context, the longest suffix (at most ``max_order`` tokens) that occurred in the history with a token
        after it, as :meth:`.ContextIndex.longest_match` finds it.

        Returns:
            ``(orders, ends)``: ``[n]`` the match length (0: none) and ``[n, len(history) - 1]`` whether the match
            ends at each history position (so that the next token followed it).
        """
        windows = self.history.numel() - 1
        padded = torch.cat([self.history.new_full((self.max_order,), NO_WINDOW), self.history[:-1]])
        matched = torch.ones(contexts.shape[0], windows, dtype=torch.bool, device=self.device)
        per_order = []
        for back in range(self.max_order):
            shifted = padded[self.max_order - back : self.max_order - back + windows]
            matched = matched & (shifted[None] == contexts[:, -1 - back, None])
            per_order.append(matched)
        by_order = torch.stack(per_order)  # [max_order, n, windows]
        found = by_order.any(-1).T  # [n, max_order]
        lengths = torch.arange(1, self.max_order + 1, device=self.device)
        orders = (found * lengths).amax(-1)
        rows = torch.arange(contexts.shape[0], device=self.device)
        ends = by_order[(orders - 1).clamp(min=0), rows] & (orders > 0)[:, None]
        return orders, ends

    def mix(
        self, logprobs: torch.Tensor, pool: TokenTree, nodes: torch.Tensor, columns: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's log-probs at ``nodes`` turned into the log of ``(1 - w_k) p + w_k * followers / total``, as
        :func:`~.context_match.mix_context_guesses` computes it.

        Args:
            logprobs: ``[nodes, vocab]`` normalized draft log-probs, or ``[nodes, columns]`` over ``columns`` only.
            pool: The search's pool.
            nodes: The expanded pool nodes.
            columns: The vocabulary ids of the log-probs' columns, ascending; ``None``: the whole vocabulary.

        Returns:
            The mixed log-probs and their columns: with ``columns``, widened by one column per distinct token of the
            history that can follow a match (``-inf`` before the mix where the draft does not score it), so that a
            guess outside the scored ones has a column of its own.
        """
        orders, ends = self.longest_matches(self.contexts(pool, nodes))
        follower_columns = self.history[1:]
        if columns is not None:
            logprobs, columns, follower_columns = self._widened(logprobs, columns)
        follower_columns = follower_columns.expand(ends.shape)
        # Only the followers' columns change beyond the row's scale: the mix is computed there, once per history
        # position (a token that followed several times is written several times, with the same value).
        counts = torch.zeros(logprobs.shape, dtype=torch.float32, device=self.device)  # small integers: exact
        counts.scatter_add_(1, follower_columns, ends.float())
        followed = counts.gather(1, follower_columns).double()
        weight = self.weights[orders][:, None]
        guesses = (weight * followed / ends.sum(-1, keepdim=True).clamp(min=1)).log().to(logprobs.dtype)
        scaled = logprobs + torch.log1p(-weight).to(logprobs.dtype)
        at_followers = scaled.gather(1, follower_columns)
        mixed = torch.where(followed > 0, torch.logaddexp(at_followers, guesses), at_followers)
        return scaled.scatter(1, follower_columns, mixed), columns

    def _widened(
        self, logprobs: torch.Tensor, columns: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``logprobs`` and ``columns`` with a column per distinct follower token (``-inf``; a token the columns
        already score keeps its own column instead), and the column of each history position's follower."""
        if self._columns is None or self._columns[0] is not columns:
            distinct = self.distinct_followers
            at = torch.searchsorted(columns, distinct).clamp(max=columns.numel() - 1)
            own = torch.arange(columns.numel(), columns.numel() + distinct.numel(), device=self.device)
            column_of = torch.where(columns[at] == distinct, at, own)
            followers = column_of[torch.searchsorted(distinct, self.history[1:])]
            self._columns = (columns, torch.cat([columns, distinct]), followers)
        _, widened, followers = self._columns
        extra = logprobs.new_full((logprobs.shape[0], self.distinct_followers.numel()), -torch.inf)
        return torch.cat([logprobs, extra], dim=-1), widened, followers
