"""A model bigger than RAM, streamed from the SSD: the disk's bound, forward cost, and SpecExec end to end.

Every section runs inside this process's own memory cgroup (``memory_cap.py``: page cache included, root and the
v1 memory controller needed), so no executor can keep the weights cached between forwards: the case of a model
bigger than RAM. Each section rewrites ``ssd.json`` / ``ssd.md`` / ``ssd.png`` as it finishes.

1. **bound**: the disk's direct-read bandwidth, measured once, cold, with the executor's direct reader, on the
   longest file the run streams (or on a scratch file of ``--bound-min-bytes`` where every file is shorter): a
   bound read on a short file comes out below what a long stream reaches. A cold buffered read of the scratch
   file through the page cache is shown beside it.
2. **forward**: seconds of one forward against the tokens scored (1, 4, 16, 64, 256), weights streamed from disk
   by the stream executor, for the default target and random-weight shapes written to ``--shape-dir``
   (SmolLM2-1.7B and Llama-3-8B in bf16; deleted after their curves unless ``--keep-shapes``); as a share of the
   bound (the bytes read from the files per forward over the bound), and the flat region (the most tokens whose
   forward stays within 1.3x the 1-token forward). The memory the cap leaves above the process's own before loading
   (ring, activations, page cache) is ``--cache-fraction`` (0.45) of the shape's weights, so the shapes' weights are
   2-2.2x their cap; the peak the group was charged (process plus page cache) is reported. ``bf16-f32`` rows stream
   the same bf16 checkpoint into a float32 model (each layer widened as it lands: the same disk bytes, float32
   compute, what a CPU without native bf16 matmuls is better served by). ``int4`` rows load the same bf16
   checkpoint with ``load_offloaded(..., quantize="int4")``: the library quantizes the decoder layers to
   optimum-quanto qint4 (torch's packed int4 CPU kernel) one at a time as they load, writes them packed to
   ``--shape-dir`` and streams them, the embedding and head read from the checkpoint (read-ahead ``--prefetch``,
   4 for ``auto``; the cap is set once the model is placed).
3. **end to end**: the default pair, target streamed from disk under the same cap, draft in RAM, greedy on
   held-out prompts: plain ``generate()``, HF assisted generation (its defaults, and constant chains on request)
   and SpecExec at fixed budgets and ``"auto"``; tokens/s, tokens per target forward, every output checked against
   plain greedy.
4. **projection**: tokens/s for the larger shapes from measured parts only: their forward curve (section 2) and the
   real pair's tokens per forward and draft seconds per step (section 3).

Not a test: the figures depend on the disk, the CPU and the load. ``--quick --no-cap`` runs every section small
(a tiny shape, one prompt, a few tokens) as a smoke check, without root.
Run (root): .venv/bin/python -m benchmarks.ssd   (about 45 minutes on the 2-core development machine)
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers

import specexec_hf
from specexec_hf.hf.learnt_state import learnt_state_of
from specexec_hf.models import int8_draft, native_bfloat16_cpu, target_cache_dir
from specexec_hf.offload import layer_streamer, load_offloaded
from specexec_hf.offload.direct_io import BLOCK
from specexec_hf.offload.layout import auto_prefetch
from specexec_hf.offload.stream import AUTO_RING_SHARE
from specexec_hf.tools.prompts import chat_inputs, load_prompts

from benchmarks.loaders import disk_bound
from benchmarks.memory_cap import MemoryCap, evict
from benchmarks.offload import disk_read_seconds, load_draft
from benchmarks.report import Goal, write_report
from benchmarks.shapes import GB, LlamaShape, interpolate, random_pool, write_random_checkpoint
from benchmarks.timing import median_forward_seconds, timed_generate

RESULTS = Path(__file__).resolve().parent / "results" / "ssd"
FLAT = 1.3  # a forward within this factor of the 1-token forward counts as flat
DEFAULT_TARGET = "SmolLM2-135M (default target)"

# Public architectures' dimensions (their config.json files); the weights are random. "tiny" is --quick's.
SHAPES = {
    "smollm2-1.7b": LlamaShape("SmolLM2-1.7B", 2048, 8192, 24, 32, 32, 49152, tied=True),
    "llama-8b": LlamaShape("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256),
    "tiny": LlamaShape("tiny Llama", 256, 512, 4, 4, 2, 16384, tied=True),  # the vocabulary forward_seconds draws
}
# The room the cap leaves above the process's memory before loading, as a share of the weights: the most that keeps
# the Llama-3-8B shape's weights over twice its cap, and enough for the default target's ring (155 MB: its 113 MB
# head stays loaded) plus a 257-token tree forward (a third, 179 MB, was not: a 256-token forward with all its
# logits was OOM-killed).
CACHE_FRACTION = 0.45
# End to end, the memory the default target gets all told (ring, activations, page cache) as a share of its weights:
# what the earlier accounting gave it (a 184 MB ring beside a room of 0.45 of the weights, 0.79 of them), now with
# the ring inside it, so prefetch="auto" can trade page cache for read-ahead that runs on through the draft's work.
WEIGHTS_MEMORY = 0.8
DEFAULT_PREFETCH = "auto"  # --prefetch's default, parsed by prefetch_value: the ring sized from the cap
# --end-to-end-prefetch's default: half the default target's 30 layers. At this disk's ~2.3 GB/s their 198 MB take
# about 0.085 s, the draft's time per tree step at budgets 16-64 on the 2-core machine (0.06-0.09 s), so the disk
# reads the next forward's layers on through the drafting; 14 rather than 9-13 because 30 layers then go round 15
# buffers evenly (326 MB, against 354 at 12, where four leftover layers get buffers of their own).
END_TO_END_PREFETCH = 14
# --dtypes: the dtype the shapes' forward computes in, their checkpoints being bf16 ("bf16-f32": widened to float32 as
# each layer lands); int4: optimum-quanto's qint4 decoder layers over bf16, placed on disk by the library.
DTYPES = {"bf16": torch.bfloat16, "bf16-f32": torch.float32, "int4": None}


# Scratch files and disk space -------------------------------------------------------------------------------------


def write_scratch_file(path: Path, size: int) -> Path:
    """A file of ``size`` random bytes (the buffered read's, and the bound's where every streamed file is shorter)."""
    if path.is_file() and path.stat().st_size == size:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    chunk = random_pool(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    with open(path, "wb") as handle:
        left = size
        while left:
            left -= handle.write(chunk[: min(left, len(chunk))])
    evict(path)  # its dirty pages would be charged to this process's group
    return path


def ensure_disk_space(directory: Path, needed: int) -> None:
    """Refuses to start writing ``needed`` bytes where the disk has less free (plus 1 GB of slack)."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if needed + GB > free:
        raise SystemExit(f"The random-weight shapes need {needed / GB:.1f} GB in {directory}, which has "
                         f"{free / GB:.1f} GB free (1 GB kept as slack): pass fewer --shapes, or --shape-dir on a "
                         "larger disk.")


