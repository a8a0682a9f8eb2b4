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

``--device cuda`` runs any stage on a GPU; data shards and checkpoints are device-free either way.

Run as ``specexec-hf distill ...`` or ``python -m specexec_hf.distill ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaForCausalLM, PreTrainedModel

from .models import (
    HEAD_TOKEN_IDS,
    INT8_SCALE_SUFFIX,
    build_draft,
    dequantize_rows_int8,
    draft_config_from_target,
    load_default_target,
    own_state_dict,
    quantize_rows_int8,
    read_draft_export,
    share_target_embeddings,
)
from .prompts import encode_chats, load_prompt_records, prompt_file
from .vocab import frequent_tokens, restrict_draft_vocabulary

STAGES = ("generate", "train", "evaluate", "export")
DEFAULT_TARGET = "smollm2"


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------
# Stage 1: the target answers prompts and its top-k log-probs are kept on the way
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One answer to generate: prompt ``prompt_index``; ``sample_index`` 0 is greedy, later ones sampled."""

    prompt_index: int
    sample_index: int

    @property
    def greedy(self) -> bool:
        return self.sample_index == 0


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(input_ids, attention_mask)`` so every row's last token is aligned.

    Args:
        sequences: Token id lists.
        pad_id: Filler id (masked out, its value does not matter).
    """
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, width - len(sequence) :] = torch.tensor(sequence)
        attention_mask[row, width - len(sequence) :] = 1
    return input_ids, attention_mask


