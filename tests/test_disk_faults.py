"""Disk faults under an offloaded model, each detected and named with the file, the problem and the fix: never other
tokens computed from changed bytes, never a bare library exception, and an offload folder that a failed write left
behind can be loaded into again."""

from __future__ import annotations

import copy
import errno
import json
import logging
import math
import os
import re
import struct
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from specexec_hf.offload import folder as folder_module
from specexec_hf.offload import load_offloaded, placement
from specexec_hf.offload.direct_io import SAFETENSORS_DTYPES, WeightFile, WeightFileError

STREAMED_WEIGHT = "model.layers.1.mlp.up_proj.weight"
DOWNLOAD_AGAIN = "Download or save the checkpoint again"


def prompt() -> torch.Tensor:
    return torch.tensor([[3, 1, 4, 1, 5, 9, 2]])


def saved_model(folder, **save_options) -> torch.nn.Module:
    model = tiny_model("llama", seed=3, num_layers=3, dtype=torch.float32)
    model.save_pretrained(folder, **save_options)
    return model


def streamed(stored: str, folder):
    """A model streamed from ``folder`` with every weight on disk, and the file that holds :data:`STREAMED_WEIGHT`."""
    if stored == "checkpoint":
        saved_model(folder)
        return load_offloaded(folder, max_memory={"cpu": 0}), folder / "model.safetensors"
    model = load_offloaded(tiny_model("llama", num_layers=2), max_memory={"cpu": 0}, offload_folder=folder)
    return model, folder / f"{STREAMED_WEIGHT}.dat"


def let_the_clock_tick() -> None:
    """File times come from a coarse clock (a jiffy, at most 10 ms): a change within the tick of a file's creation
    would leave its status-change time where it was, which no real rewrite of a loaded checkpoint does."""
    time.sleep(0.03)


