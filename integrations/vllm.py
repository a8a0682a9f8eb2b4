"""The names vLLM configurations written before :mod:`specexec_hf.vllm` use: ``"model":
"specexec_hf.integrations.vllm.SpecExecProposer"`` in a ``speculative_config`` and the
``specexec_hf.integrations.vllm:offload_plugin`` entry point of installs made before it moved. New configurations
name ``specexec_hf.vllm.SpecExecProposer``."""

from ..vllm import ProposerSettings, SpecExecProposer, offload_plugin
from ..vllm.settings import DRAFT_VOCAB_FILE, read_token_ids

__all__ = ["DRAFT_VOCAB_FILE", "ProposerSettings", "SpecExecProposer", "offload_plugin", "read_token_ids"]
