"""Where a streamed model's bytes go: the layout both executors share, planned once when they are installed.

A streamed unit (a decoder layer, an embedding) is a list of :class:`OffloadedParameter` entries, each knowing where
its weights are stored (:class:`StoredWeight` in a file, :class:`HeldWeight` in host memory). :func:`plan_runs`
groups a unit's parameters into :class:`Run` records (bytes that one read or copy moves) and places them in a ring
buffer with the alignment the in-memory model's tensors have, so that outputs stay bit-identical;
:func:`bind_views` makes the unit's parameters views of that buffer; :func:`unit_spans` (direct reads) and
:func:`unit_copies` (copies of RAM-held weights) fill it. :func:`ring_slots` says which ring buffer each unit computes
out of (:class:`RingSlot`), reading ahead without two units in flight sharing one.

The executors (:mod:`.stream` on the CPU, :mod:`.device_stream` on an accelerator, vLLM's offload) decide when to
fill which buffer; this module only decides where things go.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .direct_io import Span, WeightFile, round_up

# Allocation alignment of torch's CPU allocator, which ring-buffer views reproduce (see plan_runs).
CPU_ALLOCATION_ALIGNMENT = 64
OVERSIZED = 2
"""A streamed unit more than this many times the median unit gets a ring buffer of its own (:func:`ring_slots`)."""


@dataclass
class StoredWeight:
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
class HeldWeight:
    """A weight held in host memory: a unit placed in CPU RAM, for the device executor to pin."""

    held: torch.Tensor
    file = None
    offset = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.held.dtype

    @property
    def nbytes(self) -> int:
        return span_bytes(self.held)

    def tensor(self) -> torch.Tensor:
        return self.held


@dataclass
class OffloadedParameter:
    """A parameter of a streamed unit (on the meta device, or in host memory) and where its weights are stored.

    A parameter that is a tensor subclass (a quantized weight) is streamed as its plain inner tensors: one entry
    per inner tensor (``meta`` and ``stored`` describe it), all pointing to the ``composite`` that rebuilds the
    parameter, which is bound to ``owner.attribute``.
    """

    owner: nn.Module
    attribute: str
    meta: torch.Tensor
    stored: StoredWeight | HeldWeight
    composite: Composite | None = None


@dataclass(eq=False)
class Composite:
    """A tensor subclass as ``__tensor_flatten__`` takes it apart, to rebuild it over other inner tensors.

    Args:
        cls: The subclass.
        context: Its flattening context.
        size: Its outer size.
        stride: Its outer stride.
        parts: The inner tensors by attribute name: plain ones as :class:`OffloadedParameter`, nested subclasses
            (a packed tensor inside a quantized weight) as :class:`Composite`.
    """

    cls: type
    context: Any
    size: torch.Size
    stride: tuple[int, ...]
    parts: dict[str, OffloadedParameter | Composite]

    def leaves(self) -> Iterator[OffloadedParameter]:
        """The plain inner tensors' entries, nested ones included."""
        for part in self.parts.values():
            if isinstance(part, Composite):
                yield from part.leaves()
            else:
                yield part

    def rebuild(self, views: dict[int, torch.Tensor]) -> torch.Tensor:
        """The subclass over ``views`` (by ``id`` of each inner tensor's entry); the views are not copied."""
        inner = {
            name: part.rebuild(views) if isinstance(part, Composite) else views[id(part)]
            for name, part in self.parts.items()
        }
        return self.cls.__tensor_unflatten__(inner, self.context, self.size, self.stride)


@dataclass
class Run:
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
    members: list[tuple[OffloadedParameter, int]] = field(default_factory=list)

    def extends_with(self, parameter: OffloadedParameter) -> bool:
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
class Copy:
    """One read of a unit: zero-copy file ``source`` into ring-buffer ``target``."""

    source: torch.Tensor
    target: torch.Tensor


@dataclass
class RingSlot:
    """A ring buffer and the unit position it holds (or is being filled with)."""

    buffer: torch.Tensor
    position: int | None = None
    filled: Future = field(default_factory=Future)


