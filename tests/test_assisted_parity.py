"""transformers' own assisted-decoding checks, run with ``speculator="specexec"``.

transformers' ``GenerationTesterMixin`` (tests/generation/test_utils.py) checks assisted decoding on batch-1 tester
inputs: ``test_assisted_decoding_matches_greedy_search`` (a random-weight draft, and the model as its own draft:
the same sequences as greedy search, or scores that agree where they part; scores, logits, hidden states and
attentions shaped as plain decoding returns them) and ``test_assisted_decoding_sample`` (sampling with the model as
its own draft, outputs shaped the same). This module reproduces those checks, stricter where it costs nothing:
scores, raw logits and hidden states must equal plain decoding's (and attention weights, where the attention
implementation returns them), and the returned cache must hold every token but the last.

The inputs are built the way transformers' model testers build them: 7 random tokens, and an attention mask that is
either ``torch.tril(torch.ones_like(input_ids))`` (``CausalLMModelTester``: only the first token kept) or random bits
with the last token kept (the older testers' ``random_attention_mask``), ``token_type_ids`` where the model takes
them, and the greedy test's logits processors (``bad_words_ids``, ``repetition_penalty``, ``remove_invalid_values``).

The models are the architecture matrix's tiny ones (``architectures.build_tiny``). A few run in the normal suite
(full, sliding, hybrid and chunked attention, learned positions with token types); every registered causal LM that
SpecExec does not refuse runs under ``-m architectures`` (deselected by default).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from architectures import Skip, build_tiny, causal_lm_model_types
from tolerances import assert_close_across_kernels, model_bound

from specexec_hf.hf.compat import UnsupportedModelError, check_supported

SEQ_LENGTH = 7
MAX_NEW_TOKENS = 4
MASK_STYLES = ("tril", "random")
# Full, sliding, hybrid (gemma2, gpt_oss) and chunked (llama4_text) attention; token types (gpt2, and ctrl, whose
# generate() drops them); learned positions (gpt2, opt).
FAST = ["llama", "gpt2", "ctrl", "opt", "mistral", "gemma2", "gpt_oss", "llama4_text", "qwen3"]


def inputs_like_testers(model, style: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Batch-1 inputs as transformers' model testers build them (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config.get_text_config(decoder=True)
    input_ids = torch.randint(config.vocab_size, (1, SEQ_LENGTH), generator=generator)
    if style == "tril":
        attention_mask = torch.tril(torch.ones_like(input_ids))
    else:
        attention_mask = torch.randint(2, (1, SEQ_LENGTH), generator=generator)
        attention_mask[:, -1] = 1
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "token_type_ids" in inspect.signature(model.forward).parameters:
        type_vocab = getattr(config, "type_vocab_size", None) or 2
        inputs["token_type_ids"] = torch.randint(type_vocab, (1, SEQ_LENGTH), generator=generator)
    return inputs


def generation_kwargs(model, do_sample: bool) -> dict:
    """What the transformers tests pass: no EOS, 4 new tokens, every output, the cache on."""
    kwargs = {
        "eos_token_id": -1,
        "max_new_tokens": MAX_NEW_TOKENS,
        "num_beams": 1,
        "do_sample": do_sample,
        "output_scores": True,
        "output_logits": True,
        "output_hidden_states": True,
        "output_attentions": model.config._attn_implementation == "eager",
        "return_dict_in_generate": True,
        "use_cache": True,
    }
    if not do_sample:
        kwargs.update({"bad_words_ids": [[1, 0]], "repetition_penalty": 1.2, "remove_invalid_values": True})
    return kwargs


def random_draft(model, seed: int = 7):
    """A freshly initialised model of the same class and config: its guesses are almost never accepted."""
    torch.manual_seed(seed)
    draft = type(model)._from_config(model.config, attn_implementation=model.config._attn_implementation)
    return draft.float().eval()


def tiny_or_skip(model_type: str):
    """The matrix's tiny model of ``model_type``; skips types outside the matrix and ones SpecExec refuses."""
    try:
        target = build_tiny(model_type).target
    except Skip as skip:
        pytest.skip(f"{model_type}: {skip}")
    try:
        check_supported(target, "target")
    except UnsupportedModelError as error:
        pytest.skip(f"{model_type}: refused by SpecExec ({error})")
    return target


