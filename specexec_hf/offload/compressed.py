"""4-bit checkpoints as 70B models are downloaded: GPTQ-style packed integers in compressed-tensors' "pack-quantized"
format (what llm-compressor writes and vLLM serves), made optimum-quanto layers over the same integers, which the
offload folder stores and the executors stream packed.

transformers reads such a checkpoint through compressed-tensors, pure torch on the CPU and the GPU alike, no
compiler (docs/offloading.md says why this reader): with ``CompressedTensorsConfig(dequantize=False)`` each linear
layer keeps its packed weight (``weight_packed``, ``weight_scale``, ``weight_zero_point``), which compressed-tensors
would decompress, the whole model at once, into 16-bit weights in the first forward. :func:`quanto_from_compressed`
replaces those layers before that, each by a quanto layer holding the checkpoint's integers and scales, in the form
that computes best where the model will run (``device``):

- ``"cpu"``: int4 as quanto's TinyGemm weight, whose product is torch's packed int4 CPU kernel (faster than a
  dense float32 product at every width, issue 56), with no compiler: quanto's generic int4 form would unpack
  through its C++ extension, built on first use. That kernel takes bfloat16 scales in groups of 128 input features
  around the midpoint of the 4-bit range, so only symmetric int4 with such scales (or one scale per row, repeated
  over its groups) converts, its values ``(q - 8) * scale``, exactly the checkpoint's.
- any other device (a GPU, through the device executor): int4 in quanto's generic packing, with the checkpoint's
  zero points and any group size: the device executor expands it into the dense weight inside the ring slot
  (:mod:`.expand`), bit-equal to compressed-tensors' own decompression (both subtract the zero point from the
  integers exactly and round the product by the scale once), again without a compiler.

int8 symmetric with one scale per row becomes quanto's int8 weight on every device (its product is torch's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import PreTrainedModel

ModelT = TypeVar("ModelT", bound=nn.Module)

INT4_OFFSET = 8
"""What compressed-tensors adds to the signed 4-bit integers it packs (and quanto's unsigned nibbles hold)."""
CPU_GROUP_SIZE = 128
"""The one group size of quanto's TinyGemm int4 weight (torch's int4 CPU kernel)."""
_DEQUANTIZED_FIX = (
    "Load the checkpoint with CompressedTensorsConfig(dequantize=True) instead (16-bit weights; quantize them with "
    "optimum-quanto in memory, or save them and use load_offloaded(path, quantize='int4'))"
)


@dataclass(frozen=True)
class PackedScheme:
    """What a compressed-tensors packed linear layer holds.

    Args:
        bits: The integers' width.
        symmetric: Whether the integers are centred (no zero points).
        group_size: Consecutive input features per scale; ``None``: one scale per row.
        scale_dtype: The scales' dtype, which the layer computes in.
        extras: Parameters quanto has no form for (``weight_g_idx``: activation ordering; a global scale).
    """

    bits: int
    symmetric: bool
    group_size: int | None
    scale_dtype: torch.dtype
    extras: tuple[str, ...]

    @classmethod
    def of(cls, module: Any) -> PackedScheme:
        """The scheme of ``module``, a linear layer compressed-tensors packed (attributes compressed-tensors adds)."""
        scheme = module.quantization_scheme.weights
        columns = int(module.weight_shape[1])
        groups = module.weight_scale.shape[-1]
        extras = tuple(name for name in ("weight_g_idx", "weight_global_scale") if hasattr(module, name))
        return cls(
            bits=scheme.num_bits if scheme.type == "int" else 0,
            symmetric=bool(scheme.symmetric),
            group_size=None if groups == 1 else columns // groups,
            scale_dtype=module.weight_scale.dtype,
            extras=extras,
        )

    def unsupported(self, columns: int, on_cpu: bool) -> str | None:
        """Why this scheme has no quanto form that computes on the CPU (``on_cpu``) or on a device; ``None`` if it
        has one."""
        if self.extras:
            return f"it has {', '.join(self.extras)} (activation ordering or a global scale)"
        if self.bits == 8:
            if not self.symmetric or self.group_size is not None:
                return "int8 converts only symmetric with one scale per row"
            return None
        if self.bits != 4:
            return f"its integers are {self.bits or 'not'}-bit (int4 and int8 only)"
        if not on_cpu:
            return None
        if not self.symmetric:
            return "torch's int4 CPU kernel has no zero points (symmetric int4 only; on a GPU device='cuda' takes it)"
        if self.scale_dtype != torch.bfloat16:
            return f"its scales are {self.scale_dtype}; torch's int4 CPU kernel takes bfloat16 scales"
        if (self.group_size or CPU_GROUP_SIZE) != CPU_GROUP_SIZE or columns % CPU_GROUP_SIZE:
            return (f"its groups are {self.group_size or columns} wide; torch's int4 CPU kernel takes groups of "
                    f"{CPU_GROUP_SIZE} (or one scale per row of a multiple of {CPU_GROUP_SIZE})")
        return None


def packed_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether checkpoint ``path`` (a folder or a hub id) is compressed-tensors packed (``pack-quantized``): what
    :func:`load_compressed` loads, and ``from_pretrained`` alone would decompress at every forward."""
    from transformers import AutoConfig

    quantization = _quantization_config(AutoConfig.from_pretrained(path))
    return quantization.get("quant_method") == "compressed-tensors" and quantization.get("format") == "pack-quantized"


def _quantization_config(config: Any) -> dict[str, Any]:
    """A model config's ``quantization_config`` as a dict (``{}`` without one)."""
    quantization = getattr(config, "quantization_config", None) or {}
    return quantization if isinstance(quantization, dict) else quantization.to_dict()


def load_compressed(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    skeleton: nn.Module | None = None,
) -> PreTrainedModel:
    """A compressed-tensors packed checkpoint (a local folder or a hub id) as a model of quanto layers over its
    integers (:func:`quanto_from_compressed`), in host memory, ready for
    ``load_offloaded(model, max_memory=..., offload_folder=...)``.

    Args:
        path: The checkpoint.
        device: Where the model will compute (see :func:`quanto_from_compressed`).
        dtype: The dtype of the layers left unquantized (embedding, norms, head); ``None``: the checkpoint's.
        skeleton: ``packed_skeleton(path, dtype)`` where the caller has built it already (``load_offloaded`` plans
            the placement on it), so that it is not built twice; ``None``: built here.

    Raises:
        ValueError: The checkpoint is not compressed-tensors packed, or a layer's scheme has no quanto form
            computing on ``device`` (as :func:`quanto_from_compressed` says): both checked before its weights load.
    """
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from ..hf.compat import use_sdpa_attention

    if not packed_checkpoint(path):
        raise ValueError(
            f"{path} is not a compressed-tensors 'pack-quantized' checkpoint (its config.json has no such "
            "quantization_config). Load it with load_offloaded(path, ...), with quantize='int4' to quantize it."
        )
    check_convertible(packed_skeleton(path, dtype) if skeleton is None else skeleton, device)
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=CompressedTensorsConfig(dequantize=False), dtype=dtype or "auto",
        attn_implementation="sdpa",
    )
    return use_sdpa_attention(quanto_from_compressed(model, device)).eval()


