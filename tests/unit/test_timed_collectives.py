"""The benchmark's timing wrapper changes no value and no gradient, and counts time
inside compiled functions, for the backward alltoall too."""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from benchmarks.timed_collectives import TimedCollectives
from dlrm.dist import Collectives


class SlowCollectives(Collectives):
    """Identity-like collectives that take measurable time: 20 ms per call, and
    20 ms for the alltoall's gradient (as the reverse alltoall would)."""

    def alltoall(self, tensor: tf.Tensor, splits: object) -> tf.Tensor:
        @tf.custom_gradient
        def exchange(x: tf.Tensor) -> tuple:
            return _slow(x) * 2.0, lambda upstream: _slow(upstream) * 2.0

        return exchange(tensor)

    def allreduce_sum(self, tensors: list) -> list:
        return [_slow(t) for t in tensors]


def _slow(tensor: tf.Tensor) -> tf.Tensor:
    def wait(x: np.ndarray) -> np.ndarray:
        time.sleep(0.02)
        return x

    out = tf.numpy_function(wait, [tensor], tensor.dtype)
    out.set_shape(tensor.shape)
    return out


def test_values_gradients_and_seconds_inside_a_tf_function() -> None:
    timed = TimedCollectives(SlowCollectives())
    x = tf.Variable([[1.0, 2.0], [3.0, 4.0]])

    @tf.function
    def step() -> tuple[tf.Tensor, tf.Tensor, list]:
        with tf.GradientTape() as tape:
            y = timed.alltoall(x, [1, 1])
            loss = tf.reduce_sum(y * y)
        gradient = tape.gradient(loss, x)
        reduced = timed.allreduce_sum([gradient])
        return y, gradient, reduced

    y, gradient, reduced = step()
    np.testing.assert_allclose(y.numpy(), 2 * x.numpy())
    np.testing.assert_allclose(gradient.numpy(), 8 * x.numpy())  # d(4x^2)/dx
    np.testing.assert_allclose(reduced[0].numpy(), gradient.numpy())
    # forward alltoall, backward alltoall, allreduce: three 20 ms waits.
    assert timed.seconds.numpy() >= 0.055
    timed.reset()
    assert timed.seconds.numpy() == 0.0


def test_ids_pass_through_without_gradient() -> None:
    timed = TimedCollectives(Collectives())
    ids = tf.constant([3, 1, 4], tf.int32)
    assert timed.alltoall(ids, [3]).numpy().tolist() == [3, 1, 4]
