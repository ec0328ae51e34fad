"""ShardedEmbeddings on one process: any split of the tables gives the vectors and
gradients of LocalEmbeddings (the multi-rank cases run under horovodrun in
tests/integration/test_hybrid_parallel.py)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from dlrm.dist import Collectives
from dlrm.embedding.local import LocalEmbeddings
from dlrm.embedding.sharded import ShardAssignment, ShardedEmbeddings

CARDINALITIES = (23, 7, 11, 13)
DIM = 6


def assignments() -> list[ShardAssignment]:
    return [
        ShardAssignment(0, "row_wise", 0, (0, 10), (0, DIM)),
        ShardAssignment(0, "row_wise", 0, (10, 23), (0, DIM)),
        ShardAssignment(1, "data_parallel", 0, (0, 7), (0, DIM)),
        ShardAssignment(2, "column_wise", 0, (0, 11), (4, 6)),
        ShardAssignment(2, "column_wise", 0, (0, 11), (0, 4)),
        ShardAssignment(3, "table_wise", 0, (0, 13), (0, DIM)),
    ]


@pytest.mark.parametrize("hotness", [(1, 1, 1, 1), (2, 1, 3, 1)])
@pytest.mark.parametrize("data_parallel_input", [False, True])
def test_one_rank_split_equals_local_tables(
    hotness: tuple[int, ...], data_parallel_input: bool
) -> None:
    rng = np.random.default_rng(0)
    sharded = ShardedEmbeddings(
        assignments(),
        CARDINALITIES,
        hotness,
        DIM,
        Collectives(),
        seed=3,
        data_parallel_input=data_parallel_input,
    )
    local = LocalEmbeddings(CARDINALITIES, DIM, seed=3)
    assert sharded.input_tables == (0, 1, 2, 3)
    ids = [
        rng.integers(0, c, (9, h)).astype(np.int32)
        for c, h in zip(CARDINALITIES, hotness, strict=True)
    ]
    inputs = np.concatenate(ids, 1) if set(hotness) == {1} else tuple(ids)
    upstream = tf.constant(rng.normal(size=(9, 4, DIM)).astype(np.float32))
    with tf.GradientTape(persistent=True) as tape:
        got = sharded(inputs)
        expected = local(inputs)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6)
    # Gradients: each shard's equals the matching slice of the whole table's.
    local_grads = tape.gradient(expected, local.tables, output_gradients=upstream)
    shards = sharded.local_shards()
    shard_grads = tape.gradient(got, [s.variable for s in shards], output_gradients=upstream)
    for shard, grad in zip(shards, shard_grads, strict=True):
        whole = tf.convert_to_tensor(local_grads[shard.table]).numpy()
        part = whole[shard.rows[0] : shard.rows[1], shard.columns[0] : shard.columns[1]]
        np.testing.assert_allclose(tf.convert_to_tensor(grad).numpy(), part, atol=1e-6)
    assert [s.replicated for s in shards].count(True) == 1
    assert len(sharded.replicated_variables) == 1


def test_initial_values_are_slices_of_the_one_process_tables() -> None:
    sharded = ShardedEmbeddings(assignments(), CARDINALITIES, (1,) * 4, DIM, Collectives(), seed=9)
    local = LocalEmbeddings(CARDINALITIES, DIM, seed=9)
    for shard in sharded.local_shards():
        whole = local.tables[shard.table].numpy()
        np.testing.assert_array_equal(
            shard.variable.numpy(),
            whole[shard.rows[0] : shard.rows[1], shard.columns[0] : shard.columns[1]],
        )
