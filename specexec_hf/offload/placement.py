"""Offloaded targets: the setting SpecExec is built for, where every target forward streams weights from slow memory.

``load_offloaded`` places a target under a memory budget with accelerate (``infer_auto_device_map``) and runs it
with one of two executors:

- ``"stream"`` (the default wherever it applies): a :class:`LayerStreamer` that keeps a small ring of buffers
  allocated once and, on background threads, reads the next offloaded module's weights from the weight files
  (the safetensors checkpoint, or the ``.dat`` offload files) straight into the ring with ``O_DIRECT``
  (:mod:`.direct_io`) while the current module computes. It reads the same bytes
  as ``from_pretrained``, converts dtypes the same way and reproduces the memory alignment the weights would
  have in memory, so outputs are bit for bit those of the in-memory model. When ``max_memory`` names a GPU, it
  is a :class:`~.device_stream.DeviceLayerStreamer` instead: units that fit the GPU budget stay resident, the
  others are copied from exact-size pinned host buffers (or, from disk, through pinned staging) into a fixed ring
  on the GPU on a copy stream ordered by CUDA events (:func:`stream_on_device`).
- ``"accelerate"``: accelerate's own hooks (``dispatch_model``), which load every offloaded weight tensor by
  tensor at the start of each module's forward and drop it afterwards, with no read-ahead (several times
  slower); the default only where the streaming executor does not apply (modules spread over several GPUs).

A model dispatched by ``from_pretrained(..., device_map=..., offload_folder=...)`` gets the streaming executor
from :func:`stream`.

Both executors place modules at the granularity of "weight units": decoder layers (the model's
``_no_split_modules``) and the other modules that own parameters directly (embeddings, final norm, LM head).
Modules without parameters (rotary embeddings) always stay on the execution device.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from ..hf.compat import use_sdpa_attention
from .compressed import load_compressed, packed_checkpoint, packed_linears, packed_skeleton
from .device import StreamDevice
from .device_stream import DeviceLayerStreamer
from .direct_io import WeightFileError
from .folder import leave_on_meta, stored_tensors, write_offload_folder
from .layout import auto_prefetch
from .quantize import check_quantize, packed_dtypes, quantize_layers
from .stream import AUTO_RING_SHARE, LayerStreamer, layer_streamer

EXECUTORS = ("accelerate", "stream")
DISK = "disk"


def load_offloaded(
    path_or_model: str | os.PathLike | PreTrainedModel,
    max_memory: Mapping[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    executor: str | None = None,
    dtype: torch.dtype | None = None,
    prefetch: int | str = "auto",
    quantize: str | None = None,
) -> PreTrainedModel:
    """Loads a causal LM under a memory budget, modules that do not fit going to disk.

    Args:
        path_or_model: A checkpoint directory (or hub id) for ``from_pretrained``, or a model in memory, which is
            dispatched in place (its offloaded weights are written to ``offload_folder`` and freed). A
            compressed-tensors packed 4-bit (or 8-bit) checkpoint (:func:`~.compressed.packed_checkpoint`, GPTQ-style
            as downloaded) loads packed into memory as quanto layers in the form for the device that computes (the
            first GPU given memory in ``max_memory``, else the CPU; :func:`~.compressed.load_compressed`), and is
            then placed as a model in memory: its disk-placed layers written packed to ``offload_folder``.
        max_memory: Per-device budget as accelerate takes it, e.g. ``{0: "6GiB", "cpu": "12GiB"}``;
            ``{"cpu": 0}`` puts every weight on disk. ``None`` lets accelerate use all available memory.
        offload_folder: Where weights placed on disk are written. Needed for a model in memory; a safetensors
            checkpoint is read in place, so there it is only needed for ``.bin`` checkpoints.
        executor: ``"stream"``: :class:`LayerStreamer` when everything is on the CPU or disk; with a GPU in
            ``max_memory``, :class:`~.device_stream.DeviceLayerStreamer`, which keeps the units that fit the GPU
            budget resident and streams the others through a ring on the GPU. ``"accelerate"``: accelerate's
            hooks. ``None`` (default): ``"stream"``, unless ``max_memory`` spreads modules over several GPUs.
        dtype: Parameter dtype; ``None`` keeps the checkpoint's (or the model's) dtype.
        prefetch: For ``"stream"``, how many offloaded modules are read ahead of the one computing, or ``"auto"``
            (the default): the deepest read-ahead whose ring, beyond the smallest (prefetch 1), takes at most half
            the memory left beside that: on the CPU the memory the process can still take (cgroup limits included),
            on a GPU the device's free memory less the units kept resident on it. Read-ahead costs memory, never
            time: the reader fills a buffer only once its last unit has computed, and a deeper ring lets the disk
            (or the link) read more of the next forward while the draft grows its tree. Never deeper than half the
            streamed layers (:func:`~.layout.deepest_streaming_prefetch`): an offloaded model stays offloaded.
        quantize: ``"int4"`` or ``"int8"``: a checkpoint's decoder layers quantized with optimum-quanto as they load,
            one at a time (:mod:`.quantize`): the disk-placed ones are written packed to ``offload_folder`` and
            streamed from there, so a checkpoint bigger than RAM never is in memory whole. The CPU stream executor
            only; the placement sizes the quantized weights by their packed bytes (:func:`~.quantize.packed_dtypes`).
            For int4 keep (or pass) ``dtype`` bfloat16:
            quanto then packs for torch's int4 CPU kernel. ``None`` (default): the checkpoint's weights as they are.

    Returns:
        The model in eval mode, with SDPA attention. For ``"stream"``, :func:`layer_streamer` returns its
        streamer, whose ring buffers (``prefetch + 1`` of them, each as large as the largest streamed module it
        serves, on the execution device) come on top of ``max_memory``, as accelerate's per-module loads do.

    Raises:
        ValueError: An unknown ``executor``, a ``prefetch`` below 1, a model in memory that needs disk space
            but got no ``offload_folder``, or ``executor="stream"`` with modules on more than one GPU; ``quantize``
            unknown, given with a model in memory or a packed checkpoint, without ``offload_folder``, or with another
            executor or a GPU; a packed checkpoint whose scheme has no quanto form on the computing device, or whose
            layers go to disk without ``offload_folder`` or under an executor that streams them from RAM only (a
            GPU's, accelerate's hooks): all checked before its weights load.
        ImportError: ``quantize`` without optimum-quanto installed.
        RuntimeError: ``executor="stream"`` with a GPU in ``max_memory`` and no CUDA available to torch.
        OSError: The offload folder has no room for the weights placed on disk (``ENOSPC``), checked before
            writing, and while writing.
    """
    if executor is not None and executor not in EXECUTORS:
        raise ValueError(f"Unknown executor={executor!r}; choose one of {list(EXECUTORS)} (or None, the default).")
    _check_prefetch(prefetch)
    check_quantize(quantize)
    if quantize is not None and isinstance(path_or_model, PreTrainedModel):
        raise ValueError(
            "quantize= quantizes a checkpoint as it loads; quantize a model in memory with optimum-quanto "
            "(quanto.quantize, quanto.freeze) and pass it without quantize=."
        )
    if quantize is not None and offload_folder is None:
        raise ValueError(f"quantize={quantize!r} writes the quantized layers placed on disk: pass offload_folder=.")
    if not isinstance(path_or_model, PreTrainedModel) and packed_checkpoint(path_or_model):
        if quantize is not None:
            raise ValueError(
                f"{path_or_model} is already quantized (a compressed-tensors 'pack-quantized' checkpoint), so "
                f"quantize={quantize!r} has nothing to do: leave quantize unset, its packed integers are streamed as "
                "they are."
            )
        path_or_model = _load_packed(path_or_model, max_memory, offload_folder, dtype, executor)
        dtype = None
    skeleton = _skeleton(path_or_model, dtype)
    layers = _decoder_layers(skeleton) if quantize is not None else []
    packed = packed_dtypes(skeleton, layers, quantize) if quantize is not None else None
    device_map = offload_device_map(skeleton, max_memory, dtype, packed)
    execution_devices = {where for where in device_map.values() if not _is_cpu_or_disk(where)}
    if executor is None:
        executor = "accelerate" if len(execution_devices) > 1 else "stream"
    if quantize is not None and (executor != "stream" or execution_devices):
        raise ValueError(
            f"quantize={quantize!r} runs on the CPU stream executor only: leave executor unset (or 'stream') and "
            "keep GPUs out of max_memory; for a GPU, quantize the model in memory and load_offloaded it."
        )
    if executor == "stream" and execution_devices:
        if len(execution_devices) > 1:
            raise ValueError(
                "executor='stream' runs on one accelerator, but max_memory spreads modules over "
                f"{sorted(map(str, execution_devices))}: give max_memory a single GPU plus 'cpu' (and disk), e.g. "
                "{0: '6GiB', 'cpu': '60GiB'}."
            )
        from .device import CudaDevice

        device = CudaDevice(execution_devices.pop())
        if prefetch == "auto":
            free_bytes, _ = torch.cuda.mem_get_info(device.device)
            prefetch = device_auto_prefetch(skeleton, device_map, free_bytes, device.alignment)
        return stream_on_device(path_or_model, device_map, device, offload_folder, dtype, prefetch)
    disk_units = [name for name, where in device_map.items() if where == DISK]
    # Where the stream executor finds the disk-placed weights: the folder this call writes, or (None) accelerate's
    # hooks on a dispatched checkpoint.
    written_folder = None
    if isinstance(path_or_model, PreTrainedModel):
        model = _dispatch_in_memory_model(path_or_model, device_map, offload_folder, dtype, hooks=executor != "stream")
        written_folder = offload_folder
    else:
        model = _dispatch_checkpoint(path_or_model, device_map, offload_folder, dtype)
        if quantize is not None:
            quantize_layers(model, layers, disk_units, quantize, offload_folder)
            written_folder = offload_folder
    if executor == "stream":
        LayerStreamer.install(model, disk_units, prefetch, written_folder if disk_units else None)
    return model.eval()


def stream_on_device(
    path_or_model: str | os.PathLike | PreTrainedModel,
    device_map: Mapping[str, int | str],
    device: StreamDevice,
    offload_folder: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    prefetch: int = 1,
    expand_quantized: bool = True,
) -> PreTrainedModel:
    """Runs a model on an accelerator under ``device_map``, streaming its CPU- and disk-placed units.

    The model is first dispatched on the host (units placed on disk offloaded as for the CPU executor, every other
    unit in RAM), then :class:`~.device_stream.DeviceLayerStreamer` moves the resident units to ``device`` and packs
    each RAM-placed unit into one pinned host buffer. ``load_offloaded(..., executor="stream")`` calls this with a
    :class:`~.device.CudaDevice` when ``max_memory`` names a GPU; tests call it with
    :class:`~.device.OrderCheckingDevice`.

    Args:
        path_or_model: As for :func:`load_offloaded`.
        device_map: A placement per weight unit (:func:`offload_device_map`): ``"cpu"`` and ``"disk"`` units are
            streamed, any other value means resident on ``device``.
        device: The device operations.
        offload_folder: As for :func:`load_offloaded`.
        dtype: As for :func:`load_offloaded`.
        prefetch: Units loaded ahead of the one computing (the device ring has ``prefetch + 1`` slots).
        expand_quantized: Stream quantized (optimum-quanto int4/int8) linear weights packed and expand them into
            dense weights on the device, so that their layers multiply as plain ``nn.Linear`` layers (the default);
            ``False``: quanto's kernels on the packed weights (see
            :meth:`~.device_stream.DeviceLayerStreamer.install_on_device`).

    Returns:
        The model in eval mode; ``hf_device_map`` is ``device_map``.
    """
    host_map = {name: where if _is_cpu_or_disk(where) else "cpu" for name, where in device_map.items()}
    if isinstance(path_or_model, PreTrainedModel):
        model = _dispatch_in_memory_model(path_or_model, host_map, offload_folder, dtype)
    else:
        model = _dispatch_checkpoint(path_or_model, host_map, offload_folder, dtype)
    DeviceLayerStreamer.install_on_device(model, device_map, device, prefetch, expand_quantized)
    model.hf_device_map = dict(device_map)
    return model.eval()


def weight_units(model: nn.Module) -> list[str]:
    """Names of the modules offloaded as one piece, in registration (for decoder LMs, execution) order.

    A unit is the outermost module that is either one of the model's ``_no_split_modules`` (a decoder layer) or
    owns parameters directly (embedding, norm, LM head).

    Args:
        model: The model, possibly on the meta device.
    """
    return _partition_modules(model)[0]


def _partition_modules(model: nn.Module) -> tuple[list[str], list[str]]:
    """``(weight units, outermost parameter-free modules such as rotary embeddings)``, in registration order."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    units: list[str] = []
    parameter_free: list[str] = []

    def visit(module: nn.Module, name: str) -> None:
        if type(module).__name__ in no_split or any(p is not None for p in module._parameters.values()):
            units.append(name)
        elif next(module.parameters(), None) is None:
            parameter_free.append(name)
        else:
            for child_name, child in module.named_children():
                visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    return units, parameter_free


