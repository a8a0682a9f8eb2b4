"""Tree policies on a simulated draft and target, where acceptance is, or is not, independent of the tree position.

No model runs: each expanded node gets draft log-probs over a small vocabulary (the token order shuffled per node),
and the target's choice at a visited node is the draft's rank-r token with probability ``p[r]``:

- ``position-independent``: the same draft distribution ``q`` at every node and the target picking by ``q``
  itself (a calibrated draft), so ``p = q`` everywhere: Sequoia's model holds exactly;
- ``position-independent, draft unsure``: the same ``q`` everywhere, but the target picks by a sharper ``p``
  (rank 0 at 0.86): the draft's probabilities under-rate its top token, and only a learnt vector sees it;
- ``position-dependent``: each node's draft distribution has its own sharpness (confident here, unsure there)
  and the target picks by that node's ``q``: the draft's per-node confidence says where acceptance is likely,
  which only a dynamic tree (SpecExec's best-first) can use.

Best-first ranks by the draft's probability alone here (no acceptance map, which ``generate()`` adds).

Per regime and budget, every policy grows the same number of trees, each walked by the simulated target, whose
walk the policy observes (so Sequoia online learns its vector); reported: mean tokens per step (accepted draft
tokens plus the bonus token, i.e. tokens per target forward). Writes JSON and Markdown to
benchmarks/results/sequoia_online/.

Run: .venv/bin/python -m benchmarks.sequoia_synthetic [--trees 1000]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from specexec_hf.core.config import SpecExecConfig
from specexec_hf.core.search import SearchPolicy, grow_tree, walked_nodes
from specexec_hf.core.static_trees import SequoiaSearch, SpecInferSearch

from benchmarks.report import table, write_report

RESULTS = Path(__file__).resolve().parent / "results" / "sequoia_online"
VOCAB = 64
BASE_LOGITS = -0.5 * torch.arange(VOCAB, dtype=torch.float64)  # rank r: weight e^(-r/2) before sharpening
REGIMES = ("position-independent", "position-independent, draft unsure", "position-dependent")
UNSURE_TARGET = torch.softmax(4 * BASE_LOGITS, dim=-1)  # the target's rank probabilities where the draft is unsure


def node_logprobs(regime: str, generator: torch.Generator) -> torch.Tensor:
    """``[VOCAB]`` one node's draft log-probs: the regime's distribution over ranks, on shuffled tokens."""
    sharpness = 1.0
    if regime == REGIMES[2]:
        sharpness = float(torch.empty(1, dtype=torch.float64).uniform_(0.2, 4.0, generator=generator))
    by_rank = torch.log_softmax(BASE_LOGITS * sharpness, dim=-1)
    tokens = torch.randperm(VOCAB, generator=generator)
    return torch.empty(VOCAB, dtype=torch.float64).scatter_(0, tokens, by_rank)


def simulate(policy: SearchPolicy, regime: str, budget: int, max_depth: int | None, trees: int, seed: int) -> float:
    """Mean tokens per step of ``policy`` over ``trees`` simulated steps (the policy observes every walk)."""
    generator = torch.Generator().manual_seed(seed)
    config = SpecExecConfig(budget=budget, max_depth=max_depth)
    total = 0
    for _ in range(trees):
        search = policy.start(0, config)
        drafted: dict[int, torch.Tensor] = {}  # pool node -> its draft log-probs
        while (nodes := search.next_nodes()) is not None:
            rows = [drafted.setdefault(node, node_logprobs(regime, generator)) for node in nodes.tolist()]
            search.add_expansion(nodes, torch.stack(rows))
        result = search.result()
        choices, node = [], 0
        children = result.tree.child_index()
        while True:  # the target's walk: at each node, the draft's token of a rank drawn from the target's p
            pool_node = int(result.pool_index[node])
            logprobs = drafted.get(pool_node)
            if logprobs is None:  # a leaf: the target's choice there ends the walk whatever it is
                choices.append(0)
                break
            by_rank = torch.argsort(logprobs, descending=True)
            target = UNSURE_TARGET if regime == REGIMES[1] else logprobs[by_rank].exp()
            choice = int(by_rank[torch.multinomial(target, 1, generator=generator)])
            choices.append(choice)
            node = children.get((node, choice), -1)
            if node < 0:
                break
        assert len(walked_nodes(result.tree, choices)) == len(choices)
        policy.observe(result, choices)
        total += len(choices)  # the accepted nodes plus the bonus token
    return total / trees


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", type=int, default=1000)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--static-max-depth", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for regime in REGIMES:
        for budget in args.budgets:
            methods = {
                "specexec best-first": (grow_tree, None),
                f"specinfer-style (depth {args.static_max_depth})": (SpecInferSearch(), args.static_max_depth),
                "sequoia prior": (SequoiaSearch(learn=False), None),
                "sequoia online": (SequoiaSearch(), None),
            }
            for method, (policy, depth) in methods.items():
                tokens = simulate(policy, regime, budget, depth, args.trees, args.seed)
                row = {"regime": regime, "budget": budget, "method": method, "tokens_per_step": tokens}
                if isinstance(policy, SequoiaSearch):
                    row["acceptance_vector"] = [round(p, 4) for p in policy.learnt_acceptance()]
                rows.append(row)
                print(f"{regime} budget {budget} {method}: {tokens:.3f}", flush=True)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    best_first = {(row["regime"], row["budget"]): row["tokens_per_step"] for row in rows
                  if row["method"] == "specexec best-first"}
    lines = ["# Tree policies on a simulated draft and target: tokens per step", "", f"`{command}`", "",
             *table(["regime", "budget", "method", "tokens / step", "vs best-first"],
                    [[row["regime"], row["budget"], row["method"], f"{row['tokens_per_step']:.3f}",
                      f"{row['tokens_per_step'] / best_first[row['regime'], row['budget']]:.3f}"] for row in rows])]
    write_report(args.out, "sequoia_synthetic", {"command": command, "trees": args.trees, "rows": rows},
                 "\n".join(lines), indent=1)


if __name__ == "__main__":
    main()
