"""Ranking a tree's children over the draft's scored columns only, against over full-vocabulary rows, side by side.

The shipped SmolLM2 draft scores 8,192 of the 49,152 tokens (``models.vocab.SubsetLMHead``). Over full rows every
draft forward writes ``[rows, 49152]`` logits, ``-inf`` outside the subset, and the tree's ranking takes their
log-softmax and top-k; within ``hf.draft_cache.scored_columns`` the head returns the 8,192 scored columns and the
ranking maps its top-k back to token ids. Two sections, the two ways alternating so that the shared machine's drift
falls on both:

1. **ranking**: the logits-to-children work of one draft forward over 1 to 64 rows (the head's output, log-softmax,
   top-k), full rows against scored columns;
2. **generate**: SpecExec in memory with the default pair (greedy, ``--prompts`` eval prompts x
   ``--max-new-tokens``), per budget: drafting milliseconds per step (the tree's growth: draft forwards and ranking),
   milliseconds per step in all, tokens per target forward, every output checked against plain greedy.

Writes benchmarks/results/draft_columns/draft_columns.{json,md} (``--out`` elsewhere).

Run: .venv/bin/python -m benchmarks.draft_columns [--budgets 16 64 128] [--prompts 8] [--max-new-tokens 32]
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import torch

from specexec_hf.hf import candidate_generator
from specexec_hf.tools.bench import alternating_generations, pick_prompts
from specexec_hf.tools.prompts import chat_inputs

from benchmarks.walk_head import generate_table, heading, milliseconds, parse_arguments, run_and_write

RESULTS = Path(__file__).resolve().parent / "results" / "draft_columns"
BRANCH = 8  # the default max_branch: children ranked per node


@contextmanager
def full_rows():
    """The generators' ranking over full-vocabulary rows (the head never asked for its scored columns)."""
    library = candidate_generator.scored_columns
    candidate_generator.scored_columns = lambda model: nullcontext()
    try:
        yield
    finally:
        candidate_generator.scored_columns = library


WAYS = {"full rows": full_rows, "scored columns": nullcontext}


def ranked_children(head, hidden: torch.Tensor, compact: bool) -> torch.Tensor:
    """The top-``BRANCH`` children's token ids per row, over the scored columns if ``compact`` else full rows."""
    with head.compact_scores() if compact else nullcontext() as columns:
        logprobs = torch.log_softmax(head(hidden), dim=-1)
    tokens = logprobs.topk(BRANCH, dim=-1).indices
    return tokens if columns is None else columns[tokens]


@torch.no_grad()
def ranking(head, rows: list[int], repeats: int) -> list[dict]:
    table = []
    for count in rows:
        hidden = torch.randn(count, head.weight.shape[1])
        children = partial(ranked_children, head, hidden)
        row = {"rows": count, "equal children": torch.equal(children(False), children(True))}
        for way, compact in (("full rows", False), ("scored columns", True)):
            row[f"{way} ms"] = milliseconds(partial(children, compact), repeats)
        table.append(row)
        print(row, flush=True)
    return table


def generation(target, draft, tokenizer, budgets: list[int], prompts: int, max_new_tokens: int) -> list[dict]:
    inputs = [chat_inputs(tokenizer, prompt) for prompt in pick_prompts(prompts)]
    plain = [target.generate(**x, max_new_tokens=max_new_tokens, do_sample=False) for x in inputs]
    table = []
    for budget in budgets:
        runs = alternating_generations(
            target, inputs, plain, WAYS, max_new_tokens,
            do_sample=False, assistant_model=draft, speculator="specexec", budget=budget,
        )
        for way, run in runs.items():
            measured = run.row()
            measured["all_equal_plain_greedy"] = measured.pop("all_equal_reference")
            row = {"budget": budget, "way": way, **measured}
            table.append(row)
            print(row, flush=True)
    return table


def markdown(report: dict) -> str:
    title = "Ranking a tree's children over the draft's scored columns against full rows"
    lines = heading(report, title, "ways") + [
        f"## One draft forward's logits to children (ms, median of {report['repeats']}; the shipped draft's head)",
        "",
        "| rows | full rows | scored columns | same children |",
        "|---:|---:|---:|---|",
    ]
    for row in report["ranking"]:
        lines.append(f"| {row['rows']} | {row['full rows ms']:.2f} | {row['scored columns ms']:.2f} | "
                     f"{row['equal children']} |")
    return "\n".join(lines + generate_table(report["generate"], "way", "drafting", "draft_ms_per_step")) + "\n"


def main() -> None:
    args = parse_arguments(__doc__, [1, 4, 16, 32, 64], [16, 64, 128], 51)
    args.out = args.out or RESULTS
    run_and_write(args, "draft_columns", lambda target, draft, tokenizer: {
        "ranking": ranking(draft.get_output_embeddings(), args.rows, args.repeats),
        "generate": generation(target, draft, tokenizer, args.budgets, args.prompts, args.max_new_tokens),
    }, markdown)


if __name__ == "__main__":
    main()
