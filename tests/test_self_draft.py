"""Self-drafts: the target itself, weight-quantized, as its own draft; output stays the target's."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

import specexec_hf
from specexec_hf.models import SELF_DRAFTS, resolve_draft, self_draft
from specexec_hf.models.self_draft import SELF_DRAFT_ATTRIBUTE

pytest.importorskip("optimum.quanto")


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), bits=st.sampled_from([4, 8]), budget=st.integers(1, 24))
def test_generation_with_a_self_draft_is_plain_greedy(seed, bits, budget):
    target = tiny_model("llama", seed=seed)
    draft = self_draft(target, bits)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(seed))
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft, speculator="specexec",
                          budget=budget)
    assert out.tolist() == expected.tolist()


@pytest.mark.parametrize("name", sorted(SELF_DRAFTS))
def test_generate_takes_a_self_draft_by_name_on_both_routes(name):
    target = tiny_model("llama", seed=5)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    expected = target.generate(ids, max_new_tokens=12, do_sample=False).tolist()
    patched = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=name, speculator="specexec")
    custom = target.generate(
        ids, max_new_tokens=12, do_sample=False, draft_model=name, custom_generate=specexec_hf.generate
    )
    assert patched.tolist() == custom.tolist() == expected
    with pytest.raises(ValueError, match="self:int4"):
        target.generate(ids, max_new_tokens=2, assistant_model="self:int3", speculator="specexec")


@pytest.mark.parametrize("bits", [4, 8])
def test_the_target_is_left_untouched_and_the_copy_is_quantized(bits):
    from optimum.quanto import QLinear

    target = tiny_model("llama", seed=5)
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    draft = self_draft(target, bits)
    assert all(torch.equal(before[name], tensor) for name, tensor in target.state_dict().items())
    assert not any(isinstance(module, QLinear) for module in target.modules())
    linears = [module for module in draft.modules() if isinstance(module, torch.nn.Linear)]
    assert linears and all(isinstance(module, QLinear) for module in linears)
    assert getattr(draft.config, SELF_DRAFT_ATTRIBUTE) == f"self:int{bits}"
    assert draft.config.vocab_size == target.config.vocab_size and not draft.training


def test_more_bits_agree_more_with_the_target():
    target = tiny_model("llama", seed=7)
    tokens = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        chosen = target(tokens).logits.argmax(-1)
        agreement = {bits: float((self_draft(target, bits)(tokens).logits.argmax(-1) == chosen).double().mean())
                     for bits in (4, 8)}
    assert agreement[8] >= agreement[4] and agreement[8] > 0.9


def test_resolve_draft_builds_each_self_draft_once_and_passes_models_through():
    target, other = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    assert resolve_draft(target, other) is other
    int4 = resolve_draft(target, "self:int4")
    assert resolve_draft(target, "self:int4") is int4  # its acceptance map carries over between calls
    assert resolve_draft(target, "self:int8") is not int4
    assert set(SELF_DRAFTS) == {"self:int4", "self:int8"}


@pytest.mark.parametrize("draft", ["self:int3", "self", "int4", 4, None])
def test_resolve_draft_names_the_accepted_drafts(draft):
    with pytest.raises(ValueError, match="self:int4"):
        resolve_draft(tiny_model("llama"), draft)


def test_unsupported_bits_and_offloaded_weights_are_refused():
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="4 or 8 bits"):
        self_draft(target, 3)
    with torch.device("meta"):
        offloaded = type(target)(target.config)
    with pytest.raises(ValueError, match="in memory"):
        self_draft(offloaded, 4)


def test_missing_quanto_gives_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "optimum.quanto", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"specexec-hf\[quanto\]"):
        self_draft(tiny_model("llama"), 4)