def offload_device_map(
    model: nn.Module,
    max_memory: Mapping[int | str, int | str] | None,
    dtype: torch.dtype | None = None,
    special_dtypes: Mapping[str, Any] | None = None,
) -> dict[str, int | str]:
    """accelerate's placement under ``max_memory``, expressed per weight unit (see :func:`weight_units`).

    accelerate may place a whole subtree at once (``{"": "disk"}`` when nothing fits); restating it per unit
    gives both executors layer-by-layer streaming, and keeps parameter-free modules off the disk (accelerate's
    checkpoint loader cannot handle a map that is disk only).

    Args:
        model: The model, possibly on the meta device.
        max_memory: Per-device budget as accelerate takes it; ``None`` means all available memory.
        dtype: The dtype the weights will have, for their sizes.
        special_dtypes: Per weight name, another size than ``dtype``'s (accelerate's ``special_dtypes``), e.g.
            the packed width of weights quantized as they load (:func:`~.quantize.packed_dtypes`).
    """
    from accelerate import infer_auto_device_map

    placement = infer_auto_device_map(
        model,
        max_memory=dict(max_memory) if max_memory is not None else None,
        no_split_module_classes=list(getattr(model, "_no_split_modules", None) or ()),
        dtype=dtype,
        special_dtypes=dict(special_dtypes) if special_dtypes else None,
    )
    main_device = next((where for where in placement.values() if not _is_cpu_or_disk(where)), "cpu")
    units, parameter_free = _partition_modules(model)
    device_map = {name: _placement_of(name, placement) for name in units}
    device_map.update(dict.fromkeys(parameter_free, main_device))
    return device_map


