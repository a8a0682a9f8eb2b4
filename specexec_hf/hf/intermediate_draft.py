"""The intermediate level of a draft hierarchy (TriForce): a model between the draft and the target.

The draft grows a large tree (``draft_budget`` nodes); the intermediate model scores all of it in one tree forward
(:class:`~.tree_scorer.TreeScorer`, its own KV cache kept across steps like the target's); the target verifies the
``budget`` nodes the intermediate rates likeliest, plus the intermediate's own likeliest token under any node where
the draft missed it (:func:`~specexec_hf.core.hierarchy.rescored_tree`). It pays when the intermediate agrees with
the target much better than the draft does and costs much less than the target's forward: a target streamed from
disk or to a GPU with an intermediate held in fast memory. The output is the target's either way.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..core.hierarchy import rescored_tree
from ..core.search import SearchResult
from .request import Request
from .tree_scorer import TreeScorer

HIERARCHY_DRAFT_FACTOR = 4
"""With an intermediate model and no ``draft_budget``: how many times the budget the draft's tree holds."""


class IntermediateDraft:
    """Re-ranks each draft tree with an intermediate model and cuts it to the target's budget.

    Args:
        model: The intermediate causal LM (sharing the target's tokenizer).
        request: The checked inputs, as the target sees them.
        budget: Nodes the target verifies per tree.
        draft_budget: Nodes of the draft's tree, which the intermediate scores.
    """

    def __init__(self, model: PreTrainedModel, request: Request, budget: int, draft_budget: int):
        self.scorer = TreeScorer(model, request)
        self.budget, self.draft_budget = budget, draft_budget
        self._source: list[int] = []  # per node of the last re-ranked tree, its node in the draft's tree (-1: added)

    def rescore(self, sequence: torch.Tensor, grown: SearchResult, max_depth: int | None) -> SearchResult:
        """The target's tree from the draft's ``grown`` one, scored after the committed ``sequence`` (``[1, L]``,
        left padding included).

        Args:
            sequence: The committed tokens.
            grown: The draft's search result.
            max_depth: Deepest level a node the intermediate adds may sit at.
        """
        logits = self.scorer.score(sequence, grown.tree).all()
        tree, source = rescored_tree(grown.tree, torch.log_softmax(logits, dim=-1), self.budget, max_depth)
        self._source = source.tolist()
        pool_index = torch.arange(tree.num_nodes, device=tree.device)
        return SearchResult(tree, tree, pool_index, grown.draft_forwards)

    def keep(self, length: int, accepted: list[int]) -> None:
        """After the target's walk of the last re-ranked tree: keeps the committed ``length`` tokens and the
        accepted nodes the intermediate scored (the walk's nodes up to the first one it added itself)."""
        scored = []
        for node in accepted:
            if self._source[node] < 0:
                break
            scored.append(self._source[node])
        self.scorer.keep(length, scored)
