"""Devices and CPUs per rank: one GPU each, or a share of the host's CPUs."""

from __future__ import annotations

import os
from collections.abc import Sequence

import tensorflow as tf


def has_gpu() -> bool:
    """Whether TensorFlow sees a GPU on this host."""
    return bool(tf.config.list_physical_devices("GPU"))


def pin_gpu(local_rank: int) -> None:
    """One GPU per rank: rank `local_rank` of a node sees only GPU `local_rank`, and
    allocates its memory as needed (else every rank would claim every GPU). Must
    run before TensorFlow touches a GPU. No-op without GPUs (not exercised on the
    CPU-only CI machines)."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    gpu = gpus[local_rank % len(gpus)]
    tf.config.set_visible_devices(gpu, "GPU")
    tf.config.experimental.set_memory_growth(gpu, True)


def intra_op_threads_per_rank(cpus: int, local_ranks: int) -> int:
    """TensorFlow's intra-op threads for each of `local_ranks` ranks sharing
    `cpus` CPUs: a share each, at least one."""
    return max(1, cpus // max(1, local_ranks))


def cpu_slice(cpus: Sequence[int], local_ranks: int, local_rank: int) -> tuple[int, ...]:
    """Local rank `local_rank`'s own CPUs of `cpus`: consecutive slices, one per
    rank, the first `len(cpus) % local_ranks` ranks one CPU more; with more
    ranks than CPUs, ranks take turns over the CPUs (rank r gets CPU r mod n)."""
    cpus = sorted(cpus)
    if local_ranks >= len(cpus):
        return (cpus[local_rank % len(cpus)],)
    size, extra = divmod(len(cpus), local_ranks)
    start = local_rank * size + min(local_rank, extra)
    return tuple(cpus[start : start + size + (local_rank < extra)])


def format_cpus(cpus: Sequence[int]) -> str:
    """CPU ids as Linux lists them: ranges of consecutive ids ("0-3,8")."""
    spans: list[list[int]] = []
    for cpu in sorted(cpus):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def bind_process(cpus: Sequence[int]) -> None:
    """Every thread of this process (Horovod's and Gloo's, started by
    `hvd.init()`, included) and those it starts later may run on `cpus` only."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # the thread has ended
            continue


def share_cpus(
    local_ranks: int, local_rank: int = 0, bind: bool = True
) -> tuple[tuple[int, ...] | None, int | None]:
    """Shares this host's CPUs among its `local_ranks` ranks; returns (the CPUs
    this rank was bound to or None, the intra-op threads set or None).

    With `bind`, when the process may run on every CPU of the host (no launcher
    or container bound it), each rank is bound to its own slice (`cpu_slice`)
    and TensorFlow sizes its pools to it. Left to the kernel, ranks sharing
    cores swapped cores and cache, and one rank often ran ahead of the other
    and then waited for it in the next collective.

    Otherwise each rank gets its share of the CPUs it may run on as intra-op
    threads, at least one: by default every rank starts a pool as large as the
    machine, and their threads take turns on the cores. Both measured in
    docs/performance.md#defaults-chosen-by-measurement.
    `TF_NUM_INTRAOP_THREADS`, set by the user, leaves the threads to TensorFlow.
    Must run before TensorFlow runs an op."""
    if local_ranks <= 1:
        return None, None
    allowed = sorted(os.sched_getaffinity(0))
    bound = None
    if bind and len(allowed) == os.cpu_count():
        bound = cpu_slice(allowed, local_ranks, local_rank)
        bind_process(bound)
        threads = len(bound)
    else:
        threads = intra_op_threads_per_rank(len(allowed), local_ranks)
    if "TF_NUM_INTRAOP_THREADS" in os.environ:
        return bound, None
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    except RuntimeError:  # the runtime has started: its pools stay as they are
        return bound, None
    return bound, threads
