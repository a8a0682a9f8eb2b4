"""Offloaded targets: placement under a memory budget (:mod:`.placement`) and the executors that run them
(accelerate's hooks, :mod:`.stream`'s read-ahead ring of buffers in CPU memory, or :mod:`.device_stream`'s ring on
an accelerator, written against the device operations of :mod:`.device`). A new executor goes here."""

from .device import CudaDevice, OrderCheckingDevice, OrderingError, StreamDevice
from .device_stream import DeviceLayerStreamer
from .placement import load_offloaded, offload_device_map, stream_on_device, weight_units
from .stream import LayerStreamer, layer_streamer

__all__ = [
    "CudaDevice",
    "DeviceLayerStreamer",
    "LayerStreamer",
    "OrderCheckingDevice",
    "OrderingError",
    "StreamDevice",
    "layer_streamer",
    "load_offloaded",
    "offload_device_map",
    "stream_on_device",
    "weight_units",
]
