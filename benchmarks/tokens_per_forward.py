"""Tokens per target forward with aligned pairs, on the real SmolLM2-135M-Instruct target.

Per draft (a copy of the target: draft == target; the self-drafts ``self:int8`` and ``self:int4``, the target with
quantized weights; the shipped distilled draft), side by side on every prompt, at each budget and temperature:
SpecExec with online acceptance calibration (the default) and without it (``raw``: ranked by the draft's
probability; for the shipped draft that is its offline calibration, temperature and context weights), when sampling
SpecExec with the children after each node's top token drawn from the draft (``drawn``, ``sampled_children=True``), the
SpecInfer- and Sequoia-style static trees (``--static-max-depth``; their shapes need a depth), and HF assisted
generation at each constant ``num_assistant_tokens`` without its confidence threshold and with transformers' own
defaults (``--assistant-tokens 4 8 16 32 default``; the best of them is reported, and the defaults beside it, which
are what ``generate(assistant_model=...)`` gives a user who sets nothing). SpecExec has no depth cap (the
library default). Each run (method, budget, temperature) learns in its own acceptance maps, carried from prompt to
prompt as in a real session; ``--warmup-prompts N`` first has every run decode N calibration prompts (never a
benchmarked one), unmeasured, so the grid shows the map after earlier requests rather than on its first tree.

Each draft's top-1 agreement with the target (how often its top token is the target's, along the target's greedy
answers to held-out prompts) and forward cost (median wall time of a draft forward over the target's, at 16 and at
128 tokens, with the draft's real kernels) come first. The trees of the self-drafts are grown, unless
``--quantized-kernels``, by a float twin holding the same dequantized weights: quanto's CPU kernels dequantize the
weights on every forward, which would make the grid several times slower, and tokens per target forward do not
depend on the kernel (the twin's top-1 agreement with the quantized model is reported).

Greedy outputs are checked against plain generate(). Writes JSON, Markdown and a PNG plot to
benchmarks/results/tokens_per_forward/.
Run: .venv/bin/python -m benchmarks.tokens_per_forward [--prompts 2] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import statistics
import sys
from pathlib import Path

import torch
import transformers

import specexec_hf
from specexec_hf.core.config import SpecExecConfig
from specexec_hf.core.static_trees import best_first_nodes
from specexec_hf.tools.bench import (
    SAMPLING_ONLY_METHODS,
    Bench,
    Run,
    aligned_draft,
    greedy_continuations,
    pick_prompts,
    sequoia_acceptance,
)
from specexec_hf.tools.prompts import chat_inputs

from benchmarks.report import write_report
from benchmarks.timing import forward_seconds

RESULTS = Path(__file__).resolve().parent / "results" / "tokens_per_forward"
DRAFT_LABELS = {"target": "draft == target", "self:int8": "self:int8", "self:int4": "self:int4",
                "int4-quarter": "int4 in every 4th layer", "default": "shipped draft"}
# Benchmark-only drafts: the target with the linear layers of every ``n``-th decoder layer quantized to int4, an
# agreement level between self:int4 and self:int8.
PARTIAL_INT4 = {"int4-quarter": 4}
TREE_METHODS = {"specexec": "SpecExec calibrated", "specexec_raw": "SpecExec raw",
                "specexec_drawn": "SpecExec drawn children", "specinfer": "SpecInfer-style",
                "sequoia": "Sequoia-style"}


def partial_int4_draft(target: torch.nn.Module, every: int) -> torch.nn.Module:
    """A copy of ``target`` whose decoder layers ``0, every, 2 * every, ...`` have int4 linear layers (quanto)."""
    from optimum import quanto

    draft = copy.deepcopy(target)
    layers = range(0, len(draft.model.layers), every)
    quanto.quantize(draft, weights=quanto.qint4, include=[f"model.layers.{i}.*" for i in layers])
    quanto.freeze(draft)
    return draft.eval()


def dequantized_twin(target: torch.nn.Module, quantized: torch.nn.Module) -> torch.nn.Module:
    """A float copy of ``target`` whose linear layers hold ``quantized``'s dequantized weights (quanto models cannot
    be deep-copied themselves)."""
    from optimum.quanto import QLinear

    twin = copy.deepcopy(target)
    for name, module in quantized.named_modules():
        if isinstance(module, QLinear):
            # A new module, not new data: the LM head may be tied to the (unquantized) embedding.
            linear = torch.nn.Linear(module.in_features, module.out_features, module.bias is not None)
            linear.weight = torch.nn.Parameter(module.qweight.dequantize().to(module.qweight.dtype), False)
            if module.bias is not None:
                linear.bias = module.bias
            twin.set_submodule(name, linear)
    return twin


def forward_cost(target, draft, tokens: torch.Tensor, counts=(16, 128), repeats: int = 5) -> dict[str, float]:
    """Per token count n, the median wall time of a draft forward over the target's on ``tokens[:, :n]``
    (interleaved, after a warm-up)."""
    if tokens.shape[1] < max(counts):
        raise ValueError(f"forward_cost needs {max(counts)} tokens, got {tokens.shape[1]}.")
    ratios = {}
    for count in counts:
        piece = tokens[:, :count]
        forward_seconds(target, piece, 1), forward_seconds(draft, piece, 1)  # warm-up
        target_times, draft_times = [], []
        for _ in range(repeats):
            target_times += forward_seconds(target, piece, 1)
            draft_times += forward_seconds(draft, piece, 1)
        ratios[str(count)] = statistics.median(draft_times) / statistics.median(target_times)
    return ratios


@torch.no_grad()  # not inference_mode: quanto's int4 weights fail under it
def top1_agreement(a, b, continuations: list[tuple[torch.Tensor, int]]) -> float:
    """How often ``a`` and ``b`` pick the same next token along each continuation (after its prompt)."""
    same = total = 0
    for sequence, prompt_length in continuations:
        ids = sequence.reshape(1, -1)
        picks = [model(ids).logits[0, prompt_length - 1 : -1].argmax(-1) for model in (a, b)]
        same += int((picks[0] == picks[1]).sum())
        total += picks[0].numel()
    return same / total


def assistant_setting(text: str) -> int | None:
    """``--assistant-tokens`` values: a constant ``num_assistant_tokens``, or ``default`` (``None``: transformers'
    adaptive schedule and confidence threshold)."""
    return None if text == "default" else int(text)


def assisted_setting_label(row: dict) -> str:
    return "defaults" if row["assistant_tokens"] is None else f"@{row['assistant_tokens']}"


def position_independent_ratio(acceptance: list[float], budget: int, chain_lengths: list[int]) -> float:
    """Expected tokens per target forward of the best tree of ``budget`` nodes over the best chain of
    ``chain_lengths``, if the target's choice were the draft's rank-r token with probability ``acceptance[r]`` at
    every node whatever its context (Sequoia's model; the tree is Sequoia's): the ratio a tree ranked by ranks alone
    reaches. Real text varies in difficulty, which ranking by the draft's probability exploits (and chains too)."""
    tree = sum(best_first_nodes(acceptance, budget, budget)[2])
    chain = max(sum(best_first_nodes(acceptance[:1], length, length)[2]) for length in chain_lengths)
    return tree / chain