def _placement_of(name: str, placement: Mapping[str, int | str]) -> int | str:
    """The device of the deepest ``placement`` entry covering module ``name`` (or of the first entry inside it)."""
    covering = [key for key in placement if key == "" or name == key or name.startswith(key + ".")]
    if covering:
        return placement[max(covering, key=len)]
    return next(where for key, where in placement.items() if key.startswith(name + "."))


def _decoder_layers(model: nn.Module) -> list[str]:
    """The weight units that are one of the model's ``_no_split_modules`` (its decoder layers), in order."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    return [name for name in weight_units(model) if type(model.get_submodule(name)).__name__ in no_split]


def _load_packed(
    path: str | os.PathLike, max_memory: Mapping[int | str, int | str] | None,
    offload_folder: str | os.PathLike | None, dtype: torch.dtype | None, executor: str | None,
) -> PreTrainedModel:
    """Packed checkpoint ``path`` loaded into memory as quanto layers in the form for the device its placement under
    ``max_memory`` computes on (the placement planned on its packed structure on the meta device), to be placed
    as a model in memory.

    Raises:
        ValueError: The placement puts layers on disk where the executor cannot stream quantized layers from there
            (a GPU's, or accelerate's hooks), or with no ``offload_folder`` to write them to, or (from
            :func:`~.compressed.load_compressed`) a layer's scheme has no quanto form on that device: all before
            any weight loads.
    """
    skeleton = packed_skeleton(path, dtype)
    device_map = offload_device_map(skeleton, max_memory)
    disk_units = [name for name, where in device_map.items() if where == DISK]
    device = next((where for where in device_map.values() if not _is_cpu_or_disk(where)), "cpu")
    packed_on_disk = [name for name in disk_units if packed_linears(skeleton.get_submodule(name))]
    if packed_on_disk and (device != "cpu" or executor == "accelerate"):
        raise _quantized_on_disk(packed_on_disk[0])
    if disk_units and offload_folder is None:
        raise ValueError(
            f"max_memory leaves {len(disk_units)} module(s) of the packed checkpoint {path} on disk ({disk_units[0]}, "
            "...): they are written there packed, as quanto layers: pass offload_folder=<directory>."
        )
    return load_compressed(path, f"cuda:{device}" if isinstance(device, int) else device, dtype, skeleton=skeleton)


def _is_cpu_or_disk(where: int | str) -> bool:
    return where in ("cpu", DISK)


def _skeleton(path_or_model: str | os.PathLike | PreTrainedModel, dtype: torch.dtype | None) -> nn.Module:
    """The model itself, or an empty (meta) instance of the checkpoint's architecture to plan placement on."""
    if isinstance(path_or_model, PreTrainedModel):
        return path_or_model
    from accelerate import init_empty_weights

    config = AutoConfig.from_pretrained(path_or_model)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype or getattr(config, "dtype", None))
    skeleton.tie_weights()  # tied weights count once in the memory budget
    return skeleton


