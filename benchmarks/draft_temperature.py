"""Tokens per target forward vs how greedy SpecExec trees are ranked: the draft temperature, and context matching.

Checks the calibrated greedy temperature (``specexec-hf calibrate``) against neighbouring ones by what it is
for: tokens per target forward, with the draft's probabilities alone; ``--context-match`` adds a row at the
calibrated temperature with the draft's calibrated context-match weights (:mod:`specexec_hf.core.context_match`).
The prompts are training prompts that neither the shipped draft's distillation (the first 1,536 of its order)
nor its fits (among the next 128) used, and not the benchmark's eval prompts. Greedy outputs must be the same in
every row (only the tree changes); the script fails otherwise.
Writes JSON and Markdown to --out: benchmarks/results/draft_temperature_ab/ by default; the context-matching A/B
(--context-match) is kept in benchmarks/results/context_match_ab/.

Run: .venv/bin/python -m benchmarks.draft_temperature [--prompts 16] [--temperatures 0.6 0.85 1.0] [--context-match]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import transformers

from specexec_hf import SpecExecStats, models
from specexec_hf.hf.calibrated import (
    calibrated_context_match_weights,
    greedy_draft_temperature,
)
from specexec_hf.tools.calibrate import calibration_prompts
from specexec_hf.tools.prompts import encode_chats

from benchmarks.report import table, write_report

RESULTS = Path(__file__).resolve().parent / "results"
# The shipped draft was distilled on the first 1,536 training prompts of distill's order and its temperature fit
# on the next 48; calibration studies used up to 128 of those: skip them all.
USED_PROMPTS = 1536 + 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--skip", type=int, default=USED_PROMPTS,
                        help="Training prompts (in distill's order) to skip: those the draft and its fit used.")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 0.85, 1.0],
                        help="Compared with the draft's calibrated temperature, which always runs.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context-match", action="store_true",
                        help="Also rank at the calibrated temperature with the draft's calibrated context matching.")
    parser.add_argument("--out", type=Path, default=RESULTS / "draft_temperature_ab")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tokenizer = models.load_default_target()
    draft = models.load_draft_export(target, models.draft_export_path("default"))
    calibrated = greedy_draft_temperature(draft)
    weights = calibrated_context_match_weights(draft)
    if args.context_match and not weights:
        raise SystemExit("--context-match: the draft has no calibrated context-match weights (specexec-hf calibrate).")
    variants = [(temperature, ()) for temperature in sorted({calibrated, *args.temperatures})]
    variants += [(calibrated, weights)] if args.context_match else []
    prompts = [torch.tensor([ids]) for ids in
               encode_chats(tokenizer, calibration_prompts("train", args.prompts, after_distilled=args.skip))]
    rows, reference = [], None
    for temperature, context_match_weights in variants:
        outputs, tokens, forwards = [], 0, 0
        for ids in prompts:
            stats = SpecExecStats()
            output = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                     do_sample=False, assistant_model=draft, speculator="specexec",
                                     budget=args.budget, draft_temperature=temperature, specexec_stats=stats,
                                     context_match_weights=context_match_weights)
            outputs.append(output[0, ids.shape[1]:].tolist())
            tokens, forwards = tokens + stats.new_tokens, forwards + stats.target_forwards
        reference = reference or outputs
        if outputs != reference:
            raise SystemExit(f"greedy outputs changed with the tree's ranking (T {temperature}, context matching "
                             f"{context_match_weights}): a bug")
        rows.append({"temperature": temperature, "calibrated": temperature == calibrated,
                     "context_match_weights": list(context_match_weights), "new_tokens": tokens,
                     "target_forwards": forwards, "tokens_per_target_forward": tokens / forwards})
        print(json.dumps(rows[-1]), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    def option(key: str, value: object) -> str:
        shown = "" if value is True else " " + (" ".join(map(str, value)) if isinstance(value, list) else str(value))
        return f"--{key.replace('_', '-')}{shown}"

    command = "python -m benchmarks.draft_temperature " + " ".join(
        option(key, value) for key, value in vars(args).items() if key != "out" and value is not False
    )
    report = {"command": command, "rows": rows, "prompts": args.prompts, "skip": args.skip,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "machine": platform.processor() or platform.machine()}
    lines = [
        "# Greedy SpecExec: tokens per target forward vs draft temperature", "", f"`{command}`", "",
        f"{args.prompts} training prompts after the first {args.skip} of distill's order, {args.max_new_tokens} "
        f"new tokens each, budget {args.budget}, default tree knobs. Greedy outputs identical in every row.",
        "", *table(["draft temperature", "context matching", "tokens / target fwd", "target fwd"], [
            [f"{row['temperature']:.3f}" + (" (calibrated)" if row["calibrated"] else ""),
             ", ".join(map(str, row["context_match_weights"])) or "off", f"{row['tokens_per_target_forward']:.2f}",
             row["target_forwards"]] for row in rows]),
    ]
    write_report(args.out, "draft_temperature", report, "\n".join(lines), indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
