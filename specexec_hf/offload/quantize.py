"""Decoder layers quantized with optimum-quanto as a checkpoint loads, one layer at a time, for the CPU stream
executor: a checkpoint bigger than RAM becomes a packed int4/int8 model on disk without ever being in memory whole.

``load_offloaded(path, ..., quantize="int4")`` dispatches the checkpoint with its disk-placed units left on the meta
device (read in place from safetensors), then :func:`quantize_layers` takes each decoder layer in turn: a
disk-placed layer is read from the checkpoint (converted to the model's dtype as ``from_pretrained`` converts),
quantized and frozen by quanto, written to the offload folder as plain inner tensors
(:func:`~.folder.write_offload_folder`) and left on the meta device again, so only one 16-bit layer is ever in
memory; a layer placed in RAM is quantized where it is. The folder's ``index.json`` also names the checkpoint's
copies of the other disk-placed weights (embedding, head), so that :class:`~.stream.LayerStreamer` finds every
streamed weight through the folder.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .direct_io import WeightFile
from .folder import extend_offload_index, leave_on_meta, stored_tensors, write_offload_folder
from .stream import _detach_accelerate_hooks, _offloaded_weight_locator, _stored_weight, parameter_aliases

logger = logging.getLogger(__name__)

QUANTIZED_WEIGHTS = ("int8", "int4")


def check_quantize(quantize: str | None) -> None:
    """Refuses an unknown ``quantize`` value, or optimum-quanto missing, before anything loads."""
    if quantize is None:
        return
    if quantize not in QUANTIZED_WEIGHTS:
        raise ValueError(f"quantize={quantize!r} is not one of {list(QUANTIZED_WEIGHTS)} (or None).")
    try:
        from optimum import quanto  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"quantize={quantize!r} quantizes with optimum-quanto, which is not installed: "
            "pip install 'specexec-hf[quanto]'."
        ) from error


def packed_dtypes(model: nn.Module, layers: list[str], quantize: str) -> dict[str, Any]:
    """The dtype that accelerate's placement should size each weight of ``layers`` that quanto quantizes (their
    linear layers' weights) by: its packed width (``int8``: 1 byte; ``int4``: half a byte, accelerate's
    ``CustomDtype.INT4``). Scales and shifts are not counted: about 6% more for int4's 128-wide groups over bf16.

    Args:
        model: The model, possibly on the meta device.
        layers: The decoder layers ``quantize`` applies to.
        quantize: ``"int8"`` or ``"int4"``.
    """
    from accelerate.utils import CustomDtype

    packed = {"int8": torch.int8, "int4": CustomDtype.INT4}[quantize]
    return {
        f"{layer}.{name}.weight": packed
        for layer in layers
        for name, module in model.get_submodule(layer).named_modules()
        if isinstance(module, nn.Linear)
    }


def quantize_layers(
    model: nn.Module, layers: list[str], disk_units: list[str], quantize: str, offload_folder: str | os.PathLike
) -> None:
    """Quantizes the decoder ``layers`` of a model dispatched from a checkpoint, one at a time (see the module).

    Removes accelerate's hooks: afterwards the offload folder's ``index.json`` locates every disk-placed weight.

    Args:
        model: The model ``from_pretrained`` dispatched (disk-placed units on the meta device).
        layers: The decoder layers to quantize, each a weight unit.
        disk_units: The weight units placed on disk (the others are in RAM).
        quantize: ``"int8"`` or ``"int4"``: quanto's ``qint8`` / ``qint4`` weights.
        offload_folder: Where the quantized disk-placed layers are written.
    """
    from optimum import quanto

    weights = {"int8": quanto.qint8, "int4": quanto.qint4}[quantize]
    locate = _offloaded_weight_locator(model)
    _detach_accelerate_hooks(model)
    aliases = parameter_aliases(model)
    files: dict[str, WeightFile] = {}
    slow = quantize == "int4" and next(model.parameters()).dtype != torch.bfloat16
    if slow:
        logger.warning(
            "quantize='int4' over %s keeps quanto's generic packed form, which unpacks on every product (20-40x "
            "slower than over bfloat16 on a CPU): load with dtype=torch.bfloat16 for torch's int4 CPU kernel.",
            next(model.parameters()).dtype,
        )
    for layer in layers:
        module = model.get_submodule(layer)
        on_disk = layer in disk_units
        if on_disk:
            for owner, attribute, parameter in list(_meta_parameters(module)):
                stored = _stored_weight(aliases[id(parameter)], locate, files)
                values = stored.tensor().view(parameter.shape).to(parameter.dtype)
                setattr(owner, attribute, nn.Parameter(values, requires_grad=False))
        quanto.quantize(module, weights=weights)
        quanto.freeze(module)
        if on_disk:
            write_offload_folder(offload_folder, stored_tensors(model, [layer]))
            leave_on_meta(model, [layer])
    quantized = set(layers)
    elsewhere = {}
    for unit in (name for name in disk_units if name not in quantized):
        for _, parameter in model.get_submodule(unit).named_parameters(remove_duplicate=False):
            for name in aliases[id(parameter)]:
                try:
                    elsewhere[name] = locate(name)[2]
                except KeyError:
                    continue
    extend_offload_index(offload_folder, elsewhere)


def _meta_parameters(module: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    """``(owner, attribute, parameter)`` for each parameter of ``module`` on the meta device."""
    for owner in module.modules():
        for attribute, parameter in owner._parameters.items():
            if parameter is not None and parameter.is_meta:
                yield owner, attribute, parameter
