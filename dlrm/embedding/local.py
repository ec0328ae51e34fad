"""Every embedding table on this process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from dlrm.embedding.base import Embeddings, fused_lookup, fused_sgd, gather_rows, pooled_lookup
from dlrm.embedding.shard import ShardingKind, TableShard


class LocalEmbeddings(Embeddings):
    """One float32 variable [rows_t, D_t] per table, on this process.

    Initialised by `initial_table_values` (uniform in +-sqrt(1 / rows), as the
    reference DLRM). Multi-hot rows are pooled by sum or mean (`pooling`, per
    table).

    Call with ids [B, T] int32 (all one-hot) or a sequence of T tensors
    [B, hotness_t] or `tf.RaggedTensor` [B, None] (variable length); returns
    [B, sum of D_t] in `output_dtype`, the tables' vectors side by side. `dims` is one
    width for every table or one per table. Gradients with respect to the
    tables are `tf.IndexedSlices` (rows looked up), which the optimizers apply
    sparsely.

    `use_kernels`: one-hot ids [B, T] are looked up by one op of the project's
    CPU kernels (`fused_lookup`), which writes the vectors side by side with no
    concatenation, and the trainer's SGD updates the tables from the vectors'
    gradient without splitting it (`apply_fused_sgd`). The caller checks that
    the kernels are built and that the model runs on CPUs.
    """

    def __init__(
        self,
        cardinalities: Sequence[int],
        dims: int | Sequence[int],
        seed: int = 0,
        hotness: Sequence[int] | None = None,
        pooling: Sequence[str] | None = None,
        output_dtype: Any = tf.float32,
        use_kernels: bool = False,
        **kwargs: Any,
    ) -> None:
        tables = len(cardinalities)
        widths = [dims] * tables if isinstance(dims, int) else list(dims)
        super().__init__(
            cardinalities,
            widths,
            hotness or [1] * tables,
            seed=seed,
            pooling=pooling,
            output_dtype=output_dtype,
            **kwargs,
        )
        self.shards = [
            TableShard(t, ShardingKind.TABLE_WISE, 0, (0, rows), (0, self.dims[t]))
            for t, rows in enumerate(self.cardinalities)
        ]
        self.tables = [self.create_shard_variable(shard) for shard in self.shards]
        self.use_kernels = use_kernels

    def local_shards(self) -> list[tuple[TableShard, Any]]:
        return list(zip(self.shards, self.tables, strict=True))

    # One process: ids are already here and the vectors stay here.

    def input_distribution(self, ids: Any, local_rows: Any) -> Any:
        return ids

    def local_lookup(self, routed: Any, local_rows: Any) -> tf.Tensor:
        fused = self.fused_ids(routed)
        if fused is not None:
            return fused_lookup(self.tables, fused, self.output_dtype)
        if isinstance(routed, (tuple, list)):
            vectors = [
                pooled_lookup(table, table_ids, pooling)
                for table, table_ids, pooling in zip(self.tables, routed, self.pooling, strict=True)
            ]
        else:
            vectors = [gather_rows(table, routed[:, t]) for t, table in enumerate(self.tables)]
        return tf.concat([tf.cast(v, self.output_dtype) for v in vectors], axis=1)

    def fused_ids(self, ids: Any) -> tf.Tensor | None:
        if not self.use_kernels or isinstance(ids, (tuple, list)):
            return None
        return ids

    def apply_fused_sgd(self, ids: tf.Tensor, gradient: tf.Tensor, learning_rate: Any) -> None:
        fused_sgd(self.tables, ids, gradient, learning_rate)

    def output_distribution(self, looked_up: Any, local_rows: Any, chunk: int = 0) -> tf.Tensor:
        return looked_up

    def output_distribution_gradient(
        self, gradient: tf.Tensor, local_rows: Any, chunk: int = 0
    ) -> Any:
        return gradient
