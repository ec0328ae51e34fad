"""Every embedding table on this process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from dlrm.embedding.initializer import initial_table_values


class TableShardVariable(NamedTuple):
    """Rows [r0, r1) x columns [c0, c1) of table `table` (whole shape `shape`),
    held in `variable` [r1 - r0, c1 - c0]. `replicated`: every rank holds the same
    copy (a data-parallel table); one rank writes it to checkpoints."""

    table: int
    shape: tuple[int, int]
    rows: tuple[int, int]
    columns: tuple[int, int]
    variable: Any
    replicated: bool = False


class LocalEmbeddings(keras.layers.Layer):
    """One float32 variable [rows, D] per table, on this process.

    Initialised by `initial_table_values` (uniform in +-sqrt(1 / rows), as the
    reference DLRM). Multi-hot rows are pooled by sum.

    Call with ids [B, T] int32 (all one-hot) or a sequence of T tensors
    [B, hotness_t]; returns [B, T, D] float32. Gradients with respect to the
    tables are `tf.IndexedSlices` (rows looked up), which the optimizers apply
    sparsely.
    """

    def __init__(
        self, cardinalities: Sequence[int], dim: int, seed: int = 0, **kwargs: Any
    ) -> None:
        kwargs.setdefault("name", "embeddings")
        super().__init__(dtype="float32", **kwargs)
        self.cardinalities = tuple(int(c) for c in cardinalities)
        self.dim = dim
        self.seed = seed
        self.tables = []
        for index, rows in enumerate(self.cardinalities):
            self.tables.append(
                self.add_weight(
                    shape=(rows, dim),
                    initializer=self._initializer(index),
                    name=f"table_{index}",
                    dtype="float32",
                )
            )

    def _initializer(self, index: int) -> Any:
        rows, dim, seed = self.cardinalities[index], self.dim, self.seed

        def initialize(shape: Any, dtype: Any = None) -> np.ndarray:
            return initial_table_values(index, rows, dim, seed)

        return initialize

    @property
    def replicated_variables(self) -> list[Any]:
        """Variables whose gradients are allreduced across ranks: none here."""
        return []

    def call(self, ids: Any) -> tf.Tensor:
        if isinstance(ids, (tuple, list)):
            vectors = [
                tf.reduce_sum(tf.gather(table, table_ids), axis=1)
                for table, table_ids in zip(self.tables, ids, strict=True)
            ]
        else:
            vectors = [tf.gather(table, ids[:, t]) for t, table in enumerate(self.tables)]
        return tf.stack(vectors, axis=1)

    # ------------------------------------------------------------ checkpoints

    def local_shards(self) -> list[TableShardVariable]:
        """The table slices this process holds, each with its variable: here,
        every whole table."""
        return [
            TableShardVariable(t, (rows, self.dim), (0, rows), (0, self.dim), variable)
            for t, (rows, variable) in enumerate(zip(self.cardinalities, self.tables, strict=True))
        ]
