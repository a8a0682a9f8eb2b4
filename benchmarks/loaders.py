"""Cold reads of a safetensors file, layer by layer, into buffers the caller owns: published loaders against a pool.

The disk tier of the streaming executor needs one thing from a loader: a decoder layer's byte ranges, read from a
cold file (not in the page cache) into a ring buffer the executor allocated, at the disk's sequential bandwidth.
This script writes a safetensors file of random tensors shaped like decoder layers, then reads every layer's byte
range into a buffer it allocated, ``--repeats`` times per method, evicting the file from the page cache
(``posix_fadvise(DONTNEED)``) before each run:

- ``mmap``: copies from a memory mapping (the executor's disk tier before direct reads);
- ``buffered``: ``preadv`` through the page cache, one request per layer;
- ``pool``: :class:`specexec_hf.offload.direct_io.DirectReader`, ``O_DIRECT`` with ``--threads`` requests of
  ``--request-mib`` in flight, one layer read ahead;
- ``kvikio``: ``kvikio.CuFile.pread`` into the caller's host buffer (its POSIX thread pool, no GPU);
- ``runai``: ``runai_model_streamer.FileStreamer`` over each layer's range, chunks copied into the caller's buffer;
- ``fastsafetensors``: ``SafeTensorsFileLoader`` (``nogds``, CPU), which reads whole files into buffers of its own;
- ``instanttensor``: ``safe_open`` (whole files, into buffers of its own).

A library that is not installed or fails is recorded with its error. Run it in a throwaway environment with the
libraries installed beside the project (``pip install -e . fastsafetensors instanttensor kvikio-cu12
runai-model-streamer``: the pool is the project's own ``specexec_hf.offload.direct_io``), from the repository root::

    /tmp/loaders-venv/bin/python -m benchmarks.loaders --folder /var/tmp/loaders-bench \
        --out benchmarks/results/loaders

Writes ``loaders.json`` and ``loaders.md`` to ``--out``.

``--forward`` (run with the project's environment instead) measures what the choice gives the executor: the
default target's forward over one token, every weight on disk, read by direct reads and through the page-cache
fallback (the file evicted before each forward, as for a model larger than RAM); it writes ``forward.json`` and
``forward.md``::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.loaders --forward --out benchmarks/results/loaders
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from specexec_hf.offload import direct_io

from benchmarks.memory_cap import cached_bytes, evict
from benchmarks.report import table, write_report

READS_INTO = {
    "runai": "its own buffer, then copied",
    "fastsafetensors": "its own buffers, whole file",
    "instanttensor": "its own buffers, whole file",
}
GiB = 2**30
MiB = 2**20


def layer_tensors(hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """A Llama-style decoder layer's weight shapes."""
    return {
        "input_layernorm.weight": (hidden,),
        "mlp.down_proj.weight": (hidden, intermediate),
        "mlp.gate_proj.weight": (intermediate, hidden),
        "mlp.up_proj.weight": (intermediate, hidden),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.k_proj.weight": (hidden // 4, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.v_proj.weight": (hidden // 4, hidden),
    }


def write_checkpoint(path: Path, layers: int, hidden: int, intermediate: int) -> None:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for name, shape in layer_tensors(hidden, intermediate).items():
            bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator)
            tensors[f"model.layers.{layer:03d}.{name}"] = bits.view(torch.bfloat16)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def layer_ranges(path: Path) -> list[tuple[int, int]]:
    """``(first byte, one past the last)`` of each layer in the file (its tensors are stored back to back)."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    start = 8 + length
    ranges: dict[str, list[int]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        layer = ".".join(name.split(".")[:3])
        begin, end = (start + offset for offset in entry["data_offsets"])
        current = ranges.setdefault(layer, [begin, end])
        current[0], current[1] = min(current[0], begin), max(current[1], end)
    return [tuple(ranges[layer]) for layer in sorted(ranges)]


# Each reader: (path, ranges, buffers) -> None, reading layer i's range into buffers[i % 2][: length].


def read_mmap(path, ranges, buffers):
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    source = torch.frombuffer(mapping, dtype=torch.uint8)
    for index, (begin, end) in enumerate(ranges):
        buffers[index % 2][: end - begin].copy_(source[begin:end])
    del source
    mapping.close()


def read_buffered(path, ranges, buffers):
    fd = os.open(path, os.O_RDONLY)
    try:
        for index, (begin, end) in enumerate(ranges):
            view = memoryview(buffers[index % 2][: end - begin].numpy())
            done = 0
            while done < end - begin:
                done += os.preadv(fd, [view[done:]], begin + done)
    finally:
        os.close(fd)


def pool_reader(threads: int, request_mib: int) -> Callable:
    def read(path, ranges, buffers):
        file = direct_io.WeightFile(path)
        assert file.direct, f"{path}: O_DIRECT refused"
        reader = direct_io.DirectReader(threads, request_mib * MiB)
        try:
            pending = None
            for index, (begin, end) in enumerate(ranges):
                target = buffers[index % 2][_offset(begin) : _offset(begin) + end - begin]
                span = direct_io.Span(file, begin, end, target)
                future = reader.submit(direct_io.plan_reads([span], request_mib * MiB))
                if pending is not None:
                    pending.result()  # one layer read ahead, as the executor's ring does
                pending = future
            pending.result()
        finally:
            reader.close()
            file.close()

    return read


def _offset(begin: int) -> int:
    """Where a range starting at file offset ``begin`` lands in an aligned buffer (the file offset modulo a block)."""
    return begin % direct_io.BLOCK


def kvikio_reader(threads: int, request_mib: int) -> Callable:
    import kvikio
    import kvikio.defaults

    settings = {"compat_mode": kvikio.CompatMode.ON, "num_threads": threads, "task_size": request_mib * MiB}
    for name in ("auto_direct_io_read",):
        settings[name] = True

    def read(path, ranges, buffers):
        with kvikio.defaults.set(settings):
            handle = kvikio.CuFile(str(path), "r")
            try:
                pending = None
                for index, (begin, end) in enumerate(ranges):
                    target = buffers[index % 2][: end - begin].numpy()
                    future = handle.pread(target, end - begin, begin)
                    if pending is not None:
                        pending.get()
                    pending = future
                pending.get()
            finally:
                handle.close()

    return read


def runai_reader(threads: int, request_mib: int) -> Callable:
    os.environ["RUNAI_STREAMER_CONCURRENCY"] = str(threads)
    os.environ["RUNAI_STREAMER_CHUNK_BYTESIZE"] = str(request_mib * MiB)
    from runai_model_streamer.file_streamer.file_streamer import FileStreamer
    from runai_model_streamer.file_streamer.requests_iterator import FileChunks

    def read(path, ranges, buffers):
        chunk = request_mib * MiB
        requests = []
        for index, (begin, end) in enumerate(ranges):
            sizes = [min(chunk, end - at) for at in range(begin, end, chunk)]
            requests.append(FileChunks.contiguous(index, str(path), begin, sizes))
        with FileStreamer() as streamer:
            streamer.stream_files(requests)
            for file_index, chunk_index, data in streamer.get_chunks():
                begin, end = ranges[file_index]
                at = chunk_index * chunk
                source = data.reshape(-1)  # a uint8 tensor over the streamer's own buffer
                buffers[file_index % 2][at : at + source.numel()].copy_(source)

    return read


def read_fastsafetensors(path, ranges, buffers):
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    try:
        loader.add_filenames({0: [str(path)]})
        files = loader.copy_files_to_device()
        files.close()
    finally:
        loader.close()


def read_instanttensor(path, ranges, buffers):
    from instanttensor import safe_open

    with safe_open(str(path), framework="pt", device="cpu", copy=False) as handle:
        for _name, _tensor in handle.tensors():
            pass


def methods(args) -> dict[str, Callable]:
    found: dict[str, Callable] = {"mmap": read_mmap, "buffered": read_buffered}
    for threads in args.threads:
        for request_mib in args.request_mib:
            found[f"pool t{threads} r{request_mib}MiB"] = pool_reader(threads, request_mib)
    for label, build in (("kvikio", kvikio_reader), ("runai", runai_reader)):
        try:
            found[f"{label} t4 r8MiB"] = build(4, 8)
        except Exception as error:  # noqa: BLE001 - recorded as the library's result
            found[f"{label} t4 r8MiB"] = _failing(error)
    found["fastsafetensors"] = read_fastsafetensors
    found["instanttensor"] = read_instanttensor
    return found


def _failing(error: BaseException) -> Callable:
    def read(path, ranges, buffers):
        raise error

    return read


def verify(path: Path, ranges, buffers, index: int, offset: int) -> bool:
    """Whether layer ``index``, the last read, landed at ``offset`` in its buffer with the file's bytes."""
    begin, end = ranges[index]
    expected = torch.empty(end - begin, dtype=torch.uint8)
    read_buffered(path, [(begin, end)], [expected, expected])
    return torch.equal(buffers[index % 2][offset : offset + end - begin], expected)


