"""Bad input fails early with a message naming the problem and the fix; the patch is idempotent and reversible."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer
from transformers import GPT2Config, GPT2LMHeadModel, pipeline
from transformers.generation.utils import GenerationMixin

import specexec_hf
from specexec_hf import SpecExecConfig
from specexec_hf.hf.compat import UnsupportedModelError
from specexec_hf.hf.forward import Feed
from specexec_hf.patches import transformers_generate

IDS = torch.tensor([[1, 2, 3, 4]])


def specexec(target, draft, ids=IDS, **kwargs):
    kwargs = {"max_new_tokens": 5, "do_sample": False, **kwargs}
    return target.generate(ids, assistant_model=draft, speculator="specexec", **kwargs)


def test_mismatched_tokenizers(llama_pair):
    target, draft = llama_pair
    with pytest.raises(ValueError, match="draft's tokenizer is not the target's: compared by vocabulary"):
        specexec(target, draft, tokenizer=tiny_tokenizer(), assistant_tokenizer=tiny_tokenizer(63))


@pytest.mark.parametrize(
    "knob,value", [("budget", 0), ("max_depth", -1), ("max_branch", 1.5), ("expand_per_forward", 0)]
)
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


def test_attention_mask_of_another_shape(llama_pair):
    target, draft = llama_pair
    with pytest.raises(ValueError, match=r"2-D mask of the prompt's shape \(1, 4\)"):
        specexec(target, draft, attention_mask=torch.tensor([[1, 0, 1, 1, 1]]))


def test_masked_token_blind_in_its_window_under_eager_attention(llama_pair):
    """Eager attention averages every value of the forward for a query with no unmasked key (NaNs in float64), which
    depends on what the forward holds: refused, naming the fix."""
    _, draft = llama_pair
    target = tiny_model("mistral_sliding", seed=0, attn_implementation="eager")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with pytest.raises(ValueError, match=r"prompt token 5 .* sliding_attention span.*attn_implementation='sdpa'"):
        specexec(target, draft, ids=ids, attention_mask=torch.tensor([[1, 0, 0, 0, 0, 0, 1, 1]]))


def test_empty_prompt(llama_pair):
    target, draft = llama_pair
    with pytest.raises(ValueError, match="prompt is empty"):
        specexec(target, draft, attention_mask=torch.tensor([[0, 0, 0, 0]]))


@pytest.mark.parametrize("token", [-1, 64, 10**6])
def test_out_of_vocabulary_prompt(llama_pair, token):
    target, draft = llama_pair
    with pytest.raises(ValueError, match=f"token id {token}, outside the target's vocabulary of 64"):
        specexec(target, draft, ids=torch.tensor([[1, token, 3]]))


def test_budget_beyond_memory_is_refused_before_allocating(llama_pair):
    target, draft = llama_pair
    with pytest.raises(ValueError, match=r"budget=10000000 needs about .* GiB .* largest budget that fits is about"):
        specexec(target, draft, budget=10_000_000)


def test_unused_model_input_is_refused_by_name(llama_pair):
    target, draft = llama_pair
    embeds = target.get_input_embeddings()(IDS)
    with pytest.raises(ValueError, match=r"does not pass \['inputs_embeds'\]"):
        target.generate(inputs_embeds=embeds, max_new_tokens=3, assistant_model=draft, speculator="specexec")


def test_gpt_neo_local_attention_is_refused_up_front():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                          attention_types=[[["global", "local"], 1]], attn_implementation="eager")
    model = GPTNeoForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match="causal bias is indexed by cache slot"):
        specexec(model, model)


def test_falcon_alibi_is_refused_up_front():
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                          attn_implementation="sdpa")
    model = FalconForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match="ALiBi"):
        specexec(model, model)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_weights_left_on_the_meta_device_are_refused_before_any_forward(llama_pair, role):
    with torch.device("meta"):
        empty = type(llama_pair[0])(llama_pair[0].config)
    target, draft = (empty, llama_pair[1]) if role == "target" else (llama_pair[0], empty)
    forwards = []
    hooks = [model.register_forward_pre_hook(lambda *_: forwards.append(1)) for model in (target, draft)]
    try:
        refused = rf"The {role} model .* meta device that nothing loads \(e.g. model.embed_tokens"
        with pytest.raises(UnsupportedModelError, match=refused):
            specexec(target, draft)
    finally:
        for hook in hooks:
            hook.remove()
    assert not forwards


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


def test_recurrent_layers_are_refused_by_name(llama_pair):
    _, draft = llama_pair
    target = tiny_model("qwen2_hybrid", seed=0)
    target.config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match=r"\['linear_attention'\] layers"):
        specexec(target, draft)


def test_alibi_is_refused_up_front(llama_pair):
    _, draft = llama_pair
    target = tiny_model("llama", seed=0)
    target.config.alibi = True
    with pytest.raises(UnsupportedModelError, match="ALiBi"):
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

    def ignores_masks(model, feed):
        return original_logits(model, Feed(feed.cache, feed.tokens, torch.arange(feed.tokens.numel()), None,
                                           feed.num_logits))

    monkeypatch.setattr(compat, "model_logits", ignores_masks)
    monkeypatch.setattr(compat, "_probe_verdicts", {})
    with pytest.raises(UnsupportedModelError, match="does not honour custom 4-D masks"):
        compat.check_supported(target, "target")


def test_probe_verdicts_are_kept_per_configuration(monkeypatch):
    """Two configurations of one class are probed separately, each past its own window."""
    from specexec_hf.hf import compat

    monkeypatch.setattr(compat, "VERIFIED_MODEL_TYPES", frozenset())
    monkeypatch.setattr(compat, "_probe_verdicts", {})
    for window in (4, 9):
        model = tiny_model("mistral_sliding", seed=0)
        model.config.sliding_window = window
        compat.check_supported(model, "target")
    assert len(compat._probe_verdicts) == 2 and not any(compat._probe_verdicts.values())


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
    release = transformers_generate.TRANSFORMERS
    with pytest.raises(transformers_generate.UnsupportedTransformersVersion, match="found transformers 4.57.1"):
        release.check("4.57.1")
    with pytest.raises(transformers_generate.UnsupportedTransformersVersion):
        release.check("6.0.0")
    release.check("5.16.0")


def test_patch_refuses_a_generate_with_another_signature(monkeypatch):
    """A transformers release that changed what the patch wraps is refused, naming the method; nothing is patched."""
    transformers_generate.revert()
    try:

        def generate(self, inputs=None, **kwargs):
            raise AssertionError("never called")

        monkeypatch.setattr(GenerationMixin, "generate", generate)
        with pytest.raises(transformers_generate.UnsupportedTransformersVersion, match=r"GenerationMixin\.generate "
                           r"takes \(self, inputs, kwargs\)"):  # fmt: skip
            transformers_generate.apply()
        assert GenerationMixin.generate is generate and not transformers_generate.is_applied()
    finally:
        monkeypatch.undo()
        transformers_generate.apply()


def test_pipeline_switches_to_specexec_with_two_arguments(llama_pair):
    target, draft = llama_pair
    tokenizer = tiny_tokenizer()
    generator = pipeline("text-generation", model=target, tokenizer=tokenizer)
    plain = generator("hello there", max_new_tokens=12, do_sample=False)
    fast = generator("hello there", max_new_tokens=12, do_sample=False, assistant_model=draft, speculator="specexec")
    assert fast == plain
    assert specexec_hf.generate is not None
