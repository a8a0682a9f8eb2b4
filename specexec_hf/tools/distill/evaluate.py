"""Stage 3: the draft's held-out agreement with the target and its forward cost."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from ...models.vocab import restrict_draft_vocabulary
from ..prompts import encode_chats
from .generate import generate_with_top_k, save_atomically
from .sources import eos_token_ids, read_prompts
from .train import DraftSpec, head_token_ids, load_checkpoint_draft, resolve_checkpoint


def eval_references(args: argparse.Namespace, target: PreTrainedModel, tokenizer: Any) -> list[dict[str, Any]]:
    """The target's greedy answers to the held-out prompts, generated once per run directory and cached.

    Args:
        args: Parsed command line (``--eval-prompts``, ``--eval-limit``, ``--max-new-tokens``).
        target: The target.
        tokenizer: Its tokenizer.
    """
    key = {"prompts": str(args.eval_prompts), "limit": args.eval_limit, "max_new_tokens": args.max_new_tokens}
    cache = Path(args.out) / "eval_references.pt"
    if cache.is_file():
        saved = torch.load(cache)
        if saved["key"] == key:
            return saved["rows"]
    prompts = encode_chats(tokenizer, read_prompts(args.eval_prompts)[: args.eval_limit])
    eos_ids = eos_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    rows = []
    for start in tqdm(range(0, len(prompts), args.gen_batch_size), desc="evaluate (target greedy answers)"):
        chunk = prompts[start : start + args.gen_batch_size]
        rows += generate_with_top_k(
            target,
            chunk,
            [True] * len(chunk),
            [False] * len(chunk),
            max_new_tokens=args.max_new_tokens,
            top_k=4,
            temperature=1.0,
            eos_ids=eos_ids,
            pad_id=pad_id,
            generator=torch.Generator(device=target.device),
        )
    save_atomically({"key": key, "rows": rows}, cache)
    return rows


@torch.inference_mode()
def agreement(draft: PreTrainedModel, references: list[dict[str, Any]]) -> dict[str, float]:
    """Teacher-forced on the target's greedy answers: the draft's top-1 agreement and top-4 coverage.

    Only answer positions count (the ones a draft must predict during decoding).

    Args:
        draft: The draft model.
        references: Rows from :func:`eval_references`.
    """
    hits_top1 = hits_top4 = positions = 0
    for row in references:
        start = row["topk_start"]
        logits = draft(input_ids=row["input_ids"].long().unsqueeze(0).to(draft.device)).logits[0, start:-1]
        target_argmax = row["topk_ids"][:, 0].long()
        draft_top4 = logits.topk(4, dim=-1).indices.cpu()
        hits_top1 += int((draft_top4[:, 0] == target_argmax).sum())
        hits_top4 += int((draft_top4 == target_argmax.unsqueeze(-1)).any(-1).sum())
        positions += len(target_argmax)
    return {
        "top1_agreement": hits_top1 / max(positions, 1),
        "top4_coverage": hits_top4 / max(positions, 1),
        "positions": positions,
        "prompts": len(references),
    }


@torch.inference_mode()
def forward_seconds(model: PreTrainedModel, context: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, float]:
    """Median wall time of one forward on ``new_tokens`` tokens after a cached ``context``, per call and per token.

    Args:
        model: Model to time.
        context: ``(1, n)`` token ids; the timed tokens are its last ``new_tokens``.
        new_tokens: Tokens per timed forward (1 = plain decoding, more = a tree/verification-sized block).
        repeats: Timed calls (after one warm-up).
    """
    context = context.to(model.device)
    prefix, block = context[:, :-new_tokens], context[:, -new_tokens:]
    timings = []
    for _ in range(repeats + 1):
        cache = DynamicCache(config=model.config)
        model(input_ids=prefix, past_key_values=cache)
        _wait_for_device(model.device)
        began = time.perf_counter()
        model(input_ids=block, past_key_values=cache)
        _wait_for_device(model.device)
        timings.append(time.perf_counter() - began)
    median = sorted(timings[1:])[len(timings[1:]) // 2]
    return {"seconds_per_forward": median, "seconds_per_token": median / new_tokens}


def _wait_for_device(device: torch.device) -> None:
    """Let queued GPU work finish, so wall-clock timings cover it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_cost(target: PreTrainedModel, draft: PreTrainedModel, context: torch.Tensor) -> dict[str, Any]:
    """Draft vs target forward time on the same input, for 1-token and 16-token forwards after a context."""
    report: dict[str, Any] = {"threads": torch.get_num_threads(), "context_tokens": int(context.shape[1])}
    for new_tokens in (1, 16):
        target_time = forward_seconds(target, context, new_tokens, repeats=15)
        draft_time = forward_seconds(draft, context, new_tokens, repeats=15)
        report[f"{new_tokens}_token_forward"] = {
            "target_ms": 1000 * target_time["seconds_per_forward"],
            "draft_ms": 1000 * draft_time["seconds_per_forward"],
            "draft_over_target": draft_time["seconds_per_forward"] / target_time["seconds_per_forward"],
        }
    return report


def load_evaluated_draft(
    args: argparse.Namespace, target: PreTrainedModel
) -> tuple[Path, PreTrainedModel, DraftSpec, dict[str, Any]]:
    """The checkpoint the evaluate and export stages work on, restricted per ``--draft-vocab``."""
    path = resolve_checkpoint(args)
    draft, spec, saved = load_checkpoint_draft(path, target)
    token_ids = head_token_ids(args, draft.config.vocab_size, saved.get("draft_token_ids"))
    if token_ids is not None:
        restrict_draft_vocabulary(draft, token_ids)
    return path, draft.to(target.device), spec, saved


def agreement_report(
    args: argparse.Namespace,
    path: Path,
    saved: dict[str, Any],
    draft: PreTrainedModel,
    target: PreTrainedModel,
    tokenizer: Any,
    int8_weights: bool = False,
) -> dict[str, Any]:
    """Agreement report of ``draft`` (checkpoint ``path``) on held-out prompts, saved as ``OUT/agreement.json``.

    ``int8_weights`` records that the draft's matrices went through the int8 export's round trip.
    """
    references = eval_references(args, target, tokenizer)
    longest = max(references, key=lambda row: len(row["input_ids"]))
    report = {
        "checkpoint": str(path),
        "step": saved["state"]["step"],
        "eval_prompts": str(args.eval_prompts),
        "max_new_tokens": args.max_new_tokens,
        "draft_vocab": args.draft_vocab or None,
        "int8_weights": int8_weights,
        **agreement(draft, references),
        "forward_cost": forward_cost(target, draft, longest["input_ids"].long().unsqueeze(0)),
    }
    (Path(args.out) / "agreement.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def evaluate_checkpoint(args: argparse.Namespace, target: PreTrainedModel, tokenizer: Any) -> dict[str, Any]:
    """Stage ``evaluate``: agreement report of a checkpoint on held-out prompts, saved as ``OUT/agreement.json``."""
    path, draft, _, saved = load_evaluated_draft(args, target)
    return agreement_report(args, path, saved, draft, target, tokenizer)