def quanto_from_compressed(model: ModelT, device: str | torch.device = "cpu") -> ModelT:
    """Replaces, in place, each linear layer holding a compressed-tensors packed weight by an optimum-quanto
    ``QLinear`` over the same integers, in the form that computes on ``device`` (see the module), and drops
    compressed-tensors' decompress-on-first-forward hook. Every layer's scheme is checked before any is converted.

    Load the checkpoint with ``AutoModelForCausalLM.from_pretrained(path,
    quantization_config=CompressedTensorsConfig(dequantize=False))`` (or use :func:`load_compressed`), call this
    before any forward, then place the model (``load_offloaded(model, max_memory=..., offload_folder=...)``).

    Args:
        model: The model as transformers loaded it.
        device: Where it will compute: ``"cpu"`` (torch's int4 CPU kernel) or a GPU (the device executor expands
            the packed weights in its ring).

    Returns:
        ``model``.

    Raises:
        ValueError: A packed layer's scheme has no quanto form computing on ``device``, named with the layer, the
            reason and the fix; nothing is converted then.
    """
    on_cpu = torch.device(device).type == "cpu"
    check_convertible(model, device)
    for name, module in packed_linears(model):
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, _quanto_linear(module, on_cpu))
    hook = getattr(model, "ct_decompress_hook", None)
    if hook is not None:
        hook.remove()
        del model.ct_decompress_hook
    return model


def check_convertible(model: nn.Module, device: str | torch.device) -> None:
    """Checks that every compressed-tensors packed linear layer of ``model`` (loaded, or its structure on the meta
    device) has a quanto form computing on ``device``.

    Raises:
        ValueError: The first layer that has none, named with its scheme, the reason and the fix.
    """
    on_cpu = torch.device(device).type == "cpu"
    for name, module in packed_linears(model):
        scheme = PackedScheme.of(module)
        reason = scheme.unsupported(int(module.weight_shape[1]), on_cpu)
        if reason is not None:
            where = "the CPU" if on_cpu else str(device)
            raise ValueError(
                f"{name} is packed as {scheme.bits}-bit int, {'symmetric' if scheme.symmetric else 'asymmetric'}, "
                f"scale per {scheme.group_size or 'row'}{' inputs' if scheme.group_size else ''} "
                f"({scheme.scale_dtype}), which cannot run as quanto layers on {where}: {reason}. {_DEQUANTIZED_FIX}."
            )


