"""Cache consistency: compacting KV caches after verification equals recomputing them from scratch."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, DEVICES, on_device, perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from tolerances import assert_close_across_kernels, compute_dtype, model_bound, rounding_bound
from transformers import DynamicCache

import specexec_hf  # noqa: F401  (installs speculator="specexec")
from specexec_hf import SpecExecCandidateGenerator, SpecExecConfig, TokenTree
from specexec_hf.hf.kv import new_cache


@torch.no_grad()
def recomputed_cache(model, ids: torch.Tensor) -> DynamicCache:
    cache = new_cache()  # full layers, as SpecExec keeps them (a sliding layer's own cache keeps one window)
    model(ids, past_key_values=cache, use_cache=True)
    return cache


def assert_cache_prefix_equal(cache: DynamicCache, reference: DynamicCache, model) -> None:
    """``cache`` (filled by tree forwards) starts with ``reference`` (``model``'s forward over the same tokens), up to
    the rounding of the other kernel path."""
    length = reference.get_seq_length()
    bound = model_bound(model, keys=length)
    for ours, theirs in zip(cache.layers, reference.layers):
        assert_close_across_kernels(ours.keys[..., :length, :], theirs.keys, bound)
        assert_close_across_kernels(ours.values[..., :length, :], theirs.values, bound)


@pytest.mark.parametrize("device", DEVICES)
@given(
    arch=st.sampled_from(sorted(ARCHITECTURES)),
    seed=st.integers(0, 2**16),
    budget=st.integers(1, 24),
    max_new_tokens=st.integers(1, 24),
)
def test_target_cache_after_generate_equals_recomputation(device, arch, seed, budget, max_new_tokens):
    target = tiny_model(arch, seed=seed)
    draft = perturbed_copy(target, 0.05, seed=seed + 1)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(seed))
    target, draft, ids = on_device(device, target, draft, ids)
    out = target.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
        assistant_model=draft, speculator="specexec", budget=budget,
    )
    cache = out.past_key_values
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    assert_cache_prefix_equal(cache, recomputed_cache(target, out.sequences[:, :-1]), target)


@pytest.mark.parametrize("device", DEVICES)
@given(seed=st.integers(0, 2**16), budget=st.integers(2, 24), steps=st.integers(1, 5), data=st.data())
def test_draft_cache_reuses_accepted_nodes_and_matches_recomputation(device, seed, budget, steps, data):
    draft = tiny_model("llama", seed=seed)
    history = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(seed))
    draft, history = on_device(device, draft, history)
    generator = SpecExecCandidateGenerator(draft, SpecExecConfig(budget=budget, expand_per_forward=4))
    for _ in range(steps):
        tree = generator.grow_tree(history).tree
        assert generator.cached_ids == history[0].tolist()
        assert_cache_prefix_equal(generator.cache, recomputed_cache(draft, history), draft)
        # Accept a random root-to-node path plus a bonus token, as a verifier would.
        node = data.draw(st.integers(0, tree.num_nodes - 1))
        bonus = data.draw(st.integers(0, 63))
        path = tree.path_tokens(node)[None].to(device)
        history = torch.cat([history, path, torch.tensor([[bonus]], device=device)], dim=-1)
    # A history that diverges from what the cache holds is handled by cutting back to the common prefix.
    diverged = torch.cat([history[:, :3], (history[:, 3:] + 1) % 64], dim=-1)
    generator.grow_tree(diverged)
    assert_cache_prefix_equal(generator.cache, recomputed_cache(draft, diverged), draft)


@given(seed=st.integers(0, 2**16), budget=st.integers(2, 16), data=st.data())
def test_a_tree_grown_ahead_seeds_the_next_and_its_draft_logits_equal_recomputation(seed, budget, data):
    """draft_ahead: the search grown on past the verified tree; a history continuing down fed pool nodes starts the
    next tree from the subtree there, its draft cache holding exactly each kept node's ancestors."""
    from specexec_hf.hf.draft_cache import forward_feeds

    draft = tiny_model("llama", seed=seed)
    history = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(seed))
    config = SpecExecConfig(budget=budget, expand_per_forward=4, draft_ahead=True)
    generator = SpecExecCandidateGenerator(draft, config)
    generator.grow_tree(history)
    forwards = data.draw(st.integers(0, 6))
    made = iter(range(forwards))
    generator.grow_ahead(lambda: next(made, None) is None, 4 * budget)
    old = generator._search
    fed = [n for n in range(1, old.pool.num_nodes) if bool(old.expanded[n])]
    if not fed:
        return
    node = data.draw(st.sampled_from(fed))
    continued = torch.cat([history, old.pool.path_tokens(node)[None]], dim=-1)
    search = generator.start_tree(continued)
    assert generator.seeded_trees == 1
    assert generator.cached_ids == continued[0].tolist()
    assert_cache_prefix_equal(generator.cache, recomputed_cache(draft, continued), draft)
    # The subtree under `node`, re-rooted: each kept node's path from the new root is its old path from `node`.
    old_paths = {tuple(old.pool.path_tokens(n).tolist()) for n in range(old.pool.num_nodes)}
    prefix = tuple(old.pool.path_tokens(node).tolist())
    for new in range(1, search.pool.num_nodes):
        assert prefix + tuple(search.pool.path_tokens(new).tolist()) in old_paths
    nodes = search.next_nodes()
    if nodes is None:
        return
    (logits,) = forward_feeds(draft, [generator.feed(search.pool, nodes)])
    for row, new in enumerate(nodes.tolist()):
        ids = torch.cat([continued, search.pool.path_tokens(new)[None]], dim=-1)
        with torch.no_grad():
            expected = draft(ids).logits[0, -1]
        # The feed's logits come back in float32: equal to the float64 recomputation up to that rounding.
        assert_close_across_kernels(logits[row], expected.float(), 4 * torch.finfo(torch.float32).eps)


