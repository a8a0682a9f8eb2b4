"""A model bigger than RAM, streamed from the SSD: the disk's bound, forward cost, and SpecExec end to end.

Every section runs inside this process's own memory cgroup (``memory_cap.py``: page cache included, root and the
v1 memory controller needed), so no executor can keep the weights cached between forwards: the case of a model
bigger than RAM. Each section rewrites ``ssd.json`` / ``ssd.md`` / ``ssd.png`` as it finishes.

1. **bound**: the disk's direct-read bandwidth over the default target's weight file, read cold with the
   library's direct reader (the bytes a forward must stream, at the best rate the disk gives them).
2. **forward**: seconds of one forward against the tokens scored (1, 4, 16, 64, 256), weights streamed from disk
   by the stream executor, for the default target and random-weight shapes written to disk (SmolLM2-1.7B and
   larger, in bf16); as a share of the bound, and the flat region (the most tokens whose forward stays within 1.3x
   the 1-token forward). The memory left for caching weights is ``--cache-fraction`` of the shape's weights.
3. **end to end**: the default pair, target streamed from disk under the same cap, draft in RAM, greedy on
   held-out prompts: plain ``generate()``, HF assisted generation (its defaults and constant chains) and SpecExec at
   fixed budgets and ``"auto"``; tokens/s, tokens per target forward, every output checked against plain greedy.
4. **projection**: tokens/s for the larger shapes from measured parts only: their forward curve (section 2) and the
   real pair's tokens per forward and draft seconds per step (section 3).

Not a test: the figures depend on the disk, the CPU and the load.
Run (root): .venv/bin/python benchmarks/ssd.py [--prompts 16] [--max-new-tokens 64] [--shapes smollm2-1.7b]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_offload import LlamaShape, interpolate  # noqa: E402  (sibling scripts, not a package)
from loaders import disk_bound  # noqa: E402
from memory_cap import MemoryCap, evict  # noqa: E402
from offload import disk_read_seconds, forward_seconds, load_draft  # noqa: E402

import specexec_hf  # noqa: E402
from specexec_hf.models import target_cache_dir  # noqa: E402
from specexec_hf.offload import layer_streamer, load_offloaded  # noqa: E402
from specexec_hf.tools.prompts import chat_inputs, load_prompts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "ssd"
GB = 1e9
FLAT = 1.3  # a forward within this factor of the 1-token forward counts as flat

# Public architectures' dimensions (their config.json files); the weights are random.
SHAPES = {
    "smollm2-1.7b": LlamaShape("SmolLM2-1.7B", 2048, 8192, 24, 32, 32, 49152, tied=True),
    "llama-8b": LlamaShape("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256),
}


# Random-weight checkpoints, written without holding the model in memory ------------------------------------------


def write_random_checkpoint(shape: LlamaShape, dtype: torch.dtype, directory: Path) -> Path:
    """A safetensors checkpoint of ``shape`` with random weights (std 0.02; norms at 1), one tensor in memory at a
    time, so that a shape bigger than the memory cap can be written under it. Reused when already there."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = directory / "model.safetensors"
    config = shape.config()
    config.torch_dtype = dtype
    if weights.is_file() and (directory / "config.json").is_file():
        return directory
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config).to(dtype)
    names = {name: tensor for name, tensor in skeleton.state_dict().items() if not name.endswith("rotary_emb.inv_freq")}
    if shape.tied:
        names.pop("lm_head.weight", None)
    header, offset = {}, 0
    dtype_name = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]
    for name, tensor in names.items():
        header[name] = {"dtype": dtype_name, "shape": list(tensor.shape), "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    pool = (torch.randn(4_194_301, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)  # a prime length
    partial = weights.with_suffix(".partial")
    with open(partial, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little") + encoded)
        for name, tensor in names.items():
            if tensor.dim() == 1:
                handle.write(torch.ones(tensor.shape, dtype=dtype).view(torch.uint8).numpy().tobytes())
                continue
            left = tensor.numel()
            while left:
                chunk = pool[: min(left, pool.numel())]
                handle.write(chunk.view(torch.uint8).numpy().tobytes())
                left -= chunk.numel()
    partial.rename(weights)
    config.save_pretrained(directory)
    return directory


# Sections --------------------------------------------------------------------------------------------------------


def bound(weights: Path, repeats: int) -> dict[str, Any]:
    """The disk's direct-read bandwidth over ``weights`` (best of ``repeats`` cold reads by the executor's reader,
    :func:`loaders.disk_bound`), and one cold read of the same file through the page cache for comparison."""
    direct = [disk_bound(weights)["gb_per_s"] for _ in range(repeats)]
    buffered = disk_read_seconds(weights)
    evict(weights)
    return {"file": str(weights), "bytes": buffered["bytes"], "direct_gbps": max(direct), "direct_gbps_runs": direct,
            "buffered_cold_gbps": buffered["bytes"] / buffered["evicted"] / GB}


def capped(cap: MemoryCap | None, weights_bytes: int, fraction: float) -> dict[str, Any]:
    """Caps the process at what it uses now plus ``fraction`` of the weights; returns the cap's figures."""
    if cap is None:
        return {"capped": False}
    gc.collect()
    base = cap.usage()
    limit = base + int(fraction * weights_bytes)
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
def streamed_target(checkpoint: Path, cap: MemoryCap | None, prefetch: int) -> Iterator[torch.nn.Module]:
    """The checkpoint's model with every weight on disk, run by the stream executor; on exit the model is freed
    and the cap lifted."""
    model = load_offloaded(checkpoint, max_memory={"cpu": 0}, executor="stream", prefetch=prefetch)
    try:
        yield model
    finally:
        layer_streamer(model).close()
        del model
        gc.collect()
        if cap is not None:
            cap.limit(None)


def forward_curve(
    checkpoint: Path, label: str, token_counts: list[int], repeats: int, cap: MemoryCap | None, args, bound_gbps: float
) -> dict[str, Any]:
    """Forward seconds against tokens scored, the whole model streamed from disk under the cap."""
    weights = checkpoint / "model.safetensors"
    with streamed_target(checkpoint, cap, args.prefetch) as model:
        streamed = layer_streamer(model).streamed_bytes_per_forward
        evict(weights)
        entry: dict[str, Any] = {"shape": label, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                                 "streamed_bytes": streamed}
        entry.update(capped(cap, weights.stat().st_size, args.cache_fraction))
        seconds = {}
        for tokens in token_counts:
            seconds[str(tokens)] = forward_seconds(model, tokens, repeats)
            print(f"  {label}: forward over {tokens} tokens {seconds[str(tokens)]:.3f} s", flush=True)
        cap_figures(cap, entry)
    entry["seconds"] = seconds
    entry["share_of_bound"] = {n: streamed / s / GB / bound_gbps for n, s in seconds.items()} if bound_gbps else {}
    one = seconds.get("1")
    flat = [int(n) for n, s in seconds.items() if one and s <= FLAT * one]
    entry["flat_tokens"] = max(flat, default=None)
    entry["over_one_token"] = {n: s / one for n, s in seconds.items()} if one else {}
    return entry


def methods(draft, args) -> dict[str, dict]:
    """``generate()`` keyword arguments of each decoding method compared end to end."""
    compared: dict[str, dict] = {"plain generate": {}, "HF assisted (defaults)": {"assistant_model": draft}}
    for tokens in args.assistant_tokens:
        compared[f"HF assisted ({tokens} tokens)"] = {
            "assistant_model": draft, "num_assistant_tokens": tokens, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0}
    for budget in args.budgets:
        compared[f"SpecExec budget {budget}"] = {"assistant_model": draft, "speculator": "specexec", "budget": budget}
    return compared


def timed(model, inputs: dict, max_new_tokens: int, kwargs: dict) -> dict[str, Any]:
    """One greedy ``generate()``: its tokens, seconds, target forwards (calls of the decoder stack, which every
    method's target forward runs once) and SpecExec's draft seconds."""
    stats = specexec_hf.SpecExecStats() if kwargs.get("speculator") else None
    forwards = [0]
    hook = model.get_decoder().register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        started = time.perf_counter()
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **kwargs,
                                **({"specexec_stats": stats} if stats else {}))
        seconds = time.perf_counter() - started
    finally:
        hook.remove()
    row: dict[str, Any] = {"seconds": seconds, "tokens": output[0, inputs["input_ids"].shape[1]:].tolist(),
                           "target_forwards": forwards[0]}
    if stats is not None:
        row["draft_seconds"] = stats.draft_seconds
    return row


def end_to_end(args, cap: MemoryCap | None) -> dict[str, Any]:
    """The default pair, target streamed from disk under the cap: every method on the same prompts."""
    draft, tokenizer = load_draft("distilled")
    checkpoint = target_cache_dir()
    weights = checkpoint / "model.safetensors"
    compared = methods(draft, args)
    prompts = [chat_inputs(tokenizer, prompt) for prompt in load_prompts("eval")[: args.prompts]]
    entry: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    with streamed_target(checkpoint, cap, args.prefetch) as model:
        for kwargs in compared.values():  # warm-ups: lazy initialisations, the auto budget's profile
            model.generate(**prompts[0], max_new_tokens=4, do_sample=False, **kwargs)
        evict(weights)
        entry.update(capped(cap, weights.stat().st_size, args.cache_fraction))
        rows = []
        for index, inputs in enumerate(prompts):
            reference = None
            for method, kwargs in compared.items():
                row = {"prompt": index, "method": method, **timed(model, inputs, args.max_new_tokens, kwargs)}
                reference = reference or row["tokens"]
                row["equals_plain_greedy"] = row["tokens"] == reference
                rows.append(row)
                print(f"  prompt {index} {method:<26} {len(row['tokens']) / row['seconds']:6.2f} tok/s"
                      f"{'' if row['equals_plain_greedy'] else '  DIFFERS'}", flush=True)
        cap_figures(cap, entry)
    entry["methods"] = summarize(rows)
    entry["rows"] = rows
    return entry


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
        if all("draft_seconds" in row for row in group):
            entry["draft_seconds_per_step"] = (sum(row["draft_seconds"] for row in group)
                                               / sum(row["target_forwards"] for row in group))
        summary[method] = entry
    return summary


def goals(report: dict[str, Any]) -> dict[str, float]:
    """The issue's end-to-end ratios, from the end-to-end section."""
    speed = {name: entry["tokens_per_second"] for name, entry in report.get("end_to_end", {}).get("methods", {}).items()}
    fixed = {name: value for name, value in speed.items() if name.startswith("SpecExec budget") and "auto" not in name}
    result: dict[str, float] = {}
    if not fixed:
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
    methods_ = report["end_to_end"]["methods"]
    per_forward = methods_[best_name].get("tokens_per_target_forward")
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
    return {"shape": curve["shape"], "tokens_per_second": rows,
            "best_specexec_vs_plain": (max((v for k, v in rows.items() if k != "plain generate"), default=math.nan)
                                       / rows["plain generate"]) if "plain generate" in rows else None}


# Report ----------------------------------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown tables."""
    env = report["environment"]
    lines = ["# A model bigger than RAM, streamed from the SSD", "",
             f"{env['machine']}; torch {env['torch']}, transformers {env['transformers']}; {env['threads']} thread(s); "
             f"memory cap: {env['cap']}; cache fraction {env['cache_fraction']}; load average {env['load_before']} "
             f"before. Command: `{env['command']}`", ""]
    if report.get("bound"):
        b = report["bound"]
        lines += [f"**Bound:** {b['bytes'] / 1e6:.0f} MB read cold: direct {b['direct_gbps']:.2f} GB/s (runs "
                  f"{', '.join(f'{x:.2f}' for x in b['direct_gbps_runs'])}), buffered {b['buffered_cold_gbps']:.2f} GB/s.", ""]
    if report.get("forward"):
        counts = sorted({int(n) for curve in report["forward"] for n in curve["seconds"]})
        lines += ["## Forward time against tokens scored, streamed from disk", "",
                  "| shape | dtype | cap | " + " | ".join(f"{n} tok (s, share of bound)" for n in counts)
                  + " | flat up to (<= 1.3x) | 64 / 1 |", "|---|---|---|" + "---:|" * (len(counts) + 2)]
        for curve in report["forward"]:
            cells = []
            for n in counts:
                s = curve["seconds"].get(str(n))
                share = curve["share_of_bound"].get(str(n))
                cells.append("" if s is None else f"{s:.3f} ({share:.0%})" if share else f"{s:.3f}")
            cap = f"{curve['limit_bytes'] / 1e6:.0f} MB, weights {curve['weights_over_limit']:.1f}x" if curve.get(
                "capped") else "none"
            ratio = curve["over_one_token"].get("64")
            lines.append(f"| {curve['shape']} | {curve['dtype']} | {cap} | " + " | ".join(cells)
                         + f" | {curve['flat_tokens']} | {'' if ratio is None else f'{ratio:.2f}x'} |")
        lines.append("")
    e2e = report.get("end_to_end")
    if e2e and "methods" in e2e:
        cap = (f"capped at {e2e['limit_bytes'] / 1e6:.0f} MB (weights {e2e['weights_over_limit']:.1f}x the cap), peak "
               f"{e2e.get('peak_bytes', 0) / 1e6:.0f} MB" if e2e.get("capped") else "no cap")
        lines += ["## End to end: default pair, target streamed from disk, greedy", "",
                  f"{e2e['prompts']} held-out prompts x {e2e['max_new_tokens']} new tokens; {cap}.", "",
                  "| method | tokens/s | median per prompt | tokens per target forward | draft s per step | = plain |",
                  "|---|---:|---:|---:|---:|---|"]
        for method, m in e2e["methods"].items():
            per = m.get("tokens_per_target_forward")
            draft = m.get("draft_seconds_per_step")
            lines.append(f"| {method} | {m['tokens_per_second']:.2f} | {m['median_prompt_tokens_per_second']:.2f} | "
                         f"{'' if per is None else f'{per:.2f}'} | {'' if draft is None else f'{draft:.3f}'} | "
                         f"{m['all_equal_plain_greedy']} |")
        lines += ["", "## Goals", ""] + [f"- {name}: {value:.2f}" for name, value in report.get("goals", {}).items()]
        lines.append("")
    if report.get("projections"):
        lines += ["## Projected tokens/s for larger shapes (measured forward curve + the real pair's steps)", ""]
        for projection in report["projections"]:
            cells = ", ".join(f"{name} {value:.2f}" for name, value in projection["tokens_per_second"].items())
            lines.append(f"- {projection['shape']}: {cells}")
        lines.append("")
    lines += [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Forward seconds over the 1-token forward against tokens scored, one line per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for curve in report.get("forward", []):
        points = sorted((int(n), r) for n, r in curve["over_one_token"].items())
        axis.plot([n for n, _ in points], [r for _, r in points], marker="o", label=f"{curve['shape']} {curve['dtype']}")
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
    out.mkdir(parents=True, exist_ok=True)
    (out / "ssd.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "ssd.md").write_text(markdown(report))
    if report.get("forward"):
        plot(report, out / "ssd.png")


def run_section(report: dict[str, Any], name: str, out: Path, work: Callable[[], Any]) -> Any:
    """Runs one section and saves; an error is recorded (and fails the run) instead of losing the others."""
    try:
        return work()
    except Exception as error:
        report["notes"].append(f"{name}: error: {type(error).__name__}: {error}")
        report.setdefault("errors", []).append({"section": name, "traceback": traceback.format_exc()})
        print(traceback.format_exc(), flush=True)
        return None
    finally:
        save(report, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", nargs="+", default=["8", "16", "32", "64", "128", "256", "auto"])
    parser.add_argument("--assistant-tokens", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--token-counts", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=["smollm2-1.7b"])
    parser.add_argument("--shape-dir", type=Path, default=Path(tempfile.gettempdir()) / "specexec-ssd-shapes",
                        help="where the random-weight checkpoints are written (kept for the next run)")
    parser.add_argument("--cache-fraction", type=float, default=1 / 3,
                        help="memory above the process's own left for caching weights, as a share of the weights")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--sections", nargs="+", default=["bound", "forward", "end_to_end"],
                        choices=["bound", "forward", "end_to_end"])
    parser.add_argument("--no-cap", action="store_true", help="run without a memory cgroup (figures say so)")
    args = parser.parse_args(argv)
    args.budgets = [budget if budget == "auto" else int(budget) for budget in args.budgets]
    torch.set_num_threads(args.threads)
    cap = None
    if not args.no_cap:
        reason = MemoryCap.unavailable()
        if reason:
            parser.error(f"{reason}: run as root on a cgroup v1 machine, or pass --no-cap")
        cap = MemoryCap(f"specexec-ssd-{os.getpid()}")
        cap.join()
    report: dict[str, Any] = {"environment": {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": args.threads, "cap": "cgroup v1" if cap else "none",
        "cache_fraction": args.cache_fraction, "load_before": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join([".venv/bin/python", "benchmarks/ssd.py", *(argv if argv is not None else sys.argv[1:])]),
    }, "notes": [], "forward": [], "projections": []}
    try:
        default_weights = target_cache_dir() / "model.safetensors"
        specexec_hf.load_default_target()  # converts the GGUF on first use
        bound_gbps = 0.0
        if "bound" in args.sections:
            report["bound"] = run_section(report, "bound", args.out, lambda: bound(default_weights, args.repeats))
            bound_gbps = (report["bound"] or {}).get("direct_gbps", 0.0)
        if "forward" in args.sections:
            checkpoints = {"SmolLM2-135M (default target)": target_cache_dir()}
            for key in args.shapes:
                checkpoints[SHAPES[key].name] = write_random_checkpoint(
                    SHAPES[key], torch.bfloat16, args.shape_dir / f"{key}-bf16")
                # Its dirty pages are charged to this process's group: evicted, they do not inflate the next cap.
                evict(checkpoints[SHAPES[key].name] / "model.safetensors")
            for label, checkpoint in checkpoints.items():
                curve = run_section(report, f"forward {label}", args.out, lambda: forward_curve(
                    checkpoint, label, args.token_counts, args.repeats, cap, args, bound_gbps))
                if curve:
                    report["forward"].append(curve)
        if "end_to_end" in args.sections:
            report["end_to_end"] = run_section(report, "end to end", args.out, lambda: end_to_end(args, cap))
            report["goals"] = goals(report)
            if report["end_to_end"]:
                report["projections"] = [project(curve, report["end_to_end"]) for curve in report["forward"]
                                         if not curve["shape"].startswith("SmolLM2-135M")]
    finally:
        if cap is not None:
            cap.leave()
        report["environment"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
        save(report, args.out)
    print(markdown(report), flush=True)
    differs = [name for name, entry in (report.get("end_to_end") or {}).get("methods", {}).items()
               if not entry["all_equal_plain_greedy"]]
    if differs:
        print(f"outputs differ from plain greedy: {differs}", flush=True)
    return 1 if report.get("errors") or differs else 0


if __name__ == "__main__":
    raise SystemExit(main())
