"""Trains a few steps with given splits of the embedding tables and saves the
resulting weights, under horovodrun or as one process.

Usage: hybrid_steps.py DATASET OUT STEPS GLOBAL_BATCH RUN...
RUN is KIND:INPUT_MODE:OPTIMIZER[:VARIANT], KIND one of local (LocalEmbeddings,
one process), data_parallel, table_wise, column_wise, row_wise, mixed; VARIANT
fp32 (default), amp (the CPU's mixed_bfloat16 policy) or xla (the dense part
compiled). Writes
OUT/<RUN with : as _>/rank<r>.npz: dense weights by name, each shard as
"table_<t>_<r0>_<r1>_<c0>_<c1>", and the per-step losses.
"""

import sys
from pathlib import Path

import keras
import numpy as np

from dataloading.split_binary import InputMode, ShardSpec, SplitBinaryDataset
from dlrm.dist import create_collectives
from dlrm.embedding.sharded import ShardAssignment, ShardedEmbeddings
from dlrm.model import Dlrm, ModelConfig
from dlrm.optimizers import create_optimizer, variable_name
from dlrm.precision import choose_precision
from dlrm.schedule import DlrmSchedule, ScheduleConfig
from dlrm.trainer import Trainer
from feature_spec import FeatureSpec

DIM = 6


def assignments(kind: str, cardinalities: tuple[int, ...], world: int) -> list[ShardAssignment]:
    out = []
    for t, rows in enumerate(cardinalities):
        mixed = ("data_parallel", "table_wise", "column_wise", "row_wise")[t % 4]
        table_kind = mixed if kind == "mixed" else kind
        if table_kind == "data_parallel":
            out += [ShardAssignment(t, table_kind, r, (0, rows), (0, DIM)) for r in range(world)]
        elif table_kind == "table_wise":
            out.append(ShardAssignment(t, table_kind, t % world, (0, rows), (0, DIM)))
        elif table_kind == "column_wise":
            edges = np.linspace(0, DIM, world + 1).astype(int)
            out += [
                ShardAssignment(t, table_kind, r, (0, rows), (int(edges[r]), int(edges[r + 1])))
                for r in range(world)
            ]
        else:
            edges = np.linspace(0, rows, world + 1).astype(int)
            out += [
                ShardAssignment(t, table_kind, r, (int(edges[r]), int(edges[r + 1])), (0, DIM))
                for r in range(world)
            ]
    return out


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
            variant[0] if variant else "fp32",
            int(steps),
            int(batch),
            directory,
        )


def train(spec, collectives, kind, input_mode, optimizer, variant, steps, batch, directory) -> None:
    rank, world = collectives.rank, collectives.world_size
    config = ModelConfig(
        len(spec.numerical_features),
        spec.cardinalities,
        spec.hotness,
        embedding_dim=DIM,
        bottom_mlp_dims=(9, DIM),
        top_mlp_dims=(11, 1),
    )
    keras.utils.set_random_seed(1)
    data_parallel_input = input_mode == "data_parallel"
    embeddings = None
    if kind != "local":
        embeddings = ShardedEmbeddings(
            assignments(kind, spec.cardinalities, world),
            spec.cardinalities,
            spec.hotness,
            DIM,
            collectives,
            seed=1,
            data_parallel_input=data_parallel_input,
        )
    precision = choose_precision(variant == "amp", has_gpu=False)
    model = Dlrm(config, embeddings=embeddings, dtype_policy=precision.dtype_policy, seed=1)
    lr = {"sgd": 0.5, "adagrad": 0.1, "adam": 0.01}[optimizer]
    trainer = Trainer(
        model,
        create_optimizer(optimizer),
        DlrmSchedule(ScheduleConfig(lr)),
        precision,
        batch,
        use_xla=variant == "xla",
        collectives=collectives,
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
    for s in model.embeddings.local_shards():
        key = f"table_{s.table}_{s.rows[0]}_{s.rows[1]}_{s.columns[0]}_{s.columns[1]}"
        arrays[key] = s.variable.numpy()
    arrays["losses"] = np.array(losses)
    np.savez(directory / f"rank{rank}.npz", **arrays)


if __name__ == "__main__":
    main()
