"""The benchmark's timing wrapper changes no value, and counts time inside
compiled functions, for each collective the step runs (the reverse alltoall of
the embedding backward is a call of its own); the Horovod timeline reader
counts the collectives' execution, not their negotiation."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from benchmarks.timed_collectives import TimedCollectives, executing_seconds
from dlrm.dist import Collectives


class SlowCollectives(Collectives):
    """Identity-like collectives that take measurable time: 20 ms per call."""

    def alltoall(self, tensor: tf.Tensor, splits: object, name: str) -> tf.Tensor:
        return _slow(tensor) * 2.0

    def allreduce_sum(self, tensors: list, names: list) -> list:
        return [_slow(t) for t in tensors]


def _slow(tensor: tf.Tensor) -> tf.Tensor:
    def wait(x: np.ndarray) -> np.ndarray:
        time.sleep(0.02)
        return x

    out = tf.numpy_function(wait, [tensor], tensor.dtype)
    out.set_shape(tensor.shape)
    return out


def test_values_and_seconds_inside_a_tf_function() -> None:
    timed = TimedCollectives(SlowCollectives())
    x = tf.Variable([[1.0, 2.0], [3.0, 4.0]])

    @tf.function
    def step() -> tuple[tf.Tensor, tf.Tensor, list]:
        y = timed.alltoall(x, [1, 1], name="forward")
        backward = timed.alltoall(2 * y, [1, 1], name="backward")
        reduced = timed.allreduce_sum([backward], ["gradient"])
        return y, backward, reduced

    y, backward, reduced = step()
    np.testing.assert_allclose(y.numpy(), 2 * x.numpy())
    np.testing.assert_allclose(backward.numpy(), 8 * x.numpy())
    np.testing.assert_allclose(reduced[0].numpy(), backward.numpy())
    # forward alltoall, backward alltoall, allreduce: three 20 ms waits.
    assert timed.seconds.numpy() >= 0.055
    timed.reset()
    assert timed.seconds.numpy() == 0.0


def test_ids_pass_through() -> None:
    timed = TimedCollectives(Collectives())
    ids = tf.constant([3, 1, 4], tf.int32)
    assert timed.alltoall(ids, [3], name="ids").numpy().tolist() == [3, 1, 4]


def _timeline(steps: list[dict[str, tuple[float, float, float]]]) -> str:
    """A Horovod timeline as rank 0 writes it (no closing bracket while the job
    runs): per step, per tensor, (negotiation start, execution start, end) in ms."""
    pids = {name: pid for pid, name in enumerate(sorted({n for step in steps for n in step}), 1)}
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
        for name, pid in pids.items()
    ]
    for step in steps:
        for name, (negotiate, execute, end) in step.items():
            pid = pids[name]
            events += [
                {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": negotiate * 1000, "pid": pid},
                {"ph": "E", "ts": execute * 1000, "pid": pid},
                {"ph": "B", "name": "ALLREDUCE", "ts": execute * 1000, "pid": pid},
                {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": execute * 1000 + 1, "pid": pid},
                {"ph": "E", "ts": end * 1000 - 1, "pid": pid},
                {"ph": "E", "ts": end * 1000, "pid": pid},
            ]
    return "[\n" + ",\n".join(json.dumps(e) for e in events) + ","


def test_executing_seconds_counts_transfers_not_waiting(tmp_path: Path) -> None:
    """Negotiation (waiting for the other ranks) is left out, overlapping
    executions (one fused allreduce) count once, and only the last steps count."""
    step = [
        # warmup step: long, not counted
        {"first": (0, 50, 60), "a": (60, 200, 300), "b": (60, 210, 290), "last": (300, 301, 302)},
        {"first": (1000, 1100, 1110), "a": (1200, 1300, 1340), "b": (1200, 1320, 1350)},
        {"first": (2000, 2005, 2015), "a": (2100, 2150, 2160), "b": (2100, 2150, 2160)},
    ]
    step[1]["last"] = (1400, 1401, 1405)
    step[2]["last"] = (2200, 2210, 2212)
    timeline = tmp_path / "timeline.json"
    timeline.write_text(_timeline(step))
    seconds = executing_seconds(timeline, 2, "first", "last")
    # step 1: 10 + (1300..1350) 50 + 4; step 2: 10 + 10 + 2
    assert abs(seconds - (10 + 50 + 4 + 10 + 10 + 2) / 1000) < 1e-9
    with pytest.raises(ValueError, match="expected at least 4 steps"):
        executing_seconds(timeline, 4, "first", "last")
