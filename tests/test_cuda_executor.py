"""The streaming executor on an accelerator (``DeviceLayerStreamer``).

On the CPU it runs through ``OrderCheckingDevice``, which executes copies late, from a queue, and raises when a
copy could overwrite a buffer the compute may still read: outputs bit-equal to the in-memory model, the ring and
the parameter views fixed, exact-size pinned buffers, wrap-around read-ahead and failures surfacing in the
forward that needs the weights. The ``cuda``-marked tests run the same executor on a GPU.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
from conftest import ARCHITECTURES, importable, perturbed_copy, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from specexec_hf.offload import (
    CudaDevice,
    DeviceLayerStreamer,
    OrderCheckingDevice,
    OrderingError,
    layer_streamer,
    load_offloaded,
    offload_device_map,
    stream_on_device,
    weight_units,
)
from specexec_hf.offload import stream as stream_module
from specexec_hf.offload.direct_io import BLOCK, Span, WeightFile, WeightFileError, plan_reads

PLACES = [0, "cpu", "disk"]  # 0: resident on the execution device


def prompt(seed: int, length: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def placed(model, places) -> dict:
    """``model``'s per-unit device map with its weight units placed as ``places`` (cycled); others resident."""
    device_map = offload_device_map(model, None)
    for index, name in enumerate(weight_units(model)):
        device_map[name] = places[index % len(places)]
    return {name: (0 if where not in ("cpu", "disk") else where) for name, where in device_map.items()}


def streamed_copy(model, device_map, device, folder, prefetch=1, dtype=None):
    return stream_on_device(copy.deepcopy(model), device_map, device, folder, dtype=dtype, prefetch=prefetch)


