"""``step_budget="auto"``: a step's node total chosen from the target forward's cost as the engine measures it.

What a tree step costs depends on where the target's weights are (in memory its forward grows with the tokens fed;
streamed from disk it is about flat up to some feed, then grows) and on the machine, so it is learnt from the
engine's own steps rather than timed in a warm-up: forwards over chosen feeds are only the scheduler's to make, and
what a read costs moves with the page cache and other jobs. Every step's forward (from the end of
``_prepare_inputs`` to the start of ``_sample``: vLLM's CPU engine computes synchronously) is timed with the tokens
it fed (tree nodes, roots, prefill chunks alike); feeds are kept in buckets a quarter doubling wide, each a moving
average (a new forward weighing ``RECENT_WEIGHT``, as ``budget="auto"`` does in ``generate()``), read as a
:class:`~specexec_hf.hf.autobudget.ForwardProfile` (linear between buckets and beyond the largest, never falling).
The rest of a step (the walk, the draft's trees) is timed from the start of ``_sample`` to the end of the proposer's
``propose``.

The first steps sweep the feed: one node per running request, then twice the last total each step, until a
forward takes ``SWEEP_RISE`` times the sweep's first (the flat region ended) or the trees hold no more, so the
curve is measured on both sides of its knee within a few steps, cheap ones first. (Without it, a curve known only
at the largest feed reads flat everywhere, and once a second feed is timed, linear between two distant feeds
overrates the cost of everything between them: in a simulation of eight requests the total sank to 23 under a
forward flat to 65 tokens.) After the sweep each step's trees are cut to the total of
:func:`~specexec_hf.core.batch_budget.step_total` over their nodes' calibrated reach probabilities; as
``budget="auto"`` probes its neighbours, every ``PROBE_EVERY``-th step the best total among a half doubling above
or below it (in turn) runs instead, which keeps the feeds near the choice measured as the disk's speed moves.
Each request's tree grows to :data:`~specexec_hf.core.batch_budget.TREE_HEADROOM` times its even share of the
total the step is expected to keep (the last step's, twice it during the sweep; at most the ``budget`` setting):
enough to feed the next total even when the best nodes gather in a few trees, and room for the total to grow,
without drafting every tree to its cap for a batch that keeps few of its nodes (``generate()``'s batches share the
rule: :func:`~specexec_hf.core.batch_budget.row_tree_budget`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from ..core.batch_budget import row_tree_budget, step_total
from ..hf.autobudget import PROBE_EVERY, RECENT_WEIGHT, ForwardProfile

BUCKETS_PER_DOUBLING = 4
PROBE_FACTOR = math.sqrt(2.0)
# The first steps' sweep stops at the feed whose forward took this many times the sweep's first one: the flat region
# has ended there (the linear reading between measured feeds takes over).
SWEEP_RISE = 1.5


class StepCosts:
    """The target forward's seconds by tokens fed and the rest of a step's seconds, learnt from the engine's steps,
    and the node totals they make best.

    Args:
        clock: Seconds from an arbitrary origin (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._seconds: dict[int, float] = {}  # per bucket, the moving forward seconds
        self._tokens: dict[int, float] = {}  # ... and the moving tokens fed, where the bucket's point sits
        self._rest_seconds = 0.0
        self._forward: tuple[int, float] | None = None  # the forward under way: tokens fed, started at
        self._sampled_at: float | None = None
        self._choices = 0
        self.last_total: int | None = None
        # The sweep of the first steps: its first forward's seconds, whether the next forward is one of its steps,
        # and whether it is over.
        self._sweep_base: float | None = None
        self._sweep_step = False
        self.swept = False

    def forward_started(self, tokens: int) -> None:
        """The runner prepared a step feeding ``tokens`` tokens; its forward starts now."""
        self._forward = (tokens, self.clock())

    def forward_finished(self) -> None:
        """The step's forward is done (its sampling starts): records its seconds for its feed."""
        if self._forward is None:
            return
        tokens, started = self._forward
        self._sampled_at = self.clock()
        seconds = self._sampled_at - started
        self.observe_forward(tokens, seconds)
        self._forward = None
        if self._sweep_step:
            self._sweep_step = False
            if self._sweep_base is None:
                self._sweep_base = seconds
            elif seconds > SWEEP_RISE * self._sweep_base:
                self.swept = True

    def proposed(self) -> None:
        """The proposer's drafts for the next step are ready: the step's rest (walk and drafting) is done."""
        if self._sampled_at is not None:
            self._rest_seconds += RECENT_WEIGHT * (self.clock() - self._sampled_at - self._rest_seconds)
            self._sampled_at = None

    def observe_forward(self, tokens: int, seconds: float) -> None:
        """Adds one forward over ``tokens`` tokens that took ``seconds``."""
        if tokens < 1:
            return
        bucket = round(BUCKETS_PER_DOUBLING * math.log2(tokens))
        if bucket not in self._seconds:
            self._seconds[bucket], self._tokens[bucket] = seconds, float(tokens)
        else:
            self._seconds[bucket] += RECENT_WEIGHT * (seconds - self._seconds[bucket])
            self._tokens[bucket] += RECENT_WEIGHT * (tokens - self._tokens[bucket])

    def forward_curve(self) -> Callable[[int], float]:
        """Modelled forward seconds by tokens fed: linear between the measured buckets and beyond the largest,
        never falling, and below the smallest its seconds (1 s for every feed before any forward was measured)."""
        if not self._seconds:
            return lambda tokens: 1.0
        profile = ForwardProfile({round(self._tokens[b]): self._seconds[b] for b in self._seconds})
        smallest = min(profile.seconds)
        return lambda tokens: profile(max(tokens, smallest))

    def measured(self) -> dict[int, float]:
        """``{tokens fed: forward seconds}`` per measured bucket, for logs and benchmarks."""
        return {round(self._tokens[b]): round(self._seconds[b], 4) for b in sorted(self._seconds)}

    def rest_seconds(self) -> float:
        """The moving seconds of a step beside its forward."""
        return self._rest_seconds

    def choose(self, node_scores: Sequence[torch.Tensor]) -> int:
        """The node total for this step's trees (see the module docstring): during the first steps' sweep, twice
        the last (one node per row first); then the best for the learnt costs, with a neighbour every
        ``PROBE_EVERY``-th step.

        Args:
            node_scores: Per running row, its tree's non-root nodes' log reach probabilities (empty: no tree).
        """
        curve = self.forward_curve()
        if not self.swept:
            wanted = len(node_scores) if self.last_total is None else 2 * self.last_total
            total = step_total(node_scores, curve, self._rest_seconds, totals=[wanted])
            self.swept = total < wanted  # the trees hold no more: nothing larger to measure yet
            self._sweep_step = not self.swept
        else:
            total = step_total(node_scores, curve, self._rest_seconds)
            self._choices += 1
            if self._choices % PROBE_EVERY == 0:
                factor = PROBE_FACTOR if (self._choices // PROBE_EVERY) % 2 else 1 / PROBE_FACTOR
                total = step_total(node_scores, curve, self._rest_seconds, totals=[round(total * factor)])
        self.last_total = total
        return total

    def tree_budget(self, rows: int, cap: int) -> int:
        """Nodes each of ``rows`` requests' trees grows to this step: :data:`TREE_HEADROOM` times its even share of the
        total this step is expected to keep (the last step's, twice it during the sweep), between 1 and ``cap``
        (``cap`` before any step)."""
        if self.last_total is None:
            return row_tree_budget(rows, None, cap)
        return row_tree_budget(rows, self.last_total if self.swept else 2 * self.last_total, cap)
