"""Tokens per target forward across draft quality and tree ranking, on the real SmolLM2-135M-Instruct target.

Drafts:
- draft == target: every step could accept a chain as long as the budget plus the bonus token;
- the shipped distilled draft;
- a random draft (a 2-layer Llama with random weights and the target's vocabulary): trees are guesses, so each
  forward yields about one token, which is the floor SpecExec never goes below.

Rankings, side by side on every prompt: ``previous`` (the draft's probability, max_depth 16: the defaults before
online calibration), ``draft probability`` (no depth cap) and ``calibrated`` (online acceptance calibration, the
default; its map carries over from prompt to prompt as in a real session).

Greedy output is checked against plain generate() for every prompt. Writes JSON and Markdown to
benchmarks/results/tokens_per_forward/.
Run: .venv/bin/python benchmarks/tokens_per_forward.py [--prompts 4] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import specexec_hf
from specexec_hf.tools.prompts import chat_inputs, load_prompts

RESULTS = Path(__file__).resolve().parent / "results" / "tokens_per_forward"


def random_draft(target) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=target.config.vocab_size,
        hidden_size=target.config.hidden_size,
        intermediate_size=target.config.intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=target.config.num_attention_heads,
        num_key_value_heads=target.config.num_key_value_heads,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(target.dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-random-draft", action="store_true", help="leave out the random draft (slow, floor 1.0)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, shipped, tokenizer = specexec_hf.load_default_pair()
    drafts = {"draft == target": target, "shipped draft": shipped}
    if not args.no_random_draft:
        drafts["random 2-layer draft"] = random_draft(target)
    rankings = {
        "previous": dict(acceptance_calibration=False, max_depth=16),
        "draft probability": dict(acceptance_calibration=False),
        "calibrated": dict(acceptance_calibration=True),
    }
    rows = []
    for prompt in load_prompts("eval")[: args.prompts]:
        inputs = chat_inputs(tokenizer, prompt)
        expected = target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        for name, draft in drafts.items():
            for budget in args.budgets:
                for ranking, knobs in rankings.items():
                    stats = specexec_hf.SpecExecStats()
                    out = target.generate(
                        **inputs, max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=draft,
                        speculator="specexec", budget=budget, specexec_stats=stats, **knobs,
                    )
                    rows.append(
                        {
                            "draft": name,
                            "budget": budget,
                            "ranking": ranking,
                            "identical_to_plain_greedy": out.tolist() == expected.tolist(),
                            **stats.summary(),
                        }
                    )
                    print({k: rows[-1][k] for k in ("draft", "budget", "ranking", "new_tokens", "target_forwards")},
                          flush=True)

    summary = {}
    for row in rows:
        key = (row["draft"], row["budget"], row["ranking"])
        entry = summary.setdefault(key, {"new_tokens": 0, "target_forwards": 0, "all_identical": True})
        entry["new_tokens"] += row["new_tokens"]
        entry["target_forwards"] += row["target_forwards"]
        entry["all_identical"] &= row["identical_to_plain_greedy"]
    for entry in summary.values():
        entry["tokens_per_target_forward"] = entry["new_tokens"] / entry["target_forwards"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "benchmarks/tokens_per_forward.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "machine": platform.platform(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "summary": [{"draft": d, "budget": b, "ranking": r, **entry} for (d, b, r), entry in summary.items()],
        "runs": rows,
    }
    (RESULTS / "tokens_per_forward.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"Command: `{report['command']}`; {args.prompts} held-out prompts x {args.max_new_tokens} new tokens, greedy; "
        "tokens per target forward (outputs identical to plain greedy: all rows True below).",
        "",
        "| draft | budget | " + " | ".join(rankings) + " | calibrated / previous | identical |",
        "|---|---|" + "---|" * (len(rankings) + 2),
    ]
    for draft in drafts:
        for budget in args.budgets:
            entries = [summary[(draft, budget, ranking)] for ranking in rankings]
            values = [entry["tokens_per_target_forward"] for entry in entries]
            identical = all(entry["all_identical"] for entry in entries)
            lines.append(f"| {draft} | {budget} | " + " | ".join(f"{v:.2f}" for v in values)
                         + f" | {values[-1] / values[0]:.2f}x | {identical} |")
    (RESULTS / "tokens_per_forward.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
