"""Bad input fails early with a message naming the problem and the fix; the patch is idempotent and reversible."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer
from specexec_hf.patches import transformers_generate
from transformers import GPT2Config, GPT2LMHeadModel, pipeline
from transformers.generation.utils import GenerationMixin

import specexec_hf
from specexec_hf import SpecExecConfig
from specexec_hf.hf.compat import UnsupportedModelError

IDS = torch.tensor([[1, 2, 3, 4]])


def specexec(target, draft, ids=IDS, **kwargs):
    kwargs = {"max_new_tokens": 5, "do_sample": False, **kwargs}
    return target.generate(ids, assistant_model=draft, speculator="specexec", **kwargs)


def test_batch_larger_than_one(llama_pair):
    target, draft = llama_pair
    with pytest.raises(ValueError, match="one sequence at a time"):
        specexec(target, draft, ids=IDS.repeat(2, 1))


def test_mismatched_vocabularies(llama_pair):
    target, _ = llama_pair
    with pytest.raises(ValueError, match=r"draft's vocabulary \(32 logits\) does not match the target's \(64\)"):
        specexec(target, tiny_model("llama", vocab_size=32))


@pytest.mark.parametrize("knob,value", [("budget", 0), ("max_depth", -1), ("max_branch", 1.5), ("expand_per_forward", 0)])
def test_invalid_knobs(llama_pair, knob, value):
    target, draft = llama_pair
    with pytest.raises(ValueError, match=f"SpecExecConfig.{knob} must be a positive integer"):
        specexec(target, draft, **{knob: value})


def test_unknown_knob_in_config():
    with pytest.raises(TypeError, match="Unknown SpecExec knob"):
        SpecExecConfig().updated(bugdet=3)


def test_missing_draft(llama_pair):
    target, _ = llama_pair
    with pytest.raises(ValueError, match="needs a draft"):
        target.generate(IDS, max_new_tokens=3, speculator="specexec")


def test_unknown_speculator(llama_pair):
    target, draft = llama_pair
    with pytest.raises(ValueError, match="Unknown speculator='medusa'"):
        target.generate(IDS, max_new_tokens=3, assistant_model=draft, speculator="medusa")


def test_padded_prompt(llama_pair):
    target, draft = llama_pair
    with pytest.raises(ValueError, match="unpadded prompt"):
        specexec(target, draft, attention_mask=torch.tensor([[0, 1, 1, 1]]))


def test_beam_search(llama_pair):
    target, draft = llama_pair
    with pytest.raises(ValueError, match="num_beams=1"):
        specexec(target, draft, num_beams=2)


def test_attention_that_ignores_custom_masks(llama_pair):
    _, draft = llama_pair
    target = tiny_model("llama", seed=0)
    target.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedModelError, match="attn_implementation='sdpa'"):
        specexec(target, draft)


def test_sliding_window_model(llama_pair):
    _, draft = llama_pair
    target = tiny_model("mistral", seed=0)
    target.config.sliding_window = 16
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        specexec(target, draft)


def test_unverified_architecture_passes_the_numerical_probe():
    """GPT-2 is not in the verified list; its learned positions honour position_ids, so the probe admits it."""
    config = GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    target = GPT2LMHeadModel(config).to(torch.float64).eval()
    expected = target.generate(IDS, max_new_tokens=12, do_sample=False)
    assert specexec(target, target, max_new_tokens=12).tolist() == expected.tolist()


def test_unverified_architecture_failing_the_probe_is_refused(monkeypatch):
    from specexec_hf.hf import compat

    target = tiny_model("llama", seed=0)
    monkeypatch.setattr(compat, "VERIFIED_MODEL_TYPES", frozenset())
    original_logits = compat.model_logits

    def ignores_masks(model, input_ids, position_ids, cache, num_logits, visible=None):
        return original_logits(model, input_ids, torch.arange(input_ids.numel()), cache, num_logits)

    monkeypatch.setattr(compat, "model_logits", ignores_masks)
    monkeypatch.setattr(compat, "_probed_classes", {})
    with pytest.raises(UnsupportedModelError, match="does not honour custom 4-D masks"):
        compat.check_supported(target, "target")


def test_patch_is_idempotent_and_reversible(llama_pair):
    target, draft = llama_pair
    assert transformers_generate.is_applied()
    patched = GenerationMixin.generate
    transformers_generate.apply()
    assert GenerationMixin.generate is patched
    transformers_generate.revert()
    try:
        assert not transformers_generate.is_applied()
        assert GenerationMixin.generate is not patched
        with pytest.raises(ValueError, match="speculator"):
            target.generate(IDS, max_new_tokens=3, assistant_model=draft, speculator="specexec")
        transformers_generate.revert()  # a second revert does nothing
    finally:
        transformers_generate.apply()
    assert specexec(target, draft).shape == (1, 9)


def test_patch_refuses_versions_it_was_not_written_for():
    with pytest.raises(transformers_generate.UnsupportedTransformersVersion, match="transformers 4.57.1 is installed"):
        transformers_generate.check_version("4.57.1")
    with pytest.raises(transformers_generate.UnsupportedTransformersVersion):
        transformers_generate.check_version("6.0.0")
    transformers_generate.check_version("5.16.0")


def test_pipeline_switches_to_specexec_with_two_arguments(llama_pair):
    target, draft = llama_pair
    tokenizer = tiny_tokenizer()
    generator = pipeline("text-generation", model=target, tokenizer=tokenizer)
    plain = generator("hello there", max_new_tokens=12, do_sample=False)
    fast = generator("hello there", max_new_tokens=12, do_sample=False, assistant_model=draft, speculator="specexec")
    assert fast == plain
    assert specexec_hf.generate is not None
