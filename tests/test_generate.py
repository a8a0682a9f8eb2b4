"""SpecExec inside transformers' generate(): token-identical to plain greedy generate()."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ARCHITECTURES, DEVICES, on_device, perturbed_copy, tiny_model, tiny_tokenizer
from hypothesis import given
from hypothesis import strategies as st
from tolerances import assert_close_across_kernels, model_bound
from transformers import StoppingCriteria, StoppingCriteriaList

import specexec_hf
from specexec_hf import SpecExecStats

knobs = st.fixed_dictionaries(
    {
        "budget": st.integers(1, 32),
        "max_depth": st.integers(1, 10),
        "max_branch": st.integers(1, 6),
        "expand_per_forward": st.integers(2, 12),
        "draft_ahead": st.booleans(),
    }
)


def prompt(seed: int, length: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("device", DEVICES)
@given(
    arch=st.sampled_from(sorted(ARCHITECTURES)),
    seed=st.integers(0, 2**16),
    noise=st.sampled_from([0.0, 0.02, 0.2, 2.0]),
    prompt_length=st.integers(1, 12),
    max_new_tokens=st.integers(1, 30),
    knobs=knobs,
    entry=st.sampled_from(["speculator", "custom_generate"]),
)
def test_greedy_equals_plain_generate(device, arch, seed, noise, prompt_length, max_new_tokens, knobs, entry):
    target = tiny_model(arch, seed=seed)
    draft = perturbed_copy(target, noise, seed=seed + 1)
    target, draft, ids = on_device(device, target, draft, prompt(seed, prompt_length))
    expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    stats = SpecExecStats()
    route = {"speculator": "specexec"} if entry == "speculator" else {"custom_generate": specexec_hf.generate}
    got = target.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, specexec_stats=stats, **route,
        **knobs,
    )
    assert got.tolist() == expected.tolist()
    assert stats.new_tokens == max_new_tokens
    assert all(step.tree_size <= knobs["budget"] + 1 for step in stats.steps)


@pytest.mark.parametrize("device", DEVICES)
@given(seed=st.integers(0, 2**16), eos_at=st.integers(0, 15), knobs=knobs, noise=st.sampled_from([0.0, 0.05]))
def test_eos_inside_the_tree_stops_like_plain_generate(device, seed, eos_at, knobs, noise):
    target = tiny_model("llama", seed=seed)
    target, draft, ids = on_device(device, target, perturbed_copy(target, noise, seed=seed + 1), prompt(seed, 5))
    free_run = target.generate(ids, max_new_tokens=16, do_sample=False)
    # Two EOS ids, one of which the target emits at step `eos_at`: generation must end right there.
    eos = [int(free_run[0, 5 + eos_at]), 63]
    expected = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    got = target.generate(
        ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, assistant_model=draft, speculator="specexec",
        **knobs,
    )
    assert got.tolist() == expected.tolist()
    assert int(got[0, -1]) in eos


@given(seed=st.integers(0, 2**16), max_length=st.integers(8, 30), knobs=knobs)
def test_max_length_is_never_overshot(seed, max_length, knobs):
    target = tiny_model("qwen2", seed=seed)
    ids = prompt(seed, 7)
    expected = target.generate(ids, max_length=max_length, do_sample=False)
    got = target.generate(
        ids, max_length=max_length, do_sample=False, assistant_model=target, speculator="specexec", **knobs
    )
    assert got.tolist() == expected.tolist()
    assert got.shape[1] == max_length


@given(seed=st.integers(0, 2**16), stop_length=st.integers(1, 3), knobs=knobs)
def test_stop_strings_match_plain_generate(seed, stop_length, knobs):
    target = tiny_model("llama", seed=seed)
    tokenizer = tiny_tokenizer()
    ids = prompt(seed, 4, vocab=63)
    free_run = target.generate(ids, max_new_tokens=20, do_sample=False)
    stop = tokenizer.decode(free_run[0, 12 : 12 + stop_length])
    kwargs = dict(max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    expected = target.generate(ids, **kwargs)
    draft = perturbed_copy(target, 0.02, 1)
    got = target.generate(ids, **kwargs, assistant_model=draft, speculator="specexec", **knobs)
    assert got.tolist() == expected.tolist()


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@given(seed=st.integers(0, 2**16), stop_at=st.integers(0, 15), knobs=knobs)
def test_custom_stopping_criteria(seed, stop_at, knobs):
    target = tiny_model("mistral", seed=seed)
    ids = prompt(seed, 6)
    stop_token = int(target.generate(ids, max_new_tokens=16, do_sample=False)[0, 6 + stop_at])
    criteria = StoppingCriteriaList([StopAfterToken(stop_token)])
    expected = target.generate(ids, max_new_tokens=25, do_sample=False, stopping_criteria=criteria)
    got = target.generate(
        ids, max_new_tokens=25, do_sample=False, stopping_criteria=criteria, assistant_model=target,
        speculator="specexec", **knobs,
    )
    assert got.tolist() == expected.tolist()


processor_settings = st.sampled_from(
    [
        {"repetition_penalty": 1.8},
        {"no_repeat_ngram_size": 2},
        {"min_new_tokens": 10, "eos_token_id": 5},
        {"suppress_tokens": [1, 2, 3, 4, 5, 6, 7, 8]},
        {"bad_words_ids": [[9], [10, 11], [12, 13, 14]]},
        {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "sequence_bias": {(4,): -5.0}},
    ]
)


@pytest.mark.parametrize("device", DEVICES)
@given(seed=st.integers(0, 2**16), settings=processor_settings, knobs=knobs)
def test_logits_processors_see_each_nodes_own_path(device, seed, settings, knobs):
    target = tiny_model("qwen3", seed=seed)
    target, draft, ids = on_device(device, target, perturbed_copy(target, 0.02, seed=seed + 1), prompt(seed, 5))
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, **settings)
    got = target.generate(
        ids, max_new_tokens=24, do_sample=False, assistant_model=draft, speculator="specexec", **settings, **knobs
    )
    assert got.tolist() == expected.tolist()


@given(seed=st.integers(0, 2**16), knobs=knobs)
def test_draft_equal_to_target_accepts_the_whole_top1_chain(seed, knobs):
    """With draft == target, each step accepts the tree's chain of top-1 children, then the bonus token."""
    target = tiny_model("llama", seed=seed)
    ids = prompt(seed, 5)
    chains = []
    original_grow = specexec_hf.SpecExecCandidateGenerator.grow_tree

    def recording_grow(self, input_ids, max_depth=None):
        result = original_grow(self, input_ids, max_depth)
        tree, node, length = result.tree, 0, 0
        while (children := tree.children(node)).numel():
            node = int(children[tree.logprobs[children].argmax()])
            length += 1
        chains.append(length)
        return result

    specexec_hf.SpecExecCandidateGenerator.grow_tree = recording_grow
    try:
        stats = SpecExecStats()
        target.generate(
            ids, max_new_tokens=40, do_sample=False, assistant_model=target, speculator="specexec",
            specexec_stats=stats, **knobs,
        )
    finally:
        specexec_hf.SpecExecCandidateGenerator.grow_tree = original_grow
    for step, chain in zip(stats.steps[:-1], chains):  # the last step may be cut by max_new_tokens
        assert step.accepted == chain + 1


