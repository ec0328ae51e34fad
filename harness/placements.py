"""Placements of embedding tables on ranks, made by hand: each sharding kind for a
table (`table_plan`), and the placements `plan_for` names (the script
harness/scripts/hybrid_steps.py lists them), which give a rank no
model-parallel shard, only row ranges, or every kind at once."""

from __future__ import annotations

import numpy as np

from dlrm.embedding.planner.placement import PlannerConfig, plan_sharding
from dlrm.embedding.planner.plan import ShardingPlan, TablePlan
from dlrm.embedding.planner.types import TableSpec
from dlrm.embedding.shard import ShardingKind, TableShard

# The tables' width in the models these placements train.
DIM = 6
UNIFORM = ("data_parallel", "table_wise", "column_wise", "row_wise")


def table_plan(t: int, spec: TableSpec, kind: str, world: int, rank: int = 0) -> TablePlan:
    """Table `t` placed as `kind` (whole on `rank` when table-wise)."""
    sharding = ShardingKind(kind)
    if sharding == ShardingKind.DATA_PARALLEL:
        places = [(r, (0, spec.rows), (0, spec.dim)) for r in range(world)]
    elif sharding == ShardingKind.TABLE_WISE:
        places = [(rank, (0, spec.rows), (0, spec.dim))]
    elif sharding == ShardingKind.COLUMN_WISE:
        edges = np.linspace(0, spec.dim, world + 1).astype(int)
        places = [(r, (0, spec.rows), (int(edges[r]), int(edges[r + 1]))) for r in range(world)]
    else:
        edges = np.linspace(0, spec.rows, world + 1).astype(int)
        places = [(r, (int(edges[r]), int(edges[r + 1])), (0, spec.dim)) for r in range(world)]
    shards = tuple(TableShard(t, sharding, r, rows, cols) for r, rows, cols in places)
    return TablePlan(t, sharding, spec, shards)


# The planner's threshold under the `planner` placement: the smallest tables replicated.
PLANNER_DATA_PARALLEL_THRESHOLD = 10 * DIM


def plan_for(kind: str, specs: list[TableSpec], world: int, batch: int) -> ShardingPlan:
    """The plan of placement `kind`; replicated tables' gradients are exchanged as
    the planner's cost model chooses at `batch` (dense for the smallest tables).
    (harness/scripts/hybrid_steps.py leaves `planner` to `assemble_run`,
    as `dlrm-train` does.)"""
    if kind == "planner":
        config = PlannerConfig(
            world_size=world,
            data_parallel_threshold=PLANNER_DATA_PARALLEL_THRESHOLD,
            global_batch_size=batch,
        )
        return plan_sharding(specs, config)
    tables = []
    for t, spec in enumerate(specs):
        if kind in UNIFORM:
            tables.append(table_plan(t, spec, kind, world, rank=t % world))
        elif kind == "mixed":
            tables.append(table_plan(t, spec, UNIFORM[t % 4], world, rank=t % world))
        elif kind == "idle_rank":
            tables.append(table_plan(t, spec, "table_wise" if t == 0 else "data_parallel", world))
        elif kind == "one_rank":
            tables.append(table_plan(t, spec, "table_wise", world))
        elif kind == "row_wise_rank":
            if t % 2 == 0 or world == 1:
                tables.append(table_plan(t, spec, "row_wise", world))
            else:
                tables.append(table_plan(t, spec, "table_wise", world, rank=t % (world - 1)))
        else:
            raise ValueError(f"unknown placement {kind!r}")
    return ShardingPlan(world, "basic", tuple(tables), global_batch_size=batch)
