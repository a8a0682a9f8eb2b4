"""The draft over a static cache and padded feeds (draft_graphs, hf/draft_graphs.py): the same logits per node as over
the dynamic cache, the same outputs, no host read added; on CUDA, graph replays equal to eager forwards."""

from __future__ import annotations

import gc
from unittest import mock

import pytest
import torch
from conftest import DEVICES, chi_square_p, perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from test_host_syncs import HostReadCounter
from test_round_search import knobs
from test_sampling import PROMPT, VOCAB, exact_distribution, processors

from specexec_hf import SpecExecConfig, SpecExecStats
from specexec_hf.core.round_search import RoundPolicy
from specexec_hf.core.search import BestFirstPolicy
from specexec_hf.core.uploads import upload
from specexec_hf.hf import draft_graphs
from specexec_hf.hf.candidate_generator import SpecExecCandidateGenerator
from specexec_hf.hf.draft_cache import DraftCache, forward_feeds, scored_columns
from specexec_hf.hf.draft_graphs import (
    StaticDraftCache,
    static_path_refusal,
    uses_draft_graphs,
)
from specexec_hf.hf.forward import Feed
from specexec_hf.hf.learnt_state import LearntState
from specexec_hf.models.vocab import restrict_draft_vocabulary

STATIC_ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]


def small_buckets():
    """Capacities from 8 and graphed widths up to 8, so that tiny trees grow the cache and prompts run unpadded."""
    return mock.patch.multiple(draft_graphs, FIRST_CAPACITY=8, MAX_GRAPHED_WIDTH=8)


@given(
    arch=st.sampled_from(STATIC_ARCHITECTURES),
    attention=st.sampled_from(["sdpa", "eager"]),
    seed=st.integers(0, 2**16),
    prompt_length=st.integers(1, 20),
    budget=st.integers(1, 24),
    width=st.integers(1, 12),
    rounds=st.one_of(st.none(), st.integers(1, 5)),
    accepted=st.lists(st.integers(0, 2**16), min_size=1, max_size=4),
    subset_head=st.booleans(),
)
def test_static_logits_equal_the_dynamic_caches_per_node(
    arch, attention, seed, prompt_length, budget, width, rounds, accepted, subset_head
):
    """Two draft caches, one static, fed the same trees in lockstep: every draft forward's logits per node agree
    (float32 rounding), over trees that keep accepted nodes, grow the capacity and feed histories both padded and
    wide."""
    draft = tiny_model(arch, seed=seed, dtype=torch.float32, attn_implementation=attention)
    if subset_head:  # a head scoring every other token: the graph keeps the head's output width
        draft = restrict_draft_vocabulary(draft, torch.arange(0, 64, 2))
    config = SpecExecConfig(budget=budget, expand_per_forward=width, max_branch=3)
    policy = RoundPolicy(rounds) if rounds is not None else BestFirstPolicy()
    generator = torch.Generator().manual_seed(seed)
    history = torch.randint(0, 64, (prompt_length,), generator=generator).tolist()
    with small_buckets(), torch.no_grad(), scored_columns(draft) as columns:
        dynamic, static = DraftCache(draft), DraftCache(draft, static=True)
        for walked in accepted:
            dynamic.sync(history)
            static.sync(history)
            search = policy.start(history[-1], config)
            while (nodes := search.next_nodes()) is not None:
                expected, got = (forward_feeds(draft, [cache.feed(search.pool, nodes)], columns)[0]
                                 for cache in (dynamic, static))
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
                dynamic.record_feed(search.pool, nodes)
                static.record_feed(search.pool, nodes)
                search.add_expansion(nodes, torch.log_softmax(expected, -1))
            tree = search.result().tree
            # The target accepts the path to any node, then adds a token of its own: the draft keeps the path's fed
            # nodes, wherever they sit in the cache.
            bonus = int(torch.randint(0, 64, (1,), generator=generator))
            history = history + tree.path_tokens(walked % tree.num_nodes).tolist() + [bonus]
        assert static.cache.get_seq_length() == dynamic.cache.get_seq_length()


