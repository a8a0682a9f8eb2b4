"""Attention masks with zeros anywhere (holes, right padding, transformers' testers' ``tril`` masks): SpecExec keeps
the masked tokens in the cache, hides them from every query and places each token where ``generate()`` does, so the
output is plain ``generate()``'s, for every architecture in ``ARCHITECTURES`` (sliding and hybrid ones included).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import ARCHITECTURES, chi_square_p, perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from tolerances import assert_close_across_kernels, model_bound

import specexec_hf  # noqa: F401  (installs speculator="specexec")


def _mask(style: str, length: int, seed: int) -> torch.Tensor:
    """``[1, length]`` attention mask: random bits (leading zeros are left padding), a tester's ``tril`` of ones (only
    the first token kept), right padding, a hole in the middle, or every fourth token masked (sparse)."""
    if style == "random":
        mask = (torch.rand(1, length, generator=torch.Generator().manual_seed(seed)) > 0.4).long()
        mask[0, torch.randint(length, (1,), generator=torch.Generator().manual_seed(seed + 1))] = 1
        return mask
    if style == "tril":
        return torch.tril(torch.ones(1, length, dtype=torch.long))
    mask = torch.ones(1, length, dtype=torch.long)
    if style == "sparse":
        mask[0, 2::4] = 0
    elif style == "right_padding":
        mask[0, length // 2 + 1 :] = 0
    else:
        mask[0, 1 : 1 + length // 2] = 0
    return mask


def _prompt(seed: int, length: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def _leaves_a_query_blind(model, mask: torch.Tensor) -> bool:
    """Whether a masked prompt token (after the left padding) has no unmasked token in some window or chunk."""
    from specexec_hf.hf.attention_spans import attention_spans

    attended = mask[0].bool()
    attended = attended[int((~attended).cumprod(0).sum()) :]
    return any(bool(span.sees_no_key(attended).any()) for span in attention_spans(model.config).values())


@given(
    arch=st.sampled_from(sorted(ARCHITECTURES)),
    attention=st.sampled_from(["sdpa", "eager"]),
    style=st.sampled_from(["random", "tril", "right_padding", "hole"]),
    seed=st.integers(0, 2**16),
    prompt_length=st.integers(2, 14),
    max_new_tokens=st.integers(1, 16),
    budget=st.sampled_from([1, 4, 16]),
)
def test_masks_with_holes_equal_plain_generate(arch, attention, style, seed, prompt_length, max_new_tokens, budget):
    target = tiny_model(arch, seed=seed, attn_implementation=attention)
    draft = perturbed_copy(target, 0.2, seed=seed + 1)
    ids, mask = _prompt(seed, prompt_length), _mask(style, prompt_length, seed)
    kwargs = {"attention_mask": mask, "max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": 0,
              "return_dict_in_generate": True, "output_scores": True}
    if attention == "eager" and _leaves_a_query_blind(target, mask):
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            target.generate(ids, assistant_model=draft, speculator="specexec", budget=budget, **kwargs)
        assert torch.isnan(target.generate(ids, **kwargs).scores[0]).all()  # float64: plain decoding's NaNs
        return
    expected = target.generate(ids, **kwargs)
    if torch.isnan(expected.scores[0]).any():
        # float64 eager attention over left padding: plain decoding itself returns NaN scores, nothing to compare.
        assert attention == "eager" and not mask[0, 0]
        return
    got = target.generate(ids, assistant_model=draft, speculator="specexec", budget=budget, **kwargs)
    assert got.sequences.tolist() == expected.sequences.tolist()
    bound = model_bound(target, keys=got.sequences.shape[-1])
    for got_scores, expected_scores in zip(got.scores, expected.scores, strict=True):
        assert_close_across_kernels(got_scores, expected_scores, bound)


@pytest.mark.parametrize(
    "arch, attention, style",
    [("llama", "eager", "tril"), ("llama", "eager", "hole"), ("mistral_sliding", "eager", "sparse"),
     ("mistral_sliding", "sdpa", "tril"), ("qwen2_hybrid", "sdpa", "hole"), ("gemma2", "sdpa", "tril")],
)
def test_hidden_states_and_attentions_with_holes(arch, attention, style):
    """Masked tokens stay in the sequence, so every step's hidden states and attention rows (zero on masked keys) are
    plain generate()'s, shapes and values (SDPA returns no attention weights, eager ones are compared)."""
    target = tiny_model(arch, seed=3, attn_implementation=attention)
    ids, mask = _prompt(3, 11), _mask(style, 11, 3)
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True,
              "output_hidden_states": True, "output_attentions": attention == "eager"}
    expected = target.generate(ids, **kwargs)
    got = target.generate(ids, assistant_model=perturbed_copy(target, 0.1, seed=4), speculator="specexec", **kwargs)
    assert got.sequences.tolist() == expected.sequences.tolist()
    bound = model_bound(target, keys=got.sequences.shape[-1])
    for name in ("hidden_states", "attentions") if attention == "eager" else ("hidden_states",):
        for got_step, expected_step in zip(getattr(got, name), getattr(expected, name), strict=True):
            for got_layer, expected_layer in zip(got_step, expected_step, strict=True):
                assert_close_across_kernels(got_layer, expected_layer, bound)


