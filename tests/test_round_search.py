"""The best-first tree grown in fixed-shape rounds (tree_search="rounds"): its trees, host reads and outputs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from test_host_syncs import HostReadCounter
from test_tree_and_search import search_configs, table_expand

from specexec_hf import SpecExecConfig, SpecExecStats, TokenTree, grow_tree
from specexec_hf.core.acceptance_map import AcceptanceMap
from specexec_hf.core.context_match import ContextIndex, mix_context_guesses
from specexec_hf.core.device_context_match import DeviceContextMatch
from specexec_hf.core.round_search import RoundPolicy, RoundSearch
from specexec_hf.core.search import TREE_POLICIES, tree_policy
from specexec_hf.hf.candidate_generator import (
    SpecExecCandidateGenerator,
    _guesses_as_columns,
)


def tensor_expand(vocab: int, seed: int, sharpness: float):
    """A fake draft that reads nothing back: a node's next-token log-probs depend on its token and depth (a table)."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.log_softmax(sharpness * torch.randn(8, vocab, vocab, generator=generator), -1)

    def expand(pool: TokenTree, nodes: torch.Tensor) -> torch.Tensor:
        return table[pool.depths[nodes] % 8, pool.tokens[nodes] % vocab]

    return expand


def drive(search, expand):
    while (nodes := search.next_nodes()) is not None:
        search.add_expansion(nodes, expand(search.pool, nodes))
    return search.result()


def paths(tree: TokenTree) -> set[tuple[tuple[int, ...], float]]:
    return {(tuple(tree.path_tokens(node).tolist()), float(tree.logprobs[node])) for node in range(tree.num_nodes)}


@given(search_configs, st.integers(1, 12), st.integers(0, 2), st.integers(0, 2**16), st.floats(0.5, 6.0),
       st.integers(2, 30))
def test_round_trees_keep_the_tree_invariants(config, rounds, extensions, seed, sharpness, vocab):
    result = RoundPolicy(rounds, extensions=extensions)(3, table_expand(vocab, seed, sharpness, []), config)
    tree, pool = result.tree, result.pool
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    assert parents[0] == -1 and all(0 <= parents[node] < node for node in range(1, tree.num_nodes))
    assert all(tree.depths[node] == tree.depths[parents[node]] + 1 for node in range(1, tree.num_nodes))
    assert int(tree.depths.max()) <= config.max_depth
    assert bool((tree.logprobs[1:] <= tree.logprobs[tree.parents[1:]]).all())
    siblings = [(parent, token) for parent, token in zip(parents, tokens)]
    assert len(set(siblings)) == len(siblings)  # no token twice under one parent
    # The budget exactly: as many nodes as it allows, unless the pool holds fewer possible ones.
    assert tree.num_nodes == min(config.budget + 1, int(torch.isfinite(pool.logprobs).sum()))
    assert torch.equal(pool.select(result.pool_index).tokens, tree.tokens)
    assert 1 <= result.draft_forwards <= rounds + extensions * math.ceil(rounds / 2)
    if config.max_draft_forwards is not None:
        assert result.draft_forwards <= 1 + config.max_draft_forwards


@given(search_configs, st.integers(1, 12), st.integers(0, 2**16), st.floats(0.5, 6.0), st.integers(2, 30))
def test_rounds_grow_best_firsts_tree_after_as_many_forwards(config, rounds, seed, sharpness, vocab):
    """Both expand the best unexpanded candidates; the rows best-first would not fill only ever hold nodes ranked below
    every kept one, so after the same forwards they keep the same tree."""
    config = replace(config, min_draft_gain=0.0, max_draft_forwards=None)  # updated() keeps a setting for None
    best_first = grow_tree(3, table_expand(vocab, seed, sharpness, []), config.updated(max_draft_forwards=rounds - 1))
    search = RoundSearch(3, config, rounds)
    result = drive(search, table_expand(vocab, seed, sharpness, []))
    assert paths(result.tree) == paths(best_first.tree)
    assert result.draft_forwards == rounds


