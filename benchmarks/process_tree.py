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


def tree_cpu_seconds(root: psutil.Process) -> float:
    """User and system CPU seconds of `root`, its descendants and their waited-for
    children (Spark's Python workers are children of its daemon)."""
    total = 0.0
    for member in _members(root):
        with contextlib.suppress(psutil.Error):
            times = member.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total
