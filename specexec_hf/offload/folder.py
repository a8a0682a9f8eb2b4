"""The offload folder: the weights of disk-placed units written in accelerate's offload format (one raw ``.dat``
file per tensor, ``index.json``), tensor subclasses (quantized weights) as their plain inner tensors, and the
model's parameters left on the meta device in the same form, for :class:`~.stream.LayerStreamer` to stream."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .layout import span_bytes

logger = logging.getLogger(__name__)

_PAGE = 4096  # the unit a filesystem allocates, for the free-space check before offloading
_ROOM_FIX = (
    "Free some space, choose an offload_folder on a larger disk, or raise max_memory['cpu'] so that less goes to disk."
)


def write_offload_folder(folder: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Writes weights to ``folder`` in accelerate's offload format: one raw ``<name>.dat`` file each, ``index.json``.

    Each file starts at offset 0, so direct reads of it need no realignment. The free space is checked before the
    first byte is written (counting the files of the same names it overwrites), and the files are written with plain
    writes (accelerate maps them, so a disk filling up meanwhile kills the process with ``SIGBUS`` instead of raising
    an error). A write that fails removes the files it began, and ``index.json`` is replaced whole, never left
    half-written, so the folder can be loaded into again.

    Args:
        folder: The offload folder (created if missing). An ``index.json`` already there is extended.
        state_dict: The weights by name.

    Raises:
        OSError: ``ENOSPC``, before writing when the folder's filesystem lacks the room, or while writing when it
            fills up meanwhile; the message names the folder, the bytes needed and the fix. Any other failure to
            write (a read-only filesystem, no permission) with its ``errno``, naming the folder and the fix.
    """
    folder = os.fspath(folder)
    paths = {name: os.path.join(folder, f"{name}.dat") for name in state_dict}
    needed = sum(-(-tensor.nbytes // _PAGE) * _PAGE for tensor in state_dict.values())
    try:
        os.makedirs(folder, exist_ok=True)
        room = _room(folder, paths.values())
    except OSError as error:
        raise _unwritable(folder, error) from error
    if room is not None and needed > room:
        raise OSError(
            errno.ENOSPC,
            f"No space left in the offload folder {folder}: the weights placed on disk need {needed / 2**20:.1f} MiB, "
            f"the filesystem has {room / 2**20:.1f} MiB for them (its free space and the older files they replace). "
            + _ROOM_FIX,
        )
    begun: list[str] = []
    try:
        written = {}
        for name, tensor in state_dict.items():
            stored = tensor.detach().cpu().contiguous()
            dtype = str(stored.dtype).removeprefix("torch.")
            if stored.dtype == torch.bfloat16:  # numpy has no bfloat16: accelerate stores its bits as int16
                stored = stored.view(torch.int16)
            begun.append(paths[name])
            _write_tensor_file(paths[name], stored.reshape(-1))
            written[name] = {"dtype": dtype, "shape": list(tensor.shape)}
        _extend_index(folder, written)
    except BaseException as error:
        for path in begun:  # no file of a failed write is left to be taken for a whole one, or to fill the disk
            with contextlib.suppress(OSError):
                os.unlink(path)
        if not isinstance(error, OSError):
            raise
        if error.errno != errno.ENOSPC:
            raise _unwritable(folder, error) from error
        free_then = "the filesystem gave no free-space figure" if room is None else f"{room / 2**20:.1f} MiB were free"
        raise OSError(
            errno.ENOSPC,
            f"No space left in the offload folder {folder}: the disk filled up while the {needed / 2**20:.1f} MiB "
            f"of weights placed on disk were written ({free_then} when writing began: something else is filling "
            "it). The files begun were removed. " + _ROOM_FIX,
        ) from error


def _room(folder: str, overwritten: Iterable[str]) -> int | None:
    """Bytes ``folder``'s filesystem can give: what it has free plus what the ``overwritten`` files hold; ``None``
    where it reports no size at all (ramfs, some FUSE filesystems), which is not a full disk."""
    usage = shutil.disk_usage(folder)
    if usage.total == 0:
        return None
    held = 0
    for path in overwritten:
        with contextlib.suppress(FileNotFoundError):
            held += os.stat(path).st_blocks * 512  # st_blocks counts 512-byte units whatever the block size
    return usage.free + held


def _unwritable(folder: str, error: OSError) -> OSError:
    """``error`` (its ``errno``, hence its type) with a message naming the folder, the file and the fix."""
    return OSError(
        error.errno,
        f"Cannot write the offload folder {folder}: {error.strerror} ({error.filename or folder}). Choose an "
        "offload_folder on a writable local disk, or raise max_memory['cpu'] so that nothing goes to disk.",
    )


def _write_tensor_file(path: str, flat: torch.Tensor) -> None:
    """Writes a contiguous 1-d tensor's bytes to ``path``."""
    with open(path, "wb") as handle:
        handle.write(memoryview(flat.view(torch.uint8).numpy()))


def extend_offload_index(folder: str | os.PathLike, entries: Mapping[str, dict[str, Any]]) -> None:
    """Adds ``entries`` (accelerate's offload index format: ``dtype`` and ``shape`` of a ``<name>.dat`` file, or
    ``safetensors_file`` and ``weight_name`` of a tensor read in place) to ``folder``'s ``index.json``.

    Raises:
        OSError: The folder cannot be written (with its ``errno``), the message naming the folder and the fix.
    """
    folder = os.fspath(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        _extend_index(folder, entries)
    except OSError as error:
        raise _unwritable(folder, error) from error


def _extend_index(folder: str, entries: Mapping[str, dict[str, Any]]) -> None:
    """:func:`extend_offload_index` less the message: the new index goes to a file beside ``index.json`` that then
    replaces it, so that a failed write (a full disk) leaves the old index whole."""
    index_path = os.path.join(folder, "index.json")
    index = _readable_index(index_path)
    index.update(entries)
    partial = index_path + ".partial"
    try:
        with open(partial, "w") as handle:
            json.dump(index, handle, indent=2)
        os.replace(partial, index_path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def _readable_index(index_path: str) -> dict[str, Any]:
    """The offload index at ``index_path``; empty where there is none, or where it is not an index (one an older
    version left half-written when the disk filled up), which is said: the load extending it writes what it needs."""
    try:
        with open(index_path, "rb") as handle:
            index = json.load(handle)
    except FileNotFoundError:
        return {}
    except ValueError as error:  # not JSON, or not UTF-8
        problem = str(error)
    else:
        if isinstance(index, dict):
            return index
        problem = f"a JSON {type(index).__name__}, not an object"
    logger.warning(
        "Replacing the unreadable offload index %s (%s; left half-written by an interrupted write?): this load "
        "writes the entries it needs.", index_path, problem,
    )
    return {}


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
