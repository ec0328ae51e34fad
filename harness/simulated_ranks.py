"""W ranks in one process, for unit tests: one thread per rank, and a
`Collectives` per rank that exchanges numpy copies through a shared `Hub`.

The tensor collectives run as `tf.numpy_function`, so they work in eager mode
and inside `tf.function` (the trainer's step) alike. Like Horovod's ops, they
are not stateful by default: a collective whose result is unused is pruned
from the graph, and one whose inputs are all constants may be evaluated while
tracing, so the hazards that make real ranks hang show up here as a rank that
waits alone and times out. What real processes under horovodrun add (Gloo,
process boundaries) is tested in tests/integration.

One limit that Horovod does not have: a collective waiting in a graph holds one
of TensorFlow's inter-op threads, which the ranks share. `conftest.py` raises
their number to 16 for this reason (2, the cores, deadlocked a Trainer step);
in `tf.function`, keep to few ranks and let each rank run its collectives one
after the other (as the trainer's step does: each depends on the one before).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from dlrm.distributed.collectives import Collectives

TIMEOUT_S = 60.0


class SimulatedRankError(RuntimeError):
    """A rank waited too long in a collective, or another rank failed."""


class Hub:
    """Where the ranks meet: a mailbox keyed by (collective name, how many times
    this rank has run it), so that collectives pair up by name and order, not by
    the order in which a rank's graph happens to run them."""

    def __init__(self, world_size: int, timeout_s: float = TIMEOUT_S) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._condition = threading.Condition()
        self._posted: dict[tuple[str, int], dict[int, Any]] = {}
        self._read: dict[tuple[str, int], int] = {}
        self._failure: str | None = None

    def exchange(self, rank: int, key: tuple[str, int], value: Any) -> list[Any]:
        """Every rank's `value` posted under `key`, in rank order, once all have."""
        with self._condition:
            self._raise_if_failed(rank, key)
            posted = self._posted.setdefault(key, {})
            if rank in posted:
                raise SimulatedRankError(f"rank {rank} posted {key} twice")
            posted[rank] = value
            self._condition.notify_all()
            complete = self._condition.wait_for(
                lambda: self._failure is not None or len(posted) == self.world_size,
                timeout=self.timeout_s,
            )
            self._raise_if_failed(rank, key)
            if not complete:
                missing = sorted(set(range(self.world_size)) - set(posted))
                message = (
                    f"rank {rank} waited {self.timeout_s:g} s in collective {key[0]!r} "
                    f"(call {key[1]}); ranks {missing} never reached it"
                )
                self.abort(message)
                raise SimulatedRankError(message)
            everyone = [posted[r] for r in range(self.world_size)]
            self._read[key] = self._read.get(key, 0) + 1
            if self._read[key] == self.world_size:  # the last reader frees the slot
                del self._posted[key], self._read[key]
            return everyone

    def abort(self, reason: str) -> None:
        """Wakes every waiting rank with an error (a rank failed)."""
        with self._condition:
            if self._failure is None:
                self._failure = reason
            self._condition.notify_all()

    def _raise_if_failed(self, rank: int, key: tuple[str, int]) -> None:
        if self._failure is not None:
            raise SimulatedRankError(
                f"rank {rank} gave up in collective {key[0]!r}: {self._failure}"
            )


