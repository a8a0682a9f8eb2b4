"""Direct reads of weight files: ``O_DIRECT`` into aligned buffers the caller owns, several requests in flight.

Reading through the page cache (a memory mapping, or plain ``read``) runs a cold file at the kernel's readahead
speed, about half the disk's bandwidth on the machine this was measured on, and for a model larger than RAM the
cached pages compete with the process for memory. ``O_DIRECT`` moves the bytes from the disk straight into the
destination, at the disk's full sequential bandwidth when a few requests of several MiB are in flight
(``benchmarks/loaders.py`` measures it against the page cache and the published loaders; see
docs/offloading.md). It needs offsets, lengths and memory addresses aligned to the device's block size
(:data:`BLOCK` covers every common one). Each read therefore covers the aligned superset of the wanted bytes: it
lands straight in the destination when the bytes around it are free to overwrite (:func:`plan_reads` checks), and
otherwise goes through a small per-thread bounce buffer and is copied (or converted to another dtype) from there.

This module imports only torch and the standard library, so that ``benchmarks/loaders.py`` can load it in a
throwaway environment.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import mmap
import os
import stat
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

logger = logging.getLogger(__name__)

# Alignment of O_DIRECT offsets, lengths and buffer addresses: the largest logical block size in common use.
BLOCK = 4096
# Request size and requests in flight that reach the disk's sequential bandwidth (benchmarks/results/loaders).
REQUEST_BYTES = 8 * 2**20
READERS = 4
# Buffers this large or larger are backed by transparent huge pages where the kernel offers them (aligned_empty).
HUGE_PAGE = 2 * 2**20

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

_warned_folders: set[str] = set()


class WeightFileError(RuntimeError):
    """A weight file is damaged (an unreadable header, truncated) or no longer holds what the model was planned on
    (rewritten, replaced, deleted), or a read came up short."""


class FileIdentity(NamedTuple):
    """What a weight file's bytes are recognised by: the inode, and what any change of it moves.

    Size and modification time alone miss a rewrite that keeps the size and sets the modification time back
    (``os.utime``); the status-change time moves with every write and every ``utime``, and nothing but the kernel
    sets it. ``(device, inode)`` tells the file the model was planned on from another put under its name.
    """

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> FileIdentity:
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)

    def is_file_of(self, status: os.stat_result) -> bool:
        """Whether ``status`` is of this same file (the same inode), changed or not."""
        return (status.st_dev, status.st_ino) == (self.device, self.inode)

    def change_to(self, now: FileIdentity) -> str:
        """What changed between this identity and ``now``, of the same inode, in words."""
        if now.size != self.size:
            return f"its size went from {self.size} to {now.size} bytes"
        if now.mtime_ns != self.mtime_ns:
            return "it was modified"
        return (
            "its status-change time moved while its size and modification time stayed: it was rewritten with its "
            "modification time set back, or its permissions or owner changed"
        )


def aligned_empty(nbytes: int, alignment: int = BLOCK) -> torch.Tensor:
    """An uninitialised ``uint8`` tensor of ``nbytes`` whose first byte is ``alignment``-aligned.

    On Linux, a buffer of at least one :data:`HUGE_PAGE` is a fresh private anonymous mapping, its whole huge pages
    marked for transparent huge pages before anything touches them (:func:`_huge_page_buffer`), so that a direct
    read into it lands in physically contiguous memory.
    """
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        return _huge_page_buffer(nbytes, alignment)
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    start = -raw.data_ptr() % alignment
    return raw[start : start + nbytes]


def _huge_page_buffer(nbytes: int, alignment: int) -> torch.Tensor:
    """``nbytes`` of a new anonymous mapping from a huge-page boundary, ``madvise(MADV_HUGEPAGE)`` over its whole huge
    pages (the partial last one is left to 4 KiB pages, so no more memory is touched than asked for).

    Why: the block layer turns a direct read into requests of physically contiguous runs (at most the device's
    ``max_segments`` of them each). Pages a process gets while the kernel reclaims page cache for it (one at its
    memory cgroup's limit: a model bigger than RAM) are scattered, and each 8 MiB read then went to the disk as
    requests averaging 0.6 MiB instead of 3.3, at 1.4 instead of 2.3 GB/s (measured on the development VM,
    docs/offloading.md). Where the kernel has no transparent huge pages the advice is refused and ignored.
    """
    boundary = math.lcm(alignment, HUGE_PAGE)
    mapping = mmap.mmap(-1, nbytes + boundary, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping until the tensor's storage goes
    start = -raw.data_ptr() % boundary
    whole = round_down(nbytes, HUGE_PAGE)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, whole)
    except OSError as error:  # a kernel built without transparent huge pages
        logger.debug("Direct-read buffers stay on 4 KiB pages: madvise(MADV_HUGEPAGE) failed (%s).", error)
    return raw[start : start + nbytes]


def round_down(offset: int, alignment: int = BLOCK) -> int:
    return offset - offset % alignment


def round_up(offset: int, alignment: int = BLOCK) -> int:
    return offset + -offset % alignment


class WeightFile:
    """A weight file opened once, read with ``O_DIRECT`` where its filesystem allows it.

    Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network filesystems), the file is read through the page
    cache instead, with one warning per folder naming the reason. The file's :class:`FileIdentity` when it was
    opened is what every read is checked against (:meth:`check_unchanged`): a file truncated or rewritten in place
    afterwards (even to the same size, its modification time set back), deleted, moved, or replaced by another
    under the same name raises :class:`WeightFileError` instead of going on with other bytes than loading the
    model from its files again would give.

    Args:
        path: The file.
        direct: Try ``O_DIRECT``; ``False`` reads through the page cache without a warning.
        by_name: Check that ``path`` still leads to the open file; ``False`` checks the open file alone, its size
            and modification time, for a private file its owner unlinks once it is open (the vLLM integration's
            layer file): it then has no name to check, and the unlink itself moves its status-change time.
    """

    def __init__(self, path: str | os.PathLike, direct: bool = True, by_name: bool = True):
        self.path = os.fspath(path)
        self._absolute_path = os.path.abspath(self.path)  # what the name is checked by, whatever the working folder
        self._by_name = by_name
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._fallback_lock = threading.Lock()
        try:
            self.descriptor = os.open(self.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except OSError as error:
            if not self.direct or error.errno != errno.EINVAL:
                raise
            self.descriptor = os.open(self.path, os.O_RDONLY)
            self._note_fallback(f"open(O_DIRECT) failed: {error.strerror}")
        status = os.fstat(self.descriptor)
        if not stat.S_ISREG(status.st_mode):
            self.close()
            raise WeightFileError(
                f"{self.path} is not a regular file (a folder, a device or a pipe), so it holds no weights. Put the "
                "weight file back and load the model again."
            )
        self.size = status.st_size
        self._planned = FileIdentity.of(status)
        self._mapping: mmap.mmap | None = None
        self._safetensors_header: dict[str, Any] | None = None
        self._data_start = 0

    def close(self) -> None:
        """Closes the descriptor (a mapping handed out by :meth:`tensor` stays valid)."""
        if self.descriptor >= 0:
            os.close(self.descriptor)
            self.descriptor = -1

    def __del__(self) -> None:
        self.close()

    def check_unchanged(self) -> None:
        """Raises :class:`WeightFileError` if the file changed since it was opened (its :class:`FileIdentity`), or
        its name no longer leads to it (deleted, moved, replaced by another file)."""
        try:
            named = os.stat(self._absolute_path) if self._by_name else os.fstat(self.descriptor)
        except FileNotFoundError:
            raise WeightFileError(
                f"The weight file {self.path} was deleted or moved after the model was loaded. Put it back, or load "
                "the model again from where its weights are now."
            ) from None
        except OSError as error:
            raise WeightFileError(
                f"The weight file {self.path} can no longer be checked ({error.strerror}), so the model cannot tell "
                "that it still reads the bytes it was planned on. Restore access to it and load the model again."
            ) from error
        if not self._planned.is_file_of(named):
            raise self._replaced()
        now = FileIdentity.of(named)  # the name leads to the open file: its status is the descriptor's
        if not self._by_name:  # unlinking it moved its status-change time; no one else can reach it to set mtime
            now = now._replace(ctime_ns=self._planned.ctime_ns)
        if now != self._planned:
            raise WeightFileError(
                f"The weight file {self.path} changed after the model was loaded ({self._planned.change_to(now)}): "
                "its bytes may no longer match the planned tensors. Load the model again (and do not rewrite a "
                "checkpoint in use)."
            )

    def _replaced(self) -> WeightFileError:
        return WeightFileError(
            f"The weight file {self.path} was replaced by another file under the same name after the model was "
            "loaded (a new inode): the model was planned on the old one. Load the model again."
        )

    def read(self, offset: int, destination: torch.Tensor) -> None:
        """Fills ``destination`` (contiguous ``uint8``) with the bytes at ``offset``, up to the planned file end.

        For a direct read, ``offset``, ``destination.numel()`` and ``destination.data_ptr()`` are :data:`BLOCK`
        aligned; bytes past the file's end are left as they were.

        Raises:
            WeightFileError: The file ended before the planned size (it was truncated).
        """
        expected = max(0, min(destination.numel(), self.size - offset))
        view = _writable_view(destination)
        done = 0
        while done < expected:
            try:
                count = os.preadv(self.descriptor, [view[done:]], offset + done)
            except OSError as error:
                if not (self.direct and error.errno == errno.EINVAL):
                    raise
                self._fall_back(f"pread(O_DIRECT) failed: {error.strerror}")
                continue
            if count == 0 or (self.direct and done + count < expected and count % BLOCK):
                raise WeightFileError(
                    f"Short read from {self.path}: got {done + count} of the {expected} bytes planned at offset "
                    f"{offset}; the file is shorter than when the model was loaded (truncated?). Load the model again."
                )
            done += count

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero-copy tensor over a private mapping of the file (through the page cache), ``offset`` bytes in.

        The mapping is made on first use; it serves reads of a few rows (embedding lookups) and the executors that
        copy whole tensors from it.
        """
        if self._mapping is None:
            self._mapping = mmap.mmap(self.descriptor, 0, access=mmap.ACCESS_COPY)
        return torch.frombuffer(self._mapping, dtype=dtype, count=math.prod(shape), offset=offset).view(shape)

    def safetensors_entry(self, name: str) -> tuple[int, torch.dtype, tuple[int, ...]]:
        """``(byte offset, dtype, shape)`` of tensor ``name``, this being a safetensors file.

        Raises:
            WeightFileError: The header is damaged (not JSON, an entry that is not a tensor's dtype, shape and byte
                range of the right length), names a dtype :data:`SAFETENSORS_DTYPES` lacks, or names bytes past the
                end of the file (it was truncated).
            KeyError: No tensor ``name`` in the file.
        """
        if self._safetensors_header is None:
            self._safetensors_header, self._data_start = self._read_safetensors_header()
        if name not in self._safetensors_header:
            raise KeyError(f"{self.path} holds no tensor {name!r}.")
        entry = self._safetensors_header[name]
        try:
            dtype_name, shape, (first, last) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            dtype = SAFETENSORS_DTYPES.get(dtype_name)
            nbytes = math.prod(shape) * dtype.itemsize if dtype is not None else last - first
            well_formed = 0 <= first and last - first == nbytes
        except (KeyError, TypeError, ValueError):
            well_formed = False
        if not well_formed:
            raise self._damaged_header(f"its entry for {name!r}, {entry!r:.200}, is not a tensor's dtype, shape and "
                                       "byte range")
        if dtype is None:
            raise WeightFileError(
                f"{self.path} stores {name!r} as {dtype_name}, which direct reads do not convert (they read "
                f"{', '.join(SAFETENSORS_DTYPES)}). Save the checkpoint in one of those, or load it in memory."
            )
        start, end = self._data_start + first, self._data_start + last
        if end > self.size:
            raise WeightFileError(
                f"{self.path} is truncated: its header places {name!r} at bytes {start}-{end}, past the file's end "
                f"({self.size} bytes). Download or save the checkpoint again."
            )
        return start, dtype, shape

    def _read_safetensors_header(self) -> tuple[dict[str, Any], int]:
        first = aligned_empty(BLOCK)
        self.read(0, first)
        if self.size < 8:
            raise WeightFileError(
                f"{self.path} is not a safetensors file: {self.size} bytes, shorter than a header. Download or save "
                "the checkpoint again."
            )
        (length,) = struct.unpack("<Q", first[:8].numpy().tobytes())
        if 8 + length > self.size:
            raise WeightFileError(
                f"{self.path} is truncated or not a safetensors file: its header claims {length} bytes, the file "
                f"has {self.size}. Download or save the checkpoint again."
            )
        whole = first if 8 + length <= BLOCK else aligned_empty(round_up(8 + length))
        if whole is not first:
            self.read(0, whole)
        try:
            header = json.loads(whole[8 : 8 + length].numpy().tobytes())
        except ValueError as error:  # not JSON, or not UTF-8
            raise self._damaged_header(f"it is not JSON: {error}") from error
        if not isinstance(header, dict):
            raise self._damaged_header(f"it is a JSON {type(header).__name__}, not an object")
        return header, 8 + length

    def _damaged_header(self, problem: str) -> WeightFileError:
        return WeightFileError(
            f"{self.path} has a damaged safetensors header ({problem}). Download or save the checkpoint again."
        )

    def _fall_back(self, reason: str) -> None:
        """Reopens the file for reads through the page cache (the filesystem refused a direct read)."""
        with self._fallback_lock:
            if not self.direct:
                return
            buffered = os.open(self.path, os.O_RDONLY)
            if not self._planned.is_file_of(os.fstat(buffered)):
                os.close(buffered)
                raise self._replaced()
            os.dup2(buffered, self.descriptor)
            os.close(buffered)
            self._note_fallback(reason)

    def _note_fallback(self, reason: str) -> None:
        self.direct = False
        folder = os.path.dirname(os.path.abspath(self.path))
        if folder not in _warned_folders:
            _warned_folders.add(folder)
            logger.warning(
                "Reading weights in %s through the page cache, slower than direct reads: the filesystem refuses "
                "O_DIRECT (%s).", folder, reason,
            )


