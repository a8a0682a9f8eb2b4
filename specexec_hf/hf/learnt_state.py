"""What decoding learns as it runs, in one object a caller can hold: :class:`LearntState`.

Three things improve with every step and are worth keeping across ``generate()`` calls: the acceptance maps that
rank the draft's candidates (per ranking setting, fed by the target's walks), the per-rank acceptance vector a Sequoia
tree policy chosen by name shapes its trees from (per ranking setting, fed by the same walks), and the running
estimates ``budget="auto"`` chooses with (per target and tree knobs). A draft carries one state by default
(:func:`learnt_state_of`), so later calls with the same draft start from what earlier ones learnt; a caller that wants
learning kept apart (a benchmark measuring each method as if it ran alone, a serving engine's proposer) passes its
own, as ``generate(..., learnt_state=...)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from transformers import PreTrainedModel

from ..core.acceptance_map import AcceptanceMap
from ..core.config import SpecExecConfig
from ..core.search import SearchPolicy
from ..core.static_trees import RankAcceptance, SequoiaSearch
from .autobudget import AutoBudget, new_auto_budget
from .calibrated import starting_acceptance_map


class LearntState:
    """The acceptance maps and auto-budget estimates that one draft's decoding has learnt so far.

    Attributes:
        acceptance_maps: By ranking setting ``(sampling, draft temperature, context-match weights, sampled
            children)``, the map that ranks the draft's candidates.
        rank_acceptances: By ranking setting ``(sampling, draft temperature, context-match weights)``, the per-rank
            acceptance vector Sequoia policies chosen by name learn (:meth:`share_learning`).
        auto_budgets: By target (held weakly), then ``(draft temperature, max_depth, max_branch,
            expand_per_forward, min_draft_gain)``, the :class:`~.autobudget.AutoBudget` with its running estimates.
    """

    def __init__(self) -> None:
        self.acceptance_maps: dict[tuple, AcceptanceMap] = {}
        self.rank_acceptances: dict[tuple, RankAcceptance] = {}
        self.auto_budgets: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple, AutoBudget]] = (
            weakref.WeakKeyDictionary()
        )

    def acceptance_map(
        self,
        draft: PreTrainedModel,
        sampling: bool,
        temperature: float,
        match_weights: Sequence[float],
        sampled_children: bool = False,
    ) -> AcceptanceMap:
        """The map learnt so far at this ranking setting, shared by every caller holding this state, so what one
        walk teaches ranks the next tree; the first use of a setting starts from
        :func:`~.calibrated.starting_acceptance_map` (the draft's offline fit where it was made at this setting).

        Args:
            draft: The draft model the trees are ranked for.
            sampling: Whether the target samples.
            temperature: The draft temperature the trees are ranked at.
            match_weights: The context-match weights mixed into the draft's probabilities.
            sampled_children: Whether the trees' children are drawn from the draft (their acceptance is that of a
                rejection chain, another map).
        """
        key = (sampling, float(temperature), tuple(match_weights), sampled_children)
        if key not in self.acceptance_maps:
            self.acceptance_maps[key] = starting_acceptance_map(draft, sampling, temperature, match_weights)
        return self.acceptance_maps[key]

    def share_learning(
        self, policy: SearchPolicy, sampling: bool, temperature: float, match_weights: Sequence[float]
    ) -> None:
        """Makes ``policy``, built by name for one ``generate()`` call, learn in this state: a learning
        :class:`~specexec_hf.core.static_trees.SequoiaSearch` shapes its trees from, and adds its walks to, the
        per-rank acceptance vector kept here at this ranking setting, so the next call's policy starts from what
        this one learnt. The policy itself is the call's (the sizing ``budget="auto"`` gives it ends with the call);
        other policies learn nothing across walks and are left as they are.

        Args:
            policy: The tree policy the call built by name.
            sampling: Whether the target samples (a hit is then the target's probability of the draft's token).
            temperature: The draft temperature the trees are ranked at.
            match_weights: The context-match weights mixed into the draft's probabilities (they can reorder its
                ranks).
        """
        if isinstance(policy, SequoiaSearch) and policy.learn:
            key = (sampling, float(temperature), tuple(match_weights))
            policy.learn_into(self.rank_acceptances.setdefault(key, policy.learnt))

    def auto_budget(
        self, target: PreTrainedModel, draft: PreTrainedModel, config: SpecExecConfig, draft_temperature: float
    ) -> AutoBudget:
        """The :class:`~.autobudget.AutoBudget` ``budget="auto"`` uses with ``target``: its running estimates
        outlive a ``generate()`` call, so later calls start from what earlier ones measured.

        Args:
            target: The target model.
            draft: The draft model.
            config: ``max_depth``, ``max_branch`` (acceptance ranks tracked), ``expand_per_forward`` and
                ``min_draft_gain``.
            draft_temperature: The draft temperature the trees are ranked with (acceptance differs with it).
        """
        by_setting = self.auto_budgets.setdefault(target, {})
        key = (
            draft_temperature, config.max_depth, config.max_branch, config.expand_per_forward, config.min_draft_gain
        )
        if key not in by_setting:
            by_setting[key] = new_auto_budget(target, draft, config)
        return by_setting[key]


# The state each draft carries by default; it vanishes with the draft.
_draft_states: weakref.WeakKeyDictionary[PreTrainedModel, LearntState] = weakref.WeakKeyDictionary()


def learnt_state_of(draft: PreTrainedModel) -> LearntState:
    """The :class:`LearntState` ``draft`` carries by default: what every ``generate()`` call with it that passes no
    ``learnt_state`` learns and reads."""
    return _draft_states.setdefault(draft, LearntState())
