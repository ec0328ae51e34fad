"""Export to a TensorFlow SavedModel for serving.

The serving signature takes `numerical` float32 [B, n_numerical] and
`categorical` [B, sum of hotness] (int32, or int64 when a table has more than
2^31 rows: `serving_id_dtype`) (each table's ids side by side, in the
FeatureSpec's categorical order; one column per table when all are one-hot) and
returns `probability` float32 [B, 1]. A model with variable-length tables takes
their ids apart from `categorical` (which then holds only the fixed-hotness
tables' ids): `multi_hot_lengths` int64 [B, V], each row's number of ids per
variable-length table (in categorical order), and `multi_hot_values` [n], the
ids table after table, each table's rows in order. The exported model computes
in float32 and needs nothing from this project to load: `tf.saved_model.load(path)`.

Its tables are float32 as trained, or with `quantize="int8"` row-wise int8 with a
scale and offset per row (`dlrm.model.quantization`), dequantized by the serving
function with TensorFlow's own ops before pooling: about a quarter of the bytes,
the same signature.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from dataloading.files import RaggedIds
from dlrm.model.dlrm import Dlrm
from dlrm.model.quantization import QuantizedTable, quantized_bytes
from dlrm.variables import resource_variable
from feature_spec import ids_dtype, minimal_categorical_dtype
from feature_spec.staged import staged_directory


def serving_id_dtype(cardinalities: tuple[int, ...]) -> tf.DType:
    """The loader's rule (`feature_spec.ids_dtype`) for tables stored as their
    cardinalities need: int32 ids while every table's fit them, else int64."""
    return tf.as_dtype(ids_dtype(minimal_categorical_dtype(c) for c in cardinalities))


QUANTIZATIONS = ("none", "int8")


@dataclasses.dataclass(frozen=True)
class ExportedModel:
    """What `export_saved_model` wrote: where, and the bytes of its tables.

    Attributes:
        path: the SavedModel directory.
        quantize: "none" (float32 tables) or "int8" (`dlrm.model.quantization`).
        tables: the number of embedding tables.
        float32_table_bytes: the tables' bytes as float32, as trained.
        table_bytes: the tables' bytes in the SavedModel.
    """

    path: Path
    quantize: str
    tables: int
    float32_table_bytes: int
    table_bytes: int

    def describe(self) -> str:
        """One line for the user, e.g. "int8 tables: 26 tables, 1.33 GB -> 354 MB (27 %)"."""
        before = _format_bytes(self.float32_table_bytes)
        if self.quantize == "none":
            return f"float32 tables: {self.tables} tables, {before}"
        percent = 100 * self.table_bytes / max(self.float32_table_bytes, 1)
        return (
            f"{self.quantize} tables: {self.tables} tables, {before} -> "
            f"{_format_bytes(self.table_bytes)} ({percent:.0f} %)"
        )


def _format_bytes(count: int) -> str:
    """Bytes in decimal units, three significant digits: 981 B, 45.6 kB, 1.33 GB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count} B"


class _ServingModule(tf.Module):
    """The SavedModel's root: the dense weights, the tables (float32 variables, or
    `QuantizedTable`s) and `serve`, the serving signature's function."""

    def __init__(self, model: Dlrm, quantize: str) -> None:
        super().__init__(name="dlrm_serving")
        # Track the weights, not the Keras model: SavedModel would try to trace
        # the Keras model's own call signatures, which take two inputs.
        float_tables = [resource_variable(t) for t in model.embeddings.tables]
        table_ids = {id(t) for t in float_tables}
        self.dense_weights = [
            v for v in map(resource_variable, model.variables) if id(v) not in table_ids
        ]
        config = model.config
        hotness = tuple(config.hotness)
        fixed = [h for h in hotness if h]
        variable = hotness.count(0)
        id_dtype = serving_id_dtype(tuple(config.cardinalities))
        self.tables: list[Any]
        if quantize == "int8":
            self.tables = [
                QuantizedTable.from_variable(t, name=f"table_{i}")
                for i, t in enumerate(float_tables)
            ]
            logits = _quantized_logits(model, self.tables)
        else:
            self.tables = float_tables
            logits = _float32_logits(model)

        def model_ids(categorical: tf.Tensor, values: Any, lengths: Any) -> Any:
            if all(h == 1 for h in hotness):
                return categorical
            columns = iter(tf.split(categorical, fixed, axis=1) if fixed else [])
            if variable:
                totals = tf.reduce_sum(lengths, axis=0)
                parts = iter(tf.split(values, totals, num=variable))
                ragged = iter(
                    tf.RaggedTensor.from_row_lengths(next(parts), lengths[:, k])
                    for k in range(variable)
                )
            return tuple(next(ragged) if h == 0 else next(columns) for h in hotness)

        signature = [
            tf.TensorSpec([None, config.num_numerical], tf.float32, name="numerical"),
            tf.TensorSpec([None, int(sum(hotness))], id_dtype, name="categorical"),
        ]
        if variable:
            signature += [
                tf.TensorSpec([None], id_dtype, name="multi_hot_values"),
                tf.TensorSpec([None, variable], tf.int64, name="multi_hot_lengths"),
            ]

            def serve_variable(
                numerical: tf.Tensor,
                categorical: tf.Tensor,
                multi_hot_values: tf.Tensor,
                multi_hot_lengths: tf.Tensor,
            ) -> dict[str, tf.Tensor]:
                ids = model_ids(categorical, multi_hot_values, multi_hot_lengths)
                return {"probability": tf.sigmoid(logits(numerical, ids))}

            self.serve = tf.function(serve_variable, input_signature=signature, autograph=False)
        else:

            def serve(numerical: tf.Tensor, categorical: tf.Tensor) -> dict[str, tf.Tensor]:
                ids = model_ids(categorical, None, None)
                return {"probability": tf.sigmoid(logits(numerical, ids))}

            self.serve = tf.function(serve, input_signature=signature, autograph=False)


