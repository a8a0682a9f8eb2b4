"""Distil a small draft model from a target that has no small sibling.

Stages (``--stage``, default ``all`` runs them in order):

* ``generate``: the target answers chat prompts (one greedy answer plus ``--samples-per-prompt`` sampled
  ones per prompt) in batches and, while it decodes, keeps its top-k log-probs at every position, so training
  never runs the target again. Shards go to ``OUT/data/``; an interrupted run resumes where it stopped.
* ``train``: a shallow Llama draft whose layers start as copies of chosen target layers (or as an exported
  draft, ``--init-from``) learns the target's stored distributions with a KL loss. Checkpoints go to
  ``OUT/checkpoints/``; ``--resume`` continues.
* ``evaluate``: teacher-forced on the target's greedy answers to held-out prompts, how often the draft's top-1
  token equals the target's argmax and how often the argmax is in the draft's top 4; written as JSON.
* ``export``: the draft's own weights (fp16/bf16 safetensors, or int8 matrices with per-row scales) plus a JSON
  with its config and the report.
* ``exit`` (not part of ``all``): instead of a separate draft, tune a layer self-draft's exit: the target's first
  ``--exit-layers`` layers, then a small trainable adapter before its final norm and LM head, learnt from the same
  shards; ``OUT/exit.safetensors`` (load with ``specexec_hf.models.load_tuned_exit``) and ``OUT/exit_report.json``
  (agreement and cost, untrained and tuned).

``--device cuda`` runs any stage on a GPU; data shards and checkpoints are device-free either way.

Run as ``specexec-hf distill ...`` or ``python -m specexec_hf.tools.distill ...``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .evaluate import evaluate_checkpoint
from .exit_head import tune_exit
from .export import export_checkpoint
from .generate import generate_data
from .sources import DEFAULT_TARGET, load_target
from .train import require_stopping_rule, train_draft

STAGES = ("generate", "train", "evaluate", "export")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the distillation options to ``parser`` (used by ``specexec-hf distill`` and ``python -m``).

    Args:
        parser: The (sub)command parser to extend.
    """
    parser.add_argument("--target", default=DEFAULT_TARGET, help="'smollm2' (packaged default) or a model path.")
    parser.add_argument("--out", required=True, help="Run directory for data shards, checkpoints and reports.")
    parser.add_argument("--stage", choices=(*STAGES, "all", "exit"), default="all", help="Which stage to run.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 keeps a core free).")
    parser.add_argument(
        "--device",
        default="cpu",
        help="Where the target and draft run, e.g. 'cuda' (generation and training are many times faster on a "
        "GPU; shards and checkpoints stay device-free). The forward-cost figures of evaluate/export are measured "
        "there too, so evaluate on the machine the draft is meant for.",
    )
    data = parser.add_argument_group("generate")
    data.add_argument("--prompts", default="train", help="'train' (shipped set) or a JSONL prompt file.")
    data.add_argument("--samples-per-prompt", type=int, default=1, help="Sampled answers on top of the greedy one.")
    data.add_argument("--temperature", type=float, default=0.7, help="Temperature of the sampled answers.")
    data.add_argument("--max-new-tokens", type=int, default=128, help="Answer length cap (generate and evaluate).")
    data.add_argument("--top-k", type=int, default=32, help="Target log-probs stored per position.")
    data.add_argument("--gen-batch-size", type=int, default=16)
    data.add_argument(
        "--first-prompt",
        type=int,
        default=0,
        help="Answer only prompts from this index of the set on (e.g. prompts just appended to it, first).",
    )
    data.add_argument("--gen-minutes", type=float, default=None, help="Stop generating after this long.")
    train = parser.add_argument_group("train")
    train.add_argument("--layers", type=int, default=3, help="Decoder layers of the draft.")
    train.add_argument(
        "--init-layers",
        default=None,
        help="Comma-separated target layers to copy into the draft (default: the first LAYERS - 1 and the last).",
    )
    train.add_argument(
        "--share-embeddings",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Freeze the target's embedding/LM head and share it (the saved draft holds only its own layers).",
    )
    train.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="Train, evaluate and export a draft whose LM head scores only the N tokens most often in the target's "
        "top-8 on the training data (0: the full vocabulary). Smaller heads make the draft much faster, and "
        "training faster too.",
    )
    train.add_argument(
        "--init-from",
        default=None,
        metavar="DRAFT.safetensors",
        help="Start from an exported draft (beside its .json; e.g. the shipped one) instead of copies of target "
        "layers: --layers/--init-layers are then taken from it. Ignored when --resume finds a checkpoint.",
    )
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--warmup-steps", type=int, default=50)
    train.add_argument("--batch-tokens", type=int, default=2048, help="Target positions per optimiser step.")
    train.add_argument("--max-seq-len", type=int, default=256, help="Longer sequences are cut to this length.")
    train.add_argument("--epochs", type=float, default=None, help="Total passes over the data (or --train-minutes).")
    train.add_argument(
        "--train-minutes", type=float, default=None, help="Total training time (a resumed run counts time spent)."
    )
    train.add_argument("--prompt-weight", type=float, default=0.5, help="Loss weight of prompt positions.")
    train.add_argument("--checkpoint-minutes", type=float, default=5.0, help="Checkpoint at least this often.")
    train.add_argument("--resume", action="store_true", help="Continue from the newest checkpoint in OUT.")
    train.add_argument("--holdout-shards", type=int, default=0, help="Shards kept out of training for a val loss.")
    exit_head = parser.add_argument_group("exit (a tuned layer self-draft; uses --lr, --batch-tokens, --epochs / "
                                          "--train-minutes)")
    exit_head.add_argument("--exit-layers", type=int, default=None, help="Target layers the tuned exit runs (K).")
    exit_head.add_argument("--exit-rank", type=int, default=64, help="Rank of the exit adapter.")
    evaluation = parser.add_argument_group("evaluate / export")
    evaluation.add_argument("--eval-prompts", default="eval", help="'eval' (shipped held-out set) or a JSONL file.")
    evaluation.add_argument("--eval-limit", type=int, default=None, help="Evaluate on the first N eval prompts.")
    evaluation.add_argument(
        "--checkpoint", default=None, help="Checkpoint to evaluate/export (default: the run's best.pt, else newest)."
    )
    evaluation.add_argument("--export-path", default=None, help="Draft file to write (default OUT/draft.safetensors).")
    evaluation.add_argument(
        "--export-dtype",
        choices=("float16", "bfloat16", "float32", "int8"),
        default="float16",
        help="Storage of the exported weights; int8 keeps matrices as int8 with per-row scales (half of float16; "
        "dequantized at load) and reports the agreement of exactly those weights.",
    )


