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


def largest_peak(root: psutil.Process) -> int:
    """Bytes: the largest peak RSS of any one process in the tree so far (the
    kernel's high-water mark, `VmHWM` in /proc/PID/status, counted since the
    process's last exec). Unlike the sum sampled now, it misses no short peak of
    a process that is still running when read. (`ru_maxrss` from `wait4` would
    not do: a child's starts at its parent's own peak, copied with the parent's
    memory at fork and kept through exec, so a 1 GB parent reads every child
    as at least 1 GB.)"""
    largest = 0
    for member in _members(root):
        with (
            contextlib.suppress(psutil.Error, OSError, ValueError),
            open(f"/proc/{member.pid}/status") as status,
        ):
            for line in status:
                if line.startswith("VmHWM:"):
                    largest = max(largest, int(line.split()[1]) * 1024)  # kB
                    break
    return largest


def tree_cpu_seconds(root: psutil.Process) -> float:
    """User and system CPU seconds of `root`, its descendants and their waited-for
    children (Spark's Python workers are children of its daemon)."""
    total = 0.0
    for member in _members(root):
        with contextlib.suppress(psutil.Error):
            times = member.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total
