"""The token tree SpecExec drafts and the target verifies: plain tensors, no model code.

Node 0 is the root: the last committed token, whose continuation the tree proposes. Every other node is a
draft token whose parent has a smaller index, so any prefix of the node list is a valid tree and a walk over
indices in order visits parents before children.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenTree:
    """A tree of draft tokens.

    Args:
        tokens: ``[N]`` token id of each node.
        parents: ``[N]`` index of each node's parent; ``-1`` for the root.
        depths: ``[N]`` distance from the root (the root has depth 0).
        logprobs: ``[N]`` cumulative draft log-probability of the path from the root to the node (root: 0).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    logprobs: torch.Tensor

    @classmethod
    def from_root(cls, token: int, device: torch.device | str | None = None) -> TokenTree:
        long = dict(dtype=torch.long, device=device)
        return cls(
            tokens=torch.tensor([token], **long),
            parents=torch.tensor([-1], **long),
            depths=torch.zeros(1, **long),
            logprobs=torch.zeros(1, dtype=torch.float32, device=device),
        )

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def add_children(self, parents: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """Appends nodes under existing ``parents`` with cumulative ``logprobs``; returns their indices."""
        first = self.num_nodes
        self.tokens = torch.cat([self.tokens, tokens.to(self.tokens)])
        self.parents = torch.cat([self.parents, parents.to(self.parents)])
        self.depths = torch.cat([self.depths, self.depths[parents] + 1])
        self.logprobs = torch.cat([self.logprobs, logprobs.to(self.logprobs)])
        return torch.arange(first, self.num_nodes, device=self.device)

    def select(self, keep: torch.Tensor) -> TokenTree:
        """The subtree of the nodes ``keep`` (ascending, containing every kept node's parent), re-indexed."""
        new_index = torch.full((self.num_nodes,), -1, dtype=torch.long, device=self.device)
        new_index[keep] = torch.arange(keep.numel(), device=self.device)
        old_parents = self.parents[keep]
        parents = torch.where(old_parents >= 0, new_index[old_parents.clamp(min=0)], -1)
        if bool((parents[1:] < 0).any()):
            raise ValueError("TokenTree.select: the kept nodes must include the root and every kept node's parent.")
        return TokenTree(self.tokens[keep], parents, self.depths[keep], self.logprobs[keep])

    def ancestor_mask(self) -> torch.Tensor:
        """``[N, N]`` bool: entry ``[i, j]`` is True when node j is node i or one of its ancestors."""
        n = self.num_nodes
        rows = torch.arange(n, device=self.device)
        mask = torch.eye(n, dtype=torch.bool, device=self.device)
        ancestor = self.parents.clone()
        while bool((ancestor >= 0).any()):
            has = ancestor >= 0
            mask[rows[has], ancestor[has]] = True
            ancestor = torch.where(has, self.parents[ancestor.clamp(min=0)], -1)
        return mask

    def positions(self, root_position: int) -> torch.Tensor:
        """Sequence position of each node when the root sits at ``root_position``."""
        return root_position + self.depths

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (empty for the root)."""
        parents = self.parents.tolist()
        path = []
        while node > 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def path_tokens(self, node: int) -> torch.Tensor:
        return self.tokens[self.path(node)]

    def children(self, node: int) -> torch.Tensor:
        return (self.parents == node).nonzero().flatten()

    def child_index(self) -> dict[tuple[int, int], int]:
        """``{(parent, token): child}`` for a walk that looks children up by token."""
        return {
            (parent, token): child
            for child, (parent, token) in enumerate(zip(self.parents.tolist(), self.tokens.tolist()))
            if parent >= 0
        }

    def best_path(self) -> list[int]:
        """The root-to-leaf path that maximises the draft's expected number of accepted tokens.

        A node on a chain is accepted with the draft probability of its whole path, ``exp(logprob)``, so the
        expected acceptance of a chain is the sum of that over its nodes; children come after parents, so one
        pass from the last node back computes each subtree's best sum.
        """
        gain = self.logprobs.double().exp().tolist()
        parents = self.parents.tolist()
        best_child = [-1] * self.num_nodes
        best_value = [0.0] * self.num_nodes
        for node in range(self.num_nodes - 1, 0, -1):
            value = gain[node] + best_value[node]
            parent = parents[node]
            if best_child[parent] < 0 or value > best_value[parent]:
                best_child[parent], best_value[parent] = node, value
        path, node = [], best_child[0]
        while node >= 0:
            path.append(node)
            node = best_child[node]
        return path