def _dispatch_checkpoint(
    path: str | os.PathLike, device_map: dict[str, int | str], offload_folder: str | os.PathLike | None,
    dtype: torch.dtype | None,
) -> PreTrainedModel:
    """``from_pretrained`` with the per-unit map: accelerate hooks read disk weights from the checkpoint itself.

    Raises:
        WeightFileError: A safetensors file of the checkpoint is damaged (its header unreadable, or the file shorter
            than its header says), named with the fix: safetensors' own error names neither.
        PermissionError: A safetensors file of the checkpoint may not be read, named with the fix (safetensors
            says it does not exist).
    """
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            device_map=device_map,
            offload_folder=offload_folder,
            dtype=dtype or "auto",
            attn_implementation="sdpa",
        )
    except (SafetensorError, FileNotFoundError) as error:
        named = _checkpoint_file_error(path, error)
        if named is None:
            raise
        raise named from error
    return use_sdpa_attention(model)


def _checkpoint_file_error(path: str | os.PathLike, error: Exception) -> Exception | None:
    """The error to raise for ``error``, raised as checkpoint ``path`` loaded: naming the first of its safetensors
    files (where ``path`` is a local folder) that this process may not read or safetensors cannot open, and the fix;
    ``None`` for a file that is missing indeed."""
    for file in sorted(Path(path).glob("*.safetensors")) if os.path.isdir(path) else ():
        if not os.access(file, os.R_OK):
            return PermissionError(
                errno.EACCES,
                f"The checkpoint file {file} may not be read by this user. Give it read access (chmod a+r) or load a "
                "copy it can read.",
            )
        try:
            with safe_open(file, framework="pt"):
                pass
        except SafetensorError as damage:
            return WeightFileError(
                f"The checkpoint file {file} is damaged ({damage}). Download or save the checkpoint again."
            )
    if isinstance(error, FileNotFoundError):
        return None
    return WeightFileError(
        f"A safetensors file of the checkpoint {path} is damaged ({error}). Download it again "
        "(from_pretrained(..., force_download=True)) or save it again."
    )


