"""Collectives between ranks: the one module that imports Horovod's ops.

Everything else takes a `Collectives` value (rank, world size and the few
operations training needs), so the same model and trainer run on one process
(`Collectives`, no Horovod import at all) or under `horovodrun`
(`HorovodCollectives`: Gloo on CPU, NCCL/MPI on GPU clusters, as Horovod was built).

Collectives inside a `tf.function` take a `name`: Horovod pairs the ranks'
operations by name, and ranks that hold different shards build different
graphs, so names derived from the graph would not match and the job would hang.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from dlrm.distributed.devices import has_gpu, pin_gpu, share_cpus
from dlrm.distributed.launcher import launched_by_horovod
from dlrm.variables import resource_variable


class Collectives:
    """One process: every collective is the identity."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # TensorFlow's intra-op threads this process was given (`share_cpus`), or None.
    intra_op_threads: int | None = None
    # The CPUs this process was bound to (`share_cpus`), or None: not bound.
    bound_cpus: tuple[int, ...] | None = None

    def alltoall(
        self, tensor: tf.Tensor, splits: Sequence[int] | tf.Tensor, name: str
    ) -> tf.Tensor:
        """Sends rows [sum(splits[:j]), sum(splits[:j+1])) of `tensor` to rank j;
        returns what every rank sent here, concatenated in rank order."""
        return tensor

    def allreduce_sum(self, tensors: Sequence[tf.Tensor], names: Sequence[str]) -> list[tf.Tensor]:
        """Element-wise sums over ranks, one name per tensor."""
        return list(tensors)

    def allgather(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        """Every rank's `tensor` concatenated along axis 0, in rank order."""
        return tensor

    def allgather_object(self, value: Any, name: str) -> list[Any]:
        """Every rank's picklable `value`, in rank order. Named: Horovod would
        otherwise name it after the value's type, which may differ by rank."""
        return [value]

    def broadcast_variables(self, variables: Sequence[Any]) -> None:
        """Rank 0's values into every rank's `variables`."""

    def barrier(self) -> None:
        """Returns once every rank has called it."""


# A rank that stops submitting collectives (stuck, not dead) makes Horovod warn after
# the check time and shut every rank down after the shutdown time, instead of the
# others waiting forever. Horovod leaves the shutdown off by default. A rank that
# dies is handled sooner: its peers' Gloo/MPI connections fail and horovodrun (or
# srun/mpirun) ends the job. The environment overrides both.
STALL_DEFAULTS = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "900",
}


# Without GPUs: Horovod's background thread coordinates the ranks' pending
# collectives every cycle; every 3 ms instead of Horovod's default (1 ms) leaves
# more of the CPUs to the ranks' compute, and a CPU step takes hundreds of ms, so
# 2 ms more latency per collective round is noise (measured: docs/performance.md,
# "Defaults chosen by measurement"). On GPUs, whose steps take milliseconds,
# Horovod's default stays. The environment overrides it.
CPU_DEFAULTS = {"HOROVOD_CYCLE_TIME": "3"}


class HorovodCollectives(Collectives):
    """Horovod's collectives; `hvd.init()` runs on construction.

    Args:
        bind_cpus: bind each rank on a host to its own CPUs (`share_cpus`).
        initialize: run `hvd.init()`; False when it has run (`ElasticMembership`).
    """

    def __init__(self, bind_cpus: bool = True, initialize: bool = True) -> None:
        import horovod.tensorflow as hvd

        self._hvd = hvd
        if initialize:
            set_horovod_defaults()
            hvd.init()
        self.rank = hvd.rank()
        self.world_size = hvd.size()
        self.local_rank = hvd.local_rank()
        # DeviceError on a host with fewer GPUs than ranks (what the others see:
        # its docstring); a new world after an elastic reset keeps the first GPU.
        pin_gpu(self.local_rank, hvd.local_size())
        self.bound_cpus, self.intra_op_threads = share_cpus(
            hvd.local_size(), hvd.local_rank(), bind_cpus
        )

    def alltoall(
        self, tensor: tf.Tensor, splits: Sequence[int] | tf.Tensor, name: str
    ) -> tf.Tensor:
        result = self._hvd.alltoall(tensor, splits=tf.cast(splits, tf.int32), name=name)
        # Horovod returns (tensor, received_splits) in 0.28.
        return result[0] if isinstance(result, (tuple, list)) else result

    def allreduce_sum(self, tensors: Sequence[tf.Tensor], names: Sequence[str]) -> list[tf.Tensor]:
        def reduce(flat: tf.Tensor, name: str) -> tf.Tensor:
            return self._hvd.allreduce(flat, op=self._hvd.Sum, name=name)

        return packed(tensors, names, reduce)

    def allgather(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        return self._hvd.allgather(tensor, name=name)

    def allgather_object(self, value: Any, name: str) -> list[Any]:
        return list(self._hvd.allgather_object(value, name=name))

    def broadcast_variables(self, variables: Sequence[Any]) -> None:
        resources = [resource_variable(v) for v in variables]
        self._hvd.broadcast_variables(resources, root_rank=0)

    def barrier(self) -> None:
        self._hvd.allreduce(tf.constant(0.0), op=self._hvd.Sum, name="barrier").numpy()


def packed(
    tensors: Sequence[tf.Tensor],
    names: Sequence[str],
    reduce: Callable[[tf.Tensor, str], tf.Tensor],
) -> list[tf.Tensor]:
    """`reduce` applied to `tensors` laid end to end in one flat buffer per dtype
    (named after its first tensor), the results cut back into their shapes.

    So that a run repeats bit for bit on any number of ranks: Horovod fuses the
    allreduces that happen to be ready in the same cycle into one buffer, and a
    ring allreduce (Gloo's, NCCL's, MPI's) adds up each segment of a buffer
    starting at another rank. From 3 ranks on, (a + b) + c and (b + c) + a round
    differently, so where a tensor landed in the fused buffer changed its sums
    from run to run (3 ranks, 20 steps: 3e-8 apart; 300 steps: 3e-4, once a ReLU
    input within rounding of zero switched sides). One buffer per call puts every
    element at the same place each time; the caller keeps two calls of a step
    from being in flight together (`Trainer`)."""
    results: list[tf.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[tf.DType, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(index)
    for members in by_dtype.values():
        name = names[members[0]]
        if len(members) == 1:
            results[members[0]] = reduce(tensors[members[0]], name)
            continue
        flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in members], axis=0)
        sizes = [tf.size(tensors[i]) for i in members]
        pieces = tf.split(reduce(flat, name), tf.stack(sizes), num=len(members))
        for i, piece in zip(members, pieces, strict=True):
            results[i] = tf.reshape(piece, tf.shape(tensors[i]))
    return [r for r in results if r is not None]


def set_horovod_defaults() -> None:
    """`STALL_DEFAULTS` (and `CPU_DEFAULTS` without GPUs) where the environment
    does not set them; read by `hvd.init()`."""
    defaults = dict(STALL_DEFAULTS)
    if not has_gpu():
        defaults.update(CPU_DEFAULTS)
    for name, value in defaults.items():
        os.environ.setdefault(name, value)


def create_collectives(bind_cpus: bool = True) -> Collectives:
    """Horovod's when launched by it (even with one rank), else the one-process
    kind, pinned to the first GPU like a rank (`pin_gpu`). `bind_cpus`: see
    `share_cpus`."""
    if launched_by_horovod():
        return HorovodCollectives(bind_cpus)
    pin_gpu(local_rank=0, local_ranks=1)
    return Collectives()
