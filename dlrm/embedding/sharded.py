"""Embedding tables sharded across ranks, executing a `ShardingPlan`.

Each rank holds the `TableShard`s the plan gives it: whole tables
(`table_wise`), column slices (`column_wise`), row ranges (`row_wise`), plus a
full copy of every `data_parallel` table. For global batch G over W ranks (local
batch L = G / W), the vectors of a span of l of each rank's local rows are three
steps:

1. **input distribution** (once per step): the rank gets the ids of the global
   batch for the tables it holds model-parallel shards of (model-parallel input:
   the loader read them; data-parallel input: an alltoall of ids, which the
   trainer may run a step ahead, `exchange_ids`), and the ids of its local rows
   for the replicated tables;
2. **local lookup**: each shard pools its rows for the span's W l samples,
   [W l, width] (a row range contributes zeros for ids outside it), and each
   replicated table for the rank's l rows;
3. **output distribution**: an alltoall sends each rank its l rows of every
   shard's outputs; each rank assembles every table (column slices
   concatenated, row-range partial sums added) and puts the tables side by
   side, [l, D_0 + ... + D_{T-1}] (widths may differ).

The backward pass is written out, not the autodiff of the collectives: the
reverse alltoall sends each shard the gradient of its outputs, and the
replicated tables' gradients are summed over the ranks the way the plan costed
(`ShardingPlan.gradient_exchange`: a dense allreduce with counts of lookups, or
an allgather of the rows looked up). With the loss divided by G, each shard then
receives exactly the gradient one process computes, so model-parallel gradients
need no reduction.

Every collective of a step goes through the step's `StepExchanges`, so every
rank runs the same ones in the same order, whatever it holds, and none of them
can be pruned or folded away by TensorFlow on a rank that has nothing to send
or no use for what it receives (see `StepExchanges`).

What each kind does in steps 2 and 3 is one `ShardPiece`; a new kind is a new
piece in `PIECES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from dlrm.distributed.collectives import Collectives
from dlrm.embedding.base import (
    ChunkLookup,
    EmbeddingGradients,
    EmbeddingLookup,
    Embeddings,
    Span,
    gather_rows,
    pool,
    pooled_lookup,
)
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.shard import ShardingKind, TableShard
from dlrm.embedding.update import (
    GradientPiece,
    concatenated_slices,
    piece_slices,
    pooled_piece,
)
from dlrm.kernels.finite import all_finite


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


class StepExchanges:
    """The collectives of one step of a `ShardedEmbeddings`, in the order the
    layer runs them: every rank runs the same ones, whatever it holds.

    Horovod's collectives are not stateful ops, so inside a `tf.function` two
    things would make one rank skip a collective its peers wait in, and hang the
    job: an input that is a constant (a rank with nothing to send) is evaluated
    once while tracing, and an output nothing uses (ids or gradients a rank
    receives but has no shard for) is pruned. So every input is made from this
    step's data (`anchor`), never a constant; and every output is folded into
    `receipt`, a zero TensorFlow cannot tell is zero, that the next alltoall's
    splits add (so each exchange depends on all before it) and that the update
    checks with an assertion, which tf.function always runs
    (`Embeddings.apply_gradients`). Nothing outside the layer is placed to
    keep a collective alive.
    """

    def __init__(self, collectives: Collectives, anchor: tf.Tensor) -> None:
        self.collectives = collectives
        self.anchor = anchor  # [n]: this step's ids
        self.receipt = tf.constant(0, tf.int32)

    def alltoall(self, tensor: tf.Tensor, splits: Any, name: str) -> tf.Tensor:
        """Rows [sum(splits[:j]), sum(splits[:j+1])) of `tensor` (flattened) to rank
        j; what every rank sent here, in rank order."""
        flat = tf.reshape(tensor, [-1])
        if flat.shape.num_elements() == 0:  # nothing to send: still this step's data
            flat = tf.cast(self.anchor[:0], flat.dtype)
        splits = tf.cast(splits, tf.int32) + self.receipt
        received = self.collectives.alltoall(flat, splits, name=name)
        self._note(received)
        return received

    def allreduce_sum(self, tensors: Sequence[tf.Tensor], names: Sequence[str]) -> list[Any]:
        summed = self.collectives.allreduce_sum(list(tensors), list(names))
        for tensor in summed:
            self._note(tensor)
        return summed

    def allgather(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        gathered = self.collectives.allgather(tensor, name=name)
        self._note(gathered)
        return gathered

    def _note(self, output: tf.Tensor) -> None:
        """Folds `output` into the receipt by a zero made from it: its size,
        floored at zero, where its shape is only known when it runs; else the
        sum of none of its values."""
        if output.shape.is_fully_defined():
            zero = tf.cast(tf.reduce_sum(tf.reshape(output, [-1])[:0]), tf.int32)
        else:
            zero = tf.minimum(tf.size(output, out_type=tf.int32), 0)
        self.receipt = self.receipt + zero


class RoutedIds(NamedTuple):
    """Step 1's result: ids [G, hotness] (or ragged [G, None]) per model-parallel
    table this rank holds shards of, and ids [L, hotness] per replicated table."""

    global_ids: dict[int, tf.Tensor]
    local_ids: dict[int, tf.Tensor]


class ExchangedIds(NamedTuple):
    """Data-parallel input's alltoall of ids, run apart from the step that uses
    them (`ShardedEmbeddings.exchange_ids`): ids [G, hotness] (or ragged) per
    model-parallel table this rank holds shards of, and the exchange's receipt
    (see `StepExchanges`), which the step that uses them folds into its own."""

    global_ids: dict[int, tf.Tensor]
    receipt: tf.Tensor


class ShardedEmbeddings(Embeddings):
    """The embeddings layer under horovodrun, executing `plan`.

    Args:
        plan: where every table lives (its `TableSpec`s give rows, width and
            hotness).
        collectives: rank, world size and the collectives.
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
        use_kernels: see `Embeddings`.

    Its ids are what the loader gives this rank (`input_tables`, in order):
    [B, n] int32 or int64 when every table read is one-hot, else a tuple of
    [B, hotness] or `tf.RaggedTensor` [B, None] (variable length); and
    `local_rows` L (needed when the rank reads no table). Its vectors are
    [l, sum of D_t] in `output_dtype` for the rank's local rows of a span.
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
        use_kernels: bool = False,
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
            use_kernels=use_kernels,
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
        self._lay_out_exchanges(plan)
        self._create_shard_variables(plan)

    def _lay_out_exchanges(self, plan: ShardingPlan) -> None:
        """Who sends what to whom, the same on every rank: each rank's
        model-parallel shards in the order their outputs are sent, their widths,
        and which tables' ids this rank reads."""
        self.sent = [
            sorted(
                (s for s in plan.local_shards(r) if s.kind.is_model_parallel),
                key=lambda s: (s.table, s.rows, s.columns),
            )
            for r in range(self.world_size)
        ]
        self.widths = [sum(s.width for s in shards) for shards in self.sent]
        self.mine = self.sent[self.rank]
        # Each of this rank's shards' first column in what it sends and receives.
        self.mine_columns = [sum(s.width for s in self.mine[:i]) for i in range(len(self.mine))]
        # Whether any vectors cross between the ranks: the same on every rank.
        self.exchanges_vectors = any(self.sent)
        self.model_parallel_tables = [sorted({s.table for s in shards}) for shards in self.sent]
        self.replicated_tables = tuple(plan.data_parallel_tables())
        self.variable_length = tuple(h == 0 for h in self.hotness)
        # Whether data-parallel input sends variable-length ids (a second alltoall,
        # which every rank then runs).
        self.exchanges_variable_ids = self.data_parallel_input and any(
            self.variable_length[t] for tables in self.model_parallel_tables for t in tables
        )
        # Tables whose ids this rank reads (model-parallel input), in loader order.
        self.input_tables = tuple(
            range(len(plan.tables))
            if self.data_parallel_input
            else sorted(set(self.model_parallel_tables[self.rank]) | set(self.replicated_tables))
        )

    def _create_shard_variables(self, plan: ShardingPlan) -> None:
        """This rank's model-parallel shards, then its copies of the replicated tables."""
        self.shard_variables = [(s, self.create_shard_variable(s)) for s in self.mine]
        replicated = [
            s for s in plan.local_shards(self.rank) if s.kind == ShardingKind.DATA_PARALLEL
        ]
        self.replicated = {s.table: self.create_shard_variable(s) for s in replicated}
        # Each replicated table's position in local_shards() (a piece's target).
        self.replicated_targets = {s.table: len(self.mine) + i for i, s in enumerate(replicated)}
        self.shard_variables += [(s, self.replicated[s.table]) for s in replicated]

    # ------------------------------------------------------------------ views

    def local_shards(self) -> list[tuple[TableShard, Any]]:
        return list(self.shard_variables)

    # ---------------------------------------------------------------- the step

    @property
    def exchanges_ids(self) -> bool:
        """Whether ids cross between the ranks (data-parallel input, and some
        rank holds a model-parallel shard): the same on every rank."""
        return self.data_parallel_input and self.exchanges_vectors

    def exchange_ids(self, ids: Any, local_rows: Any) -> ExchangedIds:
        """Step 1's alltoall of ids alone, for `forward` to take as `exchanged`:
        the trainer runs the next batch's in this step, where it overlaps this
        step's dense part (`Trainer.train_step_agreeing`). The same ids, the
        same vectors: only when they cross changes."""
        if not self.exchanges_ids:
            raise ValueError("exchange_ids: no ids cross between the ranks in this plan")
        exchanges = StepExchanges(self.collectives, _anchor(ids))
        by_table = self.ids_by_table(ids, self.input_tables)
        global_ids = self._exchange_ids(by_table, local_rows, exchanges)
        return ExchangedIds(global_ids, exchanges.receipt)

    def forward(
        self,
        ids: Any,
        local_rows: Any,
        spans: Sequence[Span],
        exchanged: ExchangedIds | None = None,
    ) -> EmbeddingLookup:
        """Step 1 once (its alltoall of ids already done when `exchanged` is
        given), then steps 2 and 3 for each span: each span's vectors cross
        between the ranks on their own, so that one span's exchange, forward and
        backward, overlaps another span's dense part."""
        exchanges = StepExchanges(self.collectives, _anchor(ids))
        routed = self._input_distribution(ids, local_rows, exchanges, exchanged)
        chunks = []
        for k, (start, stop) in enumerate(spans):
            if stop is None or len(spans) == 1:  # the whole batch
                span_routed, rows = routed, local_rows
            else:
                span_routed, rows = self._span_ids(routed, local_rows, start, stop), stop - start
            block, replicated = self._local_lookup(span_routed, rows)
            vectors = self._output_distribution(block, replicated, rows, k, exchanges)
            chunks.append(ChunkLookup(vectors, (span_routed, rows)))
        return EmbeddingLookup(chunks, exchanges)

    def backward(
        self, lookup: EmbeddingLookup, vector_gradients: Sequence[tf.Tensor]
    ) -> EmbeddingGradients:
        """Each span's reverse alltoall (every rank, on every step), this rank's
        shards' pieces of what arrived, and the replicated tables' gradients
        summed over the ranks."""
        exchanges: StepExchanges = lookup.step
        pieces: list[GradientPiece] = []
        replicated: dict[int, list[Any]] = {t: [] for t in self.replicated_tables}
        for k, (chunk, gradient) in enumerate(zip(lookup.chunks, vector_gradients, strict=True)):
            routed, rows = chunk.ids
            block = self._output_distribution_gradient(gradient, rows, k, exchanges)
            for i, shard in enumerate(self.mine):
                pieces.append(
                    pooled_piece(
                        i,
                        routed.global_ids[shard.table],
                        block,
                        self.mine_columns[i],
                        self.pooling[shard.table],
                    )
                )
            for t in self.replicated_tables:
                target = self.replicated_targets[t]
                piece = pooled_piece(
                    target, routed.local_ids[t], gradient, self.offsets[t], self.pooling[t]
                )
                replicated[t].append(piece_slices(piece, self.shard_variables[target][0]))
        summed, finite = self._sum_replicated(replicated, exchanges)
        return EmbeddingGradients(pieces + summed, finite, exchanges.receipt)

    # ----------------------------------------------------- 1. input distribution

    def _input_distribution(
        self,
        ids: Any,
        local_rows: Any,
        exchanges: StepExchanges,
        exchanged: ExchangedIds | None = None,
    ) -> RoutedIds:
        by_table = self.ids_by_table(ids, self.input_tables)
        if exchanged is not None:
            if not self.exchanges_ids:
                raise ValueError("forward: ids exchanged ahead, but none cross in this plan")
            exchanges.receipt = exchanges.receipt + exchanged.receipt
            local_ids = {t: by_table[t] for t in self.replicated_tables}
            return RoutedIds(dict(exchanged.global_ids), local_ids)
        if self.data_parallel_input:
            global_ids = (
                self._exchange_ids(by_table, local_rows, exchanges) if self.exchanges_ids else {}
            )
            local_ids = {t: by_table[t] for t in self.replicated_tables}
            return RoutedIds(global_ids, local_ids)
        start = self.rank * local_rows
        global_ids = {t: by_table[t] for t in self.model_parallel_tables[self.rank]}
        local_ids = {t: by_table[t][start : start + local_rows] for t in self.replicated_tables}
        return RoutedIds(global_ids, local_ids)

    def _exchange_ids(
        self, local_ids: dict[int, Any], local_rows: Any, exchanges: StepExchanges
    ) -> dict[int, Any]:
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
        received = exchanges.alltoall(sent, tf.stack(splits), name="embedding_ids")
        received_values = None
        if self.exchanges_variable_ids:
            sent_values = tf.concat(values, 0) if values else tf.zeros([0], id_dtype)
            received_values = exchanges.alltoall(
                sent_values, tf.stack(value_splits), name="embedding_variable_ids"
            )
        mine = self.model_parallel_tables[self.rank]
        if not mine:
            return {}
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
        return global_ids

    def _span_ids(self, routed: RoutedIds, local_rows: int, start: int, stop: int) -> RoutedIds:
        """The ids of rows [start, stop) of every rank's local rows: the routed ids
        of a global batch of W (stop - start) rows, in rank order, as if each rank
        had read only those rows."""
        count = stop - start
        index = tf.reshape(
            tf.range(self.world_size)[:, None] * local_rows + tf.range(start, stop)[None, :],
            [self.world_size * count],
        )
        global_ids = {t: tf.gather(ids, index) for t, ids in routed.global_ids.items()}
        local_ids = {t: ids[start:stop] for t, ids in routed.local_ids.items()}
        return RoutedIds(global_ids, local_ids)

    def _row_width(self, tables: Sequence[int]) -> int:
        """Values per row in the id alltoall for `tables`: ids, or one length."""
        return sum(1 if self.variable_length[t] else self.hotness[t] for t in tables)

    # ---------------------------------------------------------- 2. local lookup

    def _local_lookup(
        self, routed: RoutedIds, local_rows: Any
    ) -> tuple[tf.Tensor | None, tuple[tf.Tensor, ...]]:
        """([G, C] float32 outputs of this rank's shards side by side, in `sent`
        order, or None when it holds none; the [L, D_t] vectors (`output_dtype`)
        of each replicated table, in `replicated_tables` order).

        The replicated tables' vectors stay apart: they go into the vectors
        unsent, so side by side they would be copied into one block only to be
        split again, and their gradient likewise."""
        outputs = [
            PIECES[s.kind].lookup(s, variable, routed.global_ids[s.table], self.pooling[s.table])
            for s, variable in self.shard_variables[: len(self.mine)]
        ]
        block = tf.concat(outputs, axis=1) if outputs else None
        replicated = tuple(
            tf.cast(
                pooled_lookup(self.replicated[t], routed.local_ids[t], self.pooling[t]),
                self.output_dtype,
            )
            for t in self.replicated_tables
        )
        return block, replicated

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

    def _output_distribution(
        self,
        block: tf.Tensor | None,
        replicated: tuple[tf.Tensor, ...],
        local_rows: Any,
        chunk: int,
        exchanges: StepExchanges,
    ) -> tf.Tensor:
        vectors: dict[int, tf.Tensor] = {}
        if self.exchanges_vectors:  # the same on every rank: all take part
            sent = tf.zeros([0], tf.float32) if block is None else block
            received = self._from_wire(
                exchanges.alltoall(
                    self._to_wire(sent),
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

    def _output_distribution_gradient(
        self, gradient: tf.Tensor, local_rows: Any, chunk: int, exchanges: StepExchanges
    ) -> tf.Tensor | None:
        """The gradient [G, C] of this rank's shards' outputs, from that of the
        vectors [L, sum of D_t]: the reverse alltoall, run by every rank on every
        step; None when no vectors cross."""
        if not self.exchanges_vectors:
            return None
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
            exchanges.alltoall(
                self._to_wire(flat),
                tf.stack([local_rows * w for w in self.widths]),
                name=_chunk_name("embedding_vector_gradients", chunk),
            )
        )
        # Sources in rank order: rows [j L, (j + 1) L) of this rank's [G, C] block.
        return tf.reshape(received, [local_rows * self.world_size, self.widths[self.rank]])

    # ------------------------------------------- the replicated tables' gradients

    def _sum_replicated(
        self, slices: dict[int, list[tf.IndexedSlices]], exchanges: StepExchanges
    ) -> tuple[list[GradientPiece], tf.Tensor]:
        """Each replicated table's gradient summed over the ranks, as the plan
        costed it (`ShardingPlan.gradient_exchange`): a dense allreduce of the
        [rows, D + 1] array of summed rows and lookup counts, or an allgather of
        the rows each rank looked up. Returns the sums as pieces (only rows that
        some rank looked up, as one process's gradient lists), and whether they
        are finite."""
        if not slices:
            return [], tf.constant(True)
        dense_tables, dense_arrays, pieces, checked = [], [], [], []
        for t, parts in slices.items():
            gradient = concatenated_slices(parts)
            name = f"gradient_{self.shard_variables[self.replicated_targets[t]][0].name}"
            if self.plan.gradient_exchange(t).method == "dense":
                dense_tables.append(t)
                dense_arrays.append((name, _with_counts(gradient, self.cardinalities[t])))
                continue
            values = exchanges.allgather(gradient.values, name=f"{name}_values")
            indices = exchanges.allgather(gradient.indices, name=f"{name}_indices")
            checked.append(values)
            pieces.append(_rows_piece(self.replicated_targets[t], indices, values))
        if dense_arrays:
            names, arrays = zip(*dense_arrays, strict=True)
            for t, summed in zip(dense_tables, exchanges.allreduce_sum(arrays, names), strict=True):
                rows, values = _looked_up_rows(summed)
                checked.append(values)
                pieces.append(_rows_piece(self.replicated_targets[t], rows, values))
        return pieces, all_finite(checked, self.use_kernels)


def _rows_piece(target: int, ids: tf.Tensor, values: tf.Tensor) -> GradientPiece:
    """A piece with one gradient row per id, in order."""
    rows = tf.range(tf.shape(ids)[0], dtype=tf.int32)
    return GradientPiece(target, ids, rows, values, 0)


def _with_counts(gradient: tf.IndexedSlices, rows: int) -> tf.Tensor:
    """A replicated table's sparse gradient as a dense [rows, D + 1] array: the
    summed gradient of each row, and how often the row was looked up."""
    values = tf.math.unsorted_segment_sum(gradient.values, gradient.indices, rows)
    ones = tf.ones_like(gradient.indices, dtype=values.dtype)[:, None]
    counts = tf.math.unsorted_segment_sum(ones, gradient.indices, rows)
    return tf.concat([values, counts], axis=1)


def _looked_up_rows(summed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """The rows of an allreduced `_with_counts` array that some rank looked up,
    and their summed gradients: the rows one process's gradient lists (so lazy
    optimizers leave the same rows alone)."""
    rows = tf.cast(tf.where(summed[:, -1] > 0)[:, 0], tf.int32)
    return rows, tf.gather(summed[:, :-1], rows)


def _anchor(ids: Any) -> tf.Tensor:
    """[n]: a step's ids, from which `StepExchanges` makes what a rank with
    nothing to send sends."""
    return tf.reshape(tf.nest.flatten(ids, expand_composites=True)[0], [-1])


def _chunk_name(name: str, chunk: int) -> str:
    """The collective's name for chunk `chunk` of the rows (the first keeps `name`)."""
    return name if chunk == 0 else f"{name}_{chunk}"
