"""Sections 2 and 6: forward time vs tokens scored of a random-weight shape under each executor, its achieved
bandwidth, the whole shape's time extrapolated by streamed bytes, and the per-forward goals."""

from __future__ import annotations

import argparse
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM

from specexec_hf.offload import DeviceLayerStreamer, layer_streamer

from benchmarks.figure_checks import ratio
from benchmarks.gpu_offload.placement import (
    collect,
    placed_target,
    placement_bytes,
    release,
    streamed_bytes_per_timed_forward,
)
from benchmarks.report import Goal
from benchmarks.shapes import GB, SHAPES, LlamaShape, quantize_layers, random_llama, sharing_weights
from benchmarks.timing import Deadline, median, synchronize, synchronize_compute, warm_median_seconds


def forward_times(
    model: torch.nn.Module, token_counts: list[int], repeats: int, device: torch.device, deadline: Deadline
) -> dict[str, Any]:
    """Median seconds of one forward over ``n`` fresh tokens (logits for all of them), for each ``n``, and the
    fastest and slowest repeat (``seconds_spread``: what the figure checks take for noise).

    Two 1-token forwards first: a warm-up, which pays the one-time costs (allocations, kernel selection; quanto
    builds its packed int4 kernel there: 43 s in the device-shaped environment of the rehearsal, 0.02 s a forward
    after), then one timed, from which the time the token counts need is estimated. A token count whose repeats would
    not fit in the time left is skipped and listed. Each forward starts with every queue idle (a streamer's read-ahead
    landed, as it has after the draft grew its tree: disk reads on the streamer's reader thread included) and ends when
    its compute is done: copies it issued for the next forward are not its time.
    """
    streamer = layer_streamer(model)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, max(token_counts)), generator=torch.Generator().manual_seed(1)).to(device)
    seconds: dict[str, float] = {}
    spread: dict[str, list[float]] = {}
    skipped = []
    with torch.no_grad():
        last = warm_median_seconds(lambda: model(input_ids=ids[:, :1], use_cache=False), 1, device)
        for tokens in token_counts:
            if not deadline.allows(last * repeats * 1.5):
                skipped.append(tokens)
                continue
            times = []
            for _ in range(repeats):
                if streamer is not None:
                    streamer.wait_idle()
                synchronize(device)
                started = time.perf_counter()
                model(input_ids=ids[:, :tokens], use_cache=False, logits_to_keep=tokens)
                synchronize_compute(device)
                times.append(time.perf_counter() - started)
            seconds[str(tokens)] = median(times)
            spread[str(tokens)] = [min(times), max(times)]
            last = max(times)
    return {"seconds": seconds, "seconds_spread": spread, "skipped_token_counts": skipped}


def measure_executor(
    executor: str, built: LlamaForCausalLM, args: argparse.Namespace, device: torch.device, deadline: Deadline,
    offload_dir: Path,
) -> dict[str, Any]:
    """Places ``built`` under ``executor`` and times its forwards; its copy of the model is freed on return."""
    return measure_placed(lambda: placed_target(executor, built, device, offload_dir, args.weights), executor, args,
                          device, deadline)


def measure_placed(
    place: Callable[[], torch.nn.Module], executor: str, args: argparse.Namespace, device: torch.device,
    deadline: Deadline,
) -> dict[str, Any]:
    """Times ``place()`` (the load) and the forwards of the model it returns, which is freed on return.

    Args:
        place: Loads the model, run by ``executor``.
        executor: The executor's name, for the bytes it streams (:func:`streamed_bytes_per_timed_forward`).
        args: ``token_counts``, ``repeats`` and ``weights``, as the command line gives them.
        device: Where the model computes.
        deadline: Token counts that would not fit in the time left are skipped.
    """
    started = time.perf_counter()
    model = place()
    load_seconds = time.perf_counter() - started
    try:
        entry = executor_figures(model, executor, args, device, deadline)
    finally:
        release(model)
        del model
        collect(device)
    return {"load_seconds": load_seconds, **entry}