def measure_forward(args) -> None:
    """The default target's 1-token forward, all on disk: direct reads against the page-cache fallback, cold."""
    from specexec_hf.models.default_pair import default_target_dir
    from specexec_hf.offload import layer_streamer, load_offloaded
    from specexec_hf.offload import stream as stream_module

    checkpoint = default_target_dir()
    weights = checkpoint / "model.safetensors"
    token = torch.tensor([[42]])
    results = []
    for round_ in range(args.repeats):
        bound = disk_bound(weights)
        results.append({"round": round_, "mode": "bound: DirectReader, whole file", **bound})
        print(json.dumps(results[-1]), flush=True)
        for mode in ("direct", "page cache"):
            stream_module.WeightFile = partial(direct_io.WeightFile, direct=mode == "direct")
            model = load_offloaded(checkpoint, max_memory={"cpu": 0}, prefetch=args.prefetch)
            streamer = layer_streamer(model)
            times = []
            with torch.no_grad():
                model(token)
                for _ in range(args.forwards):
                    streamer.wait_idle()
                    for path in checkpoint.glob("*.safetensors"):
                        evict(path)
                    started = time.perf_counter()
                    model(token)
                    times.append(time.perf_counter() - started)
            streamer.close()
            seconds = statistics.median(times)
            result = {
                "round": round_,
                "mode": mode,
                "median_ms": seconds * 1e3,
                "forwards_ms": [round(t * 1e3) for t in times],
                "streamed_bytes": streamer.streamed_bytes_per_forward,
                "gb_per_s": streamer.streamed_bytes_per_forward / seconds / 1e9,
            }
            results.append(result)
            print(json.dumps(result), flush=True)
    stream_module.WeightFile = direct_io.WeightFile
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "checkpoint": str(checkpoint),
        "prefetch": args.prefetch,
        "omp_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.release()}",
    }
    lines = [
        "# The default target's forward over one token, every weight on disk, cold",
        "",
        f"prefetch={args.prefetch}, {meta['omp_threads']} torch thread(s), {args.forwards} forwards per load, the "
        f"checkpoint evicted from the page cache before each; median per load. The bound row is one cold read of "
        "the whole checkpoint by the pool (a single sample: the shared disk swings between runs). "
        f"Machine: {meta['machine']}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        *table(["round", "reads", "ms (median)", "GB/s streamed", "forwards (ms)"],
               [[result["round"], result["mode"], f"{result['median_ms']:.0f}", f"{result['gb_per_s']:.2f}",
                 ", ".join(map(str, result["forwards_ms"]))] for result in results]),
    ]
    write_report(args.out, "forward", {"meta": meta, "results": results}, "\n".join(lines))


