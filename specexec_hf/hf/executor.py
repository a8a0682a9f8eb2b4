"""The seam between this adapter and the executors that stream a target's weights (``specexec_hf.offload``).

The import rule (CONTRIBUTING.md) ranks ``offload`` above ``hf``: nothing here may import an executor, yet the decode
path has questions for a streamed target's executor (which modules it streams, how deep it reads ahead, how long
the disk sat idle, the ring's size at another depth, one call at a time). :class:`StreamingExecutor` is exactly
those questions; the executors implement it and attach themselves to their model through :func:`attach_executor`,
and this layer finds them through :func:`executor_of`, typed, by no other route.

The executor is held in one attribute of the model, which only this module names, rather than in a registry keyed
weakly by the model: an executor refers back to its model (the hooks it registers, the forwards it wraps and that
:meth:`StreamingExecutor.close` restores), and a weak-keyed registry whose values reach their keys keeps every
streamed model alive; as an attribute, the model and its executor form one cycle the garbage collector frees
together, whatever drops the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from torch import nn

# Named only here: the model holds its executor (a weak registry keyed by the model would keep every streamed model
# alive, the executor's hooks referring back to it).
_EXECUTOR_ATTRIBUTE = "_specexec_executor"


@runtime_checkable
class StreamingExecutor(Protocol):
    """What this layer may ask the executor that streams a target's weights through a ring of buffers.

    ``specexec_hf.offload``'s ``LayerStreamer`` (CPU) and ``DeviceLayerStreamer`` (accelerator) implement it.
    """

    @property
    def unit_names(self) -> Sequence[str]:
        """The streamed modules' names, in execution order (a draft sharing one would load it concurrently)."""
        ...

    @property
    def prefetch(self) -> int:
        """Units read ahead of the one computing."""
        ...

    @property
    def forwards_begun(self) -> int:
        """Forwards that reached their first streamed unit so far."""
        ...

    @property
    def read_ahead_idle_seconds(self) -> float:
        """Seconds the read-ahead sat idle before forwards whose units had all landed, summed so far."""
        ...

    @property
    def cycling_units(self) -> int:
        """Units read on every forward (the others stay loaded)."""
        ...

    @property
    def buffer_bytes(self) -> int:
        """Bytes the ring holds now."""
        ...

    @property
    def streamed_bytes_per_forward(self) -> int:
        """Bytes each forward moves into the ring once the first forward has filled it."""
        ...

    def ring_bytes_at(self, prefetch: int) -> int:
        """The bytes the ring would take reading ``prefetch`` units ahead."""
        ...

    def exclusive_use(self) -> AbstractContextManager[None]:
        """Held for a whole call (a :meth:`~.ownership.CallLock.held`): waits while another call uses the ring."""
        ...

    def close(self) -> None:
        """Stops the executor and restores the model as far as it can (:func:`detach_executor` included)."""
        ...


def attach_executor(model: nn.Module, executor: StreamingExecutor) -> None:
    """Makes ``executor`` the one :func:`executor_of` finds for ``model``.

    Raises:
        TypeError: ``executor`` lacks part of :class:`StreamingExecutor`.
    """
    if not isinstance(executor, StreamingExecutor):
        raise TypeError(
            f"{type(executor).__name__} does not implement StreamingExecutor (specexec_hf.hf.executor): give it "
            "every member the protocol lists before attaching it to a model."
        )
    setattr(model, _EXECUTOR_ATTRIBUTE, executor)


def detach_executor(model: nn.Module, executor: StreamingExecutor) -> None:
    """Forgets ``executor`` as ``model``'s (an executor's :meth:`~StreamingExecutor.close` calls it); nothing where
    another executor, or none, is attached."""
    if executor_of(model) is executor:
        delattr(model, _EXECUTOR_ATTRIBUTE)


def executor_of(model: nn.Module) -> StreamingExecutor | None:
    """The executor streaming ``model``'s weights (attached by :func:`attach_executor`), or ``None`` for a model
    whose weights stay where they are or that accelerate's hooks fetch."""
    executor: StreamingExecutor | None = getattr(model, _EXECUTOR_ATTRIBUTE, None)
    return executor
