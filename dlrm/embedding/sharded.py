"""Embedding tables sharded across ranks, executing a sharding plan.

Each rank holds some shards: whole tables (`table_wise`), column slices
(`column_wise`), row ranges (`row_wise`), plus full copies of the small
`data_parallel` tables. A forward pass, for global batch G over W ranks
(local batch L = G / W):

1. every rank has the ids of the global batch for the tables it holds shards
   of (model-parallel input, read by the loader), or gets them from the other
   ranks by one alltoall of ids (data-parallel input);
2. it looks up each of its shards for all G rows: [G, columns of the shard]
   (a row-wise shard contributes zeros for ids outside its range);
3. one alltoall sends rows [j L, (j + 1) L) of all its shard outputs to rank j;
4. each rank assembles its L rows of every table: column slices concatenated,
   row-range partial sums added, data-parallel tables looked up locally.

The backward pass is the autodiff of the same alltoall (Horovod defines its
gradient), so each shard receives the gradient of the *global* loss with respect
to its rows. With the loss divided by the global batch size, that is exactly
the gradient a single process computes: model-parallel gradients need no
allreduce and no rescaling; data-parallel tables' gradients are allreduce-summed
like the MLPs'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from dlrm.dist import Collectives
from dlrm.embedding.initializer import initial_table_values
from dlrm.embedding.local import TableShardVariable
from dlrm.embedding.planner import ShardingPlan

DATA_PARALLEL = "data_parallel"
MODEL_PARALLEL_KINDS = ("table_wise", "column_wise", "row_wise")


@dataclasses.dataclass(frozen=True)
class ShardAssignment:
    """Rows [r0, r1) x columns [c0, c1) of `table`, held by `rank`."""

    table: int
    kind: str
    rank: int
    rows: tuple[int, int]
    columns: tuple[int, int]

    @property
    def width(self) -> int:
        return self.columns[1] - self.columns[0]


def assignments_from_plan(plan: ShardingPlan) -> list[ShardAssignment]:
    """Every shard of `plan` (data-parallel tables: one whole copy per rank)."""
    return [
        ShardAssignment(table.table, table.kind, shard.rank, shard.rows, shard.columns)
        for table in plan.tables
        for shard in table.shards
    ]


class ShardedEmbeddings(keras.layers.Layer):
    """The embeddings layer under horovodrun: same call as `LocalEmbeddings`.

    Args:
        assignments: every shard of every table on every rank (from the plan);
            a data-parallel table has one assignment per rank, each whole.
        cardinalities, hotness: per table, from the FeatureSpec.
        dim: embedding width.
        collectives: rank, world size and the alltoall.
        seed: initial values are `initial_table_values` slices, so N ranks
            start from the weights one process would.
        data_parallel_input: ids arrive for the local rows of all tables
            (True) or for the global batch of this rank's tables (False).

    Call with the ids the loader gives this rank: [B, n] int32 when every table
    read is one-hot, else a tuple of [B, hotness]; tables in `input_tables`
    order. Returns [L, T, D] float32 for the rank's local rows.
    """

    def __init__(
        self,
        assignments: Sequence[ShardAssignment],
        cardinalities: Sequence[int],
        hotness: Sequence[int],
        dim: int,
        collectives: Collectives,
        seed: int = 0,
        data_parallel_input: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("name", "embeddings")
        super().__init__(dtype="float32", **kwargs)
        self.cardinalities = tuple(int(c) for c in cardinalities)
        self.hotness = tuple(int(h) for h in hotness)
        self.dim = dim
        self.collectives = collectives
        self.rank = collectives.rank
        self.world_size = collectives.world_size
        self.data_parallel_input = data_parallel_input
        self.seed = seed
        self.assignments = tuple(
            sorted(assignments, key=lambda a: (a.rank, a.table, a.rows, a.columns))
        )
        self.replicated_tables = tuple(
            sorted({a.table for a in assignments if a.kind == DATA_PARALLEL})
        )
        # Model-parallel shards per rank, in the order their outputs are sent.
        self.sent = [
            [a for a in self.assignments if a.rank == r and a.kind != DATA_PARALLEL]
            for r in range(self.world_size)
        ]
        self.mine = self.sent[self.rank]
        self.model_parallel_tables = [sorted({a.table for a in shards}) for shards in self.sent]
        # Tables whose ids this rank reads (model-parallel input), in loader order.
        self.input_tables = tuple(
            range(len(self.cardinalities))
            if data_parallel_input
            else sorted(set(self.model_parallel_tables[self.rank]) | set(self.replicated_tables))
        )
        self.shard_variables = [self._variable(a, replicated=False) for a in self.mine]
        self.mine_variables = [shard.variable for shard in self.shard_variables]
        self.replicated: dict[int, Any] = {}
        for table in self.replicated_tables:
            whole = ShardAssignment(
                table, DATA_PARALLEL, self.rank, (0, self.cardinalities[table]), (0, dim)
            )
            shard = self._variable(whole, replicated=True)
            self.replicated[table] = shard.variable
            self.shard_variables.append(shard)

    def _variable(self, a: ShardAssignment, replicated: bool) -> TableShardVariable:
        rows, dim, seed = self.cardinalities[a.table], self.dim, self.seed

        def initialize(shape: Any, dtype: Any = None) -> Any:
            return initial_table_values(a.table, rows, dim, seed, a.rows, a.columns)

        variable = self.add_weight(
            shape=(a.rows[1] - a.rows[0], a.width),
            initializer=initialize,
            name=f"table_{a.table}_rows_{a.rows[0]}_{a.rows[1]}_cols_{a.columns[0]}_{a.columns[1]}",
            dtype="float32",
        )
        return TableShardVariable(a.table, (rows, dim), a.rows, a.columns, variable, replicated)

    # ------------------------------------------------------------------ views

    def local_shards(self) -> list[TableShardVariable]:
        """This rank's shards (and its copies of replicated tables), for checkpoints."""
        return list(self.shard_variables)

    @property
    def replicated_variables(self) -> list[Any]:
        """Variables whose gradients are allreduced (the data-parallel tables)."""
        return [self.replicated[t] for t in self.replicated_tables]

    # ---------------------------------------------------------------- forward

    def _ids_by_table(self, ids: Any, tables: Sequence[int]) -> dict[int, tf.Tensor]:
        if isinstance(ids, (tuple, list)):
            return {t: tf.convert_to_tensor(x) for t, x in zip(tables, ids, strict=True)}
        return {t: ids[:, i : i + 1] for i, t in enumerate(tables)}

    def _exchange_ids(self, local_ids: dict[int, tf.Tensor]) -> dict[int, tf.Tensor]:
        """Data-parallel input: every rank's local-row ids of the tables this rank
        holds model-parallel shards of, for the whole global batch (rank order)."""
        blocks, splits = [], []
        local = tf.shape(next(iter(local_ids.values())))[0]
        for tables in self.model_parallel_tables:
            width = sum(self.hotness[t] for t in tables)
            if tables:
                blocks.append(tf.reshape(tf.concat([local_ids[t] for t in tables], 1), [-1]))
            splits.append(local * width)
        sent = tf.concat(blocks, 0) if blocks else tf.zeros([0], tf.int32)
        received = self.collectives.alltoall(sent, tf.stack(splits))
        mine = self.model_parallel_tables[self.rank]
        width = sum(self.hotness[t] for t in mine)
        if not mine:
            return {}
        global_ids = tf.reshape(received, [-1, width])  # sources in rank order = global rows
        columns = tf.split(global_ids, [self.hotness[t] for t in mine], axis=1)
        return dict(zip(mine, columns, strict=True))

    @staticmethod
    def _lookup(variable: Any, ids: tf.Tensor, rows: tuple[int, int] | None = None) -> tf.Tensor:
        """Sum-pooled vectors [B, width] of ids [B, h]; `rows`: a row-wise shard's
        range (ids outside it contribute zero)."""
        if rows is None:
            return tf.reduce_sum(tf.gather(variable, ids), axis=1)
        local = ids - rows[0]
        inside = tf.logical_and(local >= 0, local < rows[1] - rows[0])
        # Gather only the ids inside the range, so that the gradient lists only rows
        # that were looked up: a zero-gradient entry for an outside id would still
        # move lazy Adam's moments of that row, which one process never touches.
        found = tf.gather(variable, tf.boolean_mask(local, inside))  # [n, width]
        shape = tf.concat(
            [tf.shape(ids, out_type=tf.int64), tf.shape(variable, out_type=tf.int64)[1:]], 0
        )
        vectors = tf.scatter_nd(tf.where(inside), found, shape)  # [B, h, width]
        return tf.reduce_sum(vectors, axis=1)

    def call(self, ids: Any) -> tf.Tensor:
        world = self.world_size
        by_table = self._ids_by_table(ids, self.input_tables)
        first = tf.shape(next(iter(by_table.values())))[0]
        if self.data_parallel_input:
            local_rows, local_ids = first, by_table
            global_ids = self._exchange_ids(by_table) if world > 1 else by_table
        else:
            local_rows, global_ids = first // world, by_table
            start = self.rank * local_rows
            local_ids = {t: x[start : start + local_rows] for t, x in by_table.items()}
        pieces: dict[int, list[tuple[ShardAssignment, tf.Tensor]]] = {}
        if any(self.sent):  # the same on every rank: all take part in the alltoall
            widths = [sum(a.width for a in shards) for shards in self.sent]
            outputs = [
                self._lookup(v, global_ids[a.table], a.rows if a.kind == "row_wise" else None)
                for a, v in zip(self.mine, self.mine_variables, strict=True)
            ]
            block = (
                tf.concat(outputs, axis=1) if outputs else tf.zeros([local_rows * world, 0])
            )  # [G, C_me]; rows [j L, (j + 1) L) go to rank j
            received = self.collectives.alltoall(
                tf.reshape(block, [-1]), tf.fill([world], local_rows * widths[self.rank])
            )
            sizes = tf.stack([local_rows * w for w in widths])
            parts = tf.split(received, sizes, num=world, axis=0)
            for source, (shards, part) in enumerate(zip(self.sent, parts, strict=True)):
                if not shards:
                    continue
                part = tf.reshape(part, [-1, widths[source]])
                columns = tf.split(part, [a.width for a in shards], axis=1)
                for a, vectors in zip(shards, columns, strict=True):
                    pieces.setdefault(a.table, []).append((a, vectors))
        vectors = []
        for table in range(len(self.cardinalities)):
            if table in self.replicated:
                vectors.append(self._lookup(self.replicated[table], local_ids[table]))
            elif pieces[table][0][0].kind == "row_wise":
                vectors.append(tf.add_n([v for _, v in pieces[table]]))
            else:
                ordered = sorted(pieces[table], key=lambda p: p[0].columns[0])
                vectors.append(tf.concat([v for _, v in ordered], axis=1))
        return tf.stack(vectors, axis=1)
