"""The SpecExec decoding loop, as a ``custom_generate`` callable for transformers' ``generate()``.

Each step: the draft grows a tree under the last committed token; the target scores the pending committed
tokens and the whole tree in one forward; the acceptance walk commits the target's own choices along the tree
plus one bonus token; both KV caches keep only the committed path. The target's cache always holds every
committed token but the last, which becomes the next tree's root.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel
from transformers.generation import (
    GenerateDecoderOnlyOutput,
    LogitsProcessorList,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

from ..core.config import SpecExecConfig
from ..core.masks import chain_and_tree_mask
from ..core.search import SearchFn, grow_tree
from ..core.stats import SpecExecStats, StepStats
from ..core.tree import TokenTree
from ..core.verify import acceptance_walk
from .autobudget import auto_budget_for
from .calibrated import calibrated_context_match_weights, greedy_draft_temperature
from .candidate_generator import SpecExecCandidateGenerator
from .compat import check_same_vocabulary, check_supported, node_logits
from .kv import compact_cache


@dataclass
class SpecExecDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus ``specexec_stats`` (tokens per target forward, tree sizes, timings)."""

    specexec_stats: SpecExecStats | None = None


class TreeLogitsProcessor:
    """Applies a ``LogitsProcessorList`` to tree logits, each node seeing its own full path as ``input_ids``.

    Processors look at the sequence they extend (repetition penalty, no-repeat n-grams, min_new_tokens, ...),
    so a node's logits are processed with ``prefix + path to the node``, exactly what plain ``generate()``
    would pass had it reached that node. Nodes of equal depth share a sequence length and go in one call.

    Args:
        processors: The processors ``generate()`` prepared (warpers included when sampling).
    """

    def __init__(self, processors: LogitsProcessorList):
        self.processors = processors

    def __call__(
        self, prefix_ids: torch.Tensor, tree: TokenTree, logits: torch.Tensor, nodes: list[int]
    ) -> torch.Tensor:
        """Processed scores ``[len(nodes), vocab]`` for tree ``nodes`` from their ``[len(nodes), vocab]`` logits."""
        if not self.processors:
            return logits
        scores = logits.clone()  # the rows are the walk's cached logits; processing must not change them
        depths = tree.depths[nodes].tolist()
        for depth in sorted(set(depths)):
            rows = [i for i, d in enumerate(depths) if d == depth]
            paths = torch.stack([tree.path_tokens(nodes[i]) for i in rows]).to(prefix_ids)
            sequences = torch.cat([prefix_ids.expand(len(rows), -1), paths], dim=-1)
            scores[rows] = self.processors(sequences, scores[rows])
        return scores


def _validate_request(model, input_ids, generation_config, model_kwargs, synced_gpus) -> None:
    # generate() has already expanded the batch for beams and return sequences: name those first.
    if generation_config.num_beams > 1 or generation_config.num_return_sequences > 1:
        raise ValueError("SpecExec supports num_beams=1 and num_return_sequences=1 only.")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"SpecExec generates one sequence at a time, got a batch of {input_ids.shape[0]}. Call generate() per "
            "prompt (batched serving is what the vLLM integration is for)."
        )
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("SpecExec does not return attentions or hidden states; drop output_attentions/hidden_states.")
    if synced_gpus:
        raise ValueError("SpecExec does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation).")
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and not bool((attention_mask == 1).all()):
        raise ValueError("SpecExec takes an unpadded prompt: the attention_mask must be all ones.")
    cache = model_kwargs.get("past_key_values")
    if cache is not None and (not isinstance(cache, DynamicCache) or cache.get_seq_length() > 0):
        raise ValueError(
            "SpecExec manages the target's KV cache itself: pass no past_key_values and leave cache_implementation "
            f"unset (got {type(cache).__name__})."
        )
    check_supported(model, "target")


def _draft_temperature(
    config: SpecExecConfig, generation_config: GenerationConfig, draft_model: PreTrainedModel
) -> float:
    if config.draft_temperature is not None:
        return config.draft_temperature
    if generation_config.do_sample and generation_config.temperature:
        return float(generation_config.temperature)
    return greedy_draft_temperature(draft_model)


