"""SpecExec speculative decoding for Hugging Face ``generate()``, pipelines, offloaded models and vLLM.

``import specexec_hf`` makes ``model.generate(..., assistant_model=draft, speculator="specexec")`` available;
``model.generate(..., assistant_model=draft, custom_generate=specexec_hf.generate)`` works without the patch.
"""

from .core import (
    Acceptance,
    BestFirstSearch,
    SearchResult,
    SpecExecConfig,
    SpecExecStats,
    StepStats,
    TokenTree,
    acceptance_walk,
    grow_tree,
)
from .hf import (
    LearntState,
    SpecExecCandidateGenerator,
    SpecExecDecoderOnlyOutput,
    TreeBatch,
    TreeLogitsProcessor,
    generate,
    grow_trees,
)
from .models import load_default_pair, load_default_target
from .offload import LayerStreamer, layer_streamer, load_offloaded
from .offload.placement import stream

__version__ = "0.1.0"


def _install_generate_patch() -> None:
    import warnings

    from .patches import transformers_generate

    try:
        transformers_generate.apply()
    except transformers_generate.UnsupportedTransformersVersion as error:
        warnings.warn(
            f"{error} speculator='specexec' is unavailable; custom_generate=specexec_hf.generate may work.",
            stacklevel=1,
        )


_install_generate_patch()

__all__ = [
    "Acceptance",
    "BestFirstSearch",
    "LayerStreamer",
    "LearntState",
    "SearchResult",
    "SpecExecCandidateGenerator",
    "SpecExecConfig",
    "SpecExecDecoderOnlyOutput",
    "SpecExecStats",
    "StepStats",
    "TokenTree",
    "TreeBatch",
    "TreeLogitsProcessor",
    "acceptance_walk",
    "generate",
    "grow_tree",
    "grow_trees",
    "layer_streamer",
    "load_default_pair",
    "load_default_target",
    "load_offloaded",
    "stream",
]