def _writable_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU ``uint8`` tensor (``os.preadv`` writes into it, releasing the GIL)."""
    return memoryview(tensor.numpy()).cast("B")


@dataclass
class Span:
    """Bytes ``[start, end)`` of ``file`` and the tensor they fill.

    Args:
        file: The file.
        start: First byte.
        end: One past the last byte.
        target: A ``uint8`` tensor of ``end - start`` bytes, or, when ``dtype`` differs from its dtype, the tensor
            the bytes fill once read as ``dtype`` and converted (as ``Tensor.copy_`` converts).
        dtype: The dtype the bytes are stored in.
    """

    file: WeightFile
    start: int
    end: int
    target: torch.Tensor
    dtype: torch.dtype = torch.uint8


@dataclass
class _Piece:
    """Part of a bounced request: ``bounce[start : start + nbytes]`` read as ``dtype`` into ``target``."""

    start: int
    nbytes: int
    dtype: torch.dtype
    target: torch.Tensor

    def scatter(self, bounce: torch.Tensor) -> None:
        source = bounce[self.start : self.start + self.nbytes]
        if self.start % self.dtype.itemsize:
            source = source.clone()  # a typed view needs its offset aligned to the dtype
        self.target.copy_(source.view(self.dtype).view(self.target.shape))


@dataclass
class _Request:
    """One read of ``length`` bytes at block-aligned ``offset``: into ``destination``, or bounced into ``pieces``."""

    file: WeightFile
    offset: int
    length: int
    destination: torch.Tensor | None = None
    pieces: list[_Piece] = field(default_factory=list)


@dataclass
class ReadPlan:
    """The requests that fill a set of spans (:func:`plan_reads`), and the files to check once they have landed."""

    requests: list[_Request]
    files: list[WeightFile]

    @property
    def file_bytes(self) -> int:
        """Bytes read from the files (alignment included): fewer than the buffers filled where the files store a
        narrower dtype than the tensors they fill."""
        return sum(request.length for request in self.requests)

    @property
    def direct_bytes(self) -> int:
        """Bytes read straight into the caller's buffers (the rest goes through bounce buffers)."""
        return sum(request.length for request in self.requests if request.destination is not None)