def _dispatch_in_memory_model(
    model: PreTrainedModel, device_map: dict[str, int | str], offload_folder: str | os.PathLike | None,
    dtype: torch.dtype | None, hooks: bool = True,
) -> PreTrainedModel:
    """Writes the disk-placed weights to ``offload_folder`` and places ``model`` under ``device_map``.

    With ``hooks``, accelerate's ``dispatch_model`` attaches its hooks (which load disk-placed weights from the
    folder). Without (the CPU stream executor, which removes them anyway), the disk-placed parameters are only
    replaced by meta tensors of the same form, quantized ones (tensor subclasses) included, whose inner tensors the
    folder holds each under ``<parameter>.<inner path>``; :class:`LayerStreamer` finds them there.
    """
    from accelerate import dispatch_model

    if dtype is not None:
        model.to(dtype)
    disk_units = [name for name, where in device_map.items() if where == DISK]
    quantized = next((name for name in disk_units if _holds_tensor_subclass(model.get_submodule(name))), None)
    if quantized is not None and hooks:
        raise _quantized_on_disk(quantized)
    if disk_units and offload_folder is None:
        raise ValueError(
            f"max_memory leaves {len(disk_units)} module(s) on disk ({disk_units[0]}, ...): pass offload_folder="
            "<directory> to write their weights to."
        )
    if hooks and set(device_map.values()) != {"cpu"}:
        if disk_units:
            # Written here rather than by dispatch_model, which would reuse a stale index.json left in the folder.
            write_offload_folder(offload_folder, stored_tensors(model, disk_units))
        return dispatch_model(
            use_sdpa_attention(model), device_map=device_map, offload_dir=str(offload_folder) if disk_units else None
        )
    # What dispatch_model does for a map of CPU- and disk-placed units, less its completeness check's
    # model.state_dict(): quanto's int4 (TinyGemm) weights on the CPU unpack there through a product with an
    # identity matrix, minutes for one Llama-3-70B layer (seen on the first GPU run, issue #32).
    uncovered = _tensors_outside(model, device_map)
    if uncovered:
        raise ValueError(
            f"The device_map places no module holding {uncovered[0]!r} ({len(uncovered)} tensor(s) unplaced): "
            "build it with offload_device_map(model, max_memory), which places every weight unit."
        )
    model = use_sdpa_attention(model).to("cpu")
    if disk_units:
        write_offload_folder(offload_folder, stored_tensors(model, disk_units))
        leave_on_meta(model, disk_units)
    model.hf_device_map = dict(device_map)
    return model


