"""Chat prompt sets shipped with the package: ``train`` (draft distillation) and ``eval`` (held out).

Each ``specexec_hf/data/prompts_<split>.jsonl`` line is ``{"id": ..., "category": ..., "prompt": ...}``.
The eval prompts are never used to train a draft, so benchmarks and agreement reports on them are held out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROMPT_DIR = Path(__file__).resolve().parent / "data"
SPLITS = ("train", "eval")


def prompt_file(split: str) -> Path:
    """Path of the JSONL file holding one split.

    Args:
        split: ``"train"`` or ``"eval"``.
    """
    if split not in SPLITS:
        raise ValueError(f"Unknown prompt split {split!r}; choose one of {SPLITS}.")
    return PROMPT_DIR / f"prompts_{split}.jsonl"


def load_prompt_records(path: str | Path) -> list[dict[str, str]]:
    """Read a JSONL prompt file into ``{"id", "category", "prompt"}`` records.

    Args:
        path: A JSONL file with one object per line carrying at least a ``"prompt"`` string.
    """
    records = []
    for line_number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{line_number}: expected an object with a string 'prompt', got {line!r}.")
        records.append(record)
    return records


def load_prompts(split: str) -> list[str]:
    """The prompt strings of a shipped split, in file order.

    Args:
        split: ``"train"`` or ``"eval"``.
    """
    return [record["prompt"] for record in load_prompt_records(prompt_file(split))]


def chat_inputs(tokenizer: Any, prompt: str) -> Any:
    """``generate()`` inputs (``input_ids`` and ``attention_mask``, a batch of one) for ``prompt`` sent as a
    one-turn user chat, ready for the assistant's answer.

    Args:
        tokenizer: A tokenizer with a chat template.
        prompt: The user message.
    """
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


def encode_chats(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as a one-turn user chat (see :func:`chat_inputs`).

    Args:
        tokenizer: A tokenizer with a chat template.
        prompts: User messages.
    """
    return [chat_inputs(tokenizer, prompt)["input_ids"][0].tolist() for prompt in prompts]
