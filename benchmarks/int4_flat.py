"""Issue 56's CPU goal: is the forward of an int4 target streamed from disk flat from 1 to 16 tokens?

The SmolLM2-1.7B shape (random bf16 weights) is loaded with ``load_offloaded(..., quantize="int4")`` (optimum-quanto
qint4 decoder layers written packed to an offload folder, streamed from there), its files evicted from the page cache
(``posix_fadvise``), and the process capped (cgroup v1, ``memory_cap.py``) at what it holds once the model is placed
plus a room of ``--room`` times the int4 weights' bytes, so the weights do not fit. The read-ahead is what
``prefetch="auto"`` chooses within that room (the model is placed before the cap, so "auto" is computed for the room).

Each round times, back to back as a tree search runs them, one forward per width (``--widths``, interleaved: 1, 16,
64, 1, 16, 64, ...), so background load falls on every width alike, and the reads alone: every streamed unit's read
plan carried out by the streamer's own reader into its own ring, without compute. Per forward the split comes from
hooks on each streamed unit: the time spent waiting for its weights (the reads not hidden behind compute) and the
time computing. Medians over the rounds:

- ``forward_seconds``: the whole forward; ``over_one_token``: against the 1-token forward (the goal: <= 1.3 at 16);
- ``read_seconds``: the reads alone; ``compute_seconds``: forward less waits; ``wait_seconds``: the waits;
- ``overlap``: the share of the shorter of reads and compute hidden behind the longer one (1: the forward takes
  max(read, compute); 0: it takes their sum).

Every figure is checked before it is written (``figure_checks.py``): positive, the forward not falling as tokens grow
beyond noise, the waits within the forward, the reads' bandwidth within the disk's bound. A failing figure is withheld
and reported, and the run exits non-zero.

Run (root, about 10 minutes on 2 cores, 5 GB on disk): flock /tmp/bench.lock .venv/bin/python -m benchmarks.int4_flat
Not a test: the figures depend on the disk, the CPU and the load.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import time
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specexec_hf.offload import layer_streamer, load_offloaded
from specexec_hf.offload.direct_io import BLOCK, DirectReader, ReadPlan, Span, WeightFile, aligned_empty, plan_reads
from specexec_hf.offload.layout import auto_prefetch
from specexec_hf.offload.stream import AUTO_RING_SHARE, LayerStreamer

from benchmarks.figure_checks import (
    MEASURED,
    STAND_IN,
    FigureAudit,
    not_falling,
    parts_within,
    positive,
    ratio,
    within_bound,
)
from benchmarks.memory_cap import evict
from benchmarks.shapes import write_random_checkpoint
from benchmarks.ssd import SHAPES, capped_run

RESULTS = Path(__file__).resolve().parent / "results" / "int4_flat"
FLAT = 1.3  # the goal: the forward over 16 tokens within this factor of the 1-token forward
GB = 1e9


class UnitClock:
    """Per streamed unit (in execution order), the time its forward waited for its weights and the time it computed,
    over the forward since :meth:`reset`.

    Hooks: one before the streamer's own pre-hook (entering the unit), one after it (weights ready), one after the
    unit's forward (done).
    """

    def __init__(self, streamer: LayerStreamer):
        self.names = streamer.unit_names
        self.wait = [0.0] * len(self.names)
        self.compute = [0.0] * len(self.names)
        self._entered = self._ready = 0.0
        for position, (module, _) in enumerate(streamer._units):
            module.register_forward_pre_hook(self._enter, prepend=True)
            module.register_forward_pre_hook(partial(self._weights_ready, position))
            module.register_forward_hook(partial(self._done, position))

    def reset(self) -> None:
        self.wait = [0.0] * len(self.names)
        self.compute = [0.0] * len(self.names)

    def _enter(self, module, args) -> None:
        self._entered = time.perf_counter()

    def _weights_ready(self, position: int, module, args) -> None:
        self._ready = time.perf_counter()
        self.wait[position] += self._ready - self._entered

    def _done(self, position: int, module, args, output) -> None:
        self.compute[position] += time.perf_counter() - self._ready


def reads_in_turn(reader: DirectReader, plans: list[ReadPlan], in_flight: int) -> float:
    """Seconds ``reader`` takes to carry out ``plans`` in order, ``in_flight`` at a time (a plan waits for the one
    ``in_flight`` places before it, whose buffer it may reuse), as the streamer's ring reads them."""
    started = time.perf_counter()
    pending: list[Future] = []
    for plan in plans:
        if len(pending) == in_flight:
            pending.pop(0).result()
        pending.append(reader.submit(plan))
    for fill in pending:
        fill.result()
    return time.perf_counter() - started


