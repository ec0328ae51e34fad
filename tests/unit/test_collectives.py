"""`dlrm.distributed.collectives.packed`: each allreduce call as one buffer per dtype, laid out the
same way every time, so that the ranks' sums repeat bit for bit (the 3-rank
runs of tests/integration/test_hybrid_main.py show it under horovodrun)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from dlrm.distributed.collectives import packed


def tensors() -> list[tf.Tensor]:
    return [
        tf.constant(1.5),  # a scalar: the verdict's kind
        tf.reshape(tf.range(6, dtype=tf.float32), [2, 3]),
        tf.constant([[7, 8]], tf.int32),
        tf.zeros([0, 4]),  # nothing to add, kept in its place
        tf.constant([-1.0, 2.0, 0.25]),
    ]


@pytest.mark.parametrize("traced", [False, True])
def test_one_reduction_per_dtype_over_the_tensors_end_to_end(traced: bool) -> None:
    calls: list[tuple[str, np.ndarray]] = []

    def reduce(flat: tf.Tensor, name: str) -> tf.Tensor:
        calls.append((name, flat))
        return flat * 3  # what a sum over three equal ranks gives

    names = ["scalar", "matrix", "ints", "empty", "vector"]

    def run() -> list[tf.Tensor]:
        return packed(tensors(), names, reduce)

    results = tf.function(run, autograph=False)() if traced else run()
    for result, tensor in zip(results, tensors(), strict=True):
        assert result.dtype == tensor.dtype and result.shape == tensor.shape
        np.testing.assert_array_equal(result.numpy(), tensor.numpy() * 3)
    # The floats go as one buffer named after the first of them, in the callers'
    # order; the ints alone, as they are.
    assert [name for name, _ in calls] == ["scalar", "ints"]
    if not traced:
        np.testing.assert_array_equal(calls[0][1], [1.5, 0, 1, 2, 3, 4, 5, -1, 2, 0.25])
        np.testing.assert_array_equal(calls[1][1], [[7, 8]])