def test_custom_position_ids_are_honoured(llama_pair):
    """generate() feeds the caller's position_ids and continues them one by one; so does SpecExec."""
    target, draft = llama_pair
    ids = _prompt(5, 8)
    positions = torch.tensor([[3, 4, 5, 9, 10, 11, 12, 20]])
    kwargs = {"position_ids": positions, "max_new_tokens": 12, "do_sample": False}
    expected = target.generate(ids, **kwargs)
    assert target.generate(ids, assistant_model=draft, speculator="specexec", **kwargs).tolist() == expected.tolist()


VOCAB, NEW_TOKENS, SAMPLES = 5, 2, 1500


@torch.no_grad()
def _exact_distribution(model, ids: torch.Tensor, mask: torch.Tensor, temperature: float) -> dict[tuple, float]:
    """The target's own distribution over ``NEW_TOKENS``-token continuations, with the mask and positions plain
    decoding uses: each new token attended, at the previous position plus one."""
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    distribution = {}
    for continuation in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        probability, sequence, sequence_mask, sequence_positions = 1.0, ids, mask, positions
        for token in continuation:
            logits = model(sequence, attention_mask=sequence_mask, position_ids=sequence_positions).logits[0, -1]
            probability *= float(torch.softmax(logits.float() / temperature, dim=-1)[token])
            sequence = torch.cat([sequence, torch.tensor([[token]])], dim=-1)
            sequence_mask = torch.cat([sequence_mask, torch.ones(1, 1, dtype=torch.long)], dim=-1)
            sequence_positions = torch.cat([sequence_positions, sequence_positions[:, -1:] + 1], dim=-1)
        distribution[continuation] = probability
    return distribution




@pytest.mark.parametrize("arch", ["mistral_sliding", "qwen2_hybrid"])
def test_sampling_with_holes_has_the_target_distribution(arch):
    """A prompt longer than the window, with its last window masked (so the last token's query sees no key on sliding
    layers): samples follow the target's own distribution under that mask (and not the distribution without it, so
    the test can tell)."""
    target = tiny_model(arch, seed=11, vocab_size=VOCAB)
    draft = perturbed_copy(target, 0.3, seed=12)
    ids = _prompt(11, 9, vocab=VOCAB)
    mask = torch.tensor([[1, 0, 0, 1, 0, 0, 0, 0, 0]])
    temperature = 0.8
    counts: dict[tuple, int] = {}
    for seed in range(SAMPLES):
        torch.manual_seed(seed)
        out = target.generate(ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0,
                              max_new_tokens=NEW_TOKENS, assistant_model=draft, speculator="specexec", budget=4)
        outcome = tuple(out[0, ids.shape[1] :].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
    assert chi_square_p(counts, _exact_distribution(target, ids, mask, temperature)) > 1e-3
    unmasked = torch.ones_like(mask)
    assert chi_square_p(counts, _exact_distribution(target, ids, unmasked, temperature)) < 1e-3


def test_cached_decoding_that_sees_masked_tokens_is_refused():
    """GIT's cached decoding steps attend to tokens its attention_mask hides (a full forward does not): plain
    generate() cannot be followed there, so SpecExec refuses it, while the same prompt without masked tokens runs."""
    from architectures import build_tiny

    from specexec_hf.hf.compat import UnsupportedModelError

    target = build_tiny("git").target
    ids = _prompt(2, 7, vocab=target.config.vocab_size)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "assistant_model": target, "speculator": "specexec"}
    with pytest.raises(UnsupportedModelError, match="masked-token probe: new token 1 gets logits"):
        target.generate(ids, attention_mask=_mask("hole", 7, 2), **kwargs)
    expected = target.generate(ids, max_new_tokens=4, do_sample=False)
    assert target.generate(ids, **kwargs).tolist() == expected.tolist()