@given(
    arch=st.sampled_from(STATIC_ARCHITECTURES),
    seed=st.integers(0, 2**16),
    noise=st.sampled_from([0.0, 0.05, 0.5]),
    prompt_length=st.integers(1, 12),
    max_new_tokens=st.integers(1, 24),
    search=st.sampled_from(["rounds", "specexec", "draft_ahead"]),
    knobs=knobs,
)
def test_greedy_over_the_static_cache_equals_plain_greedy(
    arch, seed, noise, prompt_length, max_new_tokens, search, knobs
):
    """The output is plain greedy's whatever the draft proposes; the steps (the trees' sizes, what the target accepts)
    are the dynamic cache's, since the draft's logits are the same (each call learning from scratch)."""
    target = tiny_model(arch, seed=seed, dtype=torch.float32)
    draft = perturbed_copy(target, noise, seed=seed + 1)
    ids = torch.randint(0, 64, (1, prompt_length), generator=torch.Generator().manual_seed(seed))
    expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    policy = {"tree_search": "rounds"} if search == "rounds" else {"draft_ahead": search == "draft_ahead"}
    steps = {}
    for static in (False, True):
        stats = SpecExecStats()
        static_feeds = mock.patch.object(
            draft_graphs.StaticDraftCache, "logits", autospec=True, side_effect=draft_graphs.StaticDraftCache.logits
        )
        with small_buckets(), static_feeds as spy:
            got = target.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, speculator="specexec",
                specexec_stats=stats, learnt_state=LearntState(), draft_graphs="on" if static else "off", **policy,
                **knobs,
            )
        assert got.tolist() == expected.tolist()
        # The draft ran over the static cache exactly when asked to (a call whose one token needs no tree runs none).
        assert spy.called == (static and stats.draft_forwards > 0)
        steps[static] = [(step.tree_size, step.path_length) for step in stats.steps]
    if search != "draft_ahead":  # drafting ahead grows while the target verifies: its trees follow the clock
        assert steps[True] == steps[False]


