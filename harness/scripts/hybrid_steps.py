"""Trains a few steps with given placements of the embedding tables and saves the
resulting weights, under horovodrun or as one process.

Usage: hybrid_steps.py STEPS GLOBAL_BATCH DATASET OUT RUN... [-- DATASET OUT RUN...]...
The groups (a dataset, an output directory, runs) train in turn in the same
processes: a launch's start costs more than most of its runs.
RUN is KIND:INPUT_MODE:OPTIMIZER[:VARIANT]. KIND is `local` (LocalEmbeddings,
one process) or a placement on the ranks:
- data_parallel, table_wise, column_wise, row_wise: every table so placed;
- mixed: the four kinds in turn;
- planner: what `plan_sharding` makes of the tables (every rank gets a shard);
- idle_rank: table 0 whole on rank 0, the others replicated: the other ranks
  hold no model-parallel shard (with one table, they read no ids at all);
- one_rank: every table whole on rank 0: the other ranks hold nothing at all,
  no shard and no replicated table, and update nothing;
- row_wise_rank: the last rank holds only row ranges.
VARIANT is fp32 (default), or a `+`-joined set of: amp (the CPU's
mixed_bfloat16 policy), xla (the dense part compiled), cross (the DCNv2 cross
interaction, with tables of unequal widths `CROSS_WIDTHS`), mean (every table
pools a row's vectors by mean: with variable-length tables, by their count),
chunks (the dense part over chunks of `CHUNK_ROWS` of a rank's rows, their
gradients summed; otherwise the whole batch at once).
Each run is a `RunConfig`, assembled by `dlrm.app.assembly.assemble_run` as
`dlrm-train` assembles it (a placement other than the planner's is written as a
`--sharding_plan` file): the model runs on the project's CPU kernels as
`dlrm-train` on CPUs does, under xla all but the interaction's, which XLA's
compiled dense part leaves out. Writes OUT/<RUN with : as _>/rank<r>.npz: dense
weights by name, each shard as "table_<t>_<r0>_<r1>_<c0>_<c1>", the per-step
losses and the rank's hostname.
"""

import dataclasses
import socket
import sys
from pathlib import Path

import numpy as np

from dataloading.split_binary import SplitBinaryDataset
from dlrm.app.assembly import assemble_run
from dlrm.app.config import RunConfig
from dlrm.app.reporting import MetricsLog
from dlrm.app.sharding import planning_hotness
from dlrm.distributed.collectives import Collectives, create_collectives
from dlrm.embedding.planner.types import TableSpec
from dlrm.variables import variable_name
from feature_spec import FeatureSpec
from harness.assembly import small_config
from harness.placements import DIM, PLANNER_DATA_PARALLEL_THRESHOLD, plan_for

CHUNK_ROWS = 20  # under the chunks variant: 96 rows are 20 x 4 + 16, 48 are 20 x 2 + 8
CROSS_WIDTHS = (4, 6, 8)  # table t is CROSS_WIDTHS[t % 3] wide under the cross variant
LEARNING_RATES = {"sgd": 0.5, "adagrad": 0.1, "adam": 0.01, "rowwise_adagrad": 0.1}


def main() -> None:
    steps, batch = sys.argv[1:3]
    collectives = create_collectives()
    for dataset, out, runs in run_groups(sys.argv[3:]):
        for run in runs:
            kind, input_mode, optimizer, *variant = run.split(":")
            directory = out / run.replace(":", "_")
            directory.mkdir(parents=True, exist_ok=True)
            train(
                dataset,
                collectives,
                kind,
                input_mode,
                optimizer,
                set(variant[0].split("+")) if variant else set(),
                int(steps),
                int(batch),
                directory,
            )


def run_groups(arguments: list[str]) -> list[tuple[str, Path, list[str]]]:
    """The (DATASET, OUT, RUNs) groups of `arguments`, which `--` separates."""
    groups, group = [], []
    for argument in [*arguments, "--"]:
        if argument != "--":
            group.append(argument)
            continue
        dataset, out, *runs = group
        groups.append((dataset, Path(out), runs))
        group = []
    return groups


def run_config(
    dataset: str, kind: str, input_mode: str, optimizer: str, variant: set[str], batch: int
) -> RunConfig:
    """The flags of a run: the small model (harness/assembly.py), its variant,
    and under `planner` the threshold that replicates the smallest tables."""
    cross, tables = "cross" in variant, len(FeatureSpec.load(dataset).cardinalities)
    return small_config(
        dataset,
        batch_size=batch,
        optimizer=optimizer,
        learning_rate=LEARNING_RATES[optimizer],
        embedding_dim=tuple(CROSS_WIDTHS[t % 3] for t in range(tables)) if cross else (DIM,),
        interaction="cross" if cross else "dot",
        num_cross_layers=2,
        cross_layer_projection_dim=5,
        pooling=("mean" if "mean" in variant else "sum",),
        data_parallel_threshold=PLANNER_DATA_PARALLEL_THRESHOLD,
        input_mode=input_mode,
        amp="amp" in variant,
        xla="xla" in variant,
        dense_chunk_rows=CHUNK_ROWS if "chunks" in variant else 0,
    )


def train(
    dataset: str,
    collectives: Collectives,
    kind: str,
    input_mode: str,
    optimizer: str,
    variant: set[str],
    steps: int,
    batch: int,
    directory: Path,
) -> None:
    rank, world = collectives.rank, collectives.world_size
    config = run_config(dataset, kind, input_mode, optimizer, variant, batch)
    if kind not in ("local", "planner"):
        # This placement, as a --sharding_plan file (each rank writes its own copy).
        spec = FeatureSpec.load(dataset)
        widths = tuple(CROSS_WIDTHS[t % 3] for t in range(len(spec.cardinalities)))
        specs = [
            TableSpec(rows, dim, hotness)
            for rows, dim, hotness in zip(
                spec.cardinalities,
                widths if "cross" in variant else (DIM,) * len(widths),
                planning_hotness(spec),
                strict=True,
            )
        ]
        plan_file = directory / f"plan_rank{rank}.json"
        plan_for(kind, specs, world, batch).save(plan_file)
        config = dataclasses.replace(config, sharding_plan=str(plan_file))
    assembled = assemble_run(config, MetricsLog(None, None, enabled=False), collectives)
    trainer = assembled.trainer
    assert trainer is not None
    data = SplitBinaryDataset(assembled.spec, "train", assembled.shard(batch)).to_tf_dataset()
    losses = [float(trainer.train_step(b)) for b in data.take(steps)]
    trainer.check_finite()
    arrays = {variable_name(v): v.numpy() for v in trainer.dense_variables}
    for s, variable in assembled.model.embeddings.local_shards():
        key = f"table_{s.table}_{s.rows[0]}_{s.rows[1]}_{s.columns[0]}_{s.columns[1]}"
        arrays[key] = variable.numpy()
    arrays["losses"] = np.array(losses)
    arrays["hostname"] = np.array(socket.gethostname())
    np.savez(directory / f"rank{rank}.npz", **arrays)


if __name__ == "__main__":
    main()
