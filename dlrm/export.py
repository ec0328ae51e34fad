"""Export to a TensorFlow SavedModel for serving.

The serving signature takes `numerical` float32 [B, n_numerical] and
`categorical` [B, sum of hotness] (int32, or int64 when a table has more than
2^31 rows: `serving_id_dtype`) (each table's ids side by side, in the
FeatureSpec's categorical order; one column per table when all are one-hot) and
returns `probability` float32 [B, 1]. The exported model computes in float32
and needs nothing from this project to load: `tf.saved_model.load(path)`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from dlrm.model import Dlrm
from feature_spec.staged import staged_directory


def serving_id_dtype(cardinalities: tuple[int, ...]) -> tf.DType:
    """int32 ids while every table's ids fit them, else int64."""
    return tf.int64 if max(cardinalities, default=1) > 2**31 else tf.int32


class _ServingModule(tf.Module):
    def __init__(self, model: Dlrm) -> None:
        super().__init__(name="dlrm_serving")
        # Track the weights, not the Keras model: SavedModel would try to trace
        # the Keras model's own call signatures, which take two inputs.
        self.weights = [getattr(v, "value", v) for v in model.variables]
        config = model.config
        hotness = tuple(config.hotness)

        def serve(numerical: tf.Tensor, categorical: tf.Tensor) -> dict[str, tf.Tensor]:
            ids: Any
            if all(h == 1 for h in hotness):
                ids = categorical
            else:
                ids = tuple(tf.split(categorical, list(hotness), axis=1))
            return {"probability": tf.sigmoid(model(numerical, ids))}

        self.serve = tf.function(
            serve,
            input_signature=[
                tf.TensorSpec([None, config.num_numerical], tf.float32, name="numerical"),
                tf.TensorSpec(
                    [None, int(sum(config.hotness))],
                    serving_id_dtype(tuple(config.cardinalities)),
                    name="categorical",
                ),
            ],
        )


def split_categorical(categorical: Any, hotness: tuple[int, ...]) -> np.ndarray:
    """Loader-format ids ([B, T] or a tuple of [B, h]) -> the signature's [B, sum h]."""
    if isinstance(categorical, (tuple, list)):
        return np.concatenate([np.asarray(c) for c in categorical], axis=1).astype(np.int32)
    return np.asarray(categorical, np.int32)


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
