"""What SpecExec needs from a transformers model, checked up front with errors that say how to fix it."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from .kv import additive_mask

# Families whose attention is known to honour a custom 4-D mask together with explicit position_ids; the
# test suite checks each of them against plain generate(). Others are probed numerically once per class.
VERIFIED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
SUPPORTED_ATTENTION = ("eager", "sdpa")
_probed_classes: dict[type, bool] = {}


class UnsupportedModelError(ValueError):
    """The model cannot run SpecExec; the message says why and what to do instead."""


def check_supported(model: PreTrainedModel, role: str) -> None:
    """Raises :class:`UnsupportedModelError` unless ``model`` can score token trees exactly.

    Args:
        model: The target or the draft.
        role: ``"target"`` or ``"draft"``, for the message.
    """
    name = f"The {role} model ({type(model).__name__})"
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder; SpecExec supports decoder-only causal LMs.")
    if getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(
            f"{name} is stateful (recurrent state instead of a KV cache), so it cannot score a token tree."
        )
    parameters = inspect.signature(model.forward).parameters
    missing = [arg for arg in ("attention_mask", "position_ids", "past_key_values") if arg not in parameters]
    if missing:
        raise UnsupportedModelError(f"{name}'s forward() lacks {missing}, which tree attention needs.")
    attention = getattr(config, "_attn_implementation", None)
    if attention not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"{name} uses attn_implementation={attention!r}, which ignores custom 4-D attention masks. "
            f"Load it with attn_implementation='sdpa' (or 'eager')."
        )
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types) or _uses_sliding_window(config):
        raise UnsupportedModelError(
            f"{name} uses sliding-window or hybrid attention layers ({sorted(set(layer_types)) or 'sliding_window'}); "
            "SpecExec needs full-attention KV caches it can compact. If your contexts fit in the window, set "
            "config.sliding_window = None before loading."
        )
    if config.model_type not in VERIFIED_MODEL_TYPES and not _tree_attention_probe(model):
        raise UnsupportedModelError(
            f"{name} (model_type={config.model_type!r}) gives different logits for a token scored inside a tree "
            "than for the same token scored in sequence, so its attention does not honour custom 4-D masks "
            "and position_ids. Verified families: " + ", ".join(sorted(VERIFIED_MODEL_TYPES)) + "."
        )


def _uses_sliding_window(config) -> bool:
    if not getattr(config, "sliding_window", None):
        return False
    return getattr(config, "use_sliding_window", True) is not False


def check_same_vocabulary(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    check_draft_vocabulary(target.get_output_embeddings().weight.shape[0], draft)


def check_draft_vocabulary(target_vocab_size: int, draft: PreTrainedModel, target_name: str = "target") -> None:
    """Raises ``ValueError`` unless the draft scores exactly the target's ``target_vocab_size`` tokens.

    Args:
        target_vocab_size: Logits the target produces per token.
        draft: The draft model.
        target_name: How the message names the target (e.g. ``"vLLM target"``).
    """
    draft_size = draft.get_output_embeddings().weight.shape[0]
    if draft_size != target_vocab_size:
        raise ValueError(
            f"The draft's vocabulary ({draft_size} logits) does not match the {target_name}'s ({target_vocab_size}). "
            "SpecExec compares token ids directly, so the draft must use the target's tokenizer and vocab_size: "
            "pick a draft from the same model family, or distill one with `specexec-hf distill`."
        )


def model_logits(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache,
    num_logits: int,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """One forward over ``input_ids`` on top of ``cache``; the float32 logits of the last ``num_logits`` tokens.

    Args:
        model: A causal LM.
        input_ids: ``[n]`` tokens to feed.
        position_ids: ``[n]`` their positions.
        cache: The model's KV cache; the new tokens are appended to it.
        num_logits: How many trailing tokens need logits.
        visible: ``[n, cache_length + n]`` bool attention pattern; ``None`` means causal.
    """
    kwargs = dict(
        input_ids=input_ids[None], position_ids=position_ids[None], past_key_values=cache, use_cache=True
    )
    if visible is not None:
        kwargs["attention_mask"] = additive_mask(visible, model.dtype)
    if model._supports_logits_to_keep():
        kwargs["logits_to_keep"] = num_logits
    return model(**kwargs).logits[0, -num_logits:].float()


def _tree_attention_probe(model: PreTrainedModel) -> bool:
    """Scores a 3-token sequence causally and as a 2-branch tree; the shared branch must give equal logits."""
    cls = type(model)
    if cls not in _probed_classes:
        device = model.get_input_embeddings().weight.device
        if device.type == "meta":  # offloaded to disk: accelerate's hooks move inputs to where each layer runs
            device = torch.device("cpu")
        tokens = torch.tensor([1, 2, 3], device=device) % model.config.vocab_size
        positions = torch.arange(3, device=device)
        causal = model_logits(model, tokens, positions, DynamicCache(config=model.config), 3)
        # Tree: root 1 with children 2 and 3, then 3 again under 2: the last node must match the causal run.
        tree_tokens = torch.cat([tokens[:1], tokens[2:], tokens[1:]])
        tree_positions = torch.tensor([0, 1, 1, 2], device=device)
        visible = torch.tensor(
            [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool, device=device
        )
        tree = model_logits(model, tree_tokens, tree_positions, DynamicCache(config=model.config), 4, visible)
        reference = torch.stack([causal[0], causal[1], causal[2]])
        _probed_classes[cls] = torch.allclose(tree[[0, 2, 3]], reference, atol=1e-3, rtol=1e-3)
    return _probed_classes[cls]
