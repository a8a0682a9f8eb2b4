"""Quantized (optimum-quanto) targets streamed from disk by the CPU stream executor: each quantized weight's inner
tensors written to the offload folder, read back into the ring and rebuilt there, bit-equal to the model in memory."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from conftest import importable
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from specexec_hf.offload import direct_io, layer_streamer, load_offloaded

pytestmark = pytest.mark.skipif(not importable("optimum.quanto"), reason="needs optimum-quanto")

# quanto's three CPU forms: int4 over bfloat16 (128-wide groups) packs for torch's int4 CPU kernel (TinyGemm), int4
# over float32 keeps a nested packed tensor, int8 a plain one.
FORMS = {
    "int4 bf16": ("qint4", torch.bfloat16, "TinyGemmWeightQBitsTensor"),
    "int4 f32": ("qint4", torch.float32, "WeightQBitsTensor"),
    "int8 f32": ("qint8", torch.float32, "WeightQBytesTensor"),
}


def quantized_model(form: str, seed: int, num_layers: int = 2, tied: bool = False) -> LlamaForCausalLM:
    """A small Llama (hidden 128: quanto's 128-wide int4 groups fit) whose decoder layers are quantized."""
    from optimum import quanto

    weights, dtype, _ = FORMS[form]
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked next-token distributions, like a trained model's
    quanto.quantize(model, weights=getattr(quanto, weights), include=["model.layers.*"])
    quanto.freeze(model)
    return model


def prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(seed))


@settings(max_examples=12)
@given(
    form=st.sampled_from(sorted(FORMS)),
    seed=st.integers(0, 2**16),
    prefetch=st.integers(1, 3),
    cpu_bytes=st.sampled_from([0, 60_000]),  # everything on disk, or the embedding in RAM
    tied=st.booleans(),
    budget=st.integers(1, 16),
)
def test_quantized_layers_stream_from_disk_bit_equal_and_specexec_equals_their_greedy(
    form, seed, prefetch, cpu_bytes, tied, budget
):
    reference = quantized_model(form, seed, tied=tied)
    ids = prompt(seed, 7)
    with torch.no_grad():
        expected_logits = reference(ids).logits
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False)
    with tempfile.TemporaryDirectory() as folder:
        streamed = load_offloaded(
            quantized_model(form, seed, tied=tied), max_memory={"cpu": cpu_bytes}, offload_folder=folder,
            executor="stream", prefetch=prefetch,
        )
        assert streamed.hf_device_map["model.layers.0"] == "disk"
        weight = streamed.model.layers[1].mlp.down_proj.weight
        assert type(weight).__name__ == FORMS[form][2]
        assert any(name.startswith("model.layers.1.mlp.down_proj.weight.") for name in os.listdir(folder))
        with torch.no_grad():
            for _ in range(3):  # the ring wraps around: every layer read again
                assert torch.equal(streamed(ids).logits, expected_logits)
        got = streamed.generate(
            ids, max_new_tokens=12, do_sample=False, assistant_model=quantized_model(form, seed + 1),
            speculator="specexec", budget=budget,
        )
        layer_streamer(streamed).close()
    assert got.tolist() == expected.tolist()


def test_the_packed_bytes_are_streamed_and_the_model_given_keeps_no_copy():
    model = quantized_model("int4 bf16", 1)
    with tempfile.TemporaryDirectory() as folder:
        streamed = load_offloaded(model, max_memory={"cpu": 0}, offload_folder=folder, executor="stream")
        streamer = layer_streamer(streamed)
        sixteen_bit_bytes = 2 * sum(p.numel() for p in streamed.model.layers.parameters())
        layer_files = [name for name in os.listdir(folder) if name.startswith("model.layers.")]
        stored_bytes = sum(os.path.getsize(os.path.join(folder, name)) for name in layer_files)
        assert 0.25 * sixteen_bit_bytes <= stored_bytes < 0.4 * sixteen_bit_bytes  # packed int4 and scales
        packed = streamed.model.layers[0].mlp.up_proj.weight._data._data
        buffers = [slot.buffer for slot in streamer._slots]
        assert any(b.data_ptr() <= packed.data_ptr() < b.data_ptr() + b.numel() for b in buffers)  # a ring view
        streamer.close()


def test_placing_on_disk_never_calls_state_dict():
    """quanto's state_dict() unpacks int4 TinyGemm weights through a product with an identity matrix on the CPU:
    minutes for a large layer. The inner tensors are written as they are."""
    reference = quantized_model("int4 bf16", 2)
    placing = quantized_model("int4 bf16", 2)

    def refuse(*args, **kwargs):
        raise AssertionError("state_dict() called while placing")

    placing.state_dict = refuse
    ids = prompt(2, 5)
    with tempfile.TemporaryDirectory() as folder:
        streamed = load_offloaded(placing, max_memory={"cpu": 0}, offload_folder=folder, executor="stream")
        with torch.no_grad():
            assert torch.equal(streamed(ids).logits, reference(ids).logits)
        layer_streamer(streamed).close()


def test_accelerates_hooks_refuse_quantized_weights_on_disk_before_writing_anything():
    with tempfile.TemporaryDirectory() as folder:
        with pytest.raises(ValueError, match=r"quantized .* CPU stream executor .* max_memory\['cpu'\]"):
            load_offloaded(quantized_model("int8 f32", 0), max_memory={"cpu": 0}, offload_folder=folder,
                           executor="accelerate")
        assert not os.listdir(folder)


