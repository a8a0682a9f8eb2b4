"""The bounds of ``tolerances``: loose enough for the same mathematics through other kernels (on any CPU), tight
enough that a real bug's difference fails them."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from tolerances import assert_close_across_kernels, model_bound, rounding_bound
from transformers import DynamicCache

LENGTH = 11


def _forward(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache=None):
    return model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=cache is not None,
                 output_hidden_states=True, output_attentions=model.config._attn_implementation == "eager")


def _prompt() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids, a mask with a hole (keys 2..5 hidden), positions."""
    ids = torch.randint(64, (1, LENGTH), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, 2:6] = 0
    return ids, mask, torch.arange(LENGTH)[None]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_one_token_forward_equals_the_full_forward_within_the_bound(attention):
    """The last token fed alone after a cached prefix (generate()'s path) against the whole prompt at once (a tree
    forward's shapes): other kernels, the same mathematics."""
    model = tiny_model("llama", seed=3, attn_implementation=attention)
    ids, mask, positions = _prompt()
    with torch.no_grad():
        full = _forward(model, ids, mask, positions)
        cache = _forward(model, ids[:, :-1], mask[:, :-1], positions[:, :-1], cache=DynamicCache()).past_key_values
        last = _forward(model, ids[:, -1:], mask, positions[:, -1:], cache=cache)
    bound = model_bound(model, keys=LENGTH)
    assert_close_across_kernels(last.logits[:, -1], full.logits[:, -1], bound)
    for ours, theirs in zip(last.hidden_states, full.hidden_states, strict=True):
        assert_close_across_kernels(ours[:, -1], theirs[:, -1], bound)
    for ours, theirs in zip(last.attentions or (), full.attentions or (), strict=True):
        assert_close_across_kernels(ours[..., -1:, :], theirs[..., -1:, :], bound)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("bug", ["a masked key seen", "the last position off by one"])
def test_a_bug_sized_difference_fails_the_bound(attention, bug):
    """The bugs the equality tests guard against (a key wrongly seen, a token placed at the wrong position) move
    the logits, hidden states and attention rows past the bound (on this random model a position off by one moves
    the logits by about 1e-3 of their magnitude: 40 times the eager-attention bound, 1e10 times the float64 one)."""
    model = tiny_model("llama", seed=3, attn_implementation=attention)
    ids, mask, positions = _prompt()
    buggy_mask, buggy_positions = mask.clone(), positions.clone()
    if bug == "a masked key seen":
        buggy_mask[0, 3] = 1
    else:
        buggy_positions[0, -1] += 1
    with torch.no_grad():
        expected, got = _forward(model, ids, mask, positions), _forward(model, ids, buggy_mask, buggy_positions)
    bound = model_bound(model, keys=LENGTH)
    outputs = [(got.logits, expected.logits), (got.hidden_states[-1], expected.hidden_states[-1])]
    outputs += [(got.attentions[-1], expected.attentions[-1])] if attention == "eager" else []
    for ours, theirs in outputs:
        with pytest.raises(AssertionError, match="not close"):
            assert_close_across_kernels(ours, theirs, bound)


def test_rounding_bound_refuses_empty_sums():
    with pytest.raises(ValueError, match="both are >= 1"):
        rounding_bound(torch.float32, reduction=0)