def disk_bound(path: Path, piece: int = 32 * MiB) -> dict:
    """The disk's direct-read bandwidth on ``path`` (cold): the pool reading it whole, in pieces, one ahead."""
    size = path.stat().st_size
    ranges = [(at, min(at + piece, size)) for at in range(0, size, piece)]
    buffers = [direct_io.aligned_empty(piece + 2 * direct_io.BLOCK) for _ in range(2)]
    evict(path)
    started = time.perf_counter()
    pool_reader(4, 8)(path, ranges, buffers)
    seconds = time.perf_counter() - started
    return {"median_ms": seconds * 1e3, "forwards_ms": [], "streamed_bytes": size, "gb_per_s": size / seconds / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, default=Path("/var/tmp/loaders-bench"))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "loaders")
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--request-mib", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--only", nargs="*", help="run only the methods whose name starts with one of these")
    parser.add_argument("--forward", action="store_true", help="time the default target's forward instead")
    parser.add_argument("--forwards", type=int, default=10, help="with --forward: forwards per load")
    parser.add_argument("--prefetch", type=int, default=1, help="with --forward: units read ahead")
    args = parser.parse_args()
    if args.forward:
        measure_forward(args)
        return

    path = args.folder / "layers.safetensors"
    if not path.exists():
        write_checkpoint(path, args.layers, args.hidden, args.intermediate)
    ranges = layer_ranges(path)
    size = path.stat().st_size
    largest = max(end - begin for begin, end in ranges)
    buffers = [direct_io.aligned_empty(direct_io.round_up(largest) + 2 * direct_io.BLOCK) for _ in range(2)]
    read_bytes = sum(end - begin for begin, end in ranges)

    results = []
    for name, read in methods(args).items():
        if args.only and not any(name.startswith(prefix) for prefix in args.only):
            continue
        runs, error, cached, correct = [], None, [], None
        for _ in range(args.repeats):
            evict(path)
            cached.append(cached_bytes(path) / path.stat().st_size)
            try:
                started = time.perf_counter()
                read(path, ranges, buffers)
                runs.append(time.perf_counter() - started)
            except Exception as failure:  # noqa: BLE001 - recorded as the method's result
                error = f"{type(failure).__name__}: {failure}".splitlines()[0][:300]
                traceback.print_exc()
                break
        whole_file = name in ("fastsafetensors", "instanttensor")
        if runs and not whole_file:
            last = len(ranges) - 1
            correct = verify(path, ranges, buffers, last, _offset(ranges[last][0]) if name.startswith("pool") else 0)
        seconds = statistics.median(runs) if runs else None
        moved = size if whole_file else read_bytes
        result = {
            "method": name,
            "seconds": seconds,
            "runs_s": runs,
            "gb_per_s": moved / seconds / 1e9 if seconds else None,
            "bytes": moved,
            "reads_into": READS_INTO.get(name.split()[0], "the caller's buffer"),
            "cached_before": max(cached) if cached else None,
            "correct": correct,
            "error": error,
        }
        results.append(result)
        print(json.dumps(result), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        write_results(args, path, size, ranges, results)


def write_results(args, path: Path, size: int, ranges, results) -> None:
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "file_bytes": size,
        "layers": len(ranges),
        "layer_bytes": ranges[0][1] - ranges[0][0],
        "repeats": args.repeats,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.release()}",
        "folder": str(args.folder),
    }
    lines = [
        "# Cold reads of one safetensors file, layer by layer",
        "",
        f"{size / GiB:.2f} GiB file, {len(ranges)} layers of {meta['layer_bytes'] / MiB:.0f} MiB (bf16, random), "
        f"evicted from the page cache before each of {args.repeats} runs; median. Machine: {meta['machine']}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        *table(["method", "GB/s", "s (median)", "runs (s)", "reads into", "bytes checked", "error"], [
            [result["method"], f"{result['gb_per_s']:.2f}" if result["gb_per_s"] else "-",
             f"{result['seconds']:.2f}" if result["seconds"] else "-",
             ", ".join(f"{run:.2f}" for run in result["runs_s"]) or "-", result["reads_into"],
             {True: "equal", False: "DIFFER", None: "-"}[result["correct"]], result["error"] or ""]
            for result in results]),
    ]
    write_report(args.out, "loaders", {"meta": meta, "results": results}, "\n".join(lines))


if __name__ == "__main__":
    main()
