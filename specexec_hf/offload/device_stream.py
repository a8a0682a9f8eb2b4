"""The streaming executor on an accelerator: offloaded layers copied into a fixed ring on the device, one ahead.

Layers that fit the device budget stay resident. Each layer placed in CPU RAM lives in one flat pinned host buffer
(pinned at its exact size), laid out exactly as its ring slot on the device, so loading it is one asynchronous
copy. Layers placed on disk are read with direct reads (:class:`~.direct_io.DirectReader`, ``O_DIRECT``, bypassing
the page cache) into a block-aligned pinned staging buffer laid out as the file is, then copied up weight by weight
(consecutive weights spaced alike in both layouts in one copy). Copies run on a dedicated copy queue while the
previous layer computes; events order them (see :class:`DeviceLayerStreamer`), never a device-wide synchronize.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .device import StreamDevice
from .direct_io import BLOCK, ReadPlan, plan_reads, round_up
from .expand import PackedWeight, expand_into, expandable, packed_weight, streamed_form
from .layout import (
    Copy,
    OffloadedParameter,
    RingSlot,
    Run,
    bind_views,
    plan_runs,
    ring_slots,
    slot_members,
    span_bytes,
    unit_copies,
    unit_spans,
)
from .stream import LayerStreamer, unit_parameters

HOST_PLACEMENTS = ("cpu", "disk")


@dataclass(eq=False)
class _DeviceSlot(RingSlot):
    """A ring slot on the device; ``filled`` resolves to the done event of the copy into it.

    Args:
        opened: Whether the compute may have read the slot since ``free`` was recorded. True at allocation: the
            caching allocator may hand out memory that compute queued before still reads, so the first copy into
            a fresh slot waits for a compute event recorded after the allocation, as every later one does.
        free: A slot-free event, recorded on the compute queue after the compute last read the slot: every copy
            into the slot waits for it (``None`` before the first read).
        staging: The pinned, block-aligned buffer disk-placed layers of this slot are read into, or ``None``.
        staged: The done event of the last copy out of ``staging``: the reader waits for it before overwriting.
        dense: The device buffer the quantized linear weights of this slot's layers expand into, or ``None``.
        expanded: The fill whose quantized weights ``dense`` holds expanded (``None``: none yet).
    """

    filled: Future = field(default_factory=lambda: _resolved(None))
    opened: bool = True
    free: Any = None
    staging: torch.Tensor | None = None
    staged: Any = None
    dense: torch.Tensor | None = None
    expanded: Future | None = None


class DeviceLayerStreamer(LayerStreamer):
    """Runs layers placed in CPU RAM or on disk out of a fixed ring of device buffers, loading one ahead.

    Each streamed layer computes out of the same slot (``prefetch + 1`` slots in turn, see
    :func:`~.layout.ring_slots`), whose parameter views are bound once and never move. Before layer ``i`` runs,
    the compute queue waits for the copy-done event of its slot, and the copies of the next ``prefetch`` layers
    are issued (wrapping around to the next forward's first layers, which then load while the draft grows its
    tree); each waits on the copy queue for a slot-free event recorded on the compute queue when the copy is
    issued, so after the layer that last read that slot (and before the one about to run). A layer placed on disk
    is first read into its slot's pinned staging buffer by the reader thread, through the
    :class:`~.direct_io.DirectReader` the CPU executor uses, with the same checks: a weight file truncated or
    rewritten under the model raises :class:`~.direct_io.WeightFileError`. A failed copy or read is raised in the
    forward that needs it.

    Quantized linear weights (optimum-quanto int4 and int8, weight-only) are streamed packed, in quanto's generic
    layout, and expanded into a dense weight in the compute dtype (:mod:`.expand`) on the compute queue, after the
    layer's copy-done event and before the layer computes, once per fill; the layer then runs a plain
    ``nn.Linear`` (a 4-bit product is compute-bound over a tree; the dense one is as flat as bfloat16's). Each slot
    serving such layers has one dense buffer, the size of its largest layer's dense weights: the expanded image of
    the slot, with the slot's lifetime, so a layer alone in its slot (an LM head) is expanded once and stays, and the
    copies of the next layers, whose slot-free events are recorded before the expansion is queued, overlap it. The
    int4 nibbles pass through one ``uint8`` scratch, the size of the largest weight's half, used in turn.

    Use :meth:`install_on_device`, or ``load_offloaded(..., executor="stream")`` with a GPU in ``max_memory``;
    :func:`~.stream.layer_streamer` finds a model's streamer. For benchmarks: ``buffer_bytes`` (the device ring),
    ``host_bytes`` (pinned host memory), ``streamed_bytes_per_forward``, and ``wait_idle()``.

    Args:
        unit_names: The streamed layers' module names, in execution order.
        units: ``(module, the direct reads that fill its slot's staging buffer)`` per layer; ``None`` for a layer
            in RAM.
        slots: The device ring.
        slot_of: The slot of each layer, from :func:`~.layout.ring_slots`.
        uploads: Per layer, the copies (pinned host -> its slot) that load it, the first into the slot's start.
        prefetch: Layers loaded ahead of the one computing.
        pinned: Every pinned host buffer (the layers in RAM, the staging buffers), unpinned by :meth:`close`.
        device: The device operations.
        expansions: Per layer, its quantized weights as bound over its slot and the views of the slot's ``dense``
            buffer they expand into; ``None``: no layer has any.
        scratch: The device buffer every expansion passes its nibbles through in turn (``None`` without int4).
    """

    def __init__(
        self,
        unit_names: list[str],
        units: list[tuple[nn.Module, ReadPlan | None]],
        slots: list[_DeviceSlot],
        slot_of: list[int],
        uploads: list[list[Copy]],
        prefetch: int,
        pinned: list[torch.Tensor],
        device: StreamDevice,
        expansions: list[list[tuple[PackedWeight, torch.Tensor]]] | None = None,
        scratch: torch.Tensor | None = None,
    ):
        unit_bytes = [sum(upload.source.numel() for upload in unit) for unit in uploads]
        super().__init__(unit_names, units, slots, slot_of, unit_bytes, prefetch)
        self._uploads = uploads
        self._expansions = expansions or [[] for _ in unit_names]
        self._scratch = scratch if scratch is not None else torch.empty(0, dtype=torch.uint8, device=device.device)
        self._pinned_bytes = sum(buffer.numel() for buffer in pinned)
        self._device = device
        # Unpinned by close(), or when the streamer is collected: freeing registered memory would leak the pin.
        self._release_pinned = weakref.finalize(self, _release_pinned, device, pinned)

    @classmethod
    def install_on_device(
        cls,
        model: PreTrainedModel,
        device_map: Mapping[str, int | str],
        device: StreamDevice,
        prefetch: int = 1,
        expand_quantized: bool = True,
    ) -> DeviceLayerStreamer | None:
        """Moves a CPU/disk-dispatched model to ``device``, streaming the units ``device_map`` leaves on the host.

        Args:
            model: A model dispatched by accelerate on the host: units placed ``"disk"`` offloaded, every other
                unit in CPU memory.
            device_map: The placement per weight unit (:func:`~.placement.offload_device_map`): ``"cpu"`` and
                ``"disk"`` units are streamed, any other value means resident on ``device``.
            device: The device operations (:class:`~.device.CudaDevice`, or a test stand-in).
            prefetch: Layers loaded ahead of the one computing.
            expand_quantized: Stream the quantized linear weights of streamed layers packed and expand them on the
                device into dense ``nn.Linear`` weights (see the class). ``False``: stream them in the layout quanto
                picks for the device and multiply with quanto's kernels (the path before expansion, for
                comparison). Resident layers keep quanto's form either way.

        Returns:
            The streamer, or ``None`` when every unit is resident.
        """
        streamed = [name for name, where in device_map.items() if where in HOST_PLACEMENTS]
        resident_ids = {
            id(parameter)
            for name, where in device_map.items()
            if where not in HOST_PLACEMENTS
            for parameter in model.get_submodule(name).parameters()
        }
        parameters = unit_parameters(
            model,
            streamed,
            resident=lambda parameter: id(parameter) in resident_ids,
            execution_form=partial(_execution_form, device.device, expand_quantized),
        )
        streamed = [name for name in streamed if parameters[name]]  # units whose weights are all tied to resident ones
        if not streamed:
            model.to(device.device)
            return None
        expanded = [
            _expanded_linears(model.get_submodule(name), parameters[name]) if expand_quantized else []
            for name in streamed
        ]
        dense_layouts = [_dense_layout(linears, device.alignment) for linears in expanded]
        plans = [plan_runs(parameters.pop(name), device.alignment, each_fresh=True) for name in streamed]
        # A disk-placed unit's staging is laid out as the CPU ring is (each run at its file offset modulo a block,
        # in blocks of its own), so that direct reads land in place; its slot keeps the device's layout.
        staged = {
            position: plan_runs(_members(plans[position][1]), BLOCK, padded=True)
            for position, name in enumerate(streamed)
            if device_map[name] == "disk"
        }
        slot_of = ring_slots(len(streamed), prefetch, [size for size, _ in plans])
        slots, pinned = [], []
        for members in slot_members(slot_of):
            staging_sizes = [round_up(staged[position][0]) for position in members if position in staged]
            staging = None
            if staging_sizes:
                whole = device.pin(max(staging_sizes) + BLOCK)  # room to start at a block boundary
                staging = whole[-whole.data_ptr() % BLOCK :][: max(staging_sizes)]
                pinned.append(whole)
            buffer = device.allocate(max(plans[position][0] for position in members))
            dense_bytes = max(dense_layouts[position][0] for position in members)
            dense = device.allocate(dense_bytes) if dense_bytes else None
            slots.append(_DeviceSlot(buffer, staging=staging, dense=dense))
        units, uploads, expansions = [], [], []
        for position, name in enumerate(streamed):
            size, runs = plans[position]
            plans[position] = None  # with the module rebound below, the last reference to its weights in RAM
            slot = slots[slot_of[position]]
            bind_views(runs, slot.buffer)
            expansions.append(_bind_dense(model, name, expanded[position], dense_layouts[position][1], slot.dense))
            if position in staged:
                staged_runs = staged[position][1]
                units.append((model.get_submodule(name), plan_reads(unit_spans(staged_runs, slot.staging))))
                uploads.append(_uploads(runs, staged_runs, slot.staging, slot.buffer))
            else:
                host = device.pin(size)
                pinned.append(host)
                for copy in unit_copies(runs, host):
                    copy.target.copy_(copy.source)
                units.append((model.get_submodule(name), None))
                uploads.append([Copy(host, slot.buffer[:size])])
            del runs
        scratch_bytes = max((weight.scratch_bytes for unit in expansions for weight, _ in unit), default=0)
        scratch = device.allocate(scratch_bytes) if scratch_bytes else None
        model.to(device.device)  # resident units; the streamed ones are bound to device views already
        streamer = cls(streamed, units, slots, slot_of, uploads, prefetch, pinned, device, expansions, scratch)
        streamer._attach(model)
        return streamer

    @property
    def read_ahead_bytes(self) -> int:
        """Bytes a forward finds loaded already: its first ``prefetch`` layers, whose copies the previous forward
        issued at its end (in generation they land while the draft grows its tree). A forward's own copies move
        ``streamed_bytes_per_forward - read_ahead_bytes`` before its last layer computes."""
        shared = slot_members(self._slot_of)
        first = range(min(self._prefetch, len(self._units)))
        return sum(self._unit_bytes[position] for position in first if len(shared[self._slot_of[position]]) > 1)

    @property
    def expansion_bytes(self) -> int:
        """Device bytes the expansion of quantized weights takes beside the ring: the dense buffers they expand into
        (one per slot that serves them) and the scratch their nibbles pass through."""
        return self._scratch.numel() + sum(slot.dense.numel() for slot in self._slots if slot.dense is not None)

    @property
    def host_bytes(self) -> int:
        """Pinned host memory: the layers placed in RAM, and the staging buffers of those placed on disk."""
        return self._pinned_bytes

    def close(self) -> None:
        """:meth:`LayerStreamer.close` (the reader threads stopped, the model handed back, a later forward refused
        with the fix), then the host memory unpinned once pending copies have landed."""
        super().close()
        self._release_pinned()

    def _fill(self, position: int, slot: _DeviceSlot) -> Future:
        try:
            return self._issue_fill(position, slot)
        except Exception as error:
            # Refused when issued (a CUDA enqueue error, say): the failure travels in ``filled``, so that the forward
            # that needs the layer raises it and resets the slot, not the forward that merely queued it ahead.
            failed: Future = Future()
            failed.set_exception(error)
            return failed

    def _issue_fill(self, position: int, slot: _DeviceSlot) -> Future:
        """Queues the copy of layer ``position`` into ``slot``, behind the compute that last read the slot."""
        if slot.opened:
            slot.free, slot.opened = self._device.compute_record(), False
        after = slot.free
        if self._units[position][1] is None and slot.filled.done():
            return _resolved(self._upload(position, after))
        # Through the reader thread, behind the slot's pending fill, so that copies into a slot are issued in order.
        return self._reader.submit(self._stage_and_upload, position, slot, after)

    def _stage_and_upload(self, position: int, slot: _DeviceSlot, after: Any) -> Any:
        """On the reader thread: reads a disk-placed layer into the pinned staging, then issues its copies up."""
        reads = self._units[position][1]
        if reads is not None:
            if slot.staged is not None:
                self._device.host_wait(slot.staged)  # the previous copy out of the staging buffer has landed
            self._direct_reader.read(reads)
        done = self._upload(position, after)
        if reads is not None:
            slot.staged = done
        return done

    def _upload(self, position: int, after: Any) -> Any:
        """Issues layer ``position``'s copies to its slot, each behind ``after``; returns the done event of all.

        The copy queue runs them in order, so the last one's event is the layer's. They are issued last to first,
        so that this event is the copy into the slot's start, the address that names the slot (to an ordering
        checker too).
        """
        for upload in reversed(self._uploads[position]):
            done = self._device.copy(upload.target, upload.source, after)
        return done

    def _await(self, slot: _DeviceSlot) -> None:
        self._device.compute_wait(slot.filled.result())
        slot.opened = True

    def _before_unit(self, position: int, module: nn.Module, args: tuple) -> None:
        super()._before_unit(position, module, args)  # waits for the layer's copy, then queues the next ones
        self._expand(self._slots[self._slot_of[position]])

    def _expand(self, slot: _DeviceSlot) -> None:
        """Expands the quantized weights of the layer ``slot`` holds into its dense buffer, once per fill.

        Queued on the compute queue after the wait for the layer's copy, and after the copies of the next layers
        were queued (their slot-free events are recorded before it, so that they overlap it); the copy that next
        overwrites this slot waits for a slot-free event recorded later, after the layer computed.
        """
        if slot.expanded is slot.filled:
            return
        for weight, dense in self._expansions[slot.position]:
            expand_into(weight, dense, self._scratch)
        slot.expanded = slot.filled

    def _await_on_host(self, slot: _DeviceSlot) -> None:
        if slot.position is not None and slot.filled.exception() is None:  # a failed read has nothing in flight
            self._device.host_wait(slot.filled.result())


def _execution_form(device: torch.device, expand_quantized: bool, tensor: torch.Tensor) -> torch.Tensor:
    """A streamed layer's tensor-subclass weight as its slot holds it: a quantized weight that expands, in quanto's
    generic layout on the host (:func:`~.expand.streamed_form`); any other, as quanto lays it out for ``device``."""
    if expand_quantized and expandable(tensor):
        return streamed_form(tensor)
    return tensor.to(device)


def _expanded_linears(unit: nn.Module, parameters: list[OffloadedParameter]) -> list[tuple[str, nn.Linear]]:
    """``(name in unit, module)`` of each linear layer of ``unit`` whose streamed weight expands into a dense one:
    a weight-only quantized one (a quanto module quantizing its activations too keeps its own forward)."""
    streamed = {id(parameter.owner) for parameter in parameters if parameter.attribute == "weight"}
    return [
        (name, module)
        for name, module in unit.named_modules()
        if isinstance(module, nn.Linear)
        and id(module) in streamed
        and expandable(module.weight)
        and getattr(module, "activation_qtype", None) is None
    ]


def _dense_layout(linears: list[tuple[str, nn.Linear]], alignment: int) -> tuple[int, list[int]]:
    """The dense buffer bytes that the weights of ``linears`` expand into and each one's offset there, every weight
    ``alignment``-aligned as the in-memory model's own allocation of it would be."""
    offsets, size = [], 0
    for _, linear in linears:
        offsets.append(round_up(size, alignment))
        size = offsets[-1] + linear.weight.numel() * linear.weight.dtype.itemsize
    return size, offsets


