"""Dot interaction against a numpy reference."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from dlrm.model.interaction import BLOCK_ROWS, CrossInteraction, DotInteraction, dot_interaction


def reference(dense: np.ndarray, embeddings: np.ndarray) -> np.ndarray:
    out = []
    for b in range(dense.shape[0]):
        vectors = [dense[b], *embeddings[b]]
        pairs = [vectors[i] @ vectors[j] for i in range(len(vectors)) for j in range(i)]
        out.append(np.concatenate([dense[b], pairs]))
    return np.array(out)


@pytest.mark.parametrize("side_by_side", [False, True], ids=["B_T_D", "B_TD"])
def test_matches_numpy_reference(side_by_side: bool) -> None:
    """Vectors [B, T, D], or side by side [B, T D] as the embeddings layers give them."""
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(5, 7)).astype(np.float32)  # odd sizes: B=5, D=7, T=3
    embeddings = rng.normal(size=(5, 3, 7)).astype(np.float32)
    given = embeddings.reshape(5, 21) if side_by_side else embeddings
    out = DotInteraction()(dense, given).numpy()
    assert out.shape == (5, 7 + 4 * 3 // 2)
    np.testing.assert_allclose(out, reference(dense, embeddings), rtol=1e-5, atol=1e-5)


def test_gradients_flow_to_both_inputs() -> None:
    dense = tf.Variable(np.ones((2, 4), np.float32))
    embeddings = tf.Variable(np.full((2, 2, 4), 0.5, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(DotInteraction()(dense, embeddings))
    grad_dense, grad_embeddings = tape.gradient(loss, [dense, embeddings])
    # d/d dense of sum(dense) + dense.e1 + dense.e2 + e1.e2 = 1 + e1 + e2 = 2.
    np.testing.assert_allclose(grad_dense.numpy(), 2.0)
    # d/d e1 = dense + e2 = 1.5.
    np.testing.assert_allclose(grad_embeddings.numpy(), 1.5)


def _autodiff_reference(dense: Any, embeddings: Any) -> Any:
    """The interaction as autodiff sees it: concatenate, V @ V^T, lower triangle."""
    vectors = tf.concat([dense[:, None, :], embeddings], axis=1)
    n = vectors.shape[1]
    rows, cols = np.tril_indices(n, k=-1)
    flat = tf.reshape(tf.matmul(vectors, vectors, transpose_b=True), [-1, n * n])
    return tf.concat([dense, tf.gather(flat, rows * n + cols, axis=1)], axis=1)


@pytest.mark.parametrize(
    ("rows", "compile_as"),
    [
        (5, "eager"),  # one product
        (BLOCK_ROWS * 2 + 37, "eager"),  # two full blocks and a remainder
        (BLOCK_ROWS * 2 + 37, "function"),
        (BLOCK_ROWS + 1, "xla"),
        (BLOCK_ROWS * 2 + 37, "xla_whole"),  # as --xla runs it: one product, no blocks
        (BLOCK_ROWS + 1, "unknown_batch"),  # batch size unknown when traced: one product
    ],
)
def test_values_and_gradients_match_autodiff(rows: int, compile_as: str) -> None:
    rng = np.random.default_rng(rows)
    dense = tf.constant(rng.normal(size=(rows, 5)).astype(np.float32))
    embeddings = tf.constant(rng.normal(size=(rows, 6, 5)).astype(np.float32))
    upstream = tf.constant(rng.normal(size=(rows, 5 + 21)).astype(np.float32))

    def value_and_gradients(fn: Any) -> Any:
        def run(d: Any, e: Any) -> Any:
            with tf.GradientTape() as tape:
                tape.watch([d, e])
                out = fn(d, e)
            return out, tape.gradient(out, [d, e], output_gradients=upstream)

        if compile_as == "function":
            return tf.function(run)
        if compile_as in ("xla", "xla_whole"):
            return tf.function(run, jit_compile=True)
        if compile_as == "unknown_batch":
            signature = [tf.TensorSpec([None, 5]), tf.TensorSpec([None, 6, 5])]
            return tf.function(run, input_signature=signature)
        return run

    block_rows = None if compile_as == "xla_whole" else BLOCK_ROWS
    interaction = functools.partial(dot_interaction, block_rows=block_rows)
    out, gradients = value_and_gradients(interaction)(dense, embeddings)
    want, want_gradients = value_and_gradients(_autodiff_reference)(dense, embeddings)
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    for name, gradient, expected in zip(
        ("dense", "embeddings"), gradients, want_gradients, strict=True
    ):
        np.testing.assert_allclose(gradient, expected, rtol=1e-5, atol=1e-4, err_msg=name)


def test_bfloat16_is_within_bfloat16_rounding() -> None:
    rng = np.random.default_rng(1)
    dense = rng.uniform(-1, 1, size=(BLOCK_ROWS + 3, 8)).astype(np.float32)
    embeddings = rng.uniform(-1, 1, size=(BLOCK_ROWS + 3, 4, 8)).astype(np.float32)
    out = dot_interaction(tf.cast(dense, tf.bfloat16), tf.cast(embeddings, tf.bfloat16))
    assert out.dtype == tf.bfloat16
    want = _autodiff_reference(tf.constant(dense), tf.constant(embeddings)).numpy()
    # Operands rounded to bfloat16 (relative error 2^-8 each) and a bfloat16 result:
    # at most about 3 * 2^-8 of the sum of |products| (8 terms of at most 1).
    np.testing.assert_allclose(out.numpy().astype(np.float32), want, atol=8 * 3 * 2.0**-8)


def cross_reference(x0: np.ndarray, layers: list[tuple[Any, np.ndarray, np.ndarray]]) -> Any:
    """DCNv2 in float64: x_{l+1} = x0 * (x_l V U + b) + x_l (V None: full rank)."""
    x = x0
    for down, up, bias in layers:
        projected = x @ down if down is not None else x
        x = x0 * (projected @ up + bias) + x
    return x


@pytest.mark.parametrize(("projection", "low_rank"), [(3, True), (0, False), (99, False)])
def test_cross_matches_the_dcnv2_formula(projection: int, low_rank: bool) -> None:
    rng = np.random.default_rng(3)
    dense = rng.normal(size=(5, 4)).astype(np.float32)
    vectors = rng.normal(size=(5, 2 + 7 + 3)).astype(np.float32)  # tables 2, 7 and 3 wide
    layer = CrossInteraction(num_layers=2, projection_dim=projection)
    assert layer(dense, vectors).shape == (5, 4 + 12)
    # Random biases too: the layer initialises them to zero.
    for up in layer.up:
        up.bias.assign(rng.normal(size=up.bias.shape).astype(np.float32))
    out = layer(dense, vectors).numpy()
    weights = [
        (None if down is None else down.kernel.numpy(), up.kernel.numpy(), up.bias.numpy())
        for down, up in zip(layer.down, layer.up, strict=True)
    ]
    assert all((w[0] is not None) == low_rank for w in weights)
    if low_rank:
        assert weights[0][0].shape == (16, 3) and weights[0][1].shape == (3, 16)
    else:
        assert weights[0][1].shape == (16, 16)
    x0 = np.concatenate([dense, vectors], axis=1).astype(np.float64)
    np.testing.assert_allclose(out, cross_reference(x0, weights), rtol=1e-5, atol=1e-5)


def test_cross_gradients_match_finite_differences() -> None:
    rng = np.random.default_rng(4)
    dense = tf.constant(rng.normal(size=(3, 2)))
    vectors = tf.constant(rng.normal(size=(3, 5)))
    layer = CrossInteraction(num_layers=2, projection_dim=2, dtype="float64")
    layer(dense, vectors)
    theoretical, numerical = tf.test.compute_gradient(
        lambda d, v: layer(d, v), [dense, vectors], delta=1e-6
    )
    for t, n in zip(theoretical, numerical, strict=True):
        np.testing.assert_allclose(t, n, rtol=1e-5, atol=1e-6)


def test_cross_rejects_no_layers() -> None:
    with pytest.raises(ValueError, match="num_layers >= 1 and projection_dim >= 0, got 0 and 4"):
        CrossInteraction(0, 4)
