"""The read-ahead depth a default ``load_offloaded`` call picks, against hand-set depths, end to end.

The default target streamed from disk by the stream executor inside this process's memory cgroup (weights evicted
from the page cache, direct reads), the shipped draft in RAM: plain greedy ``generate()`` and SpecExec at one budget
on the same held-out prompts, once per read-ahead depth, in one run. ``default`` loads without a ``prefetch``
argument (what a user's call gets); a number is a hand-set depth. The target gets ``--weights-memory`` of its
weights' size in all (ring, activations, page cache), as ``ssd.py``'s end-to-end section gives it. The depths take
turns prompt by prompt (the target loaded again under the cap for each, after its warm-up), so that the disk's and
the machine's drift over the run falls on every depth alike: in a first version, which ran the depths one after
another, two runs of the same depth differed by 30%.

Goal: SpecExec with the default depth within 10% of the best hand-set depth (tokens/s), every output identical to
the first run's plain greedy output.

Run (root): flock /tmp/bench.lock .venv/bin/python -m benchmarks.ring_depth   (about 15 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from specexec_hf.models import target_cache_dir
from specexec_hf.tools.prompts import chat_inputs, load_prompts

from benchmarks import ssd
from benchmarks.figure_checks import positive
from benchmarks.memory_cap import evict
from benchmarks.offload import load_draft
from benchmarks.report import write_report

RESULTS = Path(__file__).resolve().parent / "results" / "ring_depth"
DEFAULT = "default"
WITHIN = 0.9  # the goal: the default depth's SpecExec tokens/s at least this share of the best hand-set depth's


def depth_value(text: str) -> int | str:
    """``--depths``: ``default`` (no ``prefetch`` argument), ``auto``, or a positive count of units read ahead."""
    return text if text == DEFAULT else ssd.prefetch_value(text)


def goals(runs: list[dict[str, Any]], specexec: str) -> dict[str, Any]:
    """The default depth's SpecExec tokens/s against the best hand-set depth's, and whether every output matched;
    ``figure_checks.FigureError`` for a tokens/s no measurement gives.

    Args:
        runs: One entry per depth run, each with its ``label`` and ``methods`` summary.
        specexec: The SpecExec method's name in the summaries.
    """
    speed = {run["label"]: positive(f"{specexec} tokens/s at {run['label']}",
                                    run["methods"][specexec]["tokens_per_second"]) for run in runs}
    default = [value for run, value in zip(runs, speed.values()) if run["depth"] == DEFAULT]
    hand_set = {label: value for run, (label, value) in zip(runs, speed.items()) if run["depth"] != DEFAULT}
    result: dict[str, Any] = {"all_outputs_identical": all(
        entry["all_equal_plain_greedy"] for run in runs for entry in run["methods"].values())}
    if default and hand_set:
        best = max(hand_set, key=hand_set.get)
        result.update(best_hand_set=best, default_over_best=min(default) / hand_set[best], goal=WITHIN)
        result["met"] = result["default_over_best"] >= WITHIN and result["all_outputs_identical"]
    return result


def markdown(report: dict[str, Any]) -> str:
    """The run as one table, a row per depth run, then the goal."""
    env = report["environment"]
    lines = ["# Read-ahead depth: the default against hand-set depths", "",
             f"{env['machine']} ({env['cpu']}); torch {env['torch']}; {env['threads']} thread(s); memory cap: "
             f"{env['cap']}. Command: `{env['command']}`", "",
             f"{report['prompts']} held-out prompts x {report['max_new_tokens']} new tokens, greedy; the target gets "
             f"{report['weights_memory']} of its weights' size in all (ring included).", "",
             "| run | units read ahead | ring MB | highest peak / cap | plain tok/s | SpecExec tok/s "
             "| SpecExec / plain | tokens per forward | = plain |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for run in report["runs"]:
        plain, tree = run["methods"]["plain generate"], run["methods"][report["specexec"]]
        peak = f"{run['peak_over_cap']:.2f}" if run.get("peak_over_cap") else "no cap"
        same = all(entry["all_equal_plain_greedy"] for entry in run["methods"].values())
        lines.append(f"| {run['label']} | {run['prefetch']} | {run['ring_bytes'] / 1e6:.0f} | {peak} | "
                     f"{plain['tokens_per_second']:.2f} | {tree['tokens_per_second']:.2f} | "
                     f"{tree['tokens_per_second'] / plain['tokens_per_second']:.2f}x | "
                     f"{tree['tokens_per_target_forward']:.2f} | {'yes' if same else 'NO'} |")
    goal = report.get("goals", {})
    if "default_over_best" in goal:
        lines += ["", f"**{report['specexec']}, default depth (the slower where listed twice) / best hand-set depth "
                      f"({goal['best_hand_set']}): {goal['default_over_best']:.3f}** (goal >= {WITHIN}); outputs "
                      f"identical: {goal['all_outputs_identical']}."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=depth_value, nargs="+", default=[DEFAULT, 4, 9, 14])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--budget", type=int, default=64, help="SpecExec's node budget")
    parser.add_argument("--weights-memory", type=float, default=ssd.WEIGHTS_MEMORY,
                        help="the memory the target gets above the process's own before loading, ring included, "
                             "as a share of its weights")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-cap", action="store_true", help="run without a memory cgroup (figures say so)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.cache_fraction, args.prefetch = args.weights_memory, args.depths  # what ssd.capped_run records
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cap, environment = ssd.capped_run(args, "ring_depth.py", argv)
    try:
        draft, tokenizer = load_draft("distilled")
        checkpoint = target_cache_dir()
        weights = checkpoint / "model.safetensors"
        prompts = [chat_inputs(tokenizer, prompt) for prompt in load_prompts("eval")[: args.prompts]]
        specexec = f"SpecExec budget {args.budget}"
        compared = {"plain generate": {},
                    specexec: {"assistant_model": draft, "speculator": "specexec", "budget": args.budget}}
        runs: list[dict[str, Any]] = [{"depth": depth, "label": f"{depth} (run {position + 1})", "rows": []}
                                      for position, depth in enumerate(args.depths)]
        reference: dict[int, list[int]] = {}  # each prompt's plain greedy output at the first depth
        for index, inputs in enumerate(prompts):
            for entry in runs:
                print(f"prompt {index}, read-ahead {entry['label']}", flush=True)
                evict(weights)
                depth = entry["depth"]
                with ssd.streamed_target(checkpoint, cap, None if depth == DEFAULT else depth,
                                         args.weights_memory) as (model, capped_entry):
                    figures: dict[str, Any] = {}
                    rows = ssd.measure_capped(model, cap, capped_entry, figures, weights, args.weights_memory,
                                              [inputs], compared, args.max_new_tokens)
                for row in rows:
                    row["prompt"] = index
                    reference.setdefault(index, row["tokens"])
                    row["equals_plain_greedy"] = row["tokens"] == reference[index]
                entry["rows"] += rows
                # The ring's figures, and the highest peak against its cap over the prompts.
                peak = figures.get("peak_bytes", 0) / figures["limit_bytes"] if figures.get("capped") else 0.0
                entry.update(prefetch=figures["prefetch"], ring_bytes=figures["ring_bytes"],
                             peak_over_cap=max(peak, entry.get("peak_over_cap", 0.0)))
        for entry in runs:
            entry["methods"] = ssd.summarize(entry["rows"])
    finally:
        if cap is not None:
            cap.leave()
    report = {"environment": environment, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "weights_memory": args.weights_memory, "specexec": specexec, "runs": runs,
              "goals": goals(runs, specexec)}
    write_report(args.out, "ring_depth", report, markdown(report), indent=1)
    print(markdown(report), flush=True)
    return 0 if report["goals"].get("all_outputs_identical") else 1


if __name__ == "__main__":
    raise SystemExit(main())
