"""One verification budget shared best-first by the trees of a batch (``core/step_budget.py``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_tree_and_search import random_trees

from specexec_hf.core.step_budget import kept_nodes, path_scores, share_budget
from specexec_hf.core.tree import TokenTree


@st.composite
def rising_trees(draw) -> TokenTree:
    """Trees whose scores may rise down a path (what an estimate above 1 would give): cuts must stay trees anyway."""
    tree = draw(random_trees(max_nodes=20))
    tree.logprobs = torch.tensor(draw(st.lists(st.floats(-6, 1), min_size=tree.num_nodes, max_size=tree.num_nodes)))
    return tree


@given(st.lists(st.one_of(random_trees(max_nodes=20), rising_trees()), max_size=5), st.integers(0, 80))
def test_cut_keeps_the_best_nodes_and_stays_a_tree(trees, total):
    kept = kept_nodes(trees, total)
    assert sum(keep.numel() - 1 for keep in kept) == min(total, sum(tree.num_nodes - 1 for tree in trees))
    kept_scores, dropped_scores = [], []
    for tree, keep, part in zip(trees, kept, share_budget(trees, total)):
        keep = keep.tolist()
        assert keep[0] == 0 and keep == sorted(set(keep))
        assert all(int(tree.parents[node]) in keep for node in keep[1:])  # a tree: every kept node's parent too
        assert torch.equal(part.tokens, tree.tokens[keep])
        scores = path_scores(tree)
        kept_scores += scores[keep[1:]].tolist()
        dropped_scores += scores[[node for node in range(1, tree.num_nodes) if node not in keep]].tolist()
    if kept_scores and dropped_scores:
        assert min(kept_scores) >= max(dropped_scores)


def test_the_agreeing_request_gets_the_nodes():
    confident = TokenTree.from_root(0)  # a chain the draft is sure of
    for parent, logprob in enumerate([-0.1, -0.2, -0.3]):
        confident.add_children(torch.tensor([parent]), torch.tensor([parent + 1]), torch.tensor([logprob]))
    unsure = TokenTree.from_root(0)
    unsure.add_children(torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3]), torch.tensor([-2.0, -2.5, -3.0]))
    first, second = share_budget([confident, unsure], 4)
    assert (first.num_nodes, second.num_nodes) == (4, 2)
    assert share_budget([confident, unsure], 100)[1] is unsure
    with pytest.raises(ValueError, match="at least 0"):
        share_budget([confident], -1)


@pytest.mark.vllm
def test_the_proposer_setting():
    pytest.importorskip("vllm")  # the integration raises a plain ImportError naming the install when vllm is absent
    import specexec_hf.integrations.vllm as vllm

    given = {"draft_model": "d", "tree_verification": True, "step_budget": 48}
    settings = vllm.ProposerSettings.from_sources(given, {})
    assert settings.step_budget == 48
    environment = {"SPECEXEC_DRAFT_MODEL": "d", "SPECEXEC_TREE_VERIFICATION": "1", "SPECEXEC_STEP_BUDGET": "32"}
    assert vllm.ProposerSettings.from_sources({}, environment).step_budget == 32
    with pytest.raises(ValueError, match="tree_verification=true"):
        vllm.ProposerSettings.from_sources({"draft_model": "d", "step_budget": 48}, {})
    with pytest.raises(ValueError, match="at least 1"):
        vllm.ProposerSettings.from_sources({"draft_model": "d", "tree_verification": True, "step_budget": 0}, {})
