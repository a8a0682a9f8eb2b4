"""Layer self-drafts (``self:exit:K``, ``self:skip:...``) beside the shipped draft and ``self:int4``, on the default
target in memory.

Per draft: top-1 agreement with the target along its greedy answers to held-out prompts (teacher-forced), the wall
time of one draft forward over the target's at 16 tokens, and, from SpecExec greedy runs on benchmarked prompts at
each budget, tokens per target forward and the draft's wall time per step (tree growth, all its draft forwards)
over the target's per step. Every output is checked against plain greedy generate().

``self:int4``'s trees are grown by its dequantized float twin (:func:`tokens_per_forward.dequantized_twin`; quanto's
CPU kernels dequantize on every forward, and tokens per target forward do not depend on the kernel), so its draft
time per step is the twin's; its forward time ratio is the quantized model's own.

Writes JSON and Markdown to benchmarks/results/self_drafts/.
Run: flock /tmp/bench.lock .venv/bin/python -m benchmarks.self_drafts [--prompts 4] [--max-new-tokens 32]
``--drafts`` takes self-draft names, ``default`` (the shipped draft) and ``tuned:PATH`` (a tuned exit written by
``specexec-hf distill --stage exit``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import transformers

import specexec_hf
from specexec_hf.tools.bench import greedy_continuations, pick_prompts
from specexec_hf.tools.prompts import chat_inputs

from benchmarks.report import write_report
from benchmarks.tokens_per_forward import dequantized_twin, forward_cost, top1_agreement

RESULTS = Path(__file__).resolve().parent / "results" / "self_drafts"
DEFAULT_DRAFTS = ["self:exit:4", "self:exit:8", "self:exit:15", "self:skip:5-28", "self:skip", "default", "self:int4"]


def draft_for(target: torch.nn.Module, shipped: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The draft ``name`` names and its label (``"default"``: the shipped draft; ``"tuned:PATH"``: the tuned exit
    ``specexec-hf distill --stage exit`` wrote to PATH; else a self-draft by name)."""
    if name == "default":
        return shipped, "shipped draft"
    if name.startswith("tuned:"):
        draft = specexec_hf.models.load_tuned_exit(target, name.removeprefix("tuned:"))
        return draft, draft.config.specexec_self_draft
    draft = specexec_hf.models.resolve_draft(target, name)
    return draft, getattr(draft.config, "specexec_self_draft", name)


def speculative_runs(target, draft, prompts, expected, budgets, max_new_tokens) -> list[dict]:
    """Per budget: SpecExec greedy over ``prompts``, its tokens per target forward and the draft's time per step."""
    rows = []
    for budget in budgets:
        steps = forwards = tokens = 0
        draft_seconds = target_seconds = 0.0
        identical = True
        per_prompt = []
        for prompt, reference in zip(prompts, expected):
            stats = specexec_hf.SpecExecStats()
            out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                  do_sample=False, assistant_model=draft, speculator="specexec", budget=budget,
                                  specexec_stats=stats)
            identical &= out[0, prompt.shape[1]:].tolist() == reference
            steps += stats.target_forwards
            forwards += stats.draft_forwards
            tokens += stats.new_tokens
            draft_seconds += stats.draft_seconds
            target_seconds += stats.target_seconds
            per_prompt.append(stats.tokens_per_target_forward)
        rows.append({
            "budget": budget,
            "tokens_per_target_forward": tokens / steps,
            "per_prompt": per_prompt,
            "draft_forwards_per_step": forwards / steps,
            "draft_seconds_per_step": draft_seconds / steps,
            "target_seconds_per_step": target_seconds / steps,
            "draft_over_target_time_per_step": draft_seconds / target_seconds,
            "identical_to_plain_greedy": identical,
        })
    return rows


def markdown(report: dict) -> str:
    budgets = report["budgets"]
    lines = [
        f"Command: `{report['command']}`; default target (SmolLM2-135M-Instruct, float32) in memory; "
        f"{len(report['prompts'])} held-out prompts x {report['max_new_tokens']} new tokens, greedy; top-1 agreement "
        f"teacher-forced along the target's greedy answers to {report['agreement_prompts']} other prompts. "
        "Draft time per step: wall time growing a tree (all its draft forwards) over the target's verification "
        "forward in the same step. Machine: shared 2-core CPU VM.",
        "",
        "| draft | layers run | top-1 agreement | draft forward / target forward (16 tokens) | "
        + " | ".join(f"tokens/target fwd @{b} | draft fwds/step @{b} | draft time/step vs target @{b}" for b in budgets)
        + " | identical |",
        "|---|---|---|---|" + "---|---|---|" * len(budgets) + "---|",
    ]
    for info in report["drafts"].values():
        cells = [info["label"], str(info["layers"]), f"{info['top1_agreement']:.3f}",
                 f"{info['draft_over_target_forward_time']['16']:.2f}x"]
        for row in info["runs"]:
            cells += [f"{row['tokens_per_target_forward']:.2f}", f"{row['draft_forwards_per_step']:.1f}",
                      f"{row['draft_over_target_time_per_step']:.2f}x"]
        cells.append("yes" if all(row["identical_to_plain_greedy"] for row in info["runs"]) else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    if "self:int4" in report["drafts"]:
        lines += ["", "self:int4: trees grown by its dequantized float twin (draft time per step is the twin's); its "
                  "forward time ratio is the quantized model's (quanto's CPU kernels)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafts", nargs="+", default=DEFAULT_DRAFTS)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--agreement-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, shipped, tokenizer = specexec_hf.load_default_pair()
    texts = pick_prompts(args.prompts)
    prompts = [chat_inputs(tokenizer, text)["input_ids"] for text in texts]
    held_out = [chat_inputs(tokenizer, text)["input_ids"]
                for text in pick_prompts(args.agreement_prompts, skip=len(texts) // 2 + 1) if text not in texts]
    continuations = greedy_continuations(target, held_out, 64)
    expected = [target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=args.max_new_tokens,
                                do_sample=False)[0, p.shape[1]:].tolist() for p in prompts]
    timed = torch.cat([sequence for sequence, _ in continuations] * 4)[None, :128]
    report = {
        "command": " ".join(["flock /tmp/bench.lock .venv/bin/python -m benchmarks.self_drafts", *sys.argv[1:]]),
        "machine": platform.platform(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "prompts": texts, "agreement_prompts": len(held_out), "max_new_tokens": args.max_new_tokens,
        "budgets": args.budgets, "drafts": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for name in args.drafts:
            draft, label = draft_for(target, shipped, name)
            layers = (draft.config.num_hidden_layers if name != "self:int4" else target.config.num_hidden_layers)
            info = {"label": label, "layers": layers,
                    "draft_over_target_forward_time": forward_cost(target, draft, timed, counts=(16,))}
            tree_draft = dequantized_twin(target, draft) if name in specexec_hf.models.SELF_DRAFTS else draft
            info["top1_agreement"] = top1_agreement(target, tree_draft, continuations)
            info["runs"] = speculative_runs(target, tree_draft, prompts, expected, args.budgets, args.max_new_tokens)
            report["drafts"][name] = info
            print(name, json.dumps(info), flush=True)
            write_report(args.out, "self_drafts", report, markdown(report), indent=1)


if __name__ == "__main__":
    main()
