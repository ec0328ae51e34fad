"""The interactions: DLRM's dot interaction and DCNv2's cross network.

Both take the bottom-MLP output `dense` [B, D_b] and the embedding vectors
`vectors` [B, D_0 + ... + D_{T-1}] (the tables' vectors side by side) and give
the top MLP's input.

The dot interaction is written for the CPU's sake.

The interaction is a stack of tiny per-sample matrix products ([T+1, D] by
[D, T+1]), which CPU kernels run far below the machine's matmul speed: in the
default model (T = 26, D = 128, batch 8192, 2 cores) it took a quarter of the
training step while doing 4 % of its floating-point work. Two things make it
cheaper, measured in `docs/performance.md`:

- Autodiff of the embeddings' `V @ V^T` runs two batched products (one per operand), although
  both operands are `V`. With the pairs' gradient as the lower triangle `L` of a
  [T, T] matrix per sample, the vectors' gradient is `(L + L^T) @ V`: one
  product.
- The bottom-MLP output is not concatenated to the embeddings (a copy of the
  step's largest activation, and another of its gradient, which took 12 % of
  the step): its products with them are one batched matrix-vector product.
- The batched products run over row blocks of `BLOCK_ROWS` samples, whose
  operands stay in cache: about 1.5 to 2 times faster than one product over a
  large batch on the 2-core reference machine. Not under XLA (`--xla`), which
  compiles its own loops: there the blocks only added buffers (default model,
  batch 65536: peak 7.99 GiB in blocks, 6.89 whole, and 5 % slower).

Faster still, on CPUs, is the project's own kernel (`dlrm.kernels`,
`use_kernel`): forward and backward each one op that computes a sample's pairs
while its vectors stay in cache, with no Gram matrices, gathers or scatters in
between. The TensorFlow ops below are the reference it is tested against, and
what runs under XLA, on GPUs and where the kernel was not built.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from dlrm import kernels

# Samples per batched product (see the module docstring).
BLOCK_ROWS = 512


def _blocks(rows: int | None, block_rows: int | None) -> list[int] | None:
    """Row counts of the blocks of a batch of `rows` (None: one product)."""
    if rows is None or block_rows is None or rows <= block_rows:
        return None
    sizes = [block_rows] * (rows // block_rows)
    if rows % block_rows:
        sizes.append(rows % block_rows)
    return sizes


def _batched(fn: Any, a: tf.Tensor, b: tf.Tensor, block_rows: int | None) -> tf.Tensor:
    """fn(a, b) over row blocks of the batch (the leading dimension)."""
    sizes = _blocks(a.shape[0], block_rows)
    if sizes is None:
        return fn(a, b)
    pieces = zip(tf.split(a, sizes), tf.split(b, sizes), strict=True)
    return tf.concat([fn(x, y) for x, y in pieces], axis=0)


def _gram(vectors: tf.Tensor, block_rows: int | None) -> tf.Tensor:
    """vectors [B, n, D] -> [B, n, n]: V V^T per sample."""
    return _batched(lambda x, _: tf.matmul(x, x, transpose_b=True), vectors, vectors, block_rows)


def _pair_indices(tables: int) -> np.ndarray:
    """Where the pairs i > j of the T + 1 vectors (dense first) sit in the
    [T, T + 1] matrix M = [E d, E E^T] (flattened): pair (i, 0) is <e_i, d> =
    M[i - 1, 0] and pair (i, j > 0) is <e_i, e_j> = M[i - 1, j]."""
    rows, cols = np.tril_indices(tables + 1, k=-1)
    return ((rows - 1) * (tables + 1) + cols).astype(np.int32)


def dot_interaction(
    dense: tf.Tensor,
    embeddings: tf.Tensor,
    block_rows: int | None = BLOCK_ROWS,
    use_kernel: bool = False,
) -> tf.Tensor:
    """dense [B, D], embeddings [B, T, D] -> [B, D + (T + 1) T / 2]: `dense`,
    then <v_i, v_j> for i > j, row by row, of the vectors v = (dense, e_1 .. e_T).

    The T + 1 vectors are never concatenated (a copy of the largest tensor of
    the step, and another for its gradient): the products of `dense` and of the
    embeddings are computed apart. `block_rows`: samples per batched product
    (None: the whole batch in one). `use_kernel`: run the project's CPU kernel
    (float32 or bfloat16; raises RuntimeError when it was not built).
    """
    if use_kernel:
        return kernels.require().dlrm_dot_interaction(dense, embeddings)
    tables = embeddings.shape[1]
    width = dense.shape[1]
    pairs = _pair_indices(tables)

    @tf.custom_gradient
    def forward(dense: tf.Tensor, embeddings: tf.Tensor) -> tuple[tf.Tensor, Any]:
        with_dense = tf.matmul(embeddings, dense[:, :, None])  # [B, T, 1]
        among = _gram(embeddings, block_rows)  # [B, T, T]
        products = tf.reshape(tf.concat([with_dense, among], 2), [-1, tables * (tables + 1)])
        out = tf.concat([dense, tf.gather(products, pairs, axis=1)], axis=1)

        def backward(gradient: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            rows = tf.shape(gradient)[0]
            scattered = tf.scatter_nd(
                pairs[:, None], tf.transpose(gradient[:, width:]), [tables * (tables + 1), rows]
            )
            products_gradient = tf.reshape(tf.transpose(scattered), [-1, tables, tables + 1])
            with_dense_gradient = products_gradient[:, :, :1]  # [B, T, 1]
            lower = products_gradient[:, :, 1:]  # strictly lower triangular [B, T, T]
            symmetric = lower + tf.transpose(lower, [0, 2, 1])
            embeddings_gradient = _batched(
                tf.matmul, symmetric, embeddings, block_rows
            ) + tf.matmul(with_dense_gradient, dense[:, None, :])
            dense_gradient = (
                gradient[:, :width]
                + tf.matmul(with_dense_gradient, embeddings, transpose_a=True)[:, 0, :]
            )
            return dense_gradient, embeddings_gradient

        return out, backward

    return forward(dense, embeddings)


class DotInteraction(keras.layers.Layer):
    """Pairwise dot products of the bottom-MLP output and the embedding vectors.

    Inputs: `dense` [B, D] and `vectors` [B, T D] (every table D wide) or
    [B, T, D]. Output: [B, D + (T + 1) T / 2]: `dense` followed by the
    strictly-lower triangle of the Gram matrix of the T + 1 vectors (dense
    first), row by row. `block_rows`: samples per batched product (None: the
    whole batch in one, for XLA). `use_kernel`: the project's CPU kernel instead
    (see `dot_interaction`).
    """

    def __init__(
        self, block_rows: int | None = BLOCK_ROWS, use_kernel: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.block_rows = block_rows
        self.use_kernel = use_kernel
        if use_kernel:
            kernels.require()  # fails here, when the model is built, if it is missing

    def call(self, dense: tf.Tensor, vectors: tf.Tensor) -> tf.Tensor:
        if vectors.shape.rank == 2:
            width = dense.shape[1]
            vectors = tf.reshape(vectors, [-1, vectors.shape[1] // width, width])
        return dot_interaction(dense, vectors, self.block_rows, self.use_kernel)

    def compute_output_shape(self, dense_shape: Any, vectors_shape: Any) -> tuple[Any, ...]:
        tables = vectors_shape[1] if len(vectors_shape) == 3 else vectors_shape[1] // dense_shape[1]
        n = tables + 1
        return (dense_shape[0], dense_shape[1] + n * (n - 1) // 2)


class CrossInteraction(keras.layers.Layer):
    """DCNv2's cross network over x0 = [dense, vectors] (width d).

    Layer l computes x_{l+1} = x0 * (W_l x_l + b_l) + x_l, with W_l = U_l V_l
    of rank `projection_dim` (V_l: d -> r without bias, U_l: r -> d), or a full
    [d, d] W_l when `projection_dim` is 0 or not below d. Kernels are
    Glorot-uniform and biases zero, as in DCNv2 and NVIDIA's TF2 DLRM_and_DCNv2.
    Output: x_L [B, d], the top MLP's input.

    Args:
        num_layers: L >= 1.
        projection_dim: r, the rank of each W_l (0: full rank).
    """

    def __init__(self, num_layers: int, projection_dim: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if num_layers < 1 or projection_dim < 0:
            raise ValueError(
                f"cross interaction: expected num_layers >= 1 and projection_dim >= 0, "
                f"got {num_layers} and {projection_dim}"
            )
        self.num_layers = num_layers
        self.projection_dim = projection_dim
        self.down: list[keras.layers.Dense | None] = []
        self.up: list[keras.layers.Dense] = []

    def build(self, dense_shape: Any, vectors_shape: Any = None) -> None:
        width = int(dense_shape[-1]) + int(vectors_shape[-1])
        low_rank = 0 < self.projection_dim < width
        policy = self.dtype_policy
        for layer in range(self.num_layers):
            down = None
            if low_rank:
                down = keras.layers.Dense(
                    self.projection_dim,
                    use_bias=False,
                    kernel_initializer="glorot_uniform",
                    name=f"cross_{layer}_projection",
                    dtype=policy,
                )
                down.build((None, width))
            up = keras.layers.Dense(
                width,
                kernel_initializer="glorot_uniform",
                bias_initializer="zeros",
                name=f"cross_{layer}",
                dtype=policy,
            )
            up.build((None, self.projection_dim if low_rank else width))
            self.down.append(down)
            self.up.append(up)
        super().build(dense_shape)

    def call(self, dense: tf.Tensor, vectors: tf.Tensor) -> tf.Tensor:
        x0 = tf.concat([dense, tf.cast(vectors, dense.dtype)], axis=1)
        x = x0
        for down, up in zip(self.down, self.up, strict=True):
            x = x0 * up(down(x) if down is not None else x) + x
        return x

    def compute_output_shape(self, dense_shape: Any, vectors_shape: Any) -> tuple[Any, ...]:
        return (dense_shape[0], dense_shape[-1] + vectors_shape[-1])