def test_sampling_over_the_static_cache_follows_the_targets_distribution():
    settings = {"temperature": 0.5}
    target = tiny_model("llama", seed=11, vocab_size=VOCAB, sharpness=3.0)
    draft = perturbed_copy(target, 0.3, seed=12)
    distribution = exact_distribution(target, processors(settings))
    torch.manual_seed(2024)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(1000):
        out = target.generate(
            PROMPT, do_sample=True, max_new_tokens=2, top_k=None, top_p=None, **settings, assistant_model=draft,
            speculator="specexec", budget=6, max_branch=3, tree_search="rounds", sampled_children=True,
            draft_graphs="on",
        )
        outcome = tuple(out[0, PROMPT.shape[1] :].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
    assert chi_square_p(counts, distribution) > 1e-3


def test_the_static_path_refuses_what_it_cannot_hold_before_allocating():
    sliding = tiny_model("mistral_sliding", dtype=torch.float32)
    assert "sliding_attention layers" in static_path_refusal(sliding)
    with pytest.raises(ValueError, match="draft_graphs='on' needs a static draft cache.*sliding_attention"):
        uses_draft_graphs("on", sliding, rounds_search=True)
    assert not uses_draft_graphs("auto", sliding, rounds_search=True)  # the documented fallback: the dynamic cache
    with pytest.raises(ValueError, match="draft_graphs must be one of"):
        uses_draft_graphs("yes", sliding, rounds_search=True)
    hooked = tiny_model("llama", dtype=torch.float32)
    hooked.model.layers[0]._hf_hook = object()  # as accelerate's offloading leaves it
    assert "hooks move its weights in" in static_path_refusal(hooked)
    llama = tiny_model("llama", dtype=torch.float32)
    assert not uses_draft_graphs("auto", llama, rounds_search=True)  # a CPU draft: off unless asked
    assert uses_draft_graphs("on", llama, rounds_search=False)

    cache = StaticDraftCache(llama, max_capacity=16)
    with pytest.raises(ValueError, match="more than its max_capacity of 16"):
        cache.logits(Feed(cache, torch.arange(18), torch.arange(18), None, 1))
    assert cache.capacity == 0 and cache.length == 0  # nothing allocated


def test_a_finished_drafters_static_cache_serves_the_next_drafter():
    """generate() builds a drafter per call: the next one takes over the last one's buffers (and on CUDA its graphs),
    emptied, and grows the trees a dynamic cache grows."""
    draft = tiny_model("llama", seed=3, dtype=torch.float32)
    config = SpecExecConfig(budget=12, expand_per_forward=4)
    histories = torch.randint(0, 64, (2, 1, 9), generator=torch.Generator().manual_seed(3))
    first = SpecExecCandidateGenerator(draft, config, search=RoundPolicy(rounds=3), draft_graphs="on")
    first.grow_tree(histories[0])
    cache = first.cache
    other = SpecExecCandidateGenerator(draft, config, search=RoundPolicy(rounds=3), draft_graphs="on")
    assert other.cache is not cache  # a cache serves one drafter at a time
    del first
    gc.collect()
    second = SpecExecCandidateGenerator(draft, config, search=RoundPolicy(rounds=3), draft_graphs="on")
    assert second.cache is cache and cache.get_seq_length() == 0
    dynamic = SpecExecCandidateGenerator(draft, config, search=RoundPolicy(rounds=3), draft_graphs="off")
    got, expected = second.grow_tree(histories[1]), dynamic.grow_tree(histories[1])
    assert torch.equal(got.tree.tokens, expected.tree.tokens)
    torch.testing.assert_close(got.tree.logprobs, expected.tree.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_graph_replays_equal_eager_forwards_without_a_host_sync():
    target = tiny_model("llama", seed=0, num_layers=2, dtype=torch.float32).cuda()
    draft = perturbed_copy(target, 0.05, seed=1).cuda()
    config = SpecExecConfig(budget=64, expand_per_forward=8)
    graphed = SpecExecCandidateGenerator(draft, config, search=RoundPolicy(rounds=5, extensions=0))
    assert isinstance(graphed.cache, StaticDraftCache) and graphed.cache.capture  # "auto" on a CUDA draft
    eager = SpecExecCandidateGenerator(draft, config, search=RoundPolicy(rounds=5, extensions=0), draft_graphs="on")
    eager.draft_cache.cache.capture = False
    history = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0)).cuda()
    replays = []
    logits = StaticDraftCache.logits

    def checked_logits(cache, feed, scored_columns=False):
        captured = (draft_graphs.width_bucket(feed.tokens.numel()), scored_columns) in cache._graphs
        if cache.capture and captured:  # a replay: no host sync may happen in it
            torch.cuda.set_sync_debug_mode("error")
            replays.append(feed.tokens.numel())
        try:
            return logits(cache, feed, scored_columns)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    with mock.patch.object(StaticDraftCache, "logits", checked_logits):
        for _ in range(3):
            with HostReadCounter() as counter:
                got = graphed.grow_tree(history)
            expected = eager.grow_tree(history)
            assert torch.equal(got.tree.tokens, expected.tree.tokens)
            torch.testing.assert_close(got.tree.logprobs, expected.tree.logprobs, rtol=1e-5, atol=1e-5)
            assert counter.total <= 3, counter.sites
            history = torch.cat([history, got.tree.tokens[got.tree.best_path()[:2]][None]], dim=-1)
    assert len(replays) >= 8, replays


@pytest.mark.parametrize("device", DEVICES)
def test_uploads_reach_the_device_without_a_sync(device):
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # a copy from pageable memory would raise here
    try:
        uploaded = upload([3, 1, 2], torch.long, device)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert uploaded.device.type == device and uploaded.tolist() == [3, 1, 2]
