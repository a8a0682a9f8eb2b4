"""How far a draft's probabilities are to be trusted when ranking SpecExec's tree under greedy decoding.

SpecExec keeps the tree nodes with the highest cumulative draft log-probability. Under greedy decoding a node is
accepted when every token on its path is the target's argmax, so the ideal rank is the log-probability *that the
target's argmax is that token*. A distilled draft imitates the target's full distribution instead, which is
flatter than "which token wins": its probabilities are miscalibrated for that question. One temperature fixes
most of it. :func:`fit_greedy_temperature` picks the ``T`` whose ``softmax(draft_logits / T)`` best predicts the
target's greedy tokens (lowest cross-entropy), and :func:`calibrate_draft_temperature` stores it on the draft,
where greedy ``generate()`` calls find it (an explicit ``draft_temperature=`` still wins). The tree's shape is
all it changes: outputs stay exactly the target's. :func:`fit_greedy_context_match` fits, on the same answers,
the weights of context matching's guesses (:mod:`specexec_hf.core.context_match`) at that temperature, and
:func:`fit_greedy_acceptance_map` the acceptance map (:mod:`specexec_hf.core.acceptance_map`) that greedy walks
over those answers teach, at that temperature and those weights: greedy ``generate()`` calls start their online map
from it instead of from the draft's raw probabilities.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from .. import models
from ..core.acceptance_map import AcceptanceMap
from ..core.config import SpecExecConfig
from ..core.context_match import ContextIndex, mix_context_guesses
from ..hf.calibrated import (
    ACCEPTANCE_MAP_ATTRIBUTE,
    ACCEPTANCE_MAP_KEY,
    GREEDY_TEMPERATURE_ATTRIBUTE,
    calibrated_context_match_weights,
    greedy_draft_temperature,
)
from .acceptance import continuation_logits
from .distill.generate import plan_jobs
from .distill.sources import read_prompts
from .prompts import encode_chats

DEFAULT_CONTEXT_MATCH_ORDERS = 6

_SEARCH_BOUNDS = (0.05, 20.0)  # inverse temperatures searched, so temperatures 20 down to 0.05
_SEARCH_STEPS = 60


@dataclass(frozen=True)
class TemperatureFit:
    """Result of :func:`fit_greedy_temperature`.

    Args:
        temperature: The fitted draft temperature.
        positions: Continuation positions the fit used (those whose target token the draft can propose).
        cross_entropy: Mean cross-entropy of the target's greedy tokens at ``temperature`` (nats).
        cross_entropy_at_one: The same at temperature 1, for comparison.
    """

    temperature: float
    positions: int
    cross_entropy: float
    cross_entropy_at_one: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ContextMatchFit:
    """Result of :func:`fit_context_match_weights`.

    Args:
        weights: ``weights[k - 1]``: the fitted guess weight for a longest match of ``k`` tokens.
        positions: Positions per match length that the fit used.
        cross_entropy: Mean cross-entropy of the labels with the weights, over the fit's positions whose label the
            draft can propose (nats).
        cross_entropy_without: The same with the draft alone.
        rescued_positions: Fit positions whose label only the guesses can propose (outside a restricted head).
    """

    weights: tuple[float, ...]
    positions: tuple[int, ...]
    cross_entropy: float
    cross_entropy_without: float
    rescued_positions: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mean_cross_entropy(draft_logits: torch.Tensor, labels: torch.Tensor, inverse_temperature: float) -> float:
    scaled = draft_logits * inverse_temperature
    return float((torch.logsumexp(scaled, dim=-1) - scaled.gather(-1, labels[:, None])[:, 0]).mean())


def fit_temperature(draft_logits: torch.Tensor, labels: torch.Tensor) -> TemperatureFit:
    """The temperature ``T`` minimising the cross-entropy of ``labels`` under ``softmax(draft_logits / T)``.

    The cross-entropy is convex in the inverse temperature (a log-sum-exp of linear functions minus a linear
    one), so a golden-section search over it finds the minimum, within temperatures 0.05 to 20.

    Args:
        draft_logits: ``[positions, vocab]`` logits; ``-inf`` marks tokens the draft cannot propose.
        labels: ``[positions]`` the token that came at each position; each must have a finite logit.
    """
    if labels.numel() == 0:
        raise ValueError("No position to fit a temperature on: pass prompts with non-empty answers.")
    if not torch.isfinite(draft_logits.gather(-1, labels[:, None])).all():
        raise ValueError("Every label needs a finite draft logit; leave out the tokens the draft cannot propose.")

    def loss(log_inverse: float) -> float:
        return _mean_cross_entropy(draft_logits, labels, math.exp(log_inverse))

    best = _minimize_convex(loss, *(math.log(bound) for bound in _SEARCH_BOUNDS))
    return TemperatureFit(math.exp(-best), labels.numel(), loss(best), loss(0.0))


def _minimize_convex(loss: Callable[[float], float], low: float, high: float) -> float:
    """Golden-section search for the minimiser of a convex ``loss`` on ``[low, high]``."""
    # The surviving interior point becomes the next step's other one (golden**2 == 1 - golden), so each step
    # evaluates the loss (a pass over every position) once.
    golden = (math.sqrt(5) - 1) / 2
    left, right = high - golden * (high - low), low + golden * (high - low)
    loss_left, loss_right = loss(left), loss(right)
    for _ in range(_SEARCH_STEPS):
        if loss_left <= loss_right:
            high, right, loss_right = right, left, loss_left
            left = high - golden * (high - low)
            loss_left = loss(left)
        else:
            low, left, loss_left = left, right, loss_right
            right = low + golden * (high - low)
            loss_right = loss(right)
    return (low + high) / 2


def fit_context_match_weights(
    draft_probs: torch.Tensor, guess_probs: torch.Tensor, orders: torch.Tensor, max_order: int
) -> ContextMatchFit:
    """Per match length ``k``, the weight ``w`` minimising the cross-entropy of ``(1 - w) p + w q`` there.

    Each position belongs to one match length, so the weights fit separately; each loss is convex in its weight
    (minus the log of a function linear in it), so a golden-section search finds it in ``[0, 0.999]``.

    Args:
        draft_probs: ``[positions]`` the draft's probability of the label (0 when it cannot propose it).
        guess_probs: ``[positions]`` the label's share of the matched n-gram's followers (0 when none).
        orders: ``[positions]`` longest match length (0: no match; such positions are left out).
        max_order: Longest match length searched.
    """
    usable = (orders > 0) & ((draft_probs > 0) | (guess_probs > 0))  # others are lost whatever the weight
    if not bool(usable.any()):
        raise ValueError("No position with a context match to fit on: pass prompts with longer answers.")

    def cross_entropy(weight: float | torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> float:
        return float(-torch.log((1 - weight) * p + weight * q).mean())

    weights, counts = [], []
    for order in range(1, max_order + 1):
        here = usable & (orders == order)
        p, q = draft_probs[here].double(), guess_probs[here].double()
        counts.append(int(here.sum()))
        # With positions the draft cannot propose the draft alone scores infinity: start the search above 0.
        fitted = _minimize_convex(lambda w, p=p, q=q: cross_entropy(w, p, q), 1e-6, 0.999) if counts[-1] else 0.0
        weights.append(round(fitted, 4))
    proposable = usable & (draft_probs > 0)
    p, q = draft_probs[proposable].double(), guess_probs[proposable].double()
    mixed = torch.tensor([0.0, *weights], dtype=torch.float64)[orders[proposable]]
    return ContextMatchFit(
        tuple(weights), tuple(counts), cross_entropy(mixed, p, q), cross_entropy(0.0, p, q),
        int((usable & (draft_probs == 0)).sum()),
    )


def fit_greedy_context_match(
    sequences: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    positions: Sequence[tuple[torch.Tensor, torch.Tensor]],
    temperature: float,
    max_order: int = DEFAULT_CONTEXT_MATCH_ORDERS,
) -> ContextMatchFit:
    """Context-match weights that best predict the target's greedy tokens on ``sequences``, mixed into the draft's
    probabilities at ``temperature`` (see :mod:`specexec_hf.core.context_match`).

    Args:
        sequences: ``[L]`` token ids, prompt then continuation (e.g. the target's greedy answers).
        prompt_lengths: Prompt length of each sequence.
        positions: Per sequence, ``(greedy tokens, draft logits)`` from :func:`greedy_positions`.
        temperature: The draft temperature the tree is ranked at (e.g. the fitted greedy one).
        max_order: Longest match length (one weight each).
    """
    draft_probs, guess_probs, orders = [], [], []
    for sequence, prompt_length, (labels, draft_logits) in zip(sequences, prompt_lengths, positions):
        draft_probs.append(torch.softmax(draft_logits / temperature, dim=-1).gather(-1, labels[:, None])[:, 0])
        matches = _context_matches(sequence, prompt_length, labels.numel(), max_order)
        for label, (order, followers) in zip(labels.tolist(), matches):
            orders.append(order)
            guess_probs.append(followers.get(label, 0) / sum(followers.values()) if order else 0.0)
    return fit_context_match_weights(
        torch.cat(draft_probs).cpu(), torch.tensor(guess_probs), torch.tensor(orders), max_order
    )


def _context_matches(
    sequence: torch.Tensor, prompt_length: int, count: int, max_order: int
) -> list[tuple[int, dict[int, int]]]:
    """At each of the ``count`` positions after the prompt, the longest context match over the tokens before it."""
    tokens, index, matches = sequence.tolist(), ContextIndex(max_order), []
    for offset in range(count):
        context = tokens[: prompt_length + offset]
        index.sync(context)
        matches.append(index.longest_match(context))
    return matches


def fit_greedy_acceptance_map(
    sequences: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    positions: Sequence[tuple[torch.Tensor, torch.Tensor]],
    temperature: float,
    match_weights: Sequence[float] = (),
    max_branch: int = SpecExecConfig.max_branch,
) -> AcceptanceMap:
    """The acceptance map that greedy SpecExec would learn from walking the target's greedy answers.

    A greedy walk visits the nodes on the target's own path: at each of them it learns which of the node's
    ``max_branch`` likeliest draft candidates (ranked as the tree ranks them: the draft at ``temperature``, mixed
    with context-match guesses at ``match_weights``) is the target's argmax. Every continuation position of
    ``sequences`` is such a node, so the map observes each once, as ``generate()`` observes a walk.

    Args:
        sequences: ``[L]`` token ids, prompt then continuation (the target's greedy answers).
        prompt_lengths: Prompt length of each sequence.
        positions: Per sequence, ``(greedy tokens, draft logits)`` from :func:`greedy_positions`.
        temperature: The draft temperature the tree is ranked at (the fitted greedy one).
        match_weights: The context-match weights the tree mixes in (the fitted ones; ``()``: none).
        max_branch: Candidates per node, as ``SpecExecConfig.max_branch``.
    """
    if max_branch < 1:
        raise ValueError(f"max_branch must be at least 1, got {max_branch}.")
    acceptance_map = AcceptanceMap()
    for sequence, prompt_length, (labels, draft_logits) in zip(sequences, prompt_lengths, positions):
        logprobs = torch.log_softmax(draft_logits / temperature, dim=-1)
        if any(match_weights):
            matches = _context_matches(sequence, prompt_length, labels.numel(), len(match_weights))
            logprobs = mix_context_guesses(logprobs, matches, match_weights)
        top_logprobs, top_tokens = logprobs.topk(min(max_branch, logprobs.shape[-1]), dim=-1)
        ranks = torch.arange(top_tokens.shape[-1]).expand(top_tokens.shape)
        acceptance_map.observe(top_logprobs, ranks, top_tokens == labels[:, None])
    return acceptance_map


def acceptance_map_record(
    acceptance_map: AcceptanceMap, temperature: float, match_weights: Sequence[float], max_branch: int
) -> dict[str, Any]:
    """What a draft stores of its offline acceptance map: the map's state and the ranking setting it was fitted at
    (see :func:`~specexec_hf.hf.calibrated.starting_acceptance_map`)."""
    return {**acceptance_map.state(), "temperature": temperature, "context_match_weights": list(match_weights),
            "max_branch": max_branch}


def greedy_positions(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    sequences: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence, the target's greedy (argmax) tokens at its continuation positions and the draft's logits
    there: what both fits learn from, from one forward of each model per sequence.

    Args:
        target: The target model.
        draft: The draft model.
        sequences: ``[L]`` token ids, prompt then continuation (e.g. the target's greedy answers).
        prompt_lengths: Prompt length of each sequence.
    """
    return [(t.argmax(dim=-1), d) for t, d in continuation_logits(target, draft, sequences, prompt_lengths)]


def fit_greedy_temperature(positions: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> TemperatureFit:
    """The draft temperature whose softmax best predicts the target's greedy (argmax) tokens.

    Positions whose argmax the draft cannot propose (outside a restricted draft vocabulary) say nothing about
    the temperature and are left out.

    Args:
        positions: Per sequence, ``(greedy tokens, draft logits)`` from :func:`greedy_positions`.
    """
    draft_rows, labels = [], []
    for argmax, draft_logits in positions:
        proposable = torch.isfinite(draft_logits.gather(-1, argmax[:, None])[:, 0])
        draft_rows.append(draft_logits[proposable])
        labels.append(argmax[proposable])
    return fit_temperature(torch.cat(draft_rows), torch.cat(labels))


@torch.inference_mode()
def greedy_answers(
    target: PreTrainedModel, prompts: Sequence[torch.Tensor], max_new_tokens: int
) -> tuple[list[torch.Tensor], list[int]]:
    """The target's greedy answers to ``prompts`` (prompt then answer, ``[L]`` each) and the prompt lengths."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
    sequences, lengths = [], []
    for prompt in prompts:
        ids = prompt.reshape(1, -1).to(target.device)
        answer = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)
        sequences.append(answer[0])
        lengths.append(ids.shape[1])
    return sequences, lengths


def calibrate_draft_temperature(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int = 64,
) -> TemperatureFit:
    """Fits the draft's greedy temperature on the target's greedy answers to ``prompts`` and stores it on the draft.

    Greedy SpecExec ``generate()`` calls then rank their trees with it (``draft.config.specexec_greedy_temperature``;
    ``save_pretrained`` keeps it). Use prompts like the ones you will serve, and not the ones you benchmark on.

    Args:
        target: The target model.
        draft: The draft model; its config receives the fitted temperature.
        prompts: ``[1, L]`` (or ``[L]``) prompt ids, chat-formatted as in use.
        max_new_tokens: Length of each greedy answer.
    """
    fit = fit_greedy_temperature(greedy_positions(target, draft, *greedy_answers(target, prompts, max_new_tokens)))
    setattr(draft.config, GREEDY_TEMPERATURE_ATTRIBUTE, fit.temperature)
    return fit


def calibrate_draft_acceptance_map(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int = 64,
    max_branch: int = SpecExecConfig.max_branch,
) -> AcceptanceMap:
    """Fits the greedy acceptance map on the target's greedy answers to ``prompts`` and stores it on the draft.

    The fit ranks candidates at the draft's calibrated greedy temperature and context-match weights (calibrate
    those first); greedy ``generate()`` calls at that setting then start their online map from a copy of it
    instead of from the draft's raw probabilities.

    Args:
        target: The target model.
        draft: The draft model; its config receives the map (``specexec_greedy_acceptance_map``).
        prompts: ``[1, L]`` (or ``[L]``) prompt ids, chat-formatted as in use.
        max_new_tokens: Length of each greedy answer.
        max_branch: Candidates per node, as ``SpecExecConfig.max_branch``.
    """
    temperature, match_weights = greedy_draft_temperature(draft), calibrated_context_match_weights(draft)
    sequences, lengths = greedy_answers(target, prompts, max_new_tokens)
    positions = greedy_positions(target, draft, sequences, lengths)
    acceptance_map = fit_greedy_acceptance_map(sequences, lengths, positions, temperature, match_weights, max_branch)
    setattr(draft.config, ACCEPTANCE_MAP_ATTRIBUTE,
            acceptance_map_record(acceptance_map, temperature, match_weights, max_branch))
    return acceptance_map


# ----------------------------------------------------------------------------------------------------------
# Command line: `specexec-hf calibrate`
# ----------------------------------------------------------------------------------------------------------


def calibration_prompts(source: str, count: int, after_distilled: int = 0, seed: int = 0) -> list[str]:
    """``count`` prompts to fit on: a split or file, optionally skipping those a distilled draft was trained on.

    Args:
        source: ``train``, ``eval`` or a JSONL prompt file (see :func:`specexec_hf.tools.distill.sources.read_prompts`).
        count: How many prompts to return.
        after_distilled: Skip the first ``after_distilled`` prompts of ``specexec-hf distill``'s generation order
            (its ``--seed``): a draft distilled from that many prompts never saw the ones returned.
        seed: The distillation's ``--seed``.
    """
    prompts = read_prompts(source)
    order = [job.prompt_index for job in plan_jobs(len(prompts), 0, seed)][after_distilled:]
    if not 0 < count <= len(order):
        raise SystemExit(f"--count {count} is outside 1..{len(order)} (prompts left after --after-distilled).")
    return [prompts[index] for index in order[:count]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``calibrate`` subcommand's options."""
    parser.add_argument("--draft", default="default",
                        help="'default' (the shipped draft) or a draft export (.safetensors beside its .json).")
    parser.add_argument("--prompts", default="train", help="'train', 'eval' or a JSONL prompt file (default train).")
    parser.add_argument("--after-distilled", type=int, default=0,
                        help="Skip the first N prompts of distill's generation order: the ones the draft learnt from.")
    parser.add_argument("--seed", type=int, default=0, help="The distillation's --seed (default 0).")
    parser.add_argument("--count", type=int, default=48, help="Prompts to fit on (default 48).")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="Greedy answer length (default 64).")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads.")
    parser.add_argument("--context-match-orders", type=int, default=DEFAULT_CONTEXT_MATCH_ORDERS,
                        help="Longest context match to fit a guess weight for (default 6; 0: fit none).")
    parser.add_argument("--max-branch", type=int, default=SpecExecConfig.max_branch,
                        help="Candidates per node the acceptance map is fitted on (default: SpecExecConfig's).")
    parser.add_argument("--acceptance-map-only", action="store_true",
                        help="Keep the export's stored temperature and context-match weights and fit only the "
                             "acceptance map, at them.")
    parser.add_argument("--write", action="store_true", help="Store the fits in the export's JSON.")


def run(args: argparse.Namespace) -> int:
    """Fits the draft's greedy temperature, context-match weights and acceptance map (with ``--acceptance-map-only``
    the map alone, at the stored temperature and weights); prints the fits and, with ``--write``, stores them in the
    export's JSON."""
    torch.set_num_threads(args.threads)
    weights = models.draft_export_path(args.draft)
    prompts = calibration_prompts(args.prompts, args.count, args.after_distilled, args.seed)
    target, tokenizer = models.load_default_target()
    draft = models.load_draft_export(target, weights)
    sequences, lengths = greedy_answers(target, [torch.tensor(ids) for ids in encode_chats(tokenizer, prompts)],
                                        args.max_new_tokens)
    positions = greedy_positions(target, draft, sequences, lengths)
    source = {"prompts": args.prompts, "after_distilled": args.after_distilled, "seed": args.seed,
              "count": args.count, "max_new_tokens": args.max_new_tokens}
    records: dict[str, dict[str, Any]] = {}
    if args.acceptance_map_only:
        temperature, match_weights = greedy_draft_temperature(draft), calibrated_context_match_weights(draft)
    else:
        fit = fit_greedy_temperature(positions)
        temperature, match_weights = fit.temperature, ()
        records[models.GREEDY_TEMPERATURE_KEY] = {**fit.as_dict(), **source}
        if args.context_match_orders > 0:
            match = fit_greedy_context_match(sequences, lengths, positions, temperature, args.context_match_orders)
            match_weights = match.weights
            records[models.CONTEXT_MATCH_KEY] = {**match.as_dict(), "temperature": temperature, **source}
    acceptance_map = fit_greedy_acceptance_map(sequences, lengths, positions, temperature, match_weights,
                                               args.max_branch)
    records[ACCEPTANCE_MAP_KEY] = {
        **acceptance_map_record(acceptance_map, temperature, match_weights, args.max_branch), **source
    }
    print(json.dumps(records, indent=2))
    if args.write:
        meta_path = weights.with_suffix(".json")
        meta = json.loads(meta_path.read_text())
        if not args.acceptance_map_only:  # a context-match fit at another temperature would no longer hold
            meta.pop(models.CONTEXT_MATCH_KEY, None)
        meta.update(records)
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        print(f"wrote {', '.join(records)} to {meta_path}", file=sys.stderr)
    return 0