def test_a_history_leaving_the_fed_nodes_starts_a_fresh_tree():
    draft = tiny_model("llama", seed=4)
    generator = SpecExecCandidateGenerator(draft, SpecExecConfig(budget=8, expand_per_forward=4, draft_ahead=True))
    history = torch.tensor([[3, 1, 4, 1, 5]])
    tree = generator.grow_tree(history).tree
    generator.grow_ahead(lambda: False, 32)
    unseen = next(t for t in range(64) if (0, t) not in tree.child_index())  # not a child of the root in the pool
    continued = torch.cat([history, torch.tensor([[unseen]])], dim=-1)
    if (0, unseen) in generator._search.pool.child_index():
        pytest.skip("the grown-on pool holds that token")
    generator.grow_tree(continued)
    assert generator.seeded_trees == 0
    assert_cache_prefix_equal(generator.cache, recomputed_cache(draft, continued), draft)


def test_draft_cache_keeps_fed_nodes_instead_of_refeeding():
    draft = tiny_model("llama", seed=3)
    generator = SpecExecCandidateGenerator(draft, SpecExecConfig(budget=30, expand_per_forward=8))
    history = torch.tensor([[5, 6, 7]])
    tree = generator.grow_tree(history).tree
    deep = int(tree.depths.argmax())
    path = tree.path(deep)[:-1]  # interior nodes were fed to the draft
    assert path, "the tree should be deeper than one level"
    fed_before = generator.cache.get_seq_length()
    generator.draft_cache.sync(torch.cat([history[0], tree.tokens[path], torch.tensor([9])]).tolist())
    assert generator.cached_ids == history[0].tolist() + tree.tokens[path].tolist()
    assert generator.cache.get_seq_length() == len(generator.cached_ids) < fed_before


@pytest.mark.parametrize("device", DEVICES)
@given(
    arch=st.sampled_from(sorted(ARCHITECTURES)),
    seed=st.integers(0, 2**16),
    head_hook=st.sampled_from(["none", "hook", "hook, weights stay loaded"]),
    logprobs=st.lists(st.floats(-5, 0), min_size=6, max_size=6),
    order=st.permutations(range(7)),
    dtype=st.sampled_from([torch.float64, torch.float32]),  # float32 on a CPU: rows as weight @ rows.T
)
def test_node_logits_on_demand_equal_the_full_forward(device, arch, seed, head_hook, logprobs, order, dtype):
    from specexec_hf.hf.forward import (
        VERIFIED_MODEL_TYPES,
        WALK_ROWS_PER_HEAD_CALL,
        Feed,
        mark_weights_stay_loaded,
        model_logits,
        node_logits,
    )

    model = tiny_model(arch, seed=seed, dtype=dtype).to(device)
    pre_hook_rows = []
    if head_hook != "none":  # e.g. an offloading hook: the head must then run inside the model's own forward
        model.lm_head.register_forward_pre_hook(lambda module, args: pre_hook_rows.append(args[0].shape[0]))
    if head_hook == "hook, weights stay loaded":  # unless the executor keeps its weights in place
        mark_weights_stay_loaded(model.lm_head)
    tokens = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(seed))
    visible = torch.ones(9, 9, dtype=torch.bool).tril()
    visible[6:, 3:6] = False  # three nodes under token 2 that do not see each other's siblings
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 3, 4, 5])
    tokens, visible, positions = on_device(device, tokens, visible, positions)
    # The nodes: a root, then two chains of three under it (the second does not see the first).
    tree = TokenTree(
        tokens=tokens[2:].cpu(),
        parents=torch.tensor([-1, 0, 1, 2, 0, 4, 5]),
        depths=torch.tensor([0, 1, 2, 3, 1, 2, 3]),
        logprobs=torch.tensor([0.0, *logprobs]),
    )
    expected = model_logits(model, Feed(new_cache(), tokens, positions, visible, 7))
    lazy = node_logits(model, Feed(new_cache(), tokens, positions, visible, 7), tree=tree)
    assert (lazy.hidden is None) == (head_hook == "hook" or model.config.model_type not in VERIFIED_MODEL_TYPES)
    calls = []
    if lazy.head is not None:
        lazy.head.register_forward_hook(lambda module, args, output: calls.append(args[0].shape[0]))
    # The same forward up to the head; the head then sums over the hidden size for a few rows instead of nine.
    bound = rounding_bound(compute_dtype(model), reduction=model.config.hidden_size)
    likeliest, computed = tree.likeliest_children(), set()
    for node in (*order, 6, 0):
        before = len(calls)
        assert_close_across_kernels(lazy.row(node), expected[node : node + 1], bound)
        if lazy.head is None:
            continue
        if node in computed:
            assert len(calls) == before
            continue
        # A missing row comes with its likeliest descendants' rows not computed yet, in one head call.
        path = [node]
        while len(path) < WALK_ROWS_PER_HEAD_CALL and likeliest[path[-1]] >= 0 and likeliest[path[-1]] not in computed:
            path.append(likeliest[path[-1]])
        assert calls[before:] == [len(path)]
        computed |= set(path)
    if head_hook != "none" and lazy.head is not None:  # the executor's hook ran before every head call
        assert pre_hook_rows[-len(calls):] == calls
    assert "forward" not in vars(model.lm_head)  # the head's own forward is back
