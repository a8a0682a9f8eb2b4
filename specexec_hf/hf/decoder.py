"""One SpecExec step, named: :meth:`SpecExecDecoder.step`.

The draft grows a tree under the last committed token; the target scores the pending committed tokens and the whole
tree in one forward; the acceptance walk takes the target's own choices down the tree (:class:`TargetChoice`, the
rule plain decoding applies, node by node) plus one bonus token; the target's cache keeps only the committed path
(the draft's is cut on the next tree). The target's cache always holds every committed token but the last, which
becomes the next tree's root. What the step did comes back as a :class:`StepOutcome`; committing its tokens against
the stopping criteria and recording outputs is the caller's (:mod:`.generation`, :mod:`.outputs`).
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.generation import LogitsProcessorList

from ..core.config import DRAFT_AHEAD_FACTOR
from ..core.precision import greedy_choice
from ..core.search import SearchResult
from ..core.tree import TokenTree
from ..core.verify import Acceptance, acceptance_walk, rejection_sample
from .autobudget import AutoBudget
from .candidate_generator import SAMPLED_AFTER, SpecExecCandidateGenerator
from .executor import executor_of
from .forward import NodeLogits
from .intermediate_draft import IntermediateDraft
from .request import Request
from .tree_scorer import TreeScorer


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


@dataclass(frozen=True)
class ChoiceRule:
    """How the target picks its token at a node: what plain decoding does with its logits there.

    Args:
        processor: The logits processors, applied with the node's path as the sequence.
        do_sample: Draw from the processed scores' softmax; else take their argmax.
        logits_eps: Machine epsilon of the target's dtype, and
        head_width: the width of its LM head's dot products: together they bound how far rounding moves a logit
            (:func:`~specexec_hf.core.precision.greedy_choice` flags greedy choices within that of a tie).
    """

    processor: TreeLogitsProcessor
    do_sample: bool
    logits_eps: float
    head_width: int


class TargetChoice:
    """One step's ``choose`` for :func:`~specexec_hf.core.verify.acceptance_walk`, and what the walk saw.

    Greedy: the argmax of the node's processed scores, noting near-ties. Sampling: a draw from their softmax, by
    recursive rejection sampling over the node's children when they were drawn from the draft (exact either way).

    Args:
        rule: The choice rule.
        sequence: ``[1, L]`` the committed tokens (with any left padding), the prefix every node's path extends.
        grown: The step's search result; its tree is walked.
        logits: The target's logits per tree node.
        drafter: Gives the draft distribution drawn children came from, when ``drawn_children``.
        drawn_children: The tree's children other than each node's first were drawn from the draft.
    """

    def __init__(
        self,
        rule: ChoiceRule,
        sequence: torch.Tensor,
        grown: SearchResult,
        logits: NodeLogits,
        drafter: SpecExecCandidateGenerator,
        drawn_children: bool,
    ):
        self.rule, self.sequence, self.grown, self.logits, self.drafter = rule, sequence, grown, logits, drafter
        self.scores: list[torch.Tensor] = []  # [1, vocab] processed scores of each choice, in walk order
        self.near_tied: list[int] = []  # indices into scores whose choice rounding could flip (see core.precision)
        self.sampled_from: list[torch.Tensor] = []  # when sampling, the distribution of each choice, for the drafter
        self.children: dict[int, list[int]] = {}  # node -> its children's tokens, in the order they were drawn
        if drawn_children:
            for parent, token in zip(*grown.tree.host_lists()):  # the host copy the walk reads anyway
                self.children.setdefault(parent, []).append(token)

    def __call__(self, node: int) -> int:
        """The target's token at tree ``node``."""
        rule = self.rule
        scores = rule.processor(self.sequence, self.grown.tree, self.logits.row(node), [node])
        self.scores.append(scores)
        if not rule.do_sample:
            token, tied = greedy_choice(scores, rule.logits_eps, rule.head_width).tolist()  # one host read for both
            if tied:
                self.near_tied.append(len(self.scores) - 1)
            return token
        self.sampled_from.append(torch.softmax(scores, dim=-1))
        if node in self.children:
            candidates = torch.tensor(self.children[node])
            draft = self.drafter.draft_probs(self.grown, node)
            return rejection_sample(self.sampled_from[-1][0], draft, candidates, SAMPLED_AFTER)
        return int(torch.multinomial(self.sampled_from[-1], 1))


