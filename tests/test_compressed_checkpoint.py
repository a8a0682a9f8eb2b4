"""compressed-tensors "pack-quantized" int4 checkpoints (GPTQ-style, as llm-compressor writes them) read by
transformers and made optimum-quanto int4 layers (``specexec_hf.offload.compressed``): the same weights as
compressed-tensors' own decompression, streamed packed and expanded by the device executor into the logits of the
decompressed model."""

from __future__ import annotations

import pytest
import torch
from conftest import importable
from test_cuda_executor import layer_map, prompt
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specexec_hf.offload import OrderCheckingDevice, layer_streamer, stream_on_device
from specexec_hf.offload.compressed import quanto_from_compressed

pytestmark = pytest.mark.skipif(
    not (importable("compressed_tensors") and importable("optimum.quanto")), reason="needs compressed-tensors, quanto"
)


def write_checkpoint(folder, symmetric: bool, strategy: str = "group", num_bits: int = 4) -> None:
    """A small bfloat16 Llama whose decoder layers' linear weights are quantized (min-max, in groups of 128 or per
    row) and packed by compressed-tensors, saved with its quantization config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    group_size = 128 if strategy == "group" else None
    weights = QuantizationArgs(num_bits=num_bits, symmetric=symmetric, strategy=strategy, group_size=group_size)
    quantization = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}, ignore=["lm_head"],
        format="pack-quantized",
    )
    apply_quantization_config(model, quantization)
    top = (1 << (num_bits - 1)) - 1
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            rows, columns = module.weight.shape
            grouped = module.weight.detach().float().reshape(rows, -1, group_size or columns)
            low, high = grouped.amin(-1), grouped.amax(-1)
            if symmetric:
                scale = torch.maximum(low.abs(), high.abs()) / (top + 0.5)
            else:
                scale = (high - low) / (2 * top + 1)
                module.weight_zero_point.data.copy_((-top - 1 - torch.round(low / scale)).clamp(-top - 1, top))
            module.weight_scale.data.copy_(scale.clamp(min=1e-6))
    quantization.quantization_status = QuantizationStatus.COMPRESSED
    compressor = ModelCompressor(quantization_config=quantization)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)


def loaded(folder, dequantize: bool):
    from transformers import CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=CompressedTensorsConfig(dequantize=dequantize), attn_implementation="sdpa"
    ).eval()


@pytest.mark.parametrize("symmetric, strategy", [(True, "group"), (False, "group"), (True, "channel")])
def test_packed_checkpoint_streams_packed_into_the_decompressed_models_logits(tmp_path, symmetric, strategy):
    write_checkpoint(tmp_path, symmetric, strategy)
    decompressed = loaded(tmp_path, dequantize=True)  # compressed-tensors' own decompression
    converted = quanto_from_compressed(loaded(tmp_path, dequantize=False))
    for name, module in decompressed.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            weight = converted.get_submodule(name).weight
            assert type(weight).__name__ == "WeightQBitsTensor" and weight._data._data.dtype == torch.uint8
            assert torch.equal(weight.dequantize(), module.weight)
    streamed = stream_on_device(converted, layer_map(converted, "cpu"), OrderCheckingDevice())
    assert layer_streamer(streamed).expansion_bytes > 0  # packed in the ring, expanded beside it
    with torch.no_grad():
        for ids in (prompt(0, 1), prompt(1, 24)):
            assert torch.equal(streamed(ids).logits, decompressed(ids).logits)


def test_no_decompression_is_left_for_the_first_forward(tmp_path):
    write_checkpoint(tmp_path, symmetric=True)
    converted = quanto_from_compressed(loaded(tmp_path, dequantize=False))
    with torch.no_grad():
        converted(prompt(0, 3))
    assert type(converted.model.layers[0].mlp.up_proj.weight).__name__ == "WeightQBitsTensor"


def test_a_scheme_without_a_quanto_int4_form_is_refused_naming_the_layer_and_the_fix(tmp_path):
    write_checkpoint(tmp_path, symmetric=True, num_bits=8)
    with pytest.raises(ValueError, match=r"model\.layers\.0\..* 8-bit int per group.*dequantize=True"):
        quanto_from_compressed(loaded(tmp_path, dequantize=False))
