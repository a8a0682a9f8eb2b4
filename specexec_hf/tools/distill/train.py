"""Stage 2: train the draft against the stored distributions."""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM, PreTrainedModel

from ...models.drafts import (
    HEAD_TOKEN_IDS,
    build_draft,
    draft_config_from_target,
    own_state_dict,
    read_draft_export,
    share_target_embeddings,
)
from ...models.vocab import frequent_tokens
from .generate import save_atomically, shard_paths, target_token_counts


@dataclass(frozen=True)
class DraftSpec:
    """What a draft is, as stored in checkpoints and in the exported JSON.

    Args:
        num_hidden_layers: Decoder layers.
        init_layers: Target layers the draft's layers were copied from.
        share_embeddings: Whether the embedding/LM head is the target's frozen one (not part of the draft file).
    """

    num_hidden_layers: int
    init_layers: tuple[int, ...]
    share_embeddings: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_hidden_layers": self.num_hidden_layers,
            "init_layers": list(self.init_layers),
            "share_embeddings": self.share_embeddings,
        }


def draft_spec_from_args(args: argparse.Namespace, target: PreTrainedModel) -> DraftSpec:
    """The draft described by ``--layers``/``--init-layers``/``--share-embeddings``, checked against the target.

    By default the draft's layers copy the target's first ``layers - 1`` layers and its last one: the draft
    starts with the target's input processing and its final, prediction-shaping layer. (On SmolLM2-135M a
    3-layer draft from layers 0, 1, 29 reached a lower KL after a short run than 0, 14, 29 or 0, 1, 2.)
    """
    target_layers = target.config.num_hidden_layers
    if args.init_layers:
        init_layers = tuple(int(index) for index in args.init_layers.split(","))
    else:
        init_layers = (*range(min(args.layers - 1, target_layers - 1)), target_layers - 1)
    if len(init_layers) != args.layers:
        raise ValueError(f"--init-layers lists {len(init_layers)} layers but --layers is {args.layers}.")
    if any(not 0 <= index < target_layers for index in init_layers):
        raise ValueError(f"--init-layers {init_layers} must lie in [0, {target_layers - 1}] for this target.")
    return DraftSpec(args.layers, init_layers, args.share_embeddings)