def top_k_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-probs (normalised over the whole vocabulary) and their ids.

    Args:
        logits: ``(..., vocab)`` raw logits.
        k: How many to keep.

    Returns:
        ``(ids int32, log_probs float16)``, each ``(..., k)``, sorted by decreasing probability.
    """
    values, ids = torch.topk(logits.float(), k, dim=-1)
    log_probs = values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    return ids.to(torch.int32), log_probs.to(torch.float16)


def pick_next_tokens(
    logits: torch.Tensor, greedy_rows: torch.Tensor, temperature: float, generator: torch.Generator
) -> torch.Tensor:
    """Next token per row: argmax for greedy rows, a temperature sample for the others.

    Args:
        logits: ``(batch, vocab)`` last-position logits.
        greedy_rows: ``(batch,)`` bool.
        temperature: Sampling temperature of the non-greedy rows.
        generator: Random source for sampling.
    """
    chosen = logits.argmax(dim=-1)
    if not greedy_rows.all():
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        chosen = torch.where(greedy_rows, chosen, sampled)
    return chosen


@torch.inference_mode()
def generate_with_top_k(
    model: PreTrainedModel,
    prompts: list[list[int]],
    greedy_rows: list[bool],
    keep_prompt_rows: list[bool],
    *,
    max_new_tokens: int,
    top_k: int,
    temperature: float,
    eos_ids: set[int],
    pad_id: int,
    generator: torch.Generator,
) -> list[dict[str, Any]]:
    """Decode a batch of answers and record the target's top-k log-probs at every position.

    Args:
        model: The target.
        prompts: Token ids per row (chat-formatted prompts).
        greedy_rows: Per row, greedy decoding (True) or sampling (False).
        keep_prompt_rows: Per row, whether to keep the distributions over prompt positions too (kept once per
            prompt, since the duplicate rows of a prompt see the same ones).
        max_new_tokens: Answer length cap.
        top_k: Log-probs kept per position.
        temperature: Sampling temperature of the sampled rows.
        eos_ids: Tokens that end an answer (kept in the answer).
        pad_id: Left-padding id.
        generator: Random source for sampling.

    Returns:
        One record per row: ``input_ids`` (prompt + answer, int32), ``prompt_length``, ``topk_start`` (the first
        position whose distribution is stored), ``topk_ids``/``topk_log_probs`` (``(L - 1 - topk_start, k)``: the
        target's distribution over the token after each stored position), and ``greedy``.
    """
    device = model.device
    input_ids, attention_mask = (tensor.to(device) for tensor in left_pad(prompts, pad_id))
    batch, width = input_ids.shape
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache
    ).logits
    prompt_ids, prompt_log_probs = top_k_log_probs(logits, top_k)
    step_ids, step_log_probs = [prompt_ids[:, -1]], [prompt_log_probs[:, -1]]
    greedy_mask = torch.tensor(greedy_rows, device=device)
    eos = torch.tensor(sorted(eos_ids), device=device)
    answers = []
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    next_position = position_ids[:, -1] + 1
    last_logits = logits[:, -1]
    for _ in range(max_new_tokens):
        tokens = pick_next_tokens(last_logits, greedy_mask, temperature, generator)
        tokens = torch.where(finished, pad_id, tokens)
        answers.append(tokens)
        finished |= torch.isin(tokens, eos)
        if finished.all() or len(answers) == max_new_tokens:
            break
        attention_mask = torch.cat([attention_mask, (~finished).long().unsqueeze(-1)], dim=-1)
        last_logits = model(
            input_ids=tokens.unsqueeze(-1),
            attention_mask=attention_mask,
            position_ids=next_position.unsqueeze(-1),
            past_key_values=cache,
        ).logits[:, -1]
        next_position = next_position + 1
        ids, log_probs = top_k_log_probs(last_logits, top_k)
        step_ids.append(ids)
        step_log_probs.append(log_probs)
    # Records are saved and trained on from host memory, whatever device decoded them.
    answer_ids, eos = torch.stack(answers, dim=1).cpu(), eos.cpu()
    answer_topk_ids, answer_topk_log_probs = (torch.stack(steps, dim=1).cpu() for steps in (step_ids, step_log_probs))
    prompt_ids, prompt_log_probs = prompt_ids.cpu(), prompt_log_probs.cpu()
    return [
        _row_record(
            prompts[row],
            answer_ids[row],
            eos,
            (prompt_ids[row, width - len(prompts[row]) : -1], prompt_log_probs[row, width - len(prompts[row]) : -1]),
            (answer_topk_ids[row], answer_topk_log_probs[row]),
            keep_prompt_rows[row],
            greedy_rows[row],
        )
        for row in range(batch)
    ]


def _row_record(
    prompt: list[int],
    answer: torch.Tensor,
    eos: torch.Tensor,
    prompt_topk: tuple[torch.Tensor, torch.Tensor],
    answer_topk: tuple[torch.Tensor, torch.Tensor],
    keep_prompt: bool,
    greedy: bool,
) -> dict[str, Any]:
    """Cut one row of a decoded batch at its first EOS and align its stored distributions with its tokens.

    ``answer_topk[i]`` is the distribution that produced answer token ``i``; the distribution after the last
    kept token is dropped since no token follows it.

    Args:
        prompt: The row's prompt ids (unpadded).
        answer: The row's decoded ids; positions after its EOS hold padding.
        eos: Ids that end an answer.
        prompt_topk: ``(ids, log_probs)`` at prompt positions but the last (which predicts answer token 0).
        answer_topk: ``(ids, log_probs)`` that produced each answer token.
        keep_prompt: Store the prompt-position distributions too.
        greedy: Whether the row was decoded greedily (recorded for the data's users).
    """
    ended = torch.isin(answer, eos).nonzero()
    answer_length = int(ended[0]) + 1 if len(ended) else len(answer)
    answer_part = [tensor[:answer_length] for tensor in answer_topk]
    if keep_prompt:
        topk_ids, topk_log_probs = (torch.cat([p, a]) for p, a in zip(prompt_topk, answer_part))
        topk_start = 0
    else:
        topk_ids, topk_log_probs = answer_part
        topk_start = len(prompt) - 1
    return {
        "input_ids": torch.cat([torch.tensor(prompt), answer[:answer_length]]).to(torch.int32),
        "prompt_length": len(prompt),
        "topk_start": topk_start,
        "topk_ids": topk_ids.clone(),
        "topk_log_probs": topk_log_probs.clone(),
        "greedy": greedy,
    }


def plan_jobs(num_prompts: int, samples_per_prompt: int, seed: int) -> list[Job]:
    """Generation order: prompts shuffled; each prompt's greedy answer next to its sampled ones.

    Keeping a prompt's rows together gives batches of equal prompt lengths (little padding), and a run cut
    short by its time budget still covers many different prompts.

    Args:
        num_prompts: Size of the prompt set.
        samples_per_prompt: Sampled answers per prompt on top of the greedy one.
        seed: Shuffle seed.
    """
    order = list(range(num_prompts))
    random.Random(seed).shuffle(order)
    return [Job(prompt, sample) for prompt in order for sample in range(1 + samples_per_prompt)]


def shard_paths(data_dir: Path) -> list[Path]:
    """The finished shards in a data directory, in write order."""
    return sorted(data_dir.glob("shard_*.pt"))


def save_atomically(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary name, then rename, so a crash never leaves a truncated file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(obj, partial)
    partial.replace(path)


def generate_data(args: argparse.Namespace, target: PreTrainedModel, tokenizer: Any) -> int:
    """Stage ``generate``: answer the training prompts and write shards until done or out of time.

    Args:
        args: Parsed command line (see :func:`add_arguments`).
        target: The target model.
        tokenizer: Its tokenizer.

    Returns:
        Number of target tokens (prompt and answer positions with a stored distribution) written this run.
    """
    data_dir = Path(args.out) / "data"
    prompts = encode_chats(tokenizer, read_prompts(args.prompts))
    jobs = plan_jobs(len(prompts), args.samples_per_prompt, args.seed)
    jobs = [job for job in jobs if job.prompt_index >= args.first_prompt]
    done = {
        (job["prompt_index"], job["sample_index"]) for path in shard_paths(data_dir) for job in torch.load(path)["jobs"]
    }
    pending = [job for job in jobs if (job.prompt_index, job.sample_index) not in done]
    generator = torch.Generator(device=target.device).manual_seed(args.seed + len(done))
    eos_ids = eos_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    deadline = time.monotonic() + args.gen_minutes * 60 if args.gen_minutes else math.inf
    next_shard = len(shard_paths(data_dir))
    written = 0
    progress = tqdm(
        total=len(jobs), initial=len(jobs) - len(pending), desc="generate (answers)", unit="ans", dynamic_ncols=True
    )
    for start in range(0, len(pending), args.gen_batch_size):
        if time.monotonic() > deadline:
            progress.write(f"generation time budget of {args.gen_minutes} min reached")
            break
        batch = pending[start : start + args.gen_batch_size]
        rows = generate_with_top_k(
            target,
            [prompts[job.prompt_index] for job in batch],
            [job.greedy for job in batch],
            # Every prompt has exactly one greedy row; its copy of the prompt distributions is the one kept.
            [job.greedy for job in batch],
            max_new_tokens=args.max_new_tokens,
            top_k=args.top_k,
            temperature=args.temperature,
            eos_ids=eos_ids,
            pad_id=pad_id,
            generator=generator,
        )
        for job, row in zip(batch, rows):
            row.update(prompt_index=job.prompt_index, sample_index=job.sample_index)
        save_atomically(
            {"jobs": [{"prompt_index": j.prompt_index, "sample_index": j.sample_index} for j in batch], "rows": rows},
            data_dir / f"shard_{next_shard:06d}.pt",
        )
        next_shard += 1
        new_tokens = sum(len(row["topk_ids"]) for row in rows)
        written += new_tokens
        progress.update(len(batch))
        progress.set_postfix(tokens=written)
    progress.close()
    return written


# ----------------------------------------------------------------------------------------------------------
# Stage 2: train the draft against the stored distributions
# ----------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------
# Stage 3: held-out agreement; stage 4: export
# ----------------------------------------------------------------------------------------------------------


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


def target_token_counts(data_dir: Path, vocab_size: int, top: int = 8) -> torch.Tensor:
    """``[vocab_size]`` how often each token is among the target's ``top`` likeliest in the generated data."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    paths = shard_paths(data_dir)
    if not paths:
        raise FileNotFoundError(f"--draft-vocab counts tokens in the generated data, but {data_dir} has no shards.")
    for path in paths:
        for row in torch.load(path)["rows"]:
            counts += torch.bincount(row["topk_ids"][:, :top].long().reshape(-1), minlength=vocab_size)
    return counts


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


def stored_as_int8(tensor: torch.Tensor) -> bool:
    """Whether an int8 export stores ``tensor`` as int8: its floating matrices; vectors stay float16."""
    return tensor.is_floating_point() and tensor.ndim == 2


def round_trip_int8(weights: dict[str, torch.Tensor]) -> None:
    """Replace each matrix in ``weights`` (tensors sharing the draft's parameters) by its int8 round trip."""
    with torch.no_grad():
        for tensor in weights.values():
            if stored_as_int8(tensor):
                tensor.copy_(dequantize_rows_int8(*quantize_rows_int8(tensor)))


def export_tensors(weights: dict[str, torch.Tensor], export_dtype: str) -> dict[str, torch.Tensor]:
    """The tensors an export file holds, in host memory.

    Floating tensors are cast to ``export_dtype``; with ``"int8"`` each matrix is stored as int8 plus per-row
    scales (``NAME.int8_scale``, see :func:`specexec_hf.models.quantize_rows_int8`) and vectors as float16.

    Args:
        weights: The draft's own tensors (see :func:`draft_weights`).
        export_dtype: ``"float16"``, ``"bfloat16"``, ``"float32"`` or ``"int8"``.
    """
    stored = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().cpu()
        if export_dtype == "int8" and stored_as_int8(tensor):
            stored[name], stored[name + INT8_SCALE_SUFFIX] = quantize_rows_int8(tensor)
        elif tensor.is_floating_point():
            stored[name] = tensor.to(torch.float16 if export_dtype == "int8" else getattr(torch, export_dtype))
        else:
            stored[name] = tensor
    return {name: tensor.contiguous() for name, tensor in stored.items()}


def export_checkpoint(args: argparse.Namespace, target: PreTrainedModel, tokenizer: Any) -> Path:
    """Stage ``export``: write the draft's weights as safetensors plus a JSON with its config and report.

    The JSON (same name, ``.json``) is what :func:`specexec_hf.models.load_default_pair` reads to rebuild the
    draft's config; it also records the training progress and the held-out agreement report (reused from
    ``OUT/agreement.json`` when it describes the same checkpoint and vocabulary).
    """
    path, draft, spec, saved = load_evaluated_draft(args, target)
    int8 = args.export_dtype == "int8"
    if int8:
        round_trip_int8(draft_weights(draft, spec))  # the report must describe the weights that ship
    report_path = Path(args.out) / "agreement.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    evaluated = (str(path), saved["state"]["step"], args.draft_vocab or None, int8)
    reported = None if report is None else (
        report["checkpoint"], report["step"], report.get("draft_vocab"), report.get("int8_weights", False)
    )
    if reported != evaluated:
        report = agreement_report(args, path, saved, draft, target, tokenizer, int8_weights=int8)
    destination = Path(args.export_path) if args.export_path else Path(args.out) / "draft.safetensors"
    destination.parent.mkdir(parents=True, exist_ok=True)
    save_file(export_tensors(draft_weights(draft, spec), args.export_dtype), destination)
    destination.chmod(0o644)  # safetensors writes owner-only files; a draft shipped in a package must be readable
    meta = {
        "target": args.target,
        **spec.as_dict(),
        "intermediate_size": draft.config.intermediate_size,
        "draft_vocab": args.draft_vocab or None,
        "dtype": args.export_dtype,
        "training": {key: saved["state"][key] for key in ("step", "epoch", "seconds", "tokens")},
        "val_kl": saved["val_loss"],
        "agreement": report,
    }
    destination.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    return destination


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the distillation options to ``parser`` (used by ``specexec-hf distill`` and ``python -m``).

    Args:
        parser: The (sub)command parser to extend.
    """
    parser.add_argument("--target", default=DEFAULT_TARGET, help="'smollm2' (packaged default) or a model path.")
    parser.add_argument("--out", required=True, help="Run directory for data shards, checkpoints and reports.")
    parser.add_argument("--stage", choices=(*STAGES, "all"), default="all", help="Which stage to run.")
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
    evaluation = parser.add_argument_group("evaluate / export")
    evaluation.add_argument("--eval-prompts", default="eval", help="'eval' (shipped held-out set) or a JSONL file.")
    evaluation.add_argument("--eval-limit", type=int, default=None, help="Evaluate on the first N eval prompts.")
    evaluation.add_argument("--checkpoint", default=None, help="Checkpoint to evaluate/export (default: newest).")
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
    if args.stage in ("train", "all"):
        require_stopping_rule(args)  # before the slow target load and generation, not after
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
        elif stage == "evaluate":
            report = evaluate_checkpoint(args, target, tokenizer)
            print(json.dumps(report, indent=2))
        else:
            path = export_checkpoint(args, target, tokenizer)
            print(f"export: wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m specexec_hf.distill``."""
    parser = argparse.ArgumentParser(prog="python -m specexec_hf.distill", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
