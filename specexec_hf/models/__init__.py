"""Models and drafts: the default SmolLM2 pair, drafts that share their target's embedding, self-drafts (the target
quantized, or some of its layers; importing them registers the resolver of ``generate()``'s draft names), subset
heads, int8 draft layers."""

from ..core.precision import native_bfloat16_cpu
from .default_pair import (
    default_draft_dtype,
    default_target_dir,
    draft_export_path,
    export_default_pair,
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
from .int8_draft import int8_draft
from .self_draft import (
    LAYER_SELF_DRAFTS,
    SELF_DRAFTS,
    ExitAdapter,
    layer_self_draft,
    load_tuned_exit,
    resident_layers,
    resolve_draft,
    save_tuned_exit,
    self_draft,
)
from .vocab import SubsetLMHead, frequent_tokens, restrict_draft_vocabulary

__all__ = [
    "CONTEXT_MATCH_KEY",
    "ExitAdapter",
    "GREEDY_TEMPERATURE_KEY",
    "LAYER_SELF_DRAFTS",
    "SELF_DRAFTS",
    "SubsetLMHead",
    "default_draft_dtype",
    "default_target_dir",
    "draft_export_path",
    "export_default_pair",
    "frequent_tokens",
    "int8_draft",
    "load_default_pair",
    "load_default_target",
    "layer_self_draft",
    "native_bfloat16_cpu",
    "load_draft_export",
    "load_tuned_exit",
    "read_draft_export",
    "resident_layers",
    "resolve_draft",
    "restrict_draft_vocabulary",
    "save_tuned_exit",
    "self_draft",
    "target_cache_dir",
]
