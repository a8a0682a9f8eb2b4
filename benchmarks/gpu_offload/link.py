"""Section 1, the link: pinned and pageable host-to-device copy bandwidth, the bound every streamed forward is
measured against."""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.shapes import GB
from benchmarks.timing import median


def link_bandwidth(device: torch.device, size_bytes: int, repeats: int) -> dict[str, Any]:
    """Host-to-device copy bandwidth in GB/s (1e9 bytes), pinned and pageable.

    On a CPU there is no link: a host memcpy is timed instead, so the rest of the report has a bound to divide
    by; it is labelled so.

    Args:
        device: The GPU, or the CPU for the stand-in.
        size_bytes: Bytes per copy (a pinned buffer is allocated at exactly this size).
        repeats: Timed copies per kind, after two warm-ups.
    """
    source = torch.randint(0, 256, (size_bytes,), dtype=torch.uint8)
    if device.type != "cuda":
        target = torch.empty_like(source)
        rates = []
        for index in range(repeats + 2):
            started = time.perf_counter()
            target.copy_(source)
            if index >= 2:
                rates.append(size_bytes / (time.perf_counter() - started) / GB)
        return {"kind": "host memcpy (no CUDA: a stand-in for the link)", "bytes": size_bytes,
                "pinned_gbps": median(rates), "pinned_gbps_max": max(rates), "pageable_gbps": median(rates)}
    target = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    result: dict[str, Any] = {"kind": f"host to {torch.cuda.get_device_name(device)}", "bytes": size_bytes}
    for name, host in (("pinned", source.pin_memory()), ("pageable", source)):
        rates = []
        for index in range(repeats + 2):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(host, non_blocking=True)
            stop.record()
            stop.synchronize()
            if index >= 2:
                rates.append(size_bytes / (start.elapsed_time(stop) / 1e3) / GB)
        result[f"{name}_gbps"] = median(rates)
        result[f"{name}_gbps_max"] = max(rates)
        del host
    return result
