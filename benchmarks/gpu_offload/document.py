"""The report: gpu_offload.json, .md and .png, written after every section, and earlier calls' reports merged."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_offload.checks import check_figures
from benchmarks.gpu_offload.end_to_end import is_rounding_level
from benchmarks.gpu_offload.in_loop import in_loop_markdown
from benchmarks.gpu_offload.projection import GRAPHED
from benchmarks.report import Goal, write_report
from benchmarks.shapes import GB
from benchmarks.timing import TIME_SPLIT


def environment(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    import accelerate
    import transformers

    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    info = {"command": " ".join(["python -m benchmarks.gpu_offload", *sys.argv[1:]]), "machine": platform.platform(),
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
    lines += ([""] + [Goal.from_json(goal).line() for goal in disk.get("goals", [])]
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
        lines += [""] + [Goal.from_json(goal).line() for goal in shape_result.get("goals", [])]
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
                busy_cell = "" if busy is None else f"{busy:.3f}"
                lines.append(f"| {budget} | {row['tree_seconds']:.3f} | {row['draft_forwards']:.0f} | "
                             f"{1e3 * row['seconds_per_draft_forward']:.2f} | {busy_cell} |")
            else:
                lines.append(f"| {budget} | {row['status']} | | | |")
        feed = draft.get("tree_feed")
        if feed and feed.get("status", "").startswith("FAILED"):
            lines += ["", f"One forward over a tree feed of {feed['rows']} nodes: **{feed['status']}**"]
        elif feed:
            replay = (f"{1e3 * feed['cuda_graph_seconds']:.2f} ms replayed as a CUDA graph" if "cuda_graph_seconds"
                      in feed else f"no CUDA graph ({feed.get('cuda_graph_error', 'not a CUDA device')})")
            lines += ["", f"One forward over a tree feed of {feed['rows']} nodes after {feed['context_tokens']} "
                      f"cached tokens: {1e3 * feed['dynamic_cache_seconds']:.2f} ms over the dynamic cache the search "
                      f"uses, {1e3 * feed['static_cache_seconds']:.2f} ms over a static cache, {replay} (logits within "
                      f"{feed['static_max_abs_difference']:.1e} of the dynamic forward's). The projection's "
                      f"`{GRAPHED}` rows swap the eager forward for the replay and keep the search's host time; "
                      "generate() has no such path."]
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
    lines += in_loop_markdown(report.get("in_loop"))
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
        lines += [""] + [Goal.from_json(goal).line() for goal in projection["ratios"]] + [""]
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
        for key in ("link", "draft", "end_to_end", "in_loop", "disk"):
            if earlier.get(key):
                report[key] = earlier[key]
    return report


def add_shape(report: dict[str, Any], shape_result: dict[str, Any]) -> None:
    """Adds a shape's forward figures, replacing earlier ones of the same shape, dtype and layer count."""
    def key(result: dict[str, Any]) -> tuple:
        return result["shape"]["name"], result["dtype"], result["layers_built"]

    report["shapes"] = [other for other in report["shapes"] if key(other) != key(shape_result)] + [shape_result]


def save(report: dict[str, Any], out: Path, tiny: bool) -> None:
    """Writes gpu_offload.json, .md and .png (the JSON by rename, so a killed run never leaves half a file), every
    figure checked first (:func:`check_figures`)."""
    report["notes"] = list(dict.fromkeys(report["notes"]))  # each section's process repeats the general ones
    check_figures(report, tiny)
    write_report(out, "gpu_offload", report, markdown(report))
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
