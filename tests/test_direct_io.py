"""The streaming executor's disk tier: direct reads bit-equal to the bytes on disk and to the in-memory model, the
page-cache fallback where O_DIRECT is refused, and clear errors for a changed file, a short read, a full disk."""

from __future__ import annotations

import copy
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import specexec_hf
from specexec_hf.core.stats import StepStats
from specexec_hf.hf import offload_hint
from specexec_hf.offload import direct_io, folder, layer_streamer, load_offloaded, placement
from specexec_hf.offload import stream as stream_module
from specexec_hf.offload.direct_io import BLOCK, DirectReader, Span, WeightFile, WeightFileError, plan_reads
from specexec_hf.offload.layout import ring_bytes


@pytest.fixture
def refuse_o_direct(monkeypatch):
    """Makes every ``open(O_DIRECT)`` fail with ``EINVAL``, as on tmpfs, wherever the tests run."""
    real_open = os.open

    def open_without_o_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", open_without_o_direct)
    monkeypatch.setattr(direct_io, "_warned_folders", set())


def random_file(folder, size: int, seed: int = 0):
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    path = folder / f"weights-{seed}-{size}.bin"
    path.write_bytes(data.numpy().tobytes())
    return path, data


# A span: (file offset, element count, stored dtype, target dtype); targets go back to back into one buffer.
DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64]
span_strategy = st.tuples(
    st.integers(0, 5 * BLOCK), st.integers(1, 3000), st.sampled_from(DTYPES), st.sampled_from(DTYPES)
)


@given(
    spans=st.lists(span_strategy, min_size=1, max_size=6),
    gaps=st.lists(st.integers(0, 2 * BLOCK), min_size=6, max_size=6),
    request_blocks=st.integers(1, 3),
    direct=st.booleans(),
)
@settings(max_examples=60)
def test_read_plans_fill_every_span_with_the_file_bytes(tmp_path_factory, spans, gaps, request_blocks, direct):
    """Whatever the offsets, sizes, dtypes, gaps and request size, each target holds its bytes (converted)."""
    path, data = random_file(tmp_path_factory.mktemp("spans"), 6 * BLOCK + 3000 * 8, seed=len(spans))
    file = WeightFile(path, direct=direct)
    layout, size = [], 0
    for (offset, count, stored, computed), gap in zip(spans, gaps):
        if stored == computed or torch.uint8 in (stored, computed):  # a raw run: bytes, placed as the file has them
            stored = computed = torch.uint8
            count *= 3
            start = size + gap + (offset - size - gap) % BLOCK
        else:  # a conversion, into a fresh 64-byte-aligned tensor
            start = size + gap + -(size + gap) % 64
        layout.append((offset, count, stored, computed, start))
        size = start + count * computed.itemsize
    buffer = direct_io.aligned_empty(size + BLOCK)
    buffer.fill_(0xAB)
    span_list = []
    for offset, count, stored, computed, start in layout:
        target = buffer[start : start + count * computed.itemsize].view(computed)
        span_list.append(Span(file, offset, offset + count * stored.itemsize, target, stored))
    reader = DirectReader(threads=3, request_bytes=request_blocks * BLOCK)
    try:
        reader.read(plan_reads(span_list, request_blocks * BLOCK))
    finally:
        reader.close()
    for (offset, count, stored, computed, _), span in zip(layout, span_list):
        expected = data[offset : offset + count * stored.itemsize].clone().view(stored).to(computed)
        assert torch.equal(span.target.view(torch.uint8), expected.view(torch.uint8))  # bits: random bytes hold NaNs