@given(
    arch=st.sampled_from(sorted(ARCHITECTURES)),
    seed=st.integers(0, 2**16),
    num_layers=st.integers(1, 5),
    places=st.lists(st.sampled_from(PLACES), min_size=1, max_size=8).filter(lambda p: set(p) & {"cpu", "disk"}),
    prefetch=st.integers(1, 3),
    budget=st.integers(1, 16),
    max_new_tokens=st.integers(1, 16),
)
def test_streamed_target_is_bit_identical_and_specexec_equals_in_memory_greedy(
    arch, seed, num_layers, places, prefetch, budget, max_new_tokens
):
    target = tiny_model(arch, seed=seed, num_layers=num_layers)
    draft = perturbed_copy(target, 0.05, seed=seed + 1)
    ids = prompt(seed, 6)
    expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    device = OrderCheckingDevice()
    with tempfile.TemporaryDirectory() as folder:
        streamed = streamed_copy(target, placed(target, places), device, folder, prefetch)
        with torch.no_grad():
            reference = target(ids).logits
            for _ in range(3):  # later forwards run from read-ahead that wrapped around
                assert torch.equal(streamed(ids).logits, reference)
        got = streamed.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, speculator="specexec",
            budget=budget,
        )
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_checkpoint_streamed_in_another_dtype_is_bit_identical(dtype):
    """Read from a float64 safetensors checkpoint, converted as from_pretrained does, RAM and disk layers mixed."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        model = tiny_model("qwen2", seed=4, num_layers=4)
        model.save_pretrained(folder)
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        device_map = placed(model, [0, "cpu", "disk", "disk", "cpu"])
        streamed = stream_on_device(folder, device_map, OrderCheckingDevice(), dtype=dtype, prefetch=1)
        ids = prompt(1, 9)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(streamed(ids).logits, reference(ids).logits)
        assert streamed.dtype == dtype and streamed.hf_device_map == device_map


def layer_map(model, place: str, resident=("model.embed_tokens", "model.rotary_emb")) -> dict:
    return {name: (0 if name in resident else place) for name in offload_device_map(model, None)}


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_ring_and_parameter_views_never_move(prefetch):
    model = tiny_model("llama", seed=2, num_layers=5, dtype=torch.float32)
    device = OrderCheckingDevice()
    with tempfile.TemporaryDirectory() as folder:
        streamed = streamed_copy(model, layer_map(model, "disk"), device, folder, prefetch)
        streamer = layer_streamer(streamed)
        ids = prompt(3, 5)

        def addresses():
            return [p.data_ptr() for p in streamed.parameters()], [slot.buffer.data_ptr() for slot in streamer._slots]

        before, ring_bytes, pinned = addresses(), streamer.buffer_bytes, list(device.pinned_sizes)
        with torch.no_grad():
            for _ in range(6):
                streamed(ids)
        assert addresses() == before
        assert streamer.buffer_bytes == ring_bytes and device.pinned_sizes == pinned  # nothing allocated or pinned


def test_each_layer_in_ram_is_one_exact_size_pinned_buffer_laid_out_like_its_slot():
    model = tiny_model("llama", seed=1, num_layers=3, dtype=torch.bfloat16)
    device = OrderCheckingDevice()
    streamed = streamed_copy(model, layer_map(model, "cpu"), device, folder=None)
    streamer = layer_streamer(streamed)
    expected = []
    for name in streamer.unit_names:
        end = 0
        for parameter in model.get_submodule(name).parameters():  # each weight a fresh 512-byte aligned block
            end = -(-end // 512) * 512 + parameter.numel() * parameter.element_size()
        expected.append(end)
    assert device.pinned_sizes == expected
    assert streamer.host_bytes == sum(expected)
    for name in streamer.unit_names:
        for parameter in streamed.get_submodule(name).parameters():
            assert parameter.data_ptr() % 512 == 0
    with torch.no_grad():
        assert torch.equal(streamed(prompt(0, 4)).logits, model(prompt(0, 4)).logits)


@pytest.mark.parametrize("num_layers, prefetch", [(4, 1), (5, 1), (6, 2), (2, 3)])
def test_read_ahead_wraps_around_into_the_next_forward(num_layers, prefetch):
    """After a forward, the next forward's first layers are already loading (while the draft would grow a tree)."""
    model = tiny_model("llama", seed=0, num_layers=num_layers)
    device = OrderCheckingDevice()
    streamed = streamed_copy(model, layer_map(model, "cpu", resident=("model.embed_tokens", "model.rotary_emb",
                                                                      "model.norm", "lm_head")), device, None, prefetch)
    streamer = layer_streamer(streamed)
    ids = prompt(0, 3)
    ring = prefetch + 1
    ring_holds_all = ring >= num_layers
    # Layers go round the ring; the last num_layers % ring get a slot each of their own, so they stay loaded.
    reloaded = 0 if ring_holds_all else num_layers - num_layers % ring
    with torch.no_grad():
        streamed(ids)
        issued, copied = device.copies_issued, device.bytes_copied
        assert issued == (num_layers if ring_holds_all else num_layers + prefetch)
        streamed(ids)
        assert device.copies_issued - issued == reloaded
        assert device.bytes_copied - copied == streamer.streamed_bytes_per_forward
    assert len(streamer._slots) == (num_layers if ring_holds_all else ring + num_layers % ring)


def test_the_forward_never_blocks_on_copies_and_wait_idle_drains_them(monkeypatch):
    """Only the reader thread waits on the host (for a staging buffer); the forward orders copies by events."""
    import threading

    model = tiny_model("llama", seed=3, num_layers=5)
    device = OrderCheckingDevice()
    waiting_threads = []
    host_wait = device.host_wait

    def recorded_host_wait(event):
        waiting_threads.append(threading.current_thread())
        host_wait(event)

    monkeypatch.setattr(device, "host_wait", recorded_host_wait)
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        streamed = streamed_copy(model, placed(model, [0, "cpu", "disk"]), device, folder)
        for _ in range(4):
            streamed(prompt(0, 3))
        assert threading.main_thread() not in waiting_threads
        streamer = layer_streamer(streamed)
        streamer.wait_idle()
        assert all(slot.filled.result().done for slot in streamer._slots if slot.position is not None)


def test_ordering_checker_catches_a_streamer_that_does_not_wait_for_the_compute(monkeypatch):
    """The checks can fail: a streamer that forgets that the compute read a slot overwrites it too early."""
    model = tiny_model("llama", seed=0, num_layers=4)
    device = OrderCheckingDevice()
    streamed = streamed_copy(model, layer_map(model, "cpu"), device, None)
    streamer = layer_streamer(streamed)
    monkeypatch.setattr(streamer, "_await", lambda slot: device.compute_wait(slot.filled.result()))
    with torch.no_grad(), pytest.raises(OrderingError, match="compute may still read"):
        streamed(prompt(0, 3))


