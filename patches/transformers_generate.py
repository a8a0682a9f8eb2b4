"""Adds ``speculator="specexec"`` to transformers' ``GenerationMixin.generate``.

Two wrappers, both reverted together:

- ``generate``: without a speculator it calls the original untouched (assisted generation and everything
  else keep working); with ``speculator="specexec"`` it routes the call through the original ``generate`` with
  SpecExec as its ``custom_generate`` callable, so argument handling, generation configs, logits processors,
  stopping criteria and streamers are transformers' own. The speculator is the keyword's when given (``None``
  turns SpecExec off), else the ``speculator`` field of the call's ``generation_config`` when it has one, else
  that of ``model.generation_config`` (which ``generation_config.json`` loads): a ``GenerationConfig``
  carries SpecExec's settings as it carries transformers' own (:mod:`specexec_hf.hf.settings`).
- ``_extract_generation_mode_kwargs``: transformers hands a ``custom_generate`` callable only the keyword
  arguments its signature adds, dropping the draft, the streamer and the tokenizer (so ``stop_strings`` fail).
  For SpecExec's callable alone, the wrapper passes them on as the built-in decoding modes get them.

``apply()`` is idempotent and ``revert()`` restores the originals; both wrappers are :class:`~.patch.Patch` es, so
``apply()`` refuses a transformers version outside :data:`TRANSFORMERS` or a patched method with another signature.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from transformers.generation.utils import GenerationMixin

from .patch import Patch, Release, UnsupportedRelease

SPECULATORS = ("specexec",)


class UnsupportedTransformersVersion(UnsupportedRelease):
    """The installed transformers is outside the range this patch was written and tested for."""


TRANSFORMERS = Release(
    "transformers", ">=5.16,<6", "transformers>=5.16,<6", error=UnsupportedTransformersVersion
)
_GENERATE_SIGNATURE = inspect.signature(GenerationMixin.generate)
# GenerationMixin.generate and _extract_generation_mode_kwargs as transformers 5.16 - 5.19 define them.
GENERATE_PARAMETERS = (
    "self", "inputs", "generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
    "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
    "custom_generate", "kwargs",
)  # fmt: skip
EXTRACT_PARAMETERS = ("self", "custom_generate", "kwargs", "synced_gpus", "assistant_model", "streamer")


def is_applied() -> bool:
    return all(patch.applied for patch in _PATCHES)


def apply() -> None:
    """Installs the ``speculator=`` argument; a second call does nothing.

    Raises:
        UnsupportedTransformersVersion: transformers is outside :data:`TRANSFORMERS`, or a patched method changed.
    """
    for patch in _PATCHES:  # both checked before either is applied
        patch.check()
    for patch in _PATCHES:
        patch.apply()


def revert() -> None:
    """Restores transformers' own methods; does nothing if the patch is not applied."""
    for patch in _PATCHES:
        patch.revert()


def _speculating_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """``generate`` with the ``speculator=`` argument, over transformers' ``original``."""
    from specexec_hf.hf.generation import generate as specexec_generate
    from specexec_hf.hf.ownership import exclusive_call
    from specexec_hf.hf.settings import SPECULATOR_FIELD

    def configured_speculator(model, args: tuple, kwargs: dict) -> str | None:
        """The speculator of the call's generation config where it names one (``None`` included), else the
        model's (transformers fills the call's config with the model's own fields). None for the drafting call of
        transformers' own assisted generation, whose config is a copy of the target call's."""
        passed = _GENERATE_SIGNATURE.bind_partial(model, *args, **kwargs).arguments.get("generation_config")
        if getattr(passed, "is_assistant", False):
            return None
        config = passed if hasattr(passed, SPECULATOR_FIELD) else model.generation_config
        return getattr(config, SPECULATOR_FIELD, None)

    @functools.wraps(original)
    @exclusive_call  # plain generate() too: a streamed target's ring serves one call at a time
    def generate(self, *args, **kwargs):
        keyword = SPECULATOR_FIELD in kwargs
        speculator = kwargs.pop(SPECULATOR_FIELD) if keyword else configured_speculator(self, args, kwargs)
        # A custom_generate keyword wins over a speculator the generation config names.
        if speculator is None or (not keyword and kwargs.get("custom_generate") is not None):
            return original(self, *args, **kwargs)
        source = "" if keyword else " (set by the generation config's speculator field)"
        if speculator not in SPECULATORS:
            raise ValueError(
                f"Unknown speculator={speculator!r}{source}; specexec_hf provides {list(SPECULATORS)}."
            )
        if kwargs.get("custom_generate") is not None:
            raise ValueError("Pass either speculator= or custom_generate=, not both.")
        if kwargs.get("assistant_model") is None:
            raise ValueError(
                f'speculator="specexec"{source} needs a draft: pass assistant_model=<small causal LM with the same '
                "tokenizer>" + (", or speculator=None to decode without SpecExec." if source else ".")
            )
        # As draft_model= the draft reaches SpecExec directly, and transformers does not treat the call as its
        # own assisted generation (whose checks would pre-empt SpecExec's clearer ones).
        kwargs["draft_model"] = kwargs.pop("assistant_model")
        return original(self, *args, custom_generate=specexec_generate, **kwargs)

    return generate


def _passing_extract(original_extract: Callable[..., Any]) -> Callable[..., Any]:
    """``_extract_generation_mode_kwargs`` handing SpecExec's callable what the built-in modes get."""
    from specexec_hf.hf.generation import generate as specexec_generate

    @functools.wraps(original_extract)
    def extract_generation_mode_kwargs(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer):
        if custom_generate is not specexec_generate:
            return original_extract(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer)
        standard = original_extract(self, None, kwargs, synced_gpus, assistant_model, streamer)
        custom = original_extract(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer)
        return {**standard, **custom}

    return extract_generation_mode_kwargs


_WHY = "specexec_hf's speculator= argument"
_PATCHES = (
    Patch(GenerationMixin, "generate", GENERATE_PARAMETERS, _speculating_generate, TRANSFORMERS, _WHY),
    Patch(
        GenerationMixin, "_extract_generation_mode_kwargs", EXTRACT_PARAMETERS, _passing_extract, TRANSFORMERS, _WHY
    ),
)