def test_raw_spans_land_in_place_when_the_blocks_around_them_are_free(tmp_path):
    path, data = random_file(tmp_path, 4 * BLOCK)
    file = WeightFile(path)
    buffer = direct_io.aligned_empty(4 * BLOCK)
    alone = plan_reads([Span(file, 100, 5000, buffer[100:5000])])
    assert alone.direct_bytes == 2 * BLOCK  # the two blocks around bytes 100-5000
    crowded = plan_reads([Span(file, 100, 5000, buffer[100:5000]), Span(file, 0, 50, buffer[10:60])])
    assert crowded.direct_bytes == 0  # the other span sits in the first block's head: both go through a bounce
    DirectReader().read(crowded)
    assert torch.equal(buffer[100:5000], data[100:5000]) and torch.equal(buffer[10:60], data[0:50])


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (Linux's /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                begin, end = (int(bound, 16) for bound in first.split("-"))
                inside = begin <= address < end
            elif inside and first == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the mappings' flags from Linux's /proc")
@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"), reason="a kernel without transparent huge pages"
)
@given(huge_pages=st.integers(1, 3), extra=st.integers(0, direct_io.HUGE_PAGE - 1))
@settings(max_examples=6)
def test_large_direct_read_buffers_are_advised_onto_huge_pages(huge_pages, extra):
    """Whole huge pages of a large buffer are in a mapping advised for transparent huge pages (VmFlags ``hg``), so
    direct reads land in physically contiguous memory; the partial last page is not (no memory beyond the asked)."""
    nbytes = huge_pages * direct_io.HUGE_PAGE + extra
    buffer = direct_io.aligned_empty(nbytes)
    assert buffer.numel() == nbytes and buffer.data_ptr() % direct_io.HUGE_PAGE == 0
    assert "hg" in _vm_flags(buffer.data_ptr()) and "hg" in _vm_flags(buffer.data_ptr() + nbytes - extra - 1)
    if extra:
        assert "hg" not in _vm_flags(buffer.data_ptr() + nbytes - 1)
    buffer.fill_(7)  # writable, and the mapping lives as long as the tensor
    assert int(buffer[-1]) == 7 and int(buffer.view(-1)[0]) == 7


def test_without_huge_page_advice_a_large_buffer_still_reads_right(tmp_path, monkeypatch):
    monkeypatch.delattr(direct_io.mmap, "MADV_HUGEPAGE")  # a platform without it: memory from torch, as elsewhere
    path, data = random_file(tmp_path, direct_io.HUGE_PAGE + BLOCK)
    buffer = direct_io.aligned_empty(direct_io.HUGE_PAGE + BLOCK)
    DirectReader().read(plan_reads([Span(WeightFile(path), 0, data.numel(), buffer)]))
    assert torch.equal(buffer, data)


def test_a_filesystem_without_o_direct_reads_through_the_page_cache_with_one_warning(tmp_path, refuse_o_direct, caplog):
    path, data = random_file(tmp_path, 3 * BLOCK)
    with caplog.at_level(logging.WARNING, logger=direct_io.__name__):
        files = [WeightFile(path), WeightFile(path)]
    assert [file.direct for file in files] == [False, False]
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "refuses O_DIRECT" in warnings[0] and "Invalid argument" in warnings[0]
    target = torch.empty(5000, dtype=torch.uint8)
    DirectReader().read(plan_reads([Span(files[0], 7, 5007, target)]))
    assert torch.equal(target, data[7:5007])


def test_a_direct_read_refused_after_open_falls_back_to_the_page_cache(tmp_path, monkeypatch, caplog):
    path, data = random_file(tmp_path, 3 * BLOCK)
    real_open = os.open
    # A filesystem that accepts O_DIRECT at open and refuses the read, wherever tmp_path is.
    accepting = getattr(os, "O_DIRECT", 0)
    monkeypatch.setattr(direct_io.os, "open", lambda path, flags, *args: real_open(path, flags & ~accepting, *args))
    file = WeightFile(path)
    monkeypatch.setattr(direct_io.os, "open", real_open)
    assert file.direct
    real_preadv = os.preadv
    refused = []

    def preadv_refusing_the_first(fd, buffers, offset):
        if not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(direct_io.os, "preadv", preadv_refusing_the_first)
    monkeypatch.setattr(direct_io, "_warned_folders", set())
    target = direct_io.aligned_empty(2 * BLOCK)
    with caplog.at_level(logging.WARNING, logger=direct_io.__name__):
        file.read(BLOCK, target)
    assert refused and not file.direct
    assert torch.equal(target, data[BLOCK : 3 * BLOCK])
    assert "pread(O_DIRECT) failed" in caplog.text


