"""SpecExec over a batch of prompts in one ``generate()`` call: every row's tree verified in one target forward.

A target streamed from RAM or disk costs about as much per forward for one token as for hundreds, and one tree
uses only part of that. Here each step grows every live row's tree in shared draft forwards
(:func:`~.candidate_generator.grow_trees`), optionally cuts them to one node budget for the whole step where the
forecast acceptance is highest (:func:`~specexec_hf.core.step_budget.kept_nodes`, as the vLLM path does), scores
them all in one target forward over a KV cache the rows share (:class:`~.tree_scorer.BatchTreeScorer`, layout in
:mod:`specexec_hf.core.batch_packing`), and walks each row's tree with the target's own choices
(:class:`~.decoder.TargetChoice`, as for one sequence). Each row's output is therefore the one its prompt alone
would give.

With ``step_budget="auto"`` (and ``budget="auto"``, which implies it for a batch) each step's node total is the one
with the most forecast tokens per second (:func:`~specexec_hf.core.batch_budget.step_total`) under the target's
measured forward profile and the step's draft forwards at their measured cost, the profile and the cost
``budget="auto"`` measures for one sequence (:class:`~.autobudget.AutoBudget`); each row's tree grows to twice its
even share of the last step's total (:func:`~specexec_hf.core.batch_budget.row_tree_budget`, as the vLLM path's
trees), so a few rows holding the best nodes can still feed the total, without drafting every tree to its cap.

The rows' tokens are committed one at a time against the stopping criteria, as a batched plain ``generate()``
commits them: a finished row leaves the batch and is padded with ``pad_token_id`` when the criteria include an
EOS criterion (plain decoding pads it then); without one plain decoding goes on decoding a finished row until every
row has finished, and so does this loop, up to that length. A streamer gets the output one column (``[batch]``
tokens) at a time, as from batched plain decoding, each column once every row has committed its token there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.generation import StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..core.batch_budget import row_tree_budget, step_total
from ..core.search import SearchResult
from ..core.stats import StepStats
from ..core.step_budget import kept_nodes, path_scores
from ..core.tree import TokenTree
from ..core.verify import acceptance_walk
from .candidate_generator import SpecExecCandidateGenerator, grow_trees
from .decoder import ChoiceRule, StepOutcome, TargetChoice
from .offload_hint import ReadAheadWatch
from .outputs import OutputRecorder, commit_tokens, tree_forecast
from .request import Request
from .tree_scorer import BatchTreeScorer


@dataclass
class BatchRow:
    """One prompt of the batch and its decoding so far.

    Args:
        request: The row's checked inputs.
        drafter: Grows the row's trees (its own draft cache).
        sequence: ``[1, n]`` its committed tokens, with its left padding up to the batch's prompt width.
        limit: Its sequence never grows past this length (``max_length``, or where the batch ends).
        stopped_at: Its length when a stopping criterion fired (``None``: still running).
    """

    request: Request
    drafter: SpecExecCandidateGenerator
    sequence: torch.Tensor
    limit: int
    stopped_at: int | None = None

    @property
    def committed(self) -> torch.Tensor:
        """``[1, L]`` the committed tokens without the left padding."""
        return self.sequence[:, self.request.left_padding.shape[1] :]


def cut_result(result: SearchResult, keep: torch.Tensor) -> SearchResult:
    """``result`` with its tree cut to the nodes ``keep`` (ascending, closed under parents), still pointing into the
    search's pool (drawn children's distributions are looked up through it)."""
    if keep.numel() == result.tree.num_nodes:
        return result
    keep = keep.to(result.tree.device)
    top = result.draft_top_tokens
    return SearchResult(
        result.tree.select(keep), result.pool, result.pool_index[keep], result.draft_forwards,
        None if top is None else top[keep],
    )


class AutoStepTotal:
    """``step_budget="auto"``: each step's node total over the rows' trees, and the size the trees grow to.

    Args:
        target_seconds: The target forward's seconds by tokens fed (the measured profile).
        draft_forward_seconds: The seconds of one draft forward (measured).
        cap: The most nodes one row's tree grows to.
    """

    def __init__(self, target_seconds: Callable[[int], float], draft_forward_seconds: float, cap: int):
        self.target_seconds, self.draft_forward_seconds, self.cap = target_seconds, draft_forward_seconds, cap
        self.last_total: int | None = None

    def tree_budget(self, rows: int) -> int:
        """Nodes each of ``rows`` trees grows to this step (the cap before the first step)."""
        return row_tree_budget(rows, self.last_total, self.cap)

    def choose(self, trees: Sequence[TokenTree], draft_forwards: int) -> int:
        """The node total (roots excluded) this step's ``trees`` are cut to, their growth having taken
        ``draft_forwards`` draft forwards (paid whatever the total)."""
        self.last_total = step_total(
            [path_scores(tree)[1:] for tree in trees], self.target_seconds,
            self.draft_forward_seconds * draft_forwards,
        )
        return self.last_total


class BatchDecoder:
    """SpecExec decoding of several sequences, one :meth:`step` of all live rows at a time; owns their target cache.

    Args:
        model: The target.
        rows: The batch; its rows' order is the cache's.
        rule: The target's choice rule (shared: the processors see each row's own sequence).
        step_budget: Tree nodes (roots excluded) one step verifies over all rows, given to the likeliest accepted
            (:func:`~specexec_hf.core.step_budget.kept_nodes`); an :class:`AutoStepTotal` picks them (and the
            trees' size) step by step; ``None``: every row's whole tree.
    """

    def __init__(
        self, model: PreTrainedModel, rows: Sequence[BatchRow], rule: ChoiceRule,
        step_budget: int | AutoStepTotal | None,
    ):
        self.rows, self.rule, self.step_budget = list(rows), rule, step_budget
        self.scorer = BatchTreeScorer(model, [row.request for row in rows])

    def step(self) -> tuple[list[StepOutcome], int]:
        """One step of every row: its tree, one target forward for all, its walk. Returns each row's outcome and the
        draft calls made for all of them; the caller commits and then calls :meth:`keep`."""
        started = time.perf_counter()
        auto = self.step_budget if isinstance(self.step_budget, AutoStepTotal) else None
        if auto is not None:
            tree_budget = auto.tree_budget(len(self.rows))
            for row in self.rows:
                row.drafter.config = row.drafter.config.updated(budget=tree_budget)
        grown = grow_trees([
            (row.drafter, row.request.draft_history(row.committed), row.limit - row.sequence.shape[1] - 1)
            for row in self.rows
        ])
        verified_results = grown.results
        trees = [result.tree for result in grown.results]
        total = self.step_budget if auto is None else auto.choose(trees, grown.draft_calls)
        if total is not None:
            keep = kept_nodes(trees, total)
            verified_results = [cut_result(result, nodes) for result, nodes in zip(grown.results, keep)]
        drafted = time.perf_counter()
        logits = self.scorer.score([row.committed for row in self.rows], [r.tree for r in verified_results])
        verified = time.perf_counter()
        outcomes = []
        for row, drafted_result, result, row_logits, cached in zip(
            self.rows, grown.results, verified_results, logits, self.scorer.cached
        ):
            drafter = row.drafter
            choice = TargetChoice(self.rule, row.sequence, result, row_logits, drafter, drafter.sampled_children)
            acceptance = acceptance_walk(result.tree, choice)
            drafter.observe(drafted_result, acceptance.tokens, choice.sampled_from or None)
            length = row.committed.shape[1]
            outcomes.append(StepOutcome(
                result, acceptance, choice.scores, choice.near_tied, row_logits, length, length - cached,
                draft_seconds=drafted - started, target_seconds=verified - drafted,
            ))
        return outcomes, grown.draft_calls

    def keep(self, outcomes: Sequence[StepOutcome], committed: Sequence[int]) -> None:
        """After a :meth:`step` whose rows committed ``committed`` of their tokens: each row's cache keeps the
        accepted nodes whose tokens it committed, but the last committed token (the next root)."""
        self.scorer.keep([outcome.acceptance.path[: count - 1] for outcome, count in zip(outcomes, committed)])

    def keep_rows(self, rows: Sequence[BatchRow]) -> None:
        """Decodes only ``rows`` (a subsequence of the live rows) from now on."""
        index = {id(row): position for position, row in enumerate(self.rows)}
        self.scorer.keep_rows([index[id(row)] for row in rows])
        self.rows = list(rows)


def has_eos_criterion(stopping_criteria: StoppingCriteriaList) -> bool:
    """Whether plain decoding pads finished rows: when a criterion stops on EOS (its own test, verbatim)."""
    return any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)


def decode_batch(
    model: PreTrainedModel,
    rows: Sequence[BatchRow],
    rule: ChoiceRule,
    stopping_criteria: StoppingCriteriaList,
    recorder: OutputRecorder,
    pad_token_id: int | None,
    streamer: BaseStreamer | None = None,
    step_budget: int | AutoStepTotal | None = None,
) -> torch.Tensor:
    """Decodes every row until it stops (see the module docstring); returns the ``[batch, n]`` sequences, finished
    rows padded with ``pad_token_id``, as batched plain ``generate()`` returns them.

    Args:
        model: The target.
        rows: The batch, each row with its prompt as its sequence.
        rule: The target's choice rule.
        stopping_criteria: Checked after each committed token, per row.
        recorder: Takes each step's statistics (all rows together: one target forward).
        pad_token_id: Fills finished rows when an EOS criterion is among ``stopping_criteria``.
        streamer: Gets the output's columns in order.
        step_budget: As :class:`BatchDecoder`.
    """
    pads_finished = has_eos_criterion(stopping_criteria)
    if pads_finished and pad_token_id is None:
        raise ValueError("Batched SpecExec pads finished rows: set pad_token_id (or eos_token_id) in the config.")
    decoder = BatchDecoder(model, rows, rule, step_budget)
    streamed = rows[0].sequence.shape[1]  # generate() streamed the prompts
    live = list(rows)
    watch = None
    while live:
        outcomes, draft_calls = decoder.step()
        counts = []
        for row, outcome in zip(live, outcomes):
            if row.stopped_at is None:
                row.sequence, count, stopped = commit_tokens(row.sequence, outcome, stopping_criteria, recorder)
                if stopped:
                    row.stopped_at = row.sequence.shape[1]
            else:  # still decoded after stopping: plain decoding does so without an EOS criterion
                count = len(outcome.acceptance.tokens)
                row.sequence = torch.cat([row.sequence, row.sequence.new_tensor([outcome.acceptance.tokens])], dim=-1)
            if row.stopped_at is None and row.sequence.shape[1] >= row.limit:  # max_length without its criterion
                row.stopped_at = row.sequence.shape[1]
            counts.append(count)
        decoder.keep(outcomes, counts)
        recorder.stats.steps.append(_batch_step_stats(outcomes, counts, draft_calls))
        if watch is None:  # from the second step on: the first one's forwards include the prompts'
            watch = ReadAheadWatch(model, recorder.stats.steps)
        live = _rows_to_decode(rows, pads_finished)
        if len(live) < len(decoder.rows):
            decoder.keep_rows(live)
        if streamer is not None:
            streamed = _stream_columns(streamer, rows, live, streamed, pad_token_id)
    if watch is not None:
        watch.finish()
    return _padded_output(rows, pad_token_id)


def _rows_to_decode(rows: Sequence[BatchRow], pads_finished: bool) -> list[BatchRow]:
    """The rows the next step decodes: the running ones; without an EOS criterion also the stopped ones until they
    reach the length where the last row stopped (then each row's limit)."""
    running = [row for row in rows if row.stopped_at is None]
    if pads_finished:
        return running
    if not running:
        end = _output_length(rows)
        for row in rows:
            row.limit = end
    return [row for row in rows if row.sequence.shape[1] < row.limit]


def _output_length(rows: Sequence[BatchRow]) -> int:
    """Where plain decoding's batch ends: at the last row's stop (once every row has stopped)."""
    return max(row.stopped_at for row in rows if row.stopped_at is not None)


def _padded_output(rows: Sequence[BatchRow], pad_token_id: int | None) -> torch.Tensor:
    """``[batch, n]`` every row's sequence cut or padded to the output length."""
    return _padded_columns(rows, 0, _output_length(rows), pad_token_id)


def _stream_columns(
    streamer: BaseStreamer, rows: Sequence[BatchRow], live: Sequence[BatchRow], streamed: int, pad_token_id: int | None
) -> int:
    """Puts the output's columns from ``streamed`` on that every row has decided (a row no longer ``live`` is
    padded from its end; with no row live, up to the output length); returns the columns streamed so far."""
    ready = min(row.sequence.shape[1] for row in live) if live else _output_length(rows)
    for column in _padded_columns(rows, streamed, ready, pad_token_id).unbind(dim=1):
        streamer.put(column.cpu())
    return max(ready, streamed)


def _padded_columns(rows: Sequence[BatchRow], start: int, stop: int, pad_token_id: int | None) -> torch.Tensor:
    """``[batch, max(stop - start, 0)]`` the output's columns ``[start, stop)``, rows that ended before padded."""
    width = max(stop - start, 0)
    fill = pad_token_id if pad_token_id is not None else 0  # without padding every row reaches the output length
    return torch.cat([
        torch.nn.functional.pad(part, (0, width - part.shape[1]), value=fill)
        for part in (row.sequence[:, start : start + width] for row in rows)
    ])


def _batch_step_stats(outcomes: Sequence[StepOutcome], committed: Sequence[int], draft_calls: int) -> StepStats:
    """One step's statistics over all its rows: one target forward, the draft calls they shared, their trees' nodes
    and committed tokens summed (near-ties are per row and not kept)."""
    first = outcomes[0]
    return StepStats(
        tree_size=sum(outcome.grown.tree.num_nodes for outcome in outcomes),
        accepted=sum(committed),
        draft_forwards=draft_calls,
        draft_seconds=first.draft_seconds,
        target_seconds=first.target_seconds,
        path_length=sum(len(outcome.acceptance.path) for outcome in outcomes),
        forecast=sum(tree_forecast(outcome.grown.tree) for outcome in outcomes),
    )


def new_rows(
    requests: Sequence[Request], drafters: Sequence[SpecExecCandidateGenerator], max_length: int
) -> list[BatchRow]:
    """The batch's rows before decoding: each prompt with its left padding, up to ``max_length``."""
    return [
        BatchRow(request, drafter, torch.cat([request.left_padding, request.input_ids], dim=-1), max_length)
        for request, drafter in zip(requests, drafters)
    ]
