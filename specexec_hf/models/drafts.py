"""Drafts that share their target's embedding: construction and the exported file format."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from ..hf.calibrated import (
    ACCEPTANCE_MAP_ATTRIBUTE,
    ACCEPTANCE_MAP_KEY,
    CONTEXT_MATCH_ATTRIBUTE,
    GREEDY_TEMPERATURE_ATTRIBUTE,
)
from ..hf.compat import use_sdpa_attention
from .vocab import restrict_draft_vocabulary

# Key of an export's JSON holding its greedy temperature fit (see specexec_hf.tools.calibrate).
GREEDY_TEMPERATURE_KEY = "greedy_draft_temperature"
CONTEXT_MATCH_KEY = "greedy_context_match"  # its context-match weights fit, at that temperature
# Saved with a draft whose LM head scores a subset of the vocabulary (SubsetLMHead's buffer).
HEAD_TOKEN_IDS = "lm_head.token_ids"
INT8_SCALE_SUFFIX = ".int8_scale"  # beside a matrix exported as int8 (see quantize_rows_int8)


def draft_config_from_target(
    target_config: Any, num_hidden_layers: int, intermediate_size: int | None = None
) -> LlamaConfig:
    """A Llama config for a draft that matches the target's vocabulary, width and heads but is shallower.

    Args:
        target_config: Config of a Llama-style target (hidden size, heads, vocab, RoPE settings are copied).
        num_hidden_layers: Decoder layers of the draft.
        intermediate_size: MLP width; the target's when ``None``, so target layers can initialise draft layers.
    """
    if num_hidden_layers < 1:
        raise ValueError(f"A draft needs at least one layer, got num_hidden_layers={num_hidden_layers}.")
    default_head_dim = target_config.hidden_size // target_config.num_attention_heads
    head_dim = getattr(target_config, "head_dim", None) or default_head_dim
    config = LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=intermediate_size or target_config.intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or target_config.num_attention_heads,
        head_dim=head_dim,
        hidden_act=getattr(target_config, "hidden_act", "silu"),
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5),
        rope_parameters=getattr(target_config, "rope_parameters", None),
        tie_word_embeddings=True,
        bos_token_id=getattr(target_config, "bos_token_id", None),
        eos_token_id=getattr(target_config, "eos_token_id", None),
        pad_token_id=getattr(target_config, "pad_token_id", None),
    )
    config._attn_implementation = "sdpa"
    return config


def share_target_embeddings(draft: PreTrainedModel, target: PreTrainedModel) -> PreTrainedModel:
    """Point the draft's input embedding and LM head at the target's tensors (shared, not copied).

    Args:
        draft: A draft built by :func:`draft_config_from_target`.
        target: The target whose (tied) embedding the draft reuses.
    """
    target_embedding = target.get_input_embeddings()
    if target_embedding.weight.shape != draft.get_input_embeddings().weight.shape:
        raise ValueError(
            f"Draft embedding shape {tuple(draft.get_input_embeddings().weight.shape)} differs from the target's "
            f"{tuple(target_embedding.weight.shape)}."
        )
    draft.set_input_embeddings(target_embedding)
    draft.set_output_embeddings(target.get_output_embeddings())
    return draft


def copy_target_embeddings(draft: PreTrainedModel, target: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """Give the draft its own copy of the target's embedding (and of its LM head), in ``dtype``, for a draft that
    computes in another dtype than the target (converting shared tensors would convert the target's).

    Args:
        draft: A draft built by :func:`draft_config_from_target`.
        target: The target whose embedding the draft copies; a tied head stays tied to the copy.
        dtype: The draft's dtype.
    """
    target_embedding = target.get_input_embeddings()
    embedding = nn.Embedding.from_pretrained(
        target_embedding.weight.detach().to(dtype, copy=True), freeze=True, padding_idx=target_embedding.padding_idx
    )
    draft.set_input_embeddings(embedding)
    target_head = target.get_output_embeddings()
    head = nn.Linear(target_head.in_features, target_head.out_features, bias=False, device="meta")
    tied = target_head.weight is target_embedding.weight
    head.weight = embedding.weight if tied else nn.Parameter(target_head.weight.detach().to(dtype), requires_grad=False)
    draft.set_output_embeddings(head)
    return draft


def own_state_dict(draft: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The draft's parameters without the shared embedding / LM head, as saved in a shipped draft file."""
    shared = {"model.embed_tokens.weight", "lm_head.weight"}
    return {name: tensor for name, tensor in draft.state_dict().items() if name not in shared}


def build_draft(
    target: PreTrainedModel,
    draft_config: LlamaConfig,
    own_weights: dict[str, torch.Tensor],
    dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """Assemble a draft from its own weights and the target's shared embedding.

    Args:
        target: The target model (its embedding and LM head are shared with the draft).
        draft_config: Draft architecture, e.g. from :func:`draft_config_from_target`.
        own_weights: Decoder layers and final norm, as produced by :func:`own_state_dict`; with
            ``lm_head.token_ids`` the draft's head scores only those tokens (see :mod:`specexec_hf.models.vocab`).
        dtype: The draft's dtype; ``None``: the target's. In another dtype the draft copies the target's embedding
            instead of sharing it (:func:`copy_target_embeddings`).
    """
    target_dtype = target.get_input_embeddings().weight.dtype
    dtype = dtype or target_dtype
    own_weights = dict(own_weights)
    head_token_ids = own_weights.pop(HEAD_TOKEN_IDS, None)
    with torch.device("meta"):
        draft = LlamaForCausalLM(draft_config)
    if dtype == target_dtype:
        share_target_embeddings(draft, target)
    else:
        copy_target_embeddings(draft, target, dtype)
    _, unexpected = draft.load_state_dict(own_weights, strict=False, assign=True)
    unexpected = [name for name in unexpected if name not in ("model.embed_tokens.weight", "lm_head.weight")]
    still_meta = [name for name, p in draft.named_parameters() if p.is_meta]
    if unexpected or still_meta:
        raise ValueError(f"Draft weights do not fit its config: missing {still_meta}, unexpected {unexpected}.")
    # Non-persistent buffers (RoPE frequencies) were created on the meta device; rebuild them for real.
    draft.model.rotary_emb = type(draft.model.rotary_emb)(config=draft_config)
    draft.to(dtype)
    if head_token_ids is not None:
        restrict_draft_vocabulary(draft, head_token_ids)
    return use_sdpa_attention(draft).eval()


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 storage of a matrix: ``weight ~= q * scale[:, None]``, error at most ``scale / 2``.

    A storage format (it halves a shipped fp16 draft): loading dequantizes, and the draft computes in its target's
    dtype, unless :func:`~.int8_draft.int8_draft` converts it back to these rows to compute in int8.

    Args:
        weight: ``[rows, columns]`` floating tensor.

    Returns:
        ``(q int8, scale float32 [rows])``.
    """
    scale = int8_row_scales(weight)
    q = torch.round(weight.detach().float() / scale).clamp(-127, 127).to(torch.int8)
    return q, scale[:, 0]


def int8_row_scales(rows: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 scale of each row of a ``[..., columns]`` tensor, ``[..., 1]`` float32: its absolute maximum
    over 127 (at least ``1e-12 / 127``, so an all-zero row divides to zeros)."""
    return rows.detach().abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-12).div_(127)


def dequantize_rows_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_rows_int8`, in float32."""
    return q.float() * scale.float()[:, None]


def read_draft_export(
    weights_path: str | os.PathLike, dtype: torch.dtype
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An exported draft's metadata (the ``.json`` beside ``weights_path``) and tensors, floating ones in ``dtype``.

    Matrices exported as int8 (``NAME`` int8 beside ``NAME.int8_scale``) come back dequantized.

    Args:
        weights_path: A ``.safetensors`` file written by ``specexec-hf distill --stage export``.
        dtype: Parameter dtype wanted (``lm_head.token_ids`` stays an integer tensor).
    """
    weights_path = Path(weights_path)
    meta = json.loads(weights_path.with_suffix(".json").read_text())
    stored = load_file(weights_path)
    weights = {}
    for name, tensor in stored.items():
        if name.endswith(INT8_SCALE_SUFFIX):
            continue
        if name + INT8_SCALE_SUFFIX in stored:
            tensor = dequantize_rows_int8(tensor, stored[name + INT8_SCALE_SUFFIX])
        weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return meta, weights


def load_draft_export(
    target: PreTrainedModel, weights_path: str | os.PathLike, dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """The draft exported at ``weights_path`` (beside its ``.json``), sharing ``target``'s embedding and dtype, or
    in ``dtype`` with its own copy of the embedding (see :func:`build_draft`)."""
    dtype = dtype or target.get_input_embeddings().weight.dtype
    meta, own_weights = read_draft_export(weights_path, dtype)
    draft_config = draft_config_from_target(target.config, meta["num_hidden_layers"], meta.get("intermediate_size"))
    draft = build_draft(target, draft_config, own_weights, dtype)
    if GREEDY_TEMPERATURE_KEY in meta:  # written by `specexec-hf calibrate --write`
        setattr(draft.config, GREEDY_TEMPERATURE_ATTRIBUTE, float(meta[GREEDY_TEMPERATURE_KEY]["temperature"]))
    if CONTEXT_MATCH_KEY in meta:
        setattr(draft.config, CONTEXT_MATCH_ATTRIBUTE, tuple(meta[CONTEXT_MATCH_KEY]["weights"]))
    if ACCEPTANCE_MAP_KEY in meta:
        setattr(draft.config, ACCEPTANCE_MAP_ATTRIBUTE, meta[ACCEPTANCE_MAP_KEY])
    return draft