def rewrite_keeping_size_and_mtime(path) -> None:
    """The issue's fault: bytes in the middle rewritten in place, the size kept and the modification time set back."""
    before = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(before.st_size // 2)
        handle.write(bytes(64))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("stored", ["checkpoint", "offload folder"])
def test_a_weight_file_rewritten_to_the_same_size_and_mtime_is_named_instead_of_computed_on(tmp_path, stored):
    model, path = streamed(stored, tmp_path)
    with torch.no_grad():
        model(prompt())
        let_the_clock_tick()
        rewrite_keeping_size_and_mtime(path)
        with pytest.raises(WeightFileError, match=rf"{re.escape(str(path))} changed after the model was loaded .*"
                                                  r"modification time set back.*Load the model again"):
            model(prompt())


def replace_by_rename(path) -> None:
    replacement = path.with_name("replacement")
    replacement.write_bytes(bytes(path.stat().st_size))
    os.replace(replacement, path)


CHANGES = {
    "rewritten in place, size and mtime kept": (rewrite_keeping_size_and_mtime, "modification time set back"),
    "truncated": (lambda path: os.truncate(path, path.stat().st_size // 2), "its size went from"),
    "appended to": (lambda path: path.write_bytes(path.read_bytes() + b"tail"), "its size went from"),
    "permissions removed": (lambda path: path.chmod(0), "permissions or owner changed"),
    "replaced by a file of the same size (a rename)": (replace_by_rename, "replaced by another file .*new inode"),
    "deleted": (lambda path: path.unlink(), "deleted or moved"),
    "moved away": (lambda path: path.rename(path.with_name("elsewhere")), "deleted or moved"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_change_to_an_open_weight_file_is_named(tmp_path, change):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(16384))
    file = WeightFile(path)
    file.check_unchanged()  # nothing changed yet
    let_the_clock_tick()
    make, named = CHANGES[change]
    make(path)
    with pytest.raises(WeightFileError, match=rf"{re.escape(str(path))} .*{named}.*(Load the model again|load the "
                                              r"model again)"):
        file.check_unchanged()


def damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "header not JSON":
        data[8:16] = b"\x00garbage"
    elif how == "header longer than the file":
        data[:8] = struct.pack("<Q", 2**40)
    else:  # truncated
        del data[len(data) // 2 :]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["header not JSON", "header longer than the file", "truncated"])
@pytest.mark.parametrize("sharded", [False, True])
def test_a_damaged_checkpoint_file_is_named_with_the_fix_before_loading(tmp_path, how, sharded):
    saved_model(tmp_path, max_shard_size="50KB" if sharded else "5GB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 if sharded else len(shards) == 1
    damaged = shards[-1]
    damage(damaged, how)
    with pytest.raises(WeightFileError, match=rf"checkpoint file {re.escape(str(damaged))} is damaged .*"
                                              rf"{DOWNLOAD_AGAIN}"):
        load_offloaded(tmp_path, max_memory={"cpu": 0})


def test_a_checkpoint_file_this_user_may_not_read_is_named_not_called_missing(tmp_path, monkeypatch):
    """safetensors reports a file it may not open as missing ("No such file or directory"); as root, chmod cannot
    make one unreadable, so the permission check and safetensors' error are stood in for."""
    saved_model(tmp_path)
    unreadable = tmp_path / "model.safetensors"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != str(unreadable) and real_access(path, mode))

    def from_pretrained_as_safetensors_fails(*args, **kwargs):
        raise FileNotFoundError(f"No such file or directory: {unreadable}")

    monkeypatch.setattr(placement.AutoModelForCausalLM, "from_pretrained", from_pretrained_as_safetensors_fails)
    with pytest.raises(PermissionError, match=rf"{re.escape(str(unreadable))} may not be read .*chmod a\+r"):
        load_offloaded(tmp_path, max_memory={"cpu": 0})


def fill_up_partway(failing: str, folder, monkeypatch) -> None:
    """Makes the disk fill up halfway through writing the offload folder's first weight file, or its index."""
    if failing == "a weight file":
        def write_half(path, flat):
            with open(path, "wb") as handle:
                handle.write(memoryview(flat.view(torch.uint8).numpy())[: flat.nbytes // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(folder_module, "_write_tensor_file", write_half)
        return
    real_dump = json.dump

    def dump_half(index, handle, **options):
        if not getattr(handle, "name", "").startswith(str(folder)):
            return real_dump(index, handle, **options)
        handle.write(json.dumps(index, **options)[:40])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(folder_module.json, "dump", dump_half)


def index_names_only_whole_files(folder) -> bool:
    """Whether every ``.dat`` file ``folder``'s index names is absent or as long as its entry says."""
    index = json.loads((folder / "index.json").read_text())
    for name, entry in index.items():
        path = folder / f"{name}.dat"
        nbytes = math.prod(entry["shape"] or [1]) * getattr(torch, entry["dtype"]).itemsize
        if path.exists() and path.stat().st_size != nbytes:
            return False
    return True


@pytest.mark.parametrize("failing", ["a weight file", "index.json"])
def test_after_the_disk_fills_up_mid_write_the_same_folder_loads_again(tmp_path, monkeypatch, failing):
    reference = tiny_model("llama", num_layers=2)
    load_offloaded(copy.deepcopy(reference), max_memory={"cpu": 0}, offload_folder=tmp_path)  # an earlier offload
    index_before = (tmp_path / "index.json").read_text()
    with monkeypatch.context() as disk_filling_up:
        fill_up_partway(failing, tmp_path, disk_filling_up)
        with pytest.raises(OSError, match="No space left in the offload folder") as raised:
            load_offloaded(copy.deepcopy(reference), max_memory={"cpu": 0}, offload_folder=tmp_path)
    assert (tmp_path / "index.json").read_text() == index_before  # replaced whole or not at all
    assert index_names_only_whole_files(tmp_path)
    assert not list(tmp_path.glob("*.partial"))
    reloaded = load_offloaded(copy.deepcopy(reference), max_memory={"cpu": 0}, offload_folder=tmp_path)
    with torch.no_grad():
        assert torch.equal(reloaded(prompt()).logits, reference(prompt()).logits)
    assert raised.value.errno == errno.ENOSPC
    assert re.search(r"filled up while .*files begun were removed.*raise max_memory\['cpu'\]", str(raised.value))


def test_an_index_half_written_by_an_older_version_is_named_and_replaced(tmp_path, caplog):
    reference = tiny_model("llama", num_layers=2)
    (tmp_path / "index.json").write_text('{\n  "model.layers.0.mlp.up_proj.weight": {"dty')
    with caplog.at_level(logging.WARNING, logger=folder_module.__name__):
        reloaded = load_offloaded(copy.deepcopy(reference), max_memory={"cpu": 0}, offload_folder=tmp_path)
    assert f"Replacing the unreadable offload index {tmp_path / 'index.json'}" in caplog.text
    with torch.no_grad():
        assert torch.equal(reloaded(prompt()).logits, reference(prompt()).logits)


def disk_usage(total: int, free: int):
    """What ``shutil.disk_usage`` returns, with the given figures."""
    return lambda folder: SimpleNamespace(total=total, used=total - free, free=free)


def test_a_filesystem_that_reports_no_size_is_not_taken_for_a_full_one(tmp_path, monkeypatch):
    """ramfs reports zero blocks, hence zero free bytes, and grows as long as memory lasts."""
    monkeypatch.setattr(folder_module.shutil, "disk_usage", disk_usage(total=0, free=0))
    reference = tiny_model("llama", num_layers=2)
    streamed_model = load_offloaded(copy.deepcopy(reference), max_memory={"cpu": 0}, offload_folder=tmp_path)
    with torch.no_grad():
        assert torch.equal(streamed_model(prompt()).logits, reference(prompt()).logits)


def test_the_free_space_check_counts_the_older_files_a_load_overwrites(tmp_path, monkeypatch):
    reference = tiny_model("llama", num_layers=2)
    load_offloaded(copy.deepcopy(reference), max_memory={"cpu": 0}, offload_folder=tmp_path / "used")
    monkeypatch.setattr(folder_module.shutil, "disk_usage", disk_usage(total=2**30, free=4096))
    with pytest.raises(OSError, match="No space left in the offload folder"):
        load_offloaded(copy.deepcopy(reference), max_memory={"cpu": 0}, offload_folder=tmp_path / "fresh")
    load_offloaded(copy.deepcopy(reference), max_memory={"cpu": 0}, offload_folder=tmp_path / "used")


@pytest.mark.parametrize("failing", ["creating the folder", "writing a weight file"])
def test_a_read_only_offload_folder_is_named_with_the_fix(tmp_path, monkeypatch, failing):
    """A read-only filesystem (``EROFS``), stood in for: as root, permissions cannot make a folder unwritable."""

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))

    failing_call = (folder_module.os, "makedirs") if failing == "creating the folder" else (
        folder_module, "_write_tensor_file")
    monkeypatch.setattr(*failing_call, read_only)
    with pytest.raises(OSError, match=rf"Cannot write the offload folder {re.escape(str(tmp_path))}: Read-only file "
                                      r"system .*Choose an offload_folder on a writable") as raised:
        load_offloaded(tiny_model("llama", num_layers=2), max_memory={"cpu": 0}, offload_folder=tmp_path)
    assert raised.value.errno == errno.EROFS


HEADER_FILE_TENSORS = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(5, dtype=torch.float16)}


@given(changes=st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), min_size=1, max_size=4))
@settings(max_examples=60)
def test_whatever_a_damaged_header_says_an_entry_is_in_the_file_or_the_damage_is_named(tmp_path_factory, changes):
    path = tmp_path_factory.mktemp("header") / "model.safetensors"
    save_file(HEADER_FILE_TENSORS, str(path))
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    for position, value in changes:  # bytes of the header (its length included), the file's size kept
        data[position % (8 + length)] = value
    path.write_bytes(bytes(data))
    file = WeightFile(path)
    for name in HEADER_FILE_TENSORS:
        try:
            start, dtype, shape = file.safetensors_entry(name)
        except KeyError as missing:
            assert str(path) in str(missing)
        except WeightFileError as named:
            assert str(path) in str(named) and ("again" in str(named) or "direct reads do not" in str(named))
        else:
            assert dtype in SAFETENSORS_DTYPES.values()
            assert 8 <= start and start + math.prod(shape) * dtype.itemsize <= len(data)


def test_a_weight_file_that_is_not_a_regular_file_is_named(tmp_path):
    (tmp_path / "weights.bin").mkdir()
    with pytest.raises(WeightFileError, match="weights.bin is not a regular file"):
        WeightFile(tmp_path / "weights.bin")


def test_a_tensor_in_a_dtype_direct_reads_do_not_convert_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"fp8": torch.zeros(4, dtype=torch.float8_e4m3fn), "a": torch.ones(2)}, str(path))
    file = WeightFile(path)
    assert file.safetensors_entry("a")[1:] == (torch.float32, (2,))
    with pytest.raises(WeightFileError, match=r"stores 'fp8' as F8_E4M3, which direct reads do not convert"):
        file.safetensors_entry("fp8")


