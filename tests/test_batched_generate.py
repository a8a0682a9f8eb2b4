"""A batch of prompts through SpecExec's generate(): each row as the target alone gives it, the batch as plain
batched generate() returns it (left padding in, finished rows padded out, streamed by columns), one target forward
per step; the per-row cache compaction, the memory refusal and the bad-input errors."""

from __future__ import annotations

import pytest
import torch
from conftest import chi_square_p, perturbed_copy, tiny_model, tiny_tokenizer
from hypothesis import given
from hypothesis import strategies as st
from test_sampling import NEW_TOKENS, PROMPT, SAMPLES, VOCAB, exact_distribution, processors
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, pipeline
from transformers.generation.streamers import BaseStreamer

import specexec_hf  # noqa: F401  (installs speculator="specexec")
from specexec_hf import SpecExecStats
from specexec_hf.core.batch_packing import kept_feed_slots, pack_rows
from specexec_hf.hf import request as request_module
from specexec_hf.hf.kv import compact_cache, compact_rows

PAD = 0
BATCH_ARCHITECTURES = ["llama", "mistral_sliding", "qwen2_hybrid", "gemma2"]


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of ``[1, n]`` prompts, left-padded as a tokenizer pads them for
    decoder-only generation."""
    width = max(prompt.shape[1] for prompt in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :] = prompt[0]
        mask[row, width - prompt.shape[1] :] = 1
    return ids, mask


def random_prompts(seed: int, lengths: list[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 64, (1, length), generator=generator) for length in lengths]


def specexec(target, draft, ids, mask, **kwargs):
    return target.generate(
        ids, attention_mask=mask, do_sample=False, assistant_model=draft, speculator="specexec", **kwargs
    )


@st.composite
def batch_cases(draw: st.DrawFn) -> tuple:
    """A tiny target of a batch architecture, a draft near it or far from it, a batch of prompts of random lengths
    (left-padded: ``ids``, ``mask``) and the generation settings, maybe with an EOS the first row emits."""
    arch, seed = draw(st.sampled_from(BATCH_ARCHITECTURES)), draw(st.integers(0, 2**16))
    target = tiny_model(arch, seed=seed)
    draft = perturbed_copy(target, draw(st.sampled_from([0.0, 0.05, 2.0])), seed=seed + 1)
    prompts = random_prompts(seed, draw(st.lists(st.integers(1, 9), min_size=1, max_size=5)))
    ids, mask = left_padded(prompts)
    settings = {"max_new_tokens": draw(st.integers(1, 16)), "pad_token_id": PAD}
    eos_at = draw(st.none() | st.integers(0, 12))
    if eos_at is not None:  # a token the first row emits at step eos_at: that row ends there, others maybe too
        free_run = target.generate(prompts[0], max_new_tokens=eos_at + 1, do_sample=False)
        settings["eos_token_id"] = int(free_run[0, -1])
    return target, draft, prompts, ids, mask, settings


def assert_each_row_is_what_the_target_gives_it_alone(target, prompts, ids, mask, settings, got):
    """``got`` is what batched plain generate() returns, each row what its prompt alone gives, then padding."""
    assert got.tolist() == target.generate(ids, attention_mask=mask, do_sample=False, **settings).tolist()
    for row, prompt in enumerate(prompts):
        alone = target.generate(prompt, do_sample=False, **settings)[0, prompt.shape[1] :].tolist()
        new = got[row, ids.shape[1] :].tolist()
        assert new[: len(alone)] == alone
        assert all(token == PAD for token in new[len(alone) :])


@given(
    case=batch_cases(), budget=st.integers(1, 24), max_branch=st.integers(1, 4),
    step_budget=st.none() | st.integers(1, 40),
)
def test_each_row_is_what_the_target_gives_it_alone(case, budget, max_branch, step_budget):
    target, draft, prompts, ids, mask, settings = case
    stats = SpecExecStats()
    got = specexec(
        target, draft, ids, mask, budget=budget, max_branch=max_branch, step_budget=step_budget,
        specexec_stats=stats, **settings,
    )
    assert_each_row_is_what_the_target_gives_it_alone(target, prompts, ids, mask, settings, got)
    if len(prompts) > 1:  # one target forward per step for the whole batch, within the shared budget
        cap = len(prompts) * budget if step_budget is None else min(step_budget, len(prompts) * budget)
        assert all(step.tree_size <= cap + len(prompts) for step in stats.steps)


def test_rows_share_one_target_forward_per_step(llama_pair):
    target, _ = llama_pair
    draft = perturbed_copy(target, 0.0, seed=1)  # agrees with the target: every tree accepts
    ids, mask = left_padded(random_prompts(5, [3, 7, 5, 2]))
    calls = []
    hook = target.model.register_forward_hook(lambda module, args, kwargs_out: calls.append(1))
    stats = SpecExecStats()
    try:
        specexec(target, draft, ids, mask, max_new_tokens=10, budget=8, specexec_stats=stats)
    finally:
        hook.remove()
    assert len(calls) == stats.target_forwards
    assert stats.new_tokens == 4 * 10
    assert stats.tokens_per_target_forward > 4 * 2  # more than one token per row and forward


class StopAfterToken(StoppingCriteria):
    """A criterion without ``eos_token_id``: plain decoding goes on decoding a row it stopped."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@given(
    seed=st.integers(0, 2**16), stop_at=st.integers(0, 8), budget=st.integers(1, 16), noise=st.sampled_from([0.0, 0.05])
)
def test_a_criterion_without_eos_leaves_stopped_rows_decoding_like_plain_generate(seed, stop_at, budget, noise):
    target = tiny_model("qwen2", seed=seed)
    draft = perturbed_copy(target, noise, seed=seed + 1)  # an exact copy: long paths, stops inside them
    prompts = random_prompts(seed, [4, 6, 2])
    ids, mask = left_padded(prompts)
    stop_token = int(target.generate(prompts[1], max_new_tokens=stop_at + 1, do_sample=False)[0, -1])
    criteria = StoppingCriteriaList([StopAfterToken(stop_token)])
    settings = {"max_new_tokens": 14, "stopping_criteria": criteria}
    expected = target.generate(ids, attention_mask=mask, do_sample=False, **settings)
    assert specexec(target, draft, ids, mask, budget=budget, **settings).tolist() == expected.tolist()


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts: list[list] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


