"""A memory cap for benchmarks: this process in a Linux cgroup v1 memory group, page cache included.

A model bigger than RAM cannot be bought for a benchmark, so the RAM is made smaller than the model instead: the
kernel charges every page this process touches (its own memory and the page cache its reads fill) to the group,
and reclaims or refuses past ``memory.limit_in_bytes``. Needs root and the v1 memory controller mounted at
``/sys/fs/cgroup/memory``; benchmarks only, never tests. Pages charged before the process joined stay charged
to the group it came from (v1 moves no charges by default), so join first and measure usage from there.
"""

from __future__ import annotations

import os
from pathlib import Path

MEMORY_CONTROLLER = Path("/sys/fs/cgroup/memory")


class MemoryCap:
    """This process's own memory group, created on :meth:`join` and removed on :meth:`leave`.

    Args:
        name: The group's directory name under the memory controller.
    """

    def __init__(self, name: str):
        self.group = MEMORY_CONTROLLER / name

    @staticmethod
    def unavailable() -> str | None:
        """Why no group can be made here (not root, no v1 memory controller), or ``None`` when one can."""
        if not (MEMORY_CONTROLLER / "cgroup.procs").is_file():
            return f"no cgroup v1 memory controller at {MEMORY_CONTROLLER}"
        if os.geteuid() != 0:
            return "creating a memory cgroup needs root"
        return None

    def join(self) -> None:
        """Creates the group (no limit yet) and moves this process into it."""
        reason = self.unavailable()
        if reason:
            raise RuntimeError(f"Cannot cap memory: {reason}; run the benchmark as root on a cgroup v1 machine.")
        self.group.mkdir(exist_ok=True)
        (self.group / "cgroup.procs").write_text(str(os.getpid()))

    def usage(self) -> int:
        """Bytes charged to the group now: process memory plus the page cache it filled."""
        return int((self.group / "memory.usage_in_bytes").read_text())

    def reclaim(self) -> None:
        """Drops the page cache charged to the group, as far as the kernel can (v1's ``memory.force_empty``): files
        this process wrote or read earlier would otherwise count as its own memory in :meth:`usage`."""
        (self.group / "memory.force_empty").write_text("0")

    def peak(self) -> int:
        """The most bytes ever charged to the group."""
        return int((self.group / "memory.max_usage_in_bytes").read_text())

    def limit(self, limit_bytes: int | None) -> None:
        """Sets the cap (``None``: none); the kernel reclaims page cache down to it at once."""
        (self.group / "memory.limit_in_bytes").write_text(str(-1 if limit_bytes is None else int(limit_bytes)))
        (self.group / "memory.max_usage_in_bytes").write_text("0")  # the peak from here on

    def limit_bytes(self) -> int:
        """The cap now, in bytes (the kernel rounds it to pages; a huge number when there is none)."""
        return int((self.group / "memory.limit_in_bytes").read_text())

    def failures(self) -> int:
        """How often the group hit its cap (each one a reclaim)."""
        return int((self.group / "memory.failcnt").read_text())

    def leave(self) -> None:
        """Moves this process back to the root group and removes its own."""
        (MEMORY_CONTROLLER / "cgroup.procs").write_text(str(os.getpid()))
        self.group.rmdir()


def evict(path: os.PathLike | str) -> None:
    """Drops ``path``'s pages from the page cache, so that the next read comes from the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def cached_bytes(path: os.PathLike | str) -> int:
    """Bytes of ``path`` resident in the page cache now (``mincore`` over a mapping of it)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)  # writable: ctypes needs that
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pages = (size + page - 1) // page
        vector = (ctypes.c_ubyte * pages)()
        buffer = (ctypes.c_char * size).from_buffer(mapping)
        address = ctypes.addressof(buffer)
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        del buffer
        return sum(byte & 1 for byte in vector) * page
    finally:
        mapping.close()
