"""DLRM's dot interaction, with a backward pass that costs one batched matmul.

The interaction is a stack of tiny per-sample matrix products ([T+1, D] by
[D, T+1]), which CPU kernels run far below the machine's matmul speed: in the
default model (T = 26, D = 128, batch 8192, 2 cores) it took a quarter of the
training step while doing 4 % of its floating-point work. Two things make it
cheaper, measured in `docs/performance.md`:

- Autodiff of `V @ V^T` runs two batched products (one per operand), although
  both operands are `V`. With the pairs' gradient as the lower triangle `L` of a
  [T+1, T+1] matrix per sample, the vectors' gradient is `(L + L^T) @ V`: one
  product.
- The batched products run over row chunks of `CHUNK_ROWS` samples, whose
  operands stay in cache: about 1.5 to 2 times faster than one product over a
  large batch on the 2-core reference machine.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

# Samples per batched product (see the module docstring).
CHUNK_ROWS = 512


def lower_triangle_indices(num_vectors: int) -> np.ndarray:
    """Flat indices (i * n + j) of the pairs i > j, row by row: [n (n - 1) / 2]."""
    rows, cols = np.tril_indices(num_vectors, k=-1)
    return (rows * num_vectors + cols).astype(np.int32)


def _chunks(rows: int | None) -> list[int] | None:
    """Row counts of the chunks of a batch of `rows` (None: one product)."""
    if rows is None or rows <= CHUNK_ROWS:
        return None
    sizes = [CHUNK_ROWS] * (rows // CHUNK_ROWS)
    if rows % CHUNK_ROWS:
        sizes.append(rows % CHUNK_ROWS)
    return sizes


def _batched(fn: Any, a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """fn(a, b) over row chunks of the batch (the leading dimension)."""
    sizes = _chunks(a.shape[0])
    if sizes is None:
        return fn(a, b)
    pieces = zip(tf.split(a, sizes), tf.split(b, sizes), strict=True)
    return tf.concat([fn(x, y) for x, y in pieces], axis=0)


def _gram(vectors: tf.Tensor) -> tf.Tensor:
    return _batched(lambda x, _: tf.matmul(x, x, transpose_b=True), vectors, vectors)


def pairwise_dots(vectors: tf.Tensor) -> tf.Tensor:
    """vectors [B, n, D] -> [B, n (n - 1) / 2]: <v_i, v_j> for i > j, row by row."""
    n = vectors.shape[1]
    pairs = lower_triangle_indices(n)

    @tf.custom_gradient
    def forward(vectors: tf.Tensor) -> tuple[tf.Tensor, Any]:
        flat = tf.reshape(_gram(vectors), [-1, n * n])
        dots = tf.gather(flat, pairs, axis=1)

        def backward(gradient: tf.Tensor) -> tf.Tensor:
            # Scatter the pairs' gradient into the lower triangle L of [n, n].
            rows = tf.shape(gradient)[0]
            lower = tf.scatter_nd(pairs[:, None], tf.transpose(gradient), [n * n, rows])
            lower = tf.reshape(tf.transpose(lower), [-1, n, n])
            symmetric = lower + tf.transpose(lower, [0, 2, 1])
            return _batched(tf.matmul, symmetric, vectors)

        return dots, backward

    return forward(vectors)


class DotInteraction(keras.layers.Layer):
    """Pairwise dot products of the bottom-MLP output and the embedding vectors.

    Inputs: `dense` [B, D] and `embeddings` [B, T, D]. Output:
    [B, D + (T + 1) T / 2]: `dense` followed by the strictly-lower triangle of
    the Gram matrix of the T + 1 vectors (dense first), row by row.
    """

    def call(self, dense: tf.Tensor, embeddings: tf.Tensor) -> tf.Tensor:
        vectors = tf.concat([tf.expand_dims(dense, 1), embeddings], axis=1)  # [B, T+1, D]
        return tf.concat([dense, pairwise_dots(vectors)], axis=1)

    def compute_output_shape(self, dense_shape: Any, embeddings_shape: Any) -> tuple[Any, ...]:
        n = embeddings_shape[1] + 1
        return (dense_shape[0], dense_shape[1] + n * (n - 1) // 2)
