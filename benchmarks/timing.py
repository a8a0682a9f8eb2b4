"""Timing shared by the benchmarks: a time budget, device synchronisation, forward and ``generate()`` timers.

Each timer is written once here; a benchmark that needs another figure adds it to the row these return rather
than timing a forward or a generation its own way.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

import specexec_hf
from specexec_hf.tools.bench import ForwardMeter

CPU = torch.device("cpu")


class Deadline:
    """The benchmark's time budget: sections ask whether an estimated amount of work still fits.

    Args:
        seconds: The whole budget, from construction.
    """

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return self.left() > seconds


def synchronize(device: torch.device) -> None:
    """Waits for everything queued on ``device``: compute and copies."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synchronize_compute(device: torch.device) -> None:
    """Waits for the compute queue only: copies the forward issued for the next one may still run."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def warm_median_seconds(
    work: Callable[[], Any], repeats: int, device: torch.device, between: Callable[[], Any] = lambda: None
) -> float:
    """Median seconds of ``repeats`` calls of ``work`` after a first call whose time is dropped (the warm-up), each
    from an idle device to its end; ``between`` runs untimed after every call."""
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        started = time.perf_counter()
        work()
        synchronize(device)
        times.append(time.perf_counter() - started)
        between()
    return median(times[1:])


# A generate()'s wall time, the parts spent in the target's and the draft's forwards, and the host's rest (the tree
# search, verification, generate()'s own loop).
TIME_SPLIT = ("seconds", "target_seconds", "draft_seconds", "host_seconds")


@dataclass
class DeviceForwardMeter(ForwardMeter):
    """A :class:`ForwardMeter` that also brackets each outermost forward with CUDA events on the current stream.

    Host clocks around a forward end when the host stops launching, not when the device is done: a forward's queued
    work then lands in whichever call next waits for the device (the next draft forward, say). The events time each
    forward where the device runs it (:meth:`device_seconds`).
    """

    spans: list[list[Any]] = field(default_factory=list)

    def _before(self, module, args) -> None:
        if self._depth == 0:
            self.spans.append([recorded_event()])
        super()._before(module, args)

    def _after(self, module, args, output) -> None:
        super()._after(module, args, output)
        if self._depth == 0:
            self.spans[-1].append(recorded_event())

    def device_seconds(self) -> float:
        """The summed spans of the forwards on the device, once it has run them all."""
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.spans) / 1e3


def recorded_event() -> torch.cuda.Event:
    """A timing CUDA event recorded on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def metered_seconds(meter: ForwardMeter | None) -> float:
    """Seconds in a meter's forwards: the device's on CUDA (:class:`DeviceForwardMeter`), else the host's clocks."""
    if meter is None:
        return 0.0
    return meter.device_seconds() if isinstance(meter, DeviceForwardMeter) else meter.seconds


def timed_generate(
    model: torch.nn.Module, inputs: dict, max_new_tokens: int, device: torch.device = CPU, **kwargs: Any
) -> dict[str, Any]:
    """One ``generate()``, greedy unless ``kwargs`` say ``do_sample=True``: new tokens, seconds, forward counts of the
    target and of any draft, and the seconds spent in each one's forwards (:data:`TIME_SPLIT`; on CUDA by CUDA events,
    elsewhere by host clocks); with SpecExec also its tokens per target forward, its trees' sizes and its own clocks:
    ``tree_seconds`` growing the trees (the draft's forwards and the search between them) and ``verify_seconds``.
    """
    stats = specexec_hf.SpecExecStats() if kwargs.get("speculator") else None
    draft = kwargs.get("assistant_model")
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
    meter = DeviceForwardMeter if device.type == "cuda" else ForwardMeter
    with ExitStack() as metering:
        target_meter = metering.enter_context(meter(model))
        draft_meter = metering.enter_context(meter(draft)) if draft is not None else None
        synchronize(device)
        started = time.perf_counter()
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, **{"do_sample": False, **kwargs},
                                **({"specexec_stats": stats} if stats else {}))
        tokens = output[0, inputs["input_ids"].shape[1] :].tolist()
        synchronize(device)
        seconds = time.perf_counter() - started
    row = {"tokens": tokens, "seconds": seconds, "target_seconds": metered_seconds(target_meter),
           "draft_seconds": metered_seconds(draft_meter)}
    row["host_seconds"] = seconds - row["target_seconds"] - row["draft_seconds"]
    if stats is not None:
        row.update(target_forwards=stats.target_forwards, draft_forwards=stats.draft_forwards,
                   tokens_per_target_forward=stats.tokens_per_target_forward, tree_seconds=stats.draft_seconds,
                   verify_seconds=stats.target_seconds, tree_sizes=[step.tree_size for step in stats.steps])
    else:
        row.update(target_forwards=target_meter.calls, draft_forwards=draft_meter.calls if draft_meter else 0)
    return row


@torch.no_grad()
def forward_seconds(model: torch.nn.Module, input_ids: torch.Tensor, repeats: int, logits: int = 0) -> list[float]:
    """Wall seconds of each of ``repeats`` uncached forwards over ``input_ids``, with logits for the last ``logits``
    tokens (0: all)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        model(input_ids=input_ids, use_cache=False, logits_to_keep=logits)
        times.append(time.perf_counter() - started)
    return times


def median_forward_seconds(model: torch.nn.Module, tokens: int, repeats: int, logits: int = 0) -> float:
    """Median wall seconds of one forward over ``tokens`` fresh random tokens after a 1-token warm-up, with logits for
    the last ``logits`` of them (0: all)."""
    ids = torch.randint(100, 10_000, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    forward_seconds(model, ids[:, :1], 1)
    return statistics.median(forward_seconds(model, ids, repeats, logits))