def resolve_device(name: str) -> torch.device:
    """``--device`` as a torch device, with a clear error when it is not usable here."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device {name!r} is not a torch device name (try 'cpu' or 'cuda').") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name!r}: this torch build or machine has no CUDA GPU; use --device cpu.")
        # TF32 matmuls: the draft learns the target's distributions to far coarser precision than TF32 rounds.
        torch.backends.cuda.matmul.allow_tf32 = True
    return device


def run(args: argparse.Namespace) -> int:
    """Run the selected stage(s); returns a process exit status.

    Args:
        args: Parsed options from a parser extended by :func:`add_arguments`.
    """
    if args.stage in ("train", "all", "exit"):
        require_stopping_rule(args)  # before the slow target load and generation, not after
    if args.stage == "exit" and args.exit_layers is None:
        raise ValueError("--stage exit tunes the exit after the first K target layers: pass --exit-layers K.")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    stages = STAGES if args.stage == "all" else (args.stage,)
    device = resolve_device(args.device)  # before the slow target load
    target, tokenizer = load_target(args.target)
    target.to(device)
    for stage in stages:
        if stage == "generate":
            tokens = generate_data(args, target, tokenizer)
            print(f"generate: wrote {tokens} target positions to {Path(args.out) / 'data'}")
        elif stage == "train":
            train_draft(args, target)
        elif stage == "exit":
            print(json.dumps(tune_exit(args, target, tokenizer), indent=2))
        elif stage == "evaluate":
            report = evaluate_checkpoint(args, target, tokenizer)
            print(json.dumps(report, indent=2))
        else:
            path = export_checkpoint(args, target, tokenizer)
            print(f"export: wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m specexec_hf.tools.distill``."""
    parser = argparse.ArgumentParser(prog="python -m specexec_hf.tools.distill", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))