@pytest.mark.parametrize("change", ["truncated", "rewritten"])
def test_a_changed_inner_tensor_file_is_named_not_computed_with(change):
    ids = prompt(4, 5)
    with tempfile.TemporaryDirectory() as folder:
        streamed = load_offloaded(quantized_model("int4 bf16", 4), max_memory={"cpu": 0}, offload_folder=folder,
                                  executor="stream")
        path = os.path.join(folder, "model.layers.1.mlp.gate_proj.weight._data._data.dat")
        if change == "truncated":
            os.truncate(path, os.path.getsize(path) // 2)
        else:  # same size, other bytes: another model offloaded to the same folder meanwhile
            size = os.path.getsize(path)
            with open(path, "wb") as handle:
                handle.write(bytes(size))
            os.utime(path, ns=(0, 0))
        with pytest.raises(direct_io.WeightFileError, match=r"gate_proj\.weight\._data\._data\.dat"):
            with torch.no_grad():
                streamed(ids)
        layer_streamer(streamed).close()


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("layers_in_ram", [False, True])  # every layer on disk, or the first two of four in RAM
def test_a_checkpoint_quantized_as_it_loads_streams_bit_equal_to_quantos_model(form, layers_in_ram):
    """load_offloaded(path, quantize=...): the layers are quantized one at a time as they load and written packed;
    the outputs are those of the same checkpoint loaded whole and quantized in memory."""
    from optimum import quanto

    weights, dtype, kind = FORMS[form]
    source = quantized_model(form, 7, num_layers=4)  # only for its config; the checkpoint holds 16/32-bit weights
    cpu_bytes = ({"int4": 300_000, "int8": 500_000}[form[:4]] if layers_in_ram else 0)  # sized by packed bytes
    torch.manual_seed(7)
    plain = LlamaForCausalLM(source.config).to(dtype).eval()
    ids = prompt(7, 6)
    with tempfile.TemporaryDirectory() as checkpoint, tempfile.TemporaryDirectory() as folder:
        plain.save_pretrained(checkpoint)
        reference = LlamaForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="sdpa").eval()
        quanto.quantize(reference, weights=getattr(quanto, weights), include=["model.layers.*"])
        quanto.freeze(reference)
        streamed = load_offloaded(checkpoint, max_memory={"cpu": cpu_bytes}, offload_folder=folder, quantize=form[:4])
        placement = streamed.hf_device_map
        layer_places = [placement[f"model.layers.{i}"] for i in range(4)]
        assert layer_places == (["cpu", "cpu", "disk", "disk"] if layers_in_ram else ["disk"] * 4)
        for position, layer in enumerate(streamed.model.layers):
            assert type(layer.mlp.down_proj.weight).__name__ == kind, position  # in RAM and on disk alike
        on_disk = {name.split(".weight._")[0] for name in os.listdir(folder) if ".weight._" in name}
        assert on_disk == {f"model.layers.{i}.{p}" for i in range(4) if layer_places[i] == "disk"
                           for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(streamed(ids).logits, reference(ids).logits)
        expected = reference.generate(ids, max_new_tokens=10, do_sample=False)
        got = streamed.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=quantized_model(form, 8),
                                speculator="specexec", budget=8)
        layer_streamer(streamed).close()
    assert got.tolist() == expected.tolist()


def test_quantize_is_refused_where_it_cannot_apply_before_loading():
    model = quantized_model("int8 f32", 0)
    with tempfile.TemporaryDirectory() as folder:
        with pytest.raises(ValueError, match=r"quantize='int3' is not one of \['int8', 'int4'\]"):
            load_offloaded(folder, max_memory={"cpu": 0}, offload_folder=folder, quantize="int3")
        with pytest.raises(ValueError, match=r"quantize a model in memory with optimum-quanto"):
            load_offloaded(model, max_memory={"cpu": 0}, offload_folder=folder, quantize="int8")
        with pytest.raises(ValueError, match=r"pass offload_folder="):
            load_offloaded(folder, max_memory={"cpu": 0}, quantize="int8")
        model.config.save_pretrained(folder)
        with pytest.raises(ValueError, match=r"CPU stream executor only"):
            load_offloaded(folder, max_memory={"cpu": 0}, offload_folder=folder, executor="accelerate",
                           quantize="int8")
        assert os.listdir(folder) == ["config.json"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_placement_sizes_layers_quantized_as_they_load_by_their_packed_bytes(dtype):
    """A budget that holds two int4 layers of four holds none of them at 16 or 32 bits."""
    from specexec_hf.offload import offload_device_map
    from specexec_hf.offload.quantize import packed_dtypes

    model = LlamaForCausalLM(quantized_model("int4 bf16", 0, num_layers=4).config).to(dtype)
    layers = [f"model.layers.{i}" for i in range(4)]
    packed = packed_dtypes(model, layers, "int4")
    assert set(packed) == {f"{layer}.{name}.weight" for layer in layers for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")}
    assert [offload_device_map(model, {"cpu": 300_000}, dtype, packed)[layer] for layer in layers] == [
        "cpu", "cpu", "disk", "disk"]
    assert [offload_device_map(model, {"cpu": 300_000}, dtype)[layer] for layer in layers] == ["disk"] * 4
