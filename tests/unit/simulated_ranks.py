"""Several ranks in one process, for unit tests: one thread per rank, and
`Collectives` that exchange numpy copies through a shared hub (eager mode only).
What real processes under horovodrun add is tested in tests/integration."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import tensorflow as tf

from dlrm.dist import Collectives

TIMEOUT_S = 60


class Hub:
    """What the ranks post for one collective, and a barrier to meet at."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=TIMEOUT_S)
        self.posted: dict[int, Any] = {}

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, once all have posted."""
        self.posted[rank] = value
        self.barrier.wait()
        everyone = [self.posted[r] for r in range(len(self.posted))]
        self.barrier.wait()  # nobody posts the next value before all have read
        return everyone


class SimulatedCollectives(Collectives):
    def __init__(self, rank: int, world_size: int, hub: Hub) -> None:
        self.rank, self.world_size, self.hub = rank, world_size, hub

    def alltoall(
        self, tensor: tf.Tensor, splits: Sequence[int] | tf.Tensor, name: str
    ) -> tf.Tensor:
        sent = (np.asarray(tensor), np.asarray(splits, np.int64))
        parts = []
        for data, source_splits in self.hub.exchange(self.rank, sent):
            start = int(source_splits[: self.rank].sum())
            parts.append(data[start : start + int(source_splits[self.rank])])
        return tf.constant(np.concatenate(parts))

    def allreduce_sum(self, tensors: Sequence[Any], names: Sequence[str]) -> list[Any]:
        out = []
        for tensor in tensors:
            if isinstance(tensor, tf.IndexedSlices):  # allgathered, as Horovod does
                everyone = self.hub.exchange(
                    self.rank, (tensor.values.numpy(), tensor.indices.numpy())
                )
                values = np.concatenate([v for v, _ in everyone])
                indices = np.concatenate([i for _, i in everyone])
                out.append(
                    tf.IndexedSlices(tf.constant(values), tf.constant(indices), tensor.dense_shape)
                )
            else:
                out.append(tf.constant(sum(self.hub.exchange(self.rank, np.asarray(tensor)))))
        return out

    def allgather_object(self, value: Any, name: str) -> list[Any]:
        return self.hub.exchange(self.rank, value)

    def any_true(self, flags: tf.Tensor, name: str) -> tf.Tensor:
        return tf.constant(np.any(self.hub.exchange(self.rank, np.asarray(flags)), axis=0))


def run_ranks(world_size: int, work: Callable[[SimulatedCollectives], Any]) -> list[Any]:
    """`work(collectives)` on `world_size` threads; their results in rank order.
    An exception on any rank is raised here (the others time out at the hub)."""
    hub = Hub(world_size)
    with ThreadPoolExecutor(world_size) as pool:
        futures = [
            pool.submit(work, SimulatedCollectives(rank, world_size, hub))
            for rank in range(world_size)
        ]
        return [future.result(timeout=2 * TIMEOUT_S) for future in futures]
