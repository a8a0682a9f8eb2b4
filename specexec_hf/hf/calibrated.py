"""What a calibrated draft carries: its greedy tree-ranking temperature, context-match weights and acceptance map.

``specexec-hf calibrate`` (:mod:`specexec_hf.tools.calibrate`) fits them and stores them on the draft's config
(and in a shipped draft's JSON); greedy ``generate()`` calls read them here.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

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

# Per draft model, the acceptance maps of each (sampling, draft temperature, context-match weights, sampled children)
# setting.
_shared_maps: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple, AcceptanceMap]] = weakref.WeakKeyDictionary()


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


def shared_acceptance_map(
    draft: PreTrainedModel,
    sampling: bool,
    temperature: float,
    match_weights: Sequence[float],
    sampled_children: bool = False,
) -> AcceptanceMap:
    """The acceptance map learnt so far for ``draft`` at this ranking setting, shared by every caller (``generate()``
    calls, a serving engine's requests) so what one walk teaches ranks the next tree; the first call at a setting
    starts from :func:`starting_acceptance_map`.

    Args: as :func:`starting_acceptance_map`, and ``sampled_children``: whether the trees' children are drawn from
        the draft (their acceptance is that of a rejection chain, another map).
    """
    by_setting = _shared_maps.setdefault(draft, {})
    key = (sampling, float(temperature), tuple(match_weights), sampled_children)
    if key not in by_setting:
        by_setting[key] = starting_acceptance_map(draft, sampling, temperature, match_weights)
    return by_setting[key]


@contextmanager
def separate_acceptance_maps(draft: PreTrainedModel, maps: dict[tuple, AcceptanceMap]) -> Iterator[None]:
    """Within the block, ``draft``'s shared acceptance maps are ``maps``, a dict the caller keeps between blocks:
    a benchmark keeps each method's learning apart, as if each method ran alone.

    Args:
        draft: The draft model.
        maps: The maps to use and fill (empty at first), by setting, as :func:`shared_acceptance_map` keys them.
    """
    saved = _shared_maps.get(draft)
    _shared_maps[draft] = maps
    try:
        yield
    finally:
        if saved is None:
            del _shared_maps[draft]
        else:
            _shared_maps[draft] = saved
