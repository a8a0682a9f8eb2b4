"""The read-ahead executor: offloaded modules streamed through a ring of buffers allocated once."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

# Allocation alignment of torch's CPU allocator, which ring-buffer views reproduce (see _plan_runs).
_ALIGNMENT = 64
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def layer_streamer(model: PreTrainedModel) -> LayerStreamer | None:
    """The :class:`LayerStreamer` that ``load_offloaded(..., executor="stream")`` installed on ``model``, if any."""
    return getattr(model, "_specexec_layer_streamer", None)


class _MappedFile:
    """A weight file mapped once for the streamer's lifetime.

    The mapping is private (copy-on-write, never written) so that ``torch.frombuffer`` accepts it without a
    copy. Its pages are clean page cache, which the kernel drops whenever memory is short and reads again from
    disk on the next access; they are not unmapped after each read (``madvise(MADV_DONTNEED)``) because the
    page faults of re-mapping them made a forward about 25% slower.

    Args:
        path: The file.
    """

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as handle:
            self.mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        self._safetensors_header: dict[str, Any] | None = None
        self._data_start = 0

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero-copy tensor over the file, ``offset`` bytes in."""
        return torch.frombuffer(self.mapping, dtype=dtype, count=math.prod(shape), offset=offset).view(shape)

    def safetensors_entry(self, name: str) -> tuple[int, torch.dtype, tuple[int, ...]]:
        """``(byte offset, dtype, shape)`` of tensor ``name``, this being a safetensors file."""
        if self._safetensors_header is None:
            (header_length,) = struct.unpack("<Q", self.mapping[:8])
            self._safetensors_header = json.loads(self.mapping[8 : 8 + header_length])
            self._data_start = 8 + header_length
        entry = self._safetensors_header[name]
        return self._data_start + entry["data_offsets"][0], _SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"])


@dataclass
class _StoredWeight:
    """A tensor as stored in a weight file."""

    file: _MappedFile
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def tensor(self) -> torch.Tensor:
        return self.file.tensor(self.offset, self.dtype, self.shape)


@dataclass
class _OffloadedParameter:
    """A parameter of a streamed unit, still on the meta device, and where its weights are stored."""

    owner: nn.Module
    attribute: str
    meta: torch.Tensor
    stored: _StoredWeight


@dataclass
class _Run:
    """Bytes that one copy moves from a file into a ring buffer.

    Parameters stored back to back in a file, in the dtype they compute in, share a run, so that a decoder
    layer is typically a single copy: every copy costs the reader thread a GIL hand-off, which on a busy CPU
    can take milliseconds. A parameter that needs a dtype conversion gets a run of its own.

    Args:
        file: The file read.
        file_start: First byte read.
        file_end: One past the last byte read.
        buffer_start: Where the bytes land in the ring buffer.
        converts_to: The parameter dtype for a converting run; ``None`` for a raw byte copy.
        members: ``(parameter, byte offset in the ring buffer)`` of each parameter in the run.
    """

    file: _MappedFile
    file_start: int
    file_end: int
    buffer_start: int
    converts_to: torch.dtype | None = None
    members: list[tuple[_OffloadedParameter, int]] = field(default_factory=list)

    def extends_with(self, parameter: _OffloadedParameter) -> bool:
        """Whether ``parameter``'s bytes continue this raw run and keep their alignment in the buffer."""
        stored = parameter.stored
        return (
            self.converts_to is None
            and stored.dtype == parameter.meta.dtype
            and stored.file is self.file
            and stored.offset == self.file_end
            and (stored.offset - self.file_start) % stored.dtype.itemsize == 0
        )


@dataclass
class _Copy:
    """One read of a unit: zero-copy file ``source`` into ring-buffer ``target``."""

    source: torch.Tensor
    target: torch.Tensor


@dataclass
class _Slot:
    """A ring buffer and the unit position it holds (or is being filled with)."""

    buffer: torch.Tensor
    position: int | None = None
    filled: Future = field(default_factory=Future)


