"""A one-time hint for a model that runs disk-offloaded modules on accelerate's hooks: the streaming executor is faster.

It lives in the adapter layer, below :mod:`specexec_hf.offload`, so that the generate path can call it; it tells
accelerate's hooks apart by their attributes and imports nothing from the executors.
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)
_hinted = False


def hint_streaming_executor(model: nn.Module) -> bool:
    """Logs once per process, as a warning, that ``specexec_hf.stream(model)`` would run ``model`` faster.

    The hint is given when ``model`` places modules on disk (``hf_device_map``) and still runs them on
    accelerate's offloading hooks, which read each weight from disk when its module runs, with no read-ahead.

    Args:
        model: The target about to generate.

    Returns:
        Whether the hint was logged by this call.
    """
    global _hinted
    if _hinted or "disk" not in (getattr(model, "hf_device_map", None) or {}).values():
        return False
    if not any(_offloads(getattr(module, "_hf_hook", None)) for module in model.modules()):
        return False
    _hinted = True
    logger.warning(
        "This model runs its disk-offloaded modules on accelerate's hooks, which read each weight as it is needed; "
        "`model = specexec_hf.stream(model)` reads them ahead with direct I/O, several times faster per forward, "
        "with the same outputs."
    )
    return True


def _offloads(hook: object) -> bool:
    """Whether an accelerate hook (or one of a ``SequentialHook``'s) loads offloaded weights."""
    if hook is None:
        return False
    return any(getattr(single, "offload", False) for single in getattr(hook, "hooks", [hook]))
