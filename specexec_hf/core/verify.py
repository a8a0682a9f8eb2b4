"""One-pass verification: the acceptance walk over a tree the target has scored.

At the root the target makes its own choice (argmax, or a sample from its processed distribution). If that
token is a child of the current node the walk moves there and the target chooses again from that child's
logits; the first choice that is not a child is the bonus token. Every emitted token is therefore the target's
own choice given the tokens before it: greedy output equals the target's greedy output, and sampled output
has exactly the target's distribution, whatever the draft proposed.

A sampling target can do better when a node's children after the draft's top token were *drawn* from the draft's
distribution (without replacement) rather than taken as its next tokens: recursive rejection sampling
(:func:`rejection_chain`, as in SpecInfer and Sequoia) accepts a drawn child with probability up to ``sum min(p, q)``
over what is left, where a fixed child can only be hit by the target's own draw (probability ``p`` of that
token). It still emits exactly the target's distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

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
    node = 0
    path: list[int] = []
    while True:
        token = choose(node)
        child = child_of.get((node, token))
        if child is None:
            return Acceptance(path, [tree_tokens[i] for i in path] + [token])
        path.append(child)
        node = child


def rejection_chain(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, candidates: torch.Tensor, fixed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over ``candidates``: the first ``fixed`` chosen in advance (the draft's top tokens,
    say), the rest drawn in order from ``draft_probs`` without replacement and without the fixed ones.

    A drawn candidate ``i`` comes from ``q_i`` (the draft distribution without the earlier candidates) and is accepted
    with probability ``min(1, p_i(x) / q_i(x))``, which emits each token ``y`` with probability ``min(p_i, q_i)(y)``.
    A rejection (probability ``sum (p_i - q_i)+``) passes the residual ``p_{i+1} = norm((p_i - q_i)+)`` on, whatever
    the rejected token was, so by induction from the bonus token (drawn from the last residual) every step emits
    exactly ``p_i``, and the whole chain emits ``p_0``, the target's distribution. The residual gives a rejected
    token no mass (it was rejected because ``p_i(x) < q_i(x)``), so drawing the next candidate without it loses
    nothing. A fixed candidate is the same step with ``q_i`` all on that token: it is accepted with probability
    ``p_i(x)``, exactly when the target's own draw would hit it, and leaves ``p_i`` without it.

    The acceptance probabilities do not depend on which earlier candidates were rejected by which draw, so they are
    computed for the whole chain at once: a walk draws against them, and a calibration learns from them.

    Args:
        target_probs: ``[vocab]`` the target's (processed) distribution at the node.
        draft_probs: ``[vocab]`` the distribution the drawn candidates came from (before the fixed ones were taken
            out of it).
        candidates: ``[k]`` distinct tokens: the fixed ones, then the drawn ones in the order they were drawn.
        fixed: How many leading candidates were fixed in advance.

    Returns:
        ``(accept, residual)``: ``[k]`` the probability of accepting each candidate once those before it were
        rejected, and ``[vocab]`` the distribution of the bonus token after all of them were.
    """
    target = target_probs.double() / target_probs.double().sum()
    draft = draft_probs.to(target.device, torch.float64) / draft_probs.double().sum().to(target.device)
    candidates = candidates.to(target.device)
    accept = []
    for index in range(candidates.numel()):  # no host reads: the chain runs where the distributions are
        token = candidates[index : index + 1]
        step_draft = torch.zeros_like(draft).index_fill(0, token, 1.0) if index < fixed else draft
        drawn = step_draft[token]
        accept.append(torch.where(drawn > 0, target[token] / drawn.clamp(min=1e-300), 0.0).clamp(max=1.0))
        residual = (target - step_draft).clamp(min=0)
        mass = residual.sum()
        # No residual mass means target == draft: this candidate is accepted for certain, and nothing after it is
        # reached, so what the chain computes past it does not matter.
        target = torch.where(mass > 0, residual / mass.clamp(min=1e-300), target)
        draft = draft.index_fill(0, token, 0.0)
        draft = draft / draft.sum().clamp(min=1e-300)
    accept_probs = torch.cat(accept) if accept else target.new_zeros(0)
    return accept_probs, target


def taken_probabilities(accept: torch.Tensor) -> torch.Tensor:
    """Per candidate, the probability that the chain takes it: it is reached (every candidate before it was
    rejected) and accepted. ``1 - taken.sum()`` is the probability that the bonus token is drawn from the residual.

    Args:
        accept: ``[k]`` acceptance probabilities from :func:`rejection_chain`.
    """
    rejected_before = torch.cat([accept.new_ones(1), torch.cumprod(1 - accept, dim=0)[:-1]])
    return accept * rejected_before


def rejection_sample(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, candidates: torch.Tensor, fixed: int = 0
) -> int:
    """A token distributed exactly as ``target_probs``, taking one of ``candidates`` (as :func:`rejection_chain`
    describes them) as often as the chain allows; uses torch's global generator."""
    accept, residual = rejection_chain(target_probs, draft_probs, candidates, fixed)
    draws = torch.rand(accept.numel(), dtype=torch.float64, device=accept.device)
    taken = (draws < accept).nonzero()
    if taken.numel():
        return int(candidates[int(taken[0])])
    return int(torch.multinomial(residual, 1))