def plan_reads(spans: Sequence[Span], request_bytes: int = REQUEST_BYTES) -> ReadPlan:
    """The requests that fill ``spans``, at most ``request_bytes`` each (plus alignment).

    A raw span lands directly in its target when its target address and file offset agree modulo :data:`BLOCK`
    and the aligned superset around it overlaps no other span's target and stays within the target's storage
    (the bytes there are scratch); any other span is read into a bounce buffer and copied from it, split at element
    boundaries.

    Args:
        spans: What to read; targets must not overlap each other.
        request_bytes: The largest request, a multiple of :data:`BLOCK`.
    """
    if request_bytes % BLOCK or request_bytes <= 0:
        raise ValueError(f"request_bytes must be a positive multiple of {BLOCK}, got {request_bytes}.")
    occupied = sorted((span.target.data_ptr(), span.target.data_ptr() + _target_bytes(span)) for span in spans)
    requests: list[_Request] = []
    for span in spans:
        if _lands_directly(span, occupied):
            requests.extend(_direct_requests(span, request_bytes))
        else:
            requests.extend(_bounced_requests(span, request_bytes))
    files = list({id(span.file): span.file for span in spans}.values())
    return ReadPlan(requests, files)


def _target_bytes(span: Span) -> int:
    return span.target.numel() * span.target.element_size()