@given(search_configs, st.integers(0, 2**16), st.floats(0.5, 6.0), st.integers(2, 30))
def test_the_reported_stop_is_best_firsts_forward_count(config, seed, sharpness, vocab):
    best_first = grow_tree(3, table_expand(vocab, seed, sharpness, []), config)
    # Past the most forwards best-first can make (one per kept node, the root's included), or at its cap.
    rounds = 1 + (config.max_draft_forwards if config.max_draft_forwards is not None else config.budget)
    search = RoundSearch(3, config, rounds)
    result = drive(search, table_expand(vocab, seed, sharpness, []))
    if best_first.draft_forwards < result.draft_forwards:  # best-first stopped by its own rules: reported exactly
        assert search.best_first_forwards == best_first.draft_forwards
    else:  # stopped by the forward cap, where the rounds end too
        assert result.draft_forwards == best_first.draft_forwards
        assert search.best_first_forwards >= best_first.draft_forwards


@given(st.integers(1, 8), st.integers(2, 9), st.integers(0, 2**16))
def test_a_tree_grows_by_another_batch_only_while_best_first_would(rounds, budget, seed):
    config = SpecExecConfig(budget=budget, max_branch=3, expand_per_forward=2, min_draft_gain=0.0)
    best_first = grow_tree(0, tensor_expand(12, seed, 2.0), config)
    search = RoundSearch(0, config, rounds, extensions=1)
    result = drive(search, tensor_expand(12, seed, 2.0))
    assert result.draft_forwards == (rounds if best_first.draft_forwards <= rounds else 2 * rounds)
    if best_first.draft_forwards <= result.draft_forwards:
        assert paths(result.tree) == paths(best_first.tree)


@pytest.mark.parametrize("budget", [16, 64, 256])
@pytest.mark.parametrize("rounds", [3, 9])
def test_the_search_reads_the_device_once_per_batch_and_never_between_forwards(budget, rounds):
    config = SpecExecConfig(budget=budget, max_branch=8, expand_per_forward=16)
    search = RoundSearch(0, config, rounds, extensions=0)
    expand = tensor_expand(50, 0, 2.0)
    with HostReadCounter() as counter:
        while (nodes := search.next_nodes()) is not None:
            search.add_expansion(nodes, expand(search.pool, nodes))
        read_in_rounds = counter.total
        result = search.result()
    assert result.draft_forwards == rounds
    # The end of the only batch reads once (next_nodes' last call); result() then only checks, on the CPU, that the
    # selection is closed (TokenTree.select; skipped on an accelerator).
    assert read_in_rounds == 1, counter.sites
    assert sorted(site.split(":")[0] for site in counter.sites) == ["core/round_search.py", "core/tree.py"]
    assert counter.total == 2, counter.sites


def test_learnt_rounds_cover_the_recent_trees():
    policy = RoundPolicy(coverage=0.75)
    assert policy.rounds_for(64) == 6  # before any tree: 3 + log2(budget) / 2
    for stop in [3, 9, 5, 4]:
        policy.learn_rounds(64, 9, stop)
    assert policy.rounds_for(64) == 5  # 3 of the 4 trees stopped within 5 forwards
    policy.learn_rounds(64, 5, 12)  # a tree that would have gone on counts as one forward more than it made
    assert policy.rounds_for(64) == 6
    assert policy.rounds_for(16) == 5  # another budget learns on its own
    assert RoundPolicy(rounds=4).rounds_for(64) == 4


def test_the_policy_is_registered_and_checks_its_options():
    assert "rounds" in TREE_POLICIES and isinstance(tree_policy("rounds", coverage=0.5), RoundPolicy)
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        RoundPolicy(rounds=0)
    with pytest.raises(ValueError, match="coverage must be a share"):
        RoundPolicy(coverage=0.0)
    with pytest.raises(ValueError, match="extensions a count"):
        RoundPolicy(extensions=-1)


