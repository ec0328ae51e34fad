"""The benchmark's timing wrapper changes no value, and counts time inside
compiled functions, for each collective the step runs (the reverse alltoall of
the embedding backward is a call of its own)."""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from benchmarks.timed_collectives import TimedCollectives
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
