"""Draft hierarchies (TriForce): the draft's tree re-ranked by an intermediate model and cut to the budget."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, perturbed_copy, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from specexec_hf import SpecExecStats
from specexec_hf.core.hierarchy import rescored_tree
from specexec_hf.core.tree import TokenTree
from specexec_hf.hf import intermediate_draft as hierarchy


@st.composite
def scored_trees(draw):
    """A random tree (unique tokens per parent) and random log-probs of a vocabulary at each of its nodes."""
    vocab = draw(st.integers(2, 6))
    size = draw(st.integers(1, 14))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    tree = TokenTree.from_root(0)
    children: dict[int, set[int]] = {}
    for _ in range(size - 1):
        parent = int(torch.randint(tree.num_nodes, (1,), generator=generator))
        free = [token for token in range(vocab) if token not in children.setdefault(parent, set())]
        if not free:
            continue
        token = free[int(torch.randint(len(free), (1,), generator=generator))]
        children[parent].add(token)
        tree.add_children(torch.tensor([parent]), torch.tensor([token]), torch.tensor([-1.0]))
    logits = torch.randn(tree.num_nodes, vocab, generator=generator) * draw(st.sampled_from([0.5, 3.0]))
    if draw(st.booleans()):  # impossible tokens and exact ties, as a top-k or restricted head gives
        rounded = logits.round()
        logits = torch.where((logits < -1) & (logits < logits.max(dim=-1, keepdim=True).values), -torch.inf, rounded)
    return tree, torch.log_softmax(logits, dim=-1)


def brute_scores(tree: TokenTree, logprobs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Every candidate path (the tree's nodes, and each node's likeliest child) -> its cumulative log-prob."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()

    def path(node: int) -> tuple[int, ...]:
        return () if node == 0 else path(parents[node]) + (tokens[node],)

    scores = {}
    for node in range(tree.num_nodes):
        score = sum(float(logprobs[parents[n], tokens[n]]) for n in tree.path(node))
        if node:
            scores[path(node)] = score
        best = int(logprobs[node].argmax())
        if path(node) + (best,) not in scores and best not in [tokens[c] for c in range(1, tree.num_nodes)
                                                                if parents[c] == node]:
            scores[path(node) + (best,)] = score + float(logprobs[node, best])
    return scores


@given(scored=scored_trees(), budget=st.integers(0, 20), max_depth=st.sampled_from([None, 1, 2, 5]))
def test_rescored_tree_keeps_the_best_candidates_ancestor_closed(scored, budget, max_depth):
    tree, logprobs = scored
    rescored, source = rescored_tree(tree, logprobs, budget, max_depth)
    parents, tokens = rescored.parents.tolist(), rescored.tokens.tolist()
    assert parents[0] == -1 and all(0 <= parents[n] < n for n in range(1, rescored.num_nodes))

    def path(node: int) -> tuple[int, ...]:
        return () if node == 0 else path(parents[node]) + (tokens[node],)

    # A candidate the draft proposed is never depth-limited; an added one is.
    candidates = {c: s for c, s in brute_scores(tree, logprobs).items()
                  if max_depth is None or len(c) <= max_depth or _in_tree(tree, c)}
    kept = [path(n) for n in range(1, rescored.num_nodes)]
    assert len(set(kept)) == len(kept) == min(budget, len(candidates))
    for node, kept_path in enumerate(kept, start=1):
        assert float(rescored.logprobs[node]) == pytest.approx(candidates[kept_path], abs=1e-4)
        if int(source[node]) >= 0:
            assert int(tree.tokens[source[node]]) == tokens[node]
        else:
            assert not _in_tree(tree, kept_path)
    if kept:
        worst = min(candidates[p] for p in kept)
        assert all(score <= worst + 1e-4 for p, score in candidates.items() if p not in kept)


def _in_tree(tree: TokenTree, tokens_path: tuple[int, ...]) -> bool:
    index = tree.child_index()
    node = 0
    for token in tokens_path:
        if (node, token) not in index:
            return False
        node = index[(node, token)]
    return True


intermediates = st.one_of(
    st.sampled_from(["self:exit:1", "self:exit:2"]), st.sampled_from([0.0, 0.05, 0.5])
)


@settings(max_examples=25)
@given(
    arch=st.sampled_from(sorted(ARCHITECTURES)),
    seed=st.integers(0, 2**16),
    budget=st.integers(1, 12),
    extra=st.integers(0, 24),
    intermediate=intermediates,
    max_new_tokens=st.integers(1, 20),
)
def test_a_hierarchy_gives_plain_greedy_output(arch, seed, budget, extra, intermediate, max_new_tokens):
    target = tiny_model(arch, seed=seed)
    draft = perturbed_copy(target, 2.0, seed=seed + 1)
    middle = intermediate if isinstance(intermediate, str) else perturbed_copy(target, intermediate, seed=seed + 2)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(seed))
    expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    stats = SpecExecStats()
    got = target.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, speculator="specexec",
        budget=budget, intermediate_model=middle, draft_budget=budget + extra, specexec_stats=stats,
    )
    assert got.tolist() == expected.tolist()
    assert all(step.tree_size <= budget + 1 for step in stats.steps)


@torch.no_grad()
def test_the_intermediate_scores_every_node_as_a_fresh_forward_would(monkeypatch):
    """Its KV cache, kept across steps and cut to the accepted path, gives each node the logits the intermediate
    computes from scratch over the committed tokens and the node's path."""
    target = tiny_model("llama", seed=3)
    draft, middle = perturbed_copy(target, 1.0, seed=4), perturbed_copy(target, 0.1, seed=5)
    seen = []
    original = hierarchy.rescored_tree

    def recording(tree, logprobs, budget, max_depth):
        seen.append((tree, logprobs))
        return original(tree, logprobs, budget, max_depth)

    rescore = hierarchy.IntermediateDraft.rescore

    def with_sequence(self, sequence, grown, max_depth):
        result = rescore(self, sequence, grown, max_depth)
        seen[-1] = (sequence.clone(), *seen[-1])
        return result

    monkeypatch.setattr(hierarchy, "rescored_tree", recording)
    monkeypatch.setattr(hierarchy.IntermediateDraft, "rescore", with_sequence)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft, speculator="specexec",
                    budget=4, intermediate_model=middle, draft_budget=16)
    assert len(seen) > 2
    for sequence, tree, logprobs in seen:
        for node in range(0, tree.num_nodes, 3):
            full = torch.cat([sequence, tree.path_tokens(node)[None]], dim=-1)
            fresh = torch.log_softmax(middle(full).logits[0, -1].float(), dim=-1)
            torch.testing.assert_close(logprobs[node], fresh, atol=1e-5, rtol=1e-5)


