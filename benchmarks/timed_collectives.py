"""Collectives that measure the wall time they take, inside the compiled step.

`TimedCollectives` wraps any `Collectives` and brackets each collective the
training step runs (the embedding alltoalls forward *and* backward, the
gradient allreduce, the apply/skip vote) with `tf.timestamp()` ops that execute
with the graph, adding the elapsed seconds to a variable. What it measures is
the time a rank spends inside collectives, waiting for the slower peer
included: the share of the step that more ranks on more network would have to
pay for.

On a machine whose cores the ranks share, that time is mostly waiting: a rank
that reaches a collective first waits for its peer, whose compute meanwhile has
the cores. `executing_seconds` separates the collectives' own work from that
waiting with Horovod's timeline (`HOROVOD_TIMELINE`), which records for every
collective its negotiation (from the first rank's submission until every rank
has submitted) and then its execution (the transfer).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tensorflow as tf

from dlrm.dist import Collectives


class TimedCollectives(Collectives):
    """Delegates to `inner`; `seconds` accumulates the time spent in its calls."""

    def __init__(self, inner: Collectives) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.local_rank = inner.local_rank
        self.intra_op_threads = inner.intra_op_threads
        self.seconds = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="collectives_s")

    def reset(self) -> None:
        self.seconds.assign(0.0)

    def _timed(self, inputs: Sequence[Any], call: Any) -> Any:
        """`call()` with timestamps taken after `inputs` exist and after its result."""
        with tf.control_dependencies(_tensors(inputs)):
            start = tf.timestamp()
        with tf.control_dependencies([start]):
            result = call()
        with tf.control_dependencies(_tensors(result)):
            self.seconds.assign_add(tf.timestamp() - start)
            return tf.nest.map_structure(_identity, result)

    def alltoall(
        self, tensor: tf.Tensor, splits: Sequence[int] | tf.Tensor, name: str
    ) -> tf.Tensor:
        # The backward alltoall is a call of its own (the sharded embeddings run
        # it explicitly), so it is timed here too.
        return self._timed([tensor], lambda: self.inner.alltoall(tensor, splits, name))

    def allreduce_sum(self, tensors: Sequence[Any], names: Sequence[str]) -> list[Any]:
        if not tensors:
            return []
        return list(self._timed(list(tensors), lambda: self.inner.allreduce_sum(tensors, names)))

    def allgather(self, tensor: tf.Tensor) -> tf.Tensor:
        return self._timed([tensor], lambda: self.inner.allgather(tensor))

    def allgather_object(self, value: Any, name: str) -> list[Any]:
        return self.inner.allgather_object(value, name)

    def broadcast_object(self, value: Any, name: str) -> Any:
        return self.inner.broadcast_object(value, name)

    def broadcast_variables(self, variables: Sequence[Any]) -> None:
        self.inner.broadcast_variables(variables)

    def barrier(self) -> None:
        self.inner.barrier()

    def any_true(self, flags: tf.Tensor, name: str) -> tf.Tensor:
        return self._timed([flags], lambda: self.inner.any_true(flags, name))


def _tensors(structure: Any) -> list[Any]:
    """The tensors of `structure` (IndexedSlices count by their values)."""
    out = []
    for item in tf.nest.flatten(structure, expand_composites=True):
        if isinstance(item, tf.Tensor | tf.Variable):
            out.append(item)
    return out


def _identity(item: Any) -> Any:
    if isinstance(item, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(item.values), item.indices, item.dense_shape)
    return tf.identity(item)


def executing_seconds(timeline: Path, steps: int, first: str, last: str) -> float:
    """Seconds the last `steps` steps spent executing collectives (negotiation
    excluded), from a Horovod timeline (written by rank 0, the coordinator).

    A step's collectives run from collective `first`'s negotiation to the end
    of collective `last` (tensor names); overlapping executions (the tensors of
    one fused allreduce) count once."""
    text = timeline.read_text().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")  # written as it runs
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e["args"]
    }
    open_: dict[int, list[tuple[str, float]]] = {}
    negotiations: list[float] = []  # start of each of `first`'s negotiations
    ends: list[float] = []  # end of each of `last`'s executions
    executions: list[tuple[float, float]] = []
    for event in events:
        stack = open_.setdefault(event.get("pid", -1), [])
        if event.get("ph") == "B":
            stack.append((event["name"], event["ts"] / 1e6))
        elif event.get("ph") == "E" and stack:
            activity, start = stack.pop()
            if stack:  # a phase inside an activity
                continue
            tensor = names.get(event["pid"], "")
            if activity.startswith("NEGOTIATE"):
                if tensor == first:
                    negotiations.append(start)
                continue
            executions.append((start, event["ts"] / 1e6))
            if tensor == last:
                ends.append(event["ts"] / 1e6)
    if len(negotiations) < steps or len(ends) < steps:
        raise ValueError(
            f"{timeline}: expected at least {steps} steps of collectives {first!r} to "
            f"{last!r}, found {len(negotiations)} and {len(ends)}"
        )
    window = (negotiations[-steps], ends[-1])
    total, reach = 0.0, window[0]
    for start, end in sorted(executions):
        start, end = max(start, reach), min(end, window[1])
        if end > start:
            total += end - start
            reach = end
    return total
