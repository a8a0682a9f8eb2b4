"""The read-ahead executor: offloaded modules streamed through a ring of buffers allocated once."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .direct_io import (
    BLOCK,
    DirectReader,
    ReadPlan,
    Span,
    WeightFile,
    WeightFileError,
    aligned_empty,
    plan_reads,
    round_up,
)

# Allocation alignment of torch's CPU allocator, which ring-buffer views reproduce (see _plan_runs).
_ALIGNMENT = 64
# Alignment of the CPU ring's runs: the file offset modulo a block, so that direct reads land in place.
_RING_ALIGNMENT = BLOCK


def layer_streamer(model: PreTrainedModel) -> LayerStreamer | None:
    """The :class:`LayerStreamer` that ``load_offloaded(..., executor="stream")`` installed on ``model``, if any."""
    return getattr(model, "_specexec_layer_streamer", None)


@dataclass
class _StoredWeight:
    """A tensor as stored in a weight file."""

    file: WeightFile
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def tensor(self) -> torch.Tensor:
        return self.file.tensor(self.offset, self.dtype, self.shape)


@dataclass
class _HeldWeight:
    """A weight held in host memory: a unit placed in CPU RAM, for the device executor to pin."""

    held: torch.Tensor
    file = None
    offset = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.held.dtype

    @property
    def nbytes(self) -> int:
        return _span_bytes(self.held)

    def tensor(self) -> torch.Tensor:
        return self.held


@dataclass
class _OffloadedParameter:
    """A parameter of a streamed unit (on the meta device, or in host memory) and where its weights are stored.

    A parameter that is a tensor subclass (a quantized weight) is streamed as its plain inner tensors: one entry
    per inner tensor (``meta`` and ``stored`` describe it), all pointing to the ``composite`` that rebuilds the
    parameter, which is bound to ``owner.attribute``.
    """

    owner: nn.Module
    attribute: str
    meta: torch.Tensor
    stored: _StoredWeight | _HeldWeight
    composite: _Composite | None = None


@dataclass(eq=False)
class _Composite:
    """A tensor subclass as ``__tensor_flatten__`` takes it apart, to rebuild it over other inner tensors.

    Args:
        cls: The subclass.
        context: Its flattening context.
        size: Its outer size.
        stride: Its outer stride.
        parts: The inner tensors by attribute name: plain ones as :class:`_OffloadedParameter`, nested subclasses
            (a packed tensor inside a quantized weight) as :class:`_Composite`.
    """

    cls: type
    context: Any
    size: torch.Size
    stride: tuple[int, ...]
    parts: dict[str, _OffloadedParameter | _Composite]

    def leaves(self) -> Iterator[_OffloadedParameter]:
        """The plain inner tensors' entries, nested ones included."""
        for part in self.parts.values():
            if isinstance(part, _Composite):
                yield from part.leaves()
            else:
                yield part

    def rebuild(self, views: dict[int, torch.Tensor]) -> torch.Tensor:
        """The subclass over ``views`` (by ``id`` of each inner tensor's entry); the views are not copied."""
        inner = {
            name: part.rebuild(views) if isinstance(part, _Composite) else views[id(part)]
            for name, part in self.parts.items()
        }
        return self.cls.__tensor_unflatten__(inner, self.context, self.size, self.stride)


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

    file: WeightFile
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
    """Runs disk-offloaded modules out of a ring of reused buffers, reading the next ones ahead on threads.

    Each streamed unit always computes out of the same ring buffer (:func:`_ring_slots`): its parameters are views
    of that buffer, bound once, so a forward allocates nothing. Before unit ``i`` runs, the streamer waits for its
    weights and queues the reads of the next ``prefetch`` units (wrapping around to the next forward's first
    units), which a :class:`~.direct_io.DirectReader` performs while unit ``i`` computes: ``O_DIRECT`` reads from
    the weight files straight into the ring buffer, several in flight, bypassing the page cache (through it where
    the filesystem refuses direct reads). A unit called out of order is read on the spot, so the order affects
    speed only, never results. Each read checks that the files kept the size and modification time they had at
    install, so a weight file truncated or rewritten under a running model raises
    :class:`~.direct_io.WeightFileError` in the forward that needs it rather than feeding it other bytes.

    Use :meth:`install`; :func:`layer_streamer` finds a model's streamer. :class:`~.device_stream.DeviceLayerStreamer`
    runs the same ring on an accelerator.

    Embedding tables are not streamed: a lookup needs only the rows of the tokens fed, so an embedding computes
    straight from the memory-mapped file, which reads just those rows' pages (bit-identical: it is a gather); each
    lookup first checks the file's size, as a mapping past a truncated file's end would crash the process.

    Args:
        unit_names: The streamed units' module names, in execution order.
        units: ``(module, read plan)`` per streamed unit (the plan of the reads that fill its ring buffer).
        slots: The ring buffers.
        slot_of: The ring buffer of each unit, from :func:`_ring_slots`.
        unit_bytes: The bytes each unit's read moves, in execution order.
        prefetch: Units read ahead of the one computing.
        reader: Performs the read plans; a new :class:`~.direct_io.DirectReader` when ``None``.
    """

    def __init__(
        self,
        unit_names: list[str],
        units: list[tuple[nn.Module, ReadPlan | list[_Copy]]],
        slots: list[_Slot],
        slot_of: list[int],
        unit_bytes: list[int],
        prefetch: int,
        reader: DirectReader | None = None,
    ):
        self.unit_names = unit_names
        self._units = units
        self._slots = slots
        self._slot_of = slot_of
        self._unit_bytes = unit_bytes
        self._prefetch = prefetch
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specexec-layer-streamer")
        self._direct_reader = reader or DirectReader()
        self._closed = False
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
        parameters = _unit_parameters(model, unit_names, resident=lambda parameter: not parameter.is_meta)
        streamed = []
        for name in unit_names:
            if _reads_rows_on_demand(model.get_submodule(name), parameters[name]):
                _bind_to_file(model.get_submodule(name), parameters[name])
            else:
                streamed.append(name)
        if not streamed:
            return None
        plans = [_plan_runs(parameters[name], _RING_ALIGNMENT, padded=True) for name in streamed]
        slot_of = _ring_slots(len(streamed), prefetch)
        slots = [
            _Slot(aligned_empty(round_up(max(plans[position][0] for position in members), BLOCK)))
            for members in _slot_members(slot_of)
        ]
        units = []
        for position, (name, (_, runs)) in enumerate(zip(streamed, plans)):
            buffer = slots[slot_of[position]].buffer
            _bind_views(runs, buffer)
            units.append((model.get_submodule(name), plan_reads(_spans(runs, buffer))))
        streamer = cls(streamed, units, slots, slot_of, [size for size, _ in plans], prefetch)
        model._specexec_layer_streamer = streamer
        return streamer

    @property
    def buffer_bytes(self) -> int:
        """Bytes held by the ring buffers: all the memory the streamer uses for weights, fixed at install."""
        return sum(slot.buffer.numel() for slot in self._slots)

    @property
    def streamed_bytes_per_forward(self) -> int:
        """Bytes each forward reads into the ring, once the first forward has filled it.

        Units that have a buffer to themselves (all of them when ``prefetch + 1 >= len(unit_names)``, else the
        last few, see :func:`_ring_slots`) stay loaded and are read once only.
        """
        shared = _slot_members(self._slot_of)
        return sum(size for size, slot in zip(self._unit_bytes, self._slot_of) if len(shared[slot]) > 1)

    def wait_idle(self) -> None:
        """Blocks until every read queued so far has landed (for timing a forward without the read-ahead)."""
        for slot in self._slots:
            self._await_on_host(slot)

    def close(self) -> None:
        """Stops the reader threads; a later forward that needs to read weights raises ``RuntimeError``."""
        self._closed = True
        self._reader.shutdown(wait=True)
        self._direct_reader.close()

    def _before_unit(self, position: int, module: nn.Module, args: tuple) -> None:
        current = self._request(position)
        try:
            self._await(current)  # re-raises a failed read here, in the forward that needs it
        except BaseException:
            current.position = None  # what the buffer holds is unknown now: read it again next time
            raise
        for ahead in range(1, self._prefetch + 1):
            upcoming = (position + ahead) % len(self._units)
            if self._slots[self._slot_of[upcoming]] is not current:  # fewer units than slots: all stay loaded
                self._request(upcoming)

    def _request(self, position: int) -> _Slot:
        """The slot of unit ``position``, queueing the read of its weights unless it holds or awaits them."""
        slot = self._slots[self._slot_of[position]]
        if slot.position != position:
            if self._closed:
                raise RuntimeError("The layer streamer was closed (shutdown): it cannot read weights any more.")
            slot.position = position
            slot.filled = self._fill(position, slot)
            self.reads_requested += 1
        return slot

    def _fill(self, position: int, slot: _Slot) -> Future:
        """Starts filling ``slot`` with unit ``position``'s weights."""
        return self._direct_reader.submit(self._units[position][1])

    def _await(self, slot: _Slot) -> None:
        """Makes the compute that follows see ``slot``'s weights."""
        slot.filled.result()

    def _await_on_host(self, slot: _Slot) -> None:
        """Blocks the calling thread until ``slot``'s fill has landed."""
        if slot.position is not None:
            slot.filled.exception()  # waits; a failed read is raised by the forward that needs it


