"""SpecExecCandidateGenerator as a transformers CandidateGenerator, run by transformers' own assisted loop.

transformers' ``_assisted_decoding`` builds its generator in ``GenerationMixin._get_candidate_generator``; the tests
have the target's method return a SpecExec generator instead, so that the loop, its verification and its feedback
are transformers' own.
"""

from __future__ import annotations

import pytest
import torch
from conftest import chi_square_p, perturbed_copy, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sampling import NEW_TOKENS, PROMPT, VOCAB, exact_distribution, processors
from transformers import LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator

from specexec_hf import SpecExecCandidateGenerator, SpecExecConfig
from specexec_hf.core.acceptance_map import AcceptanceMap


def assisted_generate(target, generator: SpecExecCandidateGenerator, prompt: torch.Tensor, **kwargs) -> torch.Tensor:
    """transformers' assisted generation of ``target`` (``speculator`` off) with ``generator`` as its candidate
    generator."""
    calls = []

    def spec_exec_generator(**arguments):
        calls.append(arguments)
        return generator

    target._get_candidate_generator = spec_exec_generator
    try:
        output = target.generate(prompt, assistant_model=generator.draft_model, speculator=None, **kwargs)
    finally:
        del target._get_candidate_generator
    assert len(calls) == 1  # the loop ran, with this generator
    return output


def test_it_is_a_transformers_candidate_generator(llama_pair):
    _, draft = llama_pair
    generator = SpecExecCandidateGenerator(draft, SpecExecConfig(budget=8))
    assert isinstance(generator, CandidateGenerator)
    assert "not its ``CandidateGenerator`` interface" not in (SpecExecCandidateGenerator.__doc__ or "")


@settings(max_examples=8)
@given(
    seed=st.integers(0, 10_000),
    prompt_length=st.integers(1, 12),
    budget=st.sampled_from([1, 4, 16]),
    calibrated=st.booleans(),
)
def test_transformers_assisted_loop_with_it_returns_plain_greedy_output(
    llama_pair, seed, prompt_length, budget, calibrated
):
    target, draft = llama_pair
    prompt = torch.randint(0, 64, (1, prompt_length), generator=torch.Generator().manual_seed(seed))
    plain = target.generate(prompt, do_sample=False, max_new_tokens=20, speculator=None)
    acceptance_map = AcceptanceMap() if calibrated else None
    generator = SpecExecCandidateGenerator(
        draft, SpecExecConfig(budget=budget, expand_per_forward=4), acceptance_map=acceptance_map
    )
    assisted = assisted_generate(target, generator, prompt, do_sample=False, max_new_tokens=20)
    assert torch.equal(assisted, plain)


def test_candidates_are_the_trees_best_chain_with_point_mass_logits(llama_pair):
    _, draft = llama_pair
    prompt = torch.tensor([[5, 9, 2, 7]])
    generator = SpecExecCandidateGenerator(draft, SpecExecConfig(budget=12, expand_per_forward=4))
    tree = SpecExecCandidateGenerator(draft, SpecExecConfig(budget=12, expand_per_forward=4)).grow_tree(prompt).tree
    candidates, logits = generator.get_candidates(prompt)
    chain = tree.best_chain()
    assert len(chain) >= 1
    assert torch.equal(candidates, torch.cat([prompt, chain[None]], dim=1))
    assert logits.shape == (1, len(chain), generator.target_vocab_size) and logits.dtype == torch.float32
    assert torch.equal(logits.argmax(-1)[0], chain)
    assert torch.equal(logits.softmax(-1).amax(-1), torch.ones(1, len(chain)))


def test_update_candidate_strategy_teaches_the_map_the_committed_tokens(llama_pair):
    target, _ = llama_pair
    draft = target  # the target as its own draft: its chain is accepted, so the walk visits nodes below the root
    prompt = torch.tensor([[5, 9, 2, 7]])
    config = SpecExecConfig(budget=12, expand_per_forward=4)
    learning = SpecExecCandidateGenerator(draft, config, acceptance_map=AcceptanceMap())
    candidates, _ = learning.get_candidates(prompt)
    # The target's greedy choices down the chain: its matches, then its own next token.
    choices = target(candidates).logits[0, prompt.shape[1] - 1 :].argmax(-1)
    matches = int((choices[:-1] == candidates[0, prompt.shape[1] :]).cumprod(0).sum())
    assert matches >= 1
    committed = torch.cat([prompt, choices[None, : matches + 1]], dim=1)
    learning.update_candidate_strategy(committed, torch.zeros(1, choices.numel(), 64), matches)

    # What SpecExec's own step teaches after the same choices: observe() of the same tree.
    reference = SpecExecCandidateGenerator(draft, config, acceptance_map=AcceptanceMap())
    reference.observe(reference.grow_tree(prompt), committed[0, prompt.shape[1] :].tolist())
    assert learning.acceptance_map.trials.sum() > 0
    assert torch.equal(learning.acceptance_map.trials, reference.acceptance_map.trials)
    assert torch.equal(learning.acceptance_map.accepted, reference.acceptance_map.accepted)
    learning.update_candidate_strategy(committed, torch.zeros(1, 1, 64), 0)  # nothing proposed since: nothing learnt
    assert torch.equal(learning.acceptance_map.trials, reference.acceptance_map.trials)


@pytest.mark.slow
def test_transformers_speculative_sampling_with_its_point_masses_follows_the_target():
    """With ``do_sample`` transformers verifies candidates whose logits it has by speculative sampling, against the
    distribution they were drawn from: the point masses make that the target's own draw."""
    target = tiny_model("llama", seed=11, vocab_size=VOCAB, sharpness=3.0)
    draft = perturbed_copy(target, 0.3, seed=12)
    warping = {"temperature": 0.5}
    distribution = exact_distribution(target, processors(warping))
    generator = SpecExecCandidateGenerator(draft, SpecExecConfig(budget=6, max_branch=3))
    torch.manual_seed(2024)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(600):
        out = assisted_generate(
            target, generator, PROMPT, do_sample=True, max_new_tokens=NEW_TOKENS, top_k=None, top_p=None, **warping
        )
        outcome = tuple(out[0, PROMPT.shape[1] :].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
    assert chi_square_p(counts, distribution) > 1e-3
    assert chi_square_p(counts, exact_distribution(target, LogitsProcessorList())) < 1e-3