def largest_possible(new_tokens: int, budget: int) -> float:
    """Tokens per target forward if every step committed ``budget + 1`` tokens (the last one what is left)."""
    return new_tokens / math.ceil(new_tokens / (budget + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--sampling-budgets", type=int, nargs="+", default=[64, 256],
                        help="Budgets run at the sampling temperatures (default 64 256).")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6])
    parser.add_argument("--drafts", nargs="+", choices=list(DRAFT_LABELS), default=list(DRAFT_LABELS))
    parser.add_argument("--methods", nargs="+", choices=list(TREE_METHODS), default=list(TREE_METHODS))
    parser.add_argument("--assistant-tokens", type=assistant_setting, nargs="+", default=[4, 8, 16, 32, None],
                        help="constant num_assistant_tokens values for HF assisted generation, and 'default' for "
                        "transformers' defaults (default: 4 8 16 32 default)")
    parser.add_argument("--static-max-depth", type=int, default=32)
    parser.add_argument("--calibration-prompts", type=int, default=2,
                        help="held-out prompts for the drafts' agreement and Sequoia's acceptance vectors")
    parser.add_argument("--warmup-prompts", type=int, default=0,
                        help="calibration prompts each run decodes, unmeasured, before the benchmarked ones")
    parser.add_argument("--drafts-only", action="store_true",
                        help="measure the drafts' agreement and cost only, not the grid")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quantized-kernels", action="store_true",
                        help="grow the self-drafts' trees with quanto's kernels instead of the dequantized twin")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, shipped, tokenizer = specexec_hf.load_default_pair()

    def encode(text: str) -> torch.Tensor:
        return chat_inputs(tokenizer, text)["input_ids"]

    prompt_texts = pick_prompts(args.prompts)
    prompts = [encode(text) for text in prompt_texts]
    calibration = [encode(p) for p in pick_prompts(args.calibration_prompts, skip=len(prompt_texts) // 2 + 1)
                   if p not in prompt_texts]
    if args.warmup_prompts > len(calibration):
        parser.error(f"--warmup-prompts {args.warmup_prompts} needs as many calibration prompts; there are "
                     f"{len(calibration)} (raise --calibration-prompts).")
    continuations = greedy_continuations(target, calibration, args.max_new_tokens)
    expected = [target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=args.max_new_tokens,
                                do_sample=False)[0, p.shape[1]:].tolist() for p in prompts]
    tree = SpecExecConfig(max_depth=args.static_max_depth)
    report = {
        "command": " ".join(["python -m benchmarks.tokens_per_forward", *sys.argv[1:]]),
        "machine": platform.platform(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "prompts": prompt_texts,
        "drafts": {},
        "results": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.drafts:
        if name in PARTIAL_INT4:
            draft = partial_int4_draft(target, PARTIAL_INT4[name])
        else:
            draft = shipped if name == "default" else aligned_draft(target, name)
        info = {"label": DRAFT_LABELS[name]}
        timed = torch.cat([sequence for sequence, _ in continuations] * 4)[None, :128]  # real text, >= 128 tokens
        info["draft_over_target_forward_time"] = forward_cost(target, draft, timed)
        tree_draft = draft
        if (name in specexec_hf.models.SELF_DRAFTS or name in PARTIAL_INT4) and not args.quantized_kernels:
            tree_draft = dequantized_twin(target, draft)
            info["twin_top1_agreement_with_quantized"] = top1_agreement(draft, tree_draft, continuations)
        info["top1_agreement"] = top1_agreement(target, draft, continuations)
        acceptance = sequoia_acceptance(target, tree_draft, continuations, args.temperatures, tree.max_branch,
                                        args.top_p)
        info["sequoia_acceptance"] = {str(t): vector for t, vector in acceptance.items()}
        report["drafts"][name] = info
        print(name, info, flush=True)
        if args.drafts_only:
            write(report, args)
            continue
        bench = Bench(target, tree_draft, prompts, args.max_new_tokens, args.top_p, 0, tree, acceptance,
                      warmup_prompts=calibration[: args.warmup_prompts])
        runs = []
        for temperature in args.temperatures:
            budgets = args.budgets if temperature == 0 else args.sampling_budgets
            runs += [Run(method, temperature, budget=b) for b in budgets for method in args.methods
                     if temperature or method not in SAMPLING_ONLY_METHODS]
            runs += [Run("hf_assisted", temperature, assistant_tokens=n) for n in args.assistant_tokens]
        for results in bench.measure(runs, lambda: None):
            rows = []
            for result in results:
                row = {key: result[key] for key in ("method", "temperature", "budget", "assistant_tokens", "label",
                                                    "new_tokens", "target_forwards", "draft_forwards",
                                                    "tokens_per_target_forward")}
                row["per_prompt"] = [record["tokens_per_target_forward"] for record in result["records"]]
                accepted = sum(record["path_length"] for record in result["records"])
                if result["method"] in TREE_METHODS and accepted:
                    row["forecast_ratio"] = sum(record["forecast"] for record in result["records"]) / accepted
                if result["temperature"] == 0:
                    outputs = [record["output"] for record in result["records"]]
                    row["identical_to_plain_greedy"] = outputs == expected[: len(outputs)]
                rows.append({"draft": name, "prompts_done": len(result["records"]), **row})
            print(f"{name}: {len(results[0]['records'])} prompt(s) done", flush=True)
            report["results"] = [r for r in report["results"] if r["draft"] != name] + rows
            write(report, args)
        del bench, tree_draft, draft
    write(report, args, plot=not args.drafts_only)
    print((args.out / "tokens_per_forward.md").read_text())


def write(report: dict, args: argparse.Namespace, plot: bool = False) -> None:
    write_report(args.out, "tokens_per_forward", report, markdown(report, args), indent=1)
    if plot:
        write_plot(report, args.out / "tokens_per_forward.png", args.max_new_tokens)


def _cell(rows: list[dict], draft: str, method: str, temperature: float, budget: int) -> dict | None:
    return next((r for r in rows if (r["draft"], r["method"], r["temperature"], r["budget"]) ==
                 (draft, method, temperature, budget)), None)


def best_assisted(rows: list[dict], draft: str, temperature: float, defaults_only: bool = False) -> dict | None:
    """The HF assisted row with the most tokens per target forward (of those at transformers' defaults only, if
    ``defaults_only``)."""
    assisted = [r for r in rows if r["draft"] == draft and r["method"] == "hf_assisted"
                and r["temperature"] == temperature and (r["assistant_tokens"] is None or not defaults_only)]
    return max(assisted, key=lambda r: r["tokens_per_target_forward"], default=None)


def markdown(report: dict, args: argparse.Namespace) -> str:
    rows = report["results"]
    lines = [
        (f"Command: `{report['command']}`; {args.prompts} held-out prompts x {args.max_new_tokens} new tokens; tokens "
        f"per target forward. Static trees: max_depth {args.static_max_depth}; SpecExec: no depth cap."),
        "",
        "| draft | top-1 agreement | draft forward time / target forward time (tokens per forward) |",
        "|---|---|---|",
    ]
    for info in report["drafts"].values():
        costs = ", ".join(f"{ratio:.2f}x ({count})" for count, ratio in info["draft_over_target_forward_time"].items())
        lines.append(f"| {info['label']} | {info['top1_agreement']:.3f} | {costs} |")
    twins = {n: i["twin_top1_agreement_with_quantized"] for n, i in report["drafts"].items()
             if "twin_top1_agreement_with_quantized" in i}
    if twins:
        lines += ["", "Trees of the self-drafts grown by their dequantized float twins; twin vs quantized model top-1 "
                  "agreement: " + ", ".join(f"{n} {a:.4f}" for n, a in twins.items()) + "."]
    for temperature in sorted({r["temperature"] for r in rows}):
        greedy = temperature == 0
        methods = [m for m in TREE_METHODS if any(r["method"] == m and r["temperature"] == temperature for r in rows)]
        title = "greedy (t=0)" if greedy else f"sampling (t={temperature:g}, top-p {args.top_p:g})"
        lines += ["", f"## {title}", "", "| draft | budget | " + " | ".join(TREE_METHODS[m] for m in methods)
                  + " | HF assisted best | HF assisted, defaults | largest possible |"
                  + (" identical to greedy |" if greedy else ""),
                  "|---|---|" + "---|" * (len(methods) + 3 + greedy)]
        for draft in report["drafts"]:
            assisted = best_assisted(rows, draft, temperature)
            defaults = best_assisted(rows, draft, temperature, defaults_only=True)
            budgets = sorted({r["budget"] for r in rows if r["draft"] == draft and r["temperature"] == temperature
                              and r["budget"] is not None})
            for budget in budgets:
                cells = [_cell(rows, draft, m, temperature, budget) for m in methods]
                values = [f"{c['tokens_per_target_forward']:.2f}" if c else "-" for c in cells]
                hf = [f"{r['tokens_per_target_forward']:.2f} ({assisted_setting_label(r)})" if r else "-"
                      for r in (assisted, defaults)]
                line = (f"| {DRAFT_LABELS[draft]} | {budget} | " + " | ".join(values + hf)
                        + f" | {largest_possible(args.max_new_tokens, budget):.2f} |")
                if greedy:
                    checked = [c.get("identical_to_plain_greedy") for c in cells if c] + (
                        [assisted.get("identical_to_plain_greedy")] if assisted else [])
                    line += f" {all(checked)} |"
                lines.append(line)
    lines += ["", "## Goals", "", *goal_lines(report, args)]
    return "\n".join(lines) + "\n"


def goal_lines(report: dict, args: argparse.Namespace) -> list[str]:
    """The issue's goals, each with the measured figures and met / not met."""
    rows, lines = report["results"], []

    def tpf(draft, method, temperature, budget):
        cell = _cell(rows, draft, method, temperature, budget)
        return cell["tokens_per_target_forward"] if cell else None

    if "target" in report["drafts"]:
        shares = {b: tpf("target", "specexec", 0.0, b) / largest_possible(args.max_new_tokens, b)
                  for b in args.budgets if b >= 16 and tpf("target", "specexec", 0.0, b) is not None}
        if shares:
            lines.append("- draft == target, greedy, SpecExec >= 0.9 x the largest possible at every budget >= 16: "
                         + ", ".join(f"{b}: {s:.2f}" for b, s in shares.items())
                         + f" -> {'met' if min(shares.values()) >= 0.9 else 'not met'}")
    for draft in report["drafts"]:
        for temperature in sorted({r["temperature"] for r in rows if r["draft"] == draft}):
            verdicts = []
            for budget in sorted({r["budget"] for r in rows if r["draft"] == draft and r["temperature"] == temperature
                                  and r["budget"] is not None}):
                ours = tpf(draft, "specexec", temperature, budget)
                rivals = [v for v in (tpf(draft, m, temperature, budget) for m in ("specinfer", "sequoia")) if v]
                if ours is not None and rivals:
                    verdict = "ok" if ours >= max(rivals) else "NO"
                    verdicts.append(f"{budget}: {ours:.2f} vs {max(rivals):.2f} {verdict}")
            if verdicts:
                lines.append(f"- {DRAFT_LABELS[draft]}, t={temperature:g}, SpecExec >= best static tree: "
                             + "; ".join(verdicts))
            ours = tpf(draft, "specexec", temperature, 256)
            for defaults_only in (False, True):
                assisted = best_assisted(rows, draft, temperature, defaults_only)
                if assisted and ours:
                    ratio = ours / assisted["tokens_per_target_forward"]
                    lines.append(f"- {DRAFT_LABELS[draft]}, t={temperature:g}, SpecExec@256 / "
                                 + ("HF assisted at its defaults" if defaults_only else
                                    f"best HF assisted ({assisted_setting_label(assisted)})")
                                 + f" = {ratio:.2f}x (goal >= 2x: "
                                 f"{'met' if ratio >= 2 else 'not met'})")
            acceptance = report["drafts"][draft]["sequoia_acceptance"].get(str(temperature))
            chains = [n for n in args.assistant_tokens if n is not None]
            if acceptance and chains and temperature == 0:  # a greedy chain's token is accepted with p[0]
                lines.append(f"- {DRAFT_LABELS[draft]}, t={temperature:g}, under position-independent acceptance "
                             f"(the measured rank vector), the best 256-node tree over the best chain of "
                             f"{'/'.join(map(str, chains))}: "
                             f"{position_independent_ratio(acceptance, 256, chains):.2f}x")
            for numerator, denominator, label in (("specexec", "specexec_raw", "calibrated / raw"),
                                                  ("specexec_drawn", "specexec", "drawn children / top tokens")):
                ratios = [(b, tpf(draft, numerator, temperature, b), tpf(draft, denominator, temperature, b))
                          for b in sorted(set(args.budgets) | set(args.sampling_budgets))]
                ratios = [(b, ours / other) for b, ours, other in ratios if ours and other]
                if ratios:
                    lines.append(f"- {DRAFT_LABELS[draft]}, t={temperature:g}, {label}: "
                                 + ", ".join(f"{b}: {ratio:.2f}x" for b, ratio in ratios))
            forecasts = {m: [(r["budget"], r["forecast_ratio"]) for r in rows if (r["draft"], r["method"],
                             r["temperature"]) == (draft, m, temperature) and "forecast_ratio" in r]
                         for m in ("specexec", "specexec_raw", "specexec_drawn")}
            if any(forecasts.values()):
                lines.append(f"- {DRAFT_LABELS[draft]}, t={temperature:g}, tokens the trees forecast / tokens "
                             "accepted (1: the ranking trusts the draft as the target does): " + "; ".join(
                                 f"{TREE_METHODS[m]} " + ", ".join(f"{b}: {ratio:.2f}" for b, ratio in sorted(pairs))
                                 for m, pairs in forecasts.items() if pairs))
    return lines


def write_plot(report: dict, path: Path, new_tokens: int) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot.", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    temperatures = sorted({r["temperature"] for r in rows})
    drafts = list(report["drafts"])
    figure, axes = plt.subplots(len(temperatures), len(drafts), figsize=(4.2 * len(drafts), 3.6 * len(temperatures)),
                                squeeze=False)
    for row_axes, temperature in zip(axes, temperatures):
        for axis, draft in zip(row_axes, drafts):
            cells = [r for r in rows if r["draft"] == draft and r["temperature"] == temperature]
            budgets = sorted({r["budget"] for r in cells if r["budget"] is not None})
            for index, (method, label) in enumerate(TREE_METHODS.items()):
                points = sorted((r["budget"], r["tokens_per_target_forward"]) for r in cells if r["method"] == method)
                if points:
                    axis.plot(*zip(*points), marker="o", label=label, color=f"C{index}")
            assisted = best_assisted(rows, draft, temperature)
            if assisted:
                axis.axhline(assisted["tokens_per_target_forward"], linestyle="--", color="C9",
                             label=f"HF assisted best ({assisted_setting_label(assisted)})")
            if temperature == 0 and budgets:
                axis.plot(budgets, [largest_possible(new_tokens, b) for b in budgets], linestyle=":", color="gray",
                          label="largest possible")
            axis.set_xscale("log", base=2)
            axis.set_xticks(budgets, [str(b) for b in budgets])
            agreement = report["drafts"][draft]["top1_agreement"]
            sampling = ", greedy" if temperature == 0 else f", t={temperature:g}"
            axis.set_title(f"{DRAFT_LABELS[draft]} (top-1 {agreement:.2f}){sampling}", fontsize=9)
            axis.set_xlabel("budget")
            axis.set_ylabel("tokens per target forward")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    main()
