"""The target and the prompts a distillation starts from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ...models.default_pair import load_default_target
from ..prompts import load_prompt_records, prompt_file

DEFAULT_TARGET = "smollm2"


def load_target(name_or_path: str) -> tuple[PreTrainedModel, Any]:
    """Load the target and tokenizer: the packaged SmolLM2 for ``"smollm2"``, else a local/hub checkpoint.

    Args:
        name_or_path: ``"smollm2"`` or anything ``AutoModelForCausalLM.from_pretrained`` accepts.
    """
    if name_or_path == DEFAULT_TARGET:
        model, tokenizer = load_default_target(torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.chat_template is None:
        raise ValueError(f"The tokenizer of {name_or_path!r} has no chat template; distillation prompts are chats.")
    model.requires_grad_(False)
    return model.eval(), tokenizer


def read_prompts(source: str) -> list[str]:
    """Prompt strings from a shipped split name (``train``/``eval``) or a JSONL file path.

    Args:
        source: Split name or path to a JSONL file of ``{"prompt": ...}`` objects.
    """
    path = prompt_file(source) if source in ("train", "eval") else Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"Prompt file {path} does not exist.")
    return [record["prompt"] for record in load_prompt_records(path)]


def eos_token_ids(model: PreTrainedModel, tokenizer: Any) -> set[int]:
    """Every id that ends an answer: the generation config's EOS ids plus the tokenizer's EOS token."""
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("Neither the model's generation config nor the tokenizer defines an EOS token.")
    return ids
