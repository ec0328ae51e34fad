"""What the trainer, evaluator and checkpoints need of an embeddings layer.

`LocalEmbeddings` (every table on this process) and `ShardedEmbeddings` (a
`ShardingPlan` across ranks) implement it, so the model, trainer and `main.py`
do not change when tables are sharded. The trainer asks for vectors and hands
back their gradient; what crosses between ranks, and which rank holds what, is
the layer's alone:

1. `forward(ids, local_rows, spans)`: the vectors of each span (chunk) of the
   local rows, [rows, D_0 + ... + D_{T-1}] (each table's D_t columns side by
   side, in table order, so that tables may differ in width);
2. `backward(lookup, vector_gradients)`: the tables' gradients as
   `GradientPiece`s, with every exchange between ranks done (no autodiff: the
   backward of each lookup is written out);
3. `apply_gradients(gradients, optimizer, ...)`: the optimizer's rule on the
   rows looked up (`dlrm.embedding.update`).

`call(ids)` is the forward pass of the whole batch, for prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from dlrm import kernels
from dlrm.embedding.initializer import initial_table_values
from dlrm.embedding.shard import ROW_BLOCK_BYTES, TableShard
from dlrm.embedding.update import GradientPiece, apply_pieces
from dlrm.optim.optimizers import Optimizer
from dlrm.variables import resource_variable

# The most rows whose shape fits int32: TensorFlow's own gather gradient states
# the variable's shape as int32 (`ResourceGather`'s gradient, `variable_shape`).
_INT32_ROWS = int(np.iinfo(np.int32).max)


def gather_rows(variable: Any, ids: tf.Tensor) -> tf.Tensor:
    """Rows `ids` of a tf.Variable [rows, D]: [*ids.shape, D] float32 (a 16-bit
    table's widened), differentiable
    with respect to the variable as `tf.IndexedSlices` (the rows looked up).

    Tables of more than 2^31 - 1 rows cannot use `tf.gather`'s gradient: it builds
    the dense shape as an int32 constant, which wraps negative (2^31 + 16 rows
    become -2147483632), and tracing the step fails ("Invalid value in tensor
    used for shape"; eagerly it would silently carry the wrong shape). Those take
    `_gather_with_int64_shape`; smaller tables keep `tf.gather` as it is.
    """
    rows = variable.shape[0]
    if rows is not None and rows <= _INT32_ROWS:
        found = tf.gather(variable, ids)
    else:
        found = _gather_with_int64_shape(variable, ids)
    # A 16-bit table's rows, widened after the gather (exact).
    return found if found.dtype == tf.float32 else tf.cast(found, tf.float32)


def _gather_with_int64_shape(variable: Any, ids: tf.Tensor) -> tf.Tensor:
    """`tf.gather(variable, ids)` whose gradient is the `tf.IndexedSlices` that
    TensorFlow's is (values [n, D], the ids flattened), with an int64 dense shape.

    The custom gradient takes the variable's handle, not the variable: given a
    variable, `tf.custom_gradient` reads it whole (a copy of the table, which
    failed to allocate at 8 GiB). Nothing here reads it either (its shape comes
    from `VariableShape`), so the tape is told of the access as a gather would
    tell it, before the handle enters the function.
    """
    variable = resource_variable(variable)

    @tf.custom_gradient
    def gather(handle: tf.Tensor, ids: tf.Tensor) -> tuple[tf.Tensor, Any]:
        found = tf.raw_ops.ResourceGather(resource=handle, indices=ids, dtype=variable.dtype)

        def gradient(upstream: tf.Tensor) -> tuple[tf.IndexedSlices, None]:
            shape = tf.raw_ops.VariableShape(input=handle, out_type=tf.int64)
            flat = tf.reshape(ids, [-1])
            values_shape = tf.concat([tf.shape(flat, out_type=tf.int64), shape[1:]], 0)
            return tf.IndexedSlices(tf.reshape(upstream, values_shape), flat, shape), None

        return found, gradient

    resource_variable_ops.variable_accessed(variable)
    return gather(variable.handle, ids)


def pooled_lookup(variable: Any, ids: Any, pooling: str = "sum") -> tf.Tensor:
    """Pooled rows [B, width] of `variable` for ids [B, hotness] or a
    `tf.RaggedTensor` [B, None] (a variable-length table; an empty row pools
    to zeros). Fixed hotness stays one gather and one reduction."""
    if isinstance(ids, tf.RaggedTensor):
        found = gather_rows(variable, ids.values)
        sums = tf.math.unsorted_segment_sum(found, ids.value_rowids(), ids.nrows())
    else:
        sums = tf.reduce_sum(gather_rows(variable, ids), axis=1)
    return pool(sums, ids, pooling)


def pool(sums: tf.Tensor, ids: Any, pooling: str) -> tf.Tensor:
    """`sums` [B, width] of each row's looked-up vectors, pooled as `pooling`
    says: as they are, or divided by the row's number of ids (all of them, also
    those another rank's row range holds; an empty row stays zeros)."""
    if pooling == "sum":
        return sums
    if isinstance(ids, tf.RaggedTensor):
        counts = tf.cast(tf.maximum(ids.row_lengths(), 1), sums.dtype)[:, None]
        return sums / counts
    hotness = ids.shape[1] if ids.shape.rank == 2 else 1
    return sums / float(hotness) if hotness != 1 else sums


def fused_lookup(variables: Sequence[Any], ids: tf.Tensor, output_dtype: Any) -> tf.Tensor:
    """Row ids[:, t] of every table t (float32, bfloat16 or float16, widened)
    side by side: [B, sum of D_t] in `output_dtype`, for one-hot ids [B, T]
    (int32 or int64). One op of the
    project's CPU kernels (`DlrmEmbeddingLookup`; RuntimeError when not built);
    differentiable with respect to the tables, as one `tf.gather` per table."""
    tables = [resource_variable(v) for v in variables]
    for table in tables:  # a tape that records the lookup watches the tables
        resource_variable_ops.variable_accessed(table)
    dtype = tf.as_dtype(output_dtype)
    vectors = kernels.require().dlrm_embedding_lookup(
        tables=[table.handle for table in tables],
        ids=ids,
        widths=[int(table.shape[1]) for table in tables],
        T=tf.float32 if dtype == tf.float16 else dtype,
    )
    return tf.cast(vectors, dtype)


def assign_rows(variable: Any, start: int, values: np.ndarray) -> None:
    """variable[start : start + len(values)] = values, in place.

    `variable[a:b].assign(...)` reads the variable first, and that read keeps its
    buffer shared, so the next sliced assign copies the whole table; the raw op
    on the handle does not.
    """
    # int64 bounds: a table may have more than 2^31 rows. A 16-bit table's
    # float32 values are rounded to nearest (even).
    resource = resource_variable(variable)
    tf.raw_ops.ResourceStridedSliceAssign(
        ref=resource.handle,
        begin=tf.constant([start, 0], tf.int64),
        end=tf.constant([start + len(values), values.shape[1]], tf.int64),
        strides=tf.constant([1, 1], tf.int64),
        value=tf.cast(values, resource.dtype),
    )


def read_rows(variable: Any, start: int, stop: int) -> np.ndarray:
    """A copy of variable[start:stop], [stop - start, D] float32 (a 16-bit
    table's widened, exactly).

    A gather of the int64 row range: reading the variable (`variable[a:b]`,
    `.numpy()`) copies the whole table once sparse updates have put it in
    copy-on-read mode, and the gather copies only the rows asked for (with
    their int64 indices, 8 bytes a row).
    """
    handle = resource_variable(variable).handle
    rows = tf.range(start, stop, dtype=tf.int64)
    dtype = resource_variable(variable).dtype
    values = tf.raw_ops.ResourceGather(resource=handle, indices=rows, dtype=dtype)
    return np.asarray(tf.cast(values, tf.float32).numpy())


class Embeddings(keras.layers.Layer):
    """Base of the embeddings layers: tables [rows_t, D_t] of `table_dtype`.

    Args:
        cardinalities, dims, hotness: per table; hotness 0 is a variable number
            of ids per row (the ids arrive as a `tf.RaggedTensor`).
        seed: seeds `initial_table_values`, so that a shard created by itself
            holds the values of the same slice of the whole table.
        pooling: per table, "sum" or "mean" of a row's vectors (default sum).
        output_dtype: the dtype of the vectors the layer returns: float32, or
            the model's 16-bit compute dtype under --amp. Each table's vectors
            are cast before they are put side by side, so that the step's
            largest activation and its gradient are 16-bit and never also held
            in float32 (a 1-process bfloat16 step of the default model at batch
            65536 peaked at 3.8 GiB instead of 5.7); the tables keep
            `table_dtype`.
        use_kernels: the project's CPU kernels (`dlrm.kernels`; the caller
            checks that they are loaded and that the model runs on CPUs):
            `DlrmEmbeddingApply` updates the tables, and where a layer has one,
            a kernel looks ids up (`fused_lookup`).
        table_dtype: what the tables (and their shards) store: float32, or
            bfloat16 or float16 at half the bytes (`--embedding_dtype`); lookups
            widen to float32, updates compute in float32 and round
            stochastically (`dlrm.embedding.update`). Slots stay float32.
    """

    def __init__(
        self,
        cardinalities: Sequence[int],
        dims: Sequence[int],
        hotness: Sequence[int],
        seed: int = 0,
        pooling: Sequence[str] | None = None,
        output_dtype: Any = tf.float32,
        use_kernels: bool = False,
        table_dtype: Any = tf.float32,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("name", "embeddings")
        super().__init__(dtype="float32", **kwargs)
        self.cardinalities = tuple(int(c) for c in cardinalities)
        self.dims = tuple(int(d) for d in dims)
        self.hotness = tuple(int(h) for h in hotness)
        if not len(self.cardinalities) == len(self.dims) == len(self.hotness):
            raise ValueError(
                f"embeddings: expected one cardinality, width and hotness per table, got "
                f"{len(self.cardinalities)}, {len(self.dims)} and {len(self.hotness)}"
            )
        # One per table, "sum" or "mean" (checked where the flags enter, RunConfig).
        self.pooling = tuple(pooling) if pooling is not None else ("sum",) * len(self.dims)
        # Table t's columns in the output: [offsets[t], offsets[t] + dims[t]).
        self.offsets = tuple(int(sum(self.dims[:t])) for t in range(len(self.dims)))
        self.seed = seed
        self.use_kernels = use_kernels
        self.output_dtype = tf.as_dtype(output_dtype)
        if self.output_dtype not in (tf.float32, tf.bfloat16, tf.float16):
            raise ValueError(
                f"output_dtype: expected float32, bfloat16 or float16, got {output_dtype}"
            )
        self.table_dtype = tf.as_dtype(table_dtype)
        if self.table_dtype not in (tf.float32, tf.bfloat16, tf.float16):
            raise ValueError(
                f"table_dtype: expected float32, bfloat16 or float16, got {table_dtype}"
            )

    def create_shard_variable(self, shard: TableShard) -> Any:
        """The shard's tf.Variable, filled with its initial values in row blocks,
        so that creating it needs the shard's memory once plus a block (handing
        Keras the whole array made three copies of it)."""
        rows, dim, seed = self.cardinalities[shard.table], self.dims[shard.table], self.seed
        variable = self.add_weight(
            shape=(shard.height, shard.width),
            initializer="zeros",
            name=shard.name.replace(".", "_"),
            dtype=self.table_dtype.name,
        )
        step = max(1, ROW_BLOCK_BYTES // (4 * shard.width))
        for start in range(0, shard.height, step):
            stop = min(shard.height, start + step)
            rows_range = (shard.rows[0] + start, shard.rows[0] + stop)
            values = initial_table_values(shard.table, rows, dim, seed, rows_range, shard.columns)
            assign_rows(variable, start, values)
        # Lookups, gradients and updates use the tf.Variable behind the Keras one
        # (which Keras still tracks): tf.gather on a Keras 3 variable reads the
        # whole table densely, and after a sparse update that read copies it
        # (docs/performance.md#defaults-chosen-by-measurement).
        return resource_variable(variable)

    @staticmethod
    def ids_by_table(ids: Any, tables: Sequence[int]) -> dict[int, tf.Tensor]:
        """The loader's ids ([B, n] one-hot, or a tuple of [B, hotness] or
        `tf.RaggedTensor` [B, None]) by table."""
        if isinstance(ids, (tuple, list)):
            return {
                t: x if isinstance(x, tf.RaggedTensor) else tf.convert_to_tensor(x)
                for t, x in zip(tables, ids, strict=True)
            }
        return {t: ids[:, i : i + 1] for i, t in enumerate(tables)}

    # ----------------------------------------------------------------- views

    def table_shape(self, table: int) -> tuple[int, int]:
        return self.cardinalities[table], self.dims[table]

    def table_columns(self, vectors: tf.Tensor, table: int) -> tf.Tensor:
        """Table `table`'s [L, D_t] part of `vectors` [L, sum of D]."""
        start = self.offsets[table]
        return vectors[:, start : start + self.dims[table]]

    def local_shards(self) -> list[tuple[TableShard, Any]]:
        """The table shards this process holds, each with its variable: what
        `GradientPiece.target` indexes."""
        raise NotImplementedError

    # ------------------------------------------------------------ the step

    @property
    def exchanges_ids(self) -> bool:
        """Whether ids cross between the ranks before the lookups, so that a step
        can take them exchanged ahead (`exchange_ids`, `forward`'s `exchanged`)."""
        return False

    def exchange_ids(self, ids: Any, local_rows: Any) -> Any:
        """The exchange of `ids` between the ranks alone, for a later `forward`
        of the same ids (only where `exchanges_ids`)."""
        raise ValueError(f"{type(self).__name__} exchanges no ids")

    def forward(
        self, ids: Any, local_rows: Any, spans: Sequence[Span], exchanged: Any = None
    ) -> EmbeddingLookup:
        """The vectors of each span [start, stop) of the local rows (stop None:
        to the end), [rows, sum of D_t] in `output_dtype`, and what `backward`
        needs. `ids` are what the loader gives this process; `exchanged`, what
        `exchange_ids` made of them, if it ran."""
        raise NotImplementedError

    def backward(
        self, lookup: EmbeddingLookup, vector_gradients: Sequence[tf.Tensor]
    ) -> EmbeddingGradients:
        """The tables' gradients from the gradient of each span's vectors."""
        raise NotImplementedError

    def apply_gradients(
        self,
        gradients: EmbeddingGradients,
        optimizer: Optimizer,
        learning_rate: tf.Tensor,
        gradient_scale: tf.Tensor | None = None,
    ) -> None:
        """The optimizer's rule on the rows the step looked up, with the project's
        kernel where `use_kernels` (one op for every shard), else TensorFlow's
        ops. Call before `optimizer.apply` of the dense gradients, which ends
        the optimizer's step."""
        learning_rate = tf.cast(learning_rate, tf.float32)
        if gradients.receipt is not None:
            # The receipt depends on every exchange of the step (see
            # `sharded.StepExchanges`). Checked by an assertion, a stateful op
            # that tf.function always runs, it keeps every exchange in the step,
            # on a rank with no rows to update too (no shard, no replicated table).
            tf.debugging.assert_equal(
                gradients.receipt, 0, message="the exchanges' receipt is not zero"
            )
        apply_pieces(
            gradients.pieces,
            self.local_shards(),
            optimizer,
            learning_rate,
            gradient_scale,
            use_kernels=self.use_kernels,
            seed=self.seed,
        )

    def call(self, ids: Any, local_rows: Any = None) -> tf.Tensor:
        """Vectors [L, sum of D] (`output_dtype`) of the local rows, tables side by side."""
        if local_rows is None:
            local_rows = self.default_local_rows(ids)
        return self.forward(ids, local_rows, [(0, None)]).chunks[0].vectors

    def default_local_rows(self, ids: Any) -> Any:
        first = ids[0] if isinstance(ids, (tuple, list)) else ids
        if isinstance(first, tf.RaggedTensor):
            return first.nrows(out_type=tf.int32)
        return tf.shape(first)[0]


# A span of a batch's rows: [start, stop), stop None for the end of the batch.
Span = tuple[int, int | None]


class ChunkLookup(NamedTuple):
    """One span's vectors [rows, sum of D_t], and the ids its backward needs (in
    the layer's own form)."""

    vectors: tf.Tensor
    ids: Any


class EmbeddingLookup(NamedTuple):
    """`forward`'s result: one `ChunkLookup` per span, and the layer's state of
    the step (its exchanges between ranks; None on one process)."""

    chunks: list[ChunkLookup]
    step: Any = None


class EmbeddingGradients(NamedTuple):
    """`backward`'s result.

    Attributes:
        pieces: the gradient of every shard this process updates.
        finite: whether what the layer summed over ranks is finite (what each
            rank computed itself is the trainer's to check: the vectors'
            gradient).
        receipt: a zero that depends on every exchange of the step, which
            `apply_gradients` checks; None on one process.
    """

    pieces: list[GradientPiece]
    finite: tf.Tensor
    receipt: tf.Tensor | None = None


def rows_of(ids: Any, start: int, stop: int | None) -> Any:
    """Rows [start, stop) of the loader's ids ([B, n], or a tuple of [B, hotness]
    and ragged [B, None]); all of them when the span is the whole batch."""
    if start == 0 and stop is None:
        return ids
    if isinstance(ids, (tuple, list)):
        return tuple(x[start:stop] for x in ids)
    return ids[start:stop]
