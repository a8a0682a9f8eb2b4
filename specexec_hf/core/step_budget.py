"""One verification budget for a whole batch: the trees of all running requests cut to the best nodes of them all.

When one target forward verifies every request's tree (vLLM's tree verification), what a step costs is its total
node count, so a per-step total is the budget that matters, and it is best spent where the target is likeliest to
accept: a node's ranking score estimates (log-scale) the probability that the target's walk reaches it, so keeping
the ``total`` best-scoring nodes of all trees together maximises the step's expected accepted tokens, and a request
whose draft agrees more with the target gets more of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .tree import TokenTree


def path_scores(tree: TokenTree) -> torch.Tensor:
    """``[N]`` each node's lowest cumulative score on its path from the root (the root's is its own).

    SpecExec's scores never rise down a path, so this is the node's own score; taking the minimum makes the ranking
    put every parent ahead of its children whatever produced the scores.
    """
    scores = tree.logprobs.float().clone()
    for depth in range(1, int(tree.depths.max()) + 1):  # one host read for the depth, one pass per level
        level = tree.depths == depth
        scores[level] = torch.minimum(scores[level], scores[tree.parents[level]])
    return scores


def kept_nodes(trees: Sequence[TokenTree], total: int) -> list[torch.Tensor]:
    """Per tree, the ascending indices of its nodes among the ``total`` best non-root nodes of all the trees, root
    included.

    Nodes rank by :func:`path_scores`, best first; ties go to the earlier tree, then to the lower index, so a
    parent always ranks ahead of its children and every tree's kept nodes form a tree (maybe the root alone).

    Args:
        trees: One tree per request, root first, parents before children, scores on one scale (log-probabilities
            of being reached, as SpecExec's ranking gives them).
        total: Non-root nodes to keep in all; every node is kept when the trees hold fewer.
    """
    if total < 0:
        raise ValueError(f"A shared budget needs a total of at least 0 nodes, got {total}.")
    if not trees:
        return []
    scores = torch.cat([path_scores(tree)[1:].cpu() for tree in trees])
    owners = torch.cat([torch.full((tree.num_nodes - 1,), i, dtype=torch.long) for i, tree in enumerate(trees)])
    nodes = torch.cat([torch.arange(1, tree.num_nodes) for tree in trees])
    best = torch.argsort(-scores, stable=True)[:total]
    root = torch.zeros(1, dtype=torch.long)
    return [torch.cat([root, nodes[best][owners[best] == i].sort().values]) for i in range(len(trees))]


def share_budget(trees: Sequence[TokenTree], total: int) -> list[TokenTree]:
    """Each tree cut to its nodes among the ``total`` best non-root nodes of all the trees together
    (:func:`kept_nodes`); a tree that keeps every node is returned as it is.

    Args:
        trees: One tree per request (see :func:`kept_nodes`).
        total: Non-root nodes to keep in all.
    """
    return [
        tree if keep.numel() == tree.num_nodes else tree.select(keep.to(tree.device))
        for tree, keep in zip(trees, kept_nodes(trees, total))
    ]
