"""Baseline tree policies: greedy output identical to plain generate(), budgets respected, Sequoia's optimum."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from conftest import perturbed_copy, tiny_model, tiny_tokenizer
from hypothesis import given
from hypothesis import strategies as st

from specexec_hf import SpecExecCandidateGenerator, SpecExecConfig, SpecExecStats
from specexec_hf.core import search
from specexec_hf.core.acceptance_map import AcceptanceMap
from specexec_hf.core.search import TREE_POLICIES, BestFirstPolicy, register_tree_policy, tree_policy
from specexec_hf.core.static_trees import (
    PRIOR_ACCEPTANCE,
    SequoiaSearch,
    SpecInferSearch,
    TreeShape,
    best_first_nodes,
)
from specexec_hf.tools.acceptance import measure_acceptance

acceptance_vectors = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6)


def prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(seed))


@given(
    seed=st.integers(0, 2**16),
    noise=st.sampled_from([0.0, 0.05, 2.0]),
    budget=st.integers(1, 32),
    max_depth=st.integers(1, 10),
    max_new_tokens=st.integers(1, 20),
    policy=st.one_of(
        st.builds(SpecInferSearch, st.none() | st.integers(1, 6)), st.builds(SequoiaSearch, acceptance_vectors)
    ),
)
def test_baselines_keep_greedy_output_and_budget(seed, noise, budget, max_depth, max_new_tokens, policy):
    target = tiny_model("llama", seed=seed)
    draft = perturbed_copy(target, noise, seed=seed + 1)
    ids = prompt(seed, 5)
    expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    stats = SpecExecStats()
    got = target.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, speculator="specexec",
        budget=budget, max_depth=max_depth, tree_search=policy, specexec_stats=stats,
    )
    assert got.tolist() == expected.tolist()
    assert all(step.tree_size <= budget + 1 for step in stats.steps)


def test_draft_equal_to_target_accepts_the_rank0_chain_of_a_static_tree():
    target = tiny_model("qwen2", seed=3)
    stats = SpecExecStats()
    target.generate(
        prompt(3, 4), max_new_tokens=25, do_sample=False, assistant_model=target, speculator="specexec",
        budget=12, max_depth=4, tree_search=SpecInferSearch(beams=3), specexec_stats=stats,
    )
    # Three chains of four: the rank-0 chain is accepted whole, plus the bonus token.
    assert [step.accepted for step in stats.steps[:-1]] == [5] * (len(stats.steps) - 1)


def test_the_drafter_refuses_what_a_static_policy_cannot_do():
    draft = tiny_model("llama", seed=0)
    config = SpecExecConfig(budget=8)
    assert not SpecInferSearch().ranks_children and not SequoiaSearch([0.5]).draws_children
    with pytest.raises(ValueError, match="fixes by its shape"):
        SpecExecCandidateGenerator(draft, config, search=SpecInferSearch(), acceptance_map=AcceptanceMap())
    with pytest.raises(ValueError, match="takes by draft rank"):
        SpecExecCandidateGenerator(draft, config, search=SequoiaSearch([0.5]), sampled_children=True)
    with pytest.raises(TypeError, match="SearchPolicy"):
        SpecExecCandidateGenerator(draft, config, search=lambda root_token, expand, config: None)


@pytest.mark.parametrize("name", ["specexec", "specinfer", "sequoia", "rounds"])
def test_policies_by_name_keep_greedy_output(name):
    target = tiny_model("llama", seed=7)
    draft = perturbed_copy(target, 0.05, seed=8)
    ids = prompt(7, 5)
    expected = target.generate(ids, max_new_tokens=12, do_sample=False)
    stats = SpecExecStats()
    got = target.generate(
        ids, max_new_tokens=12, do_sample=False, assistant_model=draft, speculator="specexec",
        budget=10, max_depth=4, tree_search=name, specexec_stats=stats,
    )
    assert got.tolist() == expected.tolist()
    assert all(step.tree_size <= 11 for step in stats.steps)


def test_registered_names_build_their_policies():
    assert {"specexec", "specinfer", "sequoia", "rounds"} <= set(TREE_POLICIES)
    assert tree_policy("specexec") is search.grow_tree
    assert tree_policy("specinfer", beams=2).beams == 2
    assert tree_policy("sequoia").acceptance == list(PRIOR_ACCEPTANCE)
    assert tree_policy("sequoia", acceptance=[0.7, 0.1]).acceptance == [0.7, 0.1]
    assert all(later < earlier for earlier, later in zip(PRIOR_ACCEPTANCE, PRIOR_ACCEPTANCE[1:]))


def test_an_unknown_policy_name_is_refused_first_with_the_registered_names():
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    # A draft of another tokenizer is refused too, but the policy's name is checked first.
    kwargs = dict(max_new_tokens=2, do_sample=False, assistant_model=draft, speculator="specexec",
                  tokenizer=tiny_tokenizer(), assistant_tokenizer=tiny_tokenizer(63))
    with pytest.raises(ValueError, match=r"Unknown tree policy 'sequia'.*'sequoia', 'specexec', 'specinfer'"):
        target.generate(prompt(0, 3), tree_search="sequia", **kwargs)
    with pytest.raises(ValueError) as refusal:
        target.generate(prompt(0, 3), tree_search="sequoia", **kwargs)
    assert "Unknown tree policy" not in str(refusal.value)


def test_a_registered_policy_is_selectable_by_name_and_names_are_unique(monkeypatch):
    monkeypatch.setattr(search, "TREE_POLICIES", dict(TREE_POLICIES))
    register_tree_policy("best_first_copy", BestFirstPolicy)
    assert isinstance(tree_policy("best_first_copy"), BestFirstPolicy)
    with pytest.raises(ValueError, match="already registered"):
        register_tree_policy("sequoia", SequoiaSearch)


@given(budget=st.integers(1, 60), max_depth=st.integers(1, 12), beams=st.none() | st.integers(1, 8))
def test_specinfer_shape_is_k_chains_using_the_budget(budget, max_depth, beams):
    shape = SpecInferSearch(beams).shape(budget, max_depth, vocab_size=64)
    k = min(beams or math.ceil(budget / max_depth), budget)
    root_children = [n for n, p in enumerate(shape.parents) if p == 0]
    assert [shape.ranks[n] for n in root_children] == list(range(k))
    assert all(shape.ranks[n] == 0 for n in range(1, shape.num_nodes) if shape.parents[n] != 0)
    assert shape.num_nodes - 1 == sum(min(budget // k + (i < budget % k), max_depth) for i in range(k))
    if beams is None:
        assert shape.num_nodes - 1 == budget


@functools.cache
def sequoia_dp(acceptance: tuple[float, ...], nodes: int, depth: int, rank: int = 0) -> float:
    """Sequoia's recurrence: the best expected acceptance of ``nodes`` nodes hung as the children of ranks
    ``rank, rank + 1, ...`` (and their subtrees) under a parent with ``depth`` levels left below it."""
    if nodes == 0:
        return 0.0
    if rank == len(acceptance) or depth == 0:
        return -math.inf
    best = sequoia_dp(acceptance, nodes, depth, rank + 1)
    for subtree in range(1, nodes + 1):
        below = sequoia_dp(acceptance, subtree - 1, depth - 1, 0)
        value = acceptance[rank] * (1 + below) + sequoia_dp(acceptance, nodes - subtree, depth, rank + 1)
        best = max(best, value)
    return best


@given(acceptance=acceptance_vectors, budget=st.integers(1, 14), max_depth=st.integers(1, 5))
def test_best_first_nodes_reach_sequoias_dynamic_programming_optimum(acceptance, budget, max_depth):
    parents, ranks, values = best_first_nodes(acceptance, budget, max_depth)
    capacity = sum(len(acceptance) ** d for d in range(1, max_depth + 1))
    assert len(parents) - 1 == min(budget, capacity)
    optimum = sequoia_dp(tuple(acceptance), len(parents) - 1, max_depth)
    assert math.isclose(sum(values[1:]), optimum, rel_tol=1e-9, abs_tol=1e-12)
    for node in range(1, len(parents)):  # values are products along the path, parents first
        assert parents[node] < node
        assert math.isclose(values[node], values[parents[node]] * acceptance[ranks[node]])


@given(acceptance=acceptance_vectors, budget=st.integers(1, 30), max_depth=st.integers(1, 6))
def test_sequoia_shape_is_level_ordered_and_within_budget(acceptance, budget, max_depth):
    shape = SequoiaSearch(acceptance).shape(budget, max_depth, vocab_size=64)
    assert shape.num_nodes - 1 <= budget
    depth = [0]
    for node in range(1, shape.num_nodes):
        depth.append(depth[shape.parents[node]] + 1)
        assert shape.parents[node] < node and depth[node] <= max_depth
        previous = (depth[node - 1], shape.parents[node - 1], shape.ranks[node - 1])
        assert previous < (depth[node], shape.parents[node], shape.ranks[node])


def test_tree_shape_from_nodes_reindexes_into_level_order():
    # 0 -> 1 (rank 1) -> 2 (rank 0); 0 -> 3 (rank 0)
    shape = TreeShape.from_nodes([-1, 0, 1, 0], [-1, 1, 0, 0])
    assert shape == TreeShape(parents=(-1, 0, 0, 2), ranks=(-1, 0, 1, 0))


def test_measured_acceptance_of_a_draft_equal_to_the_target_is_all_rank_0():
    target = tiny_model("llama", seed=5)
    ids = prompt(5, 6)
    sequence = target.generate(ids, max_new_tokens=10, do_sample=False)[0]
    greedy = measure_acceptance(target, target, [sequence], [6], ranks=4)
    assert greedy == [1.0, 0.0, 0.0, 0.0]
    sampled = measure_acceptance(target, target, [sequence], [6], ranks=4, temperature=1.0, top_p=0.9)
    assert sampled[0] > sampled[1] > 0 and sum(sampled) <= 1 + 1e-9