Logits = Callable[[tf.Tensor, Any], tf.Tensor]


def _float32_logits(model: Dlrm) -> Logits:
    """The model as trained: its own lookups of the float32 tables."""
    return lambda numerical, ids: model(numerical, ids)


def _quantized_logits(model: Dlrm, tables: list[QuantizedTable]) -> Logits:
    """The model's dense part on vectors looked up in `tables`: each table's
    rows dequantized, then pooled as the model pools them."""
    poolings = model.config.poolings

    def logits(numerical: tf.Tensor, ids: Any) -> tf.Tensor:
        by_table = ids if isinstance(ids, tuple) else tf.unstack(ids, len(tables), axis=1)
        vectors = [
            table.pooled_lookup(table_ids, pooling)
            for table, table_ids, pooling in zip(tables, by_table, poolings, strict=True)
        ]
        return model.dense_forward(numerical, tf.concat(vectors, axis=1))

    return logits


def serving_inputs(categorical: Any, cardinalities: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Loader-format ids (`SplitBinaryDataset.read_batch`: [B, T], or a tuple of
    [B, h] and `RaggedIds`) -> the signature's id inputs."""
    dtype = serving_id_dtype(cardinalities).as_numpy_dtype
    if not isinstance(categorical, (tuple, list)):
        return {"categorical": np.asarray(categorical, dtype)}
    fixed = [np.asarray(c) for c in categorical if not isinstance(c, RaggedIds)]
    ragged = [c for c in categorical if isinstance(c, RaggedIds)]
    rows = len(ragged[0].row_lengths) if ragged else len(fixed[0])
    out = {
        "categorical": (np.concatenate(fixed, axis=1) if fixed else np.zeros((rows, 0))).astype(
            dtype
        )
    }
    if ragged:
        out["multi_hot_values"] = np.concatenate([c.values for c in ragged]).astype(dtype)
        out["multi_hot_lengths"] = np.stack([c.row_lengths for c in ragged], 1).astype(np.int64)
    return out


def export_saved_model(
    model: Dlrm, output: str | os.PathLike[str], quantize: str = "none"
) -> ExportedModel:
    """Writes `model` as a SavedModel to directory `output`, replacing one there.

    Args:
        model: a float32 model with `LocalEmbeddings` (every table here).
        output: the SavedModel directory.
        quantize: "none": the tables as trained, float32; "int8": each table
            row-wise int8 (`dlrm.model.quantization`), dequantized inside the
            serving function. The signature is the same either way.

    Atomic: the SavedModel is built in `.<name>.partial` beside `output` and
    renamed into place; a failed export leaves `output` as it was.

    Raises:
        ValueError: `quantize` is not one of `QUANTIZATIONS`.
        FileExistsError: `output` exists and is not a directory.
    """
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize: expected one of {', '.join(QUANTIZATIONS)}, got {quantize!r}")
    module = _ServingModule(model, quantize)
    signatures = {"serving_default": module.serve.get_concrete_function()}
    with staged_directory(output, overwrite=True) as staging:
        tf.saved_model.save(module, str(staging), signatures=signatures)
    shapes = [(int(rows), int(dim)) for rows, dim in (t.shape for t in model.embeddings.tables)]
    float32_bytes = sum(4 * rows * dim for rows, dim in shapes)
    return ExportedModel(
        path=Path(output),
        quantize=quantize,
        tables=len(shapes),
        float32_table_bytes=float32_bytes,
        table_bytes=(
            sum(quantized_bytes(rows, dim) for rows, dim in shapes)
            if quantize == "int8"
            else float32_bytes
        ),
    )