def _bind_dense(
    model: nn.Module, unit: str, linears: list[tuple[str, nn.Linear]], offsets: list[int], dense: torch.Tensor | None
) -> list[tuple[PackedWeight, torch.Tensor]]:
    """Replaces each quantized linear layer of ``model``'s unit ``unit`` (named within it, ``""`` for the unit
    itself; its weight bound over the ring slot already) by a plain ``nn.Linear`` over its view of ``dense``;
    returns the packed weights and the views they expand into."""
    expansions = []
    for (name, linear), offset in zip(linears, offsets):
        weight = packed_weight(linear.weight)
        nbytes = math.prod(weight.shape) * weight.dtype.itemsize
        view = dense[offset : offset + nbytes].view(weight.dtype).view(weight.shape)
        plain = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
        plain.weight = nn.Parameter(view, requires_grad=False)
        plain.bias = linear.bias
        parent, _, attribute = ".".join(filter(None, (unit, name))).rpartition(".")
        setattr(model.get_submodule(parent), attribute, plain)
        expansions.append((weight, view))
    return expansions


def _members(runs: list[Run]) -> list[OffloadedParameter]:
    """The parameters a unit's runs place, in order."""
    return [parameter for run in runs for parameter, _ in run.members]


def _uploads(runs: list[Run], staged_runs: list[Run], staging: torch.Tensor, buffer: torch.Tensor) -> list[Copy]:
    """The copies that move a unit from ``staging`` (laid out as ``staged_runs``) to ``buffer`` (as ``runs``).

    Consecutive weights whose offsets differ by the same amount in both layouts (weights stored back to back whose
    sizes are multiples of the device's alignment, typically) share one copy, padding between them included.
    """
    staged_at = {id(parameter): offset for run in staged_runs for parameter, offset in run.members}
    pieces: list[list[int]] = []  # [staging offset, buffer offset, bytes]
    for run in runs:
        for parameter, offset in run.members:
            source, nbytes = staged_at[id(parameter)], span_bytes(parameter.meta)
            if pieces and source - pieces[-1][0] == offset - pieces[-1][1]:
                pieces[-1][2] = offset + nbytes - pieces[-1][1]
            else:
                pieces.append([source, offset, nbytes])
    return [Copy(staging[source : source + nbytes], buffer[at : at + nbytes]) for source, at, nbytes in pieces]


def _resolved(value: Any) -> Future:
    """A future already holding ``value``."""
    future: Future = Future()
    future.set_result(value)
    return future


def _release_pinned(device: StreamDevice, pinned: list[torch.Tensor]) -> None:
    """Unpins ``pinned`` once no queued copy reads it any more."""
    device.drain()
    for buffer in pinned:
        device.unpin(buffer)
