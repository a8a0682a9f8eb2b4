"""What ``generate()`` returns beside the tokens, recorded step by step: scores, logits, hidden states and attentions
per committed token (as the generation config asks, shaped as plain decoding returns them) and statistics per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, GenerationConfig, PretrainedConfig
from transformers.generation import GenerateDecoderOnlyOutput, StoppingCriteriaList
from transformers.utils import ModelOutput

from ..core.stats import SpecExecStats, StepStats
from ..core.tree import TokenTree
from .attention_spans import attention_spans, decoder_layer_types
from .decoder import StepOutcome


@dataclass
class SpecExecDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus ``specexec_stats`` (tokens per target forward, tree sizes, timings)."""

    specexec_stats: SpecExecStats | None = None


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


def tree_forecast(tree: TokenTree) -> float:
    """The tree tokens its ranking expects the target to accept (:attr:`~specexec_hf.core.stats.StepStats.forecast`):
    node scores are cumulative log-probabilities of acceptance, so their exponentials, summed over the non-root
    nodes."""
    return float(tree.logprobs[1:].double().exp().sum())


class OutputRecorder:
    """Collects the outputs ``generate()`` returns as the tokens are committed.

    Args:
        generation_config: ``output_scores``, ``output_logits``, ``output_hidden_states``, ``output_attentions``
            and ``return_dict_in_generate`` say what to keep.
        model_config: The target's config (its layers' attention spans shape the attention rows).
        stats: Receives one :class:`StepStats` per step.
    """

    def __init__(self, generation_config: GenerationConfig, model_config: PretrainedConfig, stats: SpecExecStats):
        self.config, self.stats = generation_config, stats
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.hidden: list[tuple[torch.Tensor, ...]] = []
        self.attentions: list[tuple[torch.Tensor, ...]] = []
        spans = attention_spans(model_config)
        self.layer_reaches = [spans[kind].reach() if kind in spans else 0 for kind in decoder_layer_types(model_config)]

    def add_token(self, outcome: StepOutcome, index: int) -> None:
        """Records the step's ``index``-th committed token (0: the one chosen at the root)."""
        config, acceptance = self.config, outcome.acceptance
        if config.output_scores:
            self.scores.append(outcome.scores[index])
        if config.output_logits:
            self.logits.append(outcome.logits.row(acceptance.path[index - 1] if index else 0))
        if config.output_hidden_states or config.output_attentions:
            hidden, attentions = _outputs_of(
                outcome.logits.outputs, outcome.pending, outcome.length, acceptance.path, index, self.layer_reaches
            )
            self.hidden.append(hidden)
            self.attentions.append(attentions)

    def add_step(self, outcome: StepOutcome, committed: int) -> None:
        """Records the step's statistics, ``committed`` of its tokens having been committed."""
        tree = outcome.grown.tree
        self.stats.steps.append(
            StepStats(
                tree_size=tree.num_nodes,
                accepted=committed,
                draft_forwards=outcome.grown.draft_forwards,
                draft_seconds=outcome.draft_seconds,
                target_seconds=outcome.target_seconds,
                path_length=len(outcome.acceptance.path),
                forecast=tree_forecast(tree),
                near_tied=tuple(outcome.near_tied),
            )
        )

    def output(
        self, sequence: torch.Tensor, cache: DynamicCache | None
    ) -> SpecExecDecoderOnlyOutput | torch.Tensor:
        """What ``generate()`` returns: the sequence alone, or with what was recorded (``cache``: the target's, or
        ``None`` where its layout is SpecExec's own, a batch's shared cache)."""
        config = self.config
        if not config.return_dict_in_generate:
            return sequence
        return SpecExecDecoderOnlyOutput(
            sequences=sequence,
            scores=tuple(self.scores) if config.output_scores else None,
            logits=tuple(self.logits) if config.output_logits else None,
            hidden_states=tuple(self.hidden) if config.output_hidden_states else None,
            attentions=tuple(self.attentions) if config.output_attentions else None,
            past_key_values=cache if config.use_cache else None,
            specexec_stats=self.stats,
        )


def commit_tokens(
    sequence: torch.Tensor, outcome: StepOutcome, stopping_criteria: StoppingCriteriaList, recorder: OutputRecorder
) -> tuple[torch.Tensor, int, bool]:
    """Appends the step's tokens one at a time, recording each and checking the stopping criteria after it.

    Returns:
        The longer sequence, how many tokens it gained (tokens after a stop are dropped), and whether it stopped.
    """
    tokens = outcome.acceptance.tokens
    # The step's tokens go to the device at once; stopping criteria still see them one at a time, as views.
    extended = torch.cat([sequence, sequence.new_tensor([tokens])], dim=-1)
    for index, scores in enumerate(outcome.scores):
        sequence = extended[:, : extended.shape[1] - len(tokens) + index + 1]
        recorder.add_token(outcome, index)
        if bool(stopping_criteria(sequence, scores).any()):
            return sequence, index + 1, True
    return sequence, len(tokens), False
