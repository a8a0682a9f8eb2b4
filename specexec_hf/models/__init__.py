"""Models and drafts: the default SmolLM2 pair, drafts that share their target's embedding, subset heads."""

from .default_pair import (
    draft_export_path,
    load_default_pair,
    load_default_target,
    target_cache_dir,
)
from .drafts import (
    CONTEXT_MATCH_KEY,
    GREEDY_TEMPERATURE_KEY,
    load_draft_export,
    read_draft_export,
)
from .vocab import SubsetLMHead, frequent_tokens, restrict_draft_vocabulary

__all__ = [
    "CONTEXT_MATCH_KEY",
    "GREEDY_TEMPERATURE_KEY",
    "SubsetLMHead",
    "draft_export_path",
    "frequent_tokens",
    "load_default_pair",
    "load_default_target",
    "load_draft_export",
    "read_draft_export",
    "restrict_draft_vocabulary",
    "target_cache_dir",
]