def _ring_slots(count: int, prefetch: int) -> list[int]:
    """The ring buffer each of ``count`` streamed units computes out of, reading ``prefetch`` units ahead.

    Units go round ``prefetch + 1`` buffers; when ``count`` is not a multiple of that, the last ``count % (prefetch +
    1)`` units get a buffer each of their own, so that any ``prefetch + 1`` consecutive units, across the end of a
    forward too, use distinct buffers: the next forward's first units are read ahead while the last ones compute.

    Args:
        count: Streamed units.
        prefetch: Units read ahead of the one computing.
    """
    ring = min(prefetch + 1, count)
    cycled = count - count % ring
    return [position % ring if position < cycled else ring + position - cycled for position in range(count)]


def _slot_members(slot_of: list[int]) -> list[list[int]]:
    """The unit positions of each ring buffer."""
    members: list[list[int]] = [[] for _ in range(max(slot_of) + 1)]
    for position, slot in enumerate(slot_of):
        members[slot].append(position)
    return members


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
    for a name the index does not hold (every name, when no hook offloads anything).
    """
    loader = next(
        (
            module._hf_hook.weights_map.dataset
            for module in model.modules()
            if getattr(getattr(module, "_hf_hook", None), "weights_map", None) is not None
        ),
        None,
    )

    def locate(name: str) -> tuple[str, str | None, dict[str, Any]]:
        if loader is None:
            raise KeyError(name)
        info = loader.index[name]
        if info.get("safetensors_file") is not None:
            return info["safetensors_file"], info.get("weight_name", name), info
        return os.path.join(loader.save_folder, f"{name}.dat"), None, info

    return locate


def _stored_weight(names: list[str], locate: Locator, files: dict[str, WeightFile]) -> _StoredWeight:
    """Where a parameter known under ``names`` is stored; opens its file on first use.

    Args:
        names: Every name of the parameter (tied weights are indexed under one of them only).
        locate: From :func:`_offloaded_weight_locator`.
        files: Files opened so far, by path.
    """
    for name in names:
        try:
            path, safetensors_name, info = locate(name)
        except KeyError:
            continue
        if path not in files:
            files[path] = WeightFile(path)
        if safetensors_name is not None:
            return _StoredWeight(files[path], *files[path].safetensors_entry(safetensors_name))
        # accelerate's .dat files are raw arrays (bfloat16 stored as int16 bytes, 0-d tensors as 1-d).
        stored = _StoredWeight(files[path], 0, getattr(torch, info["dtype"]), tuple(info["shape"]) or (1,))
        if stored.nbytes > files[path].size:
            raise WeightFileError(
                f"{path} is truncated: {files[path].size} bytes, where accelerate's offload index records "
                f"{stored.nbytes} for {name!r}. Offload the model again."
            )
        return stored
    raise KeyError(f"No offloaded copy of parameter {names[0]!r} was found in accelerate's offload index.")


def _unit_parameters(
    model: nn.Module,
    unit_names: list[str],
    resident: Callable[[nn.Parameter], bool],
    execution_form: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor,
) -> dict[str, list[_OffloadedParameter]]:
    """Each streamed unit's parameters with where their weights are stored, in file (or registration) order.

    Removes accelerate's hooks, leaving disk-offloaded weights on the meta device, whose stored copies are found
    through accelerate's offload index (files are opened on first use); other weights are held in memory. A
    tensor-subclass parameter held in memory (a quantized weight) is taken apart into its plain inner tensors.

    Args:
        model: The dispatched model.
        unit_names: The streamed units.
        resident: Whether a parameter stays where it is (a weight tied to a resident module): it is not streamed.
        execution_form: A held tensor-subclass weight as it is on the execution device, in host memory (quantized
            formats repack for the device they move to).
    """
    locate = _offloaded_weight_locator(model)
    _detach_accelerate_hooks(model)
    files: dict[str, WeightFile] = {}
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    found: dict[str, list[_OffloadedParameter]] = {}
    for unit_name in unit_names:
        unit = []
        for local_name, parameter in model.get_submodule(unit_name).named_parameters(remove_duplicate=False):
            if resident(parameter):
                continue
            owner_name, _, attribute = f"{unit_name}.{local_name}".rpartition(".")
            owner = model.get_submodule(owner_name)
            if type(parameter) not in (torch.Tensor, nn.Parameter) and not _is_subclass(parameter):
                raise ValueError(
                    f"{unit_name}.{local_name} is a {type(parameter).__name__}, which cannot be streamed: its data is "
                    "not made of plain tensors that __tensor_flatten__ names (optimum-quanto weights are); keep this "
                    "module on the execution device or quantize with optimum-quanto."
                )
            if _is_subclass(parameter):
                if parameter.is_meta:
                    raise ValueError(
                        f"{unit_name}.{local_name} is a {type(parameter).__name__} (a quantized weight) placed on "
                        "disk; such weights stream from CPU RAM only: raise max_memory['cpu'] so nothing goes to disk."
                    )
                unit.extend(_flattened(owner, attribute, execution_form(parameter.detach())))
            elif parameter.is_meta:
                stored = _stored_weight(aliases[id(parameter)], locate, files)
                if math.prod(stored.shape) != parameter.numel():
                    raise WeightFileError(
                        f"{stored.file.path} stores {unit_name}.{local_name} with shape {list(stored.shape)}, but the "
                        f"model expects {list(parameter.shape)}: the file does not belong to this model's config."
                    )
                unit.append(_OffloadedParameter(owner, attribute, parameter, stored))
            else:
                unit.append(_OffloadedParameter(owner, attribute, parameter, _HeldWeight(parameter.detach())))
        found[unit_name] = sorted(unit, key=lambda p: (p.stored.file.path if p.stored.file else "", p.stored.offset))
    return found


def _is_subclass(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a tensor subclass made of inner tensors (as quantized weights are)."""
    return type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__")