def new_draft(target: PreTrainedModel, spec: DraftSpec) -> LlamaForCausalLM:
    """A draft whose layers and final norm start as copies of the target's, with the embedding set up per spec.

    Args:
        target: The (Llama-style) target.
        spec: Draft shape and initialisation.
    """
    draft = LlamaForCausalLM(draft_config_from_target(target.config, spec.num_hidden_layers))
    for draft_layer, target_index in zip(draft.model.layers, spec.init_layers):
        draft_layer.load_state_dict(target.model.layers[target_index].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    if spec.share_embeddings:
        share_target_embeddings(draft, target)
    else:
        draft.get_input_embeddings().weight.data.copy_(target.get_input_embeddings().weight.data)
        draft.get_input_embeddings().weight.requires_grad_(True)
    return draft


def draft_weights(draft: PreTrainedModel, spec: DraftSpec) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint or export must hold: the draft's own ones, plus the embedding if not shared."""
    return own_state_dict(draft) if spec.share_embeddings else dict(draft.state_dict())


def restore_draft(target: PreTrainedModel, spec: DraftSpec, weights: dict[str, torch.Tensor]) -> PreTrainedModel:
    """Rebuild a draft from saved tensors (see :func:`draft_weights`)."""
    config = draft_config_from_target(target.config, spec.num_hidden_layers)
    if spec.share_embeddings:
        return build_draft(target, config, weights)
    draft = LlamaForCausalLM(config)
    draft.load_state_dict(weights)
    return draft.eval()


@dataclass
class Example:
    """One training sequence: tokens, stored target distributions, and per-position loss weights."""

    input_ids: torch.Tensor  # (L,) int64
    topk_ids: torch.Tensor  # (L - 1, k) int64, rows before topk_start unused
    topk_log_probs: torch.Tensor  # (L - 1, k) float32
    weights: torch.Tensor  # (L - 1,) float32, 0 where no distribution is stored

    def __len__(self) -> int:
        return len(self.input_ids)


def examples_from_rows(rows: list[dict[str, Any]], prompt_weight: float, max_seq_len: int) -> list[Example]:
    """Turn stored generation rows into training examples.

    Args:
        rows: Records written by :func:`generate_with_top_k`.
        prompt_weight: Loss weight of positions that predict a prompt token (answer positions weigh 1).
        max_seq_len: Sequences are cut to this many tokens.
    """
    examples = []
    for row in rows:
        length = min(len(row["input_ids"]), max_seq_len)
        start = row["topk_start"]
        if length - 1 <= start:
            continue
        k = row["topk_ids"].shape[1]
        topk_ids = torch.zeros((length - 1, k), dtype=torch.long)
        topk_log_probs = torch.zeros((length - 1, k), dtype=torch.float32)
        topk_ids[start:] = row["topk_ids"][: length - 1 - start].long()
        topk_log_probs[start:] = row["topk_log_probs"][: length - 1 - start].float()
        weights = torch.zeros(length - 1)
        weights[start:] = 1.0
        # Position p predicts token p + 1, which is a prompt token while p + 1 < prompt_length.
        weights[start : max(row["prompt_length"] - 1, start)] = prompt_weight
        examples.append(Example(row["input_ids"][:length].long(), topk_ids, topk_log_probs, weights))
    return examples


def load_examples(paths: list[Path], prompt_weight: float, max_seq_len: int) -> list[Example]:
    """Read shards into training examples (see :func:`examples_from_rows`)."""
    return [
        example
        for path in paths
        for example in examples_from_rows(torch.load(path)["rows"], prompt_weight, max_seq_len)
    ]


def batches(examples: list[Example], batch_tokens: int, rng: random.Random) -> list[list[Example]]:
    """Shuffle and group examples into batches of about ``batch_tokens`` positions.

    Sequences of similar length go together (sorted inside shuffled pools) to limit right padding.

    Args:
        examples: The training set.
        batch_tokens: Target positions per batch.
        rng: Shuffle source.
    """
    order = list(examples)
    rng.shuffle(order)
    pool_size = 64
    grouped: list[list[Example]] = []
    for pool_start in range(0, len(order), pool_size):
        current: list[Example] = []
        for example in sorted(order[pool_start : pool_start + pool_size], key=len):
            if current and (len(current) + 1) * len(example) > batch_tokens:
                grouped.append(current)
                current = []
            current.append(example)
        if current:
            grouped.append(current)
    rng.shuffle(grouped)
    return grouped


def collate(batch: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad a batch into ``(input_ids, topk_ids, topk_log_probs, weights)``.

    Right padding needs no attention mask: causal attention keeps real positions from seeing the pads, and
    pad positions carry zero loss weight.
    """
    width = max(len(example) for example in batch)
    k = batch[0].topk_ids.shape[1]
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
    topk_ids = torch.zeros((len(batch), width - 1, k), dtype=torch.long)
    topk_log_probs = torch.zeros((len(batch), width - 1, k))
    weights = torch.zeros((len(batch), width - 1))
    for row, example in enumerate(batch):
        length = len(example)
        input_ids[row, :length] = example.input_ids
        topk_ids[row, : length - 1] = example.topk_ids
        topk_log_probs[row, : length - 1] = example.topk_log_probs
        weights[row, : length - 1] = example.weights
    return input_ids, topk_ids, topk_log_probs, weights


def top_k_kl(
    draft_logits: torch.Tensor, topk_columns: torch.Tensor, topk_log_probs: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Weighted mean KL(target || draft) over the partition {each scored stored top-k token, all other tokens}.

    The target's mass outside its stored top-k is one "tail" bucket, compared with the draft's mass outside the
    same tokens. This is the exact KL between the two distributions coarsened to that partition: it needs no
    guess about how the target spreads its tail, and it still penalises a draft that puts mass elsewhere.
    A stored token the draft does not score (column ``-1``, outside a ``--draft-vocab`` head) joins the tail.

    Args:
        draft_logits: ``(batch, positions, columns)`` the draft's scores, one column per scored token.
        topk_columns: ``(batch, positions, k)`` the column of each of the target's top-k tokens, ``-1`` if unscored.
        topk_log_probs: ``(batch, positions, k)`` their log-probs, normalised over the full vocabulary.
        weights: ``(batch, positions)`` loss weights (0 for padding / positions without stored targets).
    """
    scored = topk_columns >= 0
    draft_top = torch.log_softmax(draft_logits.float(), dim=-1).gather(-1, topk_columns.clamp(min=0))
    target_probs = topk_log_probs.exp() * scored
    target_tail = (1.0 - target_probs.sum(-1)).clamp(min=1e-6)
    draft_tail = (1.0 - (draft_top.exp() * scored).sum(-1)).clamp(min=1e-6)
    per_position = (target_probs * (topk_log_probs - draft_top)).sum(-1) + target_tail * (
        target_tail.log() - draft_tail.log()
    )
    return (per_position * weights).sum() / weights.sum().clamp(min=1e-6)


class ScoredTokens:
    """The tokens whose draft scores the loss compares with the target's: all of them, or a ``--draft-vocab`` set.

    Scoring only the tokens the exported head will keep makes each training step cheaper (the LM head is most of
    a small draft's compute) and trains exactly the distribution the shipped draft proposes from.

    Args:
        vocab_size: The full vocabulary size.
        token_ids: Sorted ids of the scored tokens, or ``None`` for the full vocabulary.
    """

    def __init__(self, vocab_size: int, token_ids: torch.Tensor | None = None):
        self.token_ids = token_ids
        if token_ids is None:
            self.column_of = torch.arange(vocab_size)
        else:
            self.column_of = torch.full((vocab_size,), -1, dtype=torch.long)
            self.column_of[token_ids] = torch.arange(token_ids.numel())

    def to(self, device: torch.device | str) -> ScoredTokens:
        """Move the lookup tensors to the draft's device (checkpoints still get the ids from host memory)."""
        self.column_of = self.column_of.to(device)
        self.token_ids = None if self.token_ids is None else self.token_ids.to(device)
        return self

    def loss(
        self,
        draft: PreTrainedModel,
        input_ids: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_log_probs: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        """:func:`top_k_kl` of the draft's next-token scores at every position but the last."""
        input_ids, topk_ids, topk_log_probs, weights = (
            tensor.to(draft.device) for tensor in (input_ids, topk_ids, topk_log_probs, weights)
        )
        hidden = draft.model(input_ids=input_ids).last_hidden_state[:, :-1]
        head = draft.get_output_embeddings().weight
        # Indexing inside the step keeps a trainable (unshared) head's gradient flowing to its full weight.
        scores = hidden @ (head if self.token_ids is None else head[self.token_ids]).T
        return top_k_kl(scores, self.column_of[topk_ids], topk_log_probs, weights)


def head_token_ids(
    args: argparse.Namespace, vocab_size: int, trained_with: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The tokens a ``--draft-vocab N`` draft's head scores (``None``, the full vocabulary, without the option).

    A draft keeps the set it was trained with when that set has N tokens: recounting the data would pick another
    set as soon as shards were added since, and export a head the draft never learned. Only a fresh draft, or a
    new N, gets the N tokens the target ranks high most often in the data.

    Args:
        args: Parsed command line (``--draft-vocab``, ``--out``).
        vocab_size: The full vocabulary size.
        trained_with: The set saved with the draft's checkpoint or export, if any.
    """
    if not args.draft_vocab:
        return None
    if trained_with is not None and trained_with.numel() == args.draft_vocab:
        return trained_with.long()
    return frequent_tokens(target_token_counts(Path(args.out) / "data", vocab_size), args.draft_vocab)


def learning_rate(base_lr: float, step: int, warmup_steps: int, progress: float) -> float:
    """Linear warm-up, then cosine decay to 10% of ``base_lr`` as ``progress`` goes from 0 to 1.

    Args:
        base_lr: Peak learning rate.
        step: Optimiser steps taken.
        warmup_steps: Warm-up length.
        progress: Fraction of the run done (by steps or by time, whichever budget applies).
    """
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    return base_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def latest_checkpoint(out: str | Path) -> Path | None:
    """The newest ``step_*.pt`` checkpoint of a run, if any."""
    paths = sorted(checkpoint_dir(out).glob("step_*.pt"))
    return paths[-1] if paths else None


def resolve_checkpoint(args: argparse.Namespace) -> Path:
    """``--checkpoint`` if given, else the run's ``best.pt``, else its newest checkpoint."""
    if args.checkpoint:
        path = Path(args.checkpoint)
    else:
        best = checkpoint_dir(args.out) / "best.pt"
        path = best if best.is_file() else latest_checkpoint(args.out)
    if path is None or not path.is_file():
        looked = args.checkpoint or checkpoint_dir(args.out)
        raise FileNotFoundError(f"No checkpoint found (looked for {looked}); run --stage train first.")
    return path


def load_exported_draft(path: Path, target: PreTrainedModel) -> tuple[PreTrainedModel, DraftSpec, torch.Tensor | None]:
    """An exported draft (``path`` beside its ``.json``) in float32, ready to train further (``--init-from``).

    Returns the draft with its full-vocabulary head, its spec, and the token ids its exported head scored (``None``
    when it scored all), so training goes on over the same tokens.

    Args:
        path: The ``.safetensors`` file written by the export stage (e.g. the shipped SmolLM2 draft).
        target: The target it was distilled from (its embedding is shared again).
    """
    meta_path = path.with_suffix(".json")
    if not path.is_file() or not meta_path.is_file():
        raise FileNotFoundError(
            f"--init-from needs an exported draft: {path} and {meta_path.name} beside it (written by --stage export)."
        )
    meta, weights = read_draft_export(path, torch.float32)
    spec = DraftSpec(meta["num_hidden_layers"], tuple(meta["init_layers"]), meta["share_embeddings"])
    if not spec.share_embeddings:
        raise ValueError(
            f"--init-from {path}: only drafts that share the target's embedding can be trained further; "
            "distil this one from its checkpoint with --resume instead."
        )
    token_ids = weights.pop(HEAD_TOKEN_IDS, None)
    return restore_draft(target, spec, weights), spec, token_ids


def load_checkpoint_draft(path: Path, target: PreTrainedModel) -> tuple[PreTrainedModel, DraftSpec, dict[str, Any]]:
    """Rebuild the draft saved in a checkpoint; also returns its spec and the full checkpoint dict."""
    state = torch.load(path, weights_only=False, map_location="cpu")
    spec = DraftSpec(**{**state["spec"], "init_layers": tuple(state["spec"]["init_layers"])})
    return restore_draft(target, spec, state["draft"]), spec, state


@torch.no_grad()
def validation_loss(
    draft: PreTrainedModel, examples: list[Example], batch_tokens: int, scored: ScoredTokens
) -> float:
    """Mean top-k KL of the draft over the ``scored`` tokens on held-out examples (NaN when there are none)."""
    if not examples:
        return math.nan
    total, weight = 0.0, 0.0
    for batch in batches(examples, batch_tokens, random.Random(0)):
        input_ids, topk_ids, topk_log_probs, weights = collate(batch)
        loss = scored.loss(draft, input_ids, topk_ids, topk_log_probs, weights)
        total += float(loss) * float(weights.sum())
        weight += float(weights.sum())
    return total / weight


@dataclass
class TrainState:
    """Progress that a checkpoint must carry for ``--resume`` to continue seamlessly."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    seconds: float = 0.0
    tokens: float = 0.0
    best_val: float = math.inf
    draft_vocab: int = 0  # the --draft-vocab the loss (and so best_val) was measured with


def save_checkpoint(
    out: str | Path,
    draft: PreTrainedModel,
    spec: DraftSpec,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    val: float,
    scored: ScoredTokens,
) -> Path:
    """Write ``step_XXXXXXX.pt`` (keeping the three newest) and refresh ``best.pt`` on a new best val loss.

    Without held-out shards ``val`` is NaN and every checkpoint counts as the best (the newest wins). The
    checkpoint keeps the token set the loss scored, which evaluation and export then give the draft's head.
    """
    is_best = math.isnan(val) or val <= state.best_val
    if not math.isnan(val):
        state.best_val = min(state.best_val, val)
    payload = {
        "spec": spec.as_dict(),
        "draft": {name: tensor.detach().clone() for name, tensor in draft_weights(draft, spec).items()},
        "optimizer": optimizer.state_dict(),
        "state": vars(state).copy(),
        "draft_token_ids": None if scored.token_ids is None else scored.token_ids.cpu(),
        "val_loss": val,
    }
    path = checkpoint_dir(out) / f"step_{state.step:07d}.pt"
    save_atomically(payload, path)
    if is_best:
        save_atomically(payload, checkpoint_dir(out) / "best.pt")
    for old in sorted(checkpoint_dir(out).glob("step_*.pt"))[:-3]:
        old.unlink()
    return path


def require_stopping_rule(args: argparse.Namespace) -> None:
    """Raise unless ``--epochs`` or ``--train-minutes`` tells training when to stop."""
    if not (args.epochs or args.train_minutes):
        raise ValueError("Training needs a stopping rule: give --epochs or --train-minutes.")


def train_draft(args: argparse.Namespace, target: PreTrainedModel) -> PreTrainedModel:
    """Stage ``train``: fit the draft to the stored target distributions, checkpointing as it goes.

    Args:
        args: Parsed command line (see :func:`add_arguments`).
        target: The target (source of the initial layers and of the shared embedding).

    Returns:
        The trained draft.
    """
    require_stopping_rule(args)
    paths = shard_paths(Path(args.out) / "data")
    if len(paths) <= args.holdout_shards:
        raise FileNotFoundError(
            f"Need more than {args.holdout_shards} data shards in {Path(args.out) / 'data'}; run --stage generate."
        )
    holdout = load_examples(paths[: args.holdout_shards], args.prompt_weight, args.max_seq_len)
    examples = load_examples(paths[args.holdout_shards :], args.prompt_weight, args.max_seq_len)
    positions = sum(float(example.weights.gt(0).sum()) for example in examples)
    resume_from = latest_checkpoint(args.out) if args.resume else None
    state = TrainState(draft_vocab=args.draft_vocab)
    trained_with = None
    if resume_from is not None:
        draft, spec, saved = load_checkpoint_draft(resume_from, target)
        state, trained_with = TrainState(**saved["state"]), saved.get("draft_token_ids")
        if state.draft_vocab != args.draft_vocab:
            # A loss over other tokens is another quantity: earlier val losses no longer rank checkpoints.
            print(f"train: --draft-vocab {state.draft_vocab} -> {args.draft_vocab}; best val loss reset")
            state.best_val, state.draft_vocab = math.inf, args.draft_vocab
    elif args.init_from:
        draft, spec, trained_with = load_exported_draft(Path(args.init_from), target)
    else:
        spec = draft_spec_from_args(args, target)
        draft = new_draft(target, spec)
    scored = ScoredTokens(target.config.vocab_size, head_token_ids(args, target.config.vocab_size, trained_with))
    draft.to(target.device).train()
    scored.to(target.device)
    trainable = [parameter for parameter in draft.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
    if resume_from is not None:
        optimizer.load_state_dict(saved["optimizer"])
    epoch_batches = len(batches(examples, args.batch_tokens, random.Random(0)))
    total_steps = math.ceil(args.epochs * epoch_batches) if args.epochs else None
    time_budget = args.train_minutes * 60 if args.train_minutes else None
    print(
        f"train: {len(examples)} sequences, {positions:.0f} target positions, {epoch_batches} batches/epoch, "
        f"draft {spec.as_dict()}, {sum(p.numel() for p in trainable) / 1e6:.2f}M trainable parameters"
        + (f", resuming from {resume_from} at step {state.step}" if resume_from else "")
        + (f", starting from the exported {args.init_from}" if args.init_from and not resume_from else "")
    )
    progress = tqdm(total=total_steps, initial=state.step, desc="train (steps)", dynamic_ncols=True)
    started, last_checkpoint = time.monotonic() - state.seconds, time.monotonic()
    done = False
    while not done:
        epoch_plan = batches(examples, args.batch_tokens, random.Random(args.seed * 1_000_003 + state.epoch))
        for batch in epoch_plan[state.batch_in_epoch :]:
            state.seconds = time.monotonic() - started
            step_progress = state.step / total_steps if total_steps else 0.0
            time_progress = state.seconds / time_budget if time_budget else 0.0
            if max(step_progress, time_progress) >= 1.0:
                done = True
                break
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args.lr, state.step, args.warmup_steps, max(step_progress, time_progress))
            input_ids, topk_ids, topk_log_probs, weights = collate(batch)
            loss = scored.loss(draft, input_ids, topk_ids, topk_log_probs, weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            state.step += 1
            state.batch_in_epoch += 1
            state.tokens += float(weights.gt(0).sum())
            progress.update(1)
            progress.set_postfix(
                loss=f"{float(loss.detach()):.3f}", epoch=state.epoch, lr=f"{optimizer.param_groups[0]['lr']:.2e}"
            )
            if time.monotonic() - last_checkpoint > args.checkpoint_minutes * 60:
                _checkpoint_with_validation(args, draft, spec, optimizer, state, holdout, scored, progress)
                last_checkpoint = time.monotonic()
        else:
            state.epoch += 1
            state.batch_in_epoch = 0
    state.seconds = time.monotonic() - started
    _checkpoint_with_validation(args, draft, spec, optimizer, state, holdout, scored, progress)
    progress.close()
    return draft.eval()


def _checkpoint_with_validation(
    args: argparse.Namespace,
    draft: PreTrainedModel,
    spec: DraftSpec,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    holdout: list[Example],
    scored: ScoredTokens,
    progress: tqdm,
) -> None:
    """Measure the held-out loss, save a checkpoint, and log both."""
    draft.eval()
    val = validation_loss(draft, holdout, args.batch_tokens, scored)
    draft.train()
    path = save_checkpoint(args.out, draft, spec, optimizer, state, val, scored)
    progress.write(
        f"checkpoint {path.name}: step {state.step}, epoch {state.epoch}, {state.tokens:.0f} positions seen, "
        f"{state.seconds / 60:.1f} min, val KL {val:.4f}"
    )
