"""Drafts named by a string, as ``generate()`` takes them (``assistant_model="self:int4"``, ``"self:exit:K"``, ...).

The self-drafts those names stand for are built in :mod:`specexec_hf.models.self_draft`, beside the other drafts,
which the import rule ranks above this layer: this layer cannot call it, so that module registers its resolver here
(:func:`register_draft_resolver`) when it is imported, as ``import specexec_hf`` does before any ``generate()``;
the adapter resolves names through :func:`resolve_draft`.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedModel

DraftResolver = Callable[[PreTrainedModel, "PreTrainedModel | str"], PreTrainedModel]
"""``(target, draft) -> the draft model``: a model as given, a name resolved to the draft it names."""

_resolver: DraftResolver | None = None


def register_draft_resolver(resolver: DraftResolver) -> None:
    """Makes ``resolver`` the one :func:`resolve_draft` asks (:mod:`specexec_hf.models.self_draft` registers its
    ``resolve_draft``)."""
    global _resolver
    _resolver = resolver


def resolve_draft(target: PreTrainedModel, draft: PreTrainedModel | str) -> PreTrainedModel:
    """The draft model ``draft`` names for ``target``, by the registered resolver (see the module).

    Raises:
        RuntimeError: no resolver is registered (``specexec_hf.models`` was not imported).
        ValueError: from the resolver, for a name it does not know.
    """
    if _resolver is None:
        raise RuntimeError(
            "Drafts named by a string are built by specexec_hf.models, which was not imported: import specexec_hf "
            "(or specexec_hf.models) before passing a draft by name."
        )
    return _resolver(target, draft)