class LayerStreamer:
    """Runs disk-offloaded modules out of a ring of reused buffers, reading the next ones ahead on a thread.

    Streamed unit ``i`` always computes out of ring buffer ``i % (prefetch + 1)``: its parameters are views of
    that buffer, bound once, so a forward allocates nothing. Before unit ``i`` runs, the streamer waits for its
    weights and queues the reads of the next ``prefetch`` units (wrapping around to the next forward's first
    units), which the reader thread performs while unit ``i`` computes. A unit called out of order is read on
    the spot, so the order affects speed only, never results.

    Use :meth:`install`; :func:`layer_streamer` finds a model's streamer.

    Embedding tables are not streamed: a lookup needs only the rows of the tokens fed, so an embedding computes
    straight from the memory-mapped file, which reads just those rows' pages (bit-identical: it is a gather).

    Args:
        unit_names: The streamed units' module names, in execution order.
        units: ``(module, copies)`` per streamed unit.
        slots: The ring buffers.
    """

    def __init__(self, unit_names: list[str], units: list[tuple[nn.Module, list[_Copy]]], slots: list[_Slot]):
        self.unit_names = unit_names
        self._units = units
        self._slots = slots
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specexec-layer-streamer")
        self.reads_requested = 0  # unit reads queued so far, for tests and statistics
        for position, (module, _) in enumerate(units):
            module.register_forward_pre_hook(partial(self._before_unit, position))

    @classmethod
    def install(cls, model: PreTrainedModel, unit_names: list[str], prefetch: int = 1) -> LayerStreamer | None:
        """Replaces accelerate's hooks on a dispatched model by a streamer for its disk-placed units.

        Args:
            model: A model dispatched by accelerate with ``unit_names`` on disk and everything else on the CPU.
            unit_names: The disk-placed weight units, in execution order.
            prefetch: Units read ahead of the one computing.

        Returns:
            The streamer, or ``None`` when no unit needs streaming.
        """
        if not unit_names:
            _detach_accelerate_hooks(model)
            return None
        locate = _offloaded_weight_locator(model)
        _detach_accelerate_hooks(model)
        files: dict[str, _MappedFile] = {}
        aliases: dict[int, list[str]] = {}
        for name, parameter in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(parameter), []).append(name)
        parameters = {name: _offloaded_parameters(model, name, aliases, locate, files) for name in unit_names}
        streamed = []
        for name in unit_names:
            if _reads_rows_on_demand(model.get_submodule(name), parameters[name]):
                _bind_to_file(parameters[name])
            else:
                streamed.append(name)
        if not streamed:
            return None
        plans = [_plan_runs(parameters[name]) for name in streamed]
        ring = min(prefetch + 1, len(streamed))
        slots = [
            _Slot(torch.empty(max(size for size, _ in plans[first::ring]), dtype=torch.uint8)) for first in range(ring)
        ]
        units = [
            (model.get_submodule(name), _bind(runs, slots[position % ring].buffer))
            for position, (name, (_, runs)) in enumerate(zip(streamed, plans))
        ]
        streamer = cls(streamed, units, slots)
        model._specexec_layer_streamer = streamer
        return streamer

    @property
    def buffer_bytes(self) -> int:
        """Bytes held by the ring buffers: all the memory the streamer uses for weights, fixed at install."""
        return sum(slot.buffer.numel() for slot in self._slots)

    def close(self) -> None:
        """Stops the reader thread; a later forward that needs to read weights raises ``RuntimeError``."""
        self._reader.shutdown(wait=True)

    def _before_unit(self, position: int, module: nn.Module, args: tuple) -> None:
        current = self._request(position)
        try:
            current.filled.result()  # re-raises a failed read here, in the forward that needs it
        except BaseException:
            current.position = None  # what the buffer holds is unknown now: read it again next time
            raise
        for ahead in range(1, len(self._slots)):
            upcoming = (position + ahead) % len(self._units)
            # Around the end of a forward, the next forward's first units may map to the running unit's slot.
            if self._slots[upcoming % len(self._slots)] is not current:
                self._request(upcoming)

    def _request(self, position: int) -> _Slot:
        """The slot of unit ``position``, queueing the read of its weights unless it holds or awaits them."""
        slot = self._slots[position % len(self._slots)]
        if slot.position != position:
            slot.position = position
            slot.filled = self._reader.submit(self._read, position)
            self.reads_requested += 1
        return slot

    def _read(self, position: int) -> None:
        """Copies unit ``position``'s weights into its slot (on the reader thread; torch copies release the GIL)."""
        for copy in self._units[position][1]:
            copy.target.copy_(copy.source)


def _detach_accelerate_hooks(model: nn.Module) -> None:
    """Removes accelerate's hooks, leaving offloaded weights on the meta device.

    Detaching an offloading hook would otherwise load its weights back into memory: the whole model at once.
    """
    from accelerate.hooks import remove_hook_from_module

    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for single_hook in getattr(hook, "hooks", [hook]) if hook is not None else []:
            single_hook.offload = False
        remove_hook_from_module(module)


Locator = Callable[[str], tuple[str, "str | None", dict[str, Any]]]


def _offloaded_weight_locator(model: nn.Module) -> Locator:
    """``locate(name) -> (file path, safetensors tensor name or None for a .dat file, index entry)``.

    Reads accelerate's offload index from the hooks ``dispatch_model`` attached; ``locate`` raises ``KeyError``
    for a name the index does not hold.
    """
    loader = next(
        (
            module._hf_hook.weights_map.dataset
            for module in model.modules()
            if getattr(getattr(module, "_hf_hook", None), "weights_map", None) is not None
        ),
        None,
    )
    if loader is None:
        raise RuntimeError("The model has no disk-offloaded weights to stream (no accelerate offload hooks found).")

    def locate(name: str) -> tuple[str, str | None, dict[str, Any]]:
        info = loader.index[name]
        if info.get("safetensors_file") is not None:
            return info["safetensors_file"], info.get("weight_name", name), info
        return os.path.join(loader.save_folder, f"{name}.dat"), None, info

    return locate


