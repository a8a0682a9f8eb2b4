"""How the benchmark places a random target: each executor's placement, the bytes it streams, and freeing it."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from specexec_hf.offload import (
    CudaDevice,
    DeviceLayerStreamer,
    OrderCheckingDevice,
    StreamDevice,
    layer_streamer,
    load_offloaded,
    offload_device_map,
    stream_on_device,
)

from benchmarks.shapes import quantize_layers, sharing_weights


def layers_placed(model: torch.nn.Module, where: str) -> dict[str, int | str]:
    """A placement per weight unit: the decoder layers and head at ``where`` (``"cpu"`` or ``"disk"``), every other
    unit resident on the execution device.

    Args:
        model: The model, possibly on the meta device.
        where: Where the streamed units are placed.
    """
    return {name: (where if name.startswith("model.layers") or name == "lm_head" else 0)
            for name in offload_device_map(model, None)}  # fmt: skip


def stream_device(device: torch.device) -> StreamDevice:
    """The stream executor's device operations: CUDA's on a GPU; on a CPU ``OrderCheckingDevice`` stands in."""
    return CudaDevice(device.index or 0) if device.type == "cuda" else OrderCheckingDevice()


def streamed_layers(model: torch.nn.Module, device: torch.device, expand_quantized: bool = True) -> torch.nn.Module:
    """``model`` on ``device`` with the stream executor: the embedding and final norm resident, the decoder layers
    and head in CPU RAM, streamed (``OrderCheckingDevice`` stands in for a GPU on a CPU), one layer read ahead.
    ``expand_quantized``: quantized layers computed with their weights expanded to dense in the ring slot (the
    default), or with quanto's packed kernels."""
    placement = layers_placed(model, "cpu")
    return stream_on_device(model, placement, stream_device(device), expand_quantized=expand_quantized)


def gpu_budget_bytes(model: torch.nn.Module) -> int:
    """A GPU budget that keeps the input embedding resident and sends every decoder layer to CPU RAM.

    accelerate reserves room for the largest module on the main device when it offloads, so the embedding fits
    only with that reserve on top; the next module then no longer fits and everything after it goes to the CPU.
    A head tied to the embedding is not a module accelerate offloads, so it is no reserve (counting it one put the
    first three decoder layers of a tied Llama-3.2-1B shape on the GPU).
    """
    embedding = model.get_input_embeddings().weight
    largest = max(sum(p.nbytes for p in module.parameters(recurse=False) if p is not embedding)
                  for module in model.modules())
    largest = max(largest, max(sum(p.nbytes for p in layer.parameters()) for layer in model.model.layers))
    return embedding.nbytes + largest + (1 << 20)


def placement_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Parameter bytes per placement (``"cpu"``, ``"disk"``, the GPU index) of a dispatched model."""
    device_map = getattr(model, "hf_device_map", None) or {"": "resident"}
    sizes: dict[str, int] = {}
    counted: set[int] = set()
    for name, where in device_map.items():
        module = model.get_submodule(name) if name else model
        for parameter in module.parameters():
            if id(parameter) not in counted:
                counted.add(id(parameter))
                sizes[str(where)] = sizes.get(str(where), 0) + parameter.numel() * parameter.element_size()
    return sizes


def streamed_bytes(model: torch.nn.Module) -> int:
    """Bytes a forward moves over the link: the parameters placed in CPU RAM or on disk."""
    return sum(size for where, size in placement_bytes(model).items() if where in ("cpu", "disk"))


def diffusers_group_offloading(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """diffusers' block-level group offloading with a copy stream: each decoder layer onloaded ahead of use.

    Raises:
        ImportError: diffusers is not installed.
    """
    from diffusers.hooks import apply_group_offloading

    model.model.embed_tokens.to(device)
    model.model.rotary_emb.to(device)
    apply_group_offloading(
        model, onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
        num_blocks_per_group=1, use_stream=True,
    )
    return model


def placed_target(
    executor: str, built: LlamaForCausalLM, device: torch.device, offload_dir: Path, weights: str | None = None
) -> torch.nn.Module:
    """The random target ``built`` (its weights shared, not copied) run by ``executor``; free it with
    :func:`release`.

    Executors: ``stream`` (the decoder layers and head in CPU RAM, streamed by the device streamer, one layer read
    ahead: through ``load_offloaded`` on a GPU, through ``OrderCheckingDevice`` on a CPU; quantized layers expanded to
    dense in the ring slot), ``stream-packed`` (the same, quantized layers computed by quanto's packed kernels),
    ``accelerate`` (``load_offloaded``; on a GPU with the layers in CPU RAM, on a CPU with the layers on disk),
    ``diffusers`` (group offloading) and ``resident`` (the whole model on ``device``: the compute floor). ``weights``
    (``"int8"``/``"int4"``): quantized decoder layers, for ``stream``, ``stream-packed`` and ``resident`` only.
    """
    if weights is not None and executor not in ("stream", "stream-packed", "resident"):
        raise NotImplementedError(f"{weights} weights are measured with the stream executors and resident only")
    model = sharing_weights(built)
    if weights is not None:
        quantize_layers(model, weights)
    dtype = built.dtype
    if executor == "resident":
        return model.to(device)
    if executor == "diffusers":
        return diffusers_group_offloading(model, device)
    if executor == "stream-packed":
        return streamed_layers(model, device, expand_quantized=False)
    if executor == "stream" and (weights is not None or device.type != "cuda"):
        return streamed_layers(model, device)
    if device.type == "cuda":
        budget = {0: gpu_budget_bytes(model), "cpu": 1 << 40}
        # One layer read ahead, as in the earlier runs: the default ("auto") would read up to half the layers
        # during the gaps between timed forwards.
        return load_offloaded(model, max_memory=budget, executor=executor, dtype=dtype, prefetch=1)
    return load_offloaded(model, max_memory={"cpu": 0}, offload_folder=offload_dir / executor, executor=executor,
                          dtype=dtype)


def release(model: torch.nn.Module) -> None:
    """Stops ``model``'s streamer (unpinning its host memory). The caller drops its last reference next and calls
    :func:`collect`: a streamer and its model's hooks form a reference cycle, which only the collector frees."""
    streamer = layer_streamer(model)
    if streamer is not None:
        streamer.close()


def collect(device: torch.device) -> None:
    """Frees unreachable models now (reference cycles included) and returns their GPU memory to the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def streamed_bytes_per_timed_forward(model: torch.nn.Module, executor: str, weights: str | None) -> int:
    """Bytes a timed forward moves over the link (see :func:`forward_times`).

    The device streamer's forward finds its first layers loaded ahead (by the previous forward): they are not
    its bytes. Other executors load every offloaded parameter within the forward.
    """
    if executor == "resident":
        return 0
    if executor == "diffusers":
        return sum(p.nbytes for p in model.model.layers.parameters())
    streamer = layer_streamer(model)
    if isinstance(streamer, DeviceLayerStreamer):
        return streamer.streamed_bytes_per_forward - streamer.read_ahead_bytes
    if weights is not None:
        raise NotImplementedError(f"{weights} weights: the streamed bytes are known to the device streamer only")
    return streamed_bytes(model)
