"""Whether tensors hold only finite values: the `DlrmAllFinite` kernel where the
kernels are in use, else TensorFlow's ops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from dlrm import kernels


def all_finite(tensors: Sequence[Any], use_kernel: bool = False) -> tf.Tensor:
    """Whether no value of `tensors` (tensors or IndexedSlices) is NaN or
    infinite: a bool scalar. `use_kernel`: one pass of the project's CPU kernel
    (`DlrmAllFinite`, `dlrm.kernels`), where TensorFlow's ops write a bool tensor
    as large as each one and reduce it (a tenth of the default model's step)."""
    values = [t.values if isinstance(t, tf.IndexedSlices) else t for t in tensors]
    if not values:
        return tf.constant(True)
    if use_kernel:
        return kernels.require().dlrm_all_finite(values)
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]))
