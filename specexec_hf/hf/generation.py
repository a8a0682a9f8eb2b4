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
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import (
    GenerateDecoderOnlyOutput,
    LogitsProcessorList,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer
from transformers.utils import ModelOutput

from ..core.config import SpecExecConfig
from ..core.masks import chain_and_tree_mask
from ..core.precision import greedy_choice
from ..core.search import SearchFn, grow_tree
from ..core.stats import SpecExecStats, StepStats
from ..core.tree import TokenTree
from ..core.verify import acceptance_walk, rejection_sample
from .attention_spans import attention_spans, decoder_layer_types
from .autobudget import auto_budget_for
from .calibrated import ranking_setting, shared_acceptance_map
from .candidate_generator import SAMPLED_AFTER, SpecExecCandidateGenerator
from .compat import (
    check_masked_tokens_supported,
    check_same_vocabulary,
    check_supported,
    node_logits,
)
from .kv import compact_cache, new_cache
from .request import check_budget_fits, validate_request
from .self_draft import resolve_draft


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
        _, tokens = tree.host_lists()  # read once per tree: the walk calls once per node it visits
        paths = [[tokens[i] for i in tree.path(node)] for node in nodes]
        for depth in sorted({len(path) for path in paths}):
            rows = [i for i, path in enumerate(paths) if len(path) == depth]
            path_ids = torch.tensor([paths[i] for i in rows], dtype=prefix_ids.dtype).view(len(rows), depth)
            sequences = torch.cat([prefix_ids.expand(len(rows), -1), path_ids.to(prefix_ids.device)], dim=-1)
            scores[rows] = self.processors(sequences, scores[rows])
        return scores


def _outputs_of(
    outputs: ModelOutput, pending: int, length: int, path: list[int], index: int, reaches: list[int]
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Hidden states and attentions behind a step's ``index``-th committed token, shaped as plain decoding returns
    them: the root's (the pending tokens', all of the prompt on the first step) or accepted node ``path[index - 1]``'s,
    with attention columns for the ``length`` committed tokens and that node's ancestors on the path, in order.

    Args:
        outputs: The target forward's output over ``pending`` committed tokens and then the tree's nodes.
        pending: Committed tokens fed before the tree; the root is the last of them.
        length: Committed tokens before the step.
        path: The accepted nodes.
        index: 0 for the token chosen at the root, ``i`` for the one chosen at ``path[i - 1]``.
        reaches: Per layer, its window or chunk (0: full attention). Plain decoding's cache keeps only that many
            keys of such a layer after the prompt, so its attention rows are that long.
    """
    rows = slice(0, pending) if index == 0 else slice(pending + path[index - 1] - 1, pending + path[index - 1])
    columns = torch.cat([torch.arange(length), length - 1 + torch.tensor(path[:index], dtype=torch.long)])
    prompt = index == 0 and pending == length
    # Token rows are the second-to-last dimension (Gemma 3n stacks its AltUp streams in front of the batch).
    hidden = tuple(state[..., rows, :] for state in outputs.hidden_states or ())
    attentions = tuple(
        weights[..., rows, :][..., (columns if prompt or not reach else columns[-reach:]).to(weights.device)]
        for weights, reach in zip(outputs.attentions or (), reaches)
    )
    return hidden, attentions


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: BaseStreamer | None = None,
    assistant_model: PreTrainedModel | str | None = None,
    draft_model: PreTrainedModel | str | None = None,
    specexec_config: SpecExecConfig | None = None,
    specexec_stats: SpecExecStats | None = None,
    budget: int | Literal["auto"] | None = None,
    max_depth: int | None = None,
    max_branch: int | None = None,
    expand_per_forward: int | None = None,
    max_draft_forwards: int | None = None,
    draft_temperature: float | None = None,
    context_match_weights: Sequence[float] | None = None,
    acceptance_calibration: bool | None = None,
    sampled_children: bool | None = None,
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
        draft_model: The draft, for callers that bypass ``assistant_model`` (the ``speculator=`` route does); also
            ``"self:int4"`` / ``"self:int8"``, the target itself quantized (:func:`~.self_draft.resolve_draft`),
            which ``speculator="specexec"`` accepts as ``assistant_model`` too (transformers' own checks would
            reject a string there on the ``custom_generate=`` route).
        specexec_config: Tree-growth knobs; the individual knob arguments below override it.
        specexec_stats: Filled with per-step statistics when given.
        budget, max_depth, max_branch, expand_per_forward, max_draft_forwards, draft_temperature,
            context_match_weights, acceptance_calibration, sampled_children: see :class:`SpecExecConfig`;
            ``budget="auto"`` picks the budget before every step.
        tree_search: The tree-growth policy (SpecExec's best-first search; baselines for benchmarks).
        tokenizer, assistant_tokenizer: Accepted from ``generate()``, which already built ``stop_strings``
            criteria with the tokenizer; SpecExec needs the draft to share the target's token ids.
        model_kwargs: What ``generate()`` prepared: ``attention_mask`` and ``position_ids`` (any padding or holes),
            per-token inputs such as ``token_type_ids``, and its own cache bookkeeping (see
            :mod:`specexec_hf.hf.request`).
    """
    draft_model = draft_model if draft_model is not None else assistant_model
    if isinstance(draft_model, str):
        draft_model = resolve_draft(model, draft_model)
    if draft_model is None:
        raise ValueError(
            "SpecExec needs a draft model: pass assistant_model=<small causal LM with the same tokenizer> "
            "(after `import specexec_hf`, which lets generate() forward it to custom_generate callables)."
        )
    check_supported(model, "target")  # first: an unsupported model's inputs are beside the point
    request = validate_request(model, input_ids, generation_config, model_kwargs, synced_gpus)
    if request.has_masked_tokens:
        check_masked_tokens_supported(model)
    check_same_vocabulary(model, draft_model)
    config = (specexec_config or SpecExecConfig()).updated(
        budget=budget,
        max_depth=max_depth,
        max_branch=max_branch,
        expand_per_forward=expand_per_forward,
        max_draft_forwards=max_draft_forwards,
        draft_temperature=draft_temperature,
        context_match_weights=context_match_weights,
        acceptance_calibration=acceptance_calibration,
        sampled_children=sampled_children,
    )
    if config.budget != "auto":
        check_budget_fits(model, request.input_ids.shape[1], generation_config.max_length, config.budget)
    draft_temperature, match_weights = ranking_setting(
        draft_model, config, generation_config.do_sample, generation_config.temperature
    )
    # Static trees fix their own shape and children.
    calibrate = config.acceptance_calibration and tree_search is grow_tree
    sampled_children = generation_config.do_sample and config.sampled_children and tree_search is grow_tree
    drafter = SpecExecCandidateGenerator(
        draft_model, config, draft_temperature, search=tree_search, context_match_weights=match_weights,
        acceptance_map=shared_acceptance_map(
            draft_model, generation_config.do_sample, draft_temperature, match_weights, sampled_children
        ) if calibrate else None,
        sampled_children=sampled_children,
    )
    auto_budget = auto_budget_for(model, draft_model, config, draft_temperature) if config.budget == "auto" else None
    processor = TreeLogitsProcessor(logits_processor)
    stats = specexec_stats if specexec_stats is not None else SpecExecStats()
    cache = new_cache()  # generate()'s own (empty) cache would keep sliding layers to one window
    keep_scores, keep_logits = generation_config.output_scores, generation_config.output_logits
    all_scores: list[torch.Tensor] = []
    all_logits: list[torch.Tensor] = []
    keep_hidden, keep_attentions = generation_config.output_hidden_states, generation_config.output_attentions
    all_hidden: list[tuple[torch.Tensor, ...]] = []
    all_attentions: list[tuple[torch.Tensor, ...]] = []
    spans = attention_spans(model.config)
    layer_reaches = [spans[kind].reach() if kind in spans else 0 for kind in decoder_layer_types(model.config)]
    # Near-ties: how far rounding in the target's dtype can move its logits (see core.precision).
    logits_eps = torch.finfo(model.dtype).eps
    head_width = model.config.get_text_config().hidden_size

    # Processors, stopping criteria and the output see the sequence with its left padding, as in plain decoding;
    # the models see it without (``length``, ``cached`` and cache slots count unpadded tokens).
    padding = request.left_padding.shape[1]
    sequence = torch.cat([request.left_padding, request.input_ids], dim=-1)
    cached = 0
    finished = False
    while not finished:
        length = sequence.shape[1] - padding
        depth_left = generation_config.max_length - sequence.shape[1] - 1
        started = time.perf_counter()
        if auto_budget is not None:
            drafter.config = config.updated(budget=auto_budget.choose(depth_left))
        grown = drafter.grow_tree(request.draft_history(sequence[:, padding:]), max_depth=depth_left)
        tree = grown.tree
        drafted = time.perf_counter()

        # One target forward: the committed tokens it has not seen (ending with the root), then the tree. Each node
        # takes the position after its parent's; sliding windows and chunks count sequence indices, as in plain
        # decoding, where a node at depth d would sit at index length - 1 + d.
        pending = sequence[0, padding + cached :]
        tokens = torch.cat([pending, tree.tokens[1:].to(pending)])
        committed_positions = request.positions_of(cached, length).to(pending)
        depths = tree.depths[1:].to(pending)
        positions = torch.cat([committed_positions, committed_positions[-1] + depths])
        indices = torch.cat([torch.arange(cached, length, device=pending.device), length - 1 + depths])
        visible = chain_and_tree_mask(cached, pending.numel(), tree.ancestor_mask()).to(pending.device)
        if request.has_masked_tokens:  # masked tokens stay in the cache, but no query sees them
            visible[:, :length] &= request.attended_keys(length).to(visible.device)
        extra_inputs = request.inputs_for(cached, length, tree.num_nodes - 1)
        logits = node_logits(
            model, tokens, positions, cache, tree.num_nodes, visible, extra_inputs, span_positions=indices,
            hidden_states=keep_hidden, attentions=keep_attentions,
        )
        verified = time.perf_counter()

        step_scores: list[torch.Tensor] = []
        near_tied: list[int] = []  # indices into step_scores whose choice rounding could flip (see core.precision)
        sampled_from: list[torch.Tensor] = []  # when sampling, the distribution of each choice, for the drafter
        drawn_children: dict[int, list[int]] = {}  # node -> its children's tokens, in the order they were drawn
        if sampled_children:
            for parent, token in zip(*tree.host_lists()):  # the host copy the walk reads anyway
                drawn_children.setdefault(parent, []).append(token)

        def choose(node: int) -> int:
            scores = processor(sequence, tree, logits.row(node), [node])
            step_scores.append(scores)
            if not generation_config.do_sample:
                token, tied = greedy_choice(scores, logits_eps, head_width).tolist()  # one host read for both
                if tied:
                    near_tied.append(len(step_scores) - 1)
                return token
            sampled_from.append(torch.softmax(scores, dim=-1))
            if node in drawn_children:
                candidates = torch.tensor(drawn_children[node])
                return rejection_sample(sampled_from[-1][0], drafter.draft_probs(grown, node), candidates, SAMPLED_AFTER)
            return int(torch.multinomial(sampled_from[-1], 1))

        acceptance = acceptance_walk(tree, choose)
        drafter.observe(grown, acceptance.tokens, sampled_from or None)
        if auto_budget is not None:
            auto_budget.observe(tree, acceptance, drafted - started)
        # Tree node i sat at cache slot length + i - 1; keep the committed tokens and the accepted nodes.
        compact_cache(cache, length, length - 1 + torch.tensor(acceptance.path, dtype=torch.long))
        cached = length + len(acceptance.path)

        # The step's tokens go to the device at once; stopping criteria still see them one at a time, as views.
        extended = torch.cat([sequence, sequence.new_tensor([acceptance.tokens])], dim=-1)
        committed = 0
        for scores, node in zip(step_scores, [0, *acceptance.path]):
            committed += 1
            sequence = extended[:, : extended.shape[1] - len(acceptance.tokens) + committed]
            if keep_scores:
                all_scores.append(scores)
            if keep_logits:
                all_logits.append(logits.row(node))
            if keep_hidden or keep_attentions:
                hidden, attentions = _outputs_of(
                    logits.outputs, pending.numel(), length, acceptance.path, committed - 1, layer_reaches
                )
                all_hidden.append(hidden)
                all_attentions.append(attentions)
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
                path_length=len(acceptance.path),
                # Node scores are cumulative log-probabilities of acceptance (the ranking's own estimate).
                forecast=float(tree.logprobs[1:].double().exp().sum()),
                near_tied=tuple(near_tied),
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
        hidden_states=tuple(all_hidden) if keep_hidden else None,
        attentions=tuple(all_attentions) if keep_attentions else None,
        past_key_values=cache if generation_config.use_cache else None,
        specexec_stats=stats,
    )