def _lands_directly(span: Span, occupied: list[tuple[int, int]]) -> bool:
    target = span.target
    if target.dtype != torch.uint8 or span.dtype != torch.uint8 or not target.is_contiguous():
        return False
    address = target.data_ptr()
    if (address - span.start) % BLOCK:
        return False
    head = address - span.start % BLOCK
    tail = head + round_up(span.end - round_down(span.start))
    storage = target.untyped_storage()
    if head < storage.data_ptr() or tail > storage.data_ptr() + storage.nbytes():
        return False
    own = (address, address + target.numel())
    return all(end <= head or begin >= tail for begin, end in occupied if (begin, end) != own)


def _direct_requests(span: Span, request_bytes: int) -> list[_Request]:
    first = round_down(span.start)
    storage = span.target.untyped_storage()
    base = span.target.data_ptr() - storage.data_ptr() - (span.start - first)
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    length = round_up(span.end - first)
    requests = []
    for at in range(0, length, request_bytes):
        size = min(request_bytes, length - at)
        requests.append(_Request(span.file, first + at, size, whole[base + at : base + at + size]))
    return requests


def _bounced_requests(span: Span, request_bytes: int) -> list[_Request]:
    itemsize = span.dtype.itemsize
    elements = (span.end - span.start) // itemsize
    flat = span.target.view(-1) if span.target.is_contiguous() else None
    per_piece = max(1, request_bytes // itemsize) if flat is not None else elements
    requests = []
    for first_element in range(0, elements, per_piece):
        count = min(per_piece, elements - first_element)
        start = span.start + first_element * itemsize
        offset = round_down(start)
        target = flat[first_element : first_element + count] if flat is not None else span.target
        piece = _Piece(start - offset, count * itemsize, span.dtype, target)
        requests.append(_Request(span.file, offset, round_up(start + count * itemsize) - offset, pieces=[piece]))
    return requests


class DirectReader:
    """A small pool of threads that carries out :class:`ReadPlan` requests, ``threads`` in flight.

    ``os.preadv`` releases the GIL, so the reads overlap each other and the caller's compute. Each thread owns one
    aligned bounce buffer for requests that cannot land in place.

    Args:
        threads: Requests in flight.
        request_bytes: The size plans are split into, which sizes the bounce buffers.
    """

    def __init__(self, threads: int = READERS, request_bytes: int = REQUEST_BYTES):
        self.request_bytes = request_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="specexec-direct-read")
        self._local = threading.local()

    def submit(self, plan: ReadPlan) -> Future:
        """Starts ``plan``; the future resolves once every request has landed and every file was found unchanged.

        It resolves only after all of the plan's requests have finished, failed ones included, so that a retry
        never races a straggler writing into the same buffer; it then holds the first error.
        """
        done: Future = Future()
        if not plan.requests:
            done.set_result(None)
            return done
        remaining = [len(plan.requests)]
        errors: list[BaseException] = []
        lock = threading.Lock()

        def landed(request: Future) -> None:
            with lock:
                if request.exception() is not None:
                    errors.append(request.exception())
                remaining[0] -= 1
                if remaining[0]:
                    return
            try:
                if errors:
                    raise errors[0]
                for file in plan.files:
                    file.check_unchanged()
            except BaseException as error:
                done.set_exception(error)
            else:
                done.set_result(None)

        for request in plan.requests:
            self._pool.submit(self._perform, request).add_done_callback(landed)
        return done

    def read(self, plan: ReadPlan) -> None:
        """Carries out ``plan`` and waits for it."""
        self.submit(plan).result()

    def close(self) -> None:
        """Waits for queued requests and stops the threads."""
        self._pool.shutdown(wait=True)

    def _perform(self, request: _Request) -> None:
        if request.destination is not None:
            request.file.read(request.offset, request.destination)
            return
        bounce = self._bounce(request.length)
        request.file.read(request.offset, bounce)
        for piece in request.pieces:
            piece.scatter(bounce)

    def _bounce(self, length: int) -> torch.Tensor:
        """This thread's bounce buffer, at least ``length`` bytes (block-aligned)."""
        bounce = getattr(self._local, "bounce", None)
        if bounce is None or bounce.numel() < length:
            bounce = aligned_empty(max(length, self.request_bytes + 2 * BLOCK))
            self._local.bounce = bounce
        return bounce[:length]
