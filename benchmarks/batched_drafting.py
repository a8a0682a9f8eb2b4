"""Drafting for several requests at once: grow_trees (one batched draft forward per search round) vs one tree
after another, on the shipped SmolLM2 draft, as a serving engine would call it each step.

Each simulated decoding step grows one tree per request from its token history in both modes (each mode keeps
its own draft caches, as the vLLM proposer does), checks the two modes grew the same trees, then extends every
history by the tree's best chain (up to --accept tokens) and a bonus token, so the caches carry over like in real
decoding. Writes benchmarks/results/batched_drafting/batched_drafting.{json,md}.

Run: .venv/bin/python -m benchmarks.batched_drafting [--requests 1 2 4 8] [--budget 32] [--steps 8]
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
import transformers

import specexec_hf
from specexec_hf import SpecExecCandidateGenerator, SpecExecConfig, grow_trees
from specexec_hf.tools.prompts import chat_inputs, load_prompts

from benchmarks.report import table, write_report

RESULTS = Path(__file__).resolve().parent / "results" / "batched_drafting"


def simulate(draft, histories: list[torch.Tensor], config: SpecExecConfig, steps: int, accept: int) -> dict:
    batched = [SpecExecCandidateGenerator(draft, config) for _ in histories]
    alone = [SpecExecCandidateGenerator(draft, config) for _ in histories]
    seconds = {"batched": 0.0, "one_by_one": 0.0}
    calls = {"batched": 0, "one_by_one": 0}
    histories = list(histories)
    for _ in range(steps):
        started = time.perf_counter()
        batch = grow_trees([(generator, history, None) for generator, history in zip(batched, histories)])
        seconds["batched"] += time.perf_counter() - started
        calls["batched"] += batch.draft_calls
        started = time.perf_counter()
        results = [generator.grow_tree(history) for generator, history in zip(alone, histories)]
        seconds["one_by_one"] += time.perf_counter() - started
        calls["one_by_one"] += sum(result.draft_forwards for result in results)
        for i, (ours, theirs) in enumerate(zip(batch.results, results)):
            if not torch.equal(ours.tree.tokens, theirs.tree.tokens):
                raise AssertionError(f"request {i}: batched and one-by-one trees differ")
            chain = ours.tree.tokens[ours.tree.best_path()][:accept]
            bonus = ours.tree.tokens[-1:]  # any token: it only has to be new to the draft cache
            histories[i] = torch.cat([histories[i], chain[None], bonus[None]], dim=-1)
    return {"seconds": seconds, "draft_calls": calls, "speedup": seconds["one_by_one"] / seconds["batched"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--max-depth", type=int, default=8, help="vLLM's num_speculative_tokens caps the depth.")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accept", type=int, default=2, help="Chain tokens accepted per simulated step.")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    _, draft, tokenizer = specexec_hf.load_default_pair()
    config = SpecExecConfig(budget=args.budget, max_depth=args.max_depth)
    prompts = load_prompts("eval")
    encoded = [chat_inputs(tokenizer, prompt)["input_ids"] for prompt in prompts[: max(args.requests)]]
    rows = []
    with torch.inference_mode():
        simulate(draft, encoded[:1], config, 1, args.accept)  # warm-up
        for count in args.requests:
            result = simulate(draft, encoded[:count], config, args.steps, args.accept)
            rows.append({"requests": count, **result})
            print(
                f"{count} requests: batched {result['seconds']['batched']:.2f} s ({result['draft_calls']['batched']} "
                f"calls) vs one by one {result['seconds']['one_by_one']:.2f} s "
                f"({result['draft_calls']['one_by_one']} calls): {result['speedup']:.2f}x",
                flush=True,
            )
    report = {
        "command": "python -m benchmarks.batched_drafting "
        + " ".join(f"--{name.replace('_', '-')} {value}" for name, value in vars(args).items()),
        "config": {"budget": args.budget, "max_depth": args.max_depth, "steps": args.steps, "accept": args.accept},
        "machine": {"platform": platform.platform(), "cpu_count": torch.get_num_threads(), "threads": args.threads},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "rows": rows,
    }
    lines = [
        "# Drafting for several requests: batched vs one by one",
        "",
        f"Shipped SmolLM2 draft, budget {args.budget}, depth <= {args.max_depth}, {args.steps} steps, "
        f"{args.threads} thread(s). Same trees in both modes (checked).",
        "",
        *table(["requests", "batched s", "batched draft calls", "one-by-one s", "one-by-one draft calls", "speed-up"],
               [[row["requests"], f"{row['seconds']['batched']:.2f}", row["draft_calls"]["batched"],
                 f"{row['seconds']['one_by_one']:.2f}", row["draft_calls"]["one_by_one"], f"{row['speedup']:.2f}x"]
                for row in rows]),
    ]
    write_report(RESULTS, "batched_drafting", report, "\n".join(lines))


if __name__ == "__main__":
    main()
