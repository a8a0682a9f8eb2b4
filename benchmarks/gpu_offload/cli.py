"""The command line of ``python -m benchmarks.gpu_offload`` (see the package): the sections run in order, the report
written after each."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import math
import os
import tempfile
from pathlib import Path

import torch

from specexec_hf.offload.quantize import QUANTIZED_WEIGHTS

from benchmarks import gpu_offload
from benchmarks.figure_checks import MEASURED, STAND_IN, FigureAudit
from benchmarks.gpu_offload.disk import DISK_SHAPE, disk_folders, disk_tier
from benchmarks.gpu_offload.document import add_shape, environment, markdown, merged_reports, run_section, save
from benchmarks.gpu_offload.draft import draft_timing
from benchmarks.gpu_offload.end_to_end import end_to_end, end_to_end_pair, failing_mismatches
from benchmarks.gpu_offload.forward import largest_bf16_shape, measure_shape
from benchmarks.gpu_offload.in_loop import SECTION as IN_LOOP
from benchmarks.gpu_offload.in_loop import in_loop
from benchmarks.gpu_offload.link import link_bandwidth
from benchmarks.shapes import DRAFT_SHAPES, SHAPES, LlamaShape
from benchmarks.timing import Deadline

SECTIONS = ("link", "forward", "draft", "end_to_end", "in_loop", "largest", "disk")

EXIT_FIGURES_FAILED = 4  # the exit status when every section ran but a figure failed its checks (figure_checks.py)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=gpu_offload.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--in-loop-budgets", type=int, nargs="+", default=[256, 1024],
                        help="in_loop: the SpecExec budgets run in the loop")
    parser.add_argument("--in-loop-int4-layers", type=int, default=4,
                        help="in_loop: layers built of the Llama-3-70B shape with int4 layers")
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
        args.in_loop_budgets = [16]
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
              "end_to_end": "end to end", "in_loop": IN_LOOP}

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

    def in_loop_section() -> None:
        if not math.isfinite(link_gbps()):  # the ideal's bound: measured here when no earlier section did
            report.update(link=link_bandwidth(device, args.link_mib << 20, args.repeats + 2))
        pair = end_to_end_pair(pair_kind, args.prompts, workdir, report)
        big = SHAPES["tiny"] if args.tiny else SHAPES["llama-8b"]
        int4 = (SHAPES["tiny"], SHAPES["tiny"].layers) if args.tiny else (SHAPES["llama-70b"], args.in_loop_int4_layers)
        audit = FigureAudit(STAND_IN if args.tiny else MEASURED)
        try:
            report["in_loop"] = in_loop(pair, [(big, big.layers, None), (*int4, "int4")], args.in_loop_budgets,
                                        args.max_new_tokens, link_gbps(), device, deadline, workdir, audit)
            report["errors"] += report["in_loop"]["errors"]
        finally:
            report["figure_failures"] += audit.failures

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
        "in_loop": in_loop_section,
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

