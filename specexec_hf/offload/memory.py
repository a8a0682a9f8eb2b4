"""How much memory this process can still take: what ``prefetch="auto"`` sizes the read-ahead ring by.

A model bigger than RAM is often run under a memory limit that is not the machine's (a container, a cgroup), so the
headroom is the least of the machine's available memory and the process's memory cgroup's room (v1 or v2). The page
cache a cgroup holds counts as room: the kernel reclaims it before anything else, and direct reads add none.
"""

from __future__ import annotations

from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 62  # what cgroup v1 reports as "no limit" is a page-rounded LONG_MAX; anything above this is none


def memory_headroom(proc: Path = Path("/proc"), cgroup_root: Path = _CGROUP_ROOT) -> int | None:
    """Bytes this process can still allocate before the machine or its memory cgroup must reclaim anonymous memory.

    Args:
        proc: Where procfs is mounted (for tests).
        cgroup_root: Where the cgroup filesystems are mounted (for tests).

    Returns:
        The headroom, or ``None`` where neither ``MemAvailable`` nor a cgroup limit can be read.
    """
    candidates = [value for value in (_mem_available(proc), _cgroup_room(proc, cgroup_root)) if value is not None]
    return min(candidates) if candidates else None


def _mem_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(proc: Path, cgroup_root: Path) -> int | None:
    """The memory cgroup's limit minus what it holds other than file cache, or ``None`` without a limit."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1: "N:memory:/path"
            group = cgroup_root / "memory" / path.lstrip("/")
            return _room(group, "memory.limit_in_bytes", "memory.usage_in_bytes", ("total_cache", "cache"))
        if controllers == "":  # v2: "0::/path"
            group = cgroup_root / path.lstrip("/")
            return _room(group, "memory.max", "memory.current", ("file",))
    return None


def _room(group: Path, limit_file: str, usage_file: str, cache_keys: tuple[str, ...]) -> int | None:
    try:
        limit_text = (group / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _UNLIMITED:
            return None
        usage = int((group / usage_file).read_text())
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines() if line.strip())
    except (OSError, ValueError):
        return None
    cache = next((int(stat[key]) for key in cache_keys if key in stat), 0)
    return max(0, int(limit_text) - (usage - cache))
