"""prefetch="auto": the read-ahead ring sized by the memory the process can still take, cgroup limits included."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from specexec_hf.offload import layer_streamer, load_offloaded, memory
from specexec_hf.offload import stream as stream_module
from specexec_hf.offload.layout import (
    auto_prefetch,
    cycling_units,
    deepest_streaming_prefetch,
    prefetch_within,
    ring_bytes,
    ring_slots,
    slot_bytes,
    slot_members,
)

MiB = 2**20


def fake_system(root, mem_available_kib, cgroup_line, files):
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {mem_available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for relative, text in files.items():
        (root / "cgroup" / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / "cgroup" / relative).write_text(text)
    return proc, root / "cgroup"


def test_headroom_under_a_v1_limit_counts_the_group_page_cache_as_room(tmp_path):
    proc, cgroups = fake_system(tmp_path, 8 * 1024 * 1024, "7:memory:/bench", {
        "memory/bench/memory.limit_in_bytes": str(1000 * MiB),
        "memory/bench/memory.usage_in_bytes": str(900 * MiB),
        "memory/bench/memory.stat": f"cache {100 * MiB}\nrss {800 * MiB}\ntotal_cache {300 * MiB}\n",
    })
    assert memory.memory_headroom(proc, cgroups) == 1000 * MiB - (900 - 300) * MiB


def test_headroom_under_a_v2_limit_and_the_machine_whichever_is_less(tmp_path):
    files = {"user.slice/memory.max": str(4096 * MiB), "user.slice/memory.current": str(1024 * MiB),
             "user.slice/memory.stat": f"anon {900 * MiB}\nfile {124 * MiB}\n"}
    proc, cgroups = fake_system(tmp_path, 1024 * 1024, "0::/user.slice", files)  # 1 GiB available on the machine
    assert memory.memory_headroom(proc, cgroups) == 1024 * MiB


@pytest.mark.parametrize("limit", ["max", str(2**63 - 4096)])
def test_an_unlimited_group_leaves_the_machine_available_memory(tmp_path, limit):
    name = "memory.max" if limit == "max" else "memory/memory.limit_in_bytes"
    line = "0::/" if limit == "max" else "4:memory:/"
    proc, cgroups = fake_system(tmp_path, 2048, line, {name: limit})
    assert memory.memory_headroom(proc, cgroups) == 2048 * 1024


def test_unreadable_memory_information_gives_none(tmp_path):
    assert memory.memory_headroom(tmp_path / "no-proc", tmp_path / "no-cgroup") is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=24), st.integers(0, 2000), st.sampled_from([1, 8]))
def test_prefetch_within_is_the_deepest_read_ahead_whose_ring_fits(unit_bytes, budget, alignment):
    def ring(prefetch):  # the ring's bytes from its parts, not through ring_bytes, which prefetch_within uses
        return sum(slot_bytes(unit_bytes, ring_slots(len(unit_bytes), prefetch, unit_bytes), alignment))

    chosen = prefetch_within(unit_bytes, budget, alignment)
    assert chosen >= 1
    assert chosen == 1 or ring(chosen) <= budget
    assert all(ring(deeper) > budget for deeper in range(chosen + 1, len(unit_bytes)))
    assert all(ring(prefetch) == ring_bytes(unit_bytes, prefetch, alignment) for prefetch in range(1, chosen + 2))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=24), st.integers(0, 3000), st.sampled_from([0.25, 0.5]))
def test_auto_prefetch_gives_deeper_read_ahead_its_share_of_what_the_smallest_ring_leaves(unit_bytes, headroom, share):
    smallest = ring_bytes(unit_bytes, 1)
    allowed = smallest + int(share * max(0, headroom - smallest))
    chosen = auto_prefetch(unit_bytes, headroom, share)
    deepest = deepest_streaming_prefetch(unit_bytes)
    assert chosen >= 1 and ring_bytes(unit_bytes, chosen) <= allowed and chosen <= deepest
    assert chosen == deepest or all(
        ring_bytes(unit_bytes, deeper) > allowed for deeper in range(chosen + 1, len(unit_bytes)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=4, max_size=40))
def test_auto_read_ahead_keeps_every_cycling_unit_streamed(unit_bytes):
    # However much memory there is, every unit that cycles shares its buffer with another: an offloaded model stays
    # offloaded (reads every forward), and the ring never holds more than half the cycling units.
    chosen = auto_prefetch(unit_bytes, 10**12, 1.0)
    cycling = cycling_units(len(unit_bytes), unit_bytes)
    slot_of = ring_slots(len(unit_bytes), chosen, unit_bytes)
    shared = [members for members in slot_members(slot_of) if len(members) > 1]
    assert len(cycling) < 4 or sum(len(members) for members in shared) >= len(cycling) - 1
    assert len(cycling) < 4 or chosen + 1 <= len(cycling) // 2


def test_a_head_bigger_than_the_share_no_longer_leaves_the_layers_without_read_ahead():
    # The default target under ssd.py's cap: 30 layers of 14 MB and a 113 MB tied head (a buffer of its own), 242 MB
    # of room. Charging the 142 MB smallest ring against half the room gave prefetch 1.
    unit_bytes = [14 * MiB] * 30 + [113 * MiB]
    assert prefetch_within(unit_bytes, 121 * MiB) == 1
    assert auto_prefetch(unit_bytes, 242 * MiB, 0.5) == 4
    assert auto_prefetch(unit_bytes, 10 * 2**30, 0.5) == 14  # 15 buffers for 30 layers: half read ahead


# The model's 8 units take 40 KiB or less each: 300 KiB of headroom allows some read-ahead, 1 MiB the deepest that
# still streams every layer (the layers never all stay loaded: an offloaded model stays offloaded).
@pytest.mark.parametrize("headroom_kib", [0, 300, 1024, None])
def test_auto_ring_fits_its_share_of_the_headroom_and_computes_what_the_model_in_memory_does(
    tmp_path, monkeypatch, headroom_kib
):
    model = tiny_model("llama", seed=5, num_layers=6, vocab_size=64, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    headroom = None if headroom_kib is None else headroom_kib * 1024
    monkeypatch.setattr(stream_module, "memory_headroom", lambda: headroom)
    streamed = load_offloaded(tmp_path, max_memory={"cpu": 0}, prefetch="auto")
    streamer = layer_streamer(streamed)
    assert (streamer.prefetch > 1) == bool(headroom)
    if streamer.prefetch > 1:
        smallest = layer_streamer(load_offloaded(tmp_path, max_memory={"cpu": 0}, prefetch=1)).buffer_bytes
        assert streamer.buffer_bytes - smallest <= (headroom - smallest) * stream_module.AUTO_RING_SHARE
    assert streamer.streamed_bytes_per_forward > 0
    assert streamer.prefetch <= deepest_streaming_prefetch(streamer._unit_bytes)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(2):  # the second forward runs on what the first one's read-ahead left in the ring
            assert torch.equal(streamed(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("prefetch", [0, -1, True, 1.5, "deep"])
def test_a_bad_prefetch_is_refused_naming_the_choices(tmp_path, prefetch):
    tiny_model("llama", seed=5, num_layers=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        load_offloaded(tmp_path, max_memory={"cpu": 0}, prefetch=prefetch)


def test_a_gpu_ring_is_sized_by_the_device_memory_the_resident_units_leave():
    from specexec_hf.offload.placement import device_auto_prefetch, offload_device_map

    model = tiny_model("llama", seed=5, num_layers=12, vocab_size=64, dtype=torch.float32)
    layer = sum(weight.numel() * 4 for weight in model.model.layers[0].parameters())
    device_map = {name: ("cpu" if ".layers." in f".{name}" else 0) for name in offload_device_map(model, None)}
    resident = sum(weight.numel() * 4 for name, weight in model.named_parameters() if ".layers." not in f".{name}")
    assert device_auto_prefetch(model, device_map, 0) == 1  # no room: the smallest ring, allocated anyway
    assert device_auto_prefetch(model, device_map, resident) == 1  # the resident units take it all
    # Half of what the smallest ring (two layer buffers) leaves of six layers' room: two more buffers, 12 layers
    # going round 4 of them.
    assert device_auto_prefetch(model, device_map, resident + 6 * layer + 100) == 3
    assert device_auto_prefetch(model, device_map, 10**12) == 5  # 12 layers: at most 6 buffers, every layer streamed
