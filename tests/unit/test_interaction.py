"""Dot interaction against a numpy reference."""

from __future__ import annotations

import numpy as np

from dlrm.interaction import DotInteraction


def reference(dense: np.ndarray, embeddings: np.ndarray) -> np.ndarray:
    out = []
    for b in range(dense.shape[0]):
        vectors = [dense[b], *embeddings[b]]
        pairs = [vectors[i] @ vectors[j] for i in range(len(vectors)) for j in range(i)]
        out.append(np.concatenate([dense[b], pairs]))
    return np.array(out)


def test_matches_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(5, 7)).astype(np.float32)  # odd sizes: B=5, D=7, T=3
    embeddings = rng.normal(size=(5, 3, 7)).astype(np.float32)
    out = DotInteraction()(dense, embeddings).numpy()
    assert out.shape == (5, 7 + 4 * 3 // 2)
    np.testing.assert_allclose(out, reference(dense, embeddings), rtol=1e-5, atol=1e-5)


def test_gradients_flow_to_both_inputs() -> None:
    import tensorflow as tf

    dense = tf.Variable(np.ones((2, 4), np.float32))
    embeddings = tf.Variable(np.full((2, 2, 4), 0.5, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(DotInteraction()(dense, embeddings))
    grad_dense, grad_embeddings = tape.gradient(loss, [dense, embeddings])
    # d/d dense of sum(dense) + dense.e1 + dense.e2 + e1.e2 = 1 + e1 + e2 = 2.
    np.testing.assert_allclose(grad_dense.numpy(), 2.0)
    # d/d e1 = dense + e2 = 1.5.
    np.testing.assert_allclose(grad_embeddings.numpy(), 1.5)
