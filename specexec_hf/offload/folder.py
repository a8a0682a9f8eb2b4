"""The offload folder: the weights of disk-placed units written in accelerate's offload format (one raw ``.dat``
file per tensor, ``index.json``), tensor subclasses (quantized weights) as their plain inner tensors, and the
model's parameters left on the meta device in the same form, for :class:`~.stream.LayerStreamer` to stream."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .layout import span_bytes

_PAGE = 4096  # the unit a filesystem allocates, for the free-space check before offloading


def write_offload_folder(folder: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Writes weights to ``folder`` in accelerate's offload format: one raw ``<name>.dat`` file each, ``index.json``.

    Each file starts at offset 0, so direct reads of it need no realignment. The free space is checked before the
    first byte is written, and the files are written with plain writes (accelerate maps them, so a disk filling up
    meanwhile kills the process with ``SIGBUS`` instead of raising an error).

    Args:
        folder: The offload folder (created if missing). An ``index.json`` already there is extended.
        state_dict: The weights by name.

    Raises:
        OSError: ``ENOSPC``, before writing when the folder's filesystem lacks the room, or while writing when it
            fills up meanwhile; the message names the folder, the bytes needed and the fix.
    """
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    needed = sum(-(-tensor.nbytes // _PAGE) * _PAGE for tensor in state_dict.values())
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise OSError(errno.ENOSPC, _no_room(folder, needed, free))
    written = {}
    try:
        for name, tensor in state_dict.items():
            stored = tensor.detach().cpu().contiguous()
            dtype = str(stored.dtype).removeprefix("torch.")
            if stored.dtype == torch.bfloat16:  # numpy has no bfloat16: accelerate stores its bits as int16
                stored = stored.view(torch.int16)
            _write_tensor_file(os.path.join(folder, f"{name}.dat"), stored.reshape(-1))
            written[name] = {"dtype": dtype, "shape": list(tensor.shape)}
        extend_offload_index(folder, written)
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        raise OSError(errno.ENOSPC, _no_room(folder, needed, shutil.disk_usage(folder).free)) from error


def _no_room(folder: str, needed: int, free: int) -> str:
    return (
        f"No space left in the offload folder {folder}: the weights placed on disk need {needed / 2**20:.1f} MiB, "
        f"the filesystem has {free / 2**20:.1f} MiB free. Free some space, choose an offload_folder on a larger "
        "disk, or raise max_memory['cpu'] so that less goes to disk."
    )


def _write_tensor_file(path: str, flat: torch.Tensor) -> None:
    """Writes a contiguous 1-d tensor's bytes to ``path``."""
    with open(path, "wb") as handle:
        handle.write(memoryview(flat.view(torch.uint8).numpy()))


def extend_offload_index(folder: str | os.PathLike, entries: Mapping[str, dict[str, Any]]) -> None:
    """Adds ``entries`` (accelerate's offload index format: ``dtype`` and ``shape`` of a ``<name>.dat`` file, or
    ``safetensors_file`` and ``weight_name`` of a tensor read in place) to ``folder``'s ``index.json``."""
    os.makedirs(folder, exist_ok=True)
    index_path = os.path.join(folder, "index.json")
    index = {}
    if os.path.isfile(index_path):
        with open(index_path) as handle:
            index = json.load(handle)
    index.update(entries)
    with open(index_path, "w") as handle:
        json.dump(index, handle, indent=2)


def stored_tensors(model: nn.Module, units: list[str]) -> dict[str, torch.Tensor]:
    """What the offload folder holds for ``units``: each parameter by every name it has (as ``state_dict()``
    names them, without calling it), a tensor subclass as its plain inner tensors (``<name>.<inner path>``), each the
    span from its first element to its last in memory order, so that its strides can be kept."""
    stored: dict[str, torch.Tensor] = {}
    for unit in units:
        for local_name, parameter in model.get_submodule(unit).named_parameters(remove_duplicate=False):
            name = f"{unit}.{local_name}"
            if type(parameter) in (torch.Tensor, nn.Parameter):
                stored[name] = parameter.detach()
            else:
                stored.update(
                    (f"{name}.{path}", inner.as_strided((span_bytes(inner) // inner.element_size(),), (1,)))
                    for path, inner in _inner_tensors(parameter.detach())
                )
    return stored


def _inner_tensors(tensor: torch.Tensor, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The plain inner tensors of tensor subclass ``tensor`` (``__tensor_flatten__``, nested), by dotted path."""
    for name in tensor.__tensor_flatten__()[0]:
        inner = getattr(tensor, name)
        if type(inner) is torch.Tensor:
            yield f"{prefix}{name}", inner
        else:
            yield from _inner_tensors(inner, f"{prefix}{name}.")


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s form without its data: a plain tensor as a contiguous meta tensor (as the folder stores it), a
    tensor subclass rebuilt over meta inner tensors with their strides."""
    if type(tensor) is torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    names, context = tensor.__tensor_flatten__()
    inner = {}
    for name in names:
        part = getattr(tensor, name)
        inner[name] = (
            torch.empty_strided(part.shape, part.stride(), dtype=part.dtype, device="meta")
            if type(part) is torch.Tensor
            else _on_meta(part)
        )
    return type(tensor).__tensor_unflatten__(inner, context, tensor.size(), tensor.stride())


def leave_on_meta(model: nn.Module, units: list[str]) -> None:
    """Replaces the parameters of ``units`` by meta tensors of their form, freeing their memory; a parameter tied
    to a module outside ``units`` stays (the streamer treats it as resident). Tied parameters stay tied."""
    outside = {
        id(parameter)
        for name, parameter in model.named_parameters(remove_duplicate=False)
        if not any(name.startswith(unit + ".") for unit in units)
    }
    replaced: dict[int, nn.Parameter] = {}
    for unit in units:
        for module in model.get_submodule(unit).modules():
            for attribute, parameter in list(module._parameters.items()):
                if parameter is None or id(parameter) in outside or parameter.is_meta:
                    continue
                if id(parameter) not in replaced:
                    replaced[id(parameter)] = nn.Parameter(_on_meta(parameter.detach()), requires_grad=False)
                module._parameters[attribute] = replaced[id(parameter)]
