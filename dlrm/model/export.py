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
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from dataloading.files import RaggedIds
from dlrm.model.dlrm import Dlrm
from dlrm.variables import resource_variable
from feature_spec import ids_dtype, minimal_categorical_dtype
from feature_spec.staged import staged_directory


def serving_id_dtype(cardinalities: tuple[int, ...]) -> tf.DType:
    """The loader's rule (`feature_spec.ids_dtype`) for tables stored as their
    cardinalities need: int32 ids while every table's fit them, else int64."""
    return tf.as_dtype(ids_dtype(minimal_categorical_dtype(c) for c in cardinalities))


class _ServingModule(tf.Module):
    def __init__(self, model: Dlrm) -> None:
        super().__init__(name="dlrm_serving")
        # Track the weights, not the Keras model: SavedModel would try to trace
        # the Keras model's own call signatures, which take two inputs.
        self.weights = [resource_variable(v) for v in model.variables]
        config = model.config
        hotness = tuple(config.hotness)
        fixed = [h for h in hotness if h]
        variable = hotness.count(0)
        id_dtype = serving_id_dtype(tuple(config.cardinalities))

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
                return {"probability": tf.sigmoid(model(numerical, ids))}

            self.serve = tf.function(serve_variable, input_signature=signature, autograph=False)
        else:

            def serve(numerical: tf.Tensor, categorical: tf.Tensor) -> dict[str, tf.Tensor]:
                ids = model_ids(categorical, None, None)
                return {"probability": tf.sigmoid(model(numerical, ids))}

            self.serve = tf.function(serve, input_signature=signature, autograph=False)


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


def export_saved_model(model: Dlrm, output: str | os.PathLike[str]) -> Path:
    """Writes `model` as a SavedModel to directory `output`, replacing one there.

    Atomic: the SavedModel is built in `.<name>.partial` beside `output` and
    renamed into place; a failed export leaves `output` as it was.

    Raises:
        FileExistsError: `output` exists and is not a directory.
    """
    module = _ServingModule(model)
    signatures = {"serving_default": module.serve.get_concrete_function()}
    with staged_directory(output, overwrite=True) as staging:
        tf.saved_model.save(module, str(staging), signatures=signatures)
    return Path(output)
