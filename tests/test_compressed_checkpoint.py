"""compressed-tensors "pack-quantized" checkpoints (GPTQ-style, written here by compressed-tensors' own compressor)
made optimum-quanto layers (``specexec_hf.offload.compressed``) and offloaded: on the CPU as TinyGemm int4 (torch's
int4 kernel) streamed from the offload folder, bit-equal to the same model in memory and greedy-equal to
compressed-tensors' decompressed model; in the generic form the device executor expands into the decompressed
model's very logits. All of it without building quanto's C++ extension (no compiler)."""

from __future__ import annotations

import tempfile

import pytest
import torch
from conftest import importable
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cuda_executor import layer_map, prompt
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specexec_hf.offload import OrderCheckingDevice, layer_streamer, load_offloaded, stream_on_device
from specexec_hf.offload.compressed import load_compressed, packed_checkpoint, quanto_from_compressed

pytestmark = pytest.mark.skipif(
    not (importable("compressed_tensors") and importable("optimum.quanto")), reason="needs compressed-tensors, quanto"
)


@pytest.fixture(autouse=True)
def no_compiler(monkeypatch):
    """quanto's C++ extension refuses to build: every path here must do without it."""
    from optimum.quanto.library.extensions.extension import Extension

    def refuse(extension):
        raise AssertionError(f"quanto's {extension.name} extension was asked for: it needs a compiler")

    monkeypatch.setattr(Extension, "lib", property(refuse))


