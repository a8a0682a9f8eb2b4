"""SpecExec as a ``custom_generate`` callable for transformers' ``generate()``: a thin adapter over the decoder.

``generate()`` checks the request, builds the drafter and a :class:`~.decoder.SpecExecDecoder`, and runs its
steps (:meth:`~.decoder.SpecExecDecoder.step`: draft a tree, one target forward, the acceptance walk, cache
compaction), committing each step's tokens one at a time against the stopping criteria, as plain decoding does,
and recording the outputs (:class:`~.outputs.OutputRecorder`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Literal

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..core.config import SpecExecConfig
from ..core.search import SearchPolicy, grow_tree, tree_policy
from ..core.stats import SpecExecStats
from .autobudget import DEFAULT_CANDIDATES
from .batch import AutoStepTotal, decode_batch, new_rows
from .calibrated import ranking_setting
from .candidate_generator import SpecExecCandidateGenerator
from .compat import (
    check_intermediate_vocabulary,
    check_masked_tokens_supported,
    check_same_tokenizer,
    check_supported,
    logits_width,
)
from .decoder import (
    ChoiceRule,
    SpecExecDecoder,
    TreeLogitsProcessor,
    check_draft_ahead,
)
from .draft_graphs import DraftGraphs
from .intermediate_draft import HIERARCHY_DRAFT_FACTOR, IntermediateDraft
from .learnt_state import LearntState, learnt_state_of
from .offload_hint import ReadAheadWatch, hint_streaming_executor
from .outputs import OutputRecorder, SpecExecDecoderOnlyOutput, commit_tokens
from .ownership import exclusive_call
from .request import Request, check_budget_fits, validate_batch
from .self_draft import resolve_draft
from .settings import specexec_settings, warn_unused_assisted_settings


@exclusive_call  # a streamed target's ring serves one call at a time
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
    min_draft_gain: float | None = None,
    draft_temperature: float | None = None,
    context_match_weights: Sequence[float] | None = None,
    acceptance_calibration: bool | None = None,
    sampled_children: bool | None = None,
    draft_ahead: bool | None = None,
    intermediate_model: PreTrainedModel | str | None = None,
    draft_budget: int | None = None,
    tree_search: SearchPolicy | str | None = None,
    step_budget: int | Literal["auto"] | None = None,
    draft_graphs: DraftGraphs | None = None,
    learnt_state: LearntState | None = None,
    tokenizer=None,
    assistant_tokenizer=None,
    **model_kwargs,
) -> SpecExecDecoderOnlyOutput | torch.LongTensor:
    """SpecExec decoding; pass as ``model.generate(..., assistant_model=draft, custom_generate=generate)``.

    Args:
        model: The target causal LM.
        input_ids: ``[batch, L]`` prompts, left-padded as a tokenizer pads them (``attention_mask`` in
            ``model_kwargs``). A batch of several decodes every row's tree in one target forward per step
            (:mod:`~.batch`); each row's output is the one its prompt alone would give, and the batch comes back
            as batched plain decoding returns it. Not yet with ``draft_ahead``,
            ``intermediate_model`` or per-token outputs (scores, logits, hidden states, attentions); the returned
            ``past_key_values`` are then ``None``.
        logits_processor: Prepared by ``generate()``; applied to every verified node (see ``TreeLogitsProcessor``).
        stopping_criteria: Prepared by ``generate()``; checked after every committed token.
        generation_config: ``do_sample`` picks sampling vs greedy; ``return_dict_in_generate``, ``output_scores``
            and ``output_logits`` are honoured. It may hold SpecExec's settings too (the knobs, ``tree_search``,
            ``draft_budget``; see :mod:`.settings`), which the keyword arguments override.
        synced_gpus: Unsupported; must be False.
        streamer: Receives committed tokens in order.
        assistant_model: The draft, as ``generate(assistant_model=...)`` passes it.
        draft_model: The draft, for callers that bypass ``assistant_model`` (the ``speculator=`` route does); also
            ``"self:int4"`` / ``"self:int8"``, the target itself quantized, or ``"self:exit:K"`` /
            ``"self:skip:<layers>"``, the target's own layers (:func:`~.self_draft.resolve_draft`),
            which ``speculator="specexec"`` accepts as ``assistant_model`` too (transformers' own checks would
            reject a string there on the ``custom_generate=`` route).
        specexec_config: Tree-growth knobs; the individual knob arguments below override it, and it overrides the
            generation config's knobs.
        specexec_stats: Filled with per-step statistics when given.
        budget, max_depth, max_branch, expand_per_forward, max_draft_forwards, min_draft_gain, draft_temperature,
            context_match_weights, acceptance_calibration, sampled_children, draft_ahead: see :class:`SpecExecConfig`;
            ``budget="auto"`` picks the budget before every step; for a batch it means ``step_budget="auto"``,
            each row's tree growing to at most the largest budget it would pick for one prompt.
        intermediate_model: A draft hierarchy (TriForce): a causal LM between the draft and the target, e.g. a
            larger draft or ``"self:int8"`` / ``"self:exit:K"`` (as ``draft_model`` takes them). The draft grows a
            tree of ``draft_budget`` nodes, the intermediate scores it in one forward, and the target verifies the
            ``budget`` nodes it rates likeliest (see :mod:`~.intermediate_draft`). Not with ``budget="auto"``,
            ``draft_ahead`` or ``sampled_children``.
        draft_budget: With ``intermediate_model``, the draft tree's size; default
            :data:`~.intermediate_draft.HIERARCHY_DRAFT_FACTOR` times ``budget``.
        tree_search: The tree-growth policy (SpecExec's best-first search; baselines for benchmarks), or the name of
            a registered one (``"specexec"``, ``"specinfer"``, ``"sequoia"``; see
            :data:`~specexec_hf.core.search.TREE_POLICIES`); ``None``: the generation config's, else SpecExec's
            ``grow_tree``. The acceptance map and drawn children apply to policies
            that support them (``ranks_children``, ``draws_children``). ``"sequoia"`` by name learns its acceptance
            vector in ``learnt_state``, so calls with the same draft go on learning (a ``SequoiaSearch`` object keeps
            its own) and, with ``budget="auto"``, picks each tree's size and depth from the measured forward times.
        step_budget: Tree nodes (roots excluded) one target forward verifies over all the batch's rows, given where
            the trees' ranking forecasts the most accepted tokens
            (:func:`~specexec_hf.core.step_budget.kept_nodes`, as the vLLM integration's step budget); each row
            still grows a tree of ``budget`` nodes. ``"auto"``: each step's total is the one with the most forecast
            tokens per second under the target's measured forward profile, the step's draft forwards at their
            measured cost and the rows' calibrated node scores
            (:func:`~specexec_hf.core.batch_budget.step_total`), and each row's tree grows to twice its even share
            of the last total, at most ``budget`` (see :mod:`~.batch`): one setting for one prompt and many.
            ``None``: every row's whole tree. For one prompt an integer caps ``budget`` and ``"auto"`` changes
            nothing.
        draft_graphs: Whether the draft runs over a preallocated cache with padded feeds, each shape replayed as
            a CUDA graph on a GPU (:mod:`~.draft_graphs`; the same logits): ``"auto"`` (``None``: the generation
            config's, else ``"auto"``) for a CUDA draft with ``tree_search="rounds"``, ``"on"`` (eagerly on a CPU),
            ``"off"``.
        learnt_state: Where the acceptance maps, the acceptance vector of a Sequoia policy chosen by name and
            ``budget="auto"``'s estimates are read and taught; ``None``: the state the draft carries
            (:func:`~.learnt_state.learnt_state_of`), so calls with the same draft keep learning. Pass a separate
            :class:`~.learnt_state.LearntState` to keep a run's learning apart.
        tokenizer, assistant_tokenizer: The target's and the draft's tokenizers, as HF assisted generation takes
            them (``generate()`` already built ``stop_strings`` criteria with the first): when both are given they
            are compared, and a draft with another tokenizer is refused (:func:`~.compat.check_same_tokenizer`). A
            draft sharing the target's tokenizer may be padded to another vocabulary size: it proposes only the ids
            both models have.
        model_kwargs: What ``generate()`` prepared: ``attention_mask`` and ``position_ids`` (any padding or holes),
            per-token inputs such as ``token_type_ids``, and its own cache bookkeeping (see
            :mod:`specexec_hf.hf.request`).
    """
    warn_unused_assisted_settings(generation_config)
    config, settings = specexec_settings(generation_config, specexec_config, dict(
        budget=budget, max_depth=max_depth, max_branch=max_branch, expand_per_forward=expand_per_forward,
        max_draft_forwards=max_draft_forwards, min_draft_gain=min_draft_gain, draft_temperature=draft_temperature,
        context_match_weights=context_match_weights, acceptance_calibration=acceptance_calibration,
        sampled_children=sampled_children, draft_ahead=draft_ahead, tree_search=tree_search, draft_budget=draft_budget,
        step_budget=step_budget, draft_graphs=draft_graphs,
    ))
    tree_search, draft_budget = settings["tree_search"] or grow_tree, settings["draft_budget"]
    graphs: DraftGraphs = settings["draft_graphs"] or "auto"
    by_name = isinstance(tree_search, str)
    tree_search = tree_policy(tree_search) if by_name else tree_search  # an unknown name fails before any work
    draft_model, requests = _checked_request(
        model, draft_model if draft_model is not None else assistant_model, input_ids, generation_config,
        model_kwargs, synced_gpus, tokenizer, assistant_tokenizer,
    )
    config = _capped_by_step_budget(config, settings["step_budget"], len(requests))
    batched = len(requests) > 1
    if batched:
        _check_batch_settings(config, intermediate_model, generation_config)
    hint_streaming_executor(model)
    # A batch's trees grow to at most the largest budget "auto" picks for one prompt.
    tree_cap = max(DEFAULT_CANDIDATES) if batched and config.budget == "auto" else config.budget
    if tree_cap != "auto":
        longest = max(request.input_ids.shape[1] for request in requests)
        check_budget_fits(model, longest, generation_config.max_length, tree_cap, rows=len(requests))
    request = requests[0]
    intermediate = _checked_intermediate(model, intermediate_model, draft_budget, config, request, generation_config)
    state = learnt_state if learnt_state is not None else learnt_state_of(draft_model)
    if by_name:  # a policy chosen by name learns in the state, as the acceptance maps do
        do_sample = generation_config.do_sample
        ranking = ranking_setting(draft_model, config, do_sample, generation_config.temperature)
        state.share_learning(tree_search, do_sample, *ranking)
    recorder = OutputRecorder(
        generation_config, model.config, specexec_stats if specexec_stats is not None else SpecExecStats()
    )
    if batched:
        row_config = config.updated(budget=tree_cap)
        drafters = [
            _drafter(model, draft_model, row_config, tree_search, state, generation_config, graphs) for _ in requests
        ]
        step_budget = settings["step_budget"]
        if config.budget == "auto" or step_budget == "auto":
            step_budget = _auto_step_total(model, draft_model, row_config, state, drafters[0].temperature)
        pad_token = generation_config._pad_token_tensor
        sequences = decode_batch(
            model, new_rows(requests, drafters, generation_config.max_length),
            _choice_rule(model, logits_processor, generation_config.do_sample), stopping_criteria, recorder,
            None if pad_token is None else int(pad_token), streamer, step_budget,
        )
        if streamer is not None:
            streamer.end()
        return recorder.output(sequences, None)
    decoder = _decoder(
        model, draft_model, request, config, tree_search, state, logits_processor, generation_config, graphs,
        intermediate,
    )
    # Processors, stopping criteria and the output see the sequence with its left padding, as in plain decoding;
    # the models see it without (the decoder counts unpadded tokens).
    sequence = torch.cat([request.left_padding, request.input_ids], dim=-1)
    watch = None
    finished = False
    while not finished:
        outcome = decoder.step(sequence)
        sequence, committed, finished = commit_tokens(sequence, outcome, stopping_criteria, recorder)
        if streamer is not None:
            streamer.put(sequence[0, -committed:].cpu())
        recorder.add_step(outcome, committed)
        if watch is None:  # from the second step on: the first one's forwards include the prompt's
            watch = ReadAheadWatch(model, recorder.stats.steps)
    watch.finish()
    if streamer is not None:
        streamer.end()
    return recorder.output(sequence, decoder.cache)


def _checked_request(
    model: PreTrainedModel,
    draft_model: PreTrainedModel | str | None,
    input_ids: torch.Tensor,
    generation_config: GenerationConfig,
    model_kwargs: dict,
    synced_gpus: bool,
    tokenizer: Any = None,
    assistant_tokenizer: Any = None,
) -> tuple[PreTrainedModel, list[Request]]:
    """The draft (a ``"self:..."`` spec resolved) and the checked request of each row, or a clear error before any
    work."""
    if draft_model is None:
        draft_model = _assistant_model_of_generate_call()
    draft_model = resolve_draft(model, draft_model) if isinstance(draft_model, str) else draft_model
    if draft_model is None:
        raise ValueError(
            "SpecExec needs a draft model: pass assistant_model=<small causal LM with the same tokenizer> (or "
            "draft_model=, the same)."
        )
    check_supported(model, "target")  # first: an unsupported model's inputs are beside the point
    requests = validate_batch(model, input_ids, generation_config, model_kwargs, synced_gpus)
    if any(request.has_masked_tokens for request in requests):
        check_masked_tokens_supported(model)
    check_same_tokenizer(tokenizer, assistant_tokenizer)
    return draft_model, requests


def _auto_step_total(
    model: PreTrainedModel, draft_model: PreTrainedModel, config: SpecExecConfig, state: LearntState,
    draft_temperature: float,
) -> AutoStepTotal:
    """A batch's ``step_budget="auto"``: the target's forward profile and the draft forward's cost that
    ``budget="auto"`` measured for this pair (kept in ``state``), trees of at most ``config.budget`` nodes; the first
    step expects the total ``budget="auto"`` would pick for one prompt."""
    auto_budget = state.auto_budget(model, draft_model, config, draft_temperature)
    step_total = AutoStepTotal(auto_budget.target_seconds, auto_budget.draft_forward_seconds, config.budget)
    step_total.last_total = auto_budget.choose(config.max_depth)
    return step_total


def _capped_by_step_budget(
    config: SpecExecConfig, step_budget: int | Literal["auto"] | None, rows: int
) -> SpecExecConfig:
    """The knobs with one sequence's tree cut to ``step_budget`` nodes (a batch shares them out step by step).

    Raises:
        ValueError: for a ``step_budget`` that is not a positive integer, or beside ``budget="auto"``.
    """
    if step_budget is None or step_budget == "auto":
        return config
    if not isinstance(step_budget, int) or isinstance(step_budget, bool) or step_budget < 1:
        raise ValueError(
            f"step_budget must be a positive integer (the tree nodes one target forward verifies over all the batch's "
            f"rows) or \"auto\"; got {step_budget!r}."
        )
    if config.budget == "auto":
        raise ValueError(
            'step_budget fixes the nodes each target forward verifies, which budget="auto" picks itself: pass '
            'step_budget="auto" (or a fixed budget= with step_budget=), or drop step_budget.'
        )
    return config if rows > 1 else config.updated(budget=min(config.budget, step_budget))


def _check_batch_settings(
    config: SpecExecConfig, intermediate_model: PreTrainedModel | str | None, generation_config: GenerationConfig
) -> None:
    """Refuses, naming it, a setting that a batch of prompts does not support yet."""
    refused = [
        name for name, on in (
            ("draft_ahead=True", config.draft_ahead), ("intermediate_model", intermediate_model is not None),
            ("output_scores", generation_config.output_scores), ("output_logits", generation_config.output_logits),
            ("output_hidden_states", generation_config.output_hidden_states),
            ("output_attentions", generation_config.output_attentions),
        ) if on
    ]
    if refused:
        raise ValueError(
            f"SpecExec does not run {refused[0]} over a batch of prompts yet: pass draft_ahead=False, "
            "no intermediate_model and no per-token outputs, or call generate() per prompt (a pipeline's "
            "batch_size=1)."
        )


def _assistant_model_of_generate_call() -> PreTrainedModel | str | None:
    """The ``assistant_model=`` of the ``generate()`` call that runs SpecExec as its ``custom_generate`` callable.

    Without the patch, transformers hands such a callable only the keyword arguments that its signature adds to
    ``generate()``'s own, so a draft given as ``assistant_model=`` never arrives; it is still an argument of that
    call, read from its frame, the nearest ``GenerationMixin.generate`` frame up the stack.
    """
    generate_code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = inspect.currentframe()
    while frame is not None and frame.f_code is not generate_code:
        frame = frame.f_back
    return None if frame is None else frame.f_locals.get("assistant_model")


def _checked_intermediate(
    model: PreTrainedModel,
    intermediate_model: PreTrainedModel | str | None,
    draft_budget: int | None,
    config: SpecExecConfig,
    request: Request,
    generation_config: GenerationConfig,
) -> IntermediateDraft | None:
    """The hierarchy's intermediate level (a ``"self:..."`` spec resolved), or a clear error before any work."""
    if intermediate_model is None:
        if draft_budget is not None:
            raise ValueError(
                "draft_budget sizes the draft's tree in a draft hierarchy: pass intermediate_model=<model> with it, "
                "or budget=<nodes> alone."
            )
        return None
    conflicts = [
        name for name, on in (
            ('budget="auto"', config.budget == "auto"), ("draft_ahead=True", config.draft_ahead),
            ("sampled_children=True", config.sampled_children and generation_config.do_sample),
        ) if on
    ]
    if conflicts:
        raise ValueError(
            f"intermediate_model (a draft hierarchy) does not combine with {conflicts[0]}: the intermediate cuts the "
            "draft's tree to a fixed budget before the target verifies it. Pass a fixed budget, draft_ahead=False "
            "and sampled_children=False, or drop intermediate_model."
        )
    if draft_budget is None:
        draft_budget = HIERARCHY_DRAFT_FACTOR * config.budget
    if not isinstance(draft_budget, int) or isinstance(draft_budget, bool) or draft_budget < config.budget:
        raise ValueError(
            f"draft_budget must be an integer >= budget ({config.budget}): the intermediate keeps budget nodes of "
            f"the draft's tree; got {draft_budget!r}."
        )
    intermediate_model = resolve_draft(model, intermediate_model) if isinstance(intermediate_model, str) else (
        intermediate_model
    )
    check_supported(intermediate_model, "intermediate")
    check_intermediate_vocabulary(model, intermediate_model)
    check_budget_fits(intermediate_model, request.input_ids.shape[1], generation_config.max_length, draft_budget)
    return IntermediateDraft(intermediate_model, request, config.budget, draft_budget)


def _decoder(
    model: PreTrainedModel,
    draft_model: PreTrainedModel,
    request: Request,
    config: SpecExecConfig,
    tree_search: SearchPolicy,
    state: LearntState,
    logits_processor: LogitsProcessorList,
    generation_config: GenerationConfig,
    draft_graphs: DraftGraphs,
    intermediate: IntermediateDraft | None = None,
) -> SpecExecDecoder:
    """The decoder for one ``generate()`` call: its drafter (:func:`_drafter`), ``budget="auto"`` and the choice
    rule, both learning in ``state``; with an ``intermediate``, the drafter grows trees of its draft budget."""
    if config.draft_ahead:
        check_draft_ahead(model, draft_model)
    drafter = _drafter(
        model, draft_model, config if intermediate is None else config.updated(budget=intermediate.draft_budget),
        tree_search, state, generation_config, draft_graphs,
    )
    auto_budget = (
        state.auto_budget(model, draft_model, config, drafter.temperature) if config.budget == "auto" else None
    )
    costs = (auto_budget.target_seconds, auto_budget.draft_forward_seconds) if auto_budget is not None else None
    if costs is not None and tree_search.size_by_cost(*costs):
        # The policy sizes each tree from the same measured costs, up to the largest budget "auto" would pick.
        drafter.config, auto_budget = config.updated(budget=max(auto_budget.candidates)), None
    trace = (generation_config.output_hidden_states, generation_config.output_attentions)
    return SpecExecDecoder(
        model, drafter, request, _choice_rule(model, logits_processor, generation_config.do_sample),
        generation_config.max_length, auto_budget, trace, config.draft_ahead, intermediate,
    )


def _drafter(
    model: PreTrainedModel,
    draft_model: PreTrainedModel,
    config: SpecExecConfig,
    tree_search: SearchPolicy,
    state: LearntState,
    generation_config: GenerationConfig,
    draft_graphs: DraftGraphs,
) -> SpecExecCandidateGenerator:
    """One sequence's drafter: the draft's calibrated ranking settings, the acceptance map (learning in ``state``)
    and drawn children where the policy supports them, and its draft cache's kind (``draft_graphs``)."""
    do_sample = generation_config.do_sample
    draft_temperature, match_weights = ranking_setting(draft_model, config, do_sample, generation_config.temperature)
    calibrate = config.acceptance_calibration and tree_search.ranks_children
    sampled_children = do_sample and config.sampled_children and tree_search.draws_children
    return SpecExecCandidateGenerator(
        draft_model, config, draft_temperature, search=tree_search, context_match_weights=match_weights,
        acceptance_map=state.acceptance_map(
            draft_model, do_sample, draft_temperature, match_weights, sampled_children
        ) if calibrate else None,
        sampled_children=sampled_children, target_vocab_size=logits_width(model), draft_graphs=draft_graphs,
    )


def _choice_rule(model: PreTrainedModel, logits_processor: LogitsProcessorList, do_sample: bool) -> ChoiceRule:
    """The target's choice rule; near-ties measured by how far rounding in its dtype can move its logits (see
    :mod:`specexec_hf.core.precision`)."""
    return ChoiceRule(
        TreeLogitsProcessor(logits_processor), do_sample, torch.finfo(model.dtype).eps,
        model.config.get_text_config().hidden_size,
    )