def cycling_units(count: int, unit_bytes: list[int] | None = None) -> list[int]:
    """The positions of the units that go round the ring's shared buffers: all but those more than
    :data:`OVERSIZED` times the median unit, which get a buffer of their own (:func:`ring_slots`).

    Args:
        count: Streamed units.
        unit_bytes: The bytes each unit needs, in execution order; ``None``: all alike.
    """
    if not unit_bytes:
        return list(range(count))
    median = sorted(unit_bytes)[len(unit_bytes) // 2]  # never oversized itself, so some units always cycle
    return [position for position, size in enumerate(unit_bytes) if size <= OVERSIZED * median]


def ring_slots(count: int, prefetch: int, unit_bytes: list[int] | None = None) -> list[int]:
    """The ring buffer each of ``count`` streamed units computes out of, reading ``prefetch`` units ahead.

    Units go round ``prefetch + 1`` buffers; when their number is not a multiple of that, the last ones get a buffer
    each of their own, so that any ``prefetch + 1`` consecutive units, across the end of a forward too, use distinct
    buffers: the next forward's first units are read ahead while the last ones compute. A unit more than
    :data:`OVERSIZED` times the median unit (an LM head beside decoder layers) gets a buffer of its own too, so it
    is read once and stays: sharing a buffer, it would make that buffer its size anyway and be read every forward,
    while a buffer of its own costs one more ordinary unit's worth (and up to ``prefetch`` more where the units left
    to cycle end the cycle unevenly).

    Args:
        count: Streamed units.
        prefetch: Units read ahead of the one computing.
        unit_bytes: The bytes each unit needs, in execution order; ``None``: all alike.
    """
    cycling = cycling_units(count, unit_bytes)
    oversized = set(range(count)) - set(cycling)
    ring = min(prefetch + 1, len(cycling))
    cycled = len(cycling) - len(cycling) % ring
    slot_of = [0] * count
    for order, position in enumerate(cycling):
        slot_of[position] = order % ring if order < cycled else ring + order - cycled
    for extra, position in enumerate(sorted(oversized)):
        slot_of[position] = len(cycling) - cycled + ring + extra
    return slot_of


def slot_members(slot_of: list[int]) -> list[list[int]]:
    """The unit positions of each ring buffer."""
    members: list[list[int]] = [[] for _ in range(max(slot_of) + 1)]
    for position, slot in enumerate(slot_of):
        members[slot].append(position)
    return members


def slot_bytes(unit_bytes: list[int], slot_of: list[int], alignment: int = 1) -> list[int]:
    """Each ring buffer's size: the largest unit it serves, rounded up to ``alignment``.

    Args:
        unit_bytes: The bytes each streamed unit needs, in execution order.
        slot_of: The ring buffer of each unit (:func:`ring_slots`).
        alignment: What each buffer's size is rounded up to.
    """
    return [
        round_up(max(unit_bytes[position] for position in members), alignment)
        for members in slot_members(slot_of)
    ]


def ring_bytes(unit_bytes: list[int], prefetch: int, alignment: int = 1) -> int:
    """The bytes of the ring buffers that streaming ``unit_bytes`` with ``prefetch`` units read ahead takes."""
    return sum(slot_bytes(unit_bytes, ring_slots(len(unit_bytes), prefetch, unit_bytes), alignment))


def prefetch_within(unit_bytes: list[int], budget_bytes: int, alignment: int = 1) -> int:
    """The deepest read-ahead whose ring buffers fit ``budget_bytes`` (at least 1: the executor needs two buffers).

    A deeper read-ahead keeps more requests in flight and reads more of the next forward's first units while the
    draft grows its tree; with every unit in a buffer of its own the weights stay loaded and are read once.

    Args:
        unit_bytes: The bytes each streamed unit needs, in execution order.
        budget_bytes: The memory the ring may take.
        alignment: What each buffer's size is rounded up to.
    """
    fitting = [
        prefetch
        for prefetch in range(1, max(2, len(unit_bytes)))
        if ring_bytes(unit_bytes, prefetch, alignment) <= budget_bytes
    ]
    return max(fitting, default=1)


def auto_prefetch(unit_bytes: list[int], headroom_bytes: int, share: float, alignment: int = 1) -> int:
    """``prefetch="auto"``: the deepest read-ahead whose ring takes, beyond the smallest ring (prefetch 1, which
    the executor allocates whatever the memory), at most ``share`` of the headroom that smallest ring leaves, and no
    deeper than :func:`deepest_streaming_prefetch`.

    The smallest ring is not charged against the share: it is allocated anyway, and where it alone exceeds the
    share (an LM head with a buffer of its own under a tight memory cap: the default target's is 142 MB against
    121 MB, half of a 242 MB room) charging it left no read-ahead at all, though three more 14 MB layer buffers
    read the same forward from disk 1.8x faster (1.01 GB/s at prefetch 1, 1.84 at prefetch 4, measured here).

    Args:
        unit_bytes: The bytes each streamed unit needs, in execution order.
        headroom_bytes: The memory the process can still take (:func:`~.memory.memory_headroom`).
        share: The share of the headroom left beside the smallest ring that deeper read-ahead may take.
        alignment: What each buffer's size is rounded up to.
    """
    smallest = ring_bytes(unit_bytes, 1, alignment)
    within = prefetch_within(unit_bytes, smallest + int(share * max(0, headroom_bytes - smallest)), alignment)
    return min(within, deepest_streaming_prefetch(unit_bytes))


def deepest_streaming_prefetch(unit_bytes: list[int]) -> int:
    """The deepest read-ahead ``"auto"`` takes: half the cycling units (:func:`cycling_units`) ahead of the one
    computing, less one, so that every cycling unit shares its buffer with another and is read every forward.

    An offloaded model stays offloaded: a ring holding every layer at once is the in-memory model, which the
    placement (``max_memory``) said no to, so more memory than half the streamed layers is never taken unasked. It is
    also about the depth past which read-ahead stops paying: side by side on the default target streamed from disk
    (30 layers), SpecExec ran 2.50x plain decoding reading 4 layers ahead, 2.87x at 9 and 3.17x at 14, this bound
    (``benchmarks/results/ssd/ring_depth_huge_pages/``), the disk reading half the next forward while the draft grows
    its tree.

    Args:
        unit_bytes: The bytes each streamed unit needs, in execution order.
    """
    return max(1, len(cycling_units(len(unit_bytes), unit_bytes)) // 2 - 1)


def plan_runs(
    parameters: list[OffloadedParameter],
    alignment: int = CPU_ALLOCATION_ALIGNMENT,
    each_fresh: bool = False,
    padded: bool = False,
) -> tuple[int, list[Run]]:
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
    runs: list[Run] = []
    size = 0
    for parameter in parameters:
        stored = parameter.stored
        if runs and not each_fresh and runs[-1].extends_with(parameter):
            run = runs[-1]
            run.file_end += stored.nbytes
        else:
            typed = each_fresh or stored.dtype != parameter.meta.dtype
            free = next_offset(size, 0, alignment) if padded else size
            start = next_offset(free, 0 if typed else stored.offset % alignment, alignment)
            converts_to = parameter.meta.dtype if typed else None
            run = Run(stored.file, stored.offset, stored.offset + stored.nbytes, start, converts_to)
            runs.append(run)
        buffer_offset = run.buffer_start + (0 if run.converts_to else stored.offset - run.file_start)
        run.members.append((parameter, buffer_offset))
        size = buffer_offset + span_bytes(parameter.meta)
    return size, runs


def next_offset(offset: int, remainder: int, alignment: int = CPU_ALLOCATION_ALIGNMENT) -> int:
    """The smallest byte offset ``>= offset`` that is ``remainder`` modulo ``alignment``."""
    return offset + (remainder - offset) % alignment


def span_bytes(tensor: torch.Tensor) -> int:
    """Bytes from ``tensor``'s first element to one past its last, whatever its strides."""
    if tensor.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))) * tensor.element_size()