def _context_match_weights(
    config: SpecExecConfig, generation_config: GenerationConfig, draft_model: PreTrainedModel
) -> tuple[float, ...]:
    if config.context_match_weights is not None:
        return config.context_match_weights
    # The calibrated weights were fitted on greedy answers, like the greedy temperature.
    return () if generation_config.do_sample else calibrated_context_match_weights(draft_model)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: BaseStreamer | None = None,
    assistant_model: PreTrainedModel | None = None,
    draft_model: PreTrainedModel | None = None,
    specexec_config: SpecExecConfig | None = None,
    specexec_stats: SpecExecStats | None = None,
    budget: int | Literal["auto"] | None = None,
    max_depth: int | None = None,
    max_branch: int | None = None,
    expand_per_forward: int | None = None,
    max_draft_forwards: int | None = None,
    draft_temperature: float | None = None,
    context_match_weights: Sequence[float] | None = None,
    tree_search: SearchFn = grow_tree,
    tokenizer=None,
    assistant_tokenizer=None,
    **model_kwargs,
) -> SpecExecDecoderOnlyOutput | torch.LongTensor:
    """SpecExec decoding; pass as ``model.generate(..., assistant_model=draft, custom_generate=generate)``.

    Args:
        model: The target causal LM.
        input_ids: ``[1, L]`` prompt.
        logits_processor: Prepared by ``generate()``; applied to every verified node (see ``TreeLogitsProcessor``).
        stopping_criteria: Prepared by ``generate()``; checked after every committed token.
        generation_config: ``do_sample`` picks sampling vs greedy; ``return_dict_in_generate``, ``output_scores``
            and ``output_logits`` are honoured.
        synced_gpus: Unsupported; must be False.
        streamer: Receives committed tokens in order.
        assistant_model: The draft, as ``generate(assistant_model=...)`` passes it.
        draft_model: The draft, for callers that bypass ``assistant_model`` (the ``speculator=`` route does).
        specexec_config: Tree-growth knobs; the individual knob arguments below override it.
        specexec_stats: Filled with per-step statistics when given.
        budget, max_depth, max_branch, expand_per_forward, max_draft_forwards, draft_temperature,
            context_match_weights: see :class:`SpecExecConfig`; ``budget="auto"`` picks the budget before every
            step.
        tree_search: The tree-growth policy (SpecExec's best-first search; baselines for benchmarks).
        tokenizer, assistant_tokenizer: Accepted from ``generate()``, which already built ``stop_strings``
            criteria with the tokenizer; SpecExec needs the draft to share the target's token ids.
        model_kwargs: ``attention_mask`` (all ones), ``past_key_values`` (an empty cache or None) and whatever
            else ``generate()`` prepared, which the tree forward does not use.
    """
    draft_model = draft_model if draft_model is not None else assistant_model
    if draft_model is None:
        raise ValueError(
            "SpecExec needs a draft model: pass assistant_model=<small causal LM with the same tokenizer> "
            "(after `import specexec_hf`, which lets generate() forward it to custom_generate callables)."
        )
    _validate_request(model, input_ids, generation_config, model_kwargs, synced_gpus)
    check_same_vocabulary(model, draft_model)
    config = (specexec_config or SpecExecConfig()).updated(
        budget=budget,
        max_depth=max_depth,
        max_branch=max_branch,
        expand_per_forward=expand_per_forward,
        max_draft_forwards=max_draft_forwards,
        draft_temperature=draft_temperature,
        context_match_weights=context_match_weights,
    )
    draft_temperature = _draft_temperature(config, generation_config, draft_model)
    drafter = SpecExecCandidateGenerator(
        draft_model, config, draft_temperature, search=tree_search,
        context_match_weights=_context_match_weights(config, generation_config, draft_model),
    )
    auto_budget = auto_budget_for(model, draft_model, config, draft_temperature) if config.budget == "auto" else None
    processor = TreeLogitsProcessor(logits_processor)
    stats = specexec_stats if specexec_stats is not None else SpecExecStats()
    cache = model_kwargs.get("past_key_values")
    if cache is None:
        cache = DynamicCache(config=model.config)
    keep_scores, keep_logits = generation_config.output_scores, generation_config.output_logits
    all_scores: list[torch.Tensor] = []
    all_logits: list[torch.Tensor] = []

    sequence = input_ids
    cached = 0
    finished = False
    while not finished:
        length = sequence.shape[1]
        started = time.perf_counter()
        if auto_budget is not None:
            drafter.config = config.updated(budget=auto_budget.choose(generation_config.max_length - length - 1))
        grown = drafter.grow_tree(sequence, max_depth=generation_config.max_length - length - 1)
        tree = grown.tree
        drafted = time.perf_counter()

        # One target forward: the committed tokens it has not seen (ending with the root), then the tree.
        pending = sequence[0, cached:]
        tokens = torch.cat([pending, tree.tokens[1:].to(pending)])
        positions = torch.cat([torch.arange(cached, length), tree.positions(length - 1)[1:].cpu()]).to(pending)
        visible = chain_and_tree_mask(cached, pending.numel(), tree.ancestor_mask()).to(pending.device)
        logits = node_logits(model, tokens, positions, cache, tree.num_nodes, visible)
        verified = time.perf_counter()

        step_scores: list[torch.Tensor] = []

        def choose(node: int) -> int:
            scores = processor(sequence, tree, logits.row(node), [node])
            step_scores.append(scores)
            if generation_config.do_sample:
                return int(torch.multinomial(torch.softmax(scores, dim=-1), 1))
            return int(scores.argmax(dim=-1))

        acceptance = acceptance_walk(tree, choose)
        if auto_budget is not None:
            auto_budget.observe(tree, acceptance, drafted - started)
        # Tree node i sat at cache slot length + i - 1; keep the committed tokens and the accepted nodes.
        compact_cache(cache, length, length - 1 + torch.tensor(acceptance.path, dtype=torch.long))
        cached = length + len(acceptance.path)

        committed = 0
        for token, scores, node in zip(acceptance.tokens, step_scores, [0, *acceptance.path]):
            sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=-1)
            committed += 1
            if keep_scores:
                all_scores.append(scores)
            if keep_logits:
                all_logits.append(logits.row(node))
            if bool(stopping_criteria(sequence, scores).any()):
                finished = True
                break
        if streamer is not None:
            streamer.put(sequence[0, -committed:].cpu())
        stats.steps.append(
            StepStats(
                tree_size=tree.num_nodes,
                accepted=committed,
                draft_forwards=grown.draft_forwards,
                draft_seconds=drafted - started,
                target_seconds=verified - drafted,
            )
        )

    if streamer is not None:
        streamer.end()
    if not generation_config.return_dict_in_generate:
        return sequence
    return SpecExecDecoderOnlyOutput(
        sequences=sequence,
        scores=tuple(all_scores) if keep_scores else None,
        logits=tuple(all_logits) if keep_logits else None,
        past_key_values=cache if generation_config.use_cache else None,
        specexec_stats=stats,
    )
