"""Poisoned dense forwards: a NaN where a test wants one, switched by a variable."""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

NAN = float("nan")

DenseForward = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


def nan_in_one_logit(forward: DenseForward, poisoned: tf.Variable) -> DenseForward:
    """While `poisoned`, the first logit is NaN: after the last ReLU, so the loss
    is NaN on every CPU. The gradients stay finite (the replaced logit gets none),
    so only the loss check can stop the step."""

    def forward_with_a_nan_logit(numerical: tf.Tensor, vectors: tf.Tensor) -> tf.Tensor:
        logits = forward(numerical, vectors)
        return tf.where(poisoned, tf.tensor_scatter_nd_update(logits, [[0, 0]], [NAN]), logits)

    return forward_with_a_nan_logit


def nan_in_one_vector_gradient(
    forward: DenseForward, poisoned: tf.Variable, column: int = 0
) -> DenseForward:
    """While `poisoned`, component `column` of the first looked-up vector's
    gradient is NaN and the loss is finite: only the (row-sparse) embedding
    gradients carry the NaN, so only the gradient check can stop the step."""

    @tf.custom_gradient
    def identity_with_a_nan_gradient(vectors: tf.Tensor) -> tuple[tf.Tensor, Callable]:
        def gradient(upstream: tf.Tensor) -> tf.Tensor:
            with_nan = tf.tensor_scatter_nd_update(upstream, [[0, column]], [NAN])
            return tf.where(poisoned, with_nan, upstream)

        return tf.identity(vectors), gradient

    def forward_with_a_nan_gradient(numerical: tf.Tensor, vectors: tf.Tensor) -> tf.Tensor:
        return forward(numerical, identity_with_a_nan_gradient(vectors))

    return forward_with_a_nan_gradient
