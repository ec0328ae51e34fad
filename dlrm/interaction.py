"""DLRM's dot interaction."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf


def lower_triangle_indices(num_vectors: int) -> np.ndarray:
    """Flat indices (i * n + j) of the pairs i > j, row by row: [n (n - 1) / 2]."""
    rows, cols = np.tril_indices(num_vectors, k=-1)
    return (rows * num_vectors + cols).astype(np.int32)


class DotInteraction(keras.layers.Layer):
    """Pairwise dot products of the bottom-MLP output and the embedding vectors.

    Inputs: `dense` [B, D] and `embeddings` [B, T, D]. Output:
    [B, D + (T + 1) T / 2]: `dense` followed by the strictly-lower triangle of
    the Gram matrix of the T + 1 vectors (dense first), row by row.
    """

    def call(self, dense: tf.Tensor, embeddings: tf.Tensor) -> tf.Tensor:
        vectors = tf.concat([tf.expand_dims(dense, 1), embeddings], axis=1)  # [B, T+1, D]
        n = vectors.shape[1]
        gram = tf.matmul(vectors, vectors, transpose_b=True)  # [B, T+1, T+1]
        flat = tf.reshape(gram, [-1, n * n])
        pairs = tf.gather(flat, lower_triangle_indices(n), axis=1)
        return tf.concat([dense, pairs], axis=1)

    def compute_output_shape(self, dense_shape: Any, embeddings_shape: Any) -> tuple[Any, ...]:
        n = embeddings_shape[1] + 1
        return (dense_shape[0], dense_shape[1] + n * (n - 1) // 2)