@pytest.mark.parametrize("device", DEVICES)
def test_return_dict_scores_logits_and_stats(llama_pair, device):
    target, draft, ids = on_device(device, *copy.deepcopy(llama_pair), prompt(3, 6))
    kwargs = dict(
        max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    expected = target.generate(ids, **kwargs)
    got = target.generate(ids, **kwargs, assistant_model=draft, speculator="specexec", budget=8)
    assert got.sequences.tolist() == expected.sequences.tolist()
    assert len(got.scores) == len(got.logits) == 12
    for ours, theirs in zip(got.logits, expected.logits):
        assert_close_across_kernels(ours, theirs, model_bound(target, keys=got.sequences.shape[-1]))
    stats = got.specexec_stats
    assert stats.new_tokens == 12 and stats.target_forwards == len(stats.steps) >= 1
    assert stats.tokens_per_target_forward == 12 / stats.target_forwards
    assert got.past_key_values.get_seq_length() == got.sequences.shape[1] - 1


def test_streamer_receives_each_token_once_in_order(llama_pair):
    target, draft = llama_pair

    class Recorder:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    ids = prompt(4, 5)
    for route in ({"speculator": "specexec"}, {"custom_generate": specexec_hf.generate}):
        recorder = Recorder()
        out = target.generate(
            ids, max_new_tokens=20, do_sample=False, assistant_model=draft, streamer=recorder, **route
        )
        streamed = [token for chunk in recorder.chunks for token in chunk]
        assert streamed == out[0].tolist() and recorder.ended


def test_attention_mask_of_ones_is_accepted(llama_pair):
    target, draft = llama_pair
    ids = prompt(5, 6)
    mask = torch.ones_like(ids)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    got = target.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=False, assistant_model=draft, speculator="specexec"
    )
    assert got.tolist() == expected.tolist()


