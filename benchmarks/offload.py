"""SmolLM2-135M-Instruct fully offloaded to disk, draft in RAM: forward cost and generation speed, side by side.

1. Target forward time against the number of tokens scored, for accelerate's hooks and for the streaming
   executor (``load_offloaded(..., executor="stream")``).
2. Tokens/s of plain greedy generate(), Hugging Face assisted generation (same draft) and SpecExec, on the same
   prompts with each executor; every output is checked against the in-memory target's greedy output.

The offloaded target keeps no weight in RAM (``max_memory={"cpu": 0}``) and reads the whole checkpoint on every
forward, from the kernel's page cache once it has been read once (``disk_read`` in the results times one read
right after evicting the file and one cached read, to show what the disk itself would cost).
Writes JSON and Markdown to benchmarks/results/offload_executors/. Not a test: the numbers depend on the machine
and its load.
Run: .venv/bin/python -m benchmarks.offload [--prompts 3] [--max-new-tokens 32] [--budgets 32 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

import specexec_hf
from specexec_hf.models import target_cache_dir
from specexec_hf.offload import load_offloaded
from specexec_hf.tools.prompts import chat_inputs, load_prompts

from benchmarks.memory_cap import evict
from benchmarks.report import write_report
from benchmarks.timing import median_forward_seconds, timed_generate

RESULTS = Path(__file__).resolve().parent / "results" / "offload_executors"
EXECUTORS = ("accelerate", "stream")


def load_draft(spec: str):
    """``(draft, tokenizer)``.

    Args:
        spec: ``distilled`` (the shipped draft), ``file:PATH`` (an exported draft), ``target`` (the target
            itself in RAM: an oracle draft, for an upper bound on acceptance) or ``truncated:N`` (the target's first
            N layers).
    """
    if spec == "distilled":
        _, draft, tokenizer = specexec_hf.load_default_pair()
        return draft, tokenizer
    if spec == "target":
        return specexec_hf.load_default_target()
    if spec.startswith("file:"):  # a draft exported by `specexec-hf distill`, next to its .json metadata
        return exported_draft(Path(spec.removeprefix("file:")))
    kind, _, layers = spec.partition(":")
    if kind != "truncated" or not layers.isdigit():
        raise SystemExit(f"--draft must be 'distilled', 'file:PATH', 'target' or 'truncated:N', got {spec!r}")
    target, tokenizer = specexec_hf.load_default_target()
    config = type(target.config).from_dict(target.config.to_dict())
    config.num_hidden_layers = int(layers)
    config.layer_types = None
    draft = type(target)(config).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    return draft, tokenizer


def exported_draft(weights: Path):
    """``(draft, tokenizer)`` from an exported ``draft.safetensors`` and its ``draft.json``, as shipped drafts load."""
    from safetensors.torch import load_file

    from specexec_hf.models.drafts import build_draft, draft_config_from_target

    target, tokenizer = specexec_hf.load_default_target()
    meta = json.loads(weights.with_suffix(".json").read_text())
    config = draft_config_from_target(target.config, meta["num_hidden_layers"], meta.get("intermediate_size"))
    own = {name: tensor.to(target.dtype) for name, tensor in load_file(weights).items()}
    return build_draft(target, config, own), tokenizer


def disk_read_seconds(path: Path) -> dict[str, float]:
    """Seconds to read ``path`` right after evicting it from the page cache, then again from the cache."""
    evict(path)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        result: dict[str, float] = {}
        for state in ("evicted", "cached"):
            started, offset = time.perf_counter(), 0
            while chunk := os.pread(descriptor, 16 << 20, offset):
                offset += len(chunk)
            result[state] = time.perf_counter() - started
        result["bytes"] = offset
        return result
    finally:
        os.close(descriptor)


def specexec_knobs(args) -> dict[str, int | None]:
    """The SpecExec knobs set on the command line (``None``: the library's default)."""
    return {"expand_per_forward": args.expand_per_forward, "max_draft_forwards": args.max_draft_forwards}


def methods(draft, args) -> dict[str, dict]:
    """``generate()`` keyword arguments of each decoding method compared."""
    specexec = dict(assistant_model=draft, speculator="specexec", **specexec_knobs(args))
    compared = {"plain generate": {}, "HF assisted": {"assistant_model": draft}}
    for budget in args.budgets:
        compared[f"SpecExec budget {budget}"] = dict(specexec, budget=budget)
    return compared


def generation_or_error(model, inputs: dict, max_new_tokens: int, kwargs: dict) -> dict:
    """:func:`~benchmarks.timing.timed_generate`'s row, or the error of a failing method (recorded: transformers'
    assisted generation fails on an all-meta accelerate model)."""
    try:
        return timed_generate(model, inputs, max_new_tokens, **kwargs)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def generation_rows(models: dict, draft, tokenizer, args) -> list[dict]:
    """One row per prompt, executor and method, each output compared with the in-memory target's greedy one."""
    reference, _ = specexec_hf.load_default_target()
    compared = methods(draft, args)
    prompts = [chat_inputs(tokenizer, prompt) for prompt in load_prompts("eval")[: args.prompts]]
    timed_generate(reference, prompts[0], 4)  # warm-ups: lazy initialisations, first-touch page faults
    for model in models.values():
        for kwargs in compared.values():
            generation_or_error(model, prompts[0], 4, kwargs)
    rows = []
    for index, inputs in enumerate(prompts):
        in_memory = timed_generate(reference, inputs, args.max_new_tokens)
        rows.append({**in_memory, "prompt": index, "executor": "in memory", "method": "plain generate"})
        for executor, model in models.items():
            for method, kwargs in compared.items():
                row = {**generation_or_error(model, inputs, args.max_new_tokens, kwargs), "prompt": index}
                row.update(executor=executor, method=method)
                if "tokens" in row:
                    row["matches_in_memory_greedy"] = row["tokens"] == in_memory["tokens"]
                    print(f"  prompt {index} {executor:>10} {method:<20} "
                          f"{len(row['tokens']) / row['seconds']:6.2f} tok/s", flush=True)
                rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per ``"executor | method"``: tokens/s over all prompts together, mean tokens per target forward, matches."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(f"{row['executor']} | {row['method']}", []).append(row)
    summary = {}
    for key, group in groups.items():
        failed = [row["error"] for row in group if "error" in row]
        if failed:
            summary[key] = {"error": failed[0]}
            continue
        entry = {
            "tokens_per_second": sum(len(row["tokens"]) for row in group) / sum(row["seconds"] for row in group),
            "all_match_in_memory_greedy": all(row.get("matches_in_memory_greedy", True) for row in group),
        }
        if "tokens_per_target_forward" in group[0]:
            entry["tokens_per_target_forward"] = statistics.mean(row["tokens_per_target_forward"] for row in group)
            entry["draft_share"] = sum(row["tree_seconds"] for row in group) / sum(row["seconds"] for row in group)
        summary[key] = entry
    return summary


def ratios(forward: dict, generation: dict, budgets: list[int]) -> dict[str, float]:
    """The issue's goals: stream vs accelerate per forward; best SpecExec vs plain and HF assisted generation."""
    result = {}
    for tokens, row in forward.items():
        if set(EXECUTORS) <= set(row):
            speedup = row["accelerate"] / row["stream"]
            result[f"forward over {tokens} tokens, stream executor vs accelerate hooks"] = speedup
    speed = {key: entry.get("tokens_per_second") for key, entry in generation.items()}

    def best_specexec(executor: str) -> tuple[int, float | None]:
        best = max(budgets, key=lambda budget: speed.get(f"{executor} | SpecExec budget {budget}") or 0)
        return best, speed.get(f"{executor} | SpecExec budget {best}")

    for executor in EXECUTORS:
        budget, specexec = best_specexec(executor)
        for method in ("plain generate", "HF assisted"):
            other = speed.get(f"{executor} | {method}")
            if specexec and other:
                result[f"{executor}: SpecExec (budget {budget}) vs {method}"] = specexec / other
    budget, specexec = best_specexec("stream")
    plain = speed.get("accelerate | plain generate")
    if specexec and plain:
        result[f"SpecExec (stream, budget {budget}) vs plain generate (accelerate hooks)"] = specexec / plain
    return result


def markdown(report: dict) -> str:
    """The report as Markdown tables."""
    disk = report["disk_read"]
    lines = [
        "# Offloaded target: SmolLM2-135M-Instruct fully on disk, draft in RAM",
        "",
        f"{report['machine']}; torch {report['torch']}, transformers {report['transformers']}; {report['threads']} "
        f"intra-op thread(s), prefetch {report['prefetch']}; load average {report['load_before']} before, "
        f"{report['load_after']} after. Draft: {report['draft']}; SpecExec knobs {report['specexec_knobs']}. "
        f"{report['prompts']} eval prompts, {report['max_new_tokens']} new tokens each.",
        "",
        f"Checkpoint read: {disk['bytes'] / 1e6:.0f} MB in {disk['evicted']:.3f} s right after evicting it from the "
        f"page cache, {disk['cached']:.3f} s cached. Every forward below re-reads the weights (from the page cache).",
    ]
    if report["forward_seconds"]:
        lines += [
            "",
            "## Target forward time (s, median) against tokens scored",
            "",
            "| tokens | accelerate hooks | stream executor | stream speedup |",
            "|---:|---:|---:|---:|",
        ]
    for tokens, row in report["forward_seconds"].items():
        accelerate, stream = row.get("accelerate", float("nan")), row.get("stream", float("nan"))
        lines.append(f"| {tokens} | {accelerate:.3f} | {stream:.3f} | {accelerate / stream:.2f}x |")
    lines += [
        "",
        "## Greedy generation, all prompts together",
        "",
        "| executor | method | tokens/s | tokens per target forward | draft share of time | = in-memory greedy |",
        "|---|---|---:|---:|---:|---|",
    ]
    for key, entry in report["generation"].items():
        executor, method = key.split(" | ")
        if "error" in entry:
            lines.append(f"| {executor} | {method} | fails: {entry['error'][:100]} | | | |")
            continue
        per_forward = f"{entry['tokens_per_target_forward']:.2f}" if "tokens_per_target_forward" in entry else ""
        share = f"{100 * entry['draft_share']:.0f}%" if "draft_share" in entry else ""
        lines.append(
            f"| {executor} | {method} | {entry['tokens_per_second']:.2f} | {per_forward} | {share} | "
            f"{entry['all_match_in_memory_greedy']} |"
        )
    lines += ["", "## Ratios", ""] + [f"- {name}: {value:.2f}x" for name, value in report["ratios"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--budgets", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--expand-per-forward", type=int, default=None, help="SpecExec knob (default: the library's)")
    parser.add_argument("--max-draft-forwards", type=int, default=None, help="SpecExec knob (default: the library's)")
    parser.add_argument("--token-counts", type=int, nargs="*", default=[1, 16, 64, 256, 1024], help="none: skip")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--executors", nargs="+", choices=EXECUTORS, default=list(EXECUTORS))
    parser.add_argument("--draft", default="distilled",
                        help="'distilled', 'file:PATH', 'target' (oracle) or 'truncated:N'")
    parser.add_argument("--name", default="offload", help="results file stem")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    checkpoint = target_cache_dir()
    disk_read = disk_read_seconds(checkpoint / "model.safetensors")
    draft, tokenizer = load_draft(args.draft)
    # The safetensors checkpoint is read in place: no offload_folder, and no weight kept in RAM.
    models = {
        executor: load_offloaded(checkpoint, max_memory={"cpu": 0}, executor=executor, prefetch=args.prefetch)
        for executor in args.executors
    }
    forward = {}
    for tokens in args.token_counts:
        forward[str(tokens)] = {name: median_forward_seconds(model, tokens, args.repeats)
                                for name, model in models.items()}
        print(f"forward over {tokens:>5} tokens: {forward[str(tokens)]}", flush=True)
    rows = generation_rows(models, draft, tokenizer, args)
    generation = summarize(rows)
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": args.threads,
        "prefetch": args.prefetch,
        "draft": args.draft,
        "specexec_knobs": specexec_knobs(args),
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "load_before": [round(load, 2) for load in load_before],
        "load_after": [round(load, 2) for load in os.getloadavg()],
        "disk_read": disk_read,
        "forward_seconds": forward,
        "generation": generation,
        "ratios": ratios(forward, generation, args.budgets),
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_report(RESULTS, args.name, report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