def assert_similar(plain, specexec, bound: float) -> None:
    """transformers' ``_check_similar_generate_outputs``: the same sequences, or the same scores (within ``bound``,
    see ``tolerances``) where they part."""
    matches = plain.sequences == specexec.sequences
    if bool(matches.all()):
        return
    first = int(matches[0].int().argmin()) - (plain.sequences.shape[1] - len(plain.scores))
    assert_close_across_kernels(specexec.scores[first], plain.scores[first], bound)


def assert_same_structure(plain, specexec, bound: float | None) -> None:
    """Scores, logits, hidden states and attentions: one entry per new token, each shaped as plain decoding's (and
    equal to it within ``bound``, unless None); the cache holds every token but the last, on every layer."""
    for name in ("scores", "logits", "hidden_states", "attentions"):
        expected, got = getattr(plain, name), getattr(specexec, name)
        assert (got is None) == (expected is None), name
        if expected is None:
            continue
        assert len(got) == len(expected) == MAX_NEW_TOKENS, (name, len(got), len(expected))
        for step, (got_step, expected_step) in enumerate(zip(got, expected, strict=True)):
            got_layers = got_step if isinstance(got_step, tuple) else (got_step,)
            expected_layers = expected_step if isinstance(expected_step, tuple) else (expected_step,)
            assert len(got_layers) == len(expected_layers), (name, step)
            for got_layer, expected_layer in zip(got_layers, expected_layers, strict=True):
                assert got_layer.shape == expected_layer.shape, (name, step, got_layer.shape, expected_layer.shape)
                if bound is not None:
                    assert_close_across_kernels(got_layer, expected_layer, bound, msg=f"{name}, step {step}")
    cache = specexec.past_key_values
    lengths = {cache.get_seq_length(layer) for layer in range(len(cache.layers))}
    assert lengths == {specexec.sequences.shape[1] - 1}, lengths


def check_matches_greedy_search(model_type: str, assistant: str, style: str) -> None:
    """``test_assisted_decoding_matches_greedy_search`` with ``speculator="specexec"``."""
    model = tiny_or_skip(model_type)
    inputs = inputs_like_testers(model, style)
    kwargs = generation_kwargs(model, do_sample=False)
    plain = model.generate(**inputs, **kwargs)
    draft = random_draft(model) if assistant == "random" else model
    specexec = model.generate(**inputs, **kwargs, assistant_model=draft, speculator="specexec")
    bound = model_bound(model, keys=plain.sequences.shape[-1])
    assert_similar(plain, specexec, bound)
    assert_same_structure(plain, specexec, bound if bool((plain.sequences == specexec.sequences).all()) else None)


def check_sample(model_type: str, style: str) -> None:
    """``test_assisted_decoding_sample`` with ``speculator="specexec"``: the model as its own draft, sampling."""
    model = tiny_or_skip(model_type)
    inputs = inputs_like_testers(model, style)
    kwargs = generation_kwargs(model, do_sample=True)
    torch.manual_seed(0)
    plain = model.generate(**inputs, **kwargs)
    torch.manual_seed(0)
    specexec = model.generate(**inputs, **kwargs, assistant_model=model, speculator="specexec")
    assert specexec.sequences.shape == plain.sequences.shape
    assert torch.equal(specexec.sequences[:, :SEQ_LENGTH], inputs["input_ids"])
    assert_same_structure(plain, specexec, bound=None)


# --- fast subset -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", MASK_STYLES)
@pytest.mark.parametrize("assistant", ["random", "same"])
@pytest.mark.parametrize("model_type", FAST)
def test_assisted_decoding_matches_greedy_search(model_type, assistant, style):
    check_matches_greedy_search(model_type, assistant, style)


@pytest.mark.parametrize("style", MASK_STYLES)
@pytest.mark.parametrize("model_type", FAST)
def test_assisted_decoding_sample(model_type, style):
    check_sample(model_type, style)


# --- every architecture (-m architectures) -----------------------------------------------------------------------


@pytest.mark.architectures
@pytest.mark.parametrize("model_type", causal_lm_model_types())
def test_assisted_parity_matrix(model_type):
    """Every registered causal LM SpecExec does not refuse: both greedy checks and the sampling check, both masks."""
    try:
        for style in MASK_STYLES:
            for assistant in ("random", "same"):
                check_matches_greedy_search(model_type, assistant, style)
            check_sample(model_type, style)
    except UnsupportedModelError as refusal:  # only the masked-token probe refuses here: said why, not diverged
        pytest.skip(f"{model_type}: refused with masked tokens ({refusal})")
