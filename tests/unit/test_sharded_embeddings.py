"""ShardedEmbeddings' three steps and explicit backward on W ranks simulated in one
process (threads, tests/unit/simulated_ranks.py): every rank's vectors and every
shard's gradient are those of LocalEmbeddings on the global batch, for plans of
every kind, ranks that hold no model-parallel shard, and both input modes. Real
horovodrun processes run the same plans in tests/integration/test_hybrid_parallel.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from dlrm.embedding.local import LocalEmbeddings
from dlrm.embedding.planner import TableSpec
from dlrm.embedding.shard import ShardingKind
from dlrm.embedding.sharded import ShardedEmbeddings
from tests.integration.scripts.hybrid_steps import DIM, plan_for
from tests.unit.simulated_ranks import SimulatedCollectives, run_ranks

CARDINALITIES = (23, 7, 300, 11, 5)
HOTNESS = (1, 2, 1, 3, 1)
GLOBAL_BATCH = 12  # divides by 2 and 3
SEED = 3


def global_batch(rng: np.random.Generator) -> list[np.ndarray]:
    return [
        rng.integers(0, c, (GLOBAL_BATCH, h)).astype(np.int32)
        for c, h in zip(CARDINALITIES, HOTNESS, strict=True)
    ]


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """LocalEmbeddings' vectors and table gradients for one global batch."""
    rng = np.random.default_rng(0)
    ids = global_batch(rng)
    upstream = rng.normal(size=(GLOBAL_BATCH, len(CARDINALITIES), DIM)).astype(np.float32)
    local = LocalEmbeddings(CARDINALITIES, DIM, seed=SEED, hotness=HOTNESS)
    with tf.GradientTape() as tape:
        vectors = local(tuple(ids))
    gradients = tape.gradient(vectors, local.tables, output_gradients=tf.constant(upstream))
    return {
        "ids": ids,
        "upstream": upstream,
        "vectors": vectors.numpy(),
        "gradients": [tf.convert_to_tensor(g).numpy() for g in gradients],
        "tables": [t.numpy() for t in local.tables],
    }


def one_rank(
    collectives: SimulatedCollectives, kind: str, data_parallel_input: bool, ref: dict[str, Any]
) -> dict[str, Any]:
    rank, world = collectives.rank, collectives.world_size
    specs = [TableSpec(c, DIM, h) for c, h in zip(CARDINALITIES, HOTNESS, strict=True)]
    layer = ShardedEmbeddings(
        plan_for(kind, specs, world, GLOBAL_BATCH),
        collectives,
        seed=SEED,
        data_parallel_input=data_parallel_input,
    )
    local_rows = GLOBAL_BATCH // world
    mine = slice(rank * local_rows, (rank + 1) * local_rows)
    if data_parallel_input:  # every table, the local rows
        ids = tuple(tf.constant(x[mine]) for x in ref["ids"])
    else:  # the tables this rank reads, the global batch, as the loader gives them
        ids = tuple(tf.constant(ref["ids"][t]) for t in layer.input_tables)
    with tf.GradientTape() as tape:
        looked_up = layer.lookup(ids, local_rows)
    vectors = layer.output_distribution(looked_up, local_rows)
    lookup_gradients = layer.output_distribution_gradient(
        tf.constant(ref["upstream"][mine]), local_rows
    )
    shards = layer.local_shards()
    gradients = tape.gradient(looked_up, [v for _, v in shards], output_gradients=lookup_gradients)
    return {
        "vectors": vectors.numpy(),
        "shards": [
            (
                shard,
                variable.numpy(),
                None if g is None else tf.convert_to_tensor(g).numpy(),
            )
            for (shard, variable), g in zip(shards, gradients, strict=True)
        ],
        "holds_model_parallel": bool(layer.mine),
    }


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "kind", ["mixed", "idle_rank", "row_wise_rank", "planner", "data_parallel", "column_wise"]
)
@pytest.mark.parametrize("data_parallel_input", [False, True])
def test_ranks_get_the_vectors_and_gradients_of_one_process(
    reference: dict[str, Any], world_size: int, kind: str, data_parallel_input: bool
) -> None:
    results = run_ranks(world_size, lambda c: one_rank(c, kind, data_parallel_input, reference))
    local_rows = GLOBAL_BATCH // world_size
    replicated_sum: dict[int, np.ndarray] = {}
    for rank, result in enumerate(results):
        rows = slice(rank * local_rows, (rank + 1) * local_rows)
        np.testing.assert_allclose(
            result["vectors"], reference["vectors"][rows], rtol=1e-5, atol=1e-7
        )
        for shard, values, gradient in result["shards"]:
            whole = (slice(*shard.rows), slice(*shard.columns))
            # Initial values: the slice of the one-process table.
            np.testing.assert_array_equal(values, reference["tables"][shard.table][whole])
            gradient = np.zeros_like(values) if gradient is None else gradient
            if shard.kind == ShardingKind.DATA_PARALLEL:  # summed over ranks by the trainer
                replicated_sum[shard.table] = replicated_sum.get(shard.table, 0) + gradient
            else:
                expected = reference["gradients"][shard.table][whole]
                np.testing.assert_allclose(gradient, expected, rtol=1e-5, atol=1e-6)
    for table, gradient in replicated_sum.items():
        np.testing.assert_allclose(gradient, reference["gradients"][table], rtol=1e-5, atol=1e-6)
    if kind == "idle_rank":
        assert [r["holds_model_parallel"] for r in results] == [True] + [False] * (world_size - 1)
