"""Per-step statistics of a SpecExec generation."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    """One draft-tree / target-forward round.

    Args:
        tree_size: Tree nodes the target scored, the root included.
        accepted: Tokens committed by the step (accepted tree tokens plus the bonus, after any stop).
        draft_forwards: Draft forward calls that grew the tree.
        draft_seconds: Wall time spent growing the tree.
        target_seconds: Wall time of the target forward.
        path_length: Tree tokens the target accepted (the walk's path below the root, before any stop).
        forecast: Tree tokens the tree's ranking expected the target to accept: the sum over its nodes of their
            estimated path acceptance probability (with ``acceptance_calibration``, what the acceptance map learnt;
            without it, the draft's path probability). Over many steps, a well-calibrated ranking forecasts about
            ``path_length``; a forecast far below it means the tree trusts the draft too little.
        near_tied: The step's greedy choices whose top two scores were within rounding of each other
            (:func:`~specexec_hf.core.precision.greedy_choice`), by index: 0 for the choice at the root (the step's
            first new token), ``i`` for the one at the ``i``-th accepted node. Such a choice could come out either
            way in a 16-bit target, between this tree forward and a one-token forward.
    """

    tree_size: int
    accepted: int
    draft_forwards: int
    draft_seconds: float
    target_seconds: float
    path_length: int = 0
    forecast: float = 0.0
    near_tied: tuple[int, ...] = ()


@dataclass
class SpecExecStats:
    """Statistics of one ``generate()`` call; pass an instance as ``specexec_stats=`` to have it filled."""

    steps: list[StepStats] = field(default_factory=list)

    @property
    def target_forwards(self) -> int:
        return len(self.steps)

    @property
    def new_tokens(self) -> int:
        return sum(step.accepted for step in self.steps)

    @property
    def draft_forwards(self) -> int:
        return sum(step.draft_forwards for step in self.steps)

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def mean_tree_size(self) -> float:
        return sum(step.tree_size for step in self.steps) / max(self.target_forwards, 1)

    @property
    def draft_seconds(self) -> float:
        return sum(step.draft_seconds for step in self.steps)

    @property
    def target_seconds(self) -> float:
        return sum(step.target_seconds for step in self.steps)

    @property
    def forecast_ratio(self) -> float:
        """The trees' forecast accepted tokens over the tokens they actually had accepted (1: calibrated)."""
        return sum(step.forecast for step in self.steps) / max(sum(step.path_length for step in self.steps), 1)

    @property
    def near_ties(self) -> int:
        """Greedy choices the walks made at near-ties: where a 16-bit target's rounding could pick either token."""
        return sum(len(step.near_tied) for step in self.steps)

    @property
    def near_tied_positions(self) -> list[int]:
        """The new tokens (0: the first generated) whose greedy choice was near-tied, in order.

        Before the first of them, every choice had a margin wider than rounding can close, so those tokens are the
        ones plain greedy decoding in the same dtype produces (as far as :func:`~specexec_hf.core.precision.
        rounding_bound` holds; ``benchmarks/precision_flips.py`` checks it). From it on, the two may differ.
        """
        positions: list[int] = []
        start = 0
        for step in self.steps:
            positions.extend(start + index for index in step.near_tied if index < step.accepted)
            start += step.accepted
        return positions

    def summary(self) -> dict[str, float]:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "mean_tree_size": self.mean_tree_size,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "forecast_ratio": self.forecast_ratio,
            "near_ties": self.near_ties,
        }

    def __repr__(self) -> str:
        """A summary, not every step (those stay in ``steps``)."""
        return (
            f"SpecExecStats(steps={self.target_forwards}, new_tokens={self.new_tokens}, "
            f"tokens_per_target_forward={self.tokens_per_target_forward:.2f}, draft_forwards={self.draft_forwards}, "
            f"mean_tree_size={self.mean_tree_size:.1f}, near_ties={self.near_ties}, "
            f"draft_seconds={self.draft_seconds:.3f}, "
            f"target_seconds={self.target_seconds:.3f})"
        )