def test_the_streamer_gets_the_columns_plain_batched_generate_puts(llama_pair):
    target, draft = llama_pair
    prompts = random_prompts(9, [5, 2, 8])
    ids, mask = left_padded(prompts)
    eos = int(target.generate(prompts[1], max_new_tokens=3, do_sample=False)[0, -1])
    settings = {"max_new_tokens": 12, "eos_token_id": eos, "pad_token_id": PAD}
    expected, got = Recorder(), Recorder()
    target.generate(ids, attention_mask=mask, do_sample=False, streamer=expected, **settings)
    specexec(target, draft, ids, mask, budget=6, streamer=got, **settings)
    assert got.puts == expected.puts
    assert got.ended


def test_a_row_finishing_at_its_first_token_is_padded(llama_pair):
    target, draft = llama_pair
    prompts = random_prompts(2, [4, 6])
    ids, mask = left_padded(prompts)
    first = int(target.generate(prompts[0], max_new_tokens=1, do_sample=False)[0, -1])
    settings = {"max_new_tokens": 9, "eos_token_id": first, "pad_token_id": PAD}
    got = specexec(target, draft, ids, mask, budget=8, **settings)
    assert got.tolist() == target.generate(ids, attention_mask=mask, do_sample=False, **settings).tolist()
    assert got[0, ids.shape[1]] == first


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_a_pipeline_batch_matches_the_plain_pipeline(padding_side):
    """Right padding leaves masked tokens inside the prompts, which plain decoding keeps in its cache unseen."""
    target = tiny_model("llama", seed=4)
    draft = perturbed_copy(target, 0.05, seed=5)
    tokenizer = tiny_tokenizer()
    tokenizer.padding_side = padding_side
    texts = ["hello there", "good", "a longer prompt here"]
    generator = pipeline("text-generation", model=target, tokenizer=tokenizer)
    kwargs = {"batch_size": 3, "max_new_tokens": 8, "do_sample": False}
    expected = generator(texts, **kwargs)
    stats = SpecExecStats()
    got = generator(texts, **kwargs, assistant_model=draft, speculator="specexec", budget=6, specexec_stats=stats)
    assert got == expected
    assert stats.new_tokens == 3 * 8


