"""The read-ahead executor: offloaded modules streamed through a ring of buffers allocated once.

Here: finding what a unit streams and where it is stored (:func:`unit_parameters`, after removing accelerate's
hooks) and the executor itself (:class:`LayerStreamer`); where the bytes go in the ring is :mod:`.layout`'s.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from functools import partial, wraps
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import PreTrainedModel

from ..core.precision import native_bfloat16_cpu
from ..hf.executor import attach_executor, detach_executor, executor_of
from ..hf.forward import mark_weights_stay_loaded
from ..hf.ownership import CallLock
from .direct_io import (
    BLOCK,
    DirectReader,
    ReadPlan,
    WeightFile,
    WeightFileError,
    aligned_empty,
    plan_reads,
)
from .layout import (
    Composite,
    Copy,
    HeldWeight,
    OffloadedParameter,
    RingSlot,
    StoredWeight,
    auto_prefetch,
    bind_views,
    plan_runs,
    ring_bytes,
    ring_slots,
    slot_bytes,
    slot_members,
    span_bytes,
    unit_spans,
)
from .memory import memory_headroom

logger = logging.getLogger(__name__)

# Alignment of the CPU ring's runs: the file offset modulo a block, so that direct reads land in place.
_RING_ALIGNMENT = BLOCK
AUTO_RING_SHARE = 0.5
"""Share of the memory headroom, beside the smallest ring, that ``prefetch="auto"`` gives deeper read-ahead
(:func:`~.layout.auto_prefetch`): the rest stays for activations, KV caches, the draft and the embedding rows read
through the page cache."""


def layer_streamer(model: PreTrainedModel) -> LayerStreamer | None:
    """The :class:`LayerStreamer` (or :class:`~.device_stream.DeviceLayerStreamer`) that ``load_offloaded(...,
    executor="stream")`` installed on ``model``, if any: the executor the adapter finds
    (:func:`~specexec_hf.hf.executor.executor_of`), typed to this layer's classes."""
    executor = executor_of(model)
    return executor if isinstance(executor, LayerStreamer) else None


