"""Model shapes the benchmarks build with random weights: a Llama shape's dimensions, the model built in memory or
written as a checkpoint one tensor at a time, its layers quantized, and forward seconds interpolated between token
counts."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.memory_cap import evict

GB = 1e9


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a Llama-family model, built with random weights.

    Args:
        name: Label in the report.
        hidden: Hidden size.
        intermediate: MLP intermediate size.
        layers: Decoder layers of the real model.
        heads: Attention heads.
        kv_heads: Key/value heads.
        vocab: Vocabulary size.
        tied: Whether the LM head shares the embedding.
    """

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False

    def config(self, layers: int | None = None) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=layers or self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=8192,
            tie_word_embeddings=self.tied,
            attn_implementation="sdpa",
        )

    def parameter_bytes(self, dtype: torch.dtype, layers: int | None = None) -> int:
        """Bytes of all parameters (tied ones once), counted on an empty meta-device model."""
        with torch.device("meta"):
            model = LlamaForCausalLM(self.config(layers)).to(dtype)
        return sum(p.nbytes for p in model.parameters())


# Public architectures' dimensions (their config.json files); the weights are random.
SHAPES = {
    "llama-8b": LlamaShape("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256),
    "llama-13b": LlamaShape("Llama-2-13B", 5120, 13824, 40, 40, 40, 32000),
    "llama-34b": LlamaShape("CodeLlama-34B", 8192, 22016, 48, 64, 8, 32000),
    "llama-70b": LlamaShape("Llama-3-70B", 8192, 28672, 80, 64, 8, 128256),
    "tiny": LlamaShape("tiny Llama", 64, 128, 4, 4, 2, 256),
}

DRAFT_SHAPES = {
    "llama-1b": LlamaShape("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 128256, tied=True),
    "tiny": LlamaShape("tiny draft", 32, 64, 2, 4, 2, 256, tied=True),
}


def random_llama(shape: LlamaShape, layers: int, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """A Llama of ``shape`` with ``layers`` decoder layers and random weights, on the CPU, in eval mode.

    Built on the meta device and filled from a small random pool (std 0.02; norms at 1): initialising billions of
    weights one random draw at a time would take minutes. Never zeros, which can run faster than real data.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(shape.config(layers)).to(dtype)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each module its own tensor: shared ones must be shared again
    pool = random_pool(dtype, seed)
    with torch.no_grad():
        for parameter in model.parameters():
            flat = parameter.view(-1)
            if parameter.dim() == 1:
                flat.fill_(1.0)
                continue
            for start in range(0, flat.numel(), pool.numel()):
                chunk = flat[start : start + pool.numel()]
                chunk.copy_(pool[: chunk.numel()])
    # Buffers (the rotary frequencies) are not parameters: rebuild them rather than leave them uninitialised.
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    model.generation_config.pad_token_id = 0
    return model.eval()


def sharing_weights(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A new model over ``model``'s parameter tensors (nothing copied), for one executor to place as it likes.

    Executors replace parameters rather than write into them, so one random build serves them all.
    """
    with torch.device("meta"):
        twin = LlamaForCausalLM(model.config).to(model.dtype)
    twin.load_state_dict(model.state_dict(), assign=True)
    twin.tie_weights()
    twin.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    twin.generation_config.pad_token_id = 0
    return twin.eval()


def quantize_layers(model: torch.nn.Module, weights: str, include: str = "model.layers.*") -> None:
    """Quantizes the decoder layers' (or the modules ``include`` names) linear weights in place with optimum-quanto
    (``"int8"`` or ``"int4"``); the
    embedding, norms and head keep their dtype, as in the common 4-bit checkpoints. Packed weights unpack on the
    GPU with quanto's portable kernel (``specexec_hf.patches.quanto_unpack``), not its CUDA extension, which quanto
    would otherwise compile inside the first timed forward; int4 weights packed here for the CPU leave it for the GPU
    by their learnt layout (``specexec_hf.patches.quanto_tinygemm_cpu``), not through a product over an identity
    matrix on the CPU, which kept the Llama-3-70B int4 section past its limit on the H200 (run 3)."""
    from optimum import quanto

    from specexec_hf.patches import quanto_tinygemm_cpu, quanto_unpack

    quanto_unpack.apply()
    quanto_tinygemm_cpu.apply()
    quanto.quantize(model, weights={"int8": quanto.qint8, "int4": quanto.qint4}[weights], include=[include])
    quanto.freeze(model)


def interpolate(points: dict[str, float], tokens: int) -> float | None:
    """Forward seconds at ``tokens``, linear between measured token counts; ``None`` outside them."""
    measured = sorted((int(n), s) for n, s in points.items())
    for (low, low_s), (high, high_s) in itertools.pairwise(measured):
        if low <= tokens <= high:
            return low_s + (high_s - low_s) * (tokens - low) / (high - low)
    return dict(measured).get(tokens)


def random_pool(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values (std 0.02) written over and over: a prime length, so that rows of power-of-two widths do not
    repeat each other."""
    return (torch.randn(4_194_301, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


def write_random_checkpoint(shape: LlamaShape, dtype: torch.dtype, directory: Path) -> Path:
    """A safetensors checkpoint of ``shape`` with random weights (std 0.02; norms at 1), one tensor in memory at a
    time, so that a shape bigger than the memory cap can be written under it. Reused when already there."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = directory / "model.safetensors"
    config = shape.config()
    config.torch_dtype = dtype
    if weights.is_file() and (directory / "config.json").is_file():
        return directory
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config).to(dtype)
    names = {name: tensor for name, tensor in skeleton.state_dict().items() if not name.endswith("rotary_emb.inv_freq")}
    if shape.tied:
        names.pop("lm_head.weight", None)
    header, offset = {}, 0
    dtype_name = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]
    for name, tensor in names.items():
        header[name] = {"dtype": dtype_name, "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    pool = random_pool(dtype)
    partial = weights.with_suffix(".partial")
    with open(partial, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little") + encoded)
        for tensor in names.values():
            if tensor.dim() == 1:
                handle.write(torch.ones(tensor.shape, dtype=dtype).view(torch.uint8).numpy().tobytes())
                continue
            left = tensor.numel()
            while left:
                chunk = pool[: min(left, pool.numel())]
                handle.write(chunk.view(torch.uint8).numpy().tobytes())
                left -= chunk.numel()
    partial.rename(weights)
    config.save_pretrained(directory)
    evict(weights)  # its dirty pages would be charged to this process's group and inflate the next cap
    return directory
