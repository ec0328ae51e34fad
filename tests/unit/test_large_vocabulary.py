"""Lookups in tables of more than 2^31 rows: the gradient's shape holds.

A table of width 0 has 2^31 + 16 rows in no memory, so these run in unit time;
`tests/integration/test_large_table.py` trains a real one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from dlrm.embedding.base import _gather_with_int64_shape, gather_rows, pooled_lookup

ROWS = 2**31 + 16


def gradient_of(
    lookup: Callable[[tf.Variable, Any], tf.Tensor], variable: tf.Variable, ids: Any
) -> tf.IndexedSlices:
    @tf.function
    def step(ids: Any) -> tf.IndexedSlices:
        with tf.GradientTape() as tape:
            out = lookup(variable, ids)
        weights = tf.reshape(tf.range(tf.size(out), dtype=out.dtype), tf.shape(out))
        (gradient,) = tape.gradient(out, [variable], output_gradients=weights)
        return gradient

    return step(ids)


def test_tensorflow_gather_gradient_breaks_above_2_31_rows() -> None:
    """Why `gather_rows` exists: tf.gather's gradient states the shape as int32."""
    variable = tf.Variable(tf.zeros([ROWS, 0]))
    with pytest.raises(ValueError, match="Invalid value in tensor used for shape"):
        gradient_of(tf.gather, variable, tf.constant([2**31 + 3], tf.int64))


def test_gradient_of_a_table_of_more_than_2_31_rows() -> None:
    variable = tf.Variable(tf.zeros([ROWS, 0]))
    ids = tf.constant([[2**31 + 3, 5], [2**31 + 15, 2**31 + 3]], tf.int64)
    gradient = gradient_of(gather_rows, variable, ids)
    assert gradient.dense_shape.numpy().tolist() == [ROWS, 0]
    assert gradient.indices.numpy().tolist() == [2**31 + 3, 5, 2**31 + 15, 2**31 + 3]
    assert gradient.values.shape == (4, 0)


def test_pooled_lookup_of_ragged_ids_above_2_31() -> None:
    variable = tf.Variable(tf.zeros([ROWS, 0]))
    ids = tf.RaggedTensor.from_row_lengths(
        tf.constant([ROWS - 1, 0, 2**31], tf.int64), tf.constant([2, 0, 1], tf.int64)
    )
    gradient = gradient_of(lambda v, i: pooled_lookup(v, i, "mean"), variable, ids)
    assert gradient.dense_shape.numpy().tolist() == [ROWS, 0]
    assert gradient.indices.numpy().tolist() == [ROWS - 1, 0, 2**31]


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64])
def test_the_int64_shape_gather_matches_tf_gather(dtype: tf.DType) -> None:
    """The same values and gradient as tf.gather, on a small table (where
    `gather_rows` itself keeps tf.gather)."""
    variable = tf.Variable(np.arange(23 * 7, dtype=np.float32).reshape(23, 7))
    ids = tf.constant([[4, 22, 4], [0, 9, 13]], dtype)
    theirs = gradient_of(tf.gather, variable, ids)
    ours = gradient_of(_gather_with_int64_shape, variable, ids)
    np.testing.assert_array_equal(ours.values, theirs.values)
    np.testing.assert_array_equal(ours.indices, theirs.indices)
    assert ours.dense_shape.dtype == tf.int64
    assert ours.dense_shape.numpy().tolist() == theirs.dense_shape.numpy().tolist() == [23, 7]
    np.testing.assert_array_equal(_gather_with_int64_shape(variable, ids), tf.gather(variable, ids))