def _flattened(owner: nn.Module, attribute: str, tensor: torch.Tensor) -> list[_OffloadedParameter]:
    """Entries for the plain inner tensors of tensor subclass ``tensor``, bound to ``owner.attribute`` together."""

    def take_apart(part: torch.Tensor) -> _Composite:
        names, context = part.__tensor_flatten__()
        composite = _Composite(type(part), context, part.size(), part.stride(), {})
        for name in names:
            inner = getattr(part, name)
            if _is_subclass(inner):
                composite.parts[name] = take_apart(inner)
            else:
                held = inner.detach().cpu()
                composite.parts[name] = _OffloadedParameter(owner, attribute, held, _HeldWeight(held))
        return composite

    top = take_apart(tensor)
    leaves = list(top.leaves())
    for leaf in leaves:
        leaf.composite = top
    return leaves


def _reads_rows_on_demand(module: nn.Module, parameters: list[_OffloadedParameter]) -> bool:
    """Whether ``module`` is an embedding table stored in its compute dtype, which can be read in place."""
    return isinstance(module, nn.Embedding) and all(p.stored.dtype == p.meta.dtype for p in parameters)


def _bind_to_file(module: nn.Module, parameters: list[_OffloadedParameter]) -> None:
    """Replaces meta parameters by zero-copy views of their files, read page by page as the forward touches them.

    Touching a mapped page past the end of a file truncated meanwhile would kill the process (``SIGBUS``), so
    ``module`` first checks its files, at the cost of one ``fstat`` each per call.
    """
    for parameter in parameters:
        view = parameter.stored.tensor().view(parameter.meta.shape)
        setattr(parameter.owner, parameter.attribute, nn.Parameter(view, requires_grad=False))
    files = list({id(parameter.stored.file): parameter.stored.file for parameter in parameters}.values())

    def check_files(module: nn.Module, args: tuple) -> None:
        for file in files:
            file.check_unchanged()

    module.register_forward_pre_hook(check_files)


