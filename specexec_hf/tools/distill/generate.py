"""Stage 1: the target answers prompts and its top-k log-probs are kept on the way."""

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
from transformers import DynamicCache, PreTrainedModel

from ..prompts import encode_chats
from .sources import eos_token_ids, read_prompts


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