# Sections --------------------------------------------------------------------------------------------------------


def bound(streamed: list[Path], repeats: int, scratch: Path) -> dict[str, Any]:
    """The disk's direct-read bandwidth over the longest of the ``streamed`` files and ``scratch`` (best of
    ``repeats`` cold reads by the executor's reader, :func:`loaders.disk_bound`; a short file reads slower than a
    long stream), and one cold read of ``scratch`` through the page cache for comparison (a file of this run's
    own: pages another process maps cannot be evicted, and would read as cached)."""
    weights = max([*streamed, scratch], key=lambda path: path.stat().st_size)
    direct = [disk_bound(weights)["gb_per_s"] for _ in range(repeats)]
    buffered = disk_read_seconds(scratch)
    evict(scratch)
    return {"file": str(weights), "bytes": weights.stat().st_size, "direct_gbps": max(direct),
            "direct_gbps_runs": direct, "buffered_file": str(scratch), "buffered_bytes": buffered["bytes"],
            "buffered_cold_gbps": buffered["bytes"] / buffered["evicted"] / GB}


def capped(cap: MemoryCap | None, weights_bytes: int, fraction: float, held_bytes: int = 0) -> dict[str, Any]:
    """Caps the process at what it uses now plus ``fraction`` of the weights, less ``held_bytes`` of that room it
    already holds; returns the cap's figures.

    Called before the target loads (:func:`streamed_target`: "now" is the runtime and the draft), once an int4
    target is placed (:func:`int4_curve`: its ring's pages are touched by the first forward, so the ring still comes
    out of the room) and, end to end, again after the warm-ups ("now" then holds the ring, sized within the room
    and passed as ``held_bytes``, and what the warm-ups left)."""
    if cap is None:
        return {"capped": False}
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    cap.reclaim()  # files earlier sections wrote or read stay charged as page cache: not the process's own memory
    base = cap.usage()
    limit = base + int(fraction * weights_bytes) - held_bytes
    cap.limit(limit)
    return {"capped": True, "limit_bytes": limit, "usage_before_bytes": base, "weights_bytes": weights_bytes,
            "weights_over_limit": weights_bytes / limit}


def cap_figures(cap: MemoryCap | None, entry: dict[str, Any]) -> None:
    """Adds the peak memory charged under the cap (process plus page cache) and the times the cap was hit."""
    if cap is not None and entry.get("capped"):
        entry["peak_bytes"] = cap.peak()
        entry["within_limit"] = entry["peak_bytes"] <= entry["limit_bytes"]
        entry["reclaims"] = cap.failures()


@contextmanager
def streamed_target(
    checkpoint: Path,
    cap: MemoryCap | None,
    prefetch: int | str | None,
    fraction: float = 0.0,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[torch.nn.Module, dict[str, Any]]]:
    """The checkpoint's model with every weight on disk, run by the stream executor, and the cap's figures.

    The cap is set before the target loads (what the process uses then plus ``fraction`` of the weights), so the
    ring, the activations and the page cache all come out of that room, and ``prefetch="auto"`` sizes the ring from
    it as on a machine with that little memory. ``prefetch``: ``None`` leaves ``load_offloaded``'s default.
    ``dtype``: the model's (``None``: the checkpoint's). On exit the model is freed and the cap lifted."""
    entry = capped(cap, (checkpoint / "model.safetensors").stat().st_size, fraction)
    read_ahead = {} if prefetch is None else {"prefetch": prefetch}
    with released(load_offloaded(checkpoint, max_memory={"cpu": 0}, executor="stream", dtype=dtype, **read_ahead),
                  cap) as model:
        yield model, entry


@contextmanager
def released(model: torch.nn.Module, cap: MemoryCap | None) -> Iterator[torch.nn.Module]:
    """``model`` (streamed) for the block; then its streamer closed, the model freed and the cap lifted."""
    try:
        yield model
    finally:
        layer_streamer(model).close()
        del model
        gc.collect()
        if cap is not None:
            cap.limit(None)


