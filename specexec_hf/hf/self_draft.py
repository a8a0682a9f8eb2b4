"""Self-drafts: the target itself, weight-quantized to 4 or 8 bits, as the draft of a target with no small sibling.

A self-draft is a copy of the target whose linear layers hold int4 or int8 weights (optimum-quanto), so it shares
the tokenizer and the vocabulary by construction and agrees with the target far more often than a smaller
model would. It pays only where the quantized forward is much cheaper than the target's: a target offloaded to
host memory or disk, with the self-draft resident on the accelerator, is the case it is made for. On a CPU,
quanto's kernels dequantize the weights on every forward and the self-draft is slower than an in-memory target.
"""

from __future__ import annotations

import copy
import importlib
import weakref

import torch
from transformers import PreTrainedModel

from .compat import execution_device, use_sdpa_attention

SELF_DRAFTS = {"self:int4": 4, "self:int8": 8}
"""The draft names :func:`resolve_draft` accepts, with their weight bits."""
SELF_DRAFT_ATTRIBUTE = "specexec_self_draft"
"""Attribute of a self-draft's ``config`` naming what it is (``"self:int4"``, ``"self:int8"``)."""

_QUANTO_HINT = "pip install 'specexec-hf[quanto]' (or pip install optimum-quanto)"
# Per target, its self-drafts by bits: built once, so their online acceptance maps carry over between calls.
_built: weakref.WeakKeyDictionary[PreTrainedModel, dict[int, PreTrainedModel]] = weakref.WeakKeyDictionary()


def self_draft(target: PreTrainedModel, bits: int = 4, device: torch.device | str | None = None) -> PreTrainedModel:
    """A draft made of ``target`` itself with its linear layers' weights quantized to ``bits`` (optimum-quanto).

    The target is left untouched: its weights are copied, then the copy is quantized and frozen (the float weights
    of its linear layers are dropped). Embeddings and norms stay in the target's dtype.

    Args:
        target: A causal LM with every weight in memory (build the self-draft before offloading the target).
        bits: 4 (``qint4``, a scale and shift per group of up to 128 inputs) or 8 (``qint8``, a scale per output row).
        device: Where the self-draft lives; default: the target's execution device.

    Raises:
        ValueError: ``bits`` is neither 4 nor 8, or the target's weights are not all in memory.
        ImportError: optimum-quanto is not installed.
    """
    if bits not in SELF_DRAFTS.values():
        raise ValueError(f"A self-draft quantizes to 4 or 8 bits, got bits={bits!r}.")
    offloaded = [name for name, parameter in target.named_parameters() if parameter.device.type == "meta"]
    if offloaded:
        raise ValueError(
            f"self_draft needs the target's weights in memory, but {len(offloaded)} are offloaded (e.g. "
            f"{offloaded[0]}): build the self-draft from the in-memory model first, "
            "`draft = self_draft(model, bits, device='cuda')`, then offload the model."
        )
    try:
        quanto = importlib.import_module("optimum.quanto")
    except ImportError as error:
        raise ImportError(f"Self-drafts quantize the target with optimum-quanto: {_QUANTO_HINT}") from error
    destination = torch.device(device) if device is not None else execution_device(target)
    draft = copy.deepcopy(target)
    quanto.quantize(draft, weights={4: quanto.qint4, 8: quanto.qint8}[bits])
    quanto.freeze(draft)
    setattr(draft.config, SELF_DRAFT_ATTRIBUTE, f"self:int{bits}")
    return use_sdpa_attention(draft.to(destination)).eval()


def resolve_draft(target: PreTrainedModel, draft: PreTrainedModel | str) -> PreTrainedModel:
    """The draft model ``draft`` names for ``target``: a model as given, or ``"self:int4"`` / ``"self:int8"``.

    A self-draft is built once per target and bits and reused afterwards (see :func:`self_draft`).

    Args:
        target: The target model.
        draft: A causal LM sharing the target's tokenizer, or the name of a self-draft.

    Raises:
        ValueError: ``draft`` is a string other than the self-draft names, or neither a model nor a string.
    """
    if isinstance(draft, PreTrainedModel):
        return draft
    if not isinstance(draft, str) or draft not in SELF_DRAFTS:
        raise ValueError(
            f"The draft must be a causal LM sharing the target's tokenizer or one of {sorted(SELF_DRAFTS)} (the "
            f"target itself, weight-quantized), got {draft!r}."
        )
    bits = SELF_DRAFTS[draft]
    by_bits = _built.setdefault(target, {})
    if bits not in by_bits:
        by_bits[bits] = self_draft(target, bits)
    return by_bits[bits]