def executor_figures(
    model: torch.nn.Module, executor: str, args: argparse.Namespace, device: torch.device, deadline: Deadline
) -> dict[str, Any]:
    """The placed ``model``'s bytes and forward times (its references die with this call's frame)."""
    entry: dict[str, Any] = {}
    streamer = layer_streamer(model)
    if args.weights is None:  # a quantized weight's numel() * element_size() counts its float form
        entry["placement_bytes"] = placement_bytes(model)
    entry["streamed_bytes"] = streamed_bytes_per_timed_forward(model, executor, args.weights)
    if isinstance(streamer, DeviceLayerStreamer):
        entry["stream_buffer_bytes"] = streamer.buffer_bytes
        entry["pinned_host_bytes"] = streamer.host_bytes
        entry["read_ahead_bytes"] = streamer.read_ahead_bytes
    entry.update(forward_times(model, args.token_counts, args.repeats, device, deadline))
    return entry


def stored_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters as stored: a quantized weight (a tensor subclass) by its packed inner tensors,
    not by ``numel() * element_size()``, which counts its float form."""
    def tensor_bytes(tensor: torch.Tensor) -> int:
        if not hasattr(type(tensor), "__tensor_flatten__"):
            return tensor.nbytes
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)

    return sum(tensor_bytes(parameter) for parameter in module.parameters())


def decoder_layer_bytes(built: LlamaForCausalLM, weights: str | None) -> int:
    """Bytes one decoder layer of ``built`` streams: its parameters as stored once quantized as the executors quantize
    them (``weights``), measured on a twin whose first layer alone is quantized. Not on the placed model: an executor
    may hold a quantized layer in another form (the stream executor expands it on the device)."""
    if weights is None:
        return stored_bytes(built.model.layers[0])
    twin = sharing_weights(built)
    quantize_layers(twin, weights, include="model.layers.0.*")
    return stored_bytes(twin.model.layers[0])


def full_shape_streamed_bytes(entry: dict[str, Any], shape_result: dict[str, Any]) -> int:
    """Bytes a forward of the whole shape would stream: what the build's forward streamed (``entry``) plus, for each
    decoder layer the build left out, one layer's stored bytes (``shape_result["layer_bytes"]``). Nothing else scales
    with the layers: the LM head is streamed by the whole shape as by the build, or not at all (a head far larger than
    a layer keeps a buffer of its own, loaded once: run 4's int4 build)."""
    missing = shape_result["shape"]["layers"] - shape_result["layers_built"]
    return entry["streamed_bytes"] + missing * shape_result["layer_bytes"]


def extrapolation_scale(entry: dict[str, Any], shape_result: dict[str, Any]) -> float:
    """How many times longer a forward of the whole shape takes than the build's, for one executor's ``entry``.

    A streamed forward is bound by the link: by the bytes it streams (:func:`full_shape_streamed_bytes`). A resident
    one is bound by computation, which grows with the parameter count (``parameter_bytes_*`` are counted in the float
    dtype, also for quantized layers).
    """
    if entry["streamed_bytes"]:
        return full_shape_streamed_bytes(entry, shape_result) / entry["streamed_bytes"]
    return shape_result["parameter_bytes_full_shape"] / shape_result["parameter_bytes_built"]


def measure_shape(
    shape: LlamaShape, layers: int, executors: list[str], args: argparse.Namespace, device: torch.device,
    link_gbps: float, deadline: Deadline, offload_dir: Path,
) -> dict[str, Any]:
    """Forward time vs tokens of ``shape`` (built once, with ``layers`` layers) under each executor."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    full_bytes = shape.parameter_bytes(dtype)
    built_bytes = shape.parameter_bytes(dtype, layers)
    result: dict[str, Any] = {
        "shape": asdict(shape), "layers_built": layers,
        # Labels every figure of the shape: the float dtype, and the quantized layers' format when there is one.
        "dtype": str(dtype).removeprefix("torch.") + ("" if args.weights is None else f", {args.weights} layers"),
        "parameter_bytes_built": built_bytes, "parameter_bytes_full_shape": full_bytes,
        "extrapolated": layers != shape.layers, "executors": {},
    }
    built = random_llama(shape, layers, dtype)
    result["layer_bytes"] = decoder_layer_bytes(built, args.weights)
    for executor in executors:
        if not deadline.allows(30):
            result["executors"][executor] = {"status": "skipped: time budget spent"}
            continue
        try:
            entry = measure_executor(executor, built, args, device, deadline, offload_dir)
        except NotImplementedError as error:
            result["executors"][executor] = {"status": f"unavailable: {error}"}
            continue
        except ImportError as error:
            result["executors"][executor] = {"status": f"skipped: {error}"}
            continue
        except Exception as error:  # recorded, so that one failing executor does not lose the others' figures
            result["executors"][executor] = {"status": f"error: {type(error).__name__}: {error}",
                                             "traceback": traceback.format_exc()}
            collect(device)
            continue
        result["executors"][executor] = entry
        entry["status"] = "measured"
        if entry["streamed_bytes"]:
            add_bandwidth(entry, link_gbps, "share_of_pinned_link")
            entry["full_shape_streamed_bytes"] = full_shape_streamed_bytes(entry, result)
        entry["full_shape_scale"] = extrapolation_scale(entry, result)
        entry["full_shape_seconds"] = {n: s * entry["full_shape_scale"] for n, s in entry["seconds"].items()}
        print(f"  {shape.name} x{layers} layers, {executor}: {entry['seconds']}", flush=True)
    del built
    collect(device)
    return result


def add_bandwidth(entry: dict[str, Any], bound_gbps: float | None, share_key: str) -> None:
    """Adds an entry's achieved GB/s per token count (its streamed bytes over its forward seconds) and, where the
    bound is known, each as a share of it under ``share_key``."""
    entry["achieved_gbps"] = {n: entry["streamed_bytes"] / s / GB for n, s in entry["seconds"].items()}
    if bound_gbps is not None and math.isfinite(bound_gbps):
        entry[share_key] = {n: rate / bound_gbps for n, rate in entry["achieved_gbps"].items()}


def forward_goals(shape_result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's per-forward goals (:class:`~benchmarks.report.Goal` records, as JSON), from the figures of the
    executors that measured and passed their checks (missing figures give no goal); each ratio checked as it is made
    (:func:`figure_checks.ratio`)."""
    executors = {name: entry for name, entry in shape_result["executors"].items() if entry.get("status") == "measured"}
    stream = executors.get("stream", {}).get("full_shape_seconds", {})
    goals = []
    shares = executors.get("stream", {}).get("share_of_pinned_link", {})
    upto_256 = [share for tokens, share in shares.items() if int(tokens) <= 256]
    if upto_256:
        goals.append(Goal("stream_link_share", "stream: lowest share of the pinned link up to 256 tokens",
                          min(upto_256), 0.85))
    if "1" in stream and "1024" in stream:
        claim = "stream: forward over 1024 tokens / over 1 token"
        goals.append(Goal("stream_1024_over_1", claim, ratio(claim, stream["1024"], stream["1"]), 1.3, at_least=False))
    accelerate = executors.get("accelerate", {}).get("full_shape_seconds", {})
    for tokens in sorted(set(stream) & set(accelerate), key=int):
        claim = f"accelerate hooks / stream executor, forward over {tokens} tokens"
        measured = ratio(claim, accelerate[tokens], stream[tokens])
        goals.append(Goal(f"accelerate_over_stream_{tokens}", claim, measured, 5))
    return [goal.as_json() for goal in goals]


def largest_bf16_shape(host_bytes: int) -> LlamaShape | None:
    """The largest shape whose bf16 weights fit in host RAM twice over (the model, then its pinned copy)."""
    fitting = [shape for key, shape in SHAPES.items() if key != "tiny"
               and 2.2 * shape.parameter_bytes(torch.bfloat16) < host_bytes]
    return max(fitting, key=lambda shape: shape.parameter_bytes(torch.bfloat16), default=None)
