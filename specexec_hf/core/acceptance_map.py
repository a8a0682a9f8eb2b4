"""How likely the target is to accept a draft candidate, learnt from the verification walks as decoding goes.

SpecExec keeps the tree nodes whose whole path is likeliest to be accepted. Ranking by the draft's own
probability ``p`` assumes the target accepts a candidate with probability ``p``; a confident, correct draft is
accepted far more often than that (under greedy verification a candidate is accepted whenever it is the target's
argmax), a poor one less. Every walk shows, at each node it visits, which of that node's draft candidates the
target picked, so the map ``p -> P(accepted)`` can be estimated online:

- candidates are grouped by their rank among their siblings (the draft's top token, the second, the third, the
  rest: under greedy verification the top token is accepted far more often than a sibling of equal ``p``) and
  binned by ``log p``; each bin counts acceptances over trials, starting from a prior worth ``prior_strength``
  trials;
- the prior is a smooth curve per rank group, ``P(accepted) = sigmoid(a + b logit p)`` (Platt scaling), fitted to
  all of the group's evidence and itself held near the identity (``a = 0, b = 1``: ``P(accepted) = p``, the
  draft's own ranking until evidence arrives) by a Gaussian prior: loose on ``a`` (the draft's odds may be off by
  a factor of several), tight on the slope ``b`` (so that evidence at high ``p`` moves the odds everywhere rather
  than steepening the curve). A handful of walks moves the whole curve (a draft whose top token always wins lifts
  every bin of rank 0 at once, including the bins no walk has visited yet), while each bin's own counts take over
  where they are plentiful;
- the bins' estimates are made non-decreasing in ``p`` (pool-adjacent-violators, weighted by trials), since a
  likelier candidate is never less likely to be accepted;
- a candidate's score is ``log P(accepted)``, interpolated linearly in ``log p`` between bin centres, plus a small
  multiple of ``log p`` so that candidates in one flat stretch keep the draft's order.

A node's cumulative score is then the estimated log-probability that its whole path is accepted (acceptances
treated as independent). Only the tree changes: the target verifies whatever the tree holds.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Bin edges in draft probability; bins are [edge_i, edge_{i+1}).
DEFAULT_EDGES = (0.0, 1e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
TIE_BREAK = 1e-3  # weight of log p added to the score, far below any estimated difference between bins
RANK_GROUPS = 4  # ranks 0, 1, 2 and 3+ are estimated separately
PROB_FLOOR = 1e-9  # keeps logit p finite at the bin centres
ODDS_PRIOR_SD = 2.0  # prior standard deviation of a, the log of the factor on the draft's odds
SLOPE_PRIOR_SD = 0.25  # prior standard deviation of the slope b around 1
NEWTON_STEPS = 25  # of the penalised Platt fit: 2 parameters, converged well before this


class AcceptanceMap:
    """Online estimate of ``P(target accepts a candidate | its draft probability)``.

    Args:
        prior_strength: Trials the smooth prior curve is worth in each bin.
        edges: Bin edges in draft probability, from 0 to 1.
    """

    def __init__(self, prior_strength: float = 4.0, edges: tuple[float, ...] = DEFAULT_EDGES):
        if prior_strength <= 0:
            raise ValueError(f"prior_strength must be positive, got {prior_strength!r}.")
        if edges[0] != 0.0 or edges[-1] != 1.0 or list(edges) != sorted(set(edges)):
            raise ValueError(f"edges must rise strictly from 0 to 1, got {edges!r}.")
        self._edges = tuple(edges)
        self._log_edges = torch.log(torch.tensor(edges[1:-1], dtype=torch.float64))
        lower, upper = torch.tensor(edges[:-1], dtype=torch.float64), torch.tensor(edges[1:], dtype=torch.float64)
        self._centres = torch.where(lower > 0, (lower * upper).sqrt(), upper / 10)  # geometric, or a decade below
        self._prior_strength = prior_strength
        self._curve_penalty = torch.diag(torch.tensor([ODDS_PRIOR_SD, SLOPE_PRIOR_SD], dtype=torch.float64) ** -2)
        logits = torch.logit(self._centres.clamp(PROB_FLOOR, 1 - PROB_FLOOR))
        self._features = torch.stack([torch.ones_like(logits), logits], dim=-1)  # [bins, 2]: (1, logit p)
        self.accepted = torch.zeros(RANK_GROUPS, self._centres.numel(), dtype=torch.float64)
        self.trials = torch.zeros_like(self.accepted)
        # Per device: the curves' log estimates per rank group and bin, and the bin centres' log p (None: stale).
        self._curves: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def state(self) -> dict[str, Any]:
        """The map as plain JSON-able data: its settings and, per rank group and bin, the counts it has learnt from.

        ``fitted`` (per rank group, each bin's current estimate) is a summary for reading only:
        :meth:`from_state` recomputes it from the counts.
        """
        return {
            "prior_strength": self._prior_strength,
            "edges": list(self._edges),
            "accepted": self.accepted.tolist(),
            "trials": self.trials.tolist(),
            "fitted": [self.acceptance(rank).tolist() for rank in range(RANK_GROUPS)],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> AcceptanceMap:
        """A new map holding what :meth:`state` recorded; it goes on learning independently of the original.

        Args:
            state: A dict from :meth:`state` (e.g. read back from JSON).
        """
        missing = [key for key in ("prior_strength", "edges", "accepted", "trials") if key not in state]
        if missing:
            raise ValueError(f"Acceptance map state lacks {missing}: pass a dict made by AcceptanceMap.state().")
        acceptance_map = cls(float(state["prior_strength"]), tuple(float(edge) for edge in state["edges"]))
        accepted = torch.tensor(state["accepted"], dtype=torch.float64)
        trials = torch.tensor(state["trials"], dtype=torch.float64)
        shape = tuple(acceptance_map.trials.shape)
        if tuple(accepted.shape) != shape or tuple(trials.shape) != shape:
            raise ValueError(
                f"Acceptance map counts must be [rank groups, bins] = {list(shape)} for these edges, got accepted "
                f"{list(accepted.shape)} and trials {list(trials.shape)}: the state was made with other settings."
            )
        if not bool(((accepted >= 0) & (accepted <= trials)).all()):
            raise ValueError("Acceptance map counts must satisfy 0 <= accepted <= trials in every bin.")
        acceptance_map.accepted, acceptance_map.trials = accepted, trials
        return acceptance_map

    def _cells(self, logprobs: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        bins = torch.bucketize(logprobs.detach().double().cpu(), self._log_edges, right=True)
        return ranks.cpu().clamp(max=RANK_GROUPS - 1) * self._centres.numel() + bins

    def observe(self, logprobs: torch.Tensor, ranks: torch.Tensor, accepted: torch.Tensor) -> None:
        """Counts candidates with draft log-probabilities ``logprobs`` and sibling ``ranks`` (0: the draft's top
        token), and whether the target ``accepted`` each (bool), or the probability that it would (float: a sampling
        target's probability of drawing the candidate, the same expectation with less noise)."""
        cells = self._cells(logprobs, ranks).flatten()
        size = self.trials.numel()
        self.trials += torch.bincount(cells, minlength=size).double().view_as(self.trials)
        self.accepted += torch.bincount(cells, weights=accepted.double().cpu().flatten(), minlength=size).view_as(
            self.accepted
        )
        self._curves = None

    def acceptance(self, rank: int = 0) -> torch.Tensor:
        """Per bin, the estimated acceptance probability of a candidate of sibling rank ``rank`` (non-decreasing)."""
        group = min(rank, RANK_GROUPS - 1)
        prior = self.prior_curve(group)
        weights = self._prior_strength + self.trials[group]
        rates = ((self._prior_strength * prior + self.accepted[group]) / weights).tolist()
        # Pool adjacent violators: merge neighbouring bins until the rates never fall.
        blocks: list[tuple[float, float, int]] = []  # (rate, weight, bin count)
        for rate, weight in zip(rates, weights.tolist()):
            blocks.append((rate, weight, 1))
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                rate2, weight2, count2 = blocks.pop()
                rate1, weight1, count1 = blocks.pop()
                total = weight1 + weight2
                blocks.append(((rate1 * weight1 + rate2 * weight2) / total, total, count1 + count2))
        return torch.tensor([rate for rate, _, count in blocks for _ in range(count)], dtype=torch.float64)

    def prior_curve(self, rank: int = 0) -> torch.Tensor:
        """Per bin, the smooth prior ``sigmoid(a + b logit p)`` for sibling rank ``rank``: the maximum a posteriori
        Platt fit to the rank group's counts, with a Gaussian prior centred on the identity ``(a, b) = (0, 1)``."""
        group = min(rank, RANK_GROUPS - 1)
        features, trials, accepted = self._features, self.trials[group], self.accepted[group]
        identity = torch.tensor([0.0, 1.0], dtype=torch.float64)
        penalty = self._curve_penalty
        params = identity.clone()
        if trials.sum() > 0:
            for _ in range(NEWTON_STEPS):  # the penalised log-likelihood is strictly concave: Newton converges
                rates = torch.sigmoid(features @ params)
                gradient = features.T @ (accepted - trials * rates) - penalty @ (params - identity)
                information = (features.T * (trials * rates * (1 - rates))) @ features + penalty
                step = torch.linalg.solve(information, gradient)
                params = params + step / max(1.0, float(step.abs().max()) / 4)  # damped while far from the optimum
                if float(step.abs().max()) < 1e-9:
                    break
        return torch.sigmoid(features @ params)

    def __call__(self, logprobs: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        """Ranking scores for candidates with draft log-probabilities ``logprobs`` and sibling ``ranks`` (same
        shape; the scores take ``logprobs``' dtype and device).

        Computed where ``logprobs`` live: the curves are copied to that device once after each change (one copy per
        verification step), so ranking the candidates of a draft forward never waits for the device.
        """
        device = logprobs.device
        if self._curves is None:
            curves = torch.log(torch.stack([self.acceptance(rank) for rank in range(RANK_GROUPS)]).clamp(1e-12))
            self._curves = {"cpu": (curves, torch.log(self._centres))}
        if str(device) not in self._curves:
            curves, x = self._curves["cpu"]
            self._curves[str(device)] = (curves.to(device), x.to(device))
        curves, x = self._curves[str(device)]
        logprobs64 = logprobs.double()
        values = logprobs64.clamp(min=x[0], max=x[-1])
        right = torch.searchsorted(x, values.contiguous(), right=True).clamp(1, x.numel() - 1)
        left = right - 1
        fraction = (values - x[left]) / (x[right] - x[left])
        curve = curves[ranks.to(device).clamp(max=RANK_GROUPS - 1)]
        low, high = curve.gather(-1, left[..., None])[..., 0], curve.gather(-1, right[..., None])[..., 0]
        scores = low + fraction * (high - low) + TIE_BREAK * logprobs64
        return torch.where(torch.isfinite(logprobs), scores, -math.inf).to(logprobs)
