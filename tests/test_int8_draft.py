"""int8_draft: a Llama draft's decoder layers computed in int8 on the CPU (specexec_hf/models/int8_draft.py).

The converted draft must compute what the float draft computes with each matrix product's two operands rounded to
int8 rows (weights per output row, activations per input row), over every cache and mask a tree search feeds it;
and generate() with it must stay the target's output.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specexec_hf.models.drafts import dequantize_rows_int8, quantize_rows_int8
from specexec_hf.models.int8_draft import Int8LlamaDecoderLayer, Int8LMHead, Int8SubsetLMHead, int8_draft
from specexec_hf.models.vocab import restrict_draft_vocabulary


class RoundedOperandsLinear(torch.nn.Module):
    """The reference: a float product whose weight rows and input rows are first rounded to int8 and back."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = dequantize_rows_int8(*quantize_rows_int8(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, scales = quantize_rows_int8(x.reshape(-1, x.shape[-1]))
        return (dequantize_rows_int8(rows, scales) @ self.weight.T).view(*x.shape[:-1], -1)


def rounded_operands(model: LlamaForCausalLM) -> LlamaForCausalLM:
    reference = copy.deepcopy(model)
    for layer in reference.model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name, child in list(owner.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(owner, name, RoundedOperandsLinear(child.weight))
    reference.lm_head = RoundedOperandsLinear(reference.lm_head.weight)
    return reference


def random_llama(seed: int, heads: int, groups: int, head_dim: int, layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=48, hidden_size=heads * head_dim, intermediate_size=17 + seed % 40, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads // groups, head_dim=head_dim,
        max_position_embeddings=256, attn_implementation="sdpa", tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@st.composite
def feeds(draw):
    """A batch of tree feeds: cached tokens, new tokens, their positions and a 4-D boolean mask (or ``None``:
    causal, as the history's first feed is run)."""
    batch, cached, new = draw(st.integers(1, 2)), draw(st.integers(0, 6)), draw(st.integers(1, 5))
    causal = cached == 0 and draw(st.booleans())
    visible = torch.zeros(batch, 1, new, cached + new, dtype=torch.bool)
    visible[..., :cached] = True
    for row in range(new):
        visible[:, 0, row, cached + row] = True
        for earlier in range(row):
            visible[:, 0, row, cached + earlier] = draw(st.booleans())
    return batch, cached, new, None if causal else visible


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    heads=st.sampled_from([2, 4]),
    groups=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([8, 16]),
    layers=st.integers(1, 2),
    feed=feeds(),
)
def test_int8_layers_compute_the_float_layers_with_int8_rounded_operands(seed, heads, groups, head_dim, layers, feed):
    batch, cached, new, visible = feed
    model = random_llama(seed, heads, groups, head_dim, layers)
    reference, converted = rounded_operands(model), int8_draft(copy.deepcopy(model))
    generator = torch.Generator().manual_seed(seed)
    history = torch.randint(0, 48, (batch, cached), generator=generator)
    tokens = torch.randint(0, 48, (batch, new), generator=generator)
    depths = torch.randint(0, 3, (batch, new), generator=generator)
    positions = torch.full((batch, new), cached) + (depths if visible is not None else torch.arange(new))
    outputs, caches = [], []
    with torch.no_grad():
        for candidate in (reference, converted):
            cache = DynamicCache()
            if cached:
                candidate(input_ids=history, past_key_values=cache, use_cache=True)
            logits = candidate(input_ids=tokens, position_ids=positions, attention_mask=visible,
                               past_key_values=cache, use_cache=True).logits
            outputs.append(logits)
            caches.append(cache)
    # Same arithmetic in another order: the int32 sums are exact, the float ones round (1e-7), but a rounding
    # difference can move an activation across an int8 step (1/127 of its row's maximum) and later rows with it,
    # hence a tolerance of a few steps of the output's scale. A missing rotation, norm or mask is off by far more.
    for ours, theirs in [(outputs[1], outputs[0])] + [
        (mine, reference) for layer, other in zip(caches[1].layers, caches[0].layers)
        for mine, reference in ((layer.keys, other.keys), (layer.values, other.values))
    ]:
        assert torch.allclose(ours, theirs, atol=3 / 127 * theirs.abs().max(), rtol=0)


def test_int8_layers_hold_int8_rows_fused_and_convert_once():
    model = random_llama(3, 4, 2, 8, 2)
    float_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    converted = int8_draft(model)
    layers = list(converted.model.layers)
    assert all(type(layer) is Int8LlamaDecoderLayer for layer in layers)
    assert layers[0].qkv_proj.rows_t.dtype == torch.int8 and layers[0].qkv_proj.rows_t.shape == (32, 32 + 16 + 16)
    held = sum(b.numel() * b.element_size() for b in converted.model.layers.buffers())
    held += sum(p.numel() * p.element_size() for p in converted.model.layers.parameters())
    assert held < float_bytes / 2
    head = converted.get_output_embeddings()
    assert type(head) is Int8LMHead and head.rows.rows_t.dtype == torch.int8 and head.out_features == 48
    assert list(int8_draft(converted).model.layers) == layers  # idempotent
    assert converted.get_output_embeddings() is head


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), columns=st.integers(1, 48), rows=st.integers(1, 12))
def test_an_int8_subset_head_scores_its_columns_as_the_rounded_float_head(seed, columns, rows):
    model = random_llama(seed, 2, 1, 8, 1)
    token_ids = torch.randperm(48, generator=torch.Generator().manual_seed(seed))[:columns]
    restrict_draft_vocabulary(model, token_ids)
    float_head = model.get_output_embeddings()
    expected = RoundedOperandsLinear(float_head.weight)
    head = int8_draft(model).get_output_embeddings()
    assert type(head) is Int8SubsetLMHead and torch.equal(head.token_ids, float_head.token_ids)
    hidden = torch.randn(1, rows, 16, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full, reference = head(hidden), expected(hidden)
        with head.compact_scores() as ids:
            compact = head(hidden)
    assert torch.equal(ids, float_head.token_ids) and compact.shape == (1, rows, columns)
    assert torch.equal(full[..., ids], compact)
    outside = torch.ones(48, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(full[..., outside]).all())
    # int32 sums are exact; the float scaling rounds differently from the reference's float product
    assert torch.allclose(compact, reference, atol=1e-5 * (1 + reference.abs().max()), rtol=1e-5)


def test_a_head_it_does_not_convert_stays_float():
    model = random_llama(2, 2, 1, 8, 1)
    model.lm_head = torch.nn.Linear(16, 48, bias=True)
    assert int8_draft(model).lm_head is model.lm_head


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda m: m.to(torch.bfloat16), "float32"),
        (lambda m: setattr(m.config, "_attn_implementation", "eager"), "SDPA"),
        (lambda m: setattr(m.config, "attention_bias", True), "biases"),
    ],
)
def test_a_draft_it_cannot_convert_is_refused_with_the_reason_before_any_change(change, reason):
    model = random_llama(1, 2, 1, 8, 1)
    change(model)
    with pytest.raises(ValueError, match=reason):
        int8_draft(model)
    assert type(model.model.layers[0]) is not Int8LlamaDecoderLayer


def test_another_family_is_refused():
    with pytest.raises(ValueError, match="Llama drafts"):
        int8_draft(tiny_model("qwen2", dtype=torch.float32))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), budget=st.sampled_from([4, 16]), prompt_length=st.integers(1, 12))
def test_generate_with_an_int8_draft_returns_the_target_s_greedy_output(seed, budget, prompt_length):
    target = tiny_model("llama", seed=seed % 7)  # float64: the tree and plain forwards agree far below argmax gaps
    draft = int8_draft(perturbed_copy(target, 0.05, seed=seed).float())
    prompt = torch.randint(0, 64, (1, prompt_length), generator=torch.Generator().manual_seed(seed))
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    ours = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=draft, speculator="specexec",
                           budget=budget)
    assert torch.equal(ours, plain)
