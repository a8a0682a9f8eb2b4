"""The token tree SpecExec drafts and the target verifies: plain tensors, no model code.

Node 0 is the root: the last committed token, whose continuation the tree proposes. Every other node is a
draft token whose parent has a smaller index, so any prefix of the node list is a valid tree and a walk over
indices in order visits parents before children.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    # [parents, tokens, parents list, tokens list]: host copies of the lists' first nodes, valid while the tensors
    # are these objects (add_children, which only appends, carries them over).
    _host: list[Any] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_root(cls, token: int, device: torch.device | str | None = None) -> TokenTree:
        """The tree of the root alone. Its tensors are filled on the device: a ``torch.tensor`` of host values would
        be a copy from pageable memory, which makes the host wait for a CUDA device twice per tree."""
        return cls(
            tokens=torch.full((1,), token, dtype=torch.long, device=device),
            parents=torch.full((1,), -1, dtype=torch.long, device=device),
            depths=torch.zeros(1, dtype=torch.long, device=device),
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
        host = self._host
        host_is_current = host is not None and host[0] is self.parents and host[1] is self.tokens
        self.tokens = torch.cat([self.tokens, tokens.to(self.tokens)])
        self.parents = torch.cat([self.parents, parents.to(self.parents)])
        self.depths = torch.cat([self.depths, self.depths[parents] + 1])
        self.logprobs = torch.cat([self.logprobs, logprobs.to(self.logprobs)])
        if host is not None and host_is_current:
            host[:2] = self.parents, self.tokens
        return torch.arange(first, self.num_nodes, device=self.device)

    def select(self, keep: torch.Tensor) -> TokenTree:
        """The subtree of the nodes ``keep`` (ascending, containing every kept node's parent), re-indexed."""
        new_index = torch.full((self.num_nodes,), -1, dtype=torch.long, device=self.device)
        new_index[keep] = torch.arange(keep.numel(), device=self.device)
        old_parents = self.parents[keep]
        parents = torch.where(old_parents >= 0, new_index[old_parents.clamp(min=0)], -1)
        # The check reads the device; on an accelerator callers (the search) guarantee a closed set instead.
        if self.device.type == "cpu" and bool((parents[1:] < 0).any()):
            raise ValueError("TokenTree.select: the kept nodes must include the root and every kept node's parent.")
        return TokenTree(self.tokens[keep], parents, self.depths[keep], self.logprobs[keep])

    def ancestor_mask(self) -> torch.Tensor:
        """``[N, N]`` bool: entry ``[i, j]`` is True when node j is node i or one of its ancestors."""
        n = self.num_nodes
        rows = torch.arange(n, device=self.device)
        mask = torch.eye(n, dtype=torch.bool, device=self.device)
        # The root is its own parent here: a climb that reaches it stays there, marking the root again.
        parents = self.parents.clamp(min=0)
        ancestor = parents
        for _ in range(int(self.depths.max())):  # one host read for the tree's depth, none per level
            mask[rows, ancestor] = True
            ancestor = parents[ancestor]
        return mask

    def host_lists(self) -> tuple[list[int], list[int]]:
        """``(parents, tokens)`` as Python lists (not to be modified), read from the device once per tree: a tree
        grown by :meth:`add_children` reads only its new nodes."""
        parents, tokens, _ = self.host_lists_and(None)
        return parents, tokens

    def host_lists_and(self, row: torch.Tensor | None) -> tuple[list[int], list[int], list[int]]:
        """:meth:`host_lists` and ``row`` (integers, ``None``: none) as a Python list, in one read from the device."""
        if self._host is None or self._host[0] is not self.parents or self._host[1] is not self.tokens:
            self._host = [self.parents, self.tokens, [], []]
        new = self.num_nodes - len(self._host[2])
        parts = [self.parents[-new:], self.tokens[-new:]] if new else []
        if row is not None:
            parts.append(row.to(self.parents.dtype))
        values = torch.cat(parts).tolist() if parts else []
        self._host[2].extend(values[:new])
        self._host[3].extend(values[new : 2 * new])
        return self._host[2], self._host[3], values[2 * new :]

    def positions(self, root_position: int) -> torch.Tensor:
        """Sequence position of each node when the root sits at ``root_position``."""
        return root_position + self.depths

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (empty for the root)."""
        parents, _ = self.host_lists()
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
            for child, (parent, token) in enumerate(zip(*self.host_lists()))
            if parent >= 0
        }

    def likeliest_children(self) -> list[int]:
        """Per node, its child with the highest draft log-probability (the first one on a tie), ``-1`` for a leaf:
        where the walk goes when the draft is right (one host read)."""
        logprobs = self.logprobs.tolist()
        parents, _ = self.host_lists()
        likeliest = [-1] * self.num_nodes
        for node in range(1, self.num_nodes):
            best = likeliest[parents[node]]
            if best < 0 or logprobs[node] > logprobs[best]:
                likeliest[parents[node]] = node
        return likeliest

    def best_path(self) -> list[int]:
        """The root-to-leaf path that maximises the draft's expected number of accepted tokens.

        A node on a chain is accepted with the draft probability of its whole path, ``exp(logprob)``, so the
        expected acceptance of a chain is the sum of that over its nodes; children come after parents, so one
        pass from the last node back computes each subtree's best sum.
        """
        gain = self.logprobs.double().exp().tolist()
        parents, _ = self.host_lists()
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

    def best_chain(self) -> torch.Tensor:
        """``[k]`` the tokens of :meth:`best_path`: the chain proposed where one chain is verified instead of the
        tree (transformers' assisted loop, vLLM's chain mode)."""
        return self.tokens[self.best_path()]