def forward_curve(
    checkpoint: Path, label: str, token_counts: list[int], repeats: int, cap: MemoryCap | None, args, bound_gbps: float,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Forward seconds against tokens scored, the whole model streamed from disk under the cap, computing in
    ``dtype`` (``None``: the checkpoint's)."""
    weights = checkpoint / "model.safetensors"
    evict(weights)
    with streamed_target(checkpoint, cap, args.prefetch, args.cache_fraction, dtype) as (model, entry):
        stored = transformers.AutoConfig.from_pretrained(checkpoint).dtype  # the model's dtype may differ
        entry.update({"shape": label, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                      "stored_dtype": str(stored).removeprefix("torch.") if stored else None})
        return measured_curve(model, entry, weights, token_counts, repeats, cap, bound_gbps)


def block_device_reads(path: Path) -> Callable[[], tuple[int, int]] | None:
    """A reader of (reads completed, bytes read) so far by the block device holding ``path``, from its
    ``/sys/dev/block/MAJOR:MINOR/stat`` (every process's reads of that device); ``None`` where there is none."""
    device = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat")
    if not stat.is_file():
        return None

    def reads() -> tuple[int, int]:
        fields = stat.read_text().split()
        return int(fields[0]), int(fields[2]) * 512  # sectors are 512 bytes in this file whatever the device's

    return reads


def measured_curve(model, entry: dict[str, Any], stored_on: Path, token_counts: list[int], repeats: int,
                   cap: MemoryCap | None, bound_gbps: float) -> dict[str, Any]:
    """``entry`` (the shape's label, dtype and cap figures) completed with the streamed ``model``'s forward seconds
    against tokens scored, their share of the bound, the flat region, and the requests the disk saw per 1-token
    forward (how the block layer split the reads: their mean size) on the device holding ``stored_on``."""
    streamer = layer_streamer(model)
    device_reads = block_device_reads(stored_on)
    streamed = streamer.read_bytes_per_forward
    entry.update({"streamed_bytes": streamed, "ring_bytes_per_forward": streamer.streamed_bytes_per_forward,
                  "ring_bytes": streamer.buffer_bytes, "prefetch": streamer.prefetch})
    seconds = {}
    for tokens in token_counts:
        # Logits for the last token only, as a SpecExec tree forward computes the LM head for the few nodes its
        # walk visits (hf.forward.NodeLogits); all 256 tokens' logits would also need 100 MB under the cap.
        before = device_reads() if device_reads and tokens == 1 else None
        seconds[str(tokens)] = median_forward_seconds(model, tokens, repeats, logits=1)
        if before:
            requests, nbytes = (after - earlier for after, earlier in zip(device_reads(), before))
            entry["disk_requests_per_forward"] = requests / (repeats + 1)  # forward_seconds's warm-up read too
            entry["disk_request_mean_bytes"] = nbytes / max(requests, 1)
        print(f"  {entry['shape']} {entry['dtype']}: forward over {tokens} tokens {seconds[str(tokens)]:.3f} s",
              flush=True)
    cap_figures(cap, entry)
    entry["seconds"] = seconds
    entry["share_of_bound"] = {n: streamed / s / GB / bound_gbps for n, s in seconds.items()} if bound_gbps else {}
    one = seconds.get("1")
    flat = [int(n) for n, s in seconds.items() if one and s <= FLAT * one]
    entry["flat_tokens"] = max(flat, default=None)
    entry["over_one_token"] = {n: s / one for n, s in seconds.items()} if one else {}
    return entry


def int4_prefetch(args) -> int:
    """The int4 rows' read-ahead: ``--prefetch`` where it is a number; for ``auto``, 4 (an int4 target is placed in
    memory before the cap can be set, so "auto" would size its ring by the uncapped machine's memory; each row
    records what "auto" would choose within its room, ``auto_prefetch_in_room``: 11 for the 1.7B shape, whose
    1-token forward read at the bound with 4)."""
    return args.prefetch if isinstance(args.prefetch, int) else 4


def int4_curve(checkpoint: Path, label: str, folder: Path, token_counts: list[int], repeats: int,
               cap: MemoryCap | None, args, bound_gbps: float) -> dict[str, Any]:
    """Forward seconds against tokens scored for the bf16 ``checkpoint`` loaded with ``quantize="int4"``: the library
    quantizes its decoder layers to optimum-quanto qint4 one at a time as they load, writes them packed to
    ``folder``, and streams them from there with the embedding and head read from the checkpoint. The cap is set
    once the model is placed (the ring's pages are touched by the first forward, so it comes out of the room), with
    the room of the checkpoint's bf16 rows (``--cache-fraction`` of the bf16 checkpoint's bytes): on a CPU without
    native bf16 matmuls the bf16 head's product widens the head to float32 (400 MB for the 1.7B shape), which a
    room of a fraction of the int4 bytes does not hold (OOM-killed). ``weights_over_limit`` is then the bytes the
    int4 model's weights take on disk over that cap."""
    if folder.exists():
        shutil.rmtree(folder)
    model = load_offloaded(checkpoint, max_memory={"cpu": 0}, offload_folder=folder, executor="stream",
                           prefetch=int4_prefetch(args), quantize="int4")
    with released(model, cap) as model:
        weights, packed = checkpoint / "model.safetensors", sorted(folder.glob("*.dat"))
        for path in (weights, *packed):
            evict(path)
        unquantized = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                          if not name.startswith("model.layers."))  # embedding, norm and head, read from the checkpoint
        stored = unquantized + sum(path.stat().st_size for path in packed)
        checkpoint_bytes = weights.stat().st_size
        entry = capped(cap, checkpoint_bytes, args.cache_fraction)
        if entry["capped"]:
            entry.update(weights_bytes=stored, weights_over_limit=stored / entry["limit_bytes"],
                         room_from="the bf16 checkpoint's bytes, as its bf16 rows")
        entry.update({"shape": label, "dtype": "int4", "stored_dtype": "qint4 layers, bfloat16 embedding and head",
                      "stored_bytes": stored,
                      # what prefetch="auto" would read ahead within this room (a check of int4_prefetch's choice)
                      "auto_prefetch_in_room": auto_prefetch(layer_streamer(model)._unit_bytes, int(
                          args.cache_fraction * checkpoint_bytes), AUTO_RING_SHARE, BLOCK)})
        return measured_curve(model, entry, folder, token_counts, repeats, cap, bound_gbps)


def methods(draft, args) -> dict[str, dict]:
    """``generate()`` keyword arguments of each decoding method compared end to end."""
    compared: dict[str, dict] = {"plain generate": {}, "HF assisted (defaults)": {"assistant_model": draft}}
    for tokens in args.assistant_tokens:
        compared[f"HF assisted ({tokens} tokens)"] = {
            "assistant_model": draft, "num_assistant_tokens": tokens, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0}
    int8 = int8_copy(draft) if args.draft_int8 else None
    for budget in args.budgets:
        compared[f"SpecExec budget {budget}"] = {"assistant_model": draft, "speculator": "specexec", "budget": budget}
        if args.draft_ahead:
            compared[f"SpecExec budget {budget} + draft ahead"] = {
                **compared[f"SpecExec budget {budget}"], "draft_ahead": True}
        if int8 is not None:
            compared[f"SpecExec budget {budget}, int8 draft"] = {
                **compared[f"SpecExec budget {budget}"], "assistant_model": int8}
    return compared


def int8_copy(draft):
    """The draft with its decoder layers and head in int8 (``int8_draft``), sharing the float draft's embedding (its
    float head is not copied first: the copy's head is replaced, the float draft keeps its own)."""
    shared = {id(module): module for module in (draft.get_input_embeddings(), draft.get_output_embeddings())}
    return int8_draft(copy.deepcopy(draft, memo=shared))


def end_to_end(args, cap: MemoryCap | None) -> dict[str, Any]:
    """The default pair, target streamed from disk under the cap: every method on the same prompts."""
    draft, tokenizer = load_draft("distilled")
    checkpoint = target_cache_dir()
    weights = checkpoint / "model.safetensors"
    compared = methods(draft, args)
    prompts = [chat_inputs(tokenizer, prompt) for prompt in load_prompts("eval")[: args.prompts]]
    entry: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    evict(weights)
    with streamed_target(checkpoint, cap, args.end_to_end_prefetch, args.weights_memory) as (model, capped_entry):
        rows = measure_capped(model, cap, capped_entry, entry, weights, args.weights_memory, prompts, compared,
                              args.max_new_tokens)
        autos = learnt_state_of(draft).auto_budgets.get(model, {})
        if autos:  # what budget="auto" chose with at the end: its timings, acceptance and modelled tokens/s
            entry["auto_budget"] = [auto.describe() for auto in autos.values()]
    entry["methods"] = summarize(rows)
    entry["rows"] = rows
    return entry


def measure_capped(model, cap: MemoryCap | None, capped_entry: dict[str, Any], entry: dict[str, Any], weights: Path,
                   weights_memory: float, prompts: list[dict], compared: dict[str, dict], max_new_tokens: int,
                   label: str = "") -> list[dict[str, Any]]:
    """Every method of ``compared`` on every prompt, the streamed ``model`` under the cap: the rows, each output
    checked against the first method's (plain greedy); ``entry`` gets the ring's and the cap's figures.

    Args:
        model: The target :func:`streamed_target` loaded (its ring sized under the cap, ``capped_entry``).
        weights: The target's weight file (evicted from the page cache before the timed runs).
        weights_memory: The memory the target gets in all, ring included, as a share of its weights.
        label: Appended to each row's method name (e.g. the read-ahead depth).
    """
    weights_bytes = weights.stat().st_size
    ring_bytes = layer_streamer(model).buffer_bytes
    entry.update(capped_entry, ring_bytes=ring_bytes, prefetch=layer_streamer(model).prefetch,
                 weights_memory=weights_memory)
    if cap is not None and ring_bytes >= weights_memory * weights_bytes:
        raise SystemExit(f"The ring ({ring_bytes / 1e6:.0f} MB) leaves nothing of --weights-memory "
                         f"{weights_memory} for activations: raise it, or read fewer units ahead.")
    # Warm-ups (lazy initialisations, budget="auto"'s timing forwards over up to 1025 tokens) run with the cap
    # lifted, the ring having been sized under it. The measured runs are then capped at the process's usage
    # (draft, runtime, ring, what the warm-ups left) plus what the ring left of the target's room: so the
    # ring, the activations and the page cache share the weights' room all told.
    if cap is not None:
        cap.limit(None)
    for kwargs in compared.values():
        model.generate(**prompts[0], max_new_tokens=4, do_sample=False, **kwargs)
    evict(weights)
    if cap is not None:
        entry.update(capped(cap, weights_bytes, weights_memory, ring_bytes), ring_sized_under=capped_entry)
    rows = []
    for index, inputs in enumerate(prompts):
        reference = None
        for method, kwargs in compared.items():
            row = {"prompt": index, "method": method + label, **timed_generate(model, inputs, max_new_tokens, **kwargs)}
            reference = reference or row["tokens"]
            row["equals_plain_greedy"] = row["tokens"] == reference
            rows.append(row)
            print(f"  prompt {index} {row['method']:<26} {len(row['tokens']) / row['seconds']:6.2f} tok/s"
                  f"{'' if row['equals_plain_greedy'] else '  DIFFERS'}", flush=True)
    cap_figures(cap, entry)
    return rows


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per method: tokens/s over all prompts together, the median per-prompt tokens/s, tokens per target forward."""
    summary: dict[str, dict] = {}
    for method in dict.fromkeys(row["method"] for row in rows):
        group = [row for row in rows if row["method"] == method]
        tokens = sum(len(row["tokens"]) for row in group)
        entry = {"tokens_per_second": tokens / sum(row["seconds"] for row in group),
                 "median_prompt_tokens_per_second": statistics.median(len(r["tokens"]) / r["seconds"] for r in group),
                 "all_equal_plain_greedy": all(row["equals_plain_greedy"] for row in group)}
        if all("target_forwards" in row for row in group):
            entry["tokens_per_target_forward"] = tokens / sum(row["target_forwards"] for row in group)
        steps = sum(row.get("target_forwards", 0) for row in group)
        # SpecExec's own clocks (SpecExec rows only): growing its trees, and verifying them.
        for figure, key in (("draft_seconds_per_step", "tree_seconds"), ("verify_seconds_per_step", "verify_seconds")):
            if steps and all(key in row for row in group):
                entry[figure] = sum(row[key] for row in group) / steps
        if all("tree_sizes" in row for row in group):
            entry["mean_tree_size"] = statistics.mean(size for row in group for size in row["tree_sizes"])
        if "tokens_per_target_forward" in entry:
            entry["seconds_per_step"] = entry["tokens_per_target_forward"] / entry["tokens_per_second"]
        summary[method] = entry
    return summary


def forward_goals(curves: list[dict[str, Any]]) -> list[Goal]:
    """The issue's forward goals, from the forward rows: the 1-token forward's share of the bound, the flat region,
    the 64/1 ratio, and the largest weights-over-cap ratio a shape ran with (its peak named, within the cap or
    not)."""
    measured = [curve for curve in curves if "seconds" in curve]
    result: list[Goal] = []
    larger = SHAPES["smollm2-1.7b"].name
    for curve in (curve for curve in measured if curve["shape"] in (DEFAULT_TARGET, larger)):
        # The 1.7B shape is measured in each dtype asked (bf16, and bf16 computed in float32): a goal per dtype.
        default = curve["shape"] == DEFAULT_TARGET
        name = curve["shape"] if default else f"{curve['shape']} {curve['dtype']}"
        key = "default_target" if default else f"larger_{curve['dtype']}"
        share = curve.get("share_of_bound", {}).get("1")
        if share is not None:
            result.append(Goal(f"{key}_one_token_share_of_bound", f"{name}: 1-token forward's share of the bound",
                               share, 0.85))
        if not default and curve.get("flat_tokens") is not None:
            result.append(Goal(f"{key}_flat_tokens", f"{name}: flat up to tokens", curve["flat_tokens"], 32))
        ratio = curve.get("over_one_token", {}).get("64")
        if default and ratio is not None:
            result.append(Goal(f"{key}_64_over_1", f"{name}: 64-token forward / 1-token forward", ratio, 1.5,
                               at_least=False))
    capped_rows = [curve for curve in measured if curve.get("capped") and "peak_bytes" in curve]
    if capped_rows:
        largest = max(capped_rows, key=lambda curve: curve["weights_over_limit"])
        within = "within" if largest["within_limit"] else "OVER"
        claim = (f"{largest['shape']} {largest['dtype']}: weights over the cap, peak {largest['peak_bytes'] / 1e6:.0f} "
                 f"MB {within} the {largest['limit_bytes'] / 1e6:.0f} MB cap (and within it)")
        result.append(Goal("weights_over_cap", claim, largest["weights_over_limit"], 2))
    return result


def goals(report: dict[str, Any]) -> list[Goal]:
    """The issue's goals: the forward section's, then the end-to-end ratios and its peak memory over its cap."""
    result = forward_goals(report.get("forward", []))
    e2e = report.get("end_to_end") or {}
    if e2e.get("peak_bytes"):
        result.append(Goal("peak_over_cap", "end to end: peak memory (process plus page cache) / the cap",
                           e2e["peak_bytes"] / e2e["limit_bytes"], 1, at_least=False))
    speed = {name: entry["tokens_per_second"] for name, entry in e2e.get("methods", {}).items()}
    fixed = {name: value for name, value in speed.items() if name.startswith("SpecExec budget") and "auto" not in name}
    if not fixed:
        return result
    best_name = max(fixed, key=fixed.get)
    best = fixed[best_name]
    if "plain generate" in speed:
        result.append(Goal("specexec_vs_plain", f"{best_name} vs plain generate", best / speed["plain generate"], 2.5))
    assisted = {name: value for name, value in speed.items() if name.startswith("HF assisted")}
    if assisted:
        result.append(Goal("specexec_vs_assisted", f"{best_name} vs the best HF assisted",
                           best / max(assisted.values()), 1.4))
    if "SpecExec budget auto" in speed:
        result.append(Goal("auto_vs_best_budget", "SpecExec auto vs the best fixed budget",
                           speed["SpecExec budget auto"] / best, 0.95))
    per_forward = e2e["methods"][best_name].get("tokens_per_target_forward")
    if per_forward and "plain generate" in speed:
        result.append(Goal("speedup_over_tokens_per_forward",
                           f"{best_name}: wall-clock speedup / tokens per target forward",
                           best / speed["plain generate"] / per_forward, 0.8))
    return result
    best_name = max(fixed, key=fixed.get)
    best = fixed[best_name]
    if "plain generate" in speed:
        result[f"{best_name} vs plain generate (goal >= 2.5)"] = best / speed["plain generate"]
    assisted = {name: value for name, value in speed.items() if name.startswith("HF assisted")}
    if assisted:
        result[f"{best_name} vs the best HF assisted (goal >= 1.4)"] = best / max(assisted.values())
    if "SpecExec budget auto" in speed:
        result["SpecExec auto vs the best fixed budget (goal >= 0.95)"] = speed["SpecExec budget auto"] / best
    per_forward = e2e["methods"][best_name].get("tokens_per_target_forward")
    if per_forward and "plain generate" in speed:
        result[f"{best_name}: wall-clock speedup / tokens per target forward (goal >= 0.8)"] = (
            best / speed["plain generate"] / per_forward)
    return result


def project(curve: dict[str, Any], pair: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s of plain decoding and of each SpecExec budget for a larger shape: its measured forward at ``B + 1``
    tokens plus the real pair's measured draft seconds per step, for the real pair's tokens per target forward."""
    seconds = curve["seconds"]
    rows: dict[str, Any] = {}
    one = interpolate(seconds, 1)
    if one:
        rows["plain generate"] = 1 / one
    for method, entry in pair["methods"].items():
        if not method.startswith("SpecExec budget ") or "draft_seconds_per_step" not in entry:
            continue
        budget = method.removeprefix("SpecExec budget ")
        if not budget.isdigit():
            continue
        forward = interpolate(seconds, int(budget) + 1)
        if forward is not None:
            rows[method] = entry["tokens_per_target_forward"] / (forward + entry["draft_seconds_per_step"])
    return {"shape": curve["shape"], "dtype": curve.get("dtype"), "tokens_per_second": rows,
            "best_specexec_vs_plain": (max((v for k, v in rows.items() if k != "plain generate"), default=math.nan)
                                       / rows["plain generate"]) if "plain generate" in rows else None}


# Report ----------------------------------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown tables."""
    env = report["environment"]
    lines = ["# A model bigger than RAM, streamed from the SSD", "",
             f"{env['machine']} ({env.get('cpu', 'processor not recorded')}); torch {env['torch']}, "
             f"transformers {env['transformers']}; {env['threads']} thread(s); "
             f"memory cap: {env['cap']}; cache fraction {env['cache_fraction']}; load average {env['load_before']} "
             f"before. Command: `{env['command']}`", ""]
    if report.get("bound"):
        b = report["bound"]
        lines += [f"**Bound:** {b['bytes'] / 1e6:.0f} MB (`{Path(b['file']).parent.name}/{Path(b['file']).name}`) read "
                  f"cold with direct reads: {b['direct_gbps']:.2f} GB/s (best of runs "
                  f"{', '.join(f'{x:.2f}' for x in b['direct_gbps_runs'])}); a cold buffered read of "
                  f"{b['buffered_bytes'] / 1e6:.0f} MB through the page cache: {b['buffered_cold_gbps']:.2f} GB/s.", ""]
    curves = [curve for curve in report.get("forward", []) if "seconds" in curve]
    if curves:
        counts = sorted({int(n) for curve in curves for n in curve["seconds"]})
        lines += ["## Forward time against tokens scored, streamed from disk", "",
                  "| shape | dtype | cap (weights / cap), peak, ring | "
                  + " | ".join(f"{n} tok (s, share of bound)" for n in counts)
                  + " | flat up to (<= 1.3x) | 64 / 1 | disk requests per 1-token forward (mean size) |",
                  "|---|---|---|" + "---:|" * (len(counts) + 3)]
        for curve in curves:
            cells = []
            for n in counts:
                s = curve["seconds"].get(str(n))
                share = curve["share_of_bound"].get(str(n))
                cells.append("" if s is None else f"{s:.3f} ({share:.0%})" if share else f"{s:.3f}")
            cap = (f"{curve['limit_bytes'] / 1e6:.0f} MB ({curve['weights_over_limit']:.1f}x), peak "
                   f"{curve.get('peak_bytes', 0) / 1e6:.0f} MB" if curve.get("capped") else "none"
                   ) + f", ring {curve['ring_bytes'] / 1e6:.0f} MB (prefetch {curve.get('prefetch')})"
            ratio = curve["over_one_token"].get("64")
            stored = curve.get("stored_dtype")
            dtype = curve["dtype"] + (f" ({stored} on disk)" if stored and stored != curve["dtype"] else "")
            requests = (f"{curve['disk_requests_per_forward']:.0f} ({curve['disk_request_mean_bytes'] / 2**20:.2f} MiB)"
                        if "disk_requests_per_forward" in curve else "")
            lines.append(f"| {curve['shape']} | {dtype} | {cap} | " + " | ".join(cells)
                         + f" | {curve['flat_tokens']} | {'' if ratio is None else f'{ratio:.2f}x'} | {requests} |")
        lines.append("")
    for row in report.get("forward", []):
        if "not_run" in row:
            lines.append(f"- {row['shape']} {row['dtype']}: not run; the library says: {row['not_run']}")
    if any("not_run" in row for row in report.get("forward", [])):
        lines.append("")
    e2e = report.get("end_to_end")
    if e2e and "methods" in e2e:
        cap = (f"capped at {e2e['limit_bytes'] / 1e6:.0f} MB: the process's own {e2e['usage_before_bytes'] / 1e6:.0f} "
               "MB after loading and warm-ups (draft, runtime, ring) plus "
               f"{(e2e['limit_bytes'] - e2e['usage_before_bytes']) / 1e6:.0f} "
               f"MB of room (activations and page cache); the target's {e2e['weights_bytes'] / 1e6:.0f} MB of weights "
               f"get {e2e['weights_memory']:.2f} of their size in all, the ring "
               f"({e2e.get('ring_bytes', 0) / 1e6:.0f} MB at prefetch {e2e.get('prefetch')}, sized within it before "
               "loading) included; peak "
               f"{e2e.get('peak_bytes', 0) / 1e6:.0f} MB" if e2e.get("capped") else "no cap")
        lines += ["## End to end: default pair, target streamed from disk, greedy", "",
                  f"{e2e['prompts']} held-out prompts x {e2e['max_new_tokens']} new tokens; {cap}.", "",
                  "| method | tokens/s | median per prompt | tokens per target forward | s per step | draft s per step "
                  "| target forward s per step | mean tree size | = plain |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]

        def cell(value: float | None, digits: int) -> str:
            return "" if value is None else f"{value:.{digits}f}"

        for method, m in e2e["methods"].items():
            lines.append(f"| {method} | {m['tokens_per_second']:.2f} | {m['median_prompt_tokens_per_second']:.2f} | "
                         f"{cell(m.get('tokens_per_target_forward'), 2)} | {cell(m.get('seconds_per_step'), 3)} | "
                         f"{cell(m.get('draft_seconds_per_step'), 3)} | {cell(m.get('verify_seconds_per_step'), 3)} | "
                         f"{cell(m.get('mean_tree_size'), 1)} | {m['all_equal_plain_greedy']} |")
        lines.append("")
        for auto in e2e.get("auto_budget", []):
            rates = ", ".join(f"{budget} {rate:.2f}" for budget, rate in auto["modelled_tokens_per_second"].items())
            lines += [f"`budget=\"auto\"` at the end: chose {auto['choice']}; modelled tokens/s by budget: {rates}.",
                      ""]
    if report.get("goals"):
        lines += ["## Goals", ""] + [Goal.from_json(goal).line() for goal in report["goals"]] + [""]
    if report.get("projections"):
        lines += ["## Projected tokens/s for larger shapes (measured forward curve + the real pair's steps)", ""]
        for projection in report["projections"]:
            cells = ", ".join(f"{name} {value:.2f}" for name, value in projection["tokens_per_second"].items())
            lines.append(f"- {projection['shape']} {projection.get('dtype') or ''}: {cells}")
        lines.append("")
    lines += [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Forward seconds over the 1-token forward against tokens scored, one line per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for curve in (curve for curve in report.get("forward", []) if "seconds" in curve):
        points = sorted((int(n), r) for n, r in curve["over_one_token"].items())
        axis.plot([n for n, _ in points], [r for _, r in points], marker="o",
                  label=f"{curve['shape']} {curve['dtype']}")
    axis.axhline(FLAT, color="grey", linestyle=":", label=f"{FLAT}x")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("tokens scored in one forward")
    axis.set_ylabel("forward time / 1-token forward")
    axis.set_title("Weights streamed from disk")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def save(report: dict[str, Any], out: Path) -> None:
    """Writes every file the report has so far (after each section)."""
    write_report(out, "ssd", report, markdown(report))
    if any("seconds" in curve for curve in report.get("forward", [])):
        plot(report, out / "ssd.png")


def run_section(report: dict[str, Any], name: str, out: Path, work: Callable[[], Any]) -> Any:
    """Runs one section and saves; an error is recorded (and fails the run) instead of losing the others. The
    section's wall time goes to ``report["section_seconds"]``, for the run's length."""
    started = time.perf_counter()
    try:
        return work()
    except Exception as error:
        report["notes"].append(f"{name}: error: {type(error).__name__}: {error}")
        report.setdefault("errors", []).append({"section": name, "traceback": traceback.format_exc()})
        print(traceback.format_exc(), flush=True)
        return None
    finally:
        report.setdefault("section_seconds", {})[name] = round(time.perf_counter() - started, 1)
        save(report, out)


def prefetch_value(text: str) -> int | str:
    """``--prefetch``: a positive count of units read ahead, or ``auto`` (passed to ``load_offloaded`` as is)."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--prefetch takes a positive integer or 'auto', got {text!r}")
    return int(text)


# --quick: every section, small (a tiny shape, one prompt, a few tokens): a smoke check in well under a minute.
QUICK = {"prompts": 1, "max_new_tokens": 4, "budgets": ["8", "auto"], "assistant_tokens": [], "token_counts": [1, 4],
         "repeats": 1, "bound_repeats": 1, "bound_min_bytes": 64 << 20, "shapes": ["tiny"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` swaps in :data:`QUICK`'s defaults (options given still win)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="every section, small: a smoke check")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--budgets", nargs="+", default=["8", "16", "32", "64", "128", "256", "auto"])
    parser.add_argument("--draft-ahead", action="store_true",
                        help="also each budget with draft_ahead=True (the draft grows on while the target verifies)")
    parser.add_argument("--draft-int8", action="store_true",
                        help="also each budget with the draft's decoder layers in int8 (specexec_hf.models.int8_draft)")
    parser.add_argument("--assistant-tokens", type=int, nargs="*", default=[],
                        help="HF assisted with constant chains of these lengths, besides its defaults")
    parser.add_argument("--token-counts", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3, help="forwards timed per token count (the median)")
    parser.add_argument("--bound-repeats", type=int, default=3, help="cold reads for the bound (the best)")
    parser.add_argument("--bound-min-bytes", type=int, default=2 * 10**9,
                        help="a scratch file this long, for the buffered read and for the bound where every "
                             "streamed file is shorter")
    parser.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=["smollm2-1.7b", "llama-8b"])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--shape-dir", type=Path, default=Path(tempfile.gettempdir()) / "specexec-ssd-shapes",
                        help="where the random-weight checkpoints are written")
    parser.add_argument("--keep-shapes", action="store_true",
                        help="keep the random-weight checkpoints for the next run (else deleted once measured)")
    parser.add_argument("--cache-fraction", type=float, default=CACHE_FRACTION,
                        help="memory above the process's own before loading (ring, activations, page cache), as a "
                             "share of the weights")
    parser.add_argument("--weights-memory", type=float, default=WEIGHTS_MEMORY,
                        help="end to end: the memory the target gets above the process's own before loading (the "
                             "ring, sized within it, activations and page cache together), as a share of its weights")
    parser.add_argument("--prefetch", type=prefetch_value, default=DEFAULT_PREFETCH,
                        help="units read ahead by the stream executor: a positive integer or 'auto'")
    parser.add_argument("--end-to-end-prefetch", type=prefetch_value, default=END_TO_END_PREFETCH,
                        help="the end-to-end section's read-ahead (units), or 'auto' (sized within --weights-memory)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--sections", nargs="+", default=["bound", "forward", "end_to_end"],
                        choices=["bound", "forward", "end_to_end"])
    parser.add_argument("--no-cap", action="store_true", help="run without a memory cgroup (figures say so)")
    quick = argparse.ArgumentParser(add_help=False)
    quick.add_argument("--quick", action="store_true")
    if quick.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    args.budgets = [budget if budget == "auto" else int(budget) for budget in args.budgets]
    return args


def cpu_description() -> str:
    """The processor's model name and whether it multiplies bfloat16 natively: a bf16 target's compute-bound
    forwards differ by several times between machines that do and machines that convert every weight first."""
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    native = "native bfloat16 matmuls" if native_bfloat16_cpu() else "no native bfloat16 matmuls"
    return f"{names[0] if names else platform.processor() or 'unknown processor'}, {native}"


def capped_run(args, script: str, argv: list[str] | None) -> tuple[MemoryCap | None, dict[str, Any]]:
    """This process in a memory group of its own (none with ``--no-cap``) and the run's environment for the report.

    Args:
        args: The parsed arguments (``no_cap``, ``threads``, ``cache_fraction``, ``prefetch``).
        script: The benchmark's file name under ``benchmarks/``, for the group's name and the command.
        argv: The arguments it was called with (``None``: the command line's).
    """
    torch.set_num_threads(args.threads)
    cap = None
    if not args.no_cap:
        reason = MemoryCap.unavailable()
        if reason:
            raise SystemExit(f"{reason}: run as root on a cgroup v1 machine, or pass --no-cap")
        cap = MemoryCap(f"specexec-{Path(script).stem}-{os.getpid()}")
        cap.join()  # first: pages charged before joining would stay outside the group
    return cap, {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "cpu": cpu_description(),
        "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": args.threads, "cap": "cgroup v1" if cap else "none",
        "cache_fraction": args.cache_fraction, "prefetch": args.prefetch,
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join(["flock /tmp/bench.lock .venv/bin/python", f"-m benchmarks.{script.removesuffix('.py')}",
                             *(argv if argv is not None else sys.argv[1:])]),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cap, environment = capped_run(args, "ssd.py", argv)
    report: dict[str, Any] = {"environment": environment, "notes": [], "forward": [], "projections": []}
    written: list[Path] = []  # random-weight checkpoints and the scratch file, deleted at the end unless kept
    started = time.perf_counter()
    try:
        specexec_hf.load_default_target()  # converts the GGUF on first use
        computed = [DTYPES[key] for key in ("bf16", "bf16-f32") if key in args.dtypes]  # what the shapes run in
        quantized = "int4" in args.dtypes  # int4 rows quantize the bf16 checkpoint as it loads
        # Per forward curve: (label, checkpoint, the dtype computed in; None: the checkpoint's).
        runs: list[tuple[str, Path, torch.dtype | None]] = [(DEFAULT_TARGET, target_cache_dir(), None)]
        shapes = {SHAPES[key].name: (SHAPES[key], args.shape_dir / f"{key}-bf16") for key in args.shapes
                  if "forward" in args.sections and (computed or quantized)}
        ensure_disk_space(args.shape_dir, args.bound_min_bytes * ("bound" in args.sections) + sum(
            shape.parameter_bytes(torch.bfloat16) for shape, where in shapes.values()
            if not (where / "model.safetensors").is_file())
            # one int4 folder at a time (each deleted once measured): a quarter of the layers' bf16 bytes and scales
            + max((shape.parameter_bytes(torch.bfloat16) // 3 for shape, _ in shapes.values() if quantized), default=0))
        for label, (shape, where) in shapes.items():
            print(f"writing {label} bf16 to {where}", flush=True)
            written.append(where)
            if run_section(report, f"write {label}", args.out,
                           partial(write_random_checkpoint, shape, torch.bfloat16, where)):
                runs += [(label, where, dtype) for dtype in computed]
        bound_gbps = 0.0
        if "bound" in args.sections:
            scratch = args.shape_dir / "bound-scratch.bin"
            written.append(scratch)
            checkpoints = dict.fromkeys([*(c for _, c, _ in runs), *(where for _, where in shapes.values())])
            streamed = [checkpoint / "model.safetensors" for checkpoint in checkpoints
                        if (checkpoint / "model.safetensors").is_file()]
            report["bound"] = run_section(report, "bound", args.out, lambda: bound(
                streamed, args.bound_repeats, write_scratch_file(scratch, args.bound_min_bytes)))
            bound_gbps = (report["bound"] or {}).get("direct_gbps", 0.0)
        if "forward" in args.sections:
            for position, (label, checkpoint, dtype) in enumerate(runs):
                name = f"forward {label}" + (f" {str(dtype).removeprefix('torch.')}" if dtype else "")
                curve = run_section(report, name, args.out, partial(
                    forward_curve, checkpoint, label, args.token_counts, args.repeats, cap, args, bound_gbps, dtype))
                if curve:
                    report["forward"].append(curve)
                used_later = quantized or any(later == checkpoint for _, later, _ in runs[position + 1 :])
                if checkpoint in written and not used_later and not args.keep_shapes:
                    shutil.rmtree(checkpoint)
            for label, (_, checkpoint) in shapes.items() if quantized else []:
                folder = args.shape_dir / f"{checkpoint.name}-int4"
                written.append(folder)
                curve = run_section(report, f"forward {label} int4", args.out, partial(
                    int4_curve, checkpoint, label, folder, args.token_counts, args.repeats, cap, args, bound_gbps))
                if curve:
                    report["forward"].append(curve)
                for path in (folder, checkpoint) if not args.keep_shapes else ():
                    shutil.rmtree(path, ignore_errors=True)
        report["goals"] = [goal.as_json() for goal in goals(report)]
        if "end_to_end" in args.sections:
            report["end_to_end"] = run_section(report, "end to end", args.out, lambda: end_to_end(args, cap))
            report["goals"] = [goal.as_json() for goal in goals(report)]
            if report["end_to_end"]:
                report["projections"] = [project(curve, report["end_to_end"]) for curve in report["forward"]
                                         if "seconds" in curve and curve["shape"] != DEFAULT_TARGET]
    finally:
        if cap is not None:
            cap.leave()
        if not args.keep_shapes:
            for path in written:
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
        report["environment"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
        report["environment"]["minutes"] = round((time.perf_counter() - started) / 60, 1)
        save(report, args.out)
    print(markdown(report), flush=True)
    differs = [name for name, entry in (report.get("end_to_end") or {}).get("methods", {}).items()
               if not entry["all_equal_plain_greedy"]]
    if differs:
        print(f"outputs differ from plain greedy: {differs}", flush=True)
    return 1 if report.get("errors") or differs else 0


if __name__ == "__main__":
    raise SystemExit(main())
