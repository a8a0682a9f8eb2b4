"""Sequoia as a tree policy: the acceptance vector learnt online, the shapes rebuilt only when it moves, the size and
depth chosen by the step's cost, and the output exact (greedy identity, sampled distribution) while it learns."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import chi_square_p, perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from test_sampling import NEW_TOKENS, PROMPT, SAMPLES, VOCAB, exact_distribution, processors

from specexec_hf import SpecExecConfig, SpecExecStats, TokenTree
from specexec_hf.core.search import SearchPolicy, SearchResult, grow_tree, tree_policy
from specexec_hf.core.static_trees import PRIOR_ACCEPTANCE, SequoiaSearch, StepCost, best_first_nodes, sized_nodes
from specexec_hf.hf import autobudget
from specexec_hf.hf.learnt_state import LearntState, learnt_state_of

acceptance_vectors = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5)


def prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(seed))


def chain_of(shape) -> bool:
    return all(parent == node - 1 for node, parent in enumerate(shape.parents) if node > 0)


@given(
    seed=st.integers(0, 2**16),
    noise=st.sampled_from([0.0, 0.05, 2.0]),
    budget=st.integers(1, 24),
    max_depth=st.integers(1, 8),
    acceptance=acceptance_vectors,
    tolerance=st.sampled_from([0.0, 0.01, 0.2]),
)
def test_learning_sequoia_keeps_greedy_output_and_budget_across_calls(
    seed, noise, budget, max_depth, acceptance, tolerance
):
    target = tiny_model("llama", seed=seed % 8)
    draft = perturbed_copy(target, noise, seed=seed + 1)
    policy = SequoiaSearch(acceptance, rebuild_tolerance=tolerance)  # one policy: it keeps learning across calls
    for call in range(2):
        ids = prompt(seed + call, 5)
        expected = target.generate(ids, max_new_tokens=12, do_sample=False)
        stats = SpecExecStats()
        got = target.generate(
            ids, max_new_tokens=12, do_sample=False, assistant_model=draft, speculator="specexec",
            budget=budget, max_depth=max_depth, tree_search=policy, specexec_stats=stats,
        )
        assert got.tolist() == expected.tolist()
        assert all(step.tree_size <= budget + 1 for step in stats.steps)
    assert policy.learnt.visits > 4.0  # it learnt from the walks


def test_a_draft_equal_to_the_target_teaches_rank_0_and_the_tree_becomes_a_chain():
    target = tiny_model("qwen2", seed=3)
    policy = tree_policy("sequoia")
    assert policy.acceptance == list(PRIOR_ACCEPTANCE)
    stats = SpecExecStats()
    target.generate(
        prompt(3, 4), max_new_tokens=40, do_sample=False, assistant_model=target, speculator="specexec",
        budget=6, tree_search=policy, specexec_stats=stats,
    )
    learnt = policy.learnt_acceptance()
    assert learnt[0] > 0.9 and all(rate < 0.1 for rate in learnt[1:])
    assert chain_of(policy.shape(6, 6, vocab_size=64))
    # The prior's first tree is bushy (rank 0 at 0.5 is worth little deep down); once learnt, all six are accepted.
    assert stats.steps[0].accepted < 7 and max(step.accepted for step in stats.steps) == 7


def test_a_fixed_prior_policy_does_not_learn():
    target = tiny_model("qwen2", seed=3)
    policy = tree_policy("sequoia", learn=False)
    target.generate(
        prompt(3, 4), max_new_tokens=10, do_sample=False, assistant_model=target, speculator="specexec",
        budget=6, tree_search=policy,
    )
    assert policy.acceptance == list(PRIOR_ACCEPTANCE) and policy.learnt_acceptance() == list(PRIOR_ACCEPTANCE)


@given(
    seed=st.integers(0, 2**16),
    noise=st.sampled_from([0.0, 0.05, 2.0]),
    budget=st.integers(1, 12),
    sampling=st.booleans(),
)
def test_sequoia_by_name_learns_in_the_drafts_state_across_calls_and_a_separate_state_keeps_apart(
    seed, noise, budget, sampling
):
    target = tiny_model("llama", seed=seed % 8)
    draft = perturbed_copy(target, noise, seed=seed + 1)
    settings = {"do_sample": True, "temperature": 0.7, "top_k": None, "top_p": None} if sampling else {}

    def call(index: int, **kwargs) -> None:
        ids = prompt(seed + index, 5)
        torch.manual_seed(seed + index)
        got = target.generate(
            ids, max_new_tokens=8, assistant_model=draft, speculator="specexec", budget=budget,
            tree_search="sequoia", **settings, **kwargs,
        )
        if not sampling:
            assert got.tolist() == target.generate(ids, max_new_tokens=8, do_sample=False).tolist()

    call(0)
    ((setting, learnt),) = learnt_state_of(draft).rank_acceptances.items()
    assert setting[0] == sampling
    after_first = learnt.visits
    assert after_first > 4.0  # the prior's weight, plus the first call's walks
    separate = LearntState()
    call(1, learnt_state=separate)
    assert learnt.visits == after_first  # a run in another state leaves the draft's alone
    ((_, apart),) = separate.rank_acceptances.items()
    assert apart is not learnt and apart.visits > 4.0
    hits = learnt.hits.clone()
    call(2)
    assert learnt.visits > after_first and bool((learnt.hits >= hits).all())  # the same vector went on learning


def test_a_later_call_by_name_starts_from_the_vector_earlier_calls_learnt():
    target = tiny_model("qwen2", seed=3)
    state = LearntState()

    def first_tree_accepted(ids: torch.Tensor, learnt_state: LearntState) -> int:
        stats = SpecExecStats()
        target.generate(
            ids, max_new_tokens=40, do_sample=False, assistant_model=target, speculator="specexec", budget=6,
            tree_search="sequoia", learnt_state=learnt_state, specexec_stats=stats,
        )
        return stats.steps[0].accepted

    assert first_tree_accepted(prompt(3, 4), state) < 7  # the prior's first tree is bushy; this call learns rank 0
    assert first_tree_accepted(prompt(4, 4), state) == 7  # the next call's first tree is the learnt chain
    assert first_tree_accepted(prompt(4, 4), LearntState()) < 7  # a fresh state starts from the prior again


def grown(policy: SearchPolicy, budget: int, max_depth: int, logprobs: torch.Tensor) -> SearchResult:
    """One tree grown by ``policy`` with the same draft log-probs ``[vocab]`` at every node."""
    config = SpecExecConfig(budget=budget, max_depth=max_depth)
    return policy(0, lambda pool, nodes: logprobs.expand(len(nodes), -1), config)


def test_observe_counts_the_choice_rank_at_each_visited_expanded_node():
    policy = SequoiaSearch([0.5, 0.2, 0.1], prior_strength=1.0, rebuild_tolerance=1.0)
    draft = torch.log_softmax(torch.tensor([0.0, 3.0, 2.0, 1.0, -1.0]), dim=-1)  # ranks: tokens 1, 2, 3, 0, 4
    result = grown(policy, budget=3, max_depth=1, logprobs=draft)
    assert result.draft_top_tokens[0].tolist() == [1, 2, 3]
    assert (result.draft_top_tokens[1:] == -1).all()  # leaves were not expanded
    policy.observe(result, [2])  # the root's rank-1 token, which the depth-1 tree holds as a leaf
    assert policy.learnt.visits == 2.0 and policy.learnt.hits.tolist() == pytest.approx([0.5, 1.2, 0.1])
    policy.observe(result, [1, 4])  # rank 0, then a choice at a leaf the draft never expanded: not counted
    assert policy.learnt.visits == 3.0 and policy.learnt.hits.tolist() == pytest.approx([1.5, 1.2, 0.1])
    policy.observe(result, [4])  # a token outside the top three: a visit with no hit
    assert policy.learnt.visits == 4.0 and policy.learnt.hits.tolist() == pytest.approx([1.5, 1.2, 0.1])
    target = torch.tensor([[0.1, 0.6, 0.2, 0.05, 0.05]], dtype=torch.float64)
    policy.observe(result, [1, 0], [target, target])  # sampling: each rank's probability under the target
    assert policy.learnt.visits == 5.0 and policy.learnt.hits.tolist() == pytest.approx([2.1, 1.4, 0.15])
    assert policy.acceptance == [0.5, 0.2, 0.1]  # nothing moved past the tolerance of 1


def test_shapes_are_rebuilt_only_when_a_rate_moves_past_the_tolerance():
    policy = SequoiaSearch([0.5, 0.5], prior_strength=100.0, rebuild_tolerance=0.05)
    draft = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0]), dim=-1)
    result = grown(policy, budget=4, max_depth=4, logprobs=draft)
    shape = policy.cached_shape(4, 4, 3)
    policy.observe(result, [0, 0])  # rank 0 at the root and its child: 52/102, and 50/102 for rank 1
    assert policy.cached_shape(4, 4, 3) is shape and policy.acceptance == [0.5, 0.5]
    for _ in range(10):
        policy.observe(result, [0, 0, 0, 0, 0])  # rank 0 at every expanded visited node
    assert max(abs(a - b) for a, b in zip(policy.acceptance, policy.learnt_acceptance())) <= 0.05
    assert policy.acceptance[0] > 0.55 and policy.cached_shape(4, 4, 3) is not shape


@given(
    acceptance=acceptance_vectors,
    budget=st.integers(1, 12),
    max_depth=st.integers(1, 5),
    fixed=st.floats(1e-3, 1.0),
    per_token=st.floats(0.0, 0.05),
    draft_forward=st.floats(0.0, 0.2),
)
def test_sized_tree_has_the_most_tokens_per_second_of_every_size_and_depth(
    acceptance, budget, max_depth, fixed, per_token, draft_forward
):
    cost = StepCost(lambda tokens: fixed + per_token * tokens, draft_forward)

    def rate(nodes: int, depth_limit: int) -> float:
        parents, _, values = best_first_nodes(acceptance, nodes, depth_limit)
        depths = [0]
        for node in range(1, len(parents)):
            depths.append(depths[parents[node]] + 1)
        return sum(values) / cost(len(parents) - 1, max(depths))

    best = max(rate(n, d) for n in range(1, budget + 1) for d in range(1, max_depth + 1))
    parents, ranks, values = sized_nodes(acceptance, budget, max_depth, cost)
    assert 2 <= len(parents) <= budget + 1
    depths = [0]
    for node in range(1, len(parents)):
        assert parents[node] < node and math.isclose(values[node], values[parents[node]] * acceptance[ranks[node]])
        depths.append(depths[parents[node]] + 1)
    assert max(depths) <= max_depth
    assert math.isclose(sum(values) / cost(len(parents) - 1, max(depths)), best, rel_tol=1e-9)


def test_costly_tokens_shrink_the_tree_and_costly_draft_forwards_flatten_it():
    acceptance = [0.6, 0.2, 0.1]
    flat = SequoiaSearch(acceptance, learn=False, step_cost=StepCost(lambda tokens: 1.0, 0.0))
    assert flat.shape(32, 8, vocab_size=64).num_nodes == 33  # free tokens: the whole budget
    linear = SequoiaSearch(acceptance, learn=False, step_cost=StepCost(lambda tokens: 0.1 * tokens, 0.0))
    assert linear.shape(32, 8, vocab_size=64).num_nodes < 10
    slow_draft = SequoiaSearch(acceptance, learn=False, step_cost=StepCost(lambda tokens: 1.0, 10.0))
    shape = slow_draft.shape(32, 8, vocab_size=64)
    assert all(parent == 0 for parent in shape.parents[1:])  # one draft forward: the root's children only
    assert not grow_tree.size_by_cost(lambda tokens: 1.0, 0.0)  # best-first leaves the size to budget="auto"


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """Forward profiles go to a fresh directory and in-process cache."""
    monkeypatch.setenv("SPECEXEC_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(autobudget, "_profiles", {})


@pytest.mark.usefixtures("private_cache")
def test_auto_budget_hands_sequoia_the_measured_costs_and_keeps_greedy_output():
    target = tiny_model("llama", seed=2)
    draft = perturbed_copy(target, 0.05, seed=3)
    ids = prompt(2, 5)
    expected = target.generate(ids, max_new_tokens=16, do_sample=False)
    policy = SequoiaSearch()
    stats = SpecExecStats()
    got = target.generate(
        ids, max_new_tokens=16, do_sample=False, assistant_model=draft, speculator="specexec", budget="auto",
        tree_search=policy, specexec_stats=stats,
    )
    assert got.tolist() == expected.tolist()
    assert isinstance(policy.step_cost.target_seconds, autobudget.ForwardProfile)
    assert all(step.tree_size - 1 <= max(autobudget.DEFAULT_CANDIDATES) for step in stats.steps)


def test_learning_sequoia_samples_follow_the_targets_processed_distribution():
    settings = {"temperature": 0.5}
    target = tiny_model("llama", seed=11, vocab_size=VOCAB, sharpness=3.0)
    draft = perturbed_copy(target, 0.3, seed=12)
    distribution = exact_distribution(target, processors(settings))
    policy = SequoiaSearch([0.4, 0.3, 0.2], prior_strength=1.0, rebuild_tolerance=0.0)  # rebuilt after every walk
    torch.manual_seed(2024)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(SAMPLES):
        out = target.generate(
            PROMPT, do_sample=True, max_new_tokens=NEW_TOKENS, top_k=None, top_p=None, **settings,
            assistant_model=draft, speculator="specexec", budget=6, tree_search=policy,
        )
        outcome = tuple(out[0, PROMPT.shape[1] :].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
    assert chi_square_p(counts, distribution) > 1e-3
    assert chi_square_p(counts, exact_distribution(target, processors({}))) < 1e-3
    assert policy.learnt.visits > SAMPLES  # it learnt from every call's walks


def test_bad_options_are_refused_before_any_work():
    with pytest.raises(ValueError, match="non-empty list of probabilities"):
        SequoiaSearch([1.5])
    with pytest.raises(ValueError, match="prior_strength must be positive"):
        SequoiaSearch(prior_strength=0.0)
    with pytest.raises(ValueError, match="rebuild_tolerance at least 0"):
        SequoiaSearch(rebuild_tolerance=-0.1)


def test_a_search_result_without_recorded_ranks_teaches_nothing():
    policy = SequoiaSearch([0.5])
    tree = TokenTree.from_root(0)
    policy.observe(SearchResult(tree, tree, torch.arange(1), 1), [3])
    assert policy.learnt.visits == 4.0


@pytest.mark.vllm
def test_the_vllm_proposer_selects_a_policy_by_name_and_its_walks_teach_it():
    pytest.importorskip("vllm")
    from test_vllm_tree_unit import _proposer_config

    from specexec_hf.integrations.vllm import ProposerSettings, SpecExecProposer

    assert ProposerSettings.from_sources({"draft_model": "d"}, {}).tree_search == "specexec"
    assert ProposerSettings.from_sources({"draft_model": "d"}, {"SPECEXEC_TREE_SEARCH": "sequoia"}).tree_search == (
        "sequoia"
    )
    with pytest.raises(ValueError, match="Unknown tree policy 'sequia'"):
        ProposerSettings.from_sources({"draft_model": "d", "tree_search": "sequia"}, {})
    config = _proposer_config(8, 8)
    config.speculative_config.draft_load_config.model_loader_extra_config["specexec"]["tree_search"] = "sequoia"
    proposer = SpecExecProposer(config)
    proposer.draft = tiny_model("llama", seed=4)
    proposer.tree_verifier = object()  # trees verified whole: ranked as generate() ranks them
    generator = proposer._generator("request", 0.0)
    assert generator.search is proposer.tree_search and isinstance(proposer.tree_search, SequoiaSearch)
    assert generator.acceptance_map is None  # a static shape fixes each child's rank: no map to rank them by
    history = prompt(4, 6)
    proposer.last_searches["request"] = (generator.grow_tree(history), history.shape[1])
    continuation = proposer.draft.generate(history, max_new_tokens=3, do_sample=False)[0]
    proposer._observe(generator, "request", continuation.numpy(), continuation.numel())
    assert proposer.tree_search.learnt.visits > 4.0