def reads_alone(streamer: LayerStreamer) -> float:
    """Seconds the streamer's reader takes to read every cycling unit into its ring slot, ``prefetch + 1`` units in
    flight as in a forward, with no compute; the slots are then marked as holding nothing, so the next forward
    reads again."""
    streamer.wait_idle()
    plans = [plan for (_, plan), stays in zip(streamer._units, streamer._stays_loaded) if not stays]
    seconds = reads_in_turn(streamer._direct_reader, plans, streamer.prefetch + 1)
    for position, stays in enumerate(streamer._stays_loaded):
        if not stays:
            streamer._slots[streamer._slot_of[position]].position = None
    return seconds


def bound_gbps(long_file: Path, streamer: LayerStreamer, repeats: int = 3) -> float:
    """The disk's direct-read bandwidth: the best of ``repeats`` cold reads of ``long_file`` (the bf16 checkpoint, on
    the same disk) by the streamer's own reader, in pieces of its largest unit read each forward, as many in flight as
    in its ring."""
    cycling = [size for size, stays in zip(streamer._unit_bytes, streamer._stays_loaded) if not stays]
    piece = max(cycling) // BLOCK * BLOCK
    in_flight = streamer.prefetch + 1
    buffers = [aligned_empty(piece) for _ in range(in_flight)]
    file = WeightFile(long_file)
    plans = [plan_reads([Span(file, start, min(start + piece, file.size),
                              buffers[index % in_flight][: min(piece, file.size - start)])])
             for index, start in enumerate(range(0, file.size, piece))]
    best = 0.0
    for _ in range(repeats):
        evict(long_file)
        best = max(best, file.size / reads_in_turn(streamer._direct_reader, plans, in_flight) / GB)
    return best


def forward(model, ids: torch.Tensor, clock: UnitClock) -> dict[str, float]:
    """One forward over ``ids`` as SpecExec verifies a tree on a streamed target whose head stays loaded
    (:func:`specexec_hf.hf.forward.node_logits`): the base model over every token, then the head over the rows the
    walk reads (here the last one, a 2-d row).

    Not ``model(ids, logits_to_keep=1)``: there the head takes a ``[1, 1, hidden]`` slice of the ``[1, n, hidden]``
    hidden states, which torch's matmul does not fold into one product for ``n > 1``; it multiplies it as a batch,
    copying the whole transposed head first (200 MB for the 1.7B shape, 1.4 s on one busy core of this VM), a
    cost that ``n = 1`` does not pay and SpecExec's walk never does."""
    clock.reset()
    started, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
        model.get_output_embeddings()(hidden[0, -1:])
    seconds = time.perf_counter() - started
    return {"forward": seconds, "wait": sum(clock.wait), "compute_in_units": sum(clock.compute),
            "cpu": time.process_time() - cpu, "wait_by_unit": clock.wait, "compute_by_unit": clock.compute}


def measure(model, widths: list[int], rounds: int) -> dict[str, Any]:
    """Interleaved rounds: the reads alone, an untimed 1-token forward (the ring's read-ahead refilled), then one
    forward per width. Returns every round's figures."""
    streamer = layer_streamer(model)
    clock = UnitClock(streamer)
    inputs = {n: torch.randint(100, 10_000, (1, n), generator=torch.Generator().manual_seed(n)) for n in widths}
    for n in widths:  # warm-up: every shape once
        forward(model, inputs[n], clock)
    runs: dict[str, Any] = {"read": [], "forwards": {str(n): [] for n in widths}}
    for round_index in range(rounds):
        runs["read"].append(reads_alone(streamer))
        forward(model, inputs[1] if 1 in inputs else inputs[widths[0]], clock)
        for n in widths:
            runs["forwards"][str(n)].append(forward(model, inputs[n], clock))
        line = ", ".join(f"{n}: {runs['forwards'][str(n)][-1]['forward']:.3f} s" for n in widths)
        print(f"round {round_index + 1}/{rounds}: reads alone {runs['read'][-1]:.3f} s; forwards {line}", flush=True)
    return runs