def _plan_runs(
    parameters: list[_OffloadedParameter], alignment: int = _ALIGNMENT, each_fresh: bool = False, padded: bool = False
) -> tuple[int, list[_Run]]:
    """Groups a unit's parameters (in file order) into runs; returns the ring-buffer bytes needed and the runs.

    A converting run starts ``alignment``-byte aligned, like the fresh tensor ``from_pretrained`` allocates for a
    converted weight; a raw run keeps its file offset modulo ``alignment``, like the zero-copy view of the
    checkpoint ``from_pretrained`` computes with otherwise. BLAS kernels round differently for differently
    aligned operands, so mirroring the alignment is what keeps outputs bit-identical to the in-memory model.

    Args:
        parameters: The unit's parameters, in file order.
        alignment: The allocation alignment of the in-memory model's tensors on the execution device.
        each_fresh: Place every parameter as a fresh allocation (an accelerator's in-memory model copies each
            weight into its own allocation), with a typed copy of its own.
        padded: Start every run in an ``alignment`` block of its own, so that a direct read of the blocks around
            a raw run (:func:`~.direct_io.plan_reads`) lands in place without touching another run.
    """
    runs: list[_Run] = []
    size = 0
    for parameter in parameters:
        stored = parameter.stored
        if runs and not each_fresh and runs[-1].extends_with(parameter):
            run = runs[-1]
            run.file_end += stored.nbytes
        else:
            typed = each_fresh or stored.dtype != parameter.meta.dtype
            free = _next_offset(size, 0, alignment) if padded else size
            start = _next_offset(free, 0 if typed else stored.offset % alignment, alignment)
            converts_to = parameter.meta.dtype if typed else None
            run = _Run(stored.file, stored.offset, stored.offset + stored.nbytes, start, converts_to)
            runs.append(run)
        buffer_offset = run.buffer_start + (0 if run.converts_to else stored.offset - run.file_start)
        run.members.append((parameter, buffer_offset))
        size = buffer_offset + _span_bytes(parameter.meta)
    return size, runs