def test_a_streamer_that_does_not_wait_for_the_copy_computes_with_unloaded_weights(monkeypatch):
    """The checks can fail the other way too: copies run late, so skipping the wait reads unloaded (0xFF) bytes."""
    model = tiny_model("llama", seed=0, num_layers=4)
    streamed = streamed_copy(model, layer_map(model, "cpu"), OrderCheckingDevice(), None)
    monkeypatch.setattr(layer_streamer(streamed), "_await", lambda slot: None)
    with torch.no_grad():
        assert torch.isnan(streamed(prompt(0, 3)).logits).all()


def test_ordering_checker_rules():
    device = OrderCheckingDevice()
    slot, host = device.allocate(8), device.pin(8)
    host.fill_(7)
    with pytest.raises(OrderingError, match="compute may still read"):  # a fresh allocation too
        device.copy(slot, host, after=None)
    done = device.copy(slot, host, after=device.compute_record())
    assert slot.tolist() == [0xFF] * 8  # not run yet: a compute that does not wait reads stale bytes
    device.compute_wait(done)
    assert slot.tolist() == [7] * 8
    with pytest.raises(OrderingError, match="compute may still read"):
        device.copy(slot, host, after=None)
    device.copy(slot, host, after=device.compute_record())  # a slot-free event recorded after the read: fine
    with pytest.raises(OrderingError, match="not pinned"):
        device.copy(device.allocate(8), torch.zeros(8, dtype=torch.uint8), after=None)


def test_the_first_copy_into_a_fresh_slot_waits_for_compute_recorded_after_its_allocation(monkeypatch):
    """The allocator may hand out memory that queued compute still reads: the first fill is ordered after it."""
    model = tiny_model("llama", seed=0, num_layers=4)
    device = OrderCheckingDevice()
    afters = []
    copy_on_device = device.copy

    def recorded_copy(target, source, after):
        afters.append(after)
        return copy_on_device(target, source, after)

    monkeypatch.setattr(device, "copy", recorded_copy)
    streamed = streamed_copy(model, layer_map(model, "cpu"), device, None)
    with torch.no_grad():
        assert torch.equal(streamed(prompt(0, 3)).logits, model(prompt(0, 3)).logits)
    assert afters and all(after is not None and after.target is None for after in afters)


def test_a_copy_refused_when_issued_fails_the_forward_that_needs_it_and_never_leaves_stale_weights():
    """A copy that raises when issued (not when it runs) must not leave its slot marked as holding the layer.

    The refused copy is a forward's last, the read-ahead of the next forward's first layer: that forward raises
    when it needs the layer (the one issuing it completes), and the one after computes right, never with the bytes
    the slot held before."""
    model = tiny_model("llama", seed=6, num_layers=4)
    ids = prompt(2, 4)
    device = OrderCheckingDevice()
    streamed = streamed_copy(model, layer_map(model, "cpu"), device, None)
    outcomes = []
    with torch.no_grad():
        reference = model(ids).logits
        for _ in range(2):
            issued = device.copies_issued
            assert torch.equal(streamed(ids).logits, reference)
        device.refuse_copies.add(device.copies_issued + device.copies_issued - issued)  # none refused before
        for _ in range(3):
            try:
                outcomes.append(torch.equal(streamed(ids).logits, reference))
            except RuntimeError as error:
                assert "injected refusal" in str(error)
                outcomes.append("raised")
    assert outcomes == [True, "raised", True]


