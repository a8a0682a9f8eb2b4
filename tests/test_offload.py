"""Offloaded targets (accelerate hooks and the streaming executor): token-identical to the in-memory target."""

from __future__ import annotations

import copy
import gc
import os
import tempfile
import warnings

import pytest
import torch
from conftest import ARCHITECTURES, importable, perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st

from specexec_hf.offload import direct_io, layer_streamer, load_offloaded, offload_device_map
from specexec_hf.offload.layout import slot_members

# Whole model on disk; or the embedding kept in memory and the rest on disk (tiny float64 models take ~16 KB for
# the embedding and ~75 KB per layer, and accelerate reserves room for the largest layer on top).
PLACEMENTS = {"all on disk": {"cpu": 0}, "cpu and disk": {"cpu": 150_000}}


def prompt(seed: int, length: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def offloaded_copy(model, folder: str, placement: str, executor: str, **kwargs):
    """``model`` dispatched under one of ``PLACEMENTS``, leaving ``model`` itself in memory."""
    return load_offloaded(
        copy.deepcopy(model), max_memory=PLACEMENTS[placement], offload_folder=folder, executor=executor, **kwargs
    )


@given(
    arch=st.sampled_from(sorted(ARCHITECTURES)),
    seed=st.integers(0, 2**16),
    noise=st.sampled_from([0.0, 0.05, 2.0]),
    prompt_length=st.integers(1, 10),
    max_new_tokens=st.integers(1, 24),
    budget=st.integers(1, 24),
    placement=st.sampled_from(sorted(PLACEMENTS)),
    executor=st.sampled_from(["accelerate", "stream"]),
    prefetch=st.integers(1, 3),
)
def test_specexec_on_offloaded_target_equals_in_memory_greedy(
    arch, seed, noise, prompt_length, max_new_tokens, budget, placement, executor, prefetch
):
    target = tiny_model(arch, seed=seed)
    draft = perturbed_copy(target, noise, seed=seed + 1)
    ids = prompt(seed, prompt_length)
    expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    with tempfile.TemporaryDirectory() as folder:
        offloaded = offloaded_copy(target, folder, placement, executor, prefetch=prefetch)
        assert "disk" in offloaded.hf_device_map.values()
        got = offloaded.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, speculator="specexec",
            budget=budget,
        )
        plain = offloaded.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    assert got.tolist() == expected.tolist()
    assert plain.tolist() == expected.tolist()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("executor", ["accelerate", "stream"])
def test_checkpoint_on_disk_gives_bit_identical_logits(executor, dtype):
    """Read in place from a float64 safetensors checkpoint, converted to ``dtype`` as from_pretrained does."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        tiny_model("llama", seed=3, num_layers=3).save_pretrained(folder)
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        offloaded = load_offloaded(folder, max_memory={"cpu": 0}, executor=executor, dtype=dtype)
        ids = prompt(0, 9)
        with torch.no_grad():
            for _ in range(2):  # the second forward runs from prefetched buffers
                assert torch.equal(offloaded(ids).logits, reference(ids).logits)
        assert offloaded.dtype == dtype


def test_hf_assisted_generation_runs_on_the_streamed_target(llama_pair):
    target, draft = llama_pair
    ids = prompt(1, 5)
    expected = target.generate(ids, max_new_tokens=12, do_sample=False)
    with tempfile.TemporaryDirectory() as folder:
        offloaded = offloaded_copy(target, folder, "all on disk", "stream")
        assisted = offloaded.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert assisted.tolist() == expected.tolist()


def live_tensor_count() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() touches deprecated torch.distributed aliases
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def anonymous_resident_bytes() -> int:
    """The process's private resident memory (``RssAnon``); mapped weight files are page cache, not counted."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from Linux /proc")
