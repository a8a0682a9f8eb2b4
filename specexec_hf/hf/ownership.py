"""Exclusive use of a model for a whole call, where its executor's state cannot be shared between calls.

A streamed target computes out of one ring of weight buffers (the executors of ``specexec_hf.offload``, found
through :func:`~.executor.executor_of`): two calls running at once would overwrite each other's weights. Its
:meth:`~.executor.StreamingExecutor.exclusive_use` is the hold: ``generate()`` (this adapter's and, through the
patch, transformers' own) holds it for the whole call (:func:`exclusive_call`), and the executor holds it for each
top-level forward.

The hold belongs to a call, not to a thread (:class:`CallLock`): it is recorded in the caller's context
(:mod:`contextvars`), so a thread the call starts for itself in a copy of that context
(``contextvars.copy_context().run``, as the decoder's ``draft_ahead`` worker is) uses the model under the same hold,
while every other thread waits for the call to end.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import TypeVar

from torch import nn

from .executor import executor_of

_HOLDS: ContextVar[frozenset[object]] = ContextVar("specexec_call_lock_holds", default=frozenset())
"""The holds (one token per :class:`CallLock` held) of the calls running in this context."""

Result = TypeVar("Result")


class CallLock:
    """A reentrant lock held by a call rather than a thread.

    Taken again inside the context that holds it, or a copy of that context made while it held it, it passes at
    once; anywhere else it waits until released. Released however the ``with`` block exits.
    """

    def __init__(self) -> None:
        self._released = threading.Condition()
        self._holder: object | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        """Holds the lock for the ``with`` block, first waiting for any other call holding it to end."""
        if self._holder in _HOLDS.get():  # this call holds it already
            yield
            return
        holder = object()
        with self._released:
            self._released.wait_for(lambda: self._holder is None)
            self._holder = holder
        recorded = _HOLDS.set(_HOLDS.get() | {holder})
        try:
            yield
        finally:
            _HOLDS.reset(recorded)
            with self._released:
                self._holder = None
                self._released.notify()


def exclusive_use(model: nn.Module) -> AbstractContextManager[None]:
    """The exclusive use of ``model``'s executor (:func:`~.executor.executor_of`), or nothing to hold where calls
    may share the model."""
    executor = executor_of(model)
    return executor.exclusive_use() if executor is not None else nullcontext()


def exclusive_call(function: Callable[..., Result]) -> Callable[..., Result]:
    """``function(model, ...)``, holding ``model``'s :func:`exclusive_use` for the whole call."""

    @functools.wraps(function)
    def held(model: nn.Module, *args, **kwargs) -> Result:
        with exclusive_use(model):
            return function(model, *args, **kwargs)

    return held
