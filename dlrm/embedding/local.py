"""Every embedding table on this process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from dlrm.embedding.base import (
    ChunkLookup,
    EmbeddingGradients,
    EmbeddingLookup,
    Embeddings,
    Span,
    fused_lookup,
    gather_rows,
    pooled_lookup,
    rows_of,
)
from dlrm.embedding.shard import ShardingKind, TableShard
from dlrm.embedding.update import pooled_piece


class LocalEmbeddings(Embeddings):
    """One variable [rows_t, D_t] per table (`table_dtype`), on this process.

    Initialised by `initial_table_values` (uniform in +-sqrt(1 / rows), as the
    reference DLRM). Multi-hot rows are pooled by sum or mean (`pooling`, per
    table).

    Call with ids [B, T] int32 (all one-hot) or a sequence of T tensors
    [B, hotness_t] or `tf.RaggedTensor` [B, None] (variable length); returns
    [B, sum of D_t] in `output_dtype`, the tables' vectors side by side. `dims` is one
    width for every table or one per table.

    `use_kernels`: one-hot ids [B, T] are looked up by one op of the project's
    CPU kernels (`fused_lookup`), which writes the vectors side by side with no
    concatenation, and the tables are updated from the vectors' gradient as it
    is, never split per table (`apply_gradients`).
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
            use_kernels=use_kernels,
            **kwargs,
        )
        self.shards = [
            TableShard(t, ShardingKind.TABLE_WISE, 0, (0, rows), (0, self.dims[t]))
            for t, rows in enumerate(self.cardinalities)
        ]
        self.tables = [self.create_shard_variable(shard) for shard in self.shards]

    def local_shards(self) -> list[tuple[TableShard, Any]]:
        return list(zip(self.shards, self.tables, strict=True))

    # One process: ids are already here and the vectors stay here.

    def forward(
        self, ids: Any, local_rows: Any, spans: Sequence[Span], exchanged: Any = None
    ) -> EmbeddingLookup:
        if exchanged is not None:
            raise ValueError("forward: one process exchanges no ids")
        chunks = []
        for start, stop in spans:
            chunk_ids = ids if len(spans) == 1 else rows_of(ids, start, stop)
            chunks.append(ChunkLookup(self._lookup(chunk_ids), chunk_ids))
        return EmbeddingLookup(chunks)

    def _lookup(self, ids: Any) -> tf.Tensor:
        if self.use_kernels and not isinstance(ids, (tuple, list)):
            return fused_lookup(self.tables, ids, self.output_dtype)
        if isinstance(ids, (tuple, list)):
            vectors = [
                pooled_lookup(table, table_ids, pooling)
                for table, table_ids, pooling in zip(self.tables, ids, self.pooling, strict=True)
            ]
        else:
            vectors = [gather_rows(table, ids[:, t]) for t, table in enumerate(self.tables)]
        return tf.concat([tf.cast(v, self.output_dtype) for v in vectors], axis=1)

    def backward(
        self, lookup: EmbeddingLookup, vector_gradients: Sequence[tf.Tensor]
    ) -> EmbeddingGradients:
        """Each table's piece of each chunk's gradient, as it is: the vectors
        were looked up here."""
        tables = range(len(self.tables))
        pieces = [
            pooled_piece(t, ids, gradient, self.offsets[t], self.pooling[t])
            for chunk, gradient in zip(lookup.chunks, vector_gradients, strict=True)
            for t, ids in self.ids_by_table(chunk.ids, tables).items()
        ]
        return EmbeddingGradients(pieces, tf.constant(True))