@st.composite
def context_cases(draw):
    vocab = draw(st.integers(2, 12))
    weights = draw(st.lists(st.sampled_from([0.0, 0.1, 0.45, 0.9]), min_size=1, max_size=4))
    history = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=30))
    pool = TokenTree.from_root(history[-1])
    for parent, token in draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, vocab - 1)), max_size=15)):
        pool.add_children(torch.tensor([parent % pool.num_nodes]), torch.tensor([token]), torch.tensor([-1.0]))
    nodes = sorted(draw(st.sets(st.integers(0, pool.num_nodes - 1), min_size=1)))
    columns = sorted(draw(st.sets(st.integers(0, vocab - 1), min_size=1)))
    return vocab, weights, history, pool, torch.tensor(nodes), torch.tensor(columns)


def host_matches(index: ContextIndex, history: list[int], pool: TokenTree, nodes: torch.Tensor) -> list:
    """Each node's longest match as the host path finds it: the history, then the node's path below the root."""
    parents, tokens = pool.host_lists()
    matches = []
    for node in nodes.tolist():
        path: list[int] = []
        while node > 0 and len(path) < index.max_order:
            path.append(tokens[node])
            node = parents[node]
        context = history[len(path) - index.max_order :] if len(path) < index.max_order else []
        matches.append(index.longest_match(context + path[::-1]))
    return matches


