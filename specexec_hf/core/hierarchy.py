"""A draft of a draft (TriForce's hierarchy): a larger tree re-ranked by a stronger model, cut to the budget.

The small draft grows a tree of many nodes cheaply; an intermediate model, stronger than the draft and cheaper than
the target, scores every node of it in one forward; the target then verifies only the ``budget`` nodes the
intermediate rates likeliest. Under each node the intermediate's own likeliest token joins the candidates when the
draft did not propose it, so the intermediate also grows the tree by one level where the draft missed. The target's
verification is what makes the output exact, whatever tree it is given: the tree here depends only on the drafts,
never on the target's draws.
"""

from __future__ import annotations

import torch

from .tree import TokenTree


def path_logprobs(tree: TokenTree, step_logprobs: torch.Tensor) -> torch.Tensor:
    """``[N]`` each node's cumulative log-probability: the sum of ``step_logprobs`` over its path (root: 0).

    Args:
        tree: The tree.
        step_logprobs: ``[N]`` each node's own log-probability given its parent (the root's is ignored).
    """
    cumulative = torch.zeros_like(step_logprobs)
    parents = tree.parents.clamp(min=0)
    own = torch.where(tree.parents >= 0, step_logprobs, torch.zeros_like(step_logprobs))
    # After pass d every node of depth <= d holds its whole path's sum: one pass per level, no per-node loop.
    for _ in range(int(tree.depths.max())):
        cumulative = own + cumulative[parents]
    return cumulative


def rescored_tree(
    tree: TokenTree, logprobs: torch.Tensor, budget: int, max_depth: int | None = None
) -> tuple[TokenTree, torch.Tensor]:
    """The best ``budget`` nodes of ``tree`` and of each node's likeliest missing child, by another model's log-probs.

    A candidate's score is its path's cumulative log-probability under ``logprobs``; a child never scores above its
    parent, and on a tie the shallower candidate comes first, so the kept set always contains every kept node's
    parent. The kept nodes of ``tree`` keep their order; the added children follow them.

    Args:
        tree: The draft's tree.
        logprobs: ``[N, vocab]`` the scoring model's next-token log-probabilities at each node of ``tree``.
        budget: Most non-root nodes to keep.
        max_depth: Deepest level an added child may sit at; ``None``: no limit.

    Returns:
        ``(rescored, source)``: the new tree, its ``logprobs`` the scoring model's cumulative ones, and ``[M]`` each
        of its nodes' index in ``tree``, ``-1`` for an added child.
    """
    if budget < 0:
        raise ValueError(f"rescored_tree: budget must be >= 0, got {budget}.")
    if logprobs.shape[0] != tree.num_nodes:
        raise ValueError(f"rescored_tree: {logprobs.shape[0]} rows of log-probs for a tree of {tree.num_nodes} nodes.")
    logprobs = logprobs.float()
    parents, tokens, device = tree.parents, tree.tokens, tree.device
    step = torch.zeros(tree.num_nodes, device=device)
    step[1:] = logprobs[parents[1:], tokens[1:]]
    cumulative = path_logprobs(tree, step)
    best_logprob, best_token = logprobs.max(dim=-1)
    proposed = torch.zeros(tree.num_nodes, dtype=torch.bool, device=device)
    proposed[parents[1:][tokens[1:] == best_token[parents[1:]]]] = True
    grows = ~proposed & (best_logprob > -torch.inf)
    if max_depth is not None:
        grows &= tree.depths < max_depth
    added_parents = grows.nonzero().flatten()
    scores = torch.cat([cumulative[1:], cumulative[added_parents] + best_logprob[added_parents]])
    depths = torch.cat([tree.depths[1:], tree.depths[added_parents] + 1])
    # Stable sorts: by depth first, then by score, so equal scores keep the shallower candidate (a parent) first.
    by_depth = torch.argsort(depths, stable=True)
    order = by_depth[torch.argsort(scores[by_depth], descending=True, stable=True)][:budget]
    existing = order[order < tree.num_nodes - 1] + 1
    kept = torch.cat([torch.zeros(1, dtype=torch.long, device=device), existing.sort().values])
    added = added_parents[order[order >= tree.num_nodes - 1] - (tree.num_nodes - 1)]
    rescored = tree.select(kept)
    rescored.logprobs = cumulative[kept]
    new_index = torch.full((tree.num_nodes,), -1, dtype=torch.long, device=device)
    new_index[kept] = torch.arange(kept.numel(), device=device)
    rescored.add_children(new_index[added], best_token[added], cumulative[added] + best_logprob[added])
    source = torch.cat([kept, torch.full((added.numel(),), -1, dtype=torch.long, device=device)])
    return rescored, source
