"""Offloaded targets: placement under a memory budget (:mod:`.placement`) and the executors that run them
(accelerate's hooks, :mod:`.stream`'s read-ahead ring of buffers in CPU memory filled by :mod:`.direct_io`'s direct
reads, or :mod:`.device_stream`'s ring on an accelerator, written against the device operations of :mod:`.device`;
both lay their rings out with :mod:`.layout`).
The executors implement the adapter's :class:`~specexec_hf.hf.executor.StreamingExecutor`, through which the layer
below asks them what it needs; :func:`layer_streamer` finds a model's, typed to these classes.
A new executor goes here. ``specexec_hf.stream`` is :func:`.placement.stream` (not exported here, where the name
is the :mod:`.stream` module's)."""

from .device import CudaDevice, OrderCheckingDevice, OrderingError, StreamDevice
from .device_stream import DeviceLayerStreamer
from .direct_io import DirectReader, WeightFileError
from .folder import write_offload_folder
from .placement import load_offloaded, offload_device_map, stream_on_device, weight_units
from .stream import LayerStreamer, layer_streamer

__all__ = [
    "CudaDevice",
    "DeviceLayerStreamer",
    "DirectReader",
    "LayerStreamer",
    "OrderCheckingDevice",
    "OrderingError",
    "StreamDevice",
    "WeightFileError",
    "layer_streamer",
    "load_offloaded",
    "offload_device_map",
    "stream_on_device",
    "weight_units",
    "write_offload_folder",
]
