"""What SpecExec needs from a transformers model, checked up front with errors that say how to fix it."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from ..core.masks import additive_mask

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


def logits_width(model: PreTrainedModel) -> int:
    """How many logits ``model`` produces per token (a subset head still produces the full vocabulary's)."""
    head = model.get_output_embeddings()
    return getattr(head, "out_features", None) or head.weight.shape[0]


def check_same_vocabulary(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    check_draft_vocabulary(logits_width(target), draft)


def check_draft_vocabulary(target_vocab_size: int, draft: PreTrainedModel, target_name: str = "target") -> None:
    """Raises ``ValueError`` unless the draft scores exactly the target's ``target_vocab_size`` tokens.

    Args:
        target_vocab_size: Logits the target produces per token.
        draft: The draft model.
        target_name: How the message names the target (e.g. ``"vLLM target"``).
    """
    draft_size = logits_width(draft)
    if draft_size != target_vocab_size:
        raise ValueError(
            f"The draft's vocabulary ({draft_size} logits) does not match the {target_name}'s ({target_vocab_size}). "
            "SpecExec compares token ids directly, so the draft must use the target's tokenizer and vocab_size: "
            "pick a draft from the same model family, or distill one with `specexec-hf distill`."
        )


def forward_inputs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache,
    visible: torch.Tensor | None,
) -> dict[str, Any]:
    """Keyword arguments of a cached forward over ``[batch, n]`` tokens with an optional bool attention pattern
    ``[batch, n, cache_length + n]`` (``None``: causal), for the model or its decoder stack."""
    kwargs: dict[str, Any] = dict(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
    if visible is not None:
        kwargs["attention_mask"] = additive_mask(visible, model.dtype)
    return kwargs


def batch_logits(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache,
    keep: int | torch.Tensor,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """One forward over ``[batch, n]`` tokens; float32 logits ``[batch, kept, vocab]`` of the kept positions.

    Args:
        model: A causal LM.
        input_ids: ``[batch, n]`` tokens to feed.
        position_ids: ``[batch, n]`` their positions.
        cache: The model's KV cache (batch rows as in ``input_ids``); the new tokens are appended to it.
        keep: The last ``keep`` positions, or a 1-D tensor of positions, whose logits are needed.
        visible: ``[batch, n, cache_length + n]`` bool attention pattern; ``None`` means causal.
    """
    kwargs = forward_inputs(model, input_ids, position_ids, cache, visible)
    if model._supports_logits_to_keep():
        kwargs["logits_to_keep"] = keep
        return model(**kwargs).logits.float()
    logits = model(**kwargs).logits
    return (logits[:, -keep:] if isinstance(keep, int) else logits[:, keep]).float()


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
    pattern = None if visible is None else visible[None]
    return batch_logits(model, input_ids[None], position_ids[None], cache, num_logits, pattern)[0]


class NodeLogits:
    """The target's float32 logits for each tree node, computed from its last hidden states on first use.

    The acceptance walk reads the logits of the nodes it visits (the accepted path plus one), typically a handful
    out of hundreds. Applying the LM head to those rows only, instead of to every node, saves most of the head's
    cost: on SmolLM2-135M the head is about a fifth of a forward's work per token.

    Args:
        hidden: ``[num_nodes, hidden]`` final hidden states, or ``None`` when ``logits`` are given.
        head: The model's output embedding (a bias-free linear layer).
        logits: ``[num_nodes, vocab]`` precomputed logits, for models whose head cannot be applied lazily.
    """

    def __init__(
        self,
        hidden: torch.Tensor | None = None,
        head: torch.nn.Module | None = None,
        logits: torch.Tensor | None = None,
    ):
        self.hidden, self.head = hidden, head
        self._rows: dict[int, torch.Tensor] = {}
        self._logits = logits

    def row(self, node: int) -> torch.Tensor:
        """``[1, vocab]`` logits of ``node``, computed once; a copy, so callers that keep it (``output_logits``)
        do not keep the whole tree's logits alive."""
        if node not in self._rows:
            if self._logits is not None:
                self._rows[node] = self._logits[node : node + 1].clone()
            else:
                self._rows[node] = self.head(self.hidden[node : node + 1]).float()
        return self._rows[node]


def _head_applies_lazily(model: PreTrainedModel) -> bool:
    """Whether ``logits == lm_head(last hidden state)`` can be applied outside the forward.

    That holds for the verified families' plain linear heads held in memory; heads wrapped by offloading hooks
    (weights streamed in around each call) or quantized layers go through the model's own forward instead.
    """
    head = model.get_output_embeddings()
    return (
        model.config.model_type in VERIFIED_MODEL_TYPES
        and type(head) is torch.nn.Linear
        and head.bias is None
        and head.weight.device.type != "meta"
        and not head._forward_pre_hooks
        and not head._forward_hooks
        and not hasattr(head, "_hf_hook")
        and model.base_model is not model
    )


def node_logits(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache,
    num_nodes: int,
    visible: torch.Tensor,
) -> NodeLogits:
    """One target forward over ``input_ids``; the logits of its last ``num_nodes`` tokens, per node on demand.

    Args: as :func:`model_logits`, with ``num_nodes`` the trailing tokens that are tree nodes.
    """
    if not _head_applies_lazily(model):
        return NodeLogits(logits=model_logits(model, input_ids, position_ids, cache, num_nodes, visible))
    kwargs = forward_inputs(model, input_ids[None], position_ids[None], cache, visible[None])
    hidden = model.base_model(**kwargs).last_hidden_state
    return NodeLogits(hidden=hidden[0, -num_nodes:], head=model.get_output_embeddings())


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


def disable_sliding_window(model: PreTrainedModel) -> PreTrainedModel:
    """Make sure tree attention sees a plain causal model with SDPA attention and no sliding window."""
    if getattr(model.config, "sliding_window", None) is not None:
        model.config.sliding_window = None
    if hasattr(model.config, "use_sliding_window"):
        model.config.use_sliding_window = False
    model.config._attn_implementation = "sdpa"
    return model
