"""grow_trees: several requests' trees grown with shared, batched draft forwards equal the trees grown one by one,
whatever each request's tree policy."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from test_cache import assert_cache_prefix_equal, recomputed_cache
from tolerances import assert_close_across_kernels, model_bound

from specexec_hf import SpecExecCandidateGenerator, SpecExecConfig, grow_tree, grow_trees
from specexec_hf.core.static_trees import SequoiaSearch, SpecInferSearch
from specexec_hf.hf.forward import Feed, packed_inputs
from specexec_hf.hf.kv import new_cache

POLICIES = [grow_tree, SpecInferSearch(), SpecInferSearch(beams=2), SequoiaSearch([0.6, 0.25, 0.1])]


def assert_same_tree(batched, alone, bound: float) -> None:
    """The same tokens and parents; the same log-probabilities up to ``bound`` (batched forwards are other kernel
    shapes)."""
    assert torch.equal(batched.tree.tokens, alone.tree.tokens)
    assert torch.equal(batched.tree.parents, alone.tree.parents)
    assert_close_across_kernels(batched.tree.logprobs, alone.tree.logprobs, bound)


@given(
    arch=st.sampled_from(sorted(ARCHITECTURES)),
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    budget=st.integers(1, 20),
    expand_per_forward=st.integers(1, 6),
    steps=st.integers(1, 3),
    data=st.data(),
)
def test_batched_trees_and_caches_equal_trees_grown_alone(
    arch, seed, lengths, budget, expand_per_forward, steps, data
):
    draft = tiny_model(arch, seed=seed)
    config = SpecExecConfig(budget=budget, expand_per_forward=expand_per_forward, max_depth=6)
    policies = [data.draw(st.sampled_from(POLICIES)) for _ in lengths]
    batched = [SpecExecCandidateGenerator(draft, config, search=policy) for policy in policies]
    alone = [SpecExecCandidateGenerator(draft, config, search=policy) for policy in policies]
    rng = torch.Generator().manual_seed(seed)
    histories = [torch.randint(0, 64, (1, n), generator=rng) for n in lengths]
    for _ in range(steps):
        depths = [data.draw(st.one_of(st.none(), st.integers(1, 6))) for _ in lengths]
        batch = grow_trees(list(zip(batched, histories, depths)))
        results = [g.grow_tree(h, max_depth=d) for g, h, d in zip(alone, histories, depths)]
        forwards = [result.draft_forwards for result in results]
        assert max(forwards) <= batch.draft_calls <= sum(forwards)
        for generator, history, ours, theirs in zip(batched, histories, batch.results, results):
            assert_same_tree(ours, theirs, model_bound(draft, keys=history.shape[-1] + theirs.tree.num_nodes))
            assert ours.draft_forwards == theirs.draft_forwards
            assert generator.cached_ids == history[0].tolist()
            assert_cache_prefix_equal(generator.cache, recomputed_cache(draft, history), draft)
        # Each request accepts a random path plus a bonus token, as a verifier would; the caches carry over.
        for i, result in enumerate(batch.results):
            node = data.draw(st.integers(0, result.tree.num_nodes - 1))
            bonus = torch.tensor([[data.draw(st.integers(0, 63))]])
            histories[i] = torch.cat([histories[i], result.tree.path_tokens(node)[None], bonus], dim=-1)


def test_requests_of_equal_length_share_every_draft_call():
    draft = tiny_model("llama", seed=5)
    config = SpecExecConfig(budget=24, expand_per_forward=4)
    histories = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(5))
    generators = [SpecExecCandidateGenerator(draft, config) for _ in range(3)]
    batch = grow_trees([(g, h[None], None) for g, h in zip(generators, histories)])
    assert batch.draft_calls == max(result.draft_forwards for result in batch.results) > 1


def test_growing_with_autograd_on_records_no_graph():
    """Outside generate() (a benchmark, the vLLM proposer) grad mode may be on; a draft's forwards under it cost
    a third more host time and keep their activations alive."""
    draft = tiny_model("llama", seed=5)
    generator = SpecExecCandidateGenerator(draft, SpecExecConfig(budget=16, expand_per_forward=4))
    with torch.enable_grad():
        grown = generator.grow_tree(torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(6)))
    assert grown.draft_forwards > 1
    assert not grown.tree.logprobs.requires_grad and not grown.pool.logprobs.requires_grad
    assert not generator.cache.layers[0].keys.requires_grad


def test_grow_trees_rejects_shared_generators():
    draft = tiny_model("llama", seed=0)
    generator = SpecExecCandidateGenerator(draft, SpecExecConfig(budget=8))
    history = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="one generator per request"):
        grow_trees([(generator, history, None), (generator, history, None)])
    other_draft = SpecExecCandidateGenerator(tiny_model("llama", seed=1), SpecExecConfig(budget=8))
    with pytest.raises(ValueError, match="one generator per request"):
        grow_trees([(generator, history, None), (other_draft, history, None)])
    assert grow_trees([]).results == []


@given(lengths=st.lists(st.integers(1, 5), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_packed_inputs_pad_each_feeds_tokens_positions_per_token_inputs_and_pattern(lengths, seed):
    model = tiny_model("llama", seed=0)
    rng = torch.Generator().manual_seed(seed)
    feeds = [
        Feed(new_cache(), torch.randint(1, 64, (n,), generator=rng), torch.arange(n) + 3, None, 1,
             {"token_type_ids": torch.randint(1, 3, (1, n), generator=rng)})
        for n in lengths
    ]
    kwargs = packed_inputs(model, feeds, new_cache(), [0] * len(feeds))
    longest = max(lengths)
    mask = kwargs["attention_mask"]
    assert mask.shape == (len(feeds), 1, longest, longest) and mask.dtype == torch.bool
    for row, (feed, n) in enumerate(zip(feeds, lengths)):
        for name, own in (("input_ids", feed.tokens), ("position_ids", feed.positions),
                          ("token_type_ids", feed.extra_inputs["token_type_ids"][0])):
            assert torch.equal(kwargs[name][row], torch.cat([own, own.new_zeros(longest - n)])), name
        assert torch.equal(mask[row, 0, :n, :n], feed.visibility())  # causal: its own pattern
        assert not mask[row, 0, :n, n:].any()
        assert torch.equal(mask[row, 0, n:], torch.eye(longest, dtype=torch.bool)[n:])  # padding sees itself alone
