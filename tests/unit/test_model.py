"""DLRM model: shapes, initialisation, config errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf

from dlrm.embedding.local import LocalEmbeddings
from dlrm.model.config import ModelConfig
from dlrm.model.dlrm import Dlrm
from dlrm.model.export import serving_id_dtype
from dlrm.model.interaction import BLOCK_ROWS

# Odd, tiny sizes (keras-rs style) so that shape bugs surface.
CARDINALITIES = (23, 7, 11)
DEFAULTS = {
    "num_numerical": 5,
    "cardinalities": CARDINALITIES,
    "hotness": (1, 1, 1),
    "embedding_dim": 7,
    "bottom_mlp_dims": (13, 7),
    "top_mlp_dims": (9, 1),
}


def config(**overrides: object) -> ModelConfig:
    return ModelConfig(**{**DEFAULTS, **overrides})


def test_output_shape_one_hot() -> None:
    rng = np.random.default_rng(0)
    model = Dlrm(config())
    numerical = rng.random((6, 5), dtype=np.float32)
    ids = np.stack([rng.integers(0, c, 6) for c in CARDINALITIES], axis=1).astype(np.int32)
    logits = model(numerical, ids)
    assert logits.shape == (6, 1)
    assert np.isfinite(logits.numpy()).all()
    # interaction width: 7 + (3 + 1) * 3 / 2 = 13 inputs to the top MLP
    assert model.top_mlp.layers[0].kernel.shape == (13, 9)


def test_output_shape_multi_hot_pools_by_sum() -> None:
    embeddings = LocalEmbeddings((23, 7), 4)
    ids = (np.array([[1, 2], [3, 3]], np.int32), np.array([[0], [6]], np.int32))
    out = embeddings(ids).numpy()
    assert out.shape == (2, 2 * 4)  # the tables' vectors side by side
    table_0, table_1 = embeddings.tables[0].numpy(), embeddings.tables[1].numpy()
    np.testing.assert_allclose(out[0, :4], table_0[1] + table_0[2], rtol=1e-6)
    np.testing.assert_allclose(out[1, :4], 2 * table_0[3], rtol=1e-6)
    np.testing.assert_array_equal(out[1, 4:], table_1[6])


def test_amp_embeddings_give_16_bit_vectors_and_float32_table_gradients() -> None:
    """Under --amp the default embeddings cast each table's vectors to the
    compute dtype before putting them side by side (the model would round them
    anyway, and a float32 copy of the step's largest activation is not kept);
    the tables and their gradients stay float32."""
    rng = np.random.default_rng(0)
    ids = np.stack([rng.integers(0, c, 6) for c in CARDINALITIES], axis=1).astype(np.int32)
    model = Dlrm(config(), dtype_policy="mixed_bfloat16")
    reference = LocalEmbeddings(CARDINALITIES, 7)  # the same initial tables, float32
    upstream = rng.normal(size=(6, 3 * 7)).astype(np.float32)
    results = []
    for layer, dtype in ((model.embeddings, tf.bfloat16), (reference, tf.float32)):
        with tf.GradientTape() as tape:
            vectors = layer(ids)
        assert vectors.dtype == dtype
        given = tf.cast(tf.cast(upstream, tf.bfloat16), dtype)  # bfloat16 values either way
        gradients = tape.gradient(vectors, layer.tables, output_gradients=given)
        assert all(g.values.dtype == tf.float32 for g in gradients)
        results.append((vectors, [tf.convert_to_tensor(g).numpy() for g in gradients]))
    (amp_vectors, amp_gradients), (vectors, gradients) = results
    rounded = tf.cast(tf.cast(vectors, tf.bfloat16), tf.float32).numpy()
    np.testing.assert_array_equal(tf.cast(amp_vectors, tf.float32).numpy(), rounded)
    for amp_gradient, gradient in zip(amp_gradients, gradients, strict=True):
        np.testing.assert_array_equal(amp_gradient, gradient)
    assert all(t.dtype == tf.float32 for t in model.embeddings.tables)


def test_embeddings_reject_an_output_dtype_they_cannot_give() -> None:
    with pytest.raises(ValueError, match="output_dtype: expected float32, bfloat16 or float16"):
        LocalEmbeddings((23, 7), 4, output_dtype="int32")


def test_embedding_initialisation_range() -> None:
    embeddings = LocalEmbeddings((10000, 4), 8)
    embeddings(np.zeros((1, 2), np.int32))
    big = embeddings.tables[0].numpy()
    assert np.abs(big).max() <= math.sqrt(1 / 10000) + 1e-9
    assert np.abs(big).max() > 0.9 * math.sqrt(1 / 10000)


def test_config_errors_name_what_does_not_fit_the_tables() -> None:
    # The values themselves are checked where the flags enter (test_config.py).
    with pytest.raises(ValueError, match="hotness: expected one value per table"):
        config(hotness=(1,))


def test_cross_takes_one_width_per_table() -> None:
    c = config(
        embedding_dim=(4, 6, 3),
        bottom_mlp_dims=(13, 5),
        interaction="cross",
        num_cross_layers=1,
        cross_layer_projection_dim=2,
    )
    assert c.embedding_dims == (4, 6, 3) and c.interaction_width == 5 + 13
    model = Dlrm(c)
    assert model(np.ones((2, 5), np.float32), np.zeros((2, 3), np.int32)).shape == (2, 1)
    assert [t.shape[1] for t in model.embeddings.tables] == [4, 6, 3]
    assert model.top_mlp.layers[0].kernel.shape == (18, 9)
    # Equal widths given per table are the one width (and compare equal to it).
    assert config(embedding_dim=(7, 7, 7)).embedding_dim == 7


def test_pooling_is_one_value_or_one_per_table() -> None:
    assert config(pooling=("mean", "mean", "mean")).pooling == "mean"
    c = config(pooling=("sum", "mean", "sum"))
    assert c.poolings == ("sum", "mean", "sum")
    assert ModelConfig.from_dict(c.to_dict()) == c
    assert config().poolings == ("sum",) * 3
    with pytest.raises(ValueError, match=r"--pooling: expected one value or one per table"):
        config(pooling=("sum", "mean"))


def test_model_config_errors_name_the_flags() -> None:
    with pytest.raises(ValueError, match=r"--embedding_dim: expected one width or one per table"):
        config(embedding_dim=(7, 6), interaction="cross", num_cross_layers=1)
    with pytest.raises(ValueError, match=r"expected 0 for the dot interaction"):
        config(num_cross_layers=3)


def test_serving_takes_int64_ids_only_when_a_table_needs_them() -> None:
    assert serving_id_dtype((23, 2**31)) == tf.int32  # ids up to 2^31 - 1
    assert serving_id_dtype((23, 2**31 + 1)) == tf.int64


def test_under_xla_the_dot_interaction_runs_whole_batch_products() -> None:
    """Its blocks only add buffers under XLA; the same weights give the same logits."""
    rng = np.random.default_rng(3)
    rows = BLOCK_ROWS + 5
    numerical = rng.random((rows, 5), dtype=np.float32)
    ids = np.stack([rng.integers(0, c, rows) for c in CARDINALITIES], axis=1).astype(np.int32)
    in_blocks, whole = Dlrm(config(), seed=4), Dlrm(config(), seed=4, use_xla=True)
    assert in_blocks.interaction.block_rows == BLOCK_ROWS and whole.interaction.block_rows is None
    # On a GPU too: the blocks are a CPU's cache tuning.
    assert Dlrm(config(), on_gpu=True).interaction.block_rows is None
    want = in_blocks(numerical, ids).numpy()
    whole(numerical, ids)  # builds its weights
    whole.set_weights(in_blocks.get_weights())
    np.testing.assert_allclose(whole(numerical, ids).numpy(), want, rtol=1e-5, atol=1e-5)