def _quantized_on_disk(unit: str) -> ValueError:
    """The refusal of quantized weights placed on disk where only the CPU stream executor streams them from there."""
    return ValueError(
        f"max_memory puts {unit}, which holds quantized (tensor-subclass) weights, on disk; these stream from "
        "disk only with the CPU stream executor (executor='stream', no GPU in max_memory); with accelerate's hooks "
        "or a GPU, raise max_memory['cpu'] so that nothing goes to disk."
    )


def _tensors_outside(model: nn.Module, device_map: Mapping[str, int | str]) -> list[str]:
    """The names ``model.state_dict()`` would have (parameters, tied ones under each name, persistent buffers)
    that no module of ``device_map`` holds."""
    if "" in device_map:
        return []
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    for prefix, module in model.named_modules(remove_duplicate=False):
        names += [
            f"{prefix}.{name}" if prefix else name
            for name, buffer in module.named_buffers(recurse=False)
            if name not in module._non_persistent_buffers_set
        ]
    return [name for name in names if not any(name == unit or name.startswith(unit + ".") for unit in device_map)]


def device_auto_prefetch(
    skeleton: nn.Module, device_map: Mapping[str, int | str], free_bytes: int, alignment: int = 1
) -> int:
    """``prefetch="auto"`` for a GPU ring: :func:`~.layout.auto_prefetch` over the streamed units' bytes, the headroom
    being the device's ``free_bytes`` less the units ``device_map`` keeps resident on it.

    Args:
        skeleton: The model (on the meta device or not) in the dtype it runs in.
        device_map: The placement per weight unit: ``"cpu"`` and ``"disk"`` units are streamed.
        free_bytes: The device's free memory before anything of the model is on it.
        alignment: What each ring buffer's size is rounded up to.
    """
    unit_bytes = {
        name: sum(weight.numel() * weight.element_size() for weight in skeleton.get_submodule(name).parameters())
        for name in device_map
    }
    streamed = [unit_bytes[name] for name, where in device_map.items() if _is_cpu_or_disk(where)]
    resident = sum(size for name, size in unit_bytes.items() if not _is_cpu_or_disk(device_map[name]))
    return auto_prefetch(streamed, max(0, free_bytes - resident), AUTO_RING_SHARE, alignment)


