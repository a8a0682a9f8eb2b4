"""The draft side: a transformers ``CandidateGenerator`` that grows SpecExec trees with a small causal LM."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from .compat import check_supported, model_logits
from .config import SpecExecConfig
from .kv import compact_cache
from .search import SearchFn, SearchResult, grow_tree
from .tree import TokenTree


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SpecExecCandidateGenerator(CandidateGenerator):
    """Grows SpecExec token trees with a draft model, reusing the draft's KV cache across calls.

    The generator only ever needs the token history: on each call it keeps the longest part of its cache that
    matches the history (the committed tokens plus any accepted tree nodes it had already fed), cuts the rest,
    and feeds the draft only the tokens it has not seen. That serves the Hugging Face loop (history grows by the
    accepted tokens) and serving engines (history may be anything) with the same code.

    Args:
        draft_model: A causal LM sharing the target's tokenizer.
        config: Tree-growth knobs.
        temperature: Temperature applied to the draft's logits before ranking the tree.
        search: The tree-growth policy; SpecExec's best-first ``grow_tree`` unless a baseline is being measured.
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        config: SpecExecConfig,
        temperature: float = 1.0,
        search: SearchFn = grow_tree,
    ):
        check_supported(draft_model, "draft")
        self.draft_model = draft_model
        self.config = config
        self.temperature = temperature
        self.search = search
        self.cache = DynamicCache(config=draft_model.config)
        self.cached_ids: list[int] = []
        # The last search's candidate pool, whose root is cached_ids[-1], and each pool node's cache slot (-1: not
        # fed). Accepted nodes that were fed are kept on the next call instead of being fed again.
        self._pool: TokenTree | None = None
        self._pool_slots = torch.empty(0, dtype=torch.long)

    def grow_tree(self, input_ids: torch.Tensor, max_depth: int | None = None) -> SearchResult:
        """Grows the tree whose root is the last token of ``input_ids`` (shape ``[1, L]``)."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"SpecExec drafts one sequence at a time; got a batch of {input_ids.shape[0]}.")
        history = input_ids[0].tolist()
        self._sync_cache(history)
        # The draft may live on a faster device than the target (offloading): grow the tree where the draft is.
        device = self.draft_model.device
        pending = torch.tensor(history[len(self.cached_ids) :], dtype=torch.long, device=device)
        root_position = len(history) - 1

        def expand(pool: TokenTree, nodes: torch.Tensor) -> torch.Tensor:
            if self._pool is None:  # the first forward feeds the unseen history, ending with the root
                positions = torch.arange(len(self.cached_ids), len(history), device=device)
                logits = model_logits(self.draft_model, pending, positions, self.cache, 1)
                self.cached_ids = list(history)
                self._pool = pool
                self._pool_slots = torch.full((1,), root_position, dtype=torch.long, device=device)
                return self._logprobs(logits)
            logits = self._forward_nodes(pool, nodes, root_position)
            return self._logprobs(logits)

        return self.search(history[-1], expand, self.config, max_depth=max_depth, device=device)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, None]:
        """The tree's chain with the highest expected acceptance, appended to ``input_ids`` (for chain verifiers)."""
        result = self.grow_tree(input_ids, max_depth=kwargs.get("max_depth"))
        chain = result.tree.tokens[result.tree.best_path()]
        return torch.cat([input_ids, chain[None].to(input_ids)], dim=-1), None

    def _logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        # Dividing by 1.0 would still copy the [nodes, vocab] logits.
        scaled = logits if self.temperature == 1.0 else logits / self.temperature
        return torch.log_softmax(scaled, dim=-1)

    def _forward_nodes(self, pool: TokenTree, nodes: torch.Tensor, root_position: int) -> torch.Tensor:
        """Feeds pool ``nodes`` (whose ancestors are all in the cache already) in one batched draft call."""
        cache_length = self.cache.get_seq_length()
        slots = torch.full((pool.num_nodes,), -1, dtype=torch.long, device=pool.device)
        slots[: self._pool_slots.numel()] = self._pool_slots
        count = nodes.numel()
        rows = torch.arange(count, device=pool.device)
        visible = torch.zeros(count, cache_length + count, dtype=torch.bool, device=pool.device)
        visible[:, : len(self.cached_ids)] = True
        visible[rows, cache_length + rows] = True
        ancestor = pool.parents[nodes]
        while bool((ancestor > 0).any()):  # the root (node 0) is a committed token, visible already
            has = ancestor > 0
            visible[rows[has], slots[ancestor[has]]] = True
            ancestor = torch.where(has, pool.parents[ancestor.clamp(min=0)], 0)
        positions = pool.positions(root_position)[nodes]
        logits = model_logits(self.draft_model, pool.tokens[nodes], positions, self.cache, count, visible)
        slots[nodes] = cache_length + rows
        self._pool, self._pool_slots = pool, slots
        return logits

    def _sync_cache(self, history: list[int]) -> None:
        """Cuts the cache back to the longest stretch that still matches ``history``, minus its last token."""
        keep = min(_common_prefix_length(self.cached_ids, history), len(history) - 1)
        accepted_slots: list[int] = []
        if self._pool is not None and keep == len(self.cached_ids):
            # The history continues from the last tree's root: keep the fed nodes along that continuation.
            child_of = self._pool.child_index()
            slots = self._pool_slots.tolist()
            node = 0
            for token in history[keep : len(history) - 1]:
                node = child_of.get((node, token), -1)
                if node < 0 or node >= len(slots) or slots[node] < 0:
                    break
                accepted_slots.append(slots[node])
        compact_cache(self.cache, keep, torch.tensor(accepted_slots, dtype=torch.long))
        self.cached_ids = history[: keep + len(accepted_slots)]
        self._pool = None
