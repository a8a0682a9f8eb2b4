"""SpecExec's settings from a ``GenerationConfig``, beside the keyword arguments of ``generate()``.

transformers keeps a ``GenerationConfig`` field it does not know as an attribute, saves it in
``generation_config.json`` and carries a model's own (``model.generation_config``) into the config each
``generate()`` call works with. So ``GenerationConfig(speculator="specexec", budget=32)``, passed to ``generate()``,
set as ``model.generation_config`` or saved beside the weights, reaches SpecExec like any field: ``speculator``
(read by :mod:`specexec_hf.patches.transformers_generate`), every :class:`~specexec_hf.core.config.SpecExecConfig`
knob, ``tree_search`` (by name), ``draft_budget``, ``step_budget`` and ``draft_graphs``. A keyword argument wins over
the config, as it does for transformers' own fields. Assisted generation's own settings, which SpecExec has no use
for, are named in a warning rather than dropped without a word.
"""

from __future__ import annotations

import warnings
from typing import Any

from transformers import GenerationConfig

from ..core.config import SpecExecConfig

SPECULATOR_FIELD = "speculator"
OTHER_SETTINGS = ("tree_search", "draft_budget", "step_budget", "draft_graphs")
"""SpecExec settings a generation config may hold besides the ``SpecExecConfig`` knobs."""
ASSISTED_SETTINGS = (
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind", "prompt_lookup_num_tokens", "max_matching_ngram_size",
    "assistant_early_exit", "assistant_ensemble_weight",
)
"""transformers' settings of its assisted generation and prompt lookup, which size and shape their draft chains."""


def specexec_settings(
    generation_config: GenerationConfig, specexec_config: SpecExecConfig | None, keywords: dict[str, Any]
) -> tuple[SpecExecConfig, dict[str, Any]]:
    """Each SpecExec setting of one ``generate()`` call: its keyword argument when given (not ``None``), else, for a
    knob, ``specexec_config``'s when that was passed, else the generation config's, else the default.

    Args:
        generation_config: The config ``generate()`` prepared (the passed one over the model's).
        specexec_config: The ``specexec_config=`` argument.
        keywords: The call's knob arguments and :data:`OTHER_SETTINGS`, by name (``None``: not given).

    Returns:
        The knobs as a validated ``SpecExecConfig``, and the other settings by name (``None``: unset).
    """
    knobs = SpecExecConfig.knob_names()
    configured = {
        name: None if specexec_config is not None and name in knobs else getattr(generation_config, name, None)
        for name in keywords
    }
    chosen = {name: configured[name] if value is None else value for name, value in keywords.items()}
    config = (specexec_config or SpecExecConfig()).updated(**{name: chosen.pop(name) for name in knobs})
    return config, chosen


def warn_unused_assisted_settings(generation_config: GenerationConfig) -> None:
    """Warns, naming them, about assisted-generation settings off their defaults, which SpecExec does not use."""
    defaults = GenerationConfig._get_default_generation_params()
    unused = [
        f"{name}={value!r}" for name in ASSISTED_SETTINGS
        if (value := getattr(generation_config, name, None)) is not None and value != defaults.get(name)
    ]
    if unused:
        warnings.warn(
            f"SpecExec does not use {', '.join(unused)}: those size and shape transformers' assisted generation "
            "and prompt lookup. SpecExec's tree is sized by budget= (and max_depth=, max_branch=, ...); drop them, or "
            "drop speculator='specexec' to run transformers' assisted generation with them.",
            UserWarning,
            stacklevel=3,
        )