def _stored_weight(names: list[str], locate: Locator, files: dict[str, _MappedFile]) -> _StoredWeight:
    """Where a parameter known under ``names`` is stored; maps its file on first use.

    Args:
        names: Every name of the parameter (tied weights are indexed under one of them only).
        locate: From :func:`_offloaded_weight_locator`.
        files: Files mapped so far, by path.
    """
    for name in names:
        try:
            path, safetensors_name, info = locate(name)
        except KeyError:
            continue
        if path not in files:
            files[path] = _MappedFile(path)
        if safetensors_name is not None:
            return _StoredWeight(files[path], *files[path].safetensors_entry(safetensors_name))
        # accelerate's .dat files are raw arrays (bfloat16 stored as int16 bytes, 0-d tensors as 1-d).
        return _StoredWeight(files[path], 0, getattr(torch, info["dtype"]), tuple(info["shape"]) or (1,))
    raise KeyError(f"No offloaded copy of parameter {names[0]!r} was found in accelerate's offload index.")


def _offloaded_parameters(
    model: nn.Module, unit_name: str, aliases: dict[int, list[str]], locate: Locator, files: dict[str, _MappedFile]
) -> list[_OffloadedParameter]:
    """A unit's parameters that accelerate left on the meta device, with their stored copies, in file order.

    Args:
        model: The dispatched model.
        unit_name: The unit.
        aliases: Every name of each parameter object, by ``id`` (tied weights have several).
        locate: From :func:`_offloaded_weight_locator`.
        files: Files mapped so far, by path.
    """
    found = []
    for local_name, parameter in model.get_submodule(unit_name).named_parameters(remove_duplicate=False):
        if not parameter.is_meta:
            continue  # a weight tied to a resident module is in memory already
        owner_name, _, attribute = f"{unit_name}.{local_name}".rpartition(".")
        stored = _stored_weight(aliases[id(parameter)], locate, files)
        found.append(_OffloadedParameter(model.get_submodule(owner_name), attribute, parameter, stored))
    return sorted(found, key=lambda p: (p.stored.file.path, p.stored.offset))


def _reads_rows_on_demand(module: nn.Module, parameters: list[_OffloadedParameter]) -> bool:
    """Whether ``module`` is an embedding table stored in its compute dtype, which can be read in place."""
    return isinstance(module, nn.Embedding) and all(p.stored.dtype == p.meta.dtype for p in parameters)


def _bind_to_file(parameters: list[_OffloadedParameter]) -> None:
    """Replaces meta parameters by zero-copy views of their files, read page by page as the forward touches them."""
    for parameter in parameters:
        view = parameter.stored.tensor().view(parameter.meta.shape)
        setattr(parameter.owner, parameter.attribute, nn.Parameter(view, requires_grad=False))


def _plan_runs(parameters: list[_OffloadedParameter]) -> tuple[int, list[_Run]]:
    """Groups a unit's parameters (in file order) into runs; returns the ring-buffer bytes needed and the runs.

    A converting run starts 64-byte aligned, like the fresh tensor ``from_pretrained`` allocates for a converted
    weight; a raw run keeps its file offset modulo 64, like the zero-copy view of the checkpoint
    ``from_pretrained`` computes with otherwise. BLAS kernels round differently for differently aligned operands,
    so mirroring the alignment is what keeps outputs bit-identical to the in-memory model.
    """
    runs: list[_Run] = []
    size = 0
    for parameter in parameters:
        stored = parameter.stored
        if runs and runs[-1].extends_with(parameter):
            run = runs[-1]
            run.file_end += stored.nbytes
        else:
            converts_to = parameter.meta.dtype if stored.dtype != parameter.meta.dtype else None
            start = _next_offset(size, 0 if converts_to else stored.offset % _ALIGNMENT)
            run = _Run(stored.file, stored.offset, stored.offset + stored.nbytes, start, converts_to)
            runs.append(run)
        buffer_offset = run.buffer_start + (0 if run.converts_to else stored.offset - run.file_start)
        run.members.append((parameter, buffer_offset))
        size = buffer_offset + parameter.meta.numel() * parameter.meta.element_size()
    return size, runs


def _next_offset(offset: int, remainder: int) -> int:
    """The smallest byte offset ``>= offset`` that is ``remainder`` modulo ``_ALIGNMENT``."""
    return offset + (remainder - offset) % _ALIGNMENT


def _bind(runs: list[_Run], buffer: torch.Tensor) -> list[_Copy]:
    """Replaces a unit's meta parameters by views of ``buffer`` and returns the copies that fill them."""
    copies = []
    for run in runs:
        for parameter, offset in run.members:
            meta = parameter.meta
            target = buffer[offset : offset + meta.numel() * meta.element_size()].view(meta.dtype).view(meta.shape)
            setattr(parameter.owner, parameter.attribute, nn.Parameter(target, requires_grad=False))
            if run.converts_to is not None:
                copies.append(_Copy(parameter.stored.tensor().view(meta.shape), target))
        if run.converts_to is None:
            source = run.file.tensor(run.file_start, torch.uint8, (run.file_end - run.file_start,))
            target = buffer[run.buffer_start : run.buffer_start + source.numel()]
            copies.append(_Copy(source, target))
    return copies
