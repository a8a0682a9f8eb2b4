"""Sequoia as a tree policy, at equal budget, on the default pair: tokens per target forward.

Per budget, over the same held-out chat prompts (greedy): SpecExec's best-first tree (the default, with its online
acceptance map), a SpecInfer-style tree (k draft beams merged at the root, at each ``--static-max-depth``), Sequoia's
static tree for the fixed geometric prior vector (``learn=False``) and Sequoia with the vector learnt online (one
policy object carried from prompt to prompt, as SpecExec's learnt state is). With ``--budgets ... auto``, also
SpecExec with ``budget="auto"`` beside Sequoia online sizing its own trees from the same measured forward-time
profile (Sequoia's hardware-aware size and depth), where tokens/s is the figure that counts. Every method first decodes
``--warmup-prompts`` calibration prompts unmeasured, so the learning ones are measured after some learning.
Greedy outputs are checked against plain generate(). Writes JSON and Markdown to
benchmarks/results/sequoia_online/.

Run: flock /tmp/bench.lock .venv/bin/python -m benchmarks.sequoia_online [--prompts 4] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

import specexec_hf
from specexec_hf.core.search import SearchPolicy, grow_tree
from specexec_hf.core.static_trees import SequoiaSearch, SpecInferSearch
from specexec_hf.hf.learnt_state import LearntState
from specexec_hf.tools.bench import pick_prompts
from specexec_hf.tools.prompts import chat_inputs

from benchmarks.report import table, write_report

RESULTS = Path(__file__).resolve().parent / "results" / "sequoia_online"


def policies(static_depths: list[int], budget: int | str) -> dict[str, tuple[SearchPolicy, int | None]]:
    """Per method, a fresh policy and the depth cap it runs with (``None``: the library's default)."""
    methods: dict[str, tuple[SearchPolicy, int | None]] = {"specexec best-first": (grow_tree, None)}
    if budget == "auto":
        return {**methods, "sequoia online, sized by cost": (SequoiaSearch(), None)}
    for depth in static_depths:
        methods[f"specinfer-style (depth {depth})"] = (SpecInferSearch(), depth)
    for depth in static_depths:
        methods[f"sequoia prior (depth {depth})"] = (SequoiaSearch(learn=False), depth)
        methods[f"sequoia online (depth {depth})"] = (SequoiaSearch(), depth)
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--warmup-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--budgets", nargs="+", default=["16", "64"], help="integers, or auto")
    parser.add_argument("--static-max-depth", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.time()
    target, draft, tokenizer = specexec_hf.load_default_pair()
    prompts = [chat_inputs(tokenizer, text)["input_ids"] for text in pick_prompts(args.prompts)]
    warmup = [chat_inputs(tokenizer, text)["input_ids"] for text in pick_prompts(args.warmup_prompts, skip=1)]
    expected = [target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=args.max_new_tokens,
                                do_sample=False) for p in prompts]
    rows = []
    for budget in [b if b == "auto" else int(b) for b in args.budgets]:
        for method, (policy, depth) in policies(args.static_max_depth, budget).items():
            state = LearntState()  # SpecExec's acceptance map, learnt across this method's prompts only
            records = []
            for index, ids in enumerate([*warmup, *prompts]):
                stats = specexec_hf.SpecExecStats()
                begun = time.perf_counter()
                output = target.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False,
                    assistant_model=draft, speculator="specexec", budget=budget, max_depth=depth,
                    tree_search=policy, learnt_state=state, specexec_stats=stats,
                )
                seconds = time.perf_counter() - begun
                if index < len(warmup):
                    continue
                reference = expected[index - len(warmup)]
                records.append({
                    "new_tokens": stats.new_tokens, "target_forwards": stats.target_forwards, "seconds": seconds,
                    "mean_tree_size": stats.mean_tree_size, "identical": output.tolist() == reference.tolist(),
                })
            tokens = sum(r["new_tokens"] for r in records)
            forwards = sum(r["target_forwards"] for r in records)
            row = {
                "budget": budget, "method": method, "max_depth": depth,
                "tokens_per_target_forward": tokens / forwards, "tokens_per_second": tokens / sum(
                    r["seconds"] for r in records),
                "mean_tree_size": sum(r["mean_tree_size"] for r in records) / len(records),
                "identical_to_greedy": all(r["identical"] for r in records), "records": records,
            }
            if isinstance(policy, SequoiaSearch):
                row["acceptance_vector"] = [round(p, 4) for p in policy.learnt_acceptance()]
            rows.append(row)
            print(f"budget {budget} {method}: {row['tokens_per_target_forward']:.3f} tokens/forward, "
                  f"identical {row['identical_to_greedy']}", flush=True)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "threads": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "prompts": args.prompts, "warmup_prompts": args.warmup_prompts, "max_new_tokens": args.max_new_tokens,
        "minutes": (time.time() - started) / 60, "rows": rows,
    }
    lines = [
        "# Sequoia as a tree policy: tokens per target forward at equal budget (default pair, greedy)",
        "",
        f"`{report['command']}`: {args.prompts} held-out prompts x {args.max_new_tokens} new tokens, after "
        f"{args.warmup_prompts} unmeasured warm-up prompts per method; {torch.get_num_threads()} threads.",
        "",
        *table(["budget", "method", "tokens / target forward", "tokens/s", "mean tree size", "greedy identical",
                "learnt vector"],
               [[row["budget"], row["method"], f"{row['tokens_per_target_forward']:.3f}",
                 f"{row['tokens_per_second']:.2f}", f"{row['mean_tree_size']:.1f}", row["identical_to_greedy"],
                 ", ".join(f"{p:.3f}" for p in row.get("acceptance_vector", [])[:4])] for row in rows]),
    ]
    write_report(args.out, "sequoia_online", report, "\n".join(lines), indent=1)


if __name__ == "__main__":
    main()
