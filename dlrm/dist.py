"""Collectives between ranks: the one place outside `dlrm/embedding/` that
touches Horovod.

Everything else takes a `Collectives` value (rank, world size and the few
operations training needs), so the same model and trainer run on one process
(`LocalCollectives`, no Horovod import at all) or under `horovodrun`
(`HorovodCollectives`: Gloo on CPU, NCCL/MPI on GPU clusters, as Horovod was built).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import tensorflow as tf


class Collectives:
    """One process: every collective is the identity."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def alltoall(self, tensor: tf.Tensor, splits: Sequence[int] | tf.Tensor) -> tf.Tensor:
        """Sends rows [sum(splits[:j]), sum(splits[:j+1])) of `tensor` to rank j;
        returns what every rank sent here, concatenated in rank order."""
        return tensor

    def allreduce_sum(self, tensors: Sequence[Any]) -> list[Any]:
        """Element-wise sums over ranks (dense tensors or `tf.IndexedSlices`)."""
        return list(tensors)

    def allgather(self, tensor: tf.Tensor) -> tf.Tensor:
        """Every rank's `tensor` concatenated along axis 0, in rank order."""
        return tensor

    def allgather_object(self, value: Any) -> list[Any]:
        return [value]

    def broadcast_object(self, value: Any) -> Any:
        return value

    def broadcast_variables(self, variables: Sequence[Any]) -> None:
        """Rank 0's values into every rank's `variables`."""

    def barrier(self) -> None:
        """Returns once every rank has called it."""

    def any_true(self, flag: tf.Tensor) -> tf.Tensor:
        """True on every rank when `flag` is true on any rank."""
        return flag


LocalCollectives = Collectives


# A rank that stops submitting collectives (stuck, not dead) makes Horovod warn after
# the check time and shut every rank down after the shutdown time, instead of the
# others waiting forever. Horovod leaves the shutdown off by default. A rank that
# dies is handled sooner: its peers' Gloo/MPI connections fail and horovodrun (or
# srun/mpirun) ends the job. The environment overrides both.
STALL_DEFAULTS = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "900",
}


class HorovodCollectives(Collectives):
    """Horovod's collectives; `hvd.init()` runs on construction."""

    def __init__(self) -> None:
        for name, value in STALL_DEFAULTS.items():
            os.environ.setdefault(name, value)  # read by hvd.init()
        import horovod.tensorflow as hvd

        self._hvd = hvd
        hvd.init()
        self.rank = hvd.rank()
        self.world_size = hvd.size()
        self.local_rank = hvd.local_rank()
        pin_gpu(self.local_rank)

    def alltoall(self, tensor: tf.Tensor, splits: Sequence[int] | tf.Tensor) -> tf.Tensor:
        result = self._hvd.alltoall(tensor, splits=tf.cast(splits, tf.int32))
        # Horovod returns (tensor, received_splits) in 0.28.
        return result[0] if isinstance(result, (tuple, list)) else result

    def allreduce_sum(self, tensors: Sequence[Any]) -> list[Any]:
        if not tensors:
            return []
        return [self._hvd.allreduce(t, op=self._hvd.Sum) for t in tensors]

    def allgather(self, tensor: tf.Tensor) -> tf.Tensor:
        return self._hvd.allgather(tensor)

    def allgather_object(self, value: Any) -> list[Any]:
        return list(self._hvd.allgather_object(value))

    def broadcast_object(self, value: Any) -> Any:
        return self._hvd.broadcast_object(value, root_rank=0)

    def broadcast_variables(self, variables: Sequence[Any]) -> None:
        resources = [getattr(v, "value", v) for v in variables]
        self._hvd.broadcast_variables(resources, root_rank=0)

    def barrier(self) -> None:
        self._hvd.allreduce(tf.constant(0.0), op=self._hvd.Sum, name="barrier").numpy()

    def any_true(self, flag: tf.Tensor) -> tf.Tensor:
        return self._hvd.allreduce(tf.cast(flag, tf.float32), op=self._hvd.Sum) > 0


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


def launched_by_horovod() -> bool:
    """True under horovodrun (or srun with Horovod's MPI/Gloo environment)."""
    return any(
        name in os.environ
        for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    )


def create_collectives() -> Collectives:
    """Horovod's when launched by it (even with one rank), else the one-process kind."""
    return HorovodCollectives() if launched_by_horovod() else Collectives()