class LayerStreamer:
    """Runs disk-offloaded modules out of a ring of reused buffers, reading the next ones ahead on threads.

    Each streamed unit always computes out of the same ring buffer (:func:`ring_slots`): its parameters are views
    of that buffer, bound once, so a forward allocates nothing. Before unit ``i`` runs, the streamer waits for its
    weights and queues the reads of the next ``prefetch`` units that share buffers (wrapping around to the next
    forward's first units; a unit with a buffer of its own is read once, stays loaded and is marked so, which lets
    the walk apply a resident LM head to a few rows lazily), which a :class:`~.direct_io.DirectReader` performs
    while unit ``i`` computes: ``O_DIRECT`` reads from
    the weight files straight into the ring buffer, several in flight, bypassing the page cache (through it where
    the filesystem refuses direct reads). A unit called out of order is read on the spot, so the order affects
    speed only, never results. Each read checks that the files kept the identity (device, inode, size,
    modification and status-change times) they had at install and that their names still lead to them, so a weight
    file truncated, rewritten, replaced or deleted under a running model raises
    :class:`~.direct_io.WeightFileError` in the forward that needs it rather than feeding it other bytes.

    Use :meth:`install`; :func:`layer_streamer` finds a model's streamer. :class:`~.device_stream.DeviceLayerStreamer`
    runs the same ring on an accelerator. Both implement :class:`~specexec_hf.hf.executor.StreamingExecutor`, what the
    adapter asks them; :meth:`close` hands the model back.

    Embedding tables are not streamed: a lookup needs only the rows of the tokens fed, so an embedding computes
    straight from the memory-mapped file, which reads just those rows' pages (bit-identical: it is a gather); each
    lookup first checks the file's size, as a mapping past a truncated file's end would crash the process.

    The ring has one owner at a time (:meth:`exclusive_use`, a :class:`~specexec_hf.hf.ownership.CallLock`):
    ``generate()`` holds it for the whole call and each forward entered through a module holding streamed units
    (the model, its base model) holds it too, so calls from several threads run one after another, each exact,
    and a bare forward waits for a running call instead of computing with weights that call's reads overwrite.

    Args:
        unit_names: The streamed units' module names, in execution order.
        units: ``(module, read plan)`` per streamed unit (the plan of the reads that fill its ring buffer).
        slots: The ring buffers.
        slot_of: The ring buffer of each unit, from :func:`ring_slots`.
        unit_bytes: The bytes each unit's read moves, in execution order.
        prefetch: Units read ahead of the one computing.
        reader: Performs the read plans; a new :class:`~.direct_io.DirectReader` when ``None``.
    """

    def __init__(
        self,
        unit_names: list[str],
        units: list[tuple[nn.Module, ReadPlan | list[Copy]]],
        slots: list[RingSlot],
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
        self._ownership = CallLock()
        self._model: nn.Module | None = None  # the model attached to (by install), to hand back at close
        self._wrapped: list[tuple[nn.Module, Callable[..., Any] | None]] = []  # (module, its own forward attribute)
        self.reads_requested = 0  # unit reads queued so far, for tests and statistics
        self.forwards_begun = 0  # forwards that reached their first unit
        # Seconds between the landing of the last unit read ahead for a forward and that forward's start, summed
        # over forwards whose read-ahead had all landed: time the disk sat idle that deeper read-ahead would use.
        self.read_ahead_idle_seconds = 0.0
        # Unit position -> its latest fill and when it landed (perf_counter).
        self._landed_at: dict[int, tuple[Future, float]] = {}
        shared = slot_members(slot_of)
        # A unit alone in its buffer is read once and stays: read-ahead counts only the units that cycle.
        self._stays_loaded = [len(shared[slot]) == 1 for slot in slot_of]
        self._cycling = [position for position, stays in enumerate(self._stays_loaded) if not stays]
        self._unit_hooks: list[RemovableHandle] = []
        for position, (module, _) in enumerate(units):
            self._unit_hooks.append(module.register_forward_pre_hook(partial(self._before_unit, position)))
            if self._stays_loaded[position]:
                mark_weights_stay_loaded(module)

    @classmethod
    def install(
        cls,
        model: PreTrainedModel,
        unit_names: list[str],
        prefetch: int | str = 1,
        offload_folder: str | os.PathLike | None = None,
    ) -> LayerStreamer | None:
        """Replaces accelerate's hooks on a dispatched model by a streamer for its disk-placed units.

        Args:
            model: A model with ``unit_names`` on disk (their parameters on the meta device) and everything else on
                the CPU.
            unit_names: The disk-placed weight units, in execution order.
            prefetch: Units read ahead of the one computing, or ``"auto"``: the deepest read-ahead whose ring, beyond
                the smallest one, takes at most :data:`AUTO_RING_SHARE` of the memory the process can still take
                beside that (:func:`~.memory.memory_headroom`, cgroup limits included; 1 where it cannot be read;
                see :func:`~.layout.auto_prefetch`).
            offload_folder: Where :func:`~.folder.write_offload_folder` wrote the disk-placed weights of a model
                placed without accelerate's hooks; ``None``: the weights are found through the hooks
                ``dispatch_model`` (or ``from_pretrained``) attached.

        Returns:
            The streamer, or ``None`` when no unit needs streaming.
        """
        if not unit_names:
            _detach_accelerate_hooks(model)
            return None
        locate = folder_locator(offload_folder) if offload_folder is not None else None
        parameters = unit_parameters(model, unit_names, resident=lambda parameter: not parameter.is_meta, locate=locate)
        streamed = []
        for name in unit_names:
            if _reads_rows_on_demand(model.get_submodule(name), parameters[name]):
                _bind_to_file(model.get_submodule(name), parameters[name])
            else:
                streamed.append(name)
        if not streamed:
            return None
        if _mostly_plain_bfloat16([parameter for name in streamed for parameter in parameters[name]]) and not (
            native_bfloat16_cpu()
        ):
            logger.warning(
                "This model streams bfloat16 weights to a CPU without native bfloat16 matmuls, where every forward "
                "over a tree is compute-bound: load it with dtype=torch.float32 (load_offloaded(..., "
                "dtype=torch.float32)) to read the same bytes from disk and compute in float32, several times "
                "faster over many tokens; the outputs are then the float32 model's."
            )
        plans = [plan_runs(parameters[name], _RING_ALIGNMENT, padded=True) for name in streamed]
        unit_bytes = [size for size, _ in plans]
        if prefetch == "auto":
            headroom = memory_headroom()
            prefetch = 1 if headroom is None else auto_prefetch(unit_bytes, headroom, AUTO_RING_SHARE, BLOCK)
        slot_of = ring_slots(len(streamed), prefetch, unit_bytes)
        slots = [RingSlot(aligned_empty(size)) for size in slot_bytes(unit_bytes, slot_of, BLOCK)]
        units = []
        for position, (name, (_, runs)) in enumerate(zip(streamed, plans)):
            buffer = slots[slot_of[position]].buffer
            bind_views(runs, buffer)
            units.append((model.get_submodule(name), plan_reads(unit_spans(runs, buffer))))
        streamer = cls(streamed, units, slots, slot_of, unit_bytes, prefetch)
        streamer._attach(model)
        return streamer

    def _attach(self, model: PreTrainedModel) -> None:
        """Installs the streamer on ``model``: attached as its executor (through the adapter's seam,
        :func:`~specexec_hf.hf.executor.attach_executor`; :func:`layer_streamer` finds it), and owning the ring for
        each forward entered through a module that holds streamed units (their ancestors: the model, its base
        model, ...)."""
        attach_executor(model, self)
        self._model = model
        for name in dict.fromkeys(ancestor for unit in self.unit_names for ancestor in _ancestors(unit)):
            module = model.get_submodule(name)
            self._wrapped.append((module, vars(module).get("forward")))
            # As an instance attribute, as accelerate's hooks do; a try/finally, unlike a pair of hooks, releases
            # the ring whatever the forward raises, KeyboardInterrupt included.
            module.forward = self._owning(module.forward)

    def _owning(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` holding the ring's ownership (the signature transformers inspects is kept)."""

        @wraps(forward)
        def owning_forward(*args, **kwargs) -> Any:
            with self._ownership.held():
                return forward(*args, **kwargs)

        return owning_forward

    def exclusive_use(self) -> AbstractContextManager[None]:
        """The ring's ownership, held by ``generate()`` for a whole call: waits while another call owns it.

        Reentrant within the call (its forwards, the threads it starts in a copy of its context).
        """
        return self._ownership.held()

    @property
    def prefetch(self) -> int:
        """Units read ahead of the one computing (``"auto"`` resolved at install)."""
        return self._prefetch

    @property
    def cycling_units(self) -> int:
        """Units read on every forward (the others stay loaded)."""
        return len(self._cycling)

    def ring_bytes_at(self, prefetch: int) -> int:
        """The bytes this streamer's ring would take reading ``prefetch`` units ahead (:func:`~.layout.ring_bytes`)."""
        return ring_bytes(self._unit_bytes, prefetch, BLOCK)

    @property
    def buffer_bytes(self) -> int:
        """Bytes held by the ring buffers: all the memory the streamer uses for weights, fixed at install."""
        return sum(slot.buffer.numel() for slot in self._slots)

    @property
    def streamed_bytes_per_forward(self) -> int:
        """Bytes each forward reads into the ring, once the first forward has filled it.

        Units that have a buffer to themselves (all of them when ``prefetch + 1 >= len(unit_names)``, else the
        last few, see :func:`ring_slots`) stay loaded and are read once only.
        """
        return sum(self._unit_bytes[position] for position in self._cycling)

    @property
    def read_bytes_per_forward(self) -> int:
        """Bytes each forward reads from the weight files, once the first forward has filled the ring: the bytes
        the disk moves, against :attr:`streamed_bytes_per_forward`, the bytes the ring receives (half of those
        where a bfloat16 checkpoint is computed in float32)."""
        cycling = (plan for (_, plan), stays in zip(self._units, self._stays_loaded) if not stays)
        return sum(plan.file_bytes for plan in cycling if plan is not None)  # None: a layer the device loads from RAM

    def wait_idle(self) -> None:
        """Blocks until every read queued so far has landed (for timing a forward without the read-ahead)."""
        for slot in self._slots:
            self._await_on_host(slot)

    def close(self) -> None:
        """Stops the reader threads and hands the model back as far as it can: the streamer's hooks and forward
        wrappers removed, the model detached (:func:`layer_streamer` finds no streamer on it). The ring no longer
        loads the streamed weights, so each streamed module keeps a guard: a later forward raises one
        ``RuntimeError`` naming the fix. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._reader.shutdown(wait=True)
        self._direct_reader.close()
        for hook in self._unit_hooks:
            hook.remove()
        for module, own_forward in self._wrapped:
            if own_forward is None:
                del module.forward  # the class's forward again
            else:
                module.forward = own_forward
        for module, _ in self._units:
            module.register_forward_pre_hook(_refuse_closed)
        if self._model is not None:
            detach_executor(self._model, self)

    def _before_unit(self, position: int, module: nn.Module, args: tuple) -> None:
        if position == 0:
            self._note_forward_start()
        current = self._request(position)
        try:
            self._await(current)  # re-raises a failed read here, in the forward that needs it
        except BaseException:
            current.position = None  # what the buffer holds is unknown now: read it again next time
            raise
        queued, ahead = 0, 0
        while queued < self._prefetch and ahead < len(self._units) - 1:
            ahead += 1
            upcoming = (position + ahead) % len(self._units)
            if self._slots[self._slot_of[upcoming]] is not current:  # fewer units than slots: all stay loaded
                self._request(upcoming)
                queued += not self._stays_loaded[upcoming]

    def _request(self, position: int) -> RingSlot:
        """The slot of unit ``position``, queueing the read of its weights unless it holds or awaits them.

        The slot names the unit only once its fill exists, so that it never names a unit with no fill to await; a
        fill that fails to start leaves it naming none (read again when next needed).
        """
        slot = self._slots[self._slot_of[position]]
        if slot.position != position:
            if self._closed:
                raise RuntimeError("The layer streamer was closed (shutdown): it cannot read weights any more.")
            try:
                filled = self._fill(position, slot)
            except BaseException:
                slot.position = None  # part of the fill may have started: what the buffer holds is unknown
                raise
            filled.add_done_callback(partial(self._landed, position))
            slot.position, slot.filled = position, filled
            self.reads_requested += 1
        return slot

    def _landed(self, position: int, fill: Future) -> None:
        self._landed_at[position] = (fill, time.perf_counter())

    def _note_forward_start(self) -> None:
        """Counts a forward; where every unit read ahead for it had landed, adds how long before it began the last
        one did to :attr:`read_ahead_idle_seconds`."""
        self.forwards_begun += 1
        ahead = self._cycling[: self._prefetch]
        slots = [self._slots[self._slot_of[position]] for position in ahead]
        if ahead and all(slot.position == position and slot.filled.done() for position, slot in zip(ahead, slots)):
            now = time.perf_counter()
            # A fill whose callback has not run yet landed just now.
            landed = [
                entry[1] if (entry := self._landed_at.get(position)) and entry[0] is slot.filled else now
                for position, slot in zip(ahead, slots)
            ]
            self.read_ahead_idle_seconds += now - max(landed)

    def _fill(self, position: int, slot: RingSlot) -> Future:
        """Starts filling ``slot`` with unit ``position``'s weights, once the slot's previous fill has landed.

        That fill is in flight only where the forward that queued it ahead raised (or skipped the unit): the reader
        runs requests in parallel, and its bytes, landing last, would overwrite these.
        """
        self._await_on_host(slot)
        return self._direct_reader.submit(self._units[position][1])

    def _await(self, slot: RingSlot) -> None:
        """Makes the compute that follows see ``slot``'s weights."""
        slot.filled.result()

    def _await_on_host(self, slot: RingSlot) -> None:
        """Blocks the calling thread until ``slot``'s fill has landed."""
        if slot.position is not None:
            slot.filled.exception()  # waits; a failed read is raised by the forward that needs it


def _refuse_closed(module: nn.Module, args: tuple) -> None:
    """The guard a closed streamer leaves on each module it streamed, whose weights it no longer loads."""
    raise RuntimeError(
        "This model's layer streamer was closed (close()), so the weights it streamed are no longer loaded and the "
        "model cannot compute: load it again with specexec_hf.load_offloaded(...)."
    )


def _ancestors(name: str) -> list[str]:
    """The names of the modules above module ``name``, the root (``""``) first: ``"a.b.c"``: ``["", "a", "a.b"]``."""
    parts = name.split(".")
    return [".".join(parts[:length]) for length in range(len(parts))]


def _mostly_plain_bfloat16(parameters: list[OffloadedParameter]) -> bool:
    """Whether most streamed bytes are plain bfloat16 weights, multiplied as bfloat16 matmuls (not a quantized
    weight's bfloat16 scales: quanto's packed products compute those)."""
    plain = sum(p.stored.nbytes for p in parameters if p.composite is None and p.meta.dtype == torch.bfloat16)
    return 2 * plain > sum(p.stored.nbytes for p in parameters)


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
    if loader is None:
        return partial(_locate_in, {}, "")
    return partial(_locate_in, loader.index, loader.save_folder)


def folder_locator(folder: str | os.PathLike) -> Locator:
    """``locate`` (as :func:`_offloaded_weight_locator`'s) over the ``index.json`` of an offload folder written by
    :func:`~.folder.write_offload_folder`, for a model placed without accelerate's hooks."""
    path = os.path.join(folder, "index.json")
    try:
        with open(path) as handle:
            return partial(_locate_in, json.load(handle), os.fspath(folder))
    except (OSError, ValueError) as error:  # missing, unreadable, or not JSON (json's errors are ValueErrors)
        raise WeightFileError(
            f"The offload folder's index {path} cannot be read ({error}): it was removed or damaged after the "
            "folder was written. Load the model again into the folder."
        ) from error


def _locate_in(index: dict[str, dict], folder: str, name: str) -> tuple[str, str | None, dict[str, Any]]:
    """``name``'s entry in an offload ``index``: a tensor read in place from a safetensors file, or ``<name>.dat``
    in ``folder``."""
    info = index[name]
    if info.get("safetensors_file") is not None:
        return info["safetensors_file"], info.get("weight_name", name), info
    return os.path.join(folder, f"{name}.dat"), None, info


def _stored_weight(names: list[str], locate: Locator, files: dict[str, WeightFile]) -> StoredWeight:
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
            try:
                return StoredWeight(files[path], *files[path].safetensors_entry(safetensors_name))
            except KeyError as missing:
                raise WeightFileError(
                    f"{missing.args[0]} It is where the offload index places parameter {name!r}: the checkpoint is "
                    "incomplete or not this model's. Download or save it again."
                ) from None
        # accelerate's .dat files are raw arrays (bfloat16 stored as int16 bytes, 0-d tensors as 1-d).
        stored = StoredWeight(files[path], 0, getattr(torch, info["dtype"]), tuple(info["shape"]) or (1,))
        if stored.nbytes > files[path].size:
            raise WeightFileError(
                f"{path} is truncated: {files[path].size} bytes, where accelerate's offload index records "
                f"{stored.nbytes} for {name!r}. Offload the model again."
            )
        return stored
    raise WeightFileError(
        f"No offloaded copy of parameter {names[0]!r} is in the offload index: the checkpoint or offload folder is "
        "incomplete or not this model's. Load it again from a complete checkpoint."
    )


def unit_parameters(
    model: nn.Module,
    unit_names: list[str],
    resident: Callable[[nn.Parameter], bool],
    execution_form: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor,
    locate: Locator | None = None,
) -> dict[str, list[OffloadedParameter]]:
    """Each streamed unit's parameters with where their weights are stored, in file (or registration) order.

    Removes accelerate's hooks, leaving disk-offloaded weights on the meta device, whose stored copies are found
    through ``locate`` (files are opened on first use); other weights are held in memory. A tensor-subclass
    parameter (a quantized weight) is taken apart into its plain inner tensors: held ones as they are on the
    execution device, disk-placed ones (a subclass on the meta device) from the files
    :func:`~.folder.write_offload_folder` wrote for each inner tensor (``<parameter>.<inner path>``).

    Args:
        model: The dispatched model.
        unit_names: The streamed units.
        resident: Whether a parameter stays where it is (a weight tied to a resident module): it is not streamed.
        execution_form: A held tensor-subclass weight as it is on the execution device, in host memory (quantized
            formats repack for the device they move to).
        locate: Where a disk-placed weight's copy is (:func:`folder_locator`); ``None``: accelerate's offload index,
            read from its hooks.
    """
    locate = locate or _offloaded_weight_locator(model)
    _detach_accelerate_hooks(model)
    files: dict[str, WeightFile] = {}
    aliases = parameter_aliases(model)
    found: dict[str, list[OffloadedParameter]] = {}
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
            if _is_subclass(parameter) and parameter.is_meta:
                stored_inner = partial(_stored_inner_tensor, aliases[id(parameter)], locate, files)
                unit.extend(_flattened(owner, attribute, parameter, stored_inner))
            elif _is_subclass(parameter):
                unit.extend(_flattened(owner, attribute, execution_form(parameter.detach()), _held_inner_tensor))
            elif parameter.is_meta:
                stored = _stored_weight(aliases[id(parameter)], locate, files)
                if math.prod(stored.shape) != parameter.numel():
                    raise WeightFileError(
                        f"{stored.file.path} stores {unit_name}.{local_name} with shape {list(stored.shape)}, but the "
                        f"model expects {list(parameter.shape)}: the file does not belong to this model's config."
                    )
                unit.append(OffloadedParameter(owner, attribute, parameter, stored))
            else:
                unit.append(OffloadedParameter(owner, attribute, parameter, HeldWeight(parameter.detach())))
        found[unit_name] = sorted(unit, key=lambda p: (p.stored.file.path if p.stored.file else "", p.stored.offset))
    return found


def parameter_aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter (tied weights have several; an offload index may hold any one), by ``id``."""
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    return aliases


def _is_subclass(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a tensor subclass made of inner tensors (as quantized weights are)."""
    return type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__")


InnerSource = Callable[[str, torch.Tensor], tuple[torch.Tensor, "StoredWeight | HeldWeight"]]
"""``(inner path, inner tensor) -> (its meta or held tensor, where its bytes are)`` for :func:`_flattened`."""


def _flattened(owner: nn.Module, attribute: str, tensor: torch.Tensor, source: InnerSource) -> list[OffloadedParameter]:
    """Entries for the plain inner tensors of tensor subclass ``tensor``, bound to ``owner.attribute`` together.

    Args:
        owner: The module the rebuilt subclass is bound to.
        attribute: Its attribute name there.
        tensor: The subclass (held, or on the meta device for a disk-placed one).
        source: What each plain inner tensor's entry holds, by its dotted path inside ``tensor``.
    """

    def take_apart(part: torch.Tensor, prefix: str) -> Composite:
        names, context = part.__tensor_flatten__()
        composite = Composite(type(part), context, part.size(), part.stride(), {})
        for name in names:
            inner = getattr(part, name)
            if _is_subclass(inner):
                composite.parts[name] = take_apart(inner, f"{prefix}{name}.")
            else:
                composite.parts[name] = OffloadedParameter(owner, attribute, *source(f"{prefix}{name}", inner))
        return composite

    top = take_apart(tensor, "")
    leaves = list(top.leaves())
    for leaf in leaves:
        leaf.composite = top
    return leaves


def _held_inner_tensor(path: str, inner: torch.Tensor) -> tuple[torch.Tensor, HeldWeight]:
    held = inner.detach().cpu()
    return held, HeldWeight(held)


def _stored_inner_tensor(
    names: list[str], locate: Locator, files: dict[str, WeightFile], path: str, inner: torch.Tensor
) -> tuple[torch.Tensor, StoredWeight]:
    """A disk-placed subclass's inner tensor ``path``: its meta tensor and its copy, the bytes from its first element
    to its last in memory order (:func:`~.folder.write_offload_folder` writes the span, strides kept)."""
    stored = _stored_weight([f"{name}.{path}" for name in names], locate, files)
    if stored.dtype != inner.dtype or stored.nbytes != span_bytes(inner):
        raise WeightFileError(
            f"{stored.file.path} stores {names[0]}.{path} as {math.prod(stored.shape)} x {stored.dtype}, but the "
            f"model expects {span_bytes(inner)} bytes of {inner.dtype}: the offload folder does not belong to this "
            "model. Offload the model again."
        )
    return inner, stored


def _reads_rows_on_demand(module: nn.Module, parameters: list[OffloadedParameter]) -> bool:
    """Whether ``module`` is an embedding table stored in its compute dtype, which can be read in place."""
    return isinstance(module, nn.Embedding) and all(p.stored.dtype == p.meta.dtype for p in parameters)


def _bind_to_file(module: nn.Module, parameters: list[OffloadedParameter]) -> None:
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
