"""Framework-free properties of TokenTree, the tree-search policies and the acceptance walk."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICES
from hypothesis import given
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from specexec_hf import SpecExecConfig, TokenTree, acceptance_walk, grow_tree
from specexec_hf.core.search import BestFirstSearch, rank_nodes
from specexec_hf.core.static_trees import SequoiaSearch, SpecInferSearch


@st.composite
def random_trees(draw, max_nodes: int = 40) -> TokenTree:
    """Trees whose children carry distinct tokens and log-probs below their parent's."""
    tree = TokenTree.from_root(draw(st.integers(0, 9)))
    for _ in range(draw(st.integers(0, max_nodes - 1))):
        parent = draw(st.integers(0, tree.num_nodes - 1))
        used = set(tree.tokens[tree.children(parent)].tolist())
        free = [t for t in range(10) if t not in used]
        if not free:
            continue
        token = draw(st.sampled_from(free))
        logprob = float(tree.logprobs[parent]) - draw(st.floats(0, 3))
        tree.add_children(torch.tensor([parent]), torch.tensor([token]), torch.tensor([logprob]))
    return tree


@given(random_trees())
def test_ancestor_mask_matches_paths(tree):
    mask = tree.ancestor_mask()
    for node in range(tree.num_nodes):
        expected = set(tree.path(node)) | {0, node}
        assert set(mask[node].nonzero().flatten().tolist()) == expected
        assert tree.depths[node] == len(tree.path(node))
        assert torch.equal(tree.positions(10)[node], 10 + tree.depths[node])
    assert bool((tree.parents[1:] < torch.arange(1, tree.num_nodes)).all())


@given(random_trees(), st.data())
def test_select_keeps_structure(tree, data):
    keep = {0}
    for node in data.draw(st.lists(st.integers(0, tree.num_nodes - 1))):
        keep |= {node, *tree.path(node)}
    keep = sorted(keep)
    sub = tree.select(torch.tensor(keep))
    for new, old in enumerate(keep):
        assert sub.path_tokens(new).tolist() == tree.path_tokens(old).tolist()
        assert float(sub.logprobs[new]) == float(tree.logprobs[old])


@given(random_trees())
def test_likeliest_children_are_each_nodes_child_of_highest_logprob(tree):
    likeliest = tree.likeliest_children()
    for node in range(tree.num_nodes):
        children = tree.children(node).tolist()
        if not children:
            assert likeliest[node] == -1
            continue
        assert likeliest[node] in children
        best = max(float(tree.logprobs[child]) for child in children)
        assert float(tree.logprobs[likeliest[node]]) == best
        assert likeliest[node] == min(child for child in children if float(tree.logprobs[child]) == best)


@given(random_trees())
def test_best_path_maximises_expected_acceptance(tree):
    def value(path):
        return sum(math.exp(float(tree.logprobs[n])) for n in path)

    leaves = [n for n in range(tree.num_nodes) if tree.children(n).numel() == 0]
    best = max(value(tree.path(leaf)) for leaf in leaves)
    path = tree.best_path()
    assert path == tree.path(path[-1]) if path else tree.num_nodes == 1
    assert math.isclose(value(path), best, rel_tol=1e-9)
    assert tree.best_chain().tolist() == [int(tree.tokens[node]) for node in path]


def table_expand(vocab: int, seed: int, sharpness: float, calls: list):
    """A deterministic fake draft: the next-token log-probs depend on the node's whole path."""

    def expand(pool: TokenTree, nodes: torch.Tensor) -> torch.Tensor:
        rows = []
        for node in nodes.tolist():
            key = hash((seed, tuple(pool.path_tokens(node).tolist()), int(pool.tokens[0])))
            generator = torch.Generator().manual_seed(key % (2**31))
            rows.append(torch.log_softmax(sharpness * torch.randn(vocab, generator=generator), -1))
        logprobs = torch.stack(rows)
        calls.append((pool.logprobs[nodes].clone(), logprobs, nodes.clone(), pool.depths[nodes].clone()))
        return logprobs

    return expand


search_configs = st.builds(
    SpecExecConfig,
    budget=st.integers(1, 60),
    max_depth=st.integers(1, 8),
    max_branch=st.integers(1, 6),
    expand_per_forward=st.integers(1, 10),
    max_draft_forwards=st.one_of(st.none(), st.integers(0, 6)),
    min_draft_gain=st.sampled_from([0.0, 0.0, 0.03, 0.3]),
)


