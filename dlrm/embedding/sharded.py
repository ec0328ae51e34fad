"""Embedding tables sharded across ranks, executing a `ShardingPlan`.

Each rank holds the `TableShard`s the plan gives it: whole tables
(`table_wise`), column slices (`column_wise`), row ranges (`row_wise`), plus a
full copy of every `data_parallel` table. For global batch G over W ranks (local
batch L = G / W), a lookup is three steps:

1. **input distribution**: the rank gets the ids of the global batch for the
   tables it holds model-parallel shards of (model-parallel input: the loader
   read them; data-parallel input: one alltoall of ids), and the ids of its
   local rows for the replicated tables;
2. **local lookup**: each shard pools its rows for all G samples, [G, width]
   (a row range contributes zeros for ids outside it), and each replicated
   table for the L local rows;
3. **output distribution**: one alltoall sends rows [j L, (j + 1) L) of the
   rank's shard outputs to rank j; each rank assembles its L rows of every
   table (column slices concatenated, row-range partial sums added), and puts
   the tables side by side, [L, D_0 + ... + D_{T-1}] (widths may differ).

The backward pass is explicit, not the autodiff of the collectives:
`output_distribution_gradient` sends each shard the gradient of its outputs by
the reverse alltoall, which every rank runs on every step, whether or not it
holds a shard. (Left to autodiff, a rank whose lookups reach no variable of its
own would skip the backward alltoall that the others wait for, and the job would
hang.) With the loss divided by G, each shard then receives exactly the gradient
one process computes, so model-parallel gradients need no reduction.

What each kind does in steps 2 and 3 is one `ShardPiece`; a new kind is a new
piece in `PIECES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from dlrm.dist import Collectives
from dlrm.embedding.base import Embeddings, gather_rows, pool, pooled_lookup
from dlrm.embedding.planner import ShardingPlan, TableSpec, replicated_gradient_exchange
from dlrm.embedding.shard import ShardingKind, TableShard


class ShardPiece:
    """What one sharding kind does in the local lookup and the output distribution."""

    def lookup(self, shard: TableShard, variable: Any, ids: Any, pooling: str) -> tf.Tensor:
        """Pooled vectors [B, shard.width] of the shard, for ids [B, hotness]
        or a `tf.RaggedTensor` [B, None]."""
        return pooled_lookup(variable, ids, pooling)

    def combine(self, parts: Sequence[tuple[TableShard, tf.Tensor]]) -> tf.Tensor:
        """A table's [L, D_t] vectors from its shards' received [L, width] parts."""
        (_, vectors) = parts[0]
        return vectors

    def gradient(self, shard: TableShard, table_gradient: tf.Tensor) -> tf.Tensor:
        """The gradient of the shard's [L, width] part, from the table's [L, D_t]."""
        return table_gradient


class WholeTable(ShardPiece):
    """`table_wise` and `data_parallel`: the shard is the whole table."""


class ColumnSlices(ShardPiece):
    """`column_wise`: slices side by side."""

    def combine(self, parts: Sequence[tuple[TableShard, tf.Tensor]]) -> tf.Tensor:
        ordered = sorted(parts, key=lambda part: part[0].columns)
        return tf.concat([vectors for _, vectors in ordered], axis=1)

    def gradient(self, shard: TableShard, table_gradient: tf.Tensor) -> tf.Tensor:
        return table_gradient[:, shard.columns[0] : shard.columns[1]]


class RowRanges(ShardPiece):
    """`row_wise`: partial sums over the ids each range holds."""

    def lookup(self, shard: TableShard, variable: Any, ids: Any, pooling: str) -> tf.Tensor:
        flat = ids.values if isinstance(ids, tf.RaggedTensor) else ids
        local = flat - shard.rows[0]
        inside = tf.logical_and(local >= 0, local < shard.height)
        # Gather only the ids inside the range, so that the gradient lists only rows
        # that were looked up: a zero-gradient entry for an outside id would still
        # move lazy Adam's moments of that row, which one process never touches.
        found = gather_rows(variable, tf.boolean_mask(local, inside))  # [n, width]
        if isinstance(ids, tf.RaggedTensor):
            rows = tf.boolean_mask(ids.value_rowids(), inside)
            sums = tf.math.unsorted_segment_sum(found, rows, ids.nrows())
        else:
            shape = tf.concat(
                [tf.shape(ids, out_type=tf.int64), tf.shape(variable, out_type=tf.int64)[1:]], 0
            )
            vectors = tf.scatter_nd(tf.where(inside), found, shape)  # [B, hotness, width]
            sums = tf.reduce_sum(vectors, axis=1)
        # Mean: each range divides its partial sum by the row's whole count, so
        # that the ranges' parts add up to the mean.
        return pool(sums, ids, pooling)

    def combine(self, parts: Sequence[tuple[TableShard, tf.Tensor]]) -> tf.Tensor:
        return tf.add_n([vectors for _, vectors in parts])


PIECES: dict[ShardingKind, ShardPiece] = {
    ShardingKind.DATA_PARALLEL: WholeTable(),
    ShardingKind.TABLE_WISE: WholeTable(),
    ShardingKind.COLUMN_WISE: ColumnSlices(),
    ShardingKind.ROW_WISE: RowRanges(),
}


class RoutedIds(NamedTuple):
    """Step 1's result: ids [G, hotness] (or ragged [G, None]) per model-parallel
    table this rank holds shards of, ids [L, hotness] per replicated table, and
    what the id alltoall received (kept as a dependency: on a rank that holds no
    shard it is otherwise unused, and tf.function would prune the collective the
    other ranks wait in)."""

    global_ids: dict[int, tf.Tensor]
    local_ids: dict[int, tf.Tensor]
    received: list[tf.Tensor]
    anchor: tf.Tensor


class ShardedEmbeddings(Embeddings):
    """The embeddings layer under horovodrun, executing `plan`.

    Args:
        plan: where every table lives (its `TableSpec`s give rows, width and
            hotness).
        collectives: rank, world size and the alltoall.
        seed: initial values are `initial_table_values` slices, so N ranks
            start from the weights one process would.
        data_parallel_input: ids arrive for the local rows of all tables
            (True) or for the global batch of this rank's tables (False).
        wire_dtype: what the vectors and their gradients cross the alltoalls
            as: float32, or the 16-bit compute dtype under --amp (half the
            bytes; see `_to_wire`).
        hotness: ids per row per table, 0 for a variable-length one; by
            default the plan's (which, for a variable-length table, is only
            the planner's estimate of its cost).
        pooling: per table, "sum" or "mean".
        output_dtype: the vectors' dtype (see `Embeddings`); main.py gives the
            compute dtype, as it does `wire_dtype`.

    Call with the ids the loader gives this rank (`input_tables`, in order):
    [B, n] int32 or int64 when every table read is one-hot, else a tuple of
    [B, hotness] or `tf.RaggedTensor` [B, None] (variable length); and
    `local_rows` L (needed when the rank reads no table).
    Returns [L, sum of D_t] in `output_dtype` for the rank's local rows.
    """

    def __init__(
        self,
        plan: ShardingPlan,
        collectives: Collectives,
        seed: int = 0,
        data_parallel_input: bool = False,
        wire_dtype: Any = tf.float32,
        hotness: Sequence[int] | None = None,
        pooling: Sequence[str] | None = None,
        output_dtype: Any = tf.float32,
        **kwargs: Any,
    ) -> None:
        specs = [table.spec for table in plan.tables]
        super().__init__(
            [s.rows for s in specs],
            [s.dim for s in specs],
            hotness if hotness is not None else [s.hotness for s in specs],
            seed,
            pooling=pooling,
            output_dtype=output_dtype,
            **kwargs,
        )
        if plan.world_size != collectives.world_size:
            raise ValueError(
                f"the sharding plan is for {plan.world_size} ranks, the collectives have "
                f"{collectives.world_size}"
            )
        self.plan = plan
        self.collectives = collectives
        self.rank = collectives.rank
        self.world_size = collectives.world_size
        self.data_parallel_input = data_parallel_input
        self.wire_dtype = tf.as_dtype(wire_dtype)
        if self.wire_dtype not in (tf.float32, tf.bfloat16, tf.float16):
            raise ValueError(f"wire_dtype: expected float32, bfloat16 or float16, got {wire_dtype}")
        # Model-parallel shards per rank, in the order their outputs are sent.
        self.sent = [
            sorted(
                (s for s in plan.local_shards(r) if s.kind.is_model_parallel),
                key=lambda s: (s.table, s.rows, s.columns),
            )
            for r in range(self.world_size)
        ]
        self.widths = [sum(s.width for s in shards) for shards in self.sent]
        self.mine = self.sent[self.rank]
        self.model_parallel_tables = [sorted({s.table for s in shards}) for shards in self.sent]
        self.replicated_tables = tuple(plan.data_parallel_tables())
        self.variable_length = tuple(h == 0 for h in self.hotness)
        # Whether data-parallel input sends variable-length ids (a second alltoall,
        # which every rank then runs).
        self.exchanges_variable_ids = data_parallel_input and any(
            self.variable_length[t] for tables in self.model_parallel_tables for t in tables
        )
        # Tables whose ids this rank reads (model-parallel input), in loader order.
        self.input_tables = tuple(
            range(len(specs))
            if data_parallel_input
            else sorted(set(self.model_parallel_tables[self.rank]) | set(self.replicated_tables))
        )
        self.shard_variables = [(s, self.create_shard_variable(s)) for s in self.mine]
        replicated = [
            s for s in plan.local_shards(self.rank) if s.kind == ShardingKind.DATA_PARALLEL
        ]
        self.replicated = {s.table: self.create_shard_variable(s) for s in replicated}
        self.shard_variables += [(s, self.replicated[s.table]) for s in replicated]
        self._exchange = {
            id(variable): replicated_gradient_exchange(
                TableSpec(specs[table].rows, specs[table].dim, specs[table].hotness),
                self.world_size,
                plan.global_batch_size,
            ).method
            for table, variable in self.replicated.items()
        }

    # ------------------------------------------------------------------ views

    def local_shards(self) -> list[tuple[TableShard, Any]]:
        return list(self.shard_variables)

    @property
    def holds_model_parallel_shards(self) -> bool:
        return bool(self.mine)

    def gradient_exchange(self, variable: Any) -> str | None:
        return self._exchange.get(id(variable))

    # ----------------------------------------------------- 1. input distribution

    def input_distribution(self, ids: Any, local_rows: Any) -> RoutedIds:
        by_table = self.ids_by_table(ids, self.input_tables)
        # This step's data, see _empty_block.
        anchor = tf.reshape(tf.nest.flatten(ids, expand_composites=True)[0], [-1])
        if self.data_parallel_input:
            global_ids, received = self._exchange_ids(by_table, local_rows)
            local_ids = {t: by_table[t] for t in self.replicated_tables}
            return RoutedIds(global_ids, local_ids, [received], anchor)
        start = self.rank * local_rows
        global_ids = {t: by_table[t] for t in self.model_parallel_tables[self.rank]}
        local_ids = {t: by_table[t][start : start + local_rows] for t in self.replicated_tables}
        return RoutedIds(global_ids, local_ids, [], anchor)

    def _exchange_ids(
        self, local_ids: dict[int, Any], local_rows: Any
    ) -> tuple[dict[int, Any], tf.Tensor]:
        """Data-parallel input: every rank's local-row ids of the tables this rank
        holds model-parallel shards of, for the whole global batch (rank order).

        One alltoall carries, per row, the fixed-hotness tables' ids and the
        variable-length tables' row lengths; when any rank holds a
        variable-length table, a second one carries those tables' ids."""
        id_dtype = next(iter(local_ids.values())).dtype if local_ids else tf.int32
        blocks, splits, values, value_splits = [], [], [], []
        for tables in self.model_parallel_tables:
            fixed = [t for t in tables if not self.variable_length[t]]
            ragged = [t for t in tables if self.variable_length[t]]
            columns = [local_ids[t] for t in fixed] + [
                tf.cast(local_ids[t].row_lengths(), id_dtype)[:, None] for t in ragged
            ]
            if columns:
                blocks.append(tf.reshape(tf.concat(columns, 1), [-1]))
            splits.append(local_rows * self._row_width(tables))
            if self.exchanges_variable_ids:
                values += [local_ids[t].values for t in ragged]
                value_splits.append(
                    tf.add_n([tf.size(local_ids[t].values) for t in ragged]) if ragged else 0
                )
        sent = tf.concat(blocks, 0) if blocks else tf.zeros([0], id_dtype)
        received = self.collectives.alltoall(sent, tf.stack(splits), name="embedding_ids")
        received_values = None
        if self.exchanges_variable_ids:
            sent_values = tf.concat(values, 0) if values else tf.zeros([0], id_dtype)
            received_values = self.collectives.alltoall(
                sent_values, tf.stack(value_splits), name="embedding_variable_ids"
            )
            # On a rank without a variable-length table the receipt is empty and
            # unused: add to the first one, which is always used (see _empty_block),
            # a zero that TensorFlow cannot tell is zero, so that the collective
            # is neither pruned nor folded away. (A control dependency is dropped
            # by the graph optimizer: the collective is not a stateful op.)
            nothing = tf.cast(tf.minimum(tf.size(received_values), 0), received.dtype)
            received = received + nothing
        mine = self.model_parallel_tables[self.rank]
        if not mine:
            return {}, received
        fixed = [t for t in mine if not self.variable_length[t]]
        ragged = [t for t in mine if self.variable_length[t]]
        rows = tf.reshape(received, [-1, self._row_width(mine)])  # sources in rank order
        columns = tf.split(rows, [self.hotness[t] for t in fixed] + [1] * len(ragged), axis=1)
        global_ids: dict[int, Any] = dict(zip(fixed, columns[: len(fixed)], strict=True))
        if ragged:
            assert received_values is not None
            lengths = tf.cast(tf.concat(columns[len(fixed) :], axis=1), tf.int64)  # [G, R]
            # Each source sent its tables' ids one table after another.
            totals = tf.reduce_sum(tf.reshape(lengths, [self.world_size, -1, len(ragged)]), 1)
            pieces = tf.split(
                received_values, tf.reshape(totals, [-1]), num=self.world_size * len(ragged)
            )
            for k, table in enumerate(ragged):
                table_values = tf.concat(pieces[k :: len(ragged)], axis=0)
                global_ids[table] = tf.RaggedTensor.from_row_lengths(
                    table_values, lengths[:, k], validate=False
                )
        return global_ids, received

    def chunk_ids(
        self, routed: RoutedIds, local_rows: int, start: int, stop: int
    ) -> RoutedIds | None:
        """The ids of rows [start, stop) of every rank's local rows: the routed ids
        of a global batch of W (stop - start) rows, in rank order, as if each rank
        had read only those rows. None when no rank holds a model-parallel shard:
        no vectors cross, so there is nothing to overlap."""
        if not any(self.sent):
            return None
        count = stop - start
        index = tf.reshape(
            tf.range(self.world_size)[:, None] * local_rows + tf.range(start, stop)[None, :],
            [self.world_size * count],
        )
        global_ids = {t: tf.gather(ids, index) for t, ids in routed.global_ids.items()}
        local_ids = {t: ids[start:stop] for t, ids in routed.local_ids.items()}
        return RoutedIds(global_ids, local_ids, routed.received, routed.anchor)

    def _row_width(self, tables: Sequence[int]) -> int:
        """Values per row in the id alltoall for `tables`: ids, or one length."""
        return sum(1 if self.variable_length[t] else self.hotness[t] for t in tables)

    # ---------------------------------------------------------- 2. local lookup

    def local_lookup(
        self, routed: RoutedIds, local_rows: Any
    ) -> tuple[tf.Tensor, tuple[tf.Tensor, ...]]:
        """([G, C] float32 outputs of this rank's shards side by side, in `sent`
        order; the [L, D_t] vectors (`output_dtype`) of each replicated table, in
        `replicated_tables` order).

        The replicated tables' vectors stay apart: they go into the vectors
        unsent, so side by side they were copied into one block only to be split
        again, and their gradient likewise (19 replicated tables of 128 at
        batch 8192 on 2 ranks: four copies of 40 MB; a rank's op time in copies
        fell from 84-87 to 51-59 ms per step, its step time within noise)."""
        outputs = [
            PIECES[s.kind].lookup(s, variable, routed.global_ids[s.table], self.pooling[s.table])
            for s, variable in self.shard_variables[: len(self.mine)]
        ]
        block = tf.concat(outputs, axis=1) if outputs else self._empty_block(routed, local_rows)
        replicated = tuple(
            tf.cast(
                pooled_lookup(self.replicated[t], routed.local_ids[t], self.pooling[t]),
                self.output_dtype,
            )
            for t in self.replicated_tables
        )
        return block, replicated

    def _empty_block(self, routed: RoutedIds, local_rows: Any) -> tf.Tensor:
        """The [G, 0] output of a rank without model-parallel shards, made from
        this step's data, never a constant. Horovod's collectives are not
        stateful ops, so TensorFlow's optimizer evaluates one whose inputs are all
        constants once, while tracing, and reuses the result: this rank would
        leave every later alltoall to its peers, which would hang. Made from the
        (empty) id receipt, it also keeps the id alltoall, whose result is
        otherwise unused here, from being pruned."""
        if routed.received:
            source = tf.cast(routed.received[0], tf.float32)  # no shard: nothing arrived
        else:
            source = tf.cast(routed.anchor[:0], tf.float32)
        return tf.reshape(source, [local_rows * self.world_size, 0])

    # --------------------------------------------------- 3. output distribution

    def _to_wire(self, values: tf.Tensor) -> tf.Tensor:
        """Values as they cross the alltoall: 16 bits each under --amp.

        The vectors are given to the model in its 16-bit compute dtype, so
        rounding them before the alltoall gives the vectors one process uses
        (row-wise pieces of a multi-hot sum are rounded before they are added);
        the vectors' gradients are 16-bit values already. Horovod's alltoall has
        no bfloat16, so bfloat16 crosses as its bits (uint16)."""
        values = tf.cast(values, self.wire_dtype)
        return tf.bitcast(values, tf.uint16) if self.wire_dtype == tf.bfloat16 else values

    def _from_wire(self, received: tf.Tensor) -> tf.Tensor:
        """float32 values of what arrived (row-wise parts are added in float32)."""
        if self.wire_dtype == tf.bfloat16:
            received = tf.bitcast(received, tf.bfloat16)
        return tf.cast(received, tf.float32)

    def output_distribution(self, looked_up: Any, local_rows: Any, chunk: int = 0) -> tf.Tensor:
        block, replicated = looked_up
        vectors: dict[int, tf.Tensor] = {}
        if any(self.sent):  # the same on every rank: all take part in the alltoall
            received = self._from_wire(
                self.collectives.alltoall(
                    self._to_wire(tf.reshape(block, [-1])),
                    tf.fill([self.world_size], local_rows * self.widths[self.rank]),
                    name=_chunk_name("embedding_vectors", chunk),
                )
            )
            parts: dict[int, list[tuple[TableShard, tf.Tensor]]] = {}
            sizes = tf.stack([local_rows * w for w in self.widths])
            for source, part in enumerate(tf.split(received, sizes, num=self.world_size)):
                shards = self.sent[source]
                if not shards:
                    continue
                columns = tf.split(
                    tf.reshape(part, [-1, self.widths[source]]), [s.width for s in shards], axis=1
                )
                for shard, piece in zip(shards, columns, strict=True):
                    parts.setdefault(shard.table, []).append((shard, piece))
            for table, table_parts in parts.items():
                combined = PIECES[table_parts[0][0].kind].combine(table_parts)
                vectors[table] = tf.cast(combined, self.output_dtype)
        for table, part in zip(self.replicated_tables, replicated, strict=True):
            vectors[table] = part
        return tf.concat([vectors[t] for t in range(len(self.cardinalities))], axis=1)

    def output_distribution_gradient(
        self, gradient: tf.Tensor, local_rows: Any, chunk: int = 0
    ) -> Any:
        """The gradient of `local_lookup`'s outputs from that of the vectors [L, sum of D_t]:
        the reverse alltoall, run by every rank on every step.

        A caller must use the result on every rank, also on a rank that holds no
        model-parallel shard (whose tape then reaches no variable through it):
        inside a `tf.function` an unused collective is pruned and the other ranks
        wait for it. The trainer checks the result for NaN."""
        block: tf.Tensor = tf.zeros([local_rows * self.world_size, 0])
        if any(self.sent):
            sent = []
            for shards in self.sent:
                for shard in shards:
                    table_gradient = self.table_columns(gradient, shard.table)
                    sent.append(PIECES[shard.kind].gradient(shard, table_gradient))
            # [L, sum of widths]: for each destination rank, its shards' columns.
            outgoing = tf.concat(sent, axis=1)  # not empty: some rank holds a shard
            chunks = tf.split(outgoing, self.widths, axis=1, num=self.world_size)
            flat = tf.concat([tf.reshape(chunk, [-1]) for chunk in chunks], axis=0)
            received = self._from_wire(
                self.collectives.alltoall(
                    self._to_wire(flat),
                    tf.stack([local_rows * w for w in self.widths]),
                    name=_chunk_name("embedding_vector_gradients", chunk),
                )
            )
            # Sources in rank order: rows [j L, (j + 1) L) of this rank's [G, C] block.
            block = tf.reshape(received, [local_rows * self.world_size, self.widths[self.rank]])
        replicated = tuple(self.table_columns(gradient, t) for t in self.replicated_tables)
        return block, replicated


def _chunk_name(name: str, chunk: int) -> str:
    """The collective's name for chunk `chunk` of the rows (the first keeps `name`)."""
    return name if chunk == 0 else f"{name}_{chunk}"
