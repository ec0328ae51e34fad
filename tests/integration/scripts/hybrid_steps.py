"""Trains a few steps with given placements of the embedding tables and saves the
resulting weights, under horovodrun or as one process.

Usage: hybrid_steps.py DATASET OUT STEPS GLOBAL_BATCH RUN...
RUN is KIND:INPUT_MODE:OPTIMIZER[:VARIANT]. KIND is `local` (LocalEmbeddings,
one process) or a placement on the ranks:
- data_parallel, table_wise, column_wise, row_wise: every table so placed;
- mixed: the four kinds in turn;
- planner: what `plan_sharding` makes of the tables (every rank gets a shard);
- idle_rank: table 0 whole on rank 0, the others replicated: the other ranks
  hold no model-parallel shard (with one table, they read no ids at all);
- row_wise_rank: the last rank holds only row ranges.
VARIANT is fp32 (default), or a `+`-joined set of: amp (the CPU's
mixed_bfloat16 policy), xla (the dense part compiled), cross (the DCNv2 cross
interaction, with tables of unequal widths `CROSS_WIDTHS`), mean (every table
pools a row's vectors by mean: with variable-length tables, by their count),
chunks (the dense part over chunks of `CHUNK_ROWS` of a rank's rows, their
gradients summed; otherwise the whole batch at once).
As main.py on CPUs, the model runs on the project's CPU kernels (dlrm.kernels);
under xla all but the interaction's, which XLA's compiled dense part leaves out.
A variable-length table is costed by the planner as 2 ids per row. Writes
OUT/<RUN with : as _>/rank<r>.npz: dense weights by name, each shard as
"table_<t>_<r0>_<r1>_<c0>_<c1>", the per-step losses and the rank's hostname.
"""

import socket
import sys
from pathlib import Path

import keras
import numpy as np

from dataloading.split_binary import InputMode, ShardSpec, SplitBinaryDataset
from dlrm.dist import create_collectives
from dlrm.embedding.planner import (
    PlannerConfig,
    ShardingPlan,
    TablePlan,
    TableSpec,
    plan_sharding,
)
from dlrm.embedding.shard import ShardingKind, TableShard
from dlrm.embedding.sharded import ShardedEmbeddings
from dlrm.model import Dlrm, ModelConfig
from dlrm.optimizers import create_optimizer, variable_name
from dlrm.precision import choose_precision
from dlrm.schedule import DlrmSchedule, ScheduleConfig
from dlrm.trainer import Trainer
from feature_spec import FeatureSpec

DIM = 6
CHUNK_ROWS = 20  # under the chunks variant: 96 rows are 20 x 4 + 16, 48 are 20 x 2 + 8
CROSS_WIDTHS = (4, 6, 8)  # table t is CROSS_WIDTHS[t % 3] wide under the cross variant
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


def plan_for(kind: str, specs: list[TableSpec], world: int, batch: int) -> ShardingPlan:
    """The plan of `kind`; replicated tables' gradients are exchanged as the
    planner's cost model chooses at `batch` (dense for the smallest tables)."""
    if kind == "planner":
        config = PlannerConfig(
            world_size=world, data_parallel_threshold=10 * DIM, global_batch_size=batch
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
        elif kind == "row_wise_rank":
            if t % 2 == 0 or world == 1:
                tables.append(table_plan(t, spec, "row_wise", world))
            else:
                tables.append(table_plan(t, spec, "table_wise", world, rank=t % (world - 1)))
        else:
            raise ValueError(f"unknown placement {kind!r}")
    return ShardingPlan(world, "basic", tuple(tables), global_batch_size=batch)


def main() -> None:
    dataset, out, steps, batch = sys.argv[1:5]
    collectives = create_collectives()
    spec = FeatureSpec.load(dataset)
    for run in sys.argv[5:]:
        kind, input_mode, optimizer, *variant = run.split(":")
        directory = Path(out) / run.replace(":", "_")
        directory.mkdir(parents=True, exist_ok=True)
        train(
            spec,
            collectives,
            kind,
            input_mode,
            optimizer,
            set(variant[0].split("+")) if variant else set(),
            int(steps),
            int(batch),
            directory,
        )


def model_config(spec: FeatureSpec, cross: bool, mean: bool = False) -> ModelConfig:
    tables = len(spec.cardinalities)
    return ModelConfig(
        len(spec.numerical_features),
        spec.cardinalities,
        spec.hotness,
        embedding_dim=tuple(CROSS_WIDTHS[t % 3] for t in range(tables)) if cross else DIM,
        bottom_mlp_dims=(9, DIM),
        top_mlp_dims=(11, 1),
        interaction="cross" if cross else "dot",
        num_cross_layers=2 if cross else 0,
        cross_layer_projection_dim=5 if cross else 0,
        pooling="mean" if mean else "sum",
    )


def train(spec, collectives, kind, input_mode, optimizer, variant, steps, batch, directory) -> None:
    rank, world = collectives.rank, collectives.world_size
    config = model_config(spec, "cross" in variant, "mean" in variant)
    keras.utils.set_random_seed(1)
    data_parallel_input = input_mode == "data_parallel"
    embeddings = None
    precision = choose_precision("amp" in variant, has_gpu=False)
    if kind != "local":
        specs = [
            TableSpec(rows, dim, h or 2)
            for rows, dim, h in zip(
                spec.cardinalities, config.embedding_dims, spec.hotness, strict=True
            )
        ]
        plan = plan_for(kind, specs, world, batch)
        embeddings = ShardedEmbeddings(
            plan,
            collectives,
            seed=1,
            data_parallel_input=data_parallel_input,
            wire_dtype=precision.compute_dtype,  # as main.py: 16 bits under --amp
            output_dtype=precision.compute_dtype,
            hotness=spec.hotness,
            pooling=config.poolings,
        )
    model = Dlrm(
        config,
        embeddings=embeddings,
        dtype_policy=precision.dtype_policy,
        seed=1,
        use_xla="xla" in variant,
        use_kernels=True,  # as main.py: the interaction's only where not compiled
    )
    lr = {"sgd": 0.5, "adagrad": 0.1, "adam": 0.01}[optimizer]
    trainer = Trainer(
        model,
        create_optimizer(optimizer),
        DlrmSchedule(ScheduleConfig(lr)),
        precision,
        batch,
        use_xla="xla" in variant,
        collectives=collectives,
        dense_chunk_rows=CHUNK_ROWS if "chunks" in variant else 0,
    )
    collectives.broadcast_variables(trainer.dense_variables)
    local_tables = None
    if kind != "local" and not data_parallel_input:
        local_tables = model.embeddings.input_tables
    shard = ShardSpec(
        batch,
        rank,
        world,
        local_tables,
        InputMode.DATA_PARALLEL if data_parallel_input else InputMode.MODEL_PARALLEL,
    )
    data = SplitBinaryDataset(spec, "train", shard).to_tf_dataset().take(steps)
    losses = [float(trainer.train_step(b)) for b in data]
    trainer.check_finite()
    arrays = {variable_name(v): v.numpy() for v in trainer.dense_variables}
    for s, variable in model.embeddings.local_shards():
        key = f"table_{s.table}_{s.rows[0]}_{s.rows[1]}_{s.columns[0]}_{s.columns[1]}"
        arrays[key] = variable.numpy()
    arrays["losses"] = np.array(losses)
    arrays["hostname"] = np.array(socket.gethostname())
    np.savez(directory / f"rank{rank}.npz", **arrays)


if __name__ == "__main__":
    main()