def test_a_tensor_missing_from_the_checkpoint_is_named(tmp_path):
    tiny_model("llama", num_layers=2).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightFileError, match=r"'model.layers.1.mlp.down_proj.weight' .* incomplete or not this model"):
        load_offloaded(tmp_path, max_memory={"cpu": 0})


@pytest.mark.parametrize("damage", ["removed", "not json"])
def test_an_offload_index_lost_before_the_streamer_reads_it_is_named(tmp_path, damage):
    from specexec_hf.offload.stream import folder_locator

    tiny_model("llama", num_layers=2).save_pretrained(tmp_path)
    index = tmp_path / "index.json"
    if damage == "removed":
        index.unlink(missing_ok=True)
    else:
        index.write_text("{not json")
    with pytest.raises(WeightFileError, match=r"index.json cannot be read .* Load the model again"):
        folder_locator(tmp_path)


def test_a_private_file_unlinked_once_open_is_checked_by_its_descriptor(tmp_path):
    path = tmp_path / "layers.bin"
    path.write_bytes(bytes(8192))
    writer = os.open(path, os.O_WRONLY)
    try:
        file = WeightFile(path, by_name=False)
        os.unlink(path)
        file.check_unchanged()  # no name to check, and the unlink's status change is its owner's
        os.ftruncate(writer, 4096)
        with pytest.raises(WeightFileError, match="its size went from 8192 to 4096 bytes"):
            file.check_unchanged()
    finally:
        os.close(writer)
