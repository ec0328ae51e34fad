"""The embedding update: the optimizer's rule applied to the rows a step looked up,
straight from the gradient of the lookups' outputs.

A layer's backward pass (`Embeddings.backward`) gives its gradient as
`GradientPiece`s: one table shard's part of one gradient tensor, with the ids
whose rows receive it. Nothing is split per table or expanded per id on the way:
with the project's CPU kernels loaded, one op (`DlrmEmbeddingApply`) sums each
row's gradient over its ids and pieces and applies SGD, Adagrad, lazy Adam or
row-wise Adagrad to that row in place, for every shard of the process at once
(a replicated table's summed gradient too, so it gets the row-wise rule). Without them,
`piece_slices` turns each piece into the row-sparse `tf.IndexedSlices` that
TensorFlow's own gather gradient would give, and the optimizer's TensorFlow ops
apply them (`Optimizer.apply_rows`): the same computation, slower.

A 16-bit table (bfloat16 or float16) is updated in float32 and stored back with
stochastic rounding, on either path with the same random bits: a hash of (the
run's `seed`, the optimizer's step, the table, the row's global id, the column's
global index; `dlrm.optim.rounding`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from dlrm import kernels
from dlrm.embedding.shard import ShardingKind, TableShard
from dlrm.optim.optimizers import Optimizer
from dlrm.optim.rounding import RowRounding
from dlrm.variables import resource_variable


class GradientPiece(NamedTuple):
    """One shard's part of one gradient tensor.

    Attributes:
        target: the shard's position in the layer's `local_shards()`.
        ids: [n] ids of the table (global: a row range's are offset by the
            kernel or `piece_slices`), int32 or int64.
        rows: [n] int32: the row of `gradient` that carries each id's gradient
            (i // hotness for fixed hotness, the row of a ragged value).
        gradient: [B, C] float32 or bfloat16: several shards' gradients side by
            side; this shard's `width` columns start at `column`.
        column: this shard's first column in `gradient`.
        scale: [B] float32 multiplying each gradient row (mean pooling: one
            over the row's number of ids), or None.
    """

    target: int
    ids: tf.Tensor
    rows: tf.Tensor
    gradient: tf.Tensor
    column: int
    scale: tf.Tensor | None = None


def pooled_piece(
    target: int, ids: Any, gradient: tf.Tensor, column: int, pooling: str
) -> GradientPiece:
    """The piece of a pooled lookup: ids [B, hotness] or a `tf.RaggedTensor`
    [B, None] whose rows' vectors were pooled (`pooling`) into the rows of
    `gradient`'s columns [column, column + width)."""
    if isinstance(ids, tf.RaggedTensor):
        flat = ids.values
        rows = tf.cast(ids.value_rowids(), tf.int32)
        counts = ids.row_lengths()
    else:
        hotness = ids.shape[1] if ids.shape.rank == 2 else 1
        flat = tf.reshape(ids, [-1])
        rows = tf.range(tf.size(flat, out_type=tf.int32), dtype=tf.int32) // hotness
        counts = None if hotness == 1 else tf.fill([tf.shape(ids)[0]], hotness)
    scale = None
    if pooling == "mean" and counts is not None:
        scale = 1.0 / tf.cast(tf.maximum(counts, 1), tf.float32)
    return GradientPiece(target, flat, rows, gradient, column, scale)


def piece_slices(piece: GradientPiece, shard: TableShard, gradient_scale: Any = None) -> Any:
    """The piece as the `tf.IndexedSlices` of the shard's variable [height,
    width] that TensorFlow's gather gradient gives: one gradient row per id
    inside the shard (a row range's ids offset to its rows, the others left
    out), float32."""
    gradient = piece.gradient[:, piece.column : piece.column + shard.width]
    values = tf.gather(tf.cast(gradient, tf.float32), piece.rows)
    if piece.scale is not None:
        values = values * tf.gather(piece.scale, piece.rows)[:, None]
    if gradient_scale is not None:
        values = values * tf.cast(gradient_scale, tf.float32)
    ids = piece.ids
    if shard.kind == ShardingKind.ROW_WISE:
        local = ids - tf.cast(shard.rows[0], ids.dtype)
        inside = tf.logical_and(local >= 0, local < shard.height)
        ids, values = tf.boolean_mask(local, inside), tf.boolean_mask(values, inside)
    shape = tf.constant([shard.height, shard.width], tf.int64)
    return tf.IndexedSlices(values, ids, shape)


def apply_pieces(
    pieces: Sequence[GradientPiece],
    shards: Sequence[tuple[TableShard, Any]],
    optimizer: Optimizer,
    learning_rate: tf.Tensor,
    gradient_scale: tf.Tensor | None = None,
    use_kernels: bool = False,
    seed: int = 0,
) -> None:
    """One optimizer step on the rows the pieces name, of the `shards`' variables
    (`local_shards()`). Each row's gradient is summed over its ids and pieces
    first, and the row is updated once; rows no piece names keep their values
    and slots. `gradient_scale` multiplies every gradient (one over the float16
    loss scale). `seed` keys the stochastic rounding of 16-bit tables."""
    if not pieces:
        return
    if use_kernels:
        _apply_with_kernel(pieces, shards, optimizer, learning_rate, gradient_scale, seed)
        return
    by_target: dict[int, list[Any]] = {}
    for piece in pieces:
        shard = shards[piece.target][0]
        by_target.setdefault(piece.target, []).append(piece_slices(piece, shard, gradient_scale))
    for target, slices in by_target.items():
        shard, variable = shards[target]
        rounding = RowRounding(seed, shard.table, shard.rows[0], shard.columns[0])
        optimizer.apply_rows(variable, concatenated_slices(slices), learning_rate, rounding)


def concatenated_slices(slices: list[tf.IndexedSlices]) -> tf.IndexedSlices:
    """One tf.IndexedSlices of `slices`' rows in order; their ids in int64 when
    any slice's are (a table of more than 2^31 rows)."""
    if len(slices) == 1:
        return slices[0]
    dtype = tf.int64 if any(s.indices.dtype == tf.int64 for s in slices) else tf.int32
    return tf.IndexedSlices(
        tf.concat([s.values for s in slices], 0),
        tf.concat([tf.cast(s.indices, dtype) for s in slices], 0),
        slices[0].dense_shape,
    )


def _apply_with_kernel(
    pieces: Sequence[GradientPiece],
    shards: Sequence[tuple[TableShard, Any]],
    optimizer: Optimizer,
    learning_rate: tf.Tensor,
    gradient_scale: tf.Tensor | None,
    seed: int,
) -> None:
    """`DlrmEmbeddingApply` on every shard a piece names, in one op."""
    targets = sorted({piece.target for piece in pieces})
    position = {target: index for index, target in enumerate(targets)}
    variables = [shards[t][1] for t in targets]
    slots = [optimizer.slots(v)[name] for v in variables for name in optimizer.slot_names]
    id_dtype = tf.int64 if any(p.ids.dtype == tf.int64 for p in pieces) else tf.int32
    gradient_dtype = (
        tf.bfloat16 if all(p.gradient.dtype == tf.bfloat16 for p in pieces) else tf.float32
    )
    beta_1_power, beta_2_power = optimizer.bias_correction_powers()
    rule = optimizer.kernel_rule()
    kernels.require().dlrm_embedding_apply(
        tables=[resource_variable(v).handle for v in variables],
        slots=[resource_variable(s).handle for s in slots],
        ids=[tf.cast(p.ids, id_dtype) for p in pieces],
        rows=[tf.cast(p.rows, tf.int32) for p in pieces],
        gradients=[tf.cast(p.gradient, gradient_dtype) for p in pieces],
        row_scales=[tf.zeros([0]) if p.scale is None else p.scale for p in pieces],
        learning_rate=tf.cast(learning_rate, tf.float32),
        gradient_scale=tf.constant(1.0) if gradient_scale is None else gradient_scale,
        beta_1_power=beta_1_power,
        beta_2_power=beta_2_power,
        step=tf.convert_to_tensor(optimizer.iterations, tf.int64),
        piece_tables=[position[p.target] for p in pieces],
        piece_columns=[p.column for p in pieces],
        row_offsets=[shards[t][0].rows[0] for t in targets],
        partial=[shards[t][0].kind == ShardingKind.ROW_WISE for t in targets],
        seed=seed,
        table_ids=[shards[t][0].table for t in targets],
        column_offsets=[shards[t][0].columns[0] for t in targets],
        **rule,
    )