def test_hierarchy_refusals():
    target = tiny_model("llama", seed=0)
    draft = perturbed_copy(target, 0.1, seed=1)
    ids = torch.tensor([[1, 2, 3]])
    run = dict(max_new_tokens=4, assistant_model=draft, speculator="specexec")
    with pytest.raises(ValueError, match="draft_budget sizes the draft's tree"):
        target.generate(ids, draft_budget=32, **run)
    for knobs, named in ((dict(budget="auto"), 'budget="auto"'), (dict(draft_ahead=True), "draft_ahead=True"),
                         (dict(do_sample=True, sampled_children=True), "sampled_children=True")):
        with pytest.raises(ValueError, match=f"does not combine with {named}"):
            target.generate(ids, intermediate_model=draft, **run, **knobs)
    with pytest.raises(ValueError, match="draft_budget must be an integer >= budget"):
        target.generate(ids, intermediate_model=draft, budget=8, draft_budget=4, **run)


def test_the_default_draft_budget_is_a_multiple_of_the_budget(monkeypatch):
    target = tiny_model("llama", seed=0)
    draft = perturbed_copy(target, 0.5, seed=1)
    drafted_sizes = []
    rescore = hierarchy.IntermediateDraft.rescore

    def recording(self, sequence, grown, max_depth):
        drafted_sizes.append(grown.tree.num_nodes - 1)
        return rescore(self, sequence, grown, max_depth)

    monkeypatch.setattr(hierarchy.IntermediateDraft, "rescore", recording)
    stats = SpecExecStats()
    target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=12, assistant_model=draft, speculator="specexec",
                    budget=3, max_branch=4, min_draft_gain=0.0, intermediate_model="self:exit:1", specexec_stats=stats)
    factor = hierarchy.HIERARCHY_DRAFT_FACTOR
    assert max(drafted_sizes) == factor * 3 and all(size <= factor * 3 for size in drafted_sizes)
    assert all(step.tree_size <= 4 for step in stats.steps)