@given(search_configs, st.integers(0, 2**16), st.floats(0.5, 6.0), st.integers(2, 30))
def test_search_keeps_the_budget_best_candidates(config, seed, sharpness, vocab):
    calls = []
    result = grow_tree(3, table_expand(vocab, seed, sharpness, calls), config)
    tree = result.tree

    # Shape: the root plus at most `budget` nodes, within max_depth, every parent before its children.
    assert tree.num_nodes <= config.budget + 1
    assert int(tree.depths.max()) <= config.max_depth
    assert tree.parents[0] == -1 and bool((tree.parents[1:] >= 0).all())
    assert bool((tree.parents[1:] < torch.arange(1, tree.num_nodes)).all())
    assert bool((tree.logprobs[1:] <= tree.logprobs[tree.parents[1:]]).all())
    if config.max_draft_forwards is not None:
        assert result.draft_forwards <= 1 + config.max_draft_forwards
    assert result.draft_forwards == len(calls)

    # Best-first: the kept nodes are the `budget` best of every candidate the draft's top-k produced.
    generated = [0.0]
    for parent_logprobs, logprobs, _, _ in calls:
        top = logprobs.topk(min(config.max_branch, vocab), dim=-1).values
        generated += (parent_logprobs[:, None] + top).flatten().tolist()
    best = sorted(generated, reverse=True)[: tree.num_nodes]
    assert sorted(tree.logprobs.tolist(), reverse=True) == best


@given(search_configs, st.integers(0, 2**16), st.floats(0.5, 6.0), st.integers(2, 30))
def test_search_only_stops_when_no_expansion_could_help(config, seed, sharpness, vocab):
    config = config.updated(min_draft_gain=0.0)  # min_draft_gain stops earlier on purpose: tested below
    calls = []
    result = grow_tree(3, table_expand(vocab, seed, sharpness, calls), config)
    if config.max_draft_forwards is not None and result.draft_forwards == 1 + config.max_draft_forwards:
        return  # stopped by the forward cap
    tree, pool = result.tree, result.pool
    expanded = set()
    for _, _, nodes, _ in calls:
        expanded |= set(nodes.tolist())
    full = tree.num_nodes == config.budget + 1
    worst = float(tree.logprobs.min())
    for index, node in enumerate(result.pool_index.tolist()):
        if node in expanded or int(pool.depths[node]) >= config.max_depth:
            continue
        # An unexpanded kept node may only remain if the tree is full and its children could not outrank the worst.
        assert full and float(tree.logprobs[index]) <= worst


def _forecast(logprobs: torch.Tensor) -> float:
    return float(logprobs[1:].double().exp().sum())


@given(search_configs, st.floats(0.001, 0.5), st.integers(0, 2**16), st.floats(0.5, 6.0), st.integers(2, 30))
def test_min_draft_gain_stops_after_the_first_forward_that_gained_too_little(config, gain, seed, sharpness, vocab):
    full_calls, calls = [], []
    full = grow_tree(3, table_expand(vocab, seed, sharpness, full_calls), config.updated(min_draft_gain=0.0))
    result = grow_tree(3, table_expand(vocab, seed, sharpness, calls), config.updated(min_draft_gain=gain))

    # The forecast after each of the full search's forwards, from the same search capped at that many forwards.
    forecasts = [0.0] + [
        _forecast(grow_tree(3, table_expand(vocab, seed, sharpness, []), config.updated(
            min_draft_gain=0.0, max_draft_forwards=count - 1)).tree.logprobs)
        for count in range(1, len(full_calls) + 1)
    ]
    stalled = [k for k in range(1, len(forecasts)) if forecasts[k] - forecasts[k - 1] < gain * (1 + forecasts[k])]
    assert len(calls) == min(stalled, default=len(full_calls))
    for (_, _, nodes, _), (_, _, full_nodes, _) in zip(calls, full_calls):  # the same expansions, cut short
        assert nodes.tolist() == full_nodes.tolist()
    if len(calls) == len(full_calls):
        assert result.tree.tokens.tolist() == full.tree.tokens.tolist()


@given(
    st.sampled_from([grow_tree, SpecInferSearch(), SpecInferSearch(beams=2), SequoiaSearch([0.7, 0.2, 0.1])]),
    search_configs,
    st.integers(0, 2**16),
    st.integers(2, 30),
)
def test_every_policy_expands_the_root_first_and_nodes_after_their_ancestors(policy, config, seed, vocab):
    """What the shared drafting needs of any policy: the first forward expands the root alone (it also feeds the
    draft the history) and a node only once all its ancestors were (the draft attends to their cache entries); the
    kept tree is the pool's selection, within the budget and the depth limit."""
    calls = []
    result = policy(3, table_expand(vocab, seed, 2.0, calls), config)
    assert calls[0][2].tolist() == [0]
    expanded: set[int] = set()
    for _, _, nodes, _ in calls:
        for node in nodes.tolist():
            assert node not in expanded and {0, *result.pool.path(node)[:-1]} <= expanded | {node}
        expanded |= set(nodes.tolist())
    assert result.draft_forwards == len(calls)
    tree = result.tree
    assert torch.equal(result.pool.select(result.pool_index).tokens, tree.tokens)
    assert tree.num_nodes <= config.budget + 1 and int(tree.depths.max()) <= config.max_depth