def test_a_batch_too_large_for_memory_is_refused_naming_the_largest_that_fits(llama_pair, monkeypatch):
    target, draft = llama_pair
    ids, mask = left_padded(random_prompts(1, [6] * 5))
    one_row = {}

    def free_bytes(device):
        return one_row.get("bytes")

    monkeypatch.setattr(request_module, "_free_bytes", free_bytes)
    # Measure what one row needs with the check itself: the largest budget message names it.
    one_row["bytes"] = 10**12
    request_module.check_budget_fits(target, 6, 6 + 4, 8)  # fits
    width = target.config.hidden_size
    pairs = max((6 + 9) ** 2, 9 * (10 + 9))
    per_row = pairs * (1 + 4 + 4) + (6 + 9) * (16 * width + 4 * target.config.vocab_size)
    one_row["bytes"] = 2 * per_row + per_row // 2
    with pytest.raises(ValueError, match="A batch of 5 at budget=8 .* the largest batch that fits is about 2"):
        specexec(target, draft, ids, mask, max_new_tokens=4, budget=8)


def test_an_all_padding_row_is_refused_naming_it(llama_pair):
    target, draft = llama_pair
    ids, mask = left_padded(random_prompts(1, [3, 4, 2]))
    mask[1] = 0
    with pytest.raises(ValueError, match="Row 1 of the batch is all padding"):
        specexec(target, draft, ids, mask, max_new_tokens=4)


@pytest.mark.parametrize("setting", [{"draft_ahead": True}, {"output_scores": True, "return_dict_in_generate": True}])
def test_settings_a_batch_does_not_run_yet_are_refused_by_name(llama_pair, setting):
    target, draft = llama_pair
    ids, mask = left_padded(random_prompts(1, [3, 4]))
    with pytest.raises(ValueError, match="over a batch of prompts yet"):
        specexec(target, draft, ids, mask, max_new_tokens=4, **setting)


def test_a_step_budget_caps_one_sequences_tree(llama_pair):
    target, draft = llama_pair
    stats = SpecExecStats()
    got = target.generate(
        PROMPT, max_new_tokens=8, do_sample=False, assistant_model=draft, speculator="specexec", budget=16,
        step_budget=3, specexec_stats=stats,
    )
    assert got.tolist() == target.generate(PROMPT, max_new_tokens=8, do_sample=False).tolist()
    assert max(step.tree_size for step in stats.steps) == 3 + 1


def test_a_step_budget_that_is_not_a_positive_integer_is_refused(llama_pair):
    target, draft = llama_pair
    ids, mask = left_padded(random_prompts(1, [3, 4]))
    with pytest.raises(ValueError, match="step_budget must be a positive integer"):
        specexec(target, draft, ids, mask, max_new_tokens=4, step_budget=0)


