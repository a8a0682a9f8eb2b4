"""LM heads over a few rows on a CPU: ``F.linear`` against ``weight @ rows.T`` (``core/products.py``, used by the
acceptance walk's lazy head and the draft's subset head), side by side in one run.

Two sections, the two orders alternating so that the shared machine's drift falls on both:

1. **product**: the default target's 49,152 x 576 head and the shipped draft's 8,192 x 576 subset head over 1 to 32
   rows (one lazy head call computes up to 8, one draft forward feeds 1-16 at budgets 16-64), as ``F.linear`` and
   as ``core.products.head_product``;
2. **generate**: SpecExec in memory with the default pair (greedy, ``--prompts`` eval prompts x
   ``--max-new-tokens``), the walk's head rows in either order (the draft's head always in ``head_product``'s), per
   budget: milliseconds per step in the walk's head calls, per step in all, tokens per target forward, every output
   checked against plain greedy ``generate()``.

Writes benchmarks/results/walk_head/walk_head.{json,md} (``--out`` elsewhere).

Run: .venv/bin/python -m benchmarks.walk_head [--budgets 16 64] [--prompts 8] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

import specexec_hf
from specexec_hf.core.products import head_product
from specexec_hf.hf import forward
from specexec_hf.tools.bench import alternating_generations, environment, pick_prompts
from specexec_hf.tools.prompts import chat_inputs

from benchmarks.report import write_report

RESULTS = Path(__file__).resolve().parent / "results" / "walk_head"
LIBRARY_HEAD_ROWS = forward._head_rows
ORDERS = {"F.linear": lambda head, hidden: head(hidden), "weight @ rows.T": LIBRARY_HEAD_ROWS}


def milliseconds(run, repeats: int) -> float:
    """Median milliseconds of ``run()`` over ``repeats`` calls after two warm-ups."""
    run(), run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


@torch.no_grad()
def products(heads: dict[str, torch.Tensor], rows: list[int], repeats: int) -> list[dict]:
    table = []
    for count in rows:
        for name, weight in heads.items():
            hidden = torch.randn(count, weight.shape[1])
            row = {"head": name, "rows": count}
            for order, product in (("F.linear", F.linear), ("weight @ rows.T", head_product)):
                row[f"{order} ms"] = milliseconds(partial(product, hidden, weight), repeats)
            row["max abs difference"] = (head_product(hidden, weight) - F.linear(hidden, weight)).abs().max().item()
            table.append(row)
            print(row, flush=True)
    return table


class _TimedHeadRows:
    """``forward._head_rows`` in one order, timed, while entered."""

    def __init__(self, order: str):
        self.product, self.seconds = ORDERS[order], 0.0

    def __call__(self, head, hidden):
        started = time.perf_counter()
        try:
            return self.product(head, hidden)
        finally:
            self.seconds += time.perf_counter() - started

    @contextmanager
    def installed(self):
        forward._head_rows = self
        try:
            yield
        finally:
            forward._head_rows = LIBRARY_HEAD_ROWS


def generation(target, draft, tokenizer, budgets: list[int], prompts: int, max_new_tokens: int) -> list[dict]:
    inputs = [chat_inputs(tokenizer, prompt) for prompt in pick_prompts(prompts)]
    plain = [target.generate(**x, max_new_tokens=max_new_tokens, do_sample=False) for x in inputs]
    table = []
    for budget in budgets:
        heads = {order: _TimedHeadRows(order) for order in ORDERS}
        runs = alternating_generations(
            target, inputs, plain, {order: head.installed for order, head in heads.items()}, max_new_tokens,
            do_sample=False, assistant_model=draft, speculator="specexec", budget=budget,
        )
        for order, run in runs.items():
            measured = run.row()
            row = {
                "budget": budget,
                "order": order,
                "walk_head_ms_per_step": heads[order].seconds / run.stats.target_forwards * 1e3,
                "ms_per_step": measured["ms_per_step"],
                "tokens_per_second": measured["tokens_per_second"],
                "tokens_per_target_forward": measured["tokens_per_target_forward"],
                "all_equal_plain_greedy": measured["all_equal_reference"],
            }
            table.append(row)
            print(row, flush=True)
    return table


def heading(report: dict, title: str, variants: str) -> list[str]:
    """A report's markdown title and the line naming its command, machine and that ``variants`` alternate."""
    return [
        f"# {title}",
        "",
        f"`{report['command']}` on {report['environment']['machine']['cpu']} ({report['threads']} threads), torch "
        f"{report['environment']['versions']['torch']}. The two {variants} alternate.",
        "",
    ]


def markdown(report: dict) -> str:
    lines = heading(report, "LM heads over a few rows: F.linear against weight @ rows.T", "orders") + [
        f"## The heads over a few rows (ms, median of {report['repeats']}; unit-variance random rows)",
        "",
        "| head | rows | F.linear | weight @ rows.T | largest difference |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in report["product"]:
        lines.append(f"| {row['head']} | {row['rows']} | {row['F.linear ms']:.2f} | {row['weight @ rows.T ms']:.2f} | "
                     f"{row['max abs difference']:.1e} |")
    return "\n".join(lines + generate_table(report["generate"], "order", "walk head", "walk_head_ms_per_step")) + "\n"


def generate_table(rows: list[dict], variant: str, timed: str, timed_key: str) -> list[str]:
    """The markdown of a generate section: per budget and ``variant``, the ``timed`` part's ms per step, ms per
    step in all, tokens/s, tokens per forward and whether every output equalled plain greedy."""
    lines = ["", "## SpecExec in memory, default pair (greedy)", "",
             f"| budget | {variant} | {timed} ms/step | ms/step | tok/s | tokens per forward | outputs equal plain |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for row in rows:
        lines.append(
            f"| {row['budget']} | {row[variant]} | {row[timed_key]:.1f} | {row['ms_per_step']:.1f} | "
            f"{row['tokens_per_second']:.2f} | {row['tokens_per_target_forward']:.2f} | "
            f"{row['all_equal_plain_greedy']} |"
        )
    return lines


def parse_arguments(description: str, rows: list[int], budgets: list[int], repeats: int) -> argparse.Namespace:
    """The command line both alternating benchmarks take, with their own defaults."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=rows)
    parser.add_argument("--budgets", type=int, nargs="+", default=budgets)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="where the results go (default: the kept folder)")
    return parser.parse_args()


def run_and_write(args: argparse.Namespace, name: str, sections, markdown_of) -> None:
    """Loads the default pair (the draft in float32), runs ``sections(target, draft, tokenizer)`` (a dict of
    report sections) and writes ``<args.out>/<name>.json`` and ``.md`` (``markdown_of(report)``)."""
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = specexec_hf.load_default_pair(draft_dtype=torch.float32)
    env = environment(args)
    report = {"command": env["command"], "environment": env, "threads": args.threads, "repeats": args.repeats,
              **sections(target, draft, tokenizer)}
    write_report(args.out, name, report, markdown_of(report))
    print(markdown_of(report))


def main() -> None:
    args = parse_arguments(__doc__, [1, 2, 4, 8, 13, 16, 27, 32], [16, 64], 21)
    args.out = args.out or RESULTS
    run_and_write(args, "walk_head", lambda target, draft, tokenizer: {
        "product": products(
            {"target 49152 x 576": target.get_output_embeddings().weight,
             "draft 8192 x 576": draft.get_output_embeddings().weight},
            args.rows, args.repeats,
        ),
        "generate": generation(target, draft, tokenizer, args.budgets, args.prompts, args.max_new_tokens),
    }, markdown)


if __name__ == "__main__":
    main()