@pytest.mark.parametrize("num_layers, prefetch", [(4, 1), (5, 1), (6, 2), (2, 3), (3, 1)])
def test_read_ahead_bytes_are_the_copies_a_forward_issues_for_the_next_one(num_layers, prefetch, monkeypatch):
    """What a forward's own copies move is streamed_bytes_per_forward - read_ahead_bytes: the rest it finds loaded."""
    model = tiny_model("llama", seed=0, num_layers=num_layers)
    device = OrderCheckingDevice()
    streamed = streamed_copy(model, layer_map(model, "cpu"), device, None, prefetch)
    streamer = layer_streamer(streamed)
    issued = {}  # done event -> (bytes, forward that issued the copy)
    forward = [0]
    copy_on_device, wait_on_device = device.copy, device.compute_wait
    waited_bytes = []  # per forward: bytes of the copies it waited for that it issued itself

    def recorded_copy(target, source, after):
        event = copy_on_device(target, source, after)
        issued[id(event)] = (source.numel(), forward[0])
        return event

    def recorded_wait(event):
        size, by = issued.pop(id(event), (0, None))
        if by == forward[0]:
            waited_bytes[-1] += size
        wait_on_device(event)

    monkeypatch.setattr(device, "copy", recorded_copy)
    monkeypatch.setattr(device, "compute_wait", recorded_wait)
    with torch.no_grad():
        for index in range(3):
            forward[0] = index
            waited_bytes.append(0)
            streamed(prompt(0, 3))
    assert waited_bytes[-1] == streamer.streamed_bytes_per_forward - streamer.read_ahead_bytes
    assert streamer.read_ahead_bytes <= streamer.streamed_bytes_per_forward


