"""What the trainer, evaluator and checkpoints need of an embeddings layer.

`LocalEmbeddings` (every table on this process) and `ShardedEmbeddings` (a
`ShardingPlan` across ranks) implement it, so the model, trainer and `main.py`
do not change when tables are sharded. A lookup is three steps, which the
trainer calls one by one so that the collectives of the last one run outside
autodiff (see `dlrm/embedding/sharded.py`):

1. `input_distribution(ids, local_rows)`: ids routed to where they are looked up;
2. `local_lookup(routed, local_rows)`: what this process looks up, on the tape;
3. `output_distribution(looked_up, local_rows)`: the vectors of the local rows,
   [L, D_0 + ... + D_{T-1}] (each table's D_t columns side by side, in table
   order, so that tables may differ in width); `output_distribution_gradient`
   is its backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from dlrm import kernels
from dlrm.config import POOLINGS
from dlrm.embedding.initializer import initial_table_values
from dlrm.embedding.shard import TableShard

# Rows are written into table variables in chunks of at most this many bytes.
CHUNK_BYTES = 64 << 20


# The most rows whose shape fits int32: TensorFlow's own gather gradient states
# the variable's shape as int32 (`ResourceGather`'s gradient, `variable_shape`).
_INT32_ROWS = int(np.iinfo(np.int32).max)


def gather_rows(variable: Any, ids: tf.Tensor) -> tf.Tensor:
    """Rows `ids` of a tf.Variable [rows, D]: [*ids.shape, D], differentiable
    with respect to the variable as `tf.IndexedSlices` (the rows looked up).

    Tables of more than 2^31 - 1 rows cannot use `tf.gather`'s gradient: it builds
    the dense shape as an int32 constant, which wraps negative (2^31 + 16 rows
    become -2147483632), and tracing the step fails ("Invalid value in tensor
    used for shape"; eagerly it would silently carry the wrong shape). Those take
    `_gather_with_int64_shape`; smaller tables keep `tf.gather` as it is.
    """
    rows = variable.shape[0]
    if rows is not None and rows <= _INT32_ROWS:
        return tf.gather(variable, ids)
    return _gather_with_int64_shape(variable, ids)


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
    """Row ids[:, t] of every table t side by side: [B, sum of D_t] in
    `output_dtype`, for one-hot ids [B, T] (int32 or int64). One op of the
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


def fused_sgd(
    variables: Sequence[Any], ids: tf.Tensor, gradient: tf.Tensor, learning_rate: tf.Tensor
) -> None:
    """SGD on the rows `fused_lookup(variables, ids)` read, from the gradient
    [B, sum of D_t] of its output (`DlrmEmbeddingSgd`): never split by table.
    Duplicate ids apply in turn, the summed gradient's update."""
    tables = [resource_variable(v) for v in variables]
    if gradient.dtype not in (tf.float32, tf.bfloat16):
        gradient = tf.cast(gradient, tf.float32)
    kernels.require().dlrm_embedding_sgd(
        tables=[table.handle for table in tables],
        ids=ids,
        gradient=gradient,
        learning_rate=tf.cast(learning_rate, tf.float32),
        widths=[int(table.shape[1]) for table in tables],
    )


def resource_variable(variable: Any) -> tf.Variable:
    """The tf.Variable behind a Keras 3 variable (or the variable itself)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def assign_rows(variable: Any, start: int, values: np.ndarray) -> None:
    """variable[start : start + len(values)] = values, in place.

    `variable[a:b].assign(...)` reads the variable first, and that read keeps its
    buffer shared, so the next sliced assign copies the whole table; the raw op
    on the handle does not.
    """
    # int64 bounds: a table may have more than 2^31 rows.
    tf.raw_ops.ResourceStridedSliceAssign(
        ref=resource_variable(variable).handle,
        begin=tf.constant([start, 0], tf.int64),
        end=tf.constant([start + len(values), values.shape[1]], tf.int64),
        strides=tf.constant([1, 1], tf.int64),
        value=values,
    )


def read_rows(variable: Any, start: int, stop: int) -> np.ndarray:
    """A copy of variable[start:stop], [stop - start, D] float32.

    A gather of the int64 row range: reading the variable (`variable[a:b]`,
    `.numpy()`) copies the whole table once sparse updates have put it in
    copy-on-read mode, and the gather copies only the rows asked for (with
    their int64 indices, 8 bytes a row).
    """
    handle = resource_variable(variable).handle
    rows = tf.range(start, stop, dtype=tf.int64)
    values = tf.raw_ops.ResourceGather(resource=handle, indices=rows, dtype=tf.float32)
    return np.asarray(values.numpy())


class Embeddings(keras.layers.Layer):
    """Base of the embeddings layers: float32 tables [rows_t, D_t].

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
            65536 peaked at 3.8 GiB instead of 5.7); the tables stay float32.
    """

    def __init__(
        self,
        cardinalities: Sequence[int],
        dims: Sequence[int],
        hotness: Sequence[int],
        seed: int = 0,
        pooling: Sequence[str] | None = None,
        output_dtype: Any = tf.float32,
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
        self.pooling = tuple(pooling) if pooling is not None else ("sum",) * len(self.dims)
        if len(self.pooling) != len(self.dims) or not set(self.pooling) <= set(POOLINGS):
            raise ValueError(
                f"pooling: expected one of {list(POOLINGS)} per table ({len(self.dims)}), "
                f"got {list(self.pooling)}"
            )
        # Table t's columns in the output: [offsets[t], offsets[t] + dims[t]).
        self.offsets = tuple(int(sum(self.dims[:t])) for t in range(len(self.dims)))
        self.seed = seed
        self.output_dtype = tf.as_dtype(output_dtype)
        if self.output_dtype not in (tf.float32, tf.bfloat16, tf.float16):
            raise ValueError(
                f"output_dtype: expected float32, bfloat16 or float16, got {output_dtype}"
            )

    def create_shard_variable(self, shard: TableShard) -> Any:
        """The shard's tf.Variable, filled with its initial values in row chunks,
        so that creating it needs the shard's memory once plus a chunk (handing
        Keras the whole array made three copies of it)."""
        rows, dim, seed = self.cardinalities[shard.table], self.dims[shard.table], self.seed
        variable = self.add_weight(
            shape=(shard.height, shard.width),
            initializer="zeros",
            name=shard.name.replace(".", "_"),
            dtype="float32",
        )
        step = max(1, CHUNK_BYTES // (4 * shard.width))
        for start in range(0, shard.height, step):
            stop = min(shard.height, start + step)
            rows_range = (shard.rows[0] + start, shard.rows[0] + stop)
            values = initial_table_values(shard.table, rows, dim, seed, rows_range, shard.columns)
            assign_rows(variable, start, values)
        # Lookups, gradients and updates use the tf.Variable behind the Keras one
        # (which Keras still tracks): tf.gather on a Keras 3 variable reads the
        # whole table densely, and after a sparse update that read copies it
        # (measured: a 1 GiB table's first lookup peaked 1 GiB higher; 26 tables
        # of 100,000 x 128 in a bare gather-and-update loop took 1.1-1.3 s per
        # step that way, 0.15 s on the tf.Variable).
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
        """The table shards this process holds, each with its variable."""
        raise NotImplementedError

    def fused_ids(self, ids: Any) -> tf.Tensor | None:
        """The [B, T] id matrix when the layer looks `ids` up with the fused
        kernel (`fused_lookup`), whose tables the trainer's SGD may then update
        from the vectors' undivided gradient (`apply_fused_sgd`); else None."""
        return None

    def apply_fused_sgd(self, ids: tf.Tensor, gradient: tf.Tensor, learning_rate: Any) -> None:
        """SGD on the tables from the gradient of `call`'s vectors, for ids that
        `fused_ids` accepted."""
        raise NotImplementedError

    @property
    def holds_model_parallel_shards(self) -> bool:
        """Whether this process holds a shard that other ranks' lookups reach."""
        return False

    def gradient_exchange(self, variable: Any) -> str | None:
        """How `variable`'s gradient is summed over ranks: None (it is not: one
        process, or a model-parallel shard), "dense" or "sparse" (a replicated
        table; see `planner.replicated_gradient_exchange`)."""
        return None

    # ------------------------------------------------------------ the lookup

    def input_distribution(self, ids: Any, local_rows: Any) -> Any:
        raise NotImplementedError

    def local_lookup(self, routed: Any, local_rows: Any) -> Any:
        raise NotImplementedError

    def output_distribution(self, looked_up: Any, local_rows: Any, chunk: int = 0) -> tf.Tensor:
        raise NotImplementedError

    def output_distribution_gradient(
        self, gradient: tf.Tensor, local_rows: Any, chunk: int = 0
    ) -> Any:
        raise NotImplementedError

    def chunk_ids(self, routed: Any, local_rows: int, start: int, stop: int) -> Any:
        """Step 1's result for rows [start, stop) of each rank's local rows, or None
        when the layer exchanges no vectors between ranks (nothing to overlap)."""
        return None

    def lookup(self, ids: Any, local_rows: Any) -> Any:
        """Steps 1 and 2; record on a tape to get the tables' gradients."""
        return self.local_lookup(self.input_distribution(ids, local_rows), local_rows)

    def call(self, ids: Any, local_rows: Any = None) -> tf.Tensor:
        """Vectors [L, sum of D] (`output_dtype`) of the local rows, tables side by side."""
        if local_rows is None:
            local_rows = self.default_local_rows(ids)
        return self.output_distribution(self.lookup(ids, local_rows), local_rows)

    def default_local_rows(self, ids: Any) -> Any:
        first = ids[0] if isinstance(ids, (tuple, list)) else ids
        if isinstance(first, tf.RaggedTensor):
            return first.nrows(out_type=tf.int32)
        return tf.shape(first)[0]