class SimulatedCollectives(Collectives):
    """Rank `rank` of `world_size`, exchanging through `hub`.

    Args:
        stateful: mark the collectives' ops stateful. False (the default) is
            how Horovod registers its ops, and what the code under test must
            cope with.
    """

    def __init__(self, rank: int, world_size: int, hub: Hub, stateful: bool = False) -> None:
        if hub.world_size != world_size:
            raise ValueError(f"the hub is for {hub.world_size} ranks, not {world_size}")
        self.rank = rank
        self.local_rank = rank
        self.world_size = world_size
        self.hub = hub
        self.stateful = stateful
        self._calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def collective_names(self) -> dict[str, int]:
        """How many times this rank ran each collective, by name."""
        with self._lock:
            return dict(self._calls)

    def _exchange(self, name: str, value: Any) -> list[Any]:
        """Every rank's `value` for this rank's next call of collective `name`."""
        with self._lock:  # a graph may run this rank's collectives concurrently
            count = self._calls.get(name, 0)
            self._calls[name] = count + 1
        return self.hub.exchange(self.rank, (name, count), value)

    def _run(
        self,
        name: str,
        combine: Callable[[list[list[np.ndarray]]], list[np.ndarray]],
        tensors: Sequence[tf.Tensor],
    ) -> list[tf.Tensor]:
        """`combine(every rank's arrays)` as one op, in eager and graph mode;
        outputs have the inputs' dtypes (their shapes are set by the caller)."""
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        if not tensors:
            return []

        def body(*arrays: np.ndarray) -> list[np.ndarray]:
            everyone = self._exchange(name, [np.array(a) for a in arrays])
            outputs = combine(everyone)
            return [
                np.asarray(out, dtype=t.dtype.as_numpy_dtype)
                for out, t in zip(outputs, tensors, strict=True)
            ]

        outputs = tf.numpy_function(body, tensors, [t.dtype for t in tensors], self.stateful)
        # One output comes back as a tensor, not a list of one.
        return [outputs] if isinstance(outputs, tf.Tensor) else list(outputs)

    # ------------------------------------------------------------- tensors

    def alltoall(
        self, tensor: tf.Tensor, splits: Sequence[int] | tf.Tensor, name: str
    ) -> tf.Tensor:
        tensor = tf.convert_to_tensor(tensor)
        splits = tf.cast(splits, tf.int64)
        rank, world = self.rank, self.world_size

        def combine(everyone: list[list[np.ndarray]]) -> list[np.ndarray]:
            parts = []
            for source, (data, source_splits) in enumerate(everyone):
                if len(source_splits) != world or source_splits.sum() != len(data):
                    raise SimulatedRankError(
                        f"alltoall {name!r}: rank {source} sent {len(data)} rows split as "
                        f"{source_splits.tolist()}; expected {world} splits summing to the rows"
                    )
                start = int(source_splits[:rank].sum())
                parts.append(data[start : start + int(source_splits[rank])])
            return [np.concatenate(parts), everyone[rank][1]]

        received, _ = self._run(name, combine, [tensor, splits])
        received.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
        return received

    def allreduce_sum(self, tensors: Sequence[tf.Tensor], names: Sequence[str]) -> list[tf.Tensor]:
        if len(tensors) != len(names):
            raise ValueError(f"allreduce_sum: {len(tensors)} tensors, {len(names)} names")
        tensors = [tf.convert_to_tensor(t) for t in tensors]

        def combine(everyone: list[list[np.ndarray]]) -> list[np.ndarray]:
            return [sum(arrays[i] for arrays in everyone) for i in range(len(tensors))]

        results = self._run("|".join(names), combine, tensors)
        for total, tensor in zip(results, tensors, strict=True):
            total.set_shape(tensor.shape)
        return results

    def allgather(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        tensor = tf.convert_to_tensor(tensor)
        (gathered,) = self._run(
            name, lambda everyone: [np.concatenate([a for (a,) in everyone])], [tensor]
        )
        gathered.set_shape(tf.TensorShape([None]).concatenate(tensor.shape[1:]))
        return gathered

    def broadcast_variables(self, variables: Sequence[Any]) -> None:
        tensors = [tf.convert_to_tensor(v) for v in variables]
        values = self._run("broadcast_variables", lambda everyone: everyone[0], tensors)
        for variable, value in zip(variables, values, strict=True):
            variable.assign(tf.reshape(value, variable.shape))

    # ------------------------------------------------------------- objects

    def allgather_object(self, value: Any, name: str) -> list[Any]:
        return self._exchange(name, value)

    def barrier(self) -> None:
        self._exchange("barrier", None)


def run_ranks(
    world_size: int,
    work: Callable[[SimulatedCollectives], Any],
    timeout_s: float = TIMEOUT_S,
    stateful: bool = False,
) -> list[Any]:
    """`work(collectives)` on `world_size` threads, one per rank; their results
    in rank order.

    The first exception raised on any rank is raised here, after the other
    ranks have been woken from their collectives. A rank still running
    `2 * timeout_s` after the start is reported as stuck (its thread is left
    behind as a daemon) rather than hanging the test run.
    """
    hub = Hub(world_size, timeout_s)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def one_rank(rank: int) -> None:
        try:
            results[rank] = work(SimulatedCollectives(rank, world_size, hub, stateful))
        except BaseException as error:  # re-raised in the caller's thread
            with lock:
                errors.append((rank, error))
            hub.abort(f"rank {rank} failed: {type(error).__name__}: {error}")

    threads = [
        threading.Thread(target=one_rank, args=(rank,), name=f"rank{rank}", daemon=True)
        for rank in range(world_size)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 2 * timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if errors:  # the first to fail is the cause; the others were woken by it
        rank, error = errors[0]
        raise SimulatedRankError(f"rank {rank} failed: {type(error).__name__}: {error}") from error
    if stuck:
        raise SimulatedRankError(f"ranks {stuck} still running after {2 * timeout_s:g} s")
    return results