@dataclass
class StepOutcome:
    """What one :meth:`SpecExecDecoder.step` did.

    Args:
        grown: The draft's search result (``grown.tree``: the verified tree, node 0 the root).
        acceptance: The walk: the accepted nodes and the tokens to commit (theirs, then the bonus token).
        scores: ``[1, vocab]`` processed scores behind each of ``acceptance.tokens``, in order.
        near_tied: Indices into ``scores`` of near-tied greedy choices.
        logits: The target's logits per tree node (``outputs`` holds hidden states and attentions when asked).
        length: Committed tokens (without left padding) before the step.
        pending: Committed tokens fed to the target before the tree (the last is the root).
        draft_seconds: Time spent growing the tree.
        target_seconds: Time spent in the target's forward.
    """

    grown: SearchResult
    acceptance: Acceptance
    scores: list[torch.Tensor]
    near_tied: list[int]
    logits: NodeLogits
    length: int
    pending: int
    draft_seconds: float
    target_seconds: float


AHEAD_SWITCH_INTERVAL = 0.0005  # seconds; Python's default is 0.005


def check_draft_ahead(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    """Raises ``ValueError`` if the draft shares a module with the target whose weights are streamed or fetched by
    hooks: with ``draft_ahead`` the two run at once, and two threads would stream into the same module.

    Args:
        target: The target.
        draft: The draft.
    """
    draft_modules = {id(module) for module in draft.modules()}
    executor = executor_of(target)
    streamed = list(executor.unit_names) if executor is not None else []
    hooked = [name for name, module in target.named_modules() if hasattr(module, "_hf_hook")]
    shared = [name for name in streamed + hooked if id(target.get_submodule(name)) in draft_modules]
    if shared:
        raise ValueError(
            f"draft_ahead runs the draft while the target verifies, but the draft shares the target's {shared[0]!r}, "
            "whose weights are streamed or fetched by offloading hooks: two threads would load them at once. Pass "
            "draft_ahead=False, or a draft with its own copy of those layers."
        )


class SpecExecDecoder:
    """SpecExec decoding of one sequence, one :meth:`step` at a time; owns the target's KV cache.

    Args:
        model: The target.
        drafter: Grows the trees (its draft cache persists across steps).
        request: The checked inputs (padding, positions, per-token inputs, masked tokens).
        rule: The target's choice rule.
        max_length: No step commits past this many tokens (left padding included).
        auto_budget: Picks each tree's budget (``budget="auto"``), else ``None``.
        trace: Keep the target's hidden states and attention weights (``output_hidden_states`` /
            ``output_attentions``).
        draft_ahead: Verify in a worker thread while the drafter grows the tree on (``SpecExecConfig.draft_ahead``;
            the drafter's ``grow_ahead``).
        intermediate: Re-ranks each draft tree and cuts it to the budget before the target verifies it (a draft
            hierarchy, :mod:`.intermediate_draft`); ``None``: the target verifies the draft's tree.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        drafter: SpecExecCandidateGenerator,
        request: Request,
        rule: ChoiceRule,
        max_length: int,
        auto_budget: AutoBudget | None = None,
        trace: tuple[bool, bool] = (False, False),
        draft_ahead: bool = False,
        intermediate: IntermediateDraft | None = None,
    ):
        self.model, self.drafter, self.request, self.rule = model, drafter, request, rule
        self.intermediate = intermediate
        self.max_length, self.auto_budget = max_length, auto_budget
        self.draft_ahead = draft_ahead
        self.padding = request.left_padding.shape[1]
        self.scorer = TreeScorer(model, request, trace)

    @property
    def cache(self) -> DynamicCache:
        """The target's KV cache: every committed token but the last."""
        return self.scorer.cache

    @property
    def cached(self) -> int:
        """Committed tokens (without left padding) in the target's cache."""
        return self.scorer.cached

    def step(self, sequence: torch.Tensor) -> StepOutcome:
        """One step after the committed ``sequence`` (``[1, L]``, left padding included): draft, verify, walk.

        The caller commits ``outcome.acceptance.tokens`` (or a prefix, if a stopping criterion fires) and passes the
        longer sequence to the next step.
        """
        length = sequence.shape[1] - self.padding
        started = time.perf_counter()
        drafted_tree = self._draft(sequence)
        grown = drafted_tree
        if self.intermediate is not None:
            depth_limit = self.drafter.config.depth_limit(self._depth_left(sequence))
            grown = self.intermediate.rescore(sequence, drafted_tree, depth_limit)
        drafted = time.perf_counter()
        if self.draft_ahead:
            logits = self._verify_while_drafting_ahead(sequence, grown)
        else:
            logits = self._verify(sequence, grown.tree)
        verified = time.perf_counter()
        choice = TargetChoice(
            self.rule, sequence, grown, logits, self.drafter, drawn_children=self.drafter.sampled_children
        )
        acceptance = acceptance_walk(grown.tree, choice)
        self.drafter.observe(drafted_tree, acceptance.tokens, choice.sampled_from or None)
        pending = length - self.cached
        self.scorer.keep(length, acceptance.path)
        if self.intermediate is not None:
            self.intermediate.keep(length, acceptance.path)
        if self.auto_budget is not None:
            self.auto_budget.observe(
                grown.tree, acceptance, drafted - started, grown.draft_forwards, time.perf_counter() - verified,
                budget=self.drafter.config.budget, target_seconds=verified - drafted,
            )
        return StepOutcome(
            grown, acceptance, choice.scores, choice.near_tied, logits, length, pending,
            draft_seconds=drafted - started, target_seconds=verified - drafted,
        )

    def _draft(self, sequence: torch.Tensor) -> SearchResult:
        """The draft's tree under the last committed token, no deeper than ``max_length`` leaves room for."""
        depth_left = self._depth_left(sequence)
        if self.auto_budget is not None:
            self.drafter.config = self.drafter.config.updated(budget=self.auto_budget.next_budget(depth_left))
        return self.drafter.grow_tree(self.request.draft_history(sequence[:, self.padding :]), max_depth=depth_left)

    def _depth_left(self, sequence: torch.Tensor) -> int:
        """How deep a tree after ``sequence`` may grow: ``max_length`` minus the committed tokens and the bonus one."""
        return self.max_length - sequence.shape[1] - 1

    def _verify_while_drafting_ahead(self, sequence: torch.Tensor, grown: SearchResult) -> NodeLogits:
        """:meth:`_verify` in a worker thread while the draft grows the tree's search on (``draft_ahead``)."""
        finished = threading.Event()
        outcome: list = []
        grad_enabled = torch.is_grad_enabled()  # grad mode is per thread

        def verify() -> None:
            try:
                with torch.set_grad_enabled(grad_enabled):
                    outcome.append(self._verify(sequence, grown.tree))
            except BaseException as error:  # raised again in the caller's thread
                outcome.append(error)
            finally:
                finished.set()

        # In a copy of the caller's context: the worker verifies for this call, under its hold of the target
        # (a streamed target's ring, see .ownership), which other threads wait for.
        worker = threading.Thread(
            target=contextvars.copy_context().run, args=(verify,), name="specexec-verify", daemon=True
        )
        switch_interval = sys.getswitchinterval()
        # The draft's Python between its ops holds the interpreter lock; the target's per-layer hooks and readers
        # need it briefly and often: switch threads more often than every 5 ms while both run.
        sys.setswitchinterval(AHEAD_SWITCH_INTERVAL)
        worker.start()
        try:
            self.drafter.grow_ahead(finished.is_set, DRAFT_AHEAD_FACTOR * self.drafter.config.budget)
        finally:
            worker.join()
            sys.setswitchinterval(switch_interval)
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def _verify(self, sequence: torch.Tensor, tree: TokenTree) -> NodeLogits:
        """One target forward: the committed tokens it has not seen (ending with the root), then the tree."""
        return self.scorer.score(sequence, tree)
