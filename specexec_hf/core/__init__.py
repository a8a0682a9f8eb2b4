"""The SpecExec algorithm as small torch functions over a :class:`TokenTree`; no transformers here.

- :mod:`.tree`: the token tree (parents-first nodes, depths, cumulative draft log-probs, ancestor masks);
- :mod:`.search`: the tree-search protocol (``SearchPolicy`` starts a step-by-step ``TreeSearch``) and SpecExec's
  best-first growth (``grow_tree``), and the policies by name (``tree_policy``); :mod:`.round_search`: the same
  best-first tree grown in fixed-shape rounds with no host read between draft forwards; :mod:`.static_trees`:
  SpecInfer- and Sequoia-style policies on the same protocol; further tree policies go beside them;
- :mod:`.verify`: the acceptance walk of the target's own choices down the tree, and recursive rejection sampling
  for drawn children;
- :mod:`.masks`: the tree attention masks; :mod:`.context_match`: n-gram guesses mixed into the tree's ranking;
- :mod:`.acceptance_map`: the online map from draft probability to acceptance probability;
- :mod:`.precision`: which greedy choices are within rounding of a tie; :mod:`.step_budget`: one node budget
  shared by several trees;
- :mod:`.config`: the knobs; :mod:`.stats`: what a generation reports.
"""

from .config import SpecExecConfig
from .context_match import ContextIndex, mix_context_guesses
from .masks import additive_mask, chain_and_tree_mask
from .round_search import RoundPolicy, RoundSearch
from .search import (
    TREE_POLICIES,
    BestFirstPolicy,
    BestFirstSearch,
    ExpandFn,
    SearchPolicy,
    SearchResult,
    TopCandidates,
    TreeSearch,
    grow_tree,
    register_tree_policy,
    tree_policy,
)
from .static_trees import (
    SequoiaSearch,
    SpecInferSearch,
    StaticTreeFill,
    StaticTreeSearch,
    TreeShape,
    best_first_nodes,
)
from .stats import SpecExecStats, StepStats
from .tree import TokenTree
from .verify import Acceptance, acceptance_walk, rejection_chain, rejection_sample, taken_probabilities

__all__ = [
    "TREE_POLICIES",
    "Acceptance",
    "BestFirstPolicy",
    "BestFirstSearch",
    "ContextIndex",
    "ExpandFn",
    "RoundPolicy",
    "RoundSearch",
    "SearchPolicy",
    "SearchResult",
    "SequoiaSearch",
    "SpecExecConfig",
    "SpecExecStats",
    "SpecInferSearch",
    "StaticTreeFill",
    "StaticTreeSearch",
    "StepStats",
    "TokenTree",
    "TopCandidates",
    "TreeSearch",
    "TreeShape",
    "acceptance_walk",
    "additive_mask",
    "best_first_nodes",
    "chain_and_tree_mask",
    "grow_tree",
    "mix_context_guesses",
    "register_tree_policy",
    "rejection_chain",
    "rejection_sample",
    "taken_probabilities",
    "tree_policy",
]