def packed_linears(model: nn.Module) -> list[tuple[str, Any]]:
    """``model``'s linear layers holding a compressed-tensors packed weight, with their names."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and "weight_packed" in module._parameters]


def packed_skeleton(path: str | os.PathLike[str], dtype: torch.dtype | None) -> nn.Module:
    """Checkpoint ``path``'s model on the meta device, its linear layers given the packed parameters (shapes,
    dtypes, schemes) that ``from_pretrained`` with ``CompressedTensorsConfig(dequantize=False)`` and ``dtype`` gives
    them, as transformers' quantizer does before the weights load: what :func:`check_convertible` reads, no
    weight read."""
    from accelerate import init_empty_weights
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig

    config = AutoConfig.from_pretrained(path)
    compression = CompressedTensorsConfig.from_dict({**_quantization_config(config), "dequantize": False})
    compressor = ModelCompressor.from_compression_config(compression)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype or getattr(config, "dtype", None))
    apply_quantization_config(skeleton, compressor.quantization_config, run_compressed=False)
    compressor.compress_model(model=skeleton)
    return skeleton


def _quanto_linear(module: Any, on_cpu: bool) -> nn.Module:
    """The quanto ``QLinear`` holding ``module``'s packed weight (a scheme :class:`PackedScheme` accepts)."""
    from optimum.quanto import QLinear, qint4, qint8

    bits = module.quantization_scheme.weights.num_bits
    linear = QLinear(int(module.weight_shape[1]), int(module.weight_shape[0]), bias=module.bias is not None,
                     weights=qint4 if bits == 4 else qint8, dtype=module.weight_scale.dtype, device="meta")
    weight = _int4_weight(module, on_cpu) if bits == 4 else _int8_weight(module)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = module.bias
    linear.input_scale = torch.ones((), dtype=weight.dtype)
    linear.output_scale = torch.ones((), dtype=weight.dtype)
    return linear


def _int4_weight(module: Any, on_cpu: bool) -> torch.Tensor:
    """quanto's int4 weight over ``module``'s integers: TinyGemm's on the CPU, the generic packing elsewhere."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from optimum.quanto import WeightQBitsTensor, qint4

    rows, columns = (int(size) for size in module.weight_shape)
    scale = module.weight_scale.detach()
    if on_cpu and scale.shape[-1] == 1:  # one scale per row: the same scale for each of the row's groups
        scale = scale.expand(rows, columns // CPU_GROUP_SIZE)
    group_size = columns // scale.shape[-1]
    groups = rows * columns // group_size
    grid = scale.shape  # [rows, groups per row]: the zero points' packed shape
    values = unpack_from_int32(module.weight_packed.detach(), 4, (rows, columns)) + INT4_OFFSET
    values = values.to(torch.uint8).reshape(groups, group_size)
    scale = scale.reshape(groups, 1)
    if on_cpu:  # TinyGemm takes a float shift, subtracted after scaling: 8 * scale, exact (a power of two)
        return WeightQBitsTensor.create(qint4, 0, group_size, (rows, columns), (columns, 1), values, scale,
                                        INT4_OFFSET * scale)
    if module.quantization_scheme.weights.symmetric:
        zero_point = torch.full((groups, 1), INT4_OFFSET, dtype=torch.uint8)
    else:
        zero_point = unpack_from_int32(module.weight_zero_point.detach(), 4, grid, packed_dim=0)
        zero_point = (zero_point + INT4_OFFSET).to(torch.uint8).reshape(groups, 1)
    return WeightQBitsTensor(qint4, 0, group_size, (rows, columns), (columns, 1), values, scale, zero_point)


def _int8_weight(module: Any) -> torch.Tensor:
    """quanto's int8 weight (one scale per row) over ``module``'s integers."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from optimum.quanto import WeightQBytesTensor, qint8

    rows, columns = (int(size) for size in module.weight_shape)
    values = unpack_from_int32(module.weight_packed.detach(), 8, (rows, columns)).to(torch.int8)
    scale = module.weight_scale.detach().reshape(rows, 1)
    return WeightQBytesTensor(qint8, 0, (rows, columns), (columns, 1), values, scale, activation_qtype=None)