def write_checkpoint(
    folder, symmetric: bool = True, strategy: str = "group", num_bits: int = 4, group_size: int = 128,
    dtype: torch.dtype = torch.bfloat16, seed: int = 0,
) -> None:
    """A small Llama whose decoder layers' linear weights are quantized (min-max, in groups or per row) and packed by
    compressed-tensors, saved with its quantization config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked next-token distributions, like a trained model's
    group_size = group_size if strategy == "group" else None
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


def greedy(model, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=10, do_sample=False)


def assert_greedy_equal_but_for_near_ties(model, decompressed, ids: torch.Tensor, within: float = 0.05) -> None:
    """``model``'s greedy tokens are ``decompressed``'s: at each step its token is ``decompressed``'s argmax, or a
    near-tie there (its logit within the two models' largest logit difference, itself under ``within``).

    The same weights multiply in another order (torch's int4 kernel accumulates ``(q - 8) * scale`` unrounded in
    float32, the dense bfloat16 product its rounded weights), so logits differ in their last bits and a tiny
    random model's near-ties may break the other way."""
    tokens = greedy(model, ids)
    with torch.no_grad():
        ours, theirs = model(tokens).logits[0].float(), decompressed(tokens).logits[0].float()
    difference = (ours - theirs).abs().max().item()
    assert difference < within
    for position in range(ids.shape[1] - 1, tokens.shape[1] - 1):
        chosen = tokens[0, position + 1]
        assert theirs[position].max() - theirs[position, chosen] <= 2 * difference, f"token {position + 1}"


@settings(max_examples=8, deadline=None)
@given(
    strategy=st.sampled_from(["group", "channel"]),
    seed=st.integers(0, 2**16),
    prefetch=st.integers(1, 3),
    cpu_bytes=st.sampled_from([0, 60_000]),  # everything on disk, or the embedding in RAM
    one_call=st.booleans(),  # load_offloaded(path) detects the packed checkpoint, or is given load_compressed's model
)
def test_a_packed_checkpoint_streams_from_disk_on_the_cpu_bit_equal_to_itself_in_memory(
    strategy, seed, prefetch, cpu_bytes, one_call
):
    with tempfile.TemporaryDirectory() as checkpoint, tempfile.TemporaryDirectory() as folder:
        write_checkpoint(checkpoint, strategy=strategy, seed=seed)
        reference = load_compressed(checkpoint)
        assert type(reference.model.layers[0].mlp.up_proj.weight).__name__ == "TinyGemmWeightQBitsTensor"
        ids = prompt(seed, 7)
        with torch.no_grad():
            expected = reference(ids).logits
        streamed = load_offloaded(
            checkpoint if one_call else load_compressed(checkpoint), max_memory={"cpu": cpu_bytes},
            offload_folder=folder, prefetch=prefetch,
        )
        assert streamed.hf_device_map["model.layers.0"] == "disk" and layer_streamer(streamed) is not None
        with torch.no_grad():
            for _ in range(2):  # the ring wraps around: every layer read again
                assert torch.equal(streamed(ids).logits, expected)
        assert torch.equal(greedy(streamed, ids), greedy(reference, ids))


@pytest.mark.parametrize("strategy, seed", [("group", 0), ("group", 1), ("channel", 2)])
def test_cpu_int4_holds_the_checkpoints_weights_and_decodes_as_the_decompressed_model(tmp_path, strategy, seed):
    write_checkpoint(tmp_path, strategy=strategy, seed=seed)
    decompressed = loaded(tmp_path, dequantize=True)  # compressed-tensors' own decompression
    converted = load_compressed(tmp_path)
    for name, module in decompressed.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            # the layer applied to the identity: each weight as torch's int4 kernel computes it, (q - 8) * scale
            # rounded once, as compressed-tensors decompresses it
            identity = torch.eye(module.in_features, dtype=module.weight.dtype)
            with torch.no_grad():
                assert torch.equal(converted.get_submodule(name)(identity), module.weight.T)
    assert_greedy_equal_but_for_near_ties(converted, decompressed, prompt(seed, 9))


def test_int8_per_row_streams_on_the_cpu_and_decodes_as_the_decompressed_model(tmp_path):
    write_checkpoint(tmp_path, strategy="channel", num_bits=8)
    decompressed = loaded(tmp_path, dequantize=True)
    converted = load_compressed(tmp_path)
    weight = converted.model.layers[1].self_attn.o_proj.weight
    assert type(weight).__name__ == "WeightQBytesTensor"
    assert torch.equal(weight.dequantize(), decompressed.model.layers[1].self_attn.o_proj.weight)
    with tempfile.TemporaryDirectory() as folder:
        streamed = load_offloaded(converted, max_memory={"cpu": 0}, offload_folder=folder)
        assert_greedy_equal_but_for_near_ties(streamed, decompressed, prompt(3, 6))


@pytest.mark.parametrize(
    "scheme",
    [
        {"symmetric": True},
        {"symmetric": False},
        {"symmetric": True, "strategy": "channel"},
        {"symmetric": True, "group_size": 64, "dtype": torch.float16},
    ],
)
def test_device_form_streams_packed_into_the_decompressed_models_logits(tmp_path, scheme):
    write_checkpoint(tmp_path, **scheme)
    decompressed = loaded(tmp_path, dequantize=True)
    converted = quanto_from_compressed(loaded(tmp_path, dequantize=False), device="cuda")
    assert type(converted.model.layers[0].mlp.up_proj.weight).__name__ == "WeightQBitsTensor"
    streamed = stream_on_device(converted, layer_map(converted, "cpu"), OrderCheckingDevice())
    assert layer_streamer(streamed).expansion_bytes > 0  # packed in the ring, expanded beside it
    with torch.no_grad():
        for ids in (prompt(0, 1), prompt(1, 24)):
            assert torch.equal(streamed(ids).logits, decompressed(ids).logits)


def test_no_decompression_is_left_for_the_first_forward(tmp_path):
    write_checkpoint(tmp_path)
    assert packed_checkpoint(tmp_path)
    converted = load_compressed(tmp_path)
    with torch.no_grad():
        converted(prompt(0, 3))
    assert type(converted.model.layers[0].mlp.up_proj.weight).__name__ == "TinyGemmWeightQBitsTensor"


def test_a_checkpoint_that_is_not_packed_is_refused_before_its_weights_load(tmp_path):
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    assert not packed_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="not a compressed-tensors 'pack-quantized' checkpoint.*quantize='int4'"):
        load_compressed(tmp_path)


@pytest.mark.parametrize(
    "scheme, device, reason",
    [
        ({"symmetric": False}, "cpu", r"asymmetric.*no zero points.*device='cuda'"),
        ({"group_size": 64}, "cpu", r"groups are 64 wide.*groups of 128"),
        ({"dtype": torch.float16}, "cpu", r"scales are torch.float16"),
        ({"num_bits": 8}, "cuda", r"int8 converts only symmetric with one scale per row"),
        ({"num_bits": 2}, "cuda", r"2-bit \(int4 and int8 only\)"),
    ],
)
def test_a_scheme_without_a_quanto_form_is_refused_naming_the_layer_and_the_fix_before_converting(
    tmp_path, scheme, device, reason
):
    write_checkpoint(tmp_path, **scheme)
    model = loaded(tmp_path, dequantize=False)
    with pytest.raises(ValueError, match=rf"model\.layers\.0\..*{reason}.*dequantize=True"):
        quanto_from_compressed(model, device)
    assert all("weight_packed" in module._parameters for module in model.modules()
               if isinstance(module, torch.nn.Linear) and module is not model.lm_head)


