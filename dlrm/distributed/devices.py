"""Devices and CPUs per rank: one GPU each, or a share of the host's CPUs."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Sequence

import tensorflow as tf


def has_gpu() -> bool:
    """Whether TensorFlow sees a GPU on this host."""
    return bool(tf.config.list_physical_devices("GPU"))


class DeviceError(RuntimeError):
    """A host's GPUs cannot give each of its ranks one of its own.

    Every rank of that host raises it while its `HorovodCollectives` is built,
    after `hvd.init()` and before any collective, and exits non-zero. Ranks of
    other hosts that have GPUs enough go on to their first collective and wait
    there until the launcher ends the job, which horovodrun and mpirun do when a
    rank exits non-zero (srun with --kill-on-bad-exit=1, as slurm/ sets it);
    their peers' closed connections may fail that collective first. Under
    Horovod Elastic the driver drops the failed host and the others continue."""

    # Each rank's message names its own local rank, and ranks on hosts with GPUs
    # enough do not raise it (dlrm.distributed.launcher.same_on_every_rank).
    same_on_every_rank = False


@dataclasses.dataclass
class PinnedGpu:
    """The GPU this process pinned first, for the process's lifetime."""

    gpu: tf.config.PhysicalDevice
    local_rank: int
    told_kept: bool = False  # whether a later call with another local rank was told


# TensorFlow fixes the visible devices once its runtime starts (`pin_gpu`).
_pinned: PinnedGpu | None = None


def pin_gpu(local_rank: int, local_ranks: int) -> tf.config.PhysicalDevice | None:
    """One GPU per rank: local rank `local_rank` of the `local_ranks` ranks of a
    host (`hvd.local_size()`; 1 for one process) sees only GPU `local_rank`, and
    allocates its memory as needed (else every rank, and a one-process run too,
    would claim memory on every GPU of the host). Returns that GPU; None without
    GPUs (a no-op: the CPU-only CI machines). The first call must precede
    TensorFlow's first op.

    Raises `DeviceError` when the host has fewer GPUs than ranks (`check_gpus_per_rank`):
    ranks sharing a GPU made NCCL fail later with an error that did not say why.

    A later call (a new world after a Horovod Elastic reset) keeps the GPU of the
    first: TensorFlow cannot change the visible devices once its runtime has
    started. The local rank cannot have changed there: Horovod Elastic knows each
    worker process as (host, local rank) for its whole life (HOROVOD_LOCAL_RANK at
    spawn, and the rendezvous answers for that slot), and starts new processes
    only for slots no live process holds. So the processes of a host keep
    distinct local ranks, hence distinct GPUs, and keeping the first GPU cannot
    put two of them on one. Only a launcher that renumbered live processes could
    do that; the process then says once which GPU it keeps."""
    global _pinned
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    check_gpus_per_rank(len(gpus), local_rank, local_ranks)
    if _pinned is not None:
        if _pinned.local_rank != local_rank and not _pinned.told_kept:
            _pinned.told_kept = True
            print(
                f"{socket.gethostname()}: local rank {local_rank} keeps {_pinned.gpu.name}, "
                f"pinned as local rank {_pinned.local_rank}: TensorFlow cannot change the "
                "visible GPUs once it has started",
                file=sys.stderr,
                flush=True,
            )
        return _pinned.gpu
    # Past the GPUs seen only when the launcher gave this rank its one GPU.
    gpu = gpus[local_rank] if local_rank < len(gpus) else gpus[0]
    tf.config.set_visible_devices(gpu, "GPU")
    tf.config.experimental.set_memory_growth(gpu, True)
    _pinned = PinnedGpu(gpu, local_rank)
    return gpu


def check_gpus_per_rank(gpus: int, local_rank: int, local_ranks: int) -> None:
    """Raises `DeviceError` unless each of the host's `local_ranks` ranks can have
    one of the `gpus` GPUs this rank sees to itself.

    A rank that sees exactly one GPU while CUDA_VISIBLE_DEVICES is set passes: a
    launcher gave each rank its own (`srun --gpus-per-task=1`, `--gpu-bind`, a
    wrapper that sets it by local rank), which this rank cannot tell from one GPU
    named for every rank."""
    if local_ranks <= gpus and local_rank < gpus:
        return
    if gpus == 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):
        return
    raise DeviceError(
        f"{socket.gethostname()}: {local_ranks} ranks on this host (hvd.local_size()) but "
        f"TensorFlow sees {gpus} GPU{'s' if gpus != 1 else ''}, so local rank {local_rank} "
        "has no GPU of its own (ranks that share a GPU make NCCL fail). Start at most as "
        "many ranks per host as it has GPUs (horovodrun -np N -H host:N, sbatch "
        "--ntasks-per-node=N), or give each rank one GPU through CUDA_VISIBLE_DEVICES "
        "(srun --gpus-per-task=1)"
    )


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


# A hidden testing switch (no flag, not in --help): see `gpu_code_path`.
GPU_PATH_ON_CPU_ENV = "DLRM_GPU_PATH_ON_CPU"


def gpu_code_path() -> bool:
    """Whether this rank runs the GPU code path: `--amp` as float16 with dynamic
    loss scaling, whole-batch steps, no CPU kernels, the dot interaction without
    row blocks, and float16 vectors crossing between the ranks.

    True when TensorFlow sees a GPU, or when the environment sets
    `DLRM_GPU_PATH_ON_CPU=1`: a hidden switch for tests, so that a CPU-only
    machine runs the GPU path's precision, loss scaling, chunking, kernel
    choice and float16 exchange (slowly: float16 on a CPU is emulated). Only
    the device differs; devices and collectives (`pin_gpu`, Horovod's
    settings) still follow `has_gpu`. An environment variable, not a flag, so
    that a test can give it to one rank and not the others."""
    return has_gpu() or os.environ.get(GPU_PATH_ON_CPU_ENV) == "1"