def _check_prefetch(prefetch: int | str) -> None:
    if prefetch != "auto" and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1):
        raise ValueError(f"prefetch must be a positive integer or 'auto', got {prefetch!r}.")


def stream(model: PreTrainedModel, prefetch: int | str = "auto") -> PreTrainedModel:
    """Runs a model that accelerate offloaded to disk on the streaming executor instead of accelerate's hooks.

    For a model loaded with ``from_pretrained(..., device_map=..., offload_folder=...)`` (or dispatched with
    ``dispatch_model``) on the CPU and disk: the same placement, with the disk-placed modules read ahead into a
    ring of buffers by direct reads (:class:`LayerStreamer`), several times faster per forward, with the same
    outputs. ``load_offloaded`` does this by default.

    Args:
        model: The dispatched model; changed in place.
        prefetch: Modules read ahead of the one computing, or ``"auto"`` (see :func:`load_offloaded`).

    Returns:
        ``model``, in eval mode.

    Raises:
        ValueError: ``model`` was not dispatched by accelerate, or places modules on a GPU (use
            ``load_offloaded(path, max_memory={0: ..., "cpu": ...})``, which streams to a GPU).
    """
    _check_prefetch(prefetch)
    device_map = getattr(model, "hf_device_map", None)
    if layer_streamer(model) is not None:
        return model.eval()
    if not device_map:
        raise ValueError(
            "specexec_hf.stream(model) takes a model dispatched by accelerate (from_pretrained with device_map=... and "
            "offload_folder=...); this one has no hf_device_map. For a model in memory, use specexec_hf.load_offloaded("
            "model, max_memory=..., offload_folder=...)."
        )
    accelerators = sorted({str(where) for where in device_map.values() if not _is_cpu_or_disk(where)})
    if accelerators:
        raise ValueError(
            f"specexec_hf.stream(model) streams models placed on the CPU and disk; this one has modules on "
            f"{accelerators}. Load it with specexec_hf.load_offloaded(path, max_memory={{0: ..., 'cpu': ...}}), which "
            "streams to a GPU."
        )
    disk_units = [name for name in weight_units(model) if _has_meta_parameter(model.get_submodule(name))]
    LayerStreamer.install(model, disk_units, prefetch)
    return model.eval()


def _has_meta_parameter(module: nn.Module) -> bool:
    """Whether accelerate offloaded (part of) ``module``: its offloaded parameters are left on the meta device."""
    return any(parameter.is_meta for parameter in module.parameters())


def _holds_tensor_subclass(module: nn.Module) -> bool:
    """Whether ``module`` has a parameter that is a tensor subclass, as quantized weights are."""
    return any(type(parameter) not in (torch.Tensor, nn.Parameter) for parameter in module.parameters())
