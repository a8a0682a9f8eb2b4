"""Stage ``exit``: tune a layer self-draft's exit (LayerSkip without retraining the target).

The draft is the target's first ``--exit-layers`` decoder layers, then an :class:`~specexec_hf.models.self_draft.
ExitAdapter` (a rank ``--exit-rank`` residual map, starting as the identity), then the target's final norm and LM
head. Only the adapter learns, from the stored target distributions (``--stage generate``'s shards) with the same
KL loss as the ``train`` stage; the target's layers are shared and frozen. The report compares the untrained and the
tuned exit on the held-out prompts (top-1 agreement, top-4 coverage, forward cost) and is saved beside the adapter.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from ...models.self_draft import ExitAdapter, layer_self_draft, save_tuned_exit
from .evaluate import agreement, eval_references, forward_cost
from .generate import shard_paths
from .train import ScoredTokens, batches, collate, load_examples, require_stopping_rule


def tune_exit(args: argparse.Namespace, target: PreTrainedModel, tokenizer: Any) -> dict[str, Any]:
    """Fits the exit adapter and writes ``OUT/exit.safetensors`` and ``OUT/exit_report.json``; returns the report.

    Args:
        args: Parsed command line (``--exit-layers``, ``--exit-rank``, ``--lr``, ``--batch-tokens``, ``--epochs`` /
            ``--train-minutes``, the evaluation options).
        target: The target, frozen.
        tokenizer: Its tokenizer.
    """
    require_stopping_rule(args)
    count = target.config.get_text_config().num_hidden_layers
    if not 0 < args.exit_layers < count:
        raise ValueError(f"--exit-layers must be in 1..{count - 1} (the target has {count} layers), got "
                         f"{args.exit_layers}.")
    paths = shard_paths(Path(args.out) / "data")
    if not paths:
        raise FileNotFoundError(f"No data shards in {Path(args.out) / 'data'}; run --stage generate first.")
    examples = load_examples(paths, args.prompt_weight, args.max_seq_len)
    if not examples:
        raise ValueError(f"The shards in {Path(args.out) / 'data'} hold no answer positions to learn from.")
    layers = list(range(args.exit_layers))
    adapter = ExitAdapter(target.config.get_text_config().hidden_size, args.exit_rank).to(target.device)
    draft = layer_self_draft(target, layers, exit_adapter=adapter)
    scored = ScoredTokens(target.config.vocab_size).to(target.device)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    epoch_batches = len(batches(examples, args.batch_tokens, random.Random(0)))
    total_steps = round(args.epochs * epoch_batches) if args.epochs else None
    time_budget = args.train_minutes * 60 if args.train_minutes else None
    started, step, epoch, losses = time.monotonic(), 0, 0, []

    def finished() -> bool:
        return (total_steps is not None and step >= total_steps) or (
            time_budget is not None and time.monotonic() - started >= time_budget
        )

    while not finished():
        for batch in batches(examples, args.batch_tokens, random.Random(args.seed * 1_000_003 + epoch)):
            if finished():
                break
            loss = scored.loss(draft, *collate(batch))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            step += 1
        epoch += 1
    seconds = time.monotonic() - started
    adapter.eval()
    references = eval_references(args, target, tokenizer)
    context = max(references, key=lambda row: len(row["input_ids"]))["input_ids"].long().unsqueeze(0)
    with torch.no_grad():
        untrained = layer_self_draft(target, layers)
        report = {
            "exit_layers": args.exit_layers,
            "rank": args.exit_rank,
            "trainable_parameters": sum(parameter.numel() for parameter in adapter.parameters()),
            "steps": step,
            "train_seconds": seconds,
            "first_loss": losses[0] if losses else None,
            "last_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
            "untrained": {**agreement(untrained, references),
                          "forward_cost": forward_cost(target, untrained, context)},
            "tuned": {**agreement(draft, references), "forward_cost": forward_cost(target, draft, context)},
        }
    save_tuned_exit(Path(args.out) / "exit.safetensors", layers, adapter)
    (Path(args.out) / "exit_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
