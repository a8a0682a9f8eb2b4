"""The device operations a streaming executor needs: buffers, exact-size pinned host memory, async copies, events.

:class:`~.device_stream.DeviceLayerStreamer` is written against :class:`StreamDevice` only. :class:`CudaDevice`
implements it with a dedicated copy stream and CUDA events; :class:`OrderCheckingDevice` implements it on the CPU
for tests: it runs copies from a queue, only when something waits for them, and raises :class:`OrderingError` for
a copy that could overwrite a buffer the compute may still read, or a copy from memory that is not pinned.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

# CUDA's caching allocator hands out blocks aligned to 512 bytes: every weight of an in-memory model on the GPU
# starts at such an address, which ring-buffer views reproduce so that kernels pick the same code paths.
CUDA_ALLOCATION_ALIGNMENT = 512


class StreamDevice(ABC):
    """Where a streamed model computes, and how weights get there.

    Two queues are involved: the *compute* queue, where the model's kernels run in call order, and a *copy* queue,
    where host-to-device copies run in issue order. Events order one against the other.

    Attributes:
        device: The execution device.
        alignment: The allocation alignment of an in-memory model's tensors on ``device``.
    """

    device: torch.device
    alignment: int

    @abstractmethod
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` buffer of ``nbytes`` on the device."""

    @abstractmethod
    def pin(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` host buffer of exactly ``nbytes``, page-locked, so copies from it run asynchronously."""

    @abstractmethod
    def unpin(self, host: torch.Tensor) -> None:
        """Releases the page lock of a buffer from :meth:`pin` (its copies must have completed)."""

    @abstractmethod
    def copy(self, target: torch.Tensor, source: torch.Tensor, after: Any | None) -> Any:
        """Queues ``target.copy_(source)`` (device <- pinned host) on the copy queue; returns its done event.

        Args:
            target: Device bytes.
            source: Pinned host bytes of the same size.
            after: An event from :meth:`compute_record` the copy waits for first (the compute that last read
                ``target`` is done), or ``None``.
        """

    @abstractmethod
    def compute_wait(self, event: Any) -> None:
        """Makes the compute queue wait for ``event`` (a copy's) before running what is issued next."""

    @abstractmethod
    def compute_record(self) -> Any:
        """An event that completes when the compute issued so far has run."""

    @abstractmethod
    def host_wait(self, event: Any) -> None:
        """Blocks the calling thread until ``event`` has completed."""

    @abstractmethod
    def drain(self) -> None:
        """Blocks the calling thread until every copy queued so far has run (before releasing memory)."""


class CudaDevice(StreamDevice):
    """:class:`StreamDevice` on a CUDA GPU: a dedicated copy stream, events, memory pinned with ``cudaHostRegister``.

    ``torch``'s pinned allocator rounds sizes up to powers of two (a 1.1 GB layer would pin 2 GB); registering a
    plain allocation pins exactly its size.

    Args:
        device: The GPU, e.g. ``0`` or ``"cuda:0"``.

    Raises:
        RuntimeError: CUDA is not available.
    """

    alignment = CUDA_ALLOCATION_ALIGNMENT

    def __init__(self, device: int | str | torch.device):
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"max_memory places modules on GPU {device!r}, but CUDA is not available to torch: install a CUDA "
                "build of torch, or use a CPU/disk budget such as max_memory={'cpu': '12GiB'}."
            )
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._copy_stream = torch.cuda.Stream(self.device)
        self._registered: set[int] = set()  # addresses of the buffers pin() registered with cudaHostRegister

    def allocate(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        # Freed blocks must not be reused before the copy stream's last write into them has run.
        buffer.record_stream(self._copy_stream)
        return buffer

    def pin(self, nbytes: int) -> torch.Tensor:
        host = torch.empty(nbytes, dtype=torch.uint8)
        if not nbytes:
            return host
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.device):  # registered for this GPU's context, whichever device is current
            status = cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
            if status == cudart.cudaError.success:
                self._registered.add(host.data_ptr())
                return host
            # Registration can fail where plain allocations cannot be page-locked (some containers, a memlock
            # limit): torch's pinned allocator then pins a buffer rounded up to a power of two, at twice the RAM
            # at worst. The failed call's error is cleared first: torch's next kernel-launch check would raise it.
            _clear_last_cuda_error()
            warnings.warn(f"cudaHostRegister of {nbytes} bytes failed ({status}): pinning with torch's allocator "
                          "instead, which rounds the size up to a power of two", RuntimeWarning, stacklevel=2)
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def unpin(self, host: torch.Tensor) -> None:
        if host.data_ptr() in self._registered:  # torch's pinned allocator frees its buffers itself
            self._registered.discard(host.data_ptr())
            with torch.cuda.device(self.device):
                torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(host.data_ptr()))

    def copy(self, target: torch.Tensor, source: torch.Tensor, after: torch.cuda.Event | None) -> torch.cuda.Event:
        with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):  # also from the reader thread
            if after is not None:
                self._copy_stream.wait_event(after)
            target.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        return done

    def compute_wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def compute_record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def host_wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def drain(self) -> None:
        self._copy_stream.synchronize()


def _clear_last_cuda_error() -> None:
    """Calls ``cudaGetLastError`` (which ``torch.cuda.cudart()`` does not bind) in the CUDA runtime torch loaded.

    Raises:
        RuntimeError: No loaded library exports it (then a later kernel-launch check would report a stale error).
    """
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "libcudart" in line}
    for library in [*sorted(libraries), None]:  # None: the symbols of the process, for a runtime linked statically
        clear = getattr(ctypes.CDLL(library), "cudaGetLastError", None)
        if clear is not None:
            clear()
            return
    raise RuntimeError("cannot clear the error of a failed CUDA call: no loaded library exports cudaGetLastError")


class OrderingError(RuntimeError):
    """A streamer broke the ordering rules :class:`OrderCheckingDevice` checks."""


@dataclass(eq=False)
class _FakeEvent:
    """A copy's done event (``target`` set) or a compute event (``clock`` set)."""

    target: int | None = None
    clock: int = -1
    done: bool = False
    error: BaseException | None = None


class OrderCheckingDevice(StreamDevice):
    """A CPU stand-in for an accelerator that runs copies late and checks the streamer orders them right.

    Copies are queued and run, in issue order, only when an event at or after them is waited for (by the
    compute or the host), as a copy stream may run arbitrarily late: a compute that reads a buffer without
    waiting for its copy sees stale weights. Each compute wait "opens" the copied buffer to the compute; a later
    copy into an open buffer must wait for a compute event recorded after that opening, or :class:`OrderingError`
    is raised. A fresh allocation is open too: a caching allocator hands out memory that compute queued before
    may still use, so the first copy into it must also wait for a compute event recorded after the allocation.
    Copies must come from buffers of :meth:`pin`. Thread-safe (a reader thread issues copies too).

    Args:
        fail_copies: Numbers (1-based, in issue order) of copies that fail when they run, to test error paths.
        refuse_copies: Numbers (1-based, counting every call of :meth:`copy`) of copies refused when issued, as
            an enqueue error of CUDA would be: :meth:`copy` raises ``RuntimeError`` and queues nothing.
    """

    device = torch.device("cpu")
    alignment = CUDA_ALLOCATION_ALIGNMENT

    def __init__(
        self,
        fail_copies: set[int] | frozenset[int] = frozenset(),
        refuse_copies: set[int] | frozenset[int] = frozenset(),
    ):
        self._fail_copies = set(fail_copies)
        self.refuse_copies = set(refuse_copies)  # may be changed between forwards
        self._copy_calls = 0
        self._lock = threading.RLock()
        self._queue: deque[tuple[_FakeEvent, torch.Tensor, torch.Tensor, int]] = deque()
        self._open: dict[int, int] = {}  # buffer address -> compute clock at which the compute started reading it
        self._clock = 0
        self.copies_issued = 0
        self.bytes_copied = 0  # by the copies issued
        self.pinned: dict[int, int] = {}  # address -> bytes of the live pinned buffers
        self.pinned_sizes: list[int] = []  # every pin() ever made, in order

    def allocate(self, nbytes: int) -> torch.Tensor:
        padded = torch.full((nbytes + self.alignment,), 0xFF, dtype=torch.uint8)  # NaN-like bytes until copied
        start = -padded.data_ptr() % self.alignment  # aligned as CUDA's allocator aligns
        buffer = padded[start : start + nbytes]
        with self._lock:
            self._open[buffer.data_ptr()] = self._clock  # compute issued so far may still use this memory
        return buffer

    def pin(self, nbytes: int) -> torch.Tensor:
        host = torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            self.pinned[host.data_ptr()] = nbytes
            self.pinned_sizes.append(nbytes)
        return host

    def unpin(self, host: torch.Tensor) -> None:
        with self._lock:
            del self.pinned[host.data_ptr()]

    def copy(self, target: torch.Tensor, source: torch.Tensor, after: _FakeEvent | None) -> _FakeEvent:
        with self._lock:
            self._copy_calls += 1
            if self._copy_calls in self.refuse_copies:
                raise RuntimeError(f"injected refusal of copy call {self._copy_calls}")
            if not self._is_pinned(source):
                raise OrderingError("copy from host memory that is not pinned: it could not run asynchronously")
            opened = self._open.pop(target.data_ptr(), None)
            if opened is not None and (after is None or after.target is not None or after.clock <= opened):
                raise OrderingError(
                    "copy into a buffer the compute may still read: it must wait for a compute event recorded after "
                    "the layer that used the buffer"
                )
            self.copies_issued += 1
            self.bytes_copied += source.numel() * source.element_size()
            event = _FakeEvent(target=target.data_ptr())
            self._queue.append((event, target, source, self.copies_issued))
            return event

    def compute_wait(self, event: _FakeEvent) -> None:
        with self._lock:
            self._run_through(event)
            if event.error is not None:  # the compute cannot run, so it reads nothing
                raise event.error
            self._open[event.target] = self._clock
            self._clock += 1

    def compute_record(self) -> _FakeEvent:
        with self._lock:
            self._clock += 1
            return _FakeEvent(clock=self._clock, done=True)

    def host_wait(self, event: _FakeEvent) -> None:
        with self._lock:
            self._run_through(event)

    def drain(self) -> None:
        with self._lock:
            if self._queue:
                self._run_through(self._queue[-1][0])

    def _is_pinned(self, source: torch.Tensor) -> bool:
        address, size = source.data_ptr(), source.numel() * source.element_size()
        return any(start <= address and address + size <= start + nbytes for start, nbytes in self.pinned.items())

    def _run_through(self, event: _FakeEvent) -> None:
        """Runs queued copies in issue order up to and including ``event``'s."""
        while not event.done:
            queued, target, source, number = self._queue.popleft()
            try:
                if number in self._fail_copies:
                    raise RuntimeError(f"injected failure of copy {number}")
                target.copy_(source)
            except RuntimeError as error:  # surfaces where the copy is waited for, as an async CUDA error would
                queued.error = error
            queued.done = True