@pytest.mark.parametrize("settings, knobs", [
    pytest.param({"temperature": 0.5}, {}, id="temperature"),
    pytest.param({"temperature": 1.2, "top_p": 0.7}, {}, id="top_p"),
    # drawn children verified by rejection sampling, the rows' trees cut to 4 nodes in all by their forecasts
    pytest.param({"temperature": 0.5}, {"sampled_children": True, "step_budget": 4}, id="drawn_children_step_budget"),
])
def test_each_rows_samples_follow_the_targets_distribution(settings, knobs):
    """Row 0 continues its own prompt, row 1 PROMPT; both left-padded, row 2's prompt being longer."""
    target = tiny_model("llama", seed=11, vocab_size=VOCAB, sharpness=3.0)
    draft = perturbed_copy(target, 0.3, seed=12)
    own_prompt = torch.cat([torch.tensor([[3]]), PROMPT], dim=-1)
    ids, mask = left_padded([own_prompt, PROMPT, torch.tensor([[4, 1, 1, 3, 0, 2]])])
    distributions = [
        exact_distribution_after(target, processors(settings), own_prompt),
        exact_distribution(target, processors(settings)),
    ]
    torch.manual_seed(2024)
    counts: list[dict] = [{}, {}]
    for _ in range(SAMPLES):
        out = target.generate(
            ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
            **{"top_k": None, "top_p": None, **settings}, assistant_model=draft, speculator="specexec", budget=6,
            max_branch=3, **knobs,
        )
        for row in range(2):
            outcome = tuple(out[row, ids.shape[1] :].tolist())
            counts[row][outcome] = counts[row].get(outcome, 0) + 1
    for row_counts, distribution in zip(counts, distributions):
        assert chi_square_p(row_counts, distribution) > 1e-3
    assert chi_square_p(counts[1], exact_distribution(target, LogitsProcessorList())) < 1e-3


def exact_distribution_after(model, warpers: LogitsProcessorList, prompt: torch.Tensor) -> dict:
    """:func:`test_sampling.exact_distribution` after another prompt."""
    import test_sampling

    saved, test_sampling.PROMPT = test_sampling.PROMPT, prompt
    try:
        return exact_distribution(model, warpers)
    finally:
        test_sampling.PROMPT = saved


@given(
    prefixes=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    data=st.data(),
)
def test_compact_rows_compacts_each_row_as_compact_cache_compacts_it_alone(prefixes, data):
    width = max(prefixes) + 5
    keys = torch.randn(len(prefixes), 2, width, 3, dtype=torch.float64)
    slots = [
        torch.tensor(sorted(data.draw(st.sets(st.integers(prefix, width - 1), max_size=width - prefix))),
                     dtype=torch.long)
        for prefix in prefixes
    ]
    shared = DynamicCache()
    shared.update(keys.clone(), -keys.clone(), 0)
    compact_rows(shared, prefixes, slots)
    for row, (prefix, row_slots) in enumerate(zip(prefixes, slots)):
        alone = DynamicCache()
        alone.update(keys[row : row + 1].clone(), -keys[row : row + 1].clone(), 0)
        compact_cache(alone, prefix, row_slots)
        kept = prefix + row_slots.numel()
        assert torch.equal(shared.layers[0].keys[row, :, :kept], alone.layers[0].keys[0])
        assert torch.equal(shared.layers[0].values[row, :, :kept], alone.layers[0].values[0])
    assert shared.get_seq_length() == max(prefix + s.numel() for prefix, s in zip(prefixes, slots))


@given(cached=st.lists(st.integers(0, 5), min_size=1, max_size=4), fed=st.data())
def test_packed_rows_see_their_own_keys_only(cached, fed):
    width = max(cached) + fed.draw(st.integers(0, 2))
    counts = [fed.draw(st.integers(1, 4)) for _ in cached]
    patterns = [torch.rand(count, own + count) < 0.5 for own, count in zip(cached, counts)]
    packed = pack_rows(
        [torch.arange(count) + 1 for count in counts], [torch.arange(count) for count in counts],
        [torch.arange(count) for count in counts], patterns, cached, width,
    )
    longest = max(counts)
    for row, (own, count, pattern) in enumerate(zip(cached, counts, patterns)):
        visible = packed.visible[row]
        assert torch.equal(visible[:count, :own], pattern[:, :own])
        assert not visible[:count, own:width].any()  # another row's junk slots, never seen
        assert torch.equal(visible[:count, width : width + count], pattern[:, own:])
        assert not visible[:count, width + count :].any()
        for padding in range(count, longest):  # a padding query sees itself alone
            assert visible[padding].nonzero().flatten().tolist() == [width + padding]
    assert kept_feed_slots(width, 2, [1, 3]).tolist() == [width, width + 1, width + 2, width + 4]
