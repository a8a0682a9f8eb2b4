"""What a calibrated draft carries: its greedy tree-ranking temperature and context-match weights.

``specexec-hf calibrate`` (:mod:`specexec_hf.tools.calibrate`) fits them and stores them on the draft's config
(and in a shipped draft's JSON); greedy ``generate()`` calls read them here.
"""

from __future__ import annotations

from transformers import PreTrainedModel

GREEDY_TEMPERATURE_ATTRIBUTE = "specexec_greedy_temperature"
"""Attribute of a draft's ``config`` holding its calibrated greedy draft temperature (saved with the config)."""
CONTEXT_MATCH_ATTRIBUTE = "specexec_context_match_weights"
"""Attribute of a draft's ``config`` holding its calibrated context-match weights (greedy decoding)."""
def greedy_draft_temperature(draft: PreTrainedModel) -> float:
    """The temperature greedy decoding ranks ``draft``'s trees with: its calibrated one, else 1."""
    calibrated = getattr(draft.config, GREEDY_TEMPERATURE_ATTRIBUTE, None)
    return 1.0 if calibrated is None else float(calibrated)


def calibrated_context_match_weights(draft: PreTrainedModel) -> tuple[float, ...]:
    """The context-match weights greedy decoding uses with ``draft``: its calibrated ones, else none."""
    return tuple(getattr(draft.config, CONTEXT_MATCH_ATTRIBUTE, None) or ())