def test_streamer_memory_stays_flat_over_200_forwards():
    """Streamed weights land in buffers allocated once: nothing accumulates, however many forwards run."""
    # Every forward re-reads the decoder layers into the same buffers: any leak of a read would show at once.
    model = tiny_model("llama", seed=0, num_layers=4, vocab_size=16384, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as folder:
        offloaded = offloaded_copy(model, folder, "all on disk", "stream")
        streamer = layer_streamer(offloaded)
        ids = prompt(2, 4)
        with torch.no_grad():
            for _ in range(5):
                offloaded(ids)
            tensors, resident, buffers = live_tensor_count(), anonymous_resident_bytes(), streamer.buffer_bytes
            reads = streamer.reads_requested
            for _ in range(200):
                offloaded(ids)
            # Each forward read each unit sharing a ring buffer: the decoder layers (the 2 MB LM head beside them
            # has a buffer of its own and stays loaded).
            shared = [members for members in slot_members(streamer._slot_of) if len(members) > 1]
            assert sum(len(members) for members in shared) >= 4
            assert streamer.reads_requested - reads == 200 * sum(len(members) for members in shared)
            # Each reader thread allocates its bounce buffer once, on its first bounced read, which may come late.
            assert live_tensor_count() - tensors <= direct_io.READERS
            assert streamer.buffer_bytes == buffers
            assert anonymous_resident_bytes() - resident < 8 * 2**20
            streamer.close()
            with pytest.raises(RuntimeError, match="closed"):
                offloaded(ids)  # a closed streamer's model refuses to compute rather than use stale buffers


@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_resident_streamed_head_runs_lazily_and_the_next_forwards_first_layers_are_read_ahead(prefetch):
    """The LM head has a buffer of its own (it stays loaded), so the walk applies it to a few rows after the forward
    instead of to every node inside it; the last decoder layer then queues the next forward's first layers, which
    read while the walk and the draft run."""
    from specexec_hf.hf.forward import head_applies_lazily

    model = tiny_model("llama", seed=0, num_layers=6, vocab_size=16384, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as folder:
        offloaded = offloaded_copy(model, folder, "all on disk", "stream", prefetch=prefetch)
        streamer = layer_streamer(offloaded)
        head_position = streamer.unit_names.index("lm_head")
        assert streamer._stays_loaded[head_position] and head_applies_lazily(offloaded)
        ids = prompt(2, 4)
        with torch.no_grad():
            for _ in range(2):
                offloaded.model(ids)  # what a tree forward runs: the decoder, not the head
                cycling = [p for p, stays in enumerate(streamer._stays_loaded) if not stays][:prefetch]
                for position in cycling:
                    assert streamer._slots[streamer._slot_of[position]].position == position
            expected = model(ids).logits
            assert torch.equal(offloaded(ids).logits, expected)
        streamer.close()


def test_device_map_is_per_layer_and_keeps_parameter_free_modules_off_disk():
    model = tiny_model("llama", num_layers=3)
    device_map = offload_device_map(model, {"cpu": 0})
    assert device_map == {
        "model.embed_tokens": "disk",
        "model.layers.0": "disk",
        "model.layers.1": "disk",
        "model.layers.2": "disk",
        "model.norm": "disk",
        "lm_head": "disk",
        "model.rotary_emb": "cpu",
    }
    assert set(offload_device_map(model, None).values()) == {"cpu"}


def test_bad_arguments_are_named():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="Unknown executor='fast'"):
        load_offloaded(model, max_memory={"cpu": 0}, executor="fast")
    with pytest.raises(ValueError, match="offload_folder"):
        load_offloaded(copy.deepcopy(model), max_memory={"cpu": 0})
    with pytest.raises(ValueError, match="prefetch"):
        load_offloaded(model, max_memory={"cpu": 0}, executor="stream", prefetch=0)


@pytest.mark.skipif(not importable("optimum.quanto"), reason="needs optimum-quanto")
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quanto_quantized_target_equals_its_own_greedy(weights):
    """transformers' quanto integration: SpecExec reproduces the quantized target's greedy output."""
    from transformers import AutoModelForCausalLM, QuantoConfig

    target = tiny_model("llama", seed=5, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as folder:
        target.save_pretrained(folder)
        quantized = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=QuantoConfig(weights=weights), attn_implementation="sdpa"
        )
    ids = prompt(5, 6)
    expected = quantized.generate(ids, max_new_tokens=20, do_sample=False)
    got = quantized.generate(
        ids, max_new_tokens=20, do_sample=False, assistant_model=perturbed_copy(target, 0.05, 6),
        speculator="specexec", budget=12,
    )
    assert got.tolist() == expected.tolist()
    assert type(quantized.model.layers[0].mlp.down_proj).__name__ == "QLinear"


@given(count=st.integers(1, 40), prefetch=st.integers(1, 6))
def test_ring_slots_keep_every_read_ahead_window_distinct_across_forwards(count, prefetch):
    """Any prefetch + 1 consecutive units, wrapping into the next forward, compute out of different buffers."""
    from specexec_hf.offload.layout import ring_slots

    slot_of = ring_slots(count, prefetch)
    ring = min(prefetch + 1, count)
    assert sorted(set(slot_of)) == list(range(ring + count % ring))  # at most prefetch extra buffers
    for start in range(count):
        window = [slot_of[(start + ahead) % count] for ahead in range(ring)]
        assert len(set(window)) == ring


@given(st.lists(st.integers(1, 100), min_size=1, max_size=40), st.integers(1, 6))
def test_an_oversized_unit_gets_a_ring_buffer_of_its_own(unit_bytes, prefetch):
    """Units far larger than the median (an LM head) are read once and stay; the others keep distinct windows; the
    ring costs at most one ordinary unit per oversized one, plus the buffers of its own that up to ``prefetch`` more
    units at the end of the cycle need, beyond the layout that cycles the oversized units too."""
    from specexec_hf.offload.layout import OVERSIZED, ring_slots, slot_bytes, slot_members

    count = len(unit_bytes)
    slot_of = ring_slots(count, prefetch, unit_bytes)
    assert sorted(set(slot_of)) == list(range(max(slot_of) + 1))
    median = sorted(unit_bytes)[count // 2]
    members = slot_members(slot_of)
    oversized = [position for position in range(count) if unit_bytes[position] > OVERSIZED * median]
    assert all(members[slot_of[position]] == [position] for position in oversized)
    window_size = min(prefetch + 1, count)
    for start in range(count):
        window = [slot_of[(start + ahead) % count] for ahead in range(window_size)]
        assert len(set(window)) == window_size
    plain = sum(slot_bytes(unit_bytes, ring_slots(count, prefetch)))
    ordinary = max(size for position, size in enumerate(unit_bytes) if position not in oversized)
    assert sum(slot_bytes(unit_bytes, slot_of)) <= plain + (len(oversized) + prefetch) * ordinary


@pytest.mark.parametrize("executor", ["accelerate", "stream"])
def test_draft_ahead_refuses_a_draft_sharing_the_targets_streamed_layers(executor):
    """With draft_ahead the draft runs while the target verifies: a layer self-draft would load the same streamed
    layers from two threads at once."""
    target = tiny_model("llama", seed=3)
    ids = prompt(3, 5)
    expected = target.generate(ids, max_new_tokens=8, do_sample=False)
    with tempfile.TemporaryDirectory() as folder:
        offloaded = offloaded_copy(target, folder, "all on disk", executor)
        with pytest.raises(ValueError, match=r"draft_ahead .* shares the target's 'model\..*draft_ahead=False"):
            offloaded.generate(ids, max_new_tokens=4, do_sample=False, assistant_model="self:exit:1",
                               speculator="specexec", draft_ahead=True)
        draft = perturbed_copy(target, 0.05, 4)
        got = offloaded.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=draft,
                                 speculator="specexec", draft_ahead=True)
    assert got.tolist() == expected.tolist()