def test_search_expands_in_batches_of_the_best_frontier():
    calls = []
    config = SpecExecConfig(budget=30, max_depth=5, max_branch=4, expand_per_forward=3)
    grow_tree(0, table_expand(12, 7, 3.0, calls), config)
    assert calls[0][2].tolist() == [0]
    assert all(len(nodes) <= 3 for _, _, nodes, _ in calls)
    assert any(len(nodes) == 3 for _, _, nodes, _ in calls[1:])


@given(random_trees(), st.data())
def test_acceptance_walk_follows_choices_until_the_first_miss(tree, data):
    choices = {}

    def choose(node: int) -> int:
        choices.setdefault(node, data.draw(st.integers(0, 9), label=f"choice at {node}"))
        return choices[node]

    acceptance = acceptance_walk(tree, choose)
    node = 0
    for child in acceptance.path:
        assert int(tree.parents[child]) == node and int(tree.tokens[child]) == choices[node]
        node = child
    bonus = acceptance.tokens[-1]
    assert bonus == choices[node]
    assert bonus not in tree.tokens[tree.children(node)].tolist()
    assert acceptance.tokens[:-1] == tree.tokens[acceptance.path].tolist()


@given(random_trees(), st.data())
def test_host_lists_follow_the_tree_as_it_grows(tree, data):
    for _ in range(data.draw(st.integers(1, 4))):
        assert tree.host_lists() == (tree.parents.tolist(), tree.tokens.tolist())
        parents = torch.tensor(data.draw(st.lists(st.integers(0, tree.num_nodes - 1), max_size=3)), dtype=torch.long)
        tree.add_children(parents, torch.full_like(parents, 11), torch.full(parents.shape, -50.0))
    assert tree.host_lists() == (tree.parents.tolist(), tree.tokens.tolist())
    tree.tokens = tree.tokens + 1  # a replaced tensor is read again
    assert tree.host_lists()[1] == tree.tokens.tolist()


@given(search_configs, st.integers(0, 2**16), st.integers(2, 12))
def test_kept_set_equals_the_ranking_of_the_whole_pool_ties_included(config, seed, vocab):
    """The search ranks only the old kept set and the new children; with log-probs on a coarse grid (many ties)
    that must still equal ranking every candidate, lower index first among equals."""
    generator = torch.Generator().manual_seed(seed)
    search = BestFirstSearch(3, config)
    while (nodes := search.next_nodes()) is not None:
        logprobs = -torch.randint(0, 4, (nodes.numel(), vocab), generator=generator).float() / 2
        logprobs[:, 0] = -math.inf  # impossible tokens are never added
        search.add_expansion(nodes, logprobs)
        assert search.kept.tolist() == rank_nodes(search.pool.logprobs)[: config.budget + 1].tolist()
        assert not bool(torch.isinf(search.pool.logprobs).any())


@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.integers(0, 12), st.data())
def test_host_lists_and_a_row_come_in_one_read_and_equal_the_tensors(tokens, known, data):
    from test_host_syncs import HostReadCounter

    tree = TokenTree.from_root(tokens[0])
    for added, token in enumerate(tokens[1:]):
        if added == known:
            tree.host_lists()  # the first nodes' lists known already: only the rest and the row are read
        parent = data.draw(st.integers(0, tree.num_nodes - 1))
        tree.add_children(torch.tensor([parent]), torch.tensor([token]), torch.tensor([-1.0]))
    row = torch.arange(tree.num_nodes) * 3 - 1
    with HostReadCounter() as counter:
        parents, node_tokens, values = tree.host_lists_and(row)
    assert sum(counter.sites.values()) == 1
    assert (parents, node_tokens, values) == (tree.parents.tolist(), tree.tokens.tolist(), row.tolist())
    assert tree.host_lists() == (parents, node_tokens)


class HostValueTensors(TorchFunctionMode):
    """Counts the tensors built from host values (``torch.tensor``, ``torch.as_tensor``): on a CUDA device each is a
    copy from pageable memory, which makes the host wait for the device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in ("tensor", "as_tensor")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
@given(st.integers(0, 2**40))
def test_a_root_tree_is_filled_on_its_device_without_an_upload(device, token):
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # a copy from pageable memory would raise here
    try:
        with HostValueTensors() as built:
            tree = TokenTree.from_root(token, device)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert built.count == 0
    assert tree.device.type == device
    assert (tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()) == ([token], [-1], [0])
    assert tree.logprobs.tolist() == [0.0] and tree.tokens.dtype == tree.parents.dtype == torch.long