@pytest.mark.parametrize("failing", ["copy", "disk read"])
def test_a_failed_load_surfaces_in_the_forward_that_needs_it_and_is_retried(failing):
    model = tiny_model("llama", seed=6, num_layers=4)
    device = OrderCheckingDevice(fail_copies={3} if failing == "copy" else set())
    ids = prompt(2, 4)
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        streamed = streamed_copy(model, layer_map(model, "disk"), device, folder)
        streamer = layer_streamer(streamed)
        if failing == "disk read":  # the third layer's reads come from a file truncated after it was opened
            module, good_reads = streamer._units[2]
            short = os.path.join(folder, "short.bin")
            with open(short, "wb") as handle:
                handle.write(bytes(2 * BLOCK))
            short_file = WeightFile(short)
            os.truncate(short, BLOCK // 2)
            staging = streamer._slots[streamer._slot_of[2]].staging
            streamer._units[2] = (module, plan_reads([Span(short_file, 0, 2 * BLOCK, staging[: 2 * BLOCK])]))
        with pytest.raises(RuntimeError, match="injected failure of copy 3" if failing == "copy" else "Short read"):
            streamed(ids)
        if failing == "disk read":
            streamer._units[2] = (module, good_reads)
        assert torch.equal(streamed(ids).logits, model(ids).logits)


def checkpoint_and_reference(folder, dtype, stored, num_layers, vocab_size, seed):
    """``(what stream_on_device streams from, the in-memory reference)``: a safetensors checkpoint in ``dtype`` or
    float64 (converted when read), or a model whose disk-placed units get offloaded to ``.dat`` files."""
    from transformers import AutoModelForCausalLM

    saved = torch.float64 if stored == "checkpoint, converted" else dtype
    model = tiny_model("llama", seed=seed, num_layers=num_layers, vocab_size=vocab_size, dtype=saved)
    if stored == "offload folder":
        return copy.deepcopy(model), model
    model.save_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    # Weights in fresh allocations, as on an accelerator (a zero-copy view of the checkpoint is aligned otherwise).
    return folder, copy.deepcopy(loaded)


@given(
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
    stored=st.sampled_from(["checkpoint, same dtype", "checkpoint, converted", "offload folder"]),
    num_layers=st.integers(1, 4),
    vocab_size=st.sampled_from([64, 200, 1031]),
    places=st.sampled_from([["disk"], [0, "cpu", "disk"], ["disk", "cpu"]]),
    prefetch=st.integers(1, 3),
    direct=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=12, deadline=None)
def test_disk_layers_are_read_directly_into_staging_bit_equal_to_the_file(
    tmp_path_factory, dtype, stored, num_layers, vocab_size, places, prefetch, direct, seed
):
    """Every streamed layer's slot, filled from staging (direct reads, or the page-cache fallback), holds exactly the
    reference weights, converted as from_pretrained converts them; then the logits are bit-identical."""
    folder = tmp_path_factory.mktemp("model")
    source, reference = checkpoint_and_reference(folder, dtype, stored, num_layers, vocab_size, seed)
    device_map = placed(reference, places)
    with pytest.MonkeyPatch.context() as monkeypatch:
        if not direct:  # as on a filesystem that refuses O_DIRECT
            monkeypatch.setattr(stream_module, "WeightFile", lambda path: WeightFile(path, direct=False))
        streamed = stream_on_device(source, device_map, OrderCheckingDevice(), folder / "offload", dtype=dtype,
                                    prefetch=prefetch)
    streamer = layer_streamer(streamed)
    disk_units = [reads for _, reads in streamer._units if reads is not None]
    assert len(disk_units) == sum(device_map[name] == "disk" for name in streamer.unit_names)
    assert all(file.direct == direct for reads in disk_units for file in reads.files)
    for position, name in enumerate(streamer.unit_names):
        streamer._await(streamer._request(position))  # as the forward pre-hook loads it
        for upload in streamer._uploads[position]:
            assert torch.equal(upload.target, upload.source)  # the slot holds what the staging (or RAM) held
        for (key, got), (_, expected) in zip(
            streamed.get_submodule(name).named_parameters(), reference.get_submodule(name).named_parameters()
        ):
            assert torch.equal(got, expected), key
    # On the CPU stand-in, resident units of a checkpoint in the compute dtype stay zero-copy views of it, aligned
    # unlike any fresh allocation (on a GPU they are copied): their kernels may round differently.
    if stored != "checkpoint, same dtype" or 0 not in places:
        with torch.no_grad():
            for length in (5, 1, 3):
                tokens = prompt(length, length, vocab_size)
                assert torch.equal(streamed(tokens).logits, reference(tokens).logits)
    assert all(file._mapping is None for reads in disk_units for file in reads.files)  # never read through a map


def test_raw_runs_land_in_the_staging_in_place_and_go_up_in_few_copies():
    """Weights stored in their compute dtype are read straight into the block-aligned pinned staging, no bounce,
    and move up merged where both layouts space them alike."""
    with tempfile.TemporaryDirectory() as folder:
        model = tiny_model("llama", seed=3, num_layers=3, dtype=torch.float32)
        model.save_pretrained(folder)
        device = OrderCheckingDevice()
        streamed = stream_on_device(folder, layer_map(model, "disk"), device, dtype=torch.float32, prefetch=1)
    streamer = layer_streamer(streamed)
    for position, (module, reads) in enumerate(streamer._units):
        assert reads.requests and reads.direct_bytes == sum(request.length for request in reads.requests)
        assert all(file.direct for file in reads.files)
        weights = len(list(module.parameters()))
        assert len(streamer._uploads[position]) < max(2, weights)  # the 4096-byte projections share copies
    for slot in streamer._slots:
        assert slot.staging.data_ptr() % BLOCK == 0 and device._is_pinned(slot.staging)


@pytest.mark.parametrize("stored", ["checkpoint", "offload folder"])
@pytest.mark.parametrize("change", ["truncated", "rewritten in place"])
def test_a_weight_file_changed_under_the_device_streamer_raises_in_every_later_forward(stored, change):
    model = tiny_model("llama", seed=5, num_layers=3)
    ids = prompt(1, 5)
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        if stored == "checkpoint":
            model.save_pretrained(folder)
            streamed = stream_on_device(folder, layer_map(model, "disk"), OrderCheckingDevice(), dtype=torch.float64)
            path = os.path.join(folder, "model.safetensors")
        else:
            streamed = streamed_copy(model, layer_map(model, "disk"), OrderCheckingDevice(), folder)
            path = os.path.join(folder, "model.layers.1.mlp.up_proj.weight.dat")
        assert torch.equal(streamed(ids).logits, model(ids).logits)
        stat = os.stat(path)
        if change == "truncated":
            os.truncate(path, stat.st_size // 2)
        else:
            with open(path, "r+b") as handle:
                handle.seek(stat.st_size // 2)
                handle.write(b"\0" * 64)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # coarse clocks: make the change show
        for _ in range(2):
            with pytest.raises(WeightFileError, match="changed after the model was loaded|Short read"):
                streamed(ids)


def test_close_unpins_and_refuses_later_forwards():
    model = tiny_model("llama", seed=0, num_layers=4)
    device = OrderCheckingDevice()
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        streamed = streamed_copy(model, placed(model, ["cpu", "disk"]), device, folder)
        streamed(prompt(0, 3))
        layer_streamer(streamed).close()
        assert device.pinned == {}
        with pytest.raises(RuntimeError, match="closed"):
            streamed(prompt(0, 3))


def test_a_weight_type_that_cannot_be_taken_apart_is_refused():
    class OpaqueParameter(torch.nn.Parameter):  # a subclass whose data is not described by __tensor_flatten__
        pass

    model = tiny_model("llama", seed=0, num_layers=2)
    layer = model.model.layers[1].mlp.up_proj
    layer.weight = OpaqueParameter(layer.weight.detach(), requires_grad=False)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight is a OpaqueParameter, which cannot be"):
        stream_on_device(model, layer_map(model, "cpu"), OrderCheckingDevice())


def test_everything_resident_installs_no_streamer():
    model = tiny_model("llama", seed=0, num_layers=2)
    streamed = streamed_copy(model, placed(model, [0]), OrderCheckingDevice(), None)
    assert layer_streamer(streamed) is None
    with torch.no_grad():
        assert torch.equal(streamed(prompt(0, 3)).logits, model(prompt(0, 3)).logits)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_a_gpu_budget_without_cuda_is_refused_before_loading():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        load_offloaded(tiny_model("llama"), max_memory={0: 200_000, "cpu": 10**9}, executor="stream")


def test_load_offloaded_with_a_gpu_in_the_budget_installs_the_device_streamer(monkeypatch):
    """The wiring of load_offloaded's GPU branch, with the placement and the device stood in for on a CPU."""
    from specexec_hf.offload import device as device_module
    from specexec_hf.offload import placement

    model = tiny_model("llama", seed=2, num_layers=4)
    device_map = placed(model, [0, "cpu", "cpu"])
    monkeypatch.setattr(placement, "offload_device_map", lambda *args: device_map)
    monkeypatch.setattr(device_module, "CudaDevice", lambda where: OrderCheckingDevice())
    streamed = load_offloaded(
        copy.deepcopy(model), max_memory={0: "1GiB", "cpu": "8GiB"}, executor="stream", prefetch=2
    )
    assert isinstance(layer_streamer(streamed), DeviceLayerStreamer)
    assert streamed.hf_device_map == device_map
    with torch.no_grad():
        assert torch.equal(streamed(prompt(1, 5)).logits, model(prompt(1, 5)).logits)


def test_units_over_several_gpus_are_refused(monkeypatch):
    from specexec_hf.offload import placement

    monkeypatch.setattr(placement, "offload_device_map", lambda *args: {"model.layers.0": 0, "model.layers.1": 1})
    with pytest.raises(ValueError, match="one accelerator"):
        load_offloaded(tiny_model("llama"), max_memory={0: 1, 1: 1}, executor="stream")


# The real CUDA path (run by scripts/gpu_check on a GPU machine).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("places", [["cpu"], [0, "cpu", "disk"]])
@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.cuda
@needs_cuda
def test_cuda_streamed_logits_are_bit_identical_to_the_model_on_the_gpu(dtype, places, prefetch):
    model = tiny_model("llama", seed=7, num_layers=6, vocab_size=512, dtype=dtype)
    reference = copy.deepcopy(model).to("cuda")
    ids = prompt(4, 40, vocab=512).cuda()
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        streamed = streamed_copy(model, placed(model, places), CudaDevice(0), folder, prefetch)
        streamer = layer_streamer(streamed)
        assert all(upload.source.is_pinned() for uploads in streamer._uploads for upload in uploads)
        for _ in range(3):
            assert torch.equal(streamed(ids).logits, reference(ids).logits)
        streamer.close()


@pytest.mark.cuda
@needs_cuda
def test_cuda_load_offloaded_with_a_gpu_budget_runs_specexec_exactly():
    target = tiny_model("llama", seed=8, num_layers=6, vocab_size=512)
    draft = perturbed_copy(target, 0.05, seed=9).to("cuda")
    ids = prompt(5, 8, vocab=512).cuda()
    expected = copy.deepcopy(target).to("cuda").generate(ids, max_new_tokens=24, do_sample=False)
    layer_bytes = sum(p.numel() * p.element_size() for p in target.model.layers[0].parameters())
    streamed = load_offloaded(
        copy.deepcopy(target), max_memory={0: 4 * layer_bytes, "cpu": 10**10}, executor="stream"
    )
    assert {"cpu", 0} <= set(streamed.hf_device_map.values())
    assert isinstance(layer_streamer(streamed), DeviceLayerStreamer)
    got = streamed.generate(
        ids, max_new_tokens=24, do_sample=False, assistant_model=draft, speculator="specexec", budget=32
    )
    assert got.tolist() == expected.tolist()


@pytest.mark.cuda
@needs_cuda
def test_cuda_forward_synchronizes_nothing(monkeypatch):
    """Copies and compute are ordered by events only: no device, stream or event synchronize in a forward."""
    model = tiny_model("llama", seed=0, num_layers=6, dtype=torch.bfloat16)
    streamed = streamed_copy(model, layer_map(model, "cpu"), CudaDevice(0), None)
    ids = prompt(0, 16).cuda()
    calls = []

    def counted(name, original):
        def synchronize(*args):
            calls.append(name)
            return original(*args)

        return synchronize

    for owner in (torch.cuda, torch.cuda.Stream, torch.cuda.Event):
        monkeypatch.setattr(owner, "synchronize", counted(f"{owner.__name__}.synchronize", owner.synchronize))
    with torch.no_grad():
        for _ in range(3):
            streamed(ids)
    assert calls == []
    layer_streamer(streamed).close()


@pytest.mark.cuda
@needs_cuda
def test_cuda_pin_falls_back_to_torchs_pinned_allocator_when_registration_fails(monkeypatch):
    device = CudaDevice(0)
    cudart = torch.cuda.cudart()
    register, unregister = cudart.cudaHostRegister, cudart.cudaHostUnregister

    def failing_register(address, nbytes, flags):  # a real failure, which leaves CUDA's last error set
        assert register(address, nbytes, flags) == cudart.cudaError.success
        status = register(address, nbytes, flags)  # cudaErrorHostMemoryAlreadyRegistered
        unregister(address)
        return status

    monkeypatch.setattr(cudart, "cudaHostRegister", failing_register)
    with pytest.warns(RuntimeWarning, match="cudaHostRegister"):
        host = device.pin(1000)
    assert host.is_pinned() and host.numel() == 1000
    host.fill_(3)
    slot = device.allocate(1000)
    device.host_wait(device.copy(slot, host, after=device.compute_record()))
    assert slot.eq(3).all()
    device.unpin(host)
    (torch.ones(4, device="cuda") + 1).sum().item()  # a kernel launch check would raise a stale error
    torch.cuda.synchronize()


def quantized_pair(folder: str, weights: str):
    """A tiny float32 target saved to ``folder``, and a loader of its quanto-quantized copies (held on the CPU)."""
    from transformers import AutoModelForCausalLM, QuantoConfig

    target = tiny_model("llama", seed=5, num_layers=4, dtype=torch.float32)
    target.save_pretrained(folder)
    return target, lambda: AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=QuantoConfig(weights=weights), attn_implementation="sdpa"
    )


needs_quanto = pytest.mark.skipif(not importable("optimum.quanto"), reason="needs optimum-quanto")


@pytest.fixture
def quanto_unpack_on_cuda():
    """quanto's portable unpack kernel on CUDA: without it the first int4 weight on the GPU compiles quanto's CUDA
    extension (minutes; the first GPU run's int4 test did not finish in 70 s)."""
    from specexec_hf.patches import quanto_unpack

    quanto_unpack.apply()
    yield
    quanto_unpack.revert()


@needs_quanto
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_quantized_target_streams_packed_weights_and_specexec_equals_its_own_greedy(weights, prefetch):
    """quanto weights stream as their packed inner tensors and are rebuilt over the ring: same logits, same text."""
    with tempfile.TemporaryDirectory() as folder:
        target, load_quantized = quantized_pair(folder, weights)
        quantized = load_quantized()
        device_map = layer_map(quantized, "cpu")
        # quanto's own packed kernels (the expanded default: tests/test_int4_expand.py)
        streamed = stream_on_device(
            load_quantized(), device_map, OrderCheckingDevice(), prefetch=prefetch, expand_quantized=False
        )
    streamer = layer_streamer(streamed)
    layer = streamed.model.layers[1].mlp.down_proj.weight
    assert type(layer) is type(quantized.model.layers[1].mlp.down_proj.weight)
    packed = layer._data._data if weights == "int4" else layer._data  # int4 nests a packed uint8 tensor
    assert packed.dtype == (torch.uint8 if weights == "int4" else torch.int8)
    assert streamer._slots[1].buffer.data_ptr() <= packed.data_ptr() < streamer._slots[1].buffer.data_ptr() + (
        streamer._slots[1].buffer.numel()
    )
    float_layer_bytes = sum(p.numel() * p.element_size() for p in target.model.layers[1].parameters())
    assert streamer._unit_bytes[1] < 0.5 * float_layer_bytes  # the packed bytes are streamed, not a float copy
    ids = prompt(7, 6)
    with torch.no_grad():
        reference = quantized(ids).logits
        for _ in range(3):
            assert torch.equal(streamed(ids).logits, reference)
    expected = quantized.generate(ids, max_new_tokens=20, do_sample=False)
    got = streamed.generate(
        ids, max_new_tokens=20, do_sample=False, assistant_model=perturbed_copy(target, 0.05, 6),
        speculator="specexec", budget=12,
    )
    assert got.tolist() == expected.tolist()


def test_a_model_in_memory_is_placed_without_calling_its_state_dict():
    """accelerate's dispatch_model checks a map with model.state_dict(), which unpacks quanto's int4 TinyGemm weights
    through a matrix product on the CPU: minutes for a 70B layer. A map of RAM-placed units needs no dispatch."""
    model = tiny_model("llama", seed=4, num_layers=3, dtype=torch.float32)
    ids = prompt(2, 9)
    with torch.no_grad():
        expected = model(ids).logits

    def refuse(*args, **kwargs):
        raise AssertionError("state_dict() called while placing")

    placing = copy.deepcopy(model)
    placing.state_dict = refuse
    streamed = stream_on_device(placing, layer_map(placing, "cpu"), OrderCheckingDevice(), prefetch=1)
    with torch.no_grad():
        assert torch.equal(streamed(ids).logits, expected)


def test_a_device_map_leaving_a_weight_unplaced_is_refused_naming_it():
    model = tiny_model("llama", seed=4, num_layers=3, dtype=torch.float32)
    device_map = layer_map(model, "cpu")
    del device_map["model.layers.1"]
    with pytest.raises(ValueError, match=r"places no module holding 'model\.layers\.1\..*offload_device_map"):
        stream_on_device(model, device_map, OrderCheckingDevice())


@needs_quanto
def test_quantized_weights_on_disk_are_refused_before_writing_anything():
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as offload:
        _, load_quantized = quantized_pair(folder, "int8")
        quantized = load_quantized()
        with pytest.raises(ValueError, match=r"model.layers.0, which holds quantized .* max_memory\['cpu'\]"):
            stream_on_device(quantized, layer_map(quantized, "disk"), OrderCheckingDevice(), offload)
        assert not os.listdir(offload)


@needs_quanto
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_cuda_quantized_streamed_logits_equal_the_quantized_model_on_the_gpu(weights, quanto_unpack_on_cuda):
    """On the GPU, quanto repacks weights for its kernels; the streamer streams that device form."""
    with tempfile.TemporaryDirectory() as folder:
        target, load_quantized = quantized_pair(folder, weights)
        reference = load_quantized().to("cuda")
        streamed = stream_on_device(
            load_quantized(), layer_map(reference, "cpu"), CudaDevice(0), prefetch=1, expand_quantized=False
        )
    ids = prompt(7, 40).cuda()
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(streamed(ids).logits, reference(ids).logits)
    draft = perturbed_copy(target, 0.05, 6).to("cuda")
    expected = reference.generate(ids, max_new_tokens=20, do_sample=False)
    got = streamed.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft, speculator="specexec")
    assert got.tolist() == expected.tolist()
