"""Row-wise int8 tables (`dlrm.model.quantization`) and the SavedModel that serves
them (`export_saved_model(..., quantize="int8")`): the quantizer's error bound, the
lookups' pooling, and the serving function against the float32 export's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from dlrm.app import config as app_config
from dlrm.app.config import ConfigError, RunConfig
from dlrm.embedding.base import assign_rows
from dlrm.model.config import ModelConfig
from dlrm.model.dlrm import Dlrm
from dlrm.model.export import QUANTIZATIONS, export_saved_model
from dlrm.model.quantization import (
    INT8_LEVELS,
    QuantizedTable,
    dequantize_rows,
    quantize_rows,
    quantized_bytes,
)

FLOAT32_MAX = float(np.finfo(np.float32).max)


def round_trip_error_bound(values: np.ndarray, scale_offset: np.ndarray) -> np.ndarray:
    """Half a step of each row, plus float32 rounding: the dequantization's multiply
    and add, and the rounding of the offset, each half an ulp of the row's largest
    magnitude."""
    magnitude = np.abs(values.astype(np.float64)).max(axis=1, keepdims=True)
    return scale_offset[:, :1].astype(np.float64) / 2 + 4 * np.finfo(np.float32).eps * magnitude


def assert_round_trip_within_half_a_step(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, np.float32)
    quantized, scale_offset = quantize_rows(values)
    restored = dequantize_rows(quantized, scale_offset)
    error = np.abs(values.astype(np.float64) - restored)
    bound = round_trip_error_bound(values, scale_offset)
    assert (error <= bound).all(), float((error - bound).max())
    return restored


def test_rows_round_trip_within_half_a_step() -> None:
    rng = np.random.default_rng(7)
    rows = np.concatenate(
        [
            rng.normal(0, 1, (23, 11)),
            rng.uniform(-0.01, 0.01, (23, 11)),  # an embedding table's initial scale
            rng.normal(5, 1e-3, (23, 11)),  # far from zero, narrow
            rng.standard_cauchy((23, 11)),  # heavy tails: outliers set the step
        ]
    ).astype(np.float32)
    quantized, scale_offset = quantize_rows(rows)
    assert quantized.dtype == np.int8 and quantized.shape == rows.shape
    assert scale_offset.dtype == np.float32 and scale_offset.shape == (len(rows), 2)
    # Every row uses the whole int8 range: its minimum is -128, its maximum 127.
    assert (quantized.min(axis=1) == -128).all() and (quantized.max(axis=1) == 127).all()
    span = rows.max(axis=1).astype(np.float64) - rows.min(axis=1)
    np.testing.assert_allclose(scale_offset[:, 0], span / INT8_LEVELS, rtol=1e-6)
    assert_round_trip_within_half_a_step(rows)


def test_constant_and_zero_rows_are_exact() -> None:
    rows = np.array([[0.0] * 7, [0.25] * 7, [-3.5e7] * 7, [1e-38] * 7], np.float32)
    quantized, scale_offset = quantize_rows(rows)
    assert (scale_offset[:, 0] == 0).all() and not np.isnan(scale_offset).any()
    assert (quantized == quantized[:, :1]).all()
    np.testing.assert_array_equal(dequantize_rows(quantized, scale_offset), rows)


def test_extreme_values_round_trip() -> None:
    near_max = 0.99 * FLOAT32_MAX
    rows = np.array(
        [
            [near_max, -near_max, 0.0, 1.0, near_max / 3],  # almost all of float32's range
            [1e38, 3e38, 2e38, 1e38, 3e38],
            [1e-30, 1.0, 1e-30, 0.5, 1e-45],  # tiny next to one, a subnormal
            [1e-30, 2e-30, 3e-30, 1e-45, 0.0],  # all tiny
            [0.0, 0.0, 0.0, 0.0, 1e6],  # one outlier
        ],
        np.float32,
    )
    restored = assert_round_trip_within_half_a_step(rows)
    assert np.isfinite(restored).all()
    # Each row's extremes come back as themselves (up to float32 rounding).
    np.testing.assert_allclose(restored.max(axis=1), rows.max(axis=1), rtol=1e-6)
    np.testing.assert_allclose(restored.min(axis=1), rows.min(axis=1), rtol=1e-6, atol=1e-36)


def test_values_the_int8_form_cannot_hold_are_refused() -> None:
    with pytest.raises(ValueError, match="row 1 holds a value that is not finite"):
        quantize_rows(np.array([[1.0, 2.0], [np.nan, 0.0]], np.float32))
    with pytest.raises(ValueError, match="row 0 spans"):
        quantize_rows(np.array([[FLOAT32_MAX, -FLOAT32_MAX]], np.float32))


def quantized_table(values: np.ndarray) -> QuantizedTable:
    table = tf.Variable(values)
    return QuantizedTable.from_variable(table)


def test_lookups_dequantize_each_row_before_pooling() -> None:
    rng = np.random.default_rng(3)
    values = rng.normal(0, 1, (23, 7)).astype(np.float32)
    table = quantized_table(values)
    assert table.values.dtype == tf.int8 and table.nbytes == quantized_bytes(23, 7) == 23 * 15
    dequantized = dequantize_rows(*quantize_rows(values))
    ids = rng.integers(0, 23, (5, 3))
    np.testing.assert_allclose(table.gather(ids).numpy(), dequantized[ids], rtol=1e-6)
    np.testing.assert_allclose(table.pooled_lookup(ids[:, 0]).numpy(), dequantized[ids[:, 0]])
    fixed_sum = dequantized[ids].sum(axis=1)
    np.testing.assert_allclose(table.pooled_lookup(ids, "sum").numpy(), fixed_sum, rtol=1e-5)
    np.testing.assert_allclose(
        table.pooled_lookup(ids, "mean").numpy(), fixed_sum / 3, rtol=1e-5, atol=1e-6
    )
    ragged = tf.RaggedTensor.from_row_lengths([4, 4, 9, 22, 0], [2, 0, 3])
    expected = np.stack([dequantized[[4, 4]].mean(0), np.zeros(7), dequantized[[9, 22, 0]].mean(0)])
    np.testing.assert_allclose(
        table.pooled_lookup(ragged, "mean").numpy(), expected, rtol=1e-5, atol=1e-6
    )


def test_tables_are_quantized_in_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dlrm.model.quantization.ROW_BLOCK_BYTES", 16 * 7 * 5)  # 5 rows a block
    values = np.random.default_rng(1).normal(0, 1, (23, 7)).astype(np.float32)
    table = quantized_table(values)
    quantized, scale_offset = quantize_rows(values)
    np.testing.assert_array_equal(table.values.numpy(), quantized)
    np.testing.assert_array_equal(table.scale_offset.numpy(), scale_offset)


# ------------------------------------------------------------- the SavedModel

ONE_HOT = ModelConfig(
    num_numerical=3, cardinalities=(23, 7, 130), hotness=(1, 1, 1), embedding_dim=11,
    bottom_mlp_dims=(13, 11), top_mlp_dims=(9, 1),
)  # fmt: skip
# Fixed and variable hotness, sum and mean pooling, a width per table.
MULTI_HOT = ModelConfig(
    num_numerical=3, cardinalities=(23, 7, 130), hotness=(1, 3, 0), embedding_dim=(7, 11, 5),
    bottom_mlp_dims=(13, 5), top_mlp_dims=(9, 1), interaction="cross", num_cross_layers=1,
    cross_layer_projection_dim=2, pooling=("sum", "mean", "mean"),
)  # fmt: skip


def trained_like(config: ModelConfig) -> Dlrm:
    """A model whose tables have a trained table's spread (the initial ones are
    within +-sqrt(1 / rows)), so that the scores vary and quantizing matters."""
    keras.utils.set_random_seed(5)  # the dense weights, whatever ran before
    model = Dlrm(config, seed=5)
    model.build_all()
    rng = np.random.default_rng(11)
    for table in model.embeddings.tables:
        assign_rows(table, 0, rng.normal(0, 0.5, table.shape).astype(np.float32))
    return model


def random_inputs(config: ModelConfig, batch: int, seed: int) -> dict[str, tf.Tensor]:
    rng = np.random.default_rng(seed)
    columns = [
        rng.integers(0, rows, (batch, hot))
        for rows, hot in zip(config.cardinalities, config.hotness, strict=True)
        if hot
    ]
    inputs = {
        "numerical": tf.constant(rng.normal(0, 1, (batch, config.num_numerical)), tf.float32),
        "categorical": tf.constant(np.concatenate(columns, axis=1), tf.int32),
    }
    if 0 in config.hotness:
        rows = config.cardinalities[config.hotness.index(0)]
        lengths = rng.integers(0, 5, (batch, 1))
        inputs["multi_hot_lengths"] = tf.constant(lengths, tf.int64)
        inputs["multi_hot_values"] = tf.constant(rng.integers(0, rows, lengths.sum()), tf.int32)
    return inputs


def served(path: Path, inputs: dict[str, tf.Tensor]) -> np.ndarray:
    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    return np.asarray(serve(**inputs)["probability"].numpy())


def signature_of(path: Path) -> tuple[Any, Any]:
    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    return serve.structured_input_signature, serve.structured_outputs


@pytest.mark.parametrize("config", [ONE_HOT, MULTI_HOT], ids=["one_hot", "multi_hot"])
def test_int8_export_serves_like_the_float32_export(config: ModelConfig, tmp_path: Path) -> None:
    model = trained_like(config)
    float32 = export_saved_model(model, tmp_path / "float32")
    int8 = export_saved_model(model, tmp_path / "int8", quantize="int8")
    assert signature_of(int8.path) == signature_of(float32.path)

    inputs = random_inputs(config, batch=257, seed=2)
    float32_scores, int8_scores = served(float32.path, inputs), served(int8.path, inputs)
    assert float(float32_scores.std()) > 0.02  # scores that differ, not a constant
    np.testing.assert_allclose(int8_scores, float32_scores, atol=0.01)
    assert np.abs(int8_scores - float32_scores).mean() < 0.002

    # Exactly the float32 model on the dequantized tables: each row dequantized,
    # then pooled as the model pools.
    for table in model.embeddings.tables:
        assign_rows(table, 0, dequantize_rows(*quantize_rows(table.numpy())))
    logits = model(inputs["numerical"], _model_ids(config, inputs)).numpy()
    np.testing.assert_allclose(int8_scores, 1 / (1 + np.exp(-logits)), rtol=1e-5, atol=1e-6)


def _model_ids(config: ModelConfig, inputs: dict[str, tf.Tensor]) -> Any:
    """The serving inputs as the model takes ids."""
    if all(h == 1 for h in config.hotness):
        return inputs["categorical"]
    columns = iter(tf.split(inputs["categorical"], [h for h in config.hotness if h], axis=1))
    lengths = inputs["multi_hot_lengths"][:, 0]
    ragged = tf.RaggedTensor.from_row_lengths(inputs["multi_hot_values"], lengths)
    return tuple(ragged if h == 0 else next(columns) for h in config.hotness)


def test_int8_export_holds_int8_tables_and_says_how_many_bytes(tmp_path: Path) -> None:
    model = trained_like(ONE_HOT)
    exported = export_saved_model(model, tmp_path / "int8", quantize="int8")
    rows, dim = sum(ONE_HOT.cardinalities), 11
    assert exported.tables == 3
    assert exported.float32_table_bytes == 4 * rows * dim
    assert exported.table_bytes == rows * (dim + 8)
    assert exported.describe() == "int8 tables: 3 tables, 7.04 kB -> 3.04 kB (43 %)"
    reader = tf.train.load_checkpoint(str(tmp_path / "int8" / "variables" / "variables"))
    dtypes = reader.get_variable_to_dtype_map()
    table_dtypes = {dtypes[name] for name in dtypes if name.startswith("tables/")}
    assert table_dtypes == {tf.int8, tf.float32}  # values; scales and offsets
    float32_tables = [
        name
        for name, shape in reader.get_variable_to_shape_map().items()
        if dtypes[name] == tf.float32 and shape[1:] == [dim] and shape[0] in ONE_HOT.cardinalities
    ]
    assert float32_tables == []  # the float32 tables are not kept beside them


def test_export_refuses_an_unknown_quantization(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantize: expected one of none, int8, got 'int4'"):
        export_saved_model(trained_like(ONE_HOT), tmp_path / "model", quantize="int4")


# ------------------------------------------------------------------ the flag


def test_quantize_is_a_flag_of_export_only() -> None:
    assert app_config.QUANTIZATIONS == QUANTIZATIONS  # the TensorFlow-free copy
    export = {"restore_checkpoint_path": "ckpt", "saved_model_output_path": "out"}
    assert RunConfig(mode="export", quantize="int8", **export).quantize == "int8"
    with pytest.raises(ConfigError, match=r"--quantize int8: only with --mode export"):
        RunConfig(mode="train", dataset_path="data", quantize="int8")
    with pytest.raises(ConfigError, match=r"--quantize: expected one of none, int8, got 'int4'"):
        RunConfig(mode="export", quantize="int4", **export)