def _next_offset(offset: int, remainder: int, alignment: int = _ALIGNMENT) -> int:
    """The smallest byte offset ``>= offset`` that is ``remainder`` modulo ``alignment``."""
    return offset + (remainder - offset) % alignment


def _span_bytes(tensor: torch.Tensor) -> int:
    """Bytes from ``tensor``'s first element to one past its last, whatever its strides."""
    if tensor.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))) * tensor.element_size()


def _member_view(buffer: torch.Tensor, parameter: _OffloadedParameter, offset: int) -> torch.Tensor:
    """The typed view of ``buffer`` that ``parameter`` occupies at byte ``offset``, with its shape and strides."""
    meta = parameter.meta
    return buffer[offset : offset + _span_bytes(meta)].view(meta.dtype).as_strided(meta.shape, meta.stride())


def _bind_views(runs: list[_Run], buffer: torch.Tensor) -> None:
    """Replaces a unit's parameters by views of ``buffer``, laid out as ``runs`` plan."""
    views: dict[int, torch.Tensor] = {}
    composites: dict[int, _OffloadedParameter] = {}
    for run in runs:
        for parameter, offset in run.members:
            view = _member_view(buffer, parameter, offset)
            if parameter.composite is None:
                setattr(parameter.owner, parameter.attribute, nn.Parameter(view, requires_grad=False))
            else:
                views[id(parameter)] = view
                composites[id(parameter.composite)] = parameter
    for parameter in composites.values():
        rebuilt = parameter.composite.rebuild(views)
        setattr(parameter.owner, parameter.attribute, nn.Parameter(rebuilt, requires_grad=False))


def _spans(runs: list[_Run], buffer: torch.Tensor) -> list[Span]:
    """The file spans that fill ``buffer`` (laid out as ``runs`` plan) with a unit's stored weights (direct reads)."""
    spans = []
    for run in runs:
        if run.converts_to is None:
            target = buffer[run.buffer_start : run.buffer_start + run.file_end - run.file_start]
            spans.append(Span(run.file, run.file_start, run.file_end, target))
        else:
            for parameter, offset in run.members:
                stored = parameter.stored
                target = _member_view(buffer, parameter, offset)
                spans.append(Span(stored.file, stored.offset, stored.offset + stored.nbytes, target, stored.dtype))
    return spans


def _copies(runs: list[_Run], buffer: torch.Tensor) -> list[_Copy]:
    """The copies that fill ``buffer`` (laid out as ``runs`` plan) with a unit's stored weights."""
    copies = []
    for run in runs:
        if run.converts_to is None:
            source = run.file.tensor(run.file_start, torch.uint8, (run.file_end - run.file_start,))
            copies.append(_Copy(source, buffer[run.buffer_start : run.buffer_start + source.numel()]))
        else:
            for parameter, offset in run.members:
                target = _member_view(buffer, parameter, offset)
                copies.append(_Copy(parameter.stored.tensor().view(target.shape), target))
    return copies
