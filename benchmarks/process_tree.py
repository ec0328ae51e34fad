"""Resident memory and CPU time of a process and all its descendants (Spark's JVM
and Python workers, horovodrun's ranks), read with psutil while they run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psutil


def _members(root: psutil.Process) -> Iterator[psutil.Process]:
    with contextlib.suppress(psutil.Error):  # the tree changes while it is read
        yield root
        yield from root.children(recursive=True)


def tree_rss(root: psutil.Process) -> int:
    """Bytes resident in `root` and its descendants now."""
    total = 0
    for member in _members(root):
        with contextlib.suppress(psutil.Error):
            total += member.memory_info().rss
    return total


def tree_memory(root: psutil.Process) -> tuple[int, int]:
    """Bytes, in one walk of the tree: the RSS summed over it now (`tree_rss`), and
    the largest peak RSS of any one process in it so far (the kernel's
    high-water mark, `VmHWM` in /proc/PID/status, counted since the process's
    last exec). Unlike the sum sampled now, the latter misses no short peak of a
    process that is still running when read. (`ru_maxrss` from `wait4` would not
    do: a child's starts at its parent's own peak, copied with the parent's
    memory at fork and kept through exec, so a 1 GB parent reads every child as
    at least 1 GB.)"""
    total = largest = 0
    for member in _members(root):
        with contextlib.suppress(psutil.Error):
            total += member.memory_info().rss
        largest = max(largest, high_water_mark(member.pid))
    return total, largest


def high_water_mark(pid: int) -> int:
    """Bytes: `VmHWM` of process `pid`, 0 if it is gone or has none (a zombie)."""
    with (
        contextlib.suppress(OSError, ValueError),
        open(f"/proc/{pid}/status") as status,
    ):
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    return 0


def tree_cpu_seconds(root: psutil.Process) -> float:
    """User and system CPU seconds of `root`, its descendants and their waited-for
    children (Spark's Python workers are children of its daemon)."""
    total = 0.0
    for member in _members(root):
        with contextlib.suppress(psutil.Error):
            times = member.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total
