"""SpecExec knobs, settable from ``generate()`` keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Literal

DRAFT_AHEAD_FACTOR = 4
"""With ``draft_ahead``, how many times the budget the search grown on during verification may keep."""


@dataclass(frozen=True)
class SpecExecConfig:
    """How the draft grows the token tree that the target verifies in one forward.

    Args:
        budget: Most draft tokens in the tree (the root, the last committed token, comes on top). The target
            scores ``budget + 1`` tokens per forward, so pick it by how the target's forward time grows with
            tokens: small (16-64) for an in-memory target on a CPU, large (256-1024) for an offloaded one.
            ``"auto"`` lets ``generate()`` pick it before every step from the target's measured forward times
            and the running acceptance profile (see :mod:`specexec_hf.hf.autobudget`).
        max_depth: Deepest level a tree node may reach, so at most ``max_depth + 1`` tokens per target forward.
            ``None``: no cap beyond the budget (a path holds at most ``budget`` nodes) and the tokens left, so a
            confident draft can grow one deep chain.
        max_branch: Children considered per expanded node (the draft's top-k tokens there).
        expand_per_forward: How many frontier nodes one draft forward expands, all in one batched call.
        max_draft_forwards: Cap on draft forwards per tree after the first; ``None`` runs until no frontier node
            can still improve the tree (which takes at most ``budget`` expansions) or ``min_draft_gain`` stops it.
        min_draft_gain: SpecExec's best-first search stops growing a tree once a draft forward raised its forecast
            (the expected accepted tokens, the sum of the kept nodes' estimated acceptance) by less than this share
            of the tokens the step is forecast to yield (``1 + forecast``). The search's last forwards mostly
            reshuffle low-value leaves: on the default pair (10 held-out prompts, in memory) 0.02-0.04 cut the
            draft's time per tree by 25-35% at budgets 16-128 for 0-2% fewer tokens per step, and a step's draft
            time is time the target's weights are not streaming. ``0`` grows until the tree cannot improve.
        draft_temperature: Temperature of the draft's log-probs that rank the tree. ``None`` follows the
            generation temperature when sampling and, for greedy decoding, uses the draft's calibrated greedy
            temperature (1.0 for an uncalibrated draft). It shapes the tree only: the output is the target's.
        context_match_weights: Weights of next-token guesses copied from earlier in the sequence, one per match
            length 1, 2, ... (see :mod:`specexec_hf.core.context_match`), each in ``[0, 1)``. ``None`` uses the
            draft's calibrated weights for greedy decoding and none when sampling; ``()`` turns context matching off.
            Like the temperature, it shapes the tree only.
        acceptance_calibration: Rank the tree by the estimated probability that the target accepts each path,
            learnt from the verification walks as decoding goes (:mod:`specexec_hf.core.acceptance_map`), instead of
            by the draft's probability alone. It shapes the tree only.
        sampled_children: When the target samples, keep each node's top draft token as its first child but draw
            the others from the draft's distribution (without replacement), verified by recursive rejection sampling,
            which accepts a drawn child up to ``sum min(p, q)`` of the time. ``False`` (the default; the two were
            even on the measured pair) takes the draft's top tokens throughout, accepted only when the target's own
            draw hits one. Either way the output follows the target's distribution exactly. Greedy decoding always
            takes the top tokens.
        draft_ahead: While the target verifies a tree (in a worker thread), the draft grows the same search on,
            best first, up to ``DRAFT_AHEAD_FACTOR`` times the budget: the subtrees under the likeliest accepted
            paths. When the walk ends at a node the draft has already expanded, the next tree starts from that
            node's subtree (its draft KV kept), so the next step drafts less or not at all. It pays where the
            target's forward leaves the processor idle (weights streamed from disk or to a GPU); on a target in
            memory on a CPU both compete for the same cores. It shapes the trees only, never the output. Not with
            ``sampled_children`` or a tree policy other than SpecExec's best-first search.
    """

    budget: int | Literal["auto"] = 64
    max_depth: int | None = None
    max_branch: int = 16
    expand_per_forward: int = 16
    max_draft_forwards: int | None = None
    min_draft_gain: float = 0.03
    draft_temperature: float | None = None
    context_match_weights: tuple[float, ...] | None = None
    acceptance_calibration: bool = True
    sampled_children: bool = False
    draft_ahead: bool = False

    def __post_init__(self) -> None:
        for name in ("budget", "max_depth", "max_branch", "expand_per_forward"):
            value = getattr(self, name)
            if (name, value) in (("budget", "auto"), ("max_depth", None)):  # "auto": resolved before every step
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SpecExecConfig.{name} must be a positive integer, got {value!r}.")
        if self.max_draft_forwards is not None and (
            not isinstance(self.max_draft_forwards, int) or self.max_draft_forwards < 0
        ):
            raise ValueError(
                f"SpecExecConfig.max_draft_forwards must be None or a non-negative integer, got "
                f"{self.max_draft_forwards!r}."
            )
        gain = self.min_draft_gain
        if not isinstance(gain, (int, float)) or isinstance(gain, bool) or not 0 <= gain < 1:
            raise ValueError(
                "SpecExecConfig.min_draft_gain must be a number in [0, 1) (0 grows every tree until it cannot "
                f"improve), got {gain!r}."
            )
        for name in ("acceptance_calibration", "sampled_children", "draft_ahead"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SpecExecConfig.{name} must be True or False, got {getattr(self, name)!r}.")
        if self.draft_temperature is not None and not self.draft_temperature > 0:
            raise ValueError(
                f"SpecExecConfig.draft_temperature must be None or > 0, got {self.draft_temperature!r}."
            )
        if self.context_match_weights is not None:
            weights = self.context_match_weights
            if not isinstance(weights, (tuple, list)) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w < 1 for w in weights
            ):
                raise ValueError(
                    "SpecExecConfig.context_match_weights must be None or a sequence of numbers in [0, 1) (one per "
                    f"match length; () turns context matching off), got {weights!r}."
                )
            object.__setattr__(self, "context_match_weights", tuple(float(w) for w in weights))

    @property
    def resolved_budget(self) -> int:
        """``budget`` as a number: a tree search starts only once ``"auto"`` was resolved for its step."""
        if isinstance(self.budget, int):
            return self.budget
        raise ValueError("SpecExecConfig.budget='auto' reached a tree search: resolve it to a number per step first.")

    def depth_limit(self, max_depth: int | None = None) -> int:
        """``max_depth``, tightened by a per-tree limit (e.g. the tokens still allowed, minus the bonus token)."""
        limits = [limit for limit in (self.max_depth, max_depth) if limit is not None]
        if isinstance(self.budget, int):
            limits.append(self.budget)
        return min(limits, default=2**31)

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def updated(self, **overrides: Any) -> SpecExecConfig:
        """A copy with the given knobs replaced; ``None`` values keep the current setting."""
        unknown = set(overrides) - set(self.knob_names())
        if unknown:
            raise TypeError(f"Unknown SpecExec knob(s) {sorted(unknown)}; known: {list(self.knob_names())}.")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})
