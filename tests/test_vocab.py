"""A draft head over a vocabulary subset: exact scores inside it, -inf outside, and SpecExec output unchanged."""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
from conftest import ARCHITECTURES, perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from tolerances import assert_close_across_kernels, compute_dtype, rounding_bound

import specexec_hf  # noqa: F401  (installs speculator="specexec")
from specexec_hf import SpecExecCandidateGenerator, SpecExecConfig
from specexec_hf.core.acceptance_map import AcceptanceMap
from specexec_hf.hf import candidate_generator, draft_cache
from specexec_hf.models.vocab import (
    SubsetLMHead,
    frequent_tokens,
    restrict_draft_vocabulary,
)


@given(
    seed=st.integers(0, 2**16),
    subset=st.sets(st.integers(0, 63), min_size=1, max_size=64),
    dtype=st.sampled_from([torch.float64, torch.float32]),  # float32 on a CPU: core.products.head_product's order
)
def test_subset_head_scores_exactly_the_subset(seed, subset, dtype):
    model = tiny_model("llama", seed=seed, dtype=dtype)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(seed))
    full = model(ids).logits
    token_ids = torch.tensor(sorted(subset))
    restricted = restrict_draft_vocabulary(copy.deepcopy(model), token_ids)(ids).logits
    inside = torch.zeros(64, dtype=torch.bool)
    inside[token_ids] = True
    # The same forward up to the head, whose product over the hidden size then has fewer rows: other kernel shapes.
    # The entries outside the subset are the full head's, so each row is scaled by its full magnitude.
    bound = rounding_bound(compute_dtype(model), reduction=model.config.hidden_size)
    assert_close_across_kernels(torch.where(inside, restricted, full), full, bound)
    assert torch.isneginf(restricted[..., ~inside]).all()


@given(
    arch=st.sampled_from(sorted(ARCHITECTURES)),
    seed=st.integers(0, 2**16),
    subset_size=st.integers(1, 64),
    budget=st.integers(1, 24),
    max_new_tokens=st.integers(1, 20),
)
def test_greedy_with_restricted_draft_equals_plain_generate(arch, seed, subset_size, budget, max_new_tokens):
    target = tiny_model(arch, seed=seed)
    draft = perturbed_copy(target, 0.05, seed=seed + 1)
    token_ids = torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:subset_size]
    restrict_draft_vocabulary(draft, token_ids)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(seed))
    expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    got = target.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, speculator="specexec",
        budget=budget,
    )
    assert got.tolist() == expected.tolist()


def test_frequent_tokens_keeps_the_most_counted_ids_in_ascending_order():
    counts = torch.tensor([5, 0, 9, 5, 1, 9])
    assert frequent_tokens(counts, 3).tolist() == [0, 2, 5]  # 9, 9, then the lower id of the two 5s
    with pytest.raises(ValueError, match="outside 1..6"):
        frequent_tokens(counts, 0)


def test_restricting_twice_or_bad_ids_is_refused():
    model = restrict_draft_vocabulary(tiny_model("llama"), torch.tensor([1, 2, 3]))
    assert isinstance(model.get_output_embeddings(), SubsetLMHead)
    with pytest.raises(ValueError, match="already restricted"):
        restrict_draft_vocabulary(model, torch.tensor([1]))
    with pytest.raises(ValueError, match=r"token ids in \[0, 64\)"):
        restrict_draft_vocabulary(tiny_model("llama"), torch.tensor([3, 64]))


def test_compact_scores_are_the_subset_columns_in_this_thread_only():
    model = restrict_draft_vocabulary(tiny_model("llama"), torch.tensor([9, 3, 40]))
    head = model.get_output_embeddings()
    hidden = torch.randn(2, 3, model.config.hidden_size, dtype=torch.float64)
    full = head(hidden)
    seen_elsewhere = []
    with head.compact_scores() as columns:
        assert columns.tolist() == [3, 9, 40]
        with head.compact_scores():  # nested: still compact, and still compact after the inner one ends
            pass
        assert torch.equal(head(hidden), full[..., columns])
        other = threading.Thread(target=lambda: seen_elsewhere.append(head(hidden)))
        other.start()
        other.join()
    assert torch.equal(seen_elsewhere[0], full)  # another thread meanwhile: full rows
    assert torch.equal(head(hidden), full)
    copy.deepcopy(model)  # the compact switch is no state of the module's


@given(
    seed=st.integers(0, 2**16),
    subset=st.sets(st.integers(0, 63), min_size=8, max_size=64),
    weights=st.lists(st.floats(0.0, 0.9), min_size=1, max_size=3),
    budget=st.integers(1, 24),
    history_length=st.integers(1, 24),
)
def test_trees_ranked_over_scored_columns_equal_trees_over_full_rows(seed, subset, weights, budget, history_length):
    """The same tree whether the generator ranks the head's scored columns or full rows (``-inf`` elsewhere),
    context guesses outside the subset included: repetitive histories make guesses, and random subsets leave some
    guessed tokens out of them."""
    draft = restrict_draft_vocabulary(tiny_model("llama", seed=seed), torch.tensor(sorted(subset)))
    rng = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, 64, (4,), generator=rng)
    history = motif.repeat(history_length // 4 + 1)[:history_length][None]  # repeats: context guesses
    config = SpecExecConfig(budget=budget, max_depth=6)

    def tree(scored_columns):
        generator = SpecExecCandidateGenerator(
            draft, config, acceptance_map=AcceptanceMap(), context_match_weights=weights
        )
        assert generator.takes_scored_columns
        with pytest.MonkeyPatch.context() as patch, torch.no_grad():
            patch.setattr(candidate_generator, "scored_columns", scored_columns)
            return generator.grow_tree(history)

    compact, full = tree(draft_cache.scored_columns), tree(lambda model: contextlib.nullcontext())
    assert torch.equal(compact.tree.tokens, full.tree.tokens)
    assert torch.equal(compact.tree.parents, full.tree.parents)
    # log-softmax over fewer columns sums in another order, and the search keeps float32 scores: rounding only
    assert_close_across_kernels(compact.tree.logprobs, full.tree.logprobs, rounding_bound(torch.float32, 64))


def test_scored_columns_need_a_generator_that_ranks_children():
    draft = restrict_draft_vocabulary(tiny_model("llama"), torch.tensor([1, 2, 3]))
    generator = SpecExecCandidateGenerator(draft, SpecExecConfig(budget=4), acceptance_map=None)
    assert not generator.takes_scored_columns
    search = generator.start_tree(torch.tensor([[1, 2]]))
    nodes = search.next_nodes()
    with pytest.raises(ValueError, match="rank"):
        generator.expansion(search.pool, nodes, torch.zeros(1, 3), columns=torch.tensor([1, 2, 3]))
