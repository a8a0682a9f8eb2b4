"""The seam between the adapter and the offload executors (``specexec_hf.hf.executor``), and what ``close()`` leaves.

hf asks a streamed target's executor through the :class:`StreamingExecutor` protocol, found by ``executor_of``;
both executors implement it and attach through it. A closed executor restores the model as far as it can (its
hooks and forward wrappers gone, the model no longer streamed), and the model's next forward raises one error
naming the fix.
"""

from __future__ import annotations

import copy
import gc
import tempfile
import weakref
from functools import partial

import pytest
import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

import specexec_hf
from specexec_hf.hf import self_draft as named_drafts
from specexec_hf.hf.executor import StreamingExecutor, attach_executor, executor_of
from specexec_hf.offload import (
    DeviceLayerStreamer,
    LayerStreamer,
    OrderCheckingDevice,
    layer_streamer,
    load_offloaded,
    stream_on_device,
    weight_units,
)

NUM_LAYERS = 3


def prompt() -> torch.Tensor:
    return torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))


def streamed(model, executor: str, folder: str, prefetch: int = 1):
    """A copy of ``model`` streamed by the CPU executor, or by the accelerator's on the CPU stand-in device."""
    if executor == "stream":
        return load_offloaded(
            copy.deepcopy(model), max_memory={"cpu": 0}, offload_folder=folder, executor="stream", prefetch=prefetch
        )
    device_map = {name: "disk" for name in weight_units(model)}
    return stream_on_device(copy.deepcopy(model), device_map, OrderCheckingDevice(), folder, prefetch=prefetch)


@pytest.mark.parametrize("executor", ["stream", "device"])
def test_both_executors_implement_the_protocol_and_attach_through_the_seam(executor):
    model = tiny_model("llama", seed=0, num_layers=NUM_LAYERS)
    with tempfile.TemporaryDirectory() as folder:
        target = streamed(model, executor, folder)
        found: StreamingExecutor | None = executor_of(target)  # what hf sees, typed by the protocol
        assert isinstance(found, StreamingExecutor)
        assert found is layer_streamer(target)
        assert isinstance(found, DeviceLayerStreamer if executor == "device" else LayerStreamer)
        found.close()


def test_attaching_an_object_that_lacks_part_of_the_protocol_is_refused():
    class Incomplete:
        unit_names = ["model.layers.0"]

        def close(self) -> None:
            pass

    with pytest.raises(TypeError, match="Incomplete does not implement StreamingExecutor"):
        attach_executor(tiny_model("llama"), Incomplete())


def test_a_model_in_memory_has_no_executor():
    assert executor_of(tiny_model("llama")) is None


@settings(max_examples=6, deadline=None)
@given(executor=st.sampled_from(["stream", "device"]), prefetch=st.integers(1, 3), forwards=st.integers(0, 2))
def test_close_restores_the_model_and_its_next_forward_names_the_fix(executor, prefetch, forwards):
    model = tiny_model("llama", seed=1, num_layers=NUM_LAYERS)
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        target = streamed(model, executor, folder, prefetch)
        streamer = layer_streamer(target)
        units = [target.get_submodule(name) for name in streamer.unit_names]
        for _ in range(forwards):
            assert torch.equal(target(prompt()).logits, model(prompt()).logits)
        streamer.close()
        streamer.close()  # a second close does nothing
        assert executor_of(target) is None and layer_streamer(target) is None
        # The ownership wrappers the streamer put on the forwards of the units' ancestors are gone.
        wrapped = [name for name, module in target.named_modules() if not _runs_its_own_forward(module)]
        assert not wrapped
        for unit in units:  # its read-ahead pre-hooks too: one guard is left on each streamed unit
            assert len(unit._forward_pre_hooks) == 1
            assert not any(isinstance(hook, partial) for hook in unit._forward_pre_hooks.values())
        for forward in (target, target.model, units[0]):
            with pytest.raises(RuntimeError, match=r"closed.*load it again with specexec_hf\.load_offloaded"):
                forward(prompt())  # the guard raises before the forward reads its arguments


def _runs_its_own_forward(module: torch.nn.Module) -> bool:
    """Whether ``module.forward`` is its class's, bound (no wrapper set on the instance)."""
    return getattr(module.forward, "__func__", None) is type(module).forward


def test_a_streamed_model_and_its_executor_are_freed_together():
    """The executor is held by its model (an attribute), not by a registry that would keep the model alive."""
    model = tiny_model("llama", seed=2, num_layers=NUM_LAYERS)
    with tempfile.TemporaryDirectory() as folder:
        target = streamed(model, "stream", folder)
        streamer = layer_streamer(target)
        with torch.no_grad():
            target(prompt())
        streamer.close()
        model_freed, streamer_freed = weakref.ref(target), weakref.ref(streamer)
        del target, streamer
        gc.collect()
        assert model_freed() is None and streamer_freed() is None


def test_a_draft_named_by_a_string_needs_the_resolver_the_models_layer_registers(monkeypatch):
    target = tiny_model("llama", seed=3, num_layers=NUM_LAYERS)
    assert named_drafts.resolve_draft(target, "self:exit:1") is specexec_hf.models.resolve_draft(target, "self:exit:1")
    monkeypatch.setattr(named_drafts, "_resolver", None)
    with pytest.raises(RuntimeError, match="import specexec_hf"):
        named_drafts.resolve_draft(target, "self:exit:1")
