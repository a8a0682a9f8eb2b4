"""4-bit checkpoints as 70B models are downloaded: GPTQ-style packed int4 in compressed-tensors' "pack-quantized"
format (what llm-compressor writes and vLLM serves), made optimum-quanto int4 layers over the same integers, so that
the executors stream them packed, and the device executor expands them on the GPU (:mod:`.expand`).

transformers reads such a checkpoint through compressed-tensors, pure torch on the CPU and the GPU alike, no
compiler (docs/offloading.md says why this reader): with ``CompressedTensorsConfig(dequantize=False)`` each linear
layer keeps its packed weight (``weight_packed``, ``weight_scale``, ``weight_zero_point``), which compressed-tensors
would decompress, the whole model at once, into 16-bit weights in the first forward. :func:`quanto_from_compressed`
replaces those layers before that: each becomes a quanto int4 layer holding the checkpoint's integers, scales and
zero points, whose ``dequantize()`` is bit-equal to compressed-tensors' own decompression (both subtract the zero
point from the integers exactly and round the product by the scale once).
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_BITS = 4
UNSIGNED_OFFSET = 1 << (PACKED_BITS - 1)
"""What compressed-tensors adds to the signed 4-bit integers it packs (and quanto's unsigned nibbles hold)."""


def quanto_from_compressed(model: nn.Module) -> nn.Module:
    """Replaces, in place, each linear layer holding a compressed-tensors packed int4 weight by an optimum-quanto
    int4 ``QLinear`` over the same integers, and drops compressed-tensors' decompress-on-first-forward hook.

    Load the checkpoint with ``AutoModelForCausalLM.from_pretrained(path,
    quantization_config=CompressedTensorsConfig(dequantize=False))``, call this before any forward, then place the
    model (``load_offloaded(model, max_memory=...)``).

    Returns:
        ``model``.

    Raises:
        ValueError: A packed layer's scheme is not weight-only int4 with a scale per group of consecutive input
            features (or per output row): activation ordering (``actorder``), other widths and global scales have
            no quanto int4 equivalent; named with the layer.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and "weight_packed" in module._parameters:
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent), attribute, _quanto_linear(name, module))
    hook = getattr(model, "ct_decompress_hook", None)
    if hook is not None:
        hook.remove()
        del model.ct_decompress_hook
    return model


def _quanto_linear(name: str, module: nn.Linear) -> nn.Module:
    """The quanto int4 ``QLinear`` holding ``module``'s packed weight (see :func:`quanto_from_compressed`)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from optimum.quanto import QLinear, WeightQBitsTensor, qint4

    scheme = module.quantization_scheme.weights
    extra = [attribute for attribute in ("weight_g_idx", "weight_global_scale") if hasattr(module, attribute)]
    if scheme.num_bits != PACKED_BITS or scheme.type != "int" or scheme.strategy not in ("group", "channel") or extra:
        raise ValueError(
            f"{name} is packed as {scheme.num_bits}-bit {scheme.type} per {scheme.strategy}"
            f"{' with ' + ', '.join(extra) if extra else ''}: only int4 with a scale per group of consecutive "
            "input features (or per row), without activation ordering, has a quanto int4 form. Load this checkpoint "
            "with CompressedTensorsConfig(dequantize=True) (16-bit weights) instead."
        )
    rows, columns = (int(size) for size in module.weight_shape)
    scale = module.weight_scale.detach()
    group_size = columns // scale.shape[-1]
    groups = rows * columns // group_size
    values = unpack_from_int32(module.weight_packed.detach(), PACKED_BITS, (rows, columns)) + UNSIGNED_OFFSET
    if scheme.symmetric:
        zero_point = torch.full((groups, 1), UNSIGNED_OFFSET, dtype=torch.uint8)
    else:
        zero_point = unpack_from_int32(module.weight_zero_point.detach(), PACKED_BITS, scale.shape, packed_dim=0)
        zero_point = (zero_point + UNSIGNED_OFFSET).to(torch.uint8).reshape(groups, 1)
    weight = WeightQBitsTensor(
        qint4, 0, group_size, (rows, columns), (columns, 1), values.to(torch.uint8).reshape(groups, group_size),
        scale.reshape(groups, 1), zero_point,
    )
    linear = QLinear(columns, rows, bias=module.bias is not None, weights=qint4, dtype=scale.dtype, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = module.bias
    linear.input_scale = torch.ones((), dtype=scale.dtype)
    linear.output_scale = torch.ones((), dtype=scale.dtype)
    return linear