def summary(runs: dict[str, Any], read_bytes: int, bound_gbps: float, audit: FigureAudit) -> dict[str, Any]:
    """Medians and the split per width, each figure checked (a failing one is withheld, its failure recorded)."""
    read = statistics.median(runs["read"])
    figures: dict[str, Any] = {"read_seconds": read, "read_gbps": read_bytes / read / GB, "widths": {}}
    audit.passes("reads", lambda: positive("reads alone, seconds", read))
    if bound_gbps:
        audit.passes("reads", lambda: within_bound("reads alone, GB/s", figures["read_gbps"], bound_gbps, audit.noise))
    medians = {n: statistics.median(r["forward"] for r in rows) for n, rows in runs["forwards"].items()}
    spread = {n: [min(r["forward"] for r in rows), max(r["forward"] for r in rows)]
              for n, rows in runs["forwards"].items()}
    audit.passes("forward", lambda: not_falling("int4 forward seconds", medians, spread, audit.noise))
    one = medians.get("1")
    for n, rows in runs["forwards"].items():
        whole = medians[n]
        wait = statistics.median(r["wait"] for r in rows)
        compute = statistics.median(r["forward"] - r["wait"] for r in rows)
        entry = {"forward_seconds": whole, "forward_spread": spread[n], "wait_seconds": wait,
                 "compute_seconds": compute, "compute_in_units_seconds": statistics.median(
                     r["compute_in_units"] for r in rows),
                 # the process's CPU seconds (compute threads and readers): wall seconds far above cpu / threads mean
                 # the compute threads waited for cores other processes held
                 "cpu_seconds": statistics.median(r["cpu"] for r in rows),
                 # per streamed unit (decoder layers, then the head), in execution order
                 "wait_by_unit": per_unit(rows, "wait_by_unit"), "compute_by_unit": per_unit(rows, "compute_by_unit")}
        if not audit.passes(f"width {n}", partial(parts_within, f"forward over {n} tokens", whole, {"waits": wait},
                                                              audit.noise)):
            continue
        shorter, longer = min(read, compute), max(read, compute)
        entry["overlap"] = max(0.0, min(1.0, (read + compute - whole) / shorter)) if shorter > 0 else None
        entry["serial_seconds"], entry["overlapped_seconds"] = read + compute, longer
        if one and audit.passes(f"width {n}", partial(ratio, f"forward over {n} tokens / over 1", whole, one)):
            entry["over_one_token"] = whole / one
        figures["widths"][n] = entry
    return figures


def per_unit(rows: list[dict[str, Any]], key: str) -> list[float] | None:
    """The median over ``rows`` of each unit's figure ``key``; ``None`` where the rows do not have it."""
    if not all(key in row for row in rows):
        return None
    return [statistics.median(values) for values in zip(*(row[key] for row in rows))]


