"""One-pass verification: the acceptance walk over a tree the target has scored.

At the root the target makes its own choice (argmax, or a sample from its processed distribution). If that
token is a child of the current node the walk moves there and the target chooses again from that child's
logits; the first choice that is not a child is the bonus token. Every emitted token is therefore the target's
own choice given the tokens before it: greedy output equals the target's greedy output, and sampled output
has exactly the target's distribution, whatever the draft proposed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .tree import TokenTree

ChooseFn = Callable[[int], int]
"""``choose(node) -> token``: the target's choice after the path from the root to ``node``."""


@dataclass
class Acceptance:
    """The outcome of a walk.

    Args:
        path: Accepted tree nodes below the root, in order.
        tokens: Tokens to commit: the accepted nodes' tokens, then the bonus token.
    """

    path: list[int]
    tokens: list[int]


def acceptance_walk(tree: TokenTree, choose: ChooseFn) -> Acceptance:
    child_of = tree.child_index()
    _, tree_tokens = tree.host_lists()
    node, path = 0, []
    while True:
        token = choose(node)
        child = child_of.get((node, token))
        if child is None:
            return Acceptance(path, [tree_tokens[i] for i in path] + [token])
        path.append(child)
        node = child
