"""Offloaded targets: placement under a memory budget (:mod:`.placement`) and the executors that run them
(accelerate's hooks, or :mod:`.stream`'s read-ahead ring of buffers). A new executor goes here, beside ``stream``."""

from .placement import load_offloaded, offload_device_map, weight_units
from .stream import LayerStreamer, layer_streamer

__all__ = ["LayerStreamer", "layer_streamer", "load_offloaded", "offload_device_map", "weight_units"]
