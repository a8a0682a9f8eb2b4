"""What a calibrated draft carries: its greedy tree-ranking temperature, context-match weights and acceptance map.

``specexec-hf calibrate`` (:mod:`specexec_hf.tools.calibrate`) fits them and stores them on the draft's config
(and in a shipped draft's JSON); greedy ``generate()`` calls read them here. What decoding learns on top of them
is a :class:`~.learnt_state.LearntState`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel

from ..core.acceptance_map import AcceptanceMap
from ..core.config import SpecExecConfig

GREEDY_TEMPERATURE_ATTRIBUTE = "specexec_greedy_temperature"
"""Attribute of a draft's ``config`` holding its calibrated greedy draft temperature (saved with the config)."""
CONTEXT_MATCH_ATTRIBUTE = "specexec_context_match_weights"
"""Attribute of a draft's ``config`` holding its calibrated context-match weights (greedy decoding)."""
ACCEPTANCE_MAP_ATTRIBUTE = "specexec_greedy_acceptance_map"
"""Attribute of a draft's ``config`` holding its offline greedy acceptance map: :meth:`AcceptanceMap.state` plus the
``temperature`` and ``context_match_weights`` it was fitted at (JSON-able, saved with the config)."""
ACCEPTANCE_MAP_KEY = "greedy_acceptance_map"
"""Key of a draft export's JSON holding the same record (written by ``specexec-hf calibrate --write``)."""

def greedy_draft_temperature(draft: PreTrainedModel) -> float:
    """The temperature greedy decoding ranks ``draft``'s trees with: its calibrated one, else 1."""
    calibrated = getattr(draft.config, GREEDY_TEMPERATURE_ATTRIBUTE, None)
    return 1.0 if calibrated is None else float(calibrated)


def calibrated_context_match_weights(draft: PreTrainedModel) -> tuple[float, ...]:
    """The context-match weights greedy decoding uses with ``draft``: its calibrated ones, else none."""
    return tuple(getattr(draft.config, CONTEXT_MATCH_ATTRIBUTE, None) or ())


def ranking_setting(
    draft: PreTrainedModel, config: SpecExecConfig, sampling: bool, sampling_temperature: float | None
) -> tuple[float, tuple[float, ...]]:
    """The draft temperature and context-match weights that rank ``draft``'s trees: the config's where set; else the
    target's sampling temperature and no context matching when it samples, and the draft's calibrated greedy ones
    (fitted on greedy answers) when it decodes greedily.

    Args:
        draft: The draft model.
        config: The SpecExec knobs (``draft_temperature``, ``context_match_weights``).
        sampling: Whether the target samples.
        sampling_temperature: The target's sampling temperature (read only when ``sampling``).
    """
    temperature = config.draft_temperature
    if temperature is None and sampling and sampling_temperature:
        temperature = float(sampling_temperature)
    if temperature is None:
        temperature = greedy_draft_temperature(draft)
    weights = config.context_match_weights
    if weights is None:
        weights = () if sampling else calibrated_context_match_weights(draft)
    return temperature, tuple(weights)


def starting_acceptance_map(
    draft: PreTrainedModel, sampling: bool, temperature: float, match_weights: Sequence[float]
) -> AcceptanceMap:
    """A new acceptance map for ranking ``draft``'s trees at this setting: a copy of the draft's offline fit when it
    was made at this very setting, else an empty map (its prior: the draft's own probabilities).

    The offline fit ranks candidates as greedy verification accepts them, at the draft temperature and context-match
    weights it was fitted with; any other setting ranks other probabilities, so it starts from the prior.

    Args:
        draft: The draft model.
        sampling: Whether the target samples (the offline fit is greedy).
        temperature: The draft temperature the trees are ranked at.
        match_weights: The context-match weights mixed into the draft's probabilities.
    """
    record = getattr(draft.config, ACCEPTANCE_MAP_ATTRIBUTE, None)
    if (
        record is None
        or sampling
        or float(record["temperature"]) != float(temperature)
        or tuple(record["context_match_weights"]) != tuple(match_weights)
    ):
        return AcceptanceMap()
    return AcceptanceMap.from_state(record)
