"""One-time hints for offloaded targets: the streaming executor is faster than accelerate's hooks, and a read-ahead
too shallow for SpecExec leaves the disk idle while the draft grows each tree.

It lives in the adapter layer, below :mod:`specexec_hf.offload`, so that the generate path can call it; it tells
accelerate's hooks by their attributes and asks the streaming executor through :mod:`.executor`'s protocol, importing
nothing from the executors.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from torch import nn

from ..core.stats import StepStats
from .executor import executor_of

logger = logging.getLogger(__name__)
_hinted = False
_hinted_read_ahead = False
MIN_WATCHED_FORWARDS = 8  # tree forwards a generate() call needs before its read-ahead is judged
IDLE_SHARE = 0.25  # idle disk time before a forward, as a share of the forward, that makes the hint worth giving


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


class ReadAheadWatch:
    """Watches one ``generate()`` call on a target run by the streaming executor for a disk that went idle before
    the tree forwards: every unit read ahead had landed while the draft was still growing the tree.

    The units the disk could have read meanwhile are estimated from the forward's time per unit it reads (a forward
    is at least the disk's time for the units not read ahead, so the estimate errs low); the hint names the depth
    with the smallest ring that reads at least that many ahead (units going round the ring unevenly get buffers of
    their own, so a deeper ring can be smaller), or else the deepest ring that still streams.

    Args:
        model: The target (streamed when :func:`~.executor.executor_of` finds its executor; otherwise the watch does
            nothing).
        steps: The call's statistics steps, to which :meth:`finish` looks for the steps added since.
    """

    def __init__(self, model: nn.Module, steps: list[StepStats]):
        self._streamer = executor_of(model)
        self._steps, self._first_step = steps, len(steps)
        if self._streamer is not None:
            self._forwards = self._streamer.forwards_begun
            self._idle = self._streamer.read_ahead_idle_seconds

    def finish(self) -> bool:
        """Logs once per process, as a warning, the deeper read-ahead that would keep the disk reading through the
        drafting, when the call's forwards found the disk idle for at least :data:`IDLE_SHARE` of a forward on
        average. Returns whether this call logged it."""
        global _hinted_read_ahead
        streamer = self._streamer
        if _hinted_read_ahead or streamer is None:
            return False
        steps: Sequence[StepStats] = self._steps[self._first_step :]
        forwards = streamer.forwards_begun - self._forwards
        # The streamer's first forwards are not judged: a first call's draft is slowed by lazy initialisations.
        if self._forwards < MIN_WATCHED_FORWARDS or forwards < MIN_WATCHED_FORWARDS or not steps:
            return False
        if streamer.cycling_units <= streamer.prefetch:  # every unit stays loaded: nothing is read ahead
            return False
        idle = (streamer.read_ahead_idle_seconds - self._idle) / forwards
        forward = sum(step.target_seconds for step in steps) / len(steps)
        if idle < IDLE_SHARE * forward:
            return False
        per_unit = forward / (streamer.cycling_units - streamer.prefetch)
        needed = streamer.prefetch + math.ceil(idle / per_unit)
        ring = {depth: streamer.ring_bytes_at(depth) for depth in range(streamer.prefetch + 1, streamer.cycling_units)}
        # Depths whose ring still streams: at cycling_units - 1, or wherever leftover units fill it, every unit stays.
        streaming = [depth for depth, size in ring.items() if size < ring[streamer.cycling_units - 1]] if ring else []
        if not streaming:
            return False
        reaching = [depth for depth in streaming if depth >= needed]
        deeper = min(reaching, key=lambda depth: (ring[depth], depth)) if reaching else max(streaming)
        _hinted_read_ahead = True
        logger.warning(
            f"The disk sat idle {1000 * idle:.0f} ms before each target forward on average ({forwards} forwards): the "
            f"{streamer.prefetch} units it reads ahead had landed while the draft was still growing the tree. "
            f"prefetch={deeper} (load_offloaded(..., prefetch={deeper}) or specexec_hf.stream(model, "
            f"prefetch={deeper})) would keep it reading through the drafting, for about "
            f"{(ring[deeper] - streamer.buffer_bytes) / 1e6:.0f} MB more memory "
            "(docs/offloading.md, 'What hides under the weight stream')."
        )
        return True
