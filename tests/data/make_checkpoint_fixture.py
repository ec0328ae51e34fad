"""Writes the checkpoint fixture under tests/data/checkpoint_v<format version>/.

Run from the repository root: `.venv/bin/python -m tests.data.make_checkpoint_fixture`.
It writes with `CheckpointWriter` (numpy only, no TensorFlow) what a 2-rank run with
Adam writes: three tiny tables of odd sizes, one split by columns and one by rows
over ranks 0 and 1 (each rank's own writer, as `save_training_state` does), one
replicated (written once, by rank 0), every shard with Adam's `m` and `v` slots, and
dense weights with their slots and counters. The manifest carries the plan and the
fields a training run adds. Its values come from `table_values` and `dense_values`,
which `tests/unit/test_checkpoint_fixture.py` calls to check a restore bit for bit.

A committed fixture is a record of what older code wrote: rerunning this script with
newer code writes the newer format into another directory, and never replaces it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from dlrm.checkpoint.format import FORMAT_VERSION
from dlrm.checkpoint.writer import CheckpointWriter
from dlrm.embedding.planner.plan import ShardingPlan, TablePlan
from dlrm.embedding.planner.types import TableSpec
from dlrm.embedding.shard import ShardingKind, TableShard

STEP = 12
SLOTS = ("m", "v")
SHAPES = ((23, 7), (11, 5), (5, 3))
KINDS = (ShardingKind.COLUMN_WISE, ShardingKind.ROW_WISE, ShardingKind.DATA_PARALLEL)
# The shards each rank held: (table, rank, rows, columns).
SHARDS = (
    (0, 0, (0, 23), (0, 4)),
    (0, 1, (0, 23), (4, 7)),
    (1, 0, (0, 6), (0, 5)),
    (1, 1, (6, 11), (0, 5)),
    (2, 0, (0, 5), (0, 3)),
    (2, 1, (0, 5), (0, 3)),
)
DENSE_SHAPES = {
    "bottom_mlp/bottom_mlp_0/kernel": (3, 4),
    "bottom_mlp/bottom_mlp_0/bias": (4,),
    "top_mlp/top_mlp_0/kernel": (6, 1),
}


def _values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 values of `shape` from exact float64 arithmetic (the same bits on
    every machine), with a negative zero and a subnormal among them."""
    index = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    values = ((index * 0.37 - 5.0) * (seed % 7 + 1) + seed) / 3.0
    out = values.astype(np.float32)
    out.flat[0] = -0.0
    out.flat[-1] = np.float32(1e-40) * (seed + 1)
    return out


def table_values(table: int, slot: str | None = None) -> np.ndarray:
    """The whole of table `table` (or of its optimizer `slot`) as the fixture holds it."""
    return _values(SHAPES[table], 10 * table + (0 if slot is None else 1 + SLOTS.index(slot)))


def dense_values() -> dict[str, np.ndarray]:
    """Every array of `dense.npz`: weights, their Adam slots and the counters."""
    dense: dict[str, np.ndarray] = {
        "trainer/step": np.asarray(STEP, np.int64),
        "optimizer/iterations": np.asarray(STEP, np.int64),
    }
    for seed, (name, shape) in enumerate(DENSE_SHAPES.items()):
        dense[name] = _values(shape, 100 + 3 * seed)
        for offset, slot in enumerate(SLOTS, start=1):
            dense[f"{name}/{slot}"] = _values(shape, 100 + 3 * seed + offset)
    return dense


def table_shards() -> list[TableShard]:
    return [TableShard(t, KINDS[t], rank, rows, columns) for t, rank, rows, columns in SHARDS]


def plan() -> ShardingPlan:
    tables = tuple(
        TablePlan(
            t,
            KINDS[t],
            TableSpec(*SHAPES[t]),
            tuple(s for s in table_shards() if s.table == t),
        )
        for t in range(len(SHAPES))
    )
    return ShardingPlan(2, "cost", tables, optimizer_slots=len(SLOTS), global_batch_size=64)


def manifest_fields() -> dict[str, object]:
    """What a training run adds to the manifest (its `config` cut to a few flags)."""
    return {
        "config": {"batch_size": 64, "optimizer": "adam", "learning_rate": 0.01, "seed": 7},
        "model": {
            "num_numerical": 3,
            "cardinalities": [rows for rows, _ in SHAPES],
            "hotness": [1, 1, 1],
            "embedding_dim": [width for _, width in SHAPES],
            "bottom_mlp_dims": [4],
            "top_mlp_dims": [1],
            "interaction": "cross",
            "num_cross_layers": 1,
            "cross_layer_projection_dim": 0,
            "pooling": "sum",
        },
        "optimizer": {"name": "adam", "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-07},
        "precision": "float32",
        "world_size": 2,
        "plan": plan().to_dict(),
    }


def write(root: Path) -> Path:
    """Writes the fixture's checkpoint under `root` as ranks 0 and 1 would; returns it."""
    writers = [
        CheckpointWriter(root, STEP, create=True),
        CheckpointWriter(root, STEP, create=False),
    ]
    writers[0].add_dense(dense_values())
    for shard in table_shards():
        if shard.kind == ShardingKind.DATA_PARALLEL and shard.rank != 0:
            continue  # rank 0 writes the one copy
        rows, columns = slice(*shard.rows), slice(*shard.columns)
        writers[shard.rank].add_table_shard(
            shard,
            SHAPES[shard.table],
            table_values(shard.table)[rows, columns],
            {slot: table_values(shard.table, slot)[rows, columns] for slot in SLOTS},
        )
    gathered = [writer.contents() for writer in writers]
    return writers[0].commit(manifest_fields(), gathered=gathered)


def main() -> None:
    root = Path(__file__).parent / f"checkpoint_v{FORMAT_VERSION}"
    if root.exists():
        sys.exit(f"{root} exists: a fixture records what older code wrote; keep it")
    print(write(root))


if __name__ == "__main__":
    main()