def test_a_file_truncated_after_opening_gives_a_short_read_error(tmp_path):
    path, _ = random_file(tmp_path, 4 * BLOCK)
    file = WeightFile(path)
    os.truncate(path, BLOCK + 10)
    with pytest.raises(WeightFileError, match="Short read .*truncated"):
        file.read(0, direct_io.aligned_empty(4 * BLOCK))
    with pytest.raises(WeightFileError, match="size went from 16384 to 4106 bytes"):
        file.check_unchanged()


def test_a_truncated_safetensors_file_is_named_before_any_read(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(100), "b": torch.ones(2000)}, str(path))
    os.truncate(path, path.stat().st_size - 100)
    file = WeightFile(path)
    assert file.safetensors_entry("a")[1:] == (torch.float32, (100,))
    with pytest.raises(WeightFileError, match="is truncated: its header places 'b'"):
        file.safetensors_entry("b")


def checkpoint(folder, dtype=torch.float64, num_layers=3, vocab_size=64, seed=3):
    model = tiny_model("llama", seed=seed, num_layers=num_layers, vocab_size=vocab_size, dtype=dtype)
    model.save_pretrained(folder)
    return folder / "model.safetensors"


def ids(length: int = 7, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))


@pytest.mark.parametrize("change", ["truncated", "rewritten in place"])
def test_a_checkpoint_changed_under_a_streamed_model_raises_instead_of_computing(tmp_path, change):
    path = checkpoint(tmp_path)
    model = load_offloaded(tmp_path, max_memory={"cpu": 0})
    with torch.no_grad():
        model(ids())
        if change == "truncated":
            os.truncate(path, path.stat().st_size // 2)
        else:
            size, stat = path.stat().st_size, path.stat()
            with open(path, "r+b") as handle:
                handle.seek(size // 2)
                handle.write(b"\0" * 64)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # coarse clocks: make the change show
        with pytest.raises(WeightFileError, match="changed after the model was loaded|Short read"):
            model(ids())


def test_a_truncated_offload_file_is_refused_when_the_streamer_is_planned(tmp_path):
    model = load_offloaded(tiny_model("llama", num_layers=2), max_memory={"cpu": 0}, offload_folder=tmp_path,
                           executor="accelerate")
    dat = tmp_path / "model.layers.1.mlp.up_proj.weight.dat"
    os.truncate(dat, dat.stat().st_size - 8)
    with pytest.raises(WeightFileError, match="up_proj.weight.dat is truncated"):
        specexec_hf.stream(model)


class _Usage:
    """What ``shutil.disk_usage`` returns, as far as the free-space check reads it (a filesystem of some size)."""

    def __init__(self, free: int):
        self.free = free
        self.total = 2**40


def test_no_room_for_the_offload_folder_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(folder.shutil, "disk_usage", lambda folder: _Usage(10_000))
    with pytest.raises(OSError, match="No space left in the offload folder .* raise max_memory") as raised:
        load_offloaded(tiny_model("llama"), max_memory={"cpu": 0}, offload_folder=tmp_path)
    assert raised.value.errno == errno.ENOSPC
    assert not list(tmp_path.glob("*.dat"))


def test_a_disk_filling_up_while_offloading_raises_enospc_with_the_fix(tmp_path, monkeypatch):
    real_write = folder._write_tensor_file
    written = []

    def write_until_full(path, flat):
        if len(written) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(path)
        real_write(path, flat)

    monkeypatch.setattr(folder, "_write_tensor_file", write_until_full)
    with pytest.raises(OSError, match="No space left in the offload folder") as raised:
        load_offloaded(tiny_model("llama"), max_memory={"cpu": 0}, offload_folder=tmp_path)
    assert raised.value.errno == errno.ENOSPC and len(written) == 3


@given(
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    stored=st.sampled_from(
        ["checkpoint, same dtype", "checkpoint, converted", "checkpoint, bfloat16", "offload folder"]
    ),
    num_layers=st.integers(1, 4),
    vocab_size=st.sampled_from([64, 200, 1031]),
    prefetch=st.integers(1, 4),
    direct=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=20)
def test_direct_reads_give_logits_bit_equal_to_the_in_memory_model(
    tmp_path_factory, dtype, stored, num_layers, vocab_size, prefetch, direct, seed
):
    """Over dtypes, shapes, ring sizes, checkpoint or offload folder, with O_DIRECT and through the fallback."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        if not direct:
            monkeypatch.setattr(stream_module, "WeightFile", lambda path: WeightFile(path, direct=False))
        streamed, reference = streamed_and_reference(
            tmp_path_factory.mktemp("model"), dtype, stored, num_layers, vocab_size, prefetch, seed
        )
    streamer = layer_streamer(streamed)
    assert streamer is not None
    if not direct:
        assert not any(file.direct for _, plan in streamer._units for file in plan.files)
    with torch.no_grad():
        for length in (5, 1, 3):  # later forwards run from buffers read ahead
            tokens = ids(length, vocab_size)
            assert torch.equal(streamed(tokens).logits, reference(tokens).logits)


def streamed_and_reference(folder, dtype, stored, num_layers, vocab_size, prefetch, seed):
    """A streamed tiny model, read from a safetensors checkpoint or an offload folder, and the same in memory."""
    if stored == "offload folder":
        reference = tiny_model("llama", seed=seed, num_layers=num_layers, vocab_size=vocab_size, dtype=dtype)
        streamed = load_offloaded(copy.deepcopy(reference), max_memory={"cpu": 0}, offload_folder=folder,
                                  prefetch=prefetch)
    else:
        saved = {"checkpoint, same dtype": dtype, "checkpoint, converted": torch.float64}.get(stored, torch.bfloat16)
        checkpoint(folder, saved, num_layers, vocab_size, seed)
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        streamed = load_offloaded(folder, max_memory={"cpu": 0}, dtype=dtype, prefetch=prefetch)
    return streamed, reference


def test_the_ring_layout_lets_every_raw_run_land_in_place(tmp_path):
    """Weights stored in their compute dtype are read straight into the ring: no bounce, no copy."""
    checkpoint(tmp_path, torch.float32)
    streamer = layer_streamer(load_offloaded(tmp_path, max_memory={"cpu": 0}, dtype=torch.float32, prefetch=2))
    for _, plan in streamer._units:
        assert plan.requests and plan.direct_bytes == sum(request.length for request in plan.requests)


def test_a_bfloat16_checkpoint_computed_in_float32_reads_half_the_bytes_it_streams_into_the_ring(tmp_path):
    """The disk moves the stored bytes (block-aligned); the ring receives them widened to the compute dtype."""
    checkpoint(tmp_path, torch.bfloat16, num_layers=3)
    streamer = layer_streamer(load_offloaded(tmp_path, max_memory={"cpu": 0}, dtype=torch.float32, prefetch=1))
    cycling = [(module, plan) for (module, plan), stays in zip(streamer._units, streamer._stays_loaded) if not stays]
    stored = sum(parameter.numel() * 2 for module, _ in cycling for parameter in module.parameters())
    requests = sum(len(plan.requests) for _, plan in cycling)
    assert cycling and stored <= streamer.read_bytes_per_forward <= stored + 2 * direct_io.BLOCK * requests
    assert streamer.streamed_bytes_per_forward >= 2 * stored


def test_load_offloaded_streams_by_default(tmp_path):
    model = load_offloaded(tiny_model("llama"), max_memory={"cpu": 0}, offload_folder=tmp_path)
    assert layer_streamer(model) is not None


def test_stream_takes_over_a_model_from_pretrained_offloaded_and_the_hint_names_it(tmp_path, monkeypatch, caplog):
    checkpoint(tmp_path / "checkpoint")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint", attn_implementation="sdpa")
    device_map = placement.offload_device_map(reference, {"cpu": 0})
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "checkpoint", device_map=device_map, offload_folder=tmp_path / "offload", attn_implementation="sdpa"
    )
    monkeypatch.setattr(offload_hint, "_hinted", False)
    with caplog.at_level(logging.WARNING, logger=offload_hint.__name__):
        for _ in range(2):  # SpecExec's generate() gives the hint, once
            model.generate(ids(), attention_mask=torch.ones_like(ids()), max_new_tokens=2, do_sample=False,
                           assistant_model=reference, speculator="specexec", budget=4)
        assert not offload_hint.hint_streaming_executor(model)  # given already
    hints = [record.getMessage() for record in caplog.records if record.name == offload_hint.__name__]
    assert len(hints) == 1 and "specexec_hf.stream(model)" in hints[0]
    assert specexec_hf.stream(model) is model and layer_streamer(model) is not None
    monkeypatch.setattr(offload_hint, "_hinted", False)
    assert not offload_hint.hint_streaming_executor(model)  # the hooks are gone
    with torch.no_grad():
        assert torch.equal(model(ids()).logits, reference(ids()).logits)


def test_stream_refuses_a_model_accelerate_did_not_dispatch():
    with pytest.raises(ValueError, match="no hf_device_map.*load_offloaded"):
        specexec_hf.stream(tiny_model("llama"))


@pytest.mark.parametrize("dtype, native, hinted", [(torch.bfloat16, False, True), (torch.bfloat16, True, False),
                                                   (torch.float32, False, False)])
def test_bfloat16_streamed_to_a_cpu_without_native_bfloat16_gets_the_float32_hint(
    tmp_path, monkeypatch, caplog, dtype, native, hinted
):
    monkeypatch.setattr(stream_module, "native_bfloat16_cpu", lambda: native)
    checkpoint(tmp_path, torch.bfloat16)
    with caplog.at_level("WARNING", logger=stream_module.__name__):
        load_offloaded(tmp_path, max_memory={"cpu": 0}, dtype=dtype)
    hints = [record.message for record in caplog.records if "dtype=torch.float32" in record.message]
    assert len(hints) == hinted


def await_landing_records(streamer, monkeypatch) -> Callable[[], None]:
    """A function that blocks until the streamer has recorded when each unit read ahead for its next forward landed.

    The reader thread records a landing in a callback of the read's future, which may run just after
    ``wait_idle()`` returns: the returned function waits for those records, on a condition the callback notifies.
    """
    recorded = threading.Condition()
    record = streamer._landed

    def record_and_notify(position: int, fill: Future) -> None:
        record(position, fill)
        with recorded:
            recorded.notify_all()

    monkeypatch.setattr(streamer, "_landed", record_and_notify)

    def all_recorded() -> bool:
        ahead = streamer._cycling[: streamer._prefetch]
        slots = [streamer._slots[streamer._slot_of[position]] for position in ahead]
        return bool(ahead) and all(
            (entry := streamer._landed_at.get(position)) is not None and entry[0] is slot.filled
            for position, slot in zip(ahead, slots)
        )

    def wait() -> None:
        with recorded:
            assert recorded.wait_for(all_recorded, timeout=60), "the read-ahead's landings were never recorded"

    return wait


def test_the_streamer_counts_how_long_the_disk_sat_idle_before_a_forward(tmp_path, monkeypatch):
    checkpoint(tmp_path, num_layers=6)
    model = load_offloaded(tmp_path, max_memory={"cpu": 0}, prefetch=2)
    streamer = layer_streamer(model)
    # The streamer's clock, moved by the test alone: the idle time is the exact gap the test puts in.
    clock = SimpleNamespace(seconds=1.0)
    monkeypatch.setattr(stream_module, "time", SimpleNamespace(perf_counter=lambda: clock.seconds))
    await_read_ahead = await_landing_records(streamer, monkeypatch)
    with torch.no_grad():
        model(ids())
        assert (streamer.forwards_begun, streamer.read_ahead_idle_seconds) == (1, 0.0)  # nothing was read ahead
        streamer.wait_idle()
        await_read_ahead()
        clock.seconds += 0.5
        model(ids())
        assert (streamer.forwards_begun, streamer.read_ahead_idle_seconds) == (2, 0.5)
        # A forward whose read-ahead has not all landed adds no idle time.
        idle, first = streamer.read_ahead_idle_seconds, streamer._slots[streamer._slot_of[0]]
        landed, first.filled = first.filled, Future()
        streamer._note_forward_start()
        assert streamer.forwards_begun == 3 and streamer.read_ahead_idle_seconds == idle
        first.filled = landed
        assert torch.equal(model(ids()).logits, AutoModelForCausalLM.from_pretrained(tmp_path)(ids()).logits)
    streamer.close()


def read_ahead_hint(streamer, idle_per_forward: float, forward_seconds: float, forwards: int = 8) -> str | None:
    """The hint a ReadAheadWatch gives for ``forwards`` steps over a stand-in streamer, or None."""
    steps: list = []
    with patch.object(offload_hint, "executor_of", return_value=streamer):
        watch = offload_hint.ReadAheadWatch(SimpleNamespace(), steps)
    streamer.forwards_begun += forwards
    streamer.read_ahead_idle_seconds += forwards * idle_per_forward
    steps += [StepStats(tree_size=17, accepted=3, draft_forwards=5, draft_seconds=0.06,
                        target_seconds=forward_seconds)] * forwards
    with patch.object(offload_hint.logger, "warning") as warning:
        given = watch.finish()
    assert given == warning.called
    return warning.call_args.args[0] if given else None


def test_the_read_ahead_hint_names_the_depth_the_idle_disk_could_have_read(monkeypatch):
    monkeypatch.setattr(offload_hint, "_hinted_read_ahead", False)
    layers = [14_000_000] * 30  # the default target's decoder layers, about
    streamer = SimpleNamespace(forwards_begun=8, read_ahead_idle_seconds=0.0, prefetch=4, cycling_units=30,
                               buffer_bytes=ring_bytes(layers, 4), ring_bytes_at=partial(ring_bytes, layers))
    assert read_ahead_hint(streamer, 0.04, 0.18) is None  # idle 22% of a forward: not worth a hint
    assert read_ahead_hint(streamer, 0.06, 0.18, forwards=7) is None  # too few forwards to judge
    # 26 units read in 0.18 s: 6.9 ms each, so 0.06 s of idle disk would have read 9 more: 13 ahead, whose ring
    # (14 buffers, plus 2 for the layers left over) is larger than 14 ahead's (15 buffers, 30 layers evenly).
    hint = read_ahead_hint(streamer, 0.06, 0.18)
    assert "prefetch=14" in hint and "about 140 MB more memory" in hint and "60 ms" in hint
    assert read_ahead_hint(streamer, 0.06, 0.18) is None  # once per process
    monkeypatch.setattr(offload_hint, "_hinted_read_ahead", False)
    # More than the deepest ring that still streams (14 ahead: from 15 on, the leftover layers fill the ring and
    # every layer stays) is not hinted: that one is.
    assert "prefetch=14" in read_ahead_hint(streamer, 1.0, 0.18)
    monkeypatch.setattr(offload_hint, "_hinted_read_ahead", False)
    streamer.forwards_begun = 0
    assert read_ahead_hint(streamer, 0.06, 0.18) is None  # a first call's forwards (the warm-up) are not judged
    streamer.forwards_begun, streamer.cycling_units = 8, 0
    assert read_ahead_hint(streamer, 0.06, 0.18) is None  # every unit stays loaded: nothing to read ahead
    assert offload_hint.ReadAheadWatch(SimpleNamespace(), []).finish() is False  # not streamed: nothing to say


def test_generate_on_a_streamed_target_hints_a_deeper_read_ahead_when_the_draft_outlasts_it(tmp_path, monkeypatch,
                                                                                           caplog):
    checkpoint(tmp_path, num_layers=6)
    target = load_offloaded(tmp_path, max_memory={"cpu": 0}, prefetch=1)
    draft = perturbed_copy(AutoModelForCausalLM.from_pretrained(tmp_path), 0.05, seed=1)
    draft.register_forward_pre_hook(lambda *_: time.sleep(0.03))  # a draft far slower than the tiny target
    monkeypatch.setattr(offload_hint, "_hinted_read_ahead", False)
    with caplog.at_level(logging.WARNING, logger=offload_hint.__name__):
        for _ in range(2):  # the first call warms up and is not judged
            target.generate(ids(), attention_mask=torch.ones_like(ids()), max_new_tokens=40, do_sample=False,
                            assistant_model=draft, speculator="specexec", budget=2)  # 3 tokens a step at most
    hints = [record.getMessage() for record in caplog.records if "sat idle" in record.getMessage()]
    assert len(hints) == 1 and "load_offloaded(..., prefetch=" in hints[0]
    layer_streamer(target).close()