def test_plain_and_assisted_generate_untouched_by_the_patch(llama_pair):
    target, draft = llama_pair
    ids = prompt(6, 6)
    plain = target.generate(ids, max_new_tokens=10, do_sample=False)
    assisted = target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=draft)
    assert assisted.tolist() == plain.tolist()


@pytest.mark.parametrize("device", DEVICES)
@given(seed=st.integers(0, 2**16), prompt_length=st.integers(1, 10), padding=st.integers(1, 4),
       max_new_tokens=st.integers(1, 20))
def test_left_padded_prompt_equals_plain_generate(device, seed, prompt_length, padding, max_new_tokens):
    target = tiny_model("llama", seed=seed)
    draft = perturbed_copy(target, 0.2, seed=seed + 1)
    ids = torch.cat([torch.zeros(1, padding, dtype=torch.long), prompt(seed, prompt_length)], dim=-1)
    mask = torch.cat([torch.zeros(1, padding, dtype=torch.long), torch.ones(1, prompt_length, dtype=torch.long)], -1)
    target, draft, ids, mask = on_device(device, target, draft, ids, mask)
    kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    expected = target.generate(ids, **kwargs)
    assert target.generate(ids, assistant_model=draft, speculator="specexec", **kwargs).tolist() == expected.tolist()


@given(seed=st.integers(0, 2**16), prompt_length=st.integers(1, 10), max_new_tokens=st.integers(1, 20),
       budget=st.sampled_from([1, 4, 16]))
def test_token_type_ids_extend_like_plain_generate(seed, prompt_length, max_new_tokens, budget):
    """GPT-2 adds token-type embeddings: every tree node gets the prompt's last type, as generate() extends it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=None,
                        eos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    target = GPT2LMHeadModel(config).to(torch.float64).eval()
    ids = prompt(seed, prompt_length)
    types = torch.randint(0, 64, ids.shape, generator=torch.Generator().manual_seed(seed + 7))
    kwargs = dict(token_type_ids=types, max_new_tokens=max_new_tokens, do_sample=False)
    expected = target.generate(ids, **kwargs)
    got = target.generate(ids, assistant_model=target, speculator="specexec", budget=budget, **kwargs)
    assert got.tolist() == expected.tolist()


@given(
    arch=st.sampled_from(["llama", "qwen2_hybrid", "gemma2"]),
    seed=st.integers(0, 2**16),
    prompt_length=st.integers(1, 10),
    max_new_tokens=st.integers(1, 16),
    budget=st.sampled_from([1, 4, 16]),
    noise=st.sampled_from([0.0, 0.2]),
)
def test_hidden_states_and_attentions_equal_plain_generate(arch, seed, prompt_length, max_new_tokens, budget, noise):
    """Per new token, per layer: the prompt's (first token) or the fed token's hidden states, and attention rows
    over every key plain decoding has at that point (eager attention returns the weights)."""
    target = tiny_model(arch, seed=seed, attn_implementation="eager")
    draft = perturbed_copy(target, noise, seed=seed + 1)
    ids = prompt(seed, prompt_length)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                  output_hidden_states=True, output_attentions=True)
    expected = target.generate(ids, **kwargs)
    got = target.generate(ids, assistant_model=draft, speculator="specexec", budget=budget, **kwargs)
    assert got.sequences.tolist() == expected.sequences.tolist()
    bound = model_bound(target, keys=got.sequences.shape[-1])  # eager attention: float32 softmax rounding
    for ours, theirs in [(got.hidden_states, expected.hidden_states), (got.attentions, expected.attentions)]:
        assert len(ours) == len(theirs) == max_new_tokens
        for step_ours, step_theirs in zip(ours, theirs):
            assert len(step_ours) == len(step_theirs)
            for tensor_ours, tensor_theirs in zip(step_ours, step_theirs):
                assert_close_across_kernels(tensor_ours, tensor_theirs, bound)