def markdown(report: dict[str, Any]) -> str:
    env, figures = report["environment"], report.get("figures", {})
    lines = [
        f"# int4_flat: the {report['shape']} shape at int4, streamed from disk under a RAM cap", "",
        (f"{env['cpu']}, {env['machine']}, {env['threads']} threads; torch {env['torch']}; "
         f"{env['cap']}; read-ahead {report.get('prefetch')} units; load {env['load_before']} -> "
         f"{env.get('load_after')}."), "",
        f"```bash\n{env['command']}\n```", "",
        (f"Bytes read per forward: {report.get('read_bytes', 0) / 1e6:.0f} MB; the disk's bound "
         f"{report.get('bound_gbps', 0):.2f} GB/s; the reads alone {figures.get('read_seconds', float('nan')):.3f} s "
         f"({figures.get('read_gbps', float('nan')):.2f} GB/s). Medians of {report.get('rounds')} interleaved "
         "rounds."),
        "",
        "| tokens | forward (s) | x 1 token | compute (s) | waits (s) | reads alone (s) | overlap | CPU (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, entry in figures.get("widths", {}).items():
        lines.append(f"| {n} | {entry['forward_seconds']:.3f} | {entry.get('over_one_token', float('nan')):.2f} | "
                     f"{entry['compute_seconds']:.3f} | {entry['wait_seconds']:.3f} | {figures['read_seconds']:.3f} | "
                     f"{entry['overlap']:.2f} | {entry['cpu_seconds']:.3f} |")
    goal = report.get("goal")
    if goal:
        lines += ["", (f"Goal (forward over 16 tokens <= {FLAT}x over 1): {goal['over_one_token']:.2f}x, "
                       f"{'met' if goal['met'] else 'not met'}.")]
    for failure in report.get("failures", []):
        lines.append(f"\nFAILED CHECK ({failure['section']}): {failure['figure']}: {failure['why']}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--room", type=float, default=1.0,
                        help="the memory the cap leaves once the model is placed (ring, activations, page cache), as a "
                        "share of the bytes each forward streams (packed layers and bf16 head)")
    parser.add_argument("--prefetch", type=int, default=None, help="read-ahead (default: 'auto' within the room)")
    parser.add_argument("--shape-dir", type=Path, default=Path("/var/tmp/int4-flat"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and the int4 folder for a rerun")
    parser.add_argument("--no-cap", action="store_true", help="run without a memory cgroup (figures say so)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # ssd's cgroup and environment; its room (cache_fraction) is this run's, taken once the model is placed
    cap, environment = capped_run(argparse.Namespace(**vars(args), cache_fraction=args.room), "int4_flat.py", argv)
    report: dict[str, Any] = {"environment": environment, "shape": SHAPES[args.shape].name, "rounds": args.rounds}
    # the tiny shape (a smoke run) times a shared machine's noise: its checks catch signs and NaNs, not falls
    noise = STAND_IN if args.shape == "tiny" else MEASURED
    audit = FigureAudit(noise)
    checkpoint = args.shape_dir / f"{args.shape}-bf16"
    folder = args.shape_dir / f"{args.shape}-int4"
    try:
        print(f"writing {checkpoint}", flush=True)
        write_random_checkpoint(SHAPES[args.shape], torch.bfloat16, checkpoint)
        if folder.exists():
            shutil.rmtree(folder)
        print("quantizing as it loads", flush=True)
        model = placed(checkpoint, folder, prefetch=1)
        # The streamed bytes: the packed layers and what is read from the checkpoint (the bf16 head).
        weights = layer_streamer(model).read_bytes_per_forward
        room = int(args.room * weights)
        prefetch = args.prefetch or auto_prefetch(layer_streamer(model)._unit_bytes, room, AUTO_RING_SHARE, BLOCK)
        layer_streamer(model).close()
        del model
        # Placed again with the read-ahead "auto" chooses within the room (placed before the cap, "auto" would size
        # the ring by the uncapped machine's memory).
        model = placed(checkpoint, folder, prefetch)
        streamer = layer_streamer(model)
        report.update(prefetch=prefetch, read_bytes=streamer.read_bytes_per_forward, ring_bytes=streamer.buffer_bytes)
        report["bound_gbps"] = bound_gbps(checkpoint / "model.safetensors", streamer)  # its buffers outside the cap
        gc.collect()
        if cap is not None:
            cap.reclaim()  # the files written and read so far are page cache, not this process's memory
            limit = cap.usage() + room
            cap.limit(limit)
            report.update(cap_bytes=limit, room_bytes=room, weights_over_room=weights / room)
        report["units"] = streamer.unit_names
        runs = measure(model, args.widths, args.rounds)
        if cap is not None:
            report["peak_bytes"], report["cap_hits"] = cap.peak(), cap.failures()
        report["runs"] = runs
        report["figures"] = summary(runs, streamer.read_bytes_per_forward, report["bound_gbps"], audit)
        sixteen = report["figures"]["widths"].get("16", {}).get("over_one_token")
        if sixteen:
            report["goal"] = {"over_one_token": sixteen, "met": sixteen <= FLAT}
    finally:
        if cap is not None:
            cap.leave()
        for path in (checkpoint, folder) if not args.keep else ():
            shutil.rmtree(path, ignore_errors=True)
        report["environment"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
        report["failures"] = audit.failures
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "int4_flat.json").write_text(json.dumps(report, indent=1))
        if "figures" in report:
            (args.out / "int4_flat.md").write_text(markdown(report))
    print(markdown(report) if "figures" in report else json.dumps(report, indent=1), flush=True)
    return 1 if audit.failures or "figures" not in report else 0


def placed(checkpoint: Path, folder: Path, prefetch: int) -> torch.nn.Module:
    """The checkpoint quantized to int4 as it loads into ``folder`` (every weight on disk), its files evicted from
    the page cache and the loading's freed memory given back to the system."""
    if folder.exists():
        shutil.rmtree(folder)
    model = load_offloaded(checkpoint, max_memory={"cpu": 0}, offload_folder=folder, prefetch=prefetch,
                           quantize="int4")
    for path in (checkpoint / "model.safetensors", *folder.glob("*.dat")):
        evict(path)
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # the bf16 layers quantized one by one leave GBs in malloc's arenas
    return model


if __name__ == "__main__":
    raise SystemExit(main())
