"""One decoding step on a fixed tree: the target's choice rule on fixed logits, and SpecExecDecoder.step() with a
drafter that returns a tree built by hand (so the walk, the cache accounting and the outcome are checked apart from
the draft)."""

from __future__ import annotations

import math

import torch
from conftest import tiny_model
from transformers import GenerationConfig, LogitsProcessorList

from specexec_hf.core.search import SearchResult
from specexec_hf.core.tree import TokenTree
from specexec_hf.core.verify import acceptance_walk
from specexec_hf.hf.decoder import ChoiceRule, SpecExecDecoder, TargetChoice, TreeLogitsProcessor
from specexec_hf.hf.forward import NodeLogits
from specexec_hf.hf.request import validate_request

VOCAB = 12


def fixed_tree(root: int, parents: list[int], tokens: list[int]) -> SearchResult:
    """A tree whose node ``i + 1`` hangs under ``parents[i]`` with ``tokens[i]``, as a search result."""
    tree = TokenTree.from_root(root)
    for parent, token in zip(parents, tokens):
        tree.add_children(torch.tensor([parent]), torch.tensor([token]), torch.tensor([-1.0]))
    return SearchResult(tree, tree, torch.arange(tree.num_nodes), draft_forwards=1)


def one_hot_logits(choices: list[int]) -> torch.Tensor:
    """``[len(choices), VOCAB]`` logits whose row ``i`` puts everything on ``choices[i]``."""
    logits = torch.full((len(choices), VOCAB), -math.inf)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 0.0
    return logits


def rule(do_sample: bool) -> ChoiceRule:
    return ChoiceRule(TreeLogitsProcessor(LogitsProcessorList()), do_sample, logits_eps=2.0**-23, head_width=64)


class UniformDrafts:
    """Stands in for the drafter: every node's children were drawn from a uniform draft."""

    sampled_children = True

    def draft_probs(self, result: SearchResult, node: int) -> torch.Tensor:
        return torch.full((VOCAB,), 1.0 / VOCAB, dtype=torch.float64)


def test_greedy_choice_walks_the_argmax_and_notes_near_ties():
    # Root 3 with children 5 (node 1) and 7 (node 2); node 1 has child 9 (node 3).
    grown = fixed_tree(3, [0, 0, 1], [5, 7, 9])
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[0, 5] = logits[1, 9] = 10.0  # the target continues 5, 9 ...
    logits[3, [2, 4]] = 10.0  # ... then 2 and 4 tie exactly: the first maximum, as plain greedy takes it
    choice = TargetChoice(rule(False), torch.tensor([[1, 3]]), grown, NodeLogits(logits=logits), None, False)
    acceptance = acceptance_walk(grown.tree, choice)
    assert acceptance.path == [1, 3] and acceptance.tokens == [5, 9, 2]
    assert [scores.tolist() for scores in choice.scores] == [logits[[node]].tolist() for node in (0, 1, 3)]
    assert choice.near_tied == [2] and choice.sampled_from == []


def test_sampled_choice_draws_the_target_token_with_or_without_drawn_children():
    """With the target's distribution one-hot, any exact draw returns its token: by rejection sampling where the
    node's children were drawn from the draft, by a plain draw elsewhere; each choice's distribution is kept."""
    grown = fixed_tree(3, [0, 0, 1], [5, 7, 9])
    targets = [7, 0, 1, 4]  # per node; the walk visits the root, then node 2 (token 7), a leaf, whose choice is 1
    torch.manual_seed(0)
    for drafter in (UniformDrafts(), None):
        choice = TargetChoice(
            rule(True), torch.tensor([[3]]), grown, NodeLogits(logits=one_hot_logits(targets)), drafter,
            drawn_children=drafter is not None,
        )
        acceptance = acceptance_walk(grown.tree, choice)
        assert acceptance.path == [2] and acceptance.tokens == [7, 1]
        assert [probs.argmax().item() for probs in choice.sampled_from] == [7, 1]


class FixedDrafter:
    """Stands in for the drafter: hands out prepared trees, one per step, and learns nothing."""

    sampled_children = False

    def __init__(self, trees: list[SearchResult]):
        self.trees = trees
        self.histories: list[list[int]] = []

    def grow_tree(self, input_ids: torch.Tensor, max_depth: int | None = None) -> SearchResult:
        self.histories.append(input_ids[0].tolist())
        return self.trees[len(self.histories) - 1]

    def observe(self, result: SearchResult, choices: list[int], choice_probs=None) -> None:
        pass


def test_step_accepts_the_target_path_of_a_fixed_tree_and_keeps_it_cached():
    target = tiny_model("llama", seed=4)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(4))
    plain = target.generate(prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    g1, g2, g3, g4 = plain.sequences[0, 6:].tolist()
    # Step 1: the greedy chain g1 -> g2 beside wrong siblings; step 2: the root alone.
    first = fixed_tree(prompt[0, -1].item(), [0, 0, 1, 1], [g1, (g1 + 1) % 64, (g2 + 1) % 64, g2])
    drafter = FixedDrafter([first, fixed_tree(g3, [], [])])
    config = GenerationConfig(max_length=20, num_beams=1, num_return_sequences=1)
    request = validate_request(target, prompt, config, {}, False)
    greedy = ChoiceRule(
        TreeLogitsProcessor(LogitsProcessorList()), False, torch.finfo(target.dtype).eps, target.config.hidden_size
    )
    decoder = SpecExecDecoder(target, drafter, request, greedy, max_length=20)

    outcome = decoder.step(prompt)
    assert outcome.acceptance.path == [1, 4] and outcome.acceptance.tokens == [g1, g2, g3]
    assert (outcome.length, outcome.pending) == (6, 6)  # the first step feeds the whole prompt
    for got, expected in zip(outcome.scores, plain.scores):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert decoder.cached == decoder.cache.get_seq_length() == 6 + 2  # every committed token but the last

    sequence = torch.cat([prompt, torch.tensor([[g1, g2, g3]])], dim=-1)
    outcome = decoder.step(sequence)
    assert outcome.acceptance.path == [] and outcome.acceptance.tokens == [g4]
    assert (outcome.length, outcome.pending) == (9, 1)  # only the last tree's bonus token was not yet fed
    assert decoder.cache.get_seq_length() == 9
    assert drafter.histories == [prompt[0].tolist(), sequence[0].tolist()]