@pytest.fixture
def no_weight_loads(monkeypatch):
    """Loading a checkpoint's weights fails: refusals must come before."""
    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint's weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def test_a_packed_checkpoint_given_quantize_is_refused_naming_the_fix(tmp_path, no_weight_loads):
    write_checkpoint(tmp_path / "checkpoint")
    with pytest.raises(ValueError, match=r"already quantized.*compressed-tensors.*leave quantize unset"):
        load_offloaded(tmp_path / "checkpoint", max_memory={"cpu": 0}, offload_folder=tmp_path / "folder",
                       quantize="int4")


@pytest.mark.parametrize(
    "scheme, reason",
    [({"symmetric": False}, r"no zero points"), ({"group_size": 64}, r"groups are 64 wide")],
)
def test_a_packed_checkpoint_the_cpu_cannot_run_is_refused_before_its_weights_load(
    tmp_path, no_weight_loads, scheme, reason
):
    write_checkpoint(tmp_path / "checkpoint", **scheme)
    with pytest.raises(ValueError, match=rf"model\.layers\.0\..*on the CPU: .*{reason}.*dequantize=True"):
        load_offloaded(tmp_path / "checkpoint", max_memory={"cpu": 0}, offload_folder=tmp_path / "folder")
    with pytest.raises(ValueError, match=reason):
        load_compressed(tmp_path / "checkpoint")


def test_a_packed_checkpoint_placed_on_disk_without_an_offload_folder_is_refused_before_its_weights_load(
    tmp_path, no_weight_loads
):
    write_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"on disk \(model\.embed_tokens, \.\.\.\).*pass offload_folder="):
        load_offloaded(tmp_path, max_memory={"cpu": 0})


def test_a_packed_checkpoint_on_disk_under_accelerates_hooks_is_refused_before_its_weights_load(
    tmp_path, no_weight_loads
):
    write_checkpoint(tmp_path / "checkpoint")
    with pytest.raises(ValueError, match=r"puts model\.layers\.0, which holds quantized.*raise max_memory\['cpu'\]"):
        load_offloaded(tmp_path / "checkpoint", max_memory={"cpu": 0}, offload_folder=tmp_path / "folder",
                       executor="accelerate")


def test_the_cli_streams_a_packed_checkpoint_as_it_decodes_in_memory(tmp_path, capsys):
    from conftest import tiny_tokenizer

    from specexec_hf.tools import cli
    from specexec_hf.tools.prompts import chat_inputs

    checkpoint = tmp_path / "checkpoint"
    write_checkpoint(checkpoint)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    tokenizer.save_pretrained(checkpoint)
    inputs = chat_inputs(tokenizer, "the quick brown fox")
    output = load_compressed(checkpoint).generate(**inputs, max_new_tokens=12, do_sample=False)
    expected = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert cli.main(["generate", "--prompt", "the quick brown fox", "--max-new-tokens", "12", "--target",
                     str(checkpoint), "--no-specexec", "--offload", "stream", "--max-memory", "cpu=0",
                     "--offload-folder", str(tmp_path / "folder")]) == 0
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize(
    "max_memory, device",
    [({0: 10**9, "cpu": 10**9}, "cuda:0"), ({"cpu": 10**9}, "cpu"), ({0: 0, "cpu": 10**9}, "cpu")],
)
def test_a_packed_checkpoint_loads_in_the_form_for_the_device_its_placement_computes_on(
    tmp_path, monkeypatch, max_memory, device
):
    from specexec_hf.offload import placement

    class Loaded(Exception):
        pass

    def record(path, device, dtype, skeleton=None):
        raise Loaded(device)

    write_checkpoint(tmp_path)
    monkeypatch.setattr(placement, "load_compressed", record)
    with pytest.raises(Loaded, match=rf"^{device}$"):
        load_offloaded(tmp_path, max_memory=max_memory)