def by_token(logprobs: torch.Tensor, columns: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` log-probs per token, whatever column holds it (a column that never scores stays -inf)."""
    out = torch.full((logprobs.shape[0], vocab), -math.inf, dtype=logprobs.dtype)
    for column, token in enumerate(columns.tolist()):
        out[:, token] = torch.logaddexp(out[:, token], logprobs[:, column])
    return out


@given(context_cases(), st.integers(0, 2**16))
def test_context_guesses_on_the_device_equal_the_host_index(case, seed):
    vocab, weights, history, pool, nodes, columns = case
    index = ContextIndex(len(weights))
    index.sync(history)
    matches = host_matches(index, history, pool, nodes)
    device = DeviceContextMatch(weights)
    device.sync(history)
    generator = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(3 * torch.randn(nodes.numel(), vocab, generator=generator), -1)
    expected = mix_context_guesses(logprobs.clone(), matches, weights)
    got, no_columns = device.mix(logprobs, pool, nodes)
    assert no_columns is None
    assert torch.allclose(got, expected, rtol=0, atol=1e-6)
    # Over part of the vocabulary: a guess outside the columns gets a column of its own.
    logprobs = torch.log_softmax(3 * torch.randn(nodes.numel(), columns.numel(), generator=generator), -1)
    widened, wider_columns, column_matches = _guesses_as_columns(logprobs.clone(), columns, matches)
    expected = by_token(mix_context_guesses(widened, column_matches, weights), wider_columns, vocab)
    got = by_token(*device.mix(logprobs, pool, nodes, columns), vocab)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.allclose(got.nan_to_num(neginf=0), expected.nan_to_num(neginf=0), rtol=0, atol=1e-6)


knobs = st.fixed_dictionaries(
    {
        "budget": st.integers(1, 40),
        "max_depth": st.one_of(st.none(), st.integers(1, 10)),
        "max_branch": st.integers(1, 6),
        "expand_per_forward": st.integers(1, 12),
        "acceptance_calibration": st.booleans(),
        "context_match_weights": st.sampled_from([(), (0.3,), (0.2, 0.5)]),
    }
)


@given(
    arch=st.sampled_from(["llama", "qwen2"]),
    seed=st.integers(0, 2**16),
    noise=st.sampled_from([0.0, 0.05, 0.5]),
    prompt_length=st.integers(1, 12),
    max_new_tokens=st.integers(1, 30),
    rounds=st.one_of(st.none(), st.integers(1, 6)),
    knobs=knobs,
)
def test_greedy_with_round_trees_equals_plain_greedy(arch, seed, noise, prompt_length, max_new_tokens, rounds, knobs):
    target = tiny_model(arch, seed=seed, dtype=torch.float32)
    draft = perturbed_copy(target, noise, seed=seed + 1)
    ids = torch.randint(0, 64, (1, prompt_length), generator=torch.Generator().manual_seed(seed))
    expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    stats = SpecExecStats()
    got = target.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, speculator="specexec",
        tree_search=RoundPolicy(rounds), specexec_stats=stats, **knobs,
    )
    assert got.tolist() == expected.tolist()
    assert all(step.tree_size <= knobs["budget"] + 1 for step in stats.steps)


def test_sampling_with_drawn_children_grows_round_trees():
    target = tiny_model("llama", seed=0, dtype=torch.float32)
    draft = perturbed_copy(target, 0.05, seed=1)
    stats = SpecExecStats()
    out = target.generate(
        torch.tensor([[1, 2, 3]]), max_new_tokens=20, do_sample=True, assistant_model=draft, speculator="specexec",
        tree_search="rounds", sampled_children=True, budget=12, specexec_stats=stats,
    )
    assert out.shape[1] == 23 and stats.new_tokens == 20
    assert stats.tokens_per_target_forward > 1


@pytest.mark.parametrize("draft_graphs", ["off", "on"])
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_host_reads_per_tree_do_not_grow_with_the_budget(budget, draft_graphs):
    """The drafter's whole tree, context guesses and acceptance ranking included: a constant per tree, the same at
    every budget and however many draft forwards it took, and the same over the draft's static cache."""
    target = tiny_model("llama", seed=0, num_layers=1, dtype=torch.float32)
    draft = perturbed_copy(target, 0.05, seed=1)
    config = SpecExecConfig(budget=budget)
    generator = SpecExecCandidateGenerator(
        draft, config, search=RoundPolicy(rounds=6, extensions=0), context_match_weights=(0.3, 0.5),
        acceptance_map=AcceptanceMap(), draft_graphs=draft_graphs,
    )
    history = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    reads = []
    for _ in range(3):
        with HostReadCounter() as counter:
            result = generator.grow_tree(history)
        # The map's first ranking fits its curves from its own host statistics: no device to wait for.
        reads.append(sum(n for site, n in counter.sites.items() if not site.startswith("core/acceptance_map.py")))
        assert result.draft_forwards == 6 and result.tree.num_nodes == budget + 1
        history = torch.cat([history, result.tree.tokens[result.tree.best_path()[:2]][None]], dim=-1)
    # The first tree: the history, the search's batch end, the CPU-only closed-selection check; the later ones also
    # read the last pool to keep the accepted nodes' draft cache (its slots and its token lists, in one read).
    assert reads == [3, 4, 4], (reads, counter.sites)


@pytest.mark.slow
def test_round_trees_match_best_first_tokens_per_forward_on_the_default_pair():
    """On held-out prompts, in float32, the round trees give what best-first's give, within 3%, with the same
    output."""
    from specexec_hf.hf.learnt_state import LearntState
    from specexec_hf.models import default_pair
    from specexec_hf.tools.prompts import chat_inputs, load_prompts

    if not default_pair.DRAFT_WEIGHTS_PATH.is_file():
        pytest.skip("the shipped draft is absent (produce it with `specexec-hf distill`)")
    target, draft, tokenizer = default_pair.load_default_pair(draft_dtype=torch.float32)
    prompts = load_prompts("eval")[:6]
    for budget in (16, 64):
        rates, outputs = {}, {}
        for name, policy in [("best-first", "specexec"), ("rounds", RoundPolicy())]:
            state, stats, outputs[name] = LearntState(), SpecExecStats(), []
            for prompt in prompts:
                out = target.generate(
                    **chat_inputs(tokenizer, prompt), max_new_tokens=48, do_sample=False, assistant_model=draft,
                    speculator="specexec", budget=budget, tree_search=policy, learnt_state=state,
                    specexec_stats=stats,
                )
                outputs[name].append(out.tolist())
            rates[name] = stats.tokens_per_target_forward
        assert outputs["rounds"] == outputs["best-first"]
        assert rates["rounds"] >= 0.97 * rates["best-first"], (budget, rates)