def member_view(buffer: torch.Tensor, parameter: OffloadedParameter, offset: int) -> torch.Tensor:
    """The typed view of ``buffer`` that ``parameter`` occupies at byte ``offset``, with its shape and strides."""
    meta = parameter.meta
    return buffer[offset : offset + span_bytes(meta)].view(meta.dtype).as_strided(meta.shape, meta.stride())


def bind_views(runs: list[Run], buffer: torch.Tensor) -> None:
    """Replaces a unit's parameters by views of ``buffer``, laid out as ``runs`` plan."""
    views: dict[int, torch.Tensor] = {}
    composites: dict[int, OffloadedParameter] = {}
    for run in runs:
        for parameter, offset in run.members:
            view = member_view(buffer, parameter, offset)
            if parameter.composite is None:
                setattr(parameter.owner, parameter.attribute, nn.Parameter(view, requires_grad=False))
            else:
                views[id(parameter)] = view
                composites[id(parameter.composite)] = parameter
    for parameter in composites.values():
        rebuilt = parameter.composite.rebuild(views)
        setattr(parameter.owner, parameter.attribute, nn.Parameter(rebuilt, requires_grad=False))


def unit_spans(runs: list[Run], buffer: torch.Tensor) -> list[Span]:
    """The file spans that fill ``buffer`` (laid out as ``runs`` plan) with a unit's stored weights (direct reads)."""
    spans = []
    for run in runs:
        if run.converts_to is None:
            target = buffer[run.buffer_start : run.buffer_start + run.file_end - run.file_start]
            spans.append(Span(run.file, run.file_start, run.file_end, target))
        else:
            for parameter, offset in run.members:
                stored = parameter.stored
                target = member_view(buffer, parameter, offset)
                spans.append(Span(stored.file, stored.offset, stored.offset + stored.nbytes, target, stored.dtype))
    return spans


def unit_copies(runs: list[Run], buffer: torch.Tensor) -> list[Copy]:
    """The copies that fill ``buffer`` (laid out as ``runs`` plan) with a unit's stored weights."""
    copies = []
    for run in runs:
        if run.converts_to is None:
            source = run.file.tensor(run.file_start, torch.uint8, (run.file_end - run.file_start,))
            copies.append(Copy(source, buffer[run.buffer_start : run.buffer_start + source.numel()]))
        else:
            for parameter, offset in run.members:
                target = member_view(buffer, parameter, offset)
                copies.append(Copy(parameter.stored.tensor().view(target.shape), target))
    return copies
