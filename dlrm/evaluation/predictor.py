"""Batched prediction: click probabilities from a model, no optimizer needed."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from dlrm.model.dlrm import Dlrm
from dlrm.model.row_chunks import chunk_bounds, concat_rows, in_sequence


class Predictor:
    """Click probabilities of `model`, the dense part compiled with XLA when
    `use_xla`, over chunks of `dense_chunk_rows` rows one after another (0: the
    whole batch at once; `dlrm.model.row_chunks`). Under several ranks every rank
    must call `predict` for each batch (the sharded lookup has collectives)."""

    def __init__(self, model: Dlrm, use_xla: bool = False, dense_chunk_rows: int = 0) -> None:
        self.model = model
        self.dense_chunk_rows = dense_chunk_rows
        model.build_all()
        self._dense = tf.function(self._dense_eager, jit_compile=use_xla, autograph=False)
        self._predict = tf.function(self._predict_eager, autograph=False)

    def _dense_eager(self, numerical: tf.Tensor, vectors: tf.Tensor) -> tf.Tensor:
        return tf.sigmoid(self.model.dense_forward(numerical, vectors))

    def _predict_eager(self, numerical: tf.Tensor, categorical: Any) -> tf.Tensor:
        vectors = self.model.embeddings(categorical, tf.shape(numerical)[0])
        bounds = chunk_bounds(numerical.shape[0], self.dense_chunk_rows)
        chunks = in_sequence(bounds, [numerical, vectors], lambda *chunk: [self._dense(*chunk)])
        return concat_rows([chunk[0] for chunk in chunks])

    def predict(self, numerical: tf.Tensor, categorical: Any) -> tf.Tensor:
        """Click probabilities [B, 1] float32 for the local rows."""
        return self._predict(numerical, categorical)
