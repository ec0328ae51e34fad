"""One process trains a table of more than 2^31 rows, checkpoints and restores it.

    python harness/scripts/large_table.py DATASET REFERENCE_DATASET CHECKPOINTS STEPS

DATASET holds one categorical feature of more than 2^31 rows (int64 ids, some of
them >= 2^31); REFERENCE_DATASET is the same model's FeatureSpec with a table of
REFERENCE_ROWS rows. The script trains STEPS batches of DATASET with SGD, and the
same batches, with each id replaced by its rank among the ids looked up, on the
small table whose rows start as the large table's looked-up rows did, and with
the same dense weights: the invariant is "same rows, same updates". Then it
saves a checkpoint, overwrites the rows looked up, restores, and prints one JSON
line: the values it found (looked-up rows, rows never looked up, their initial
values, the reference), what the checkpoint files hold at those rows, and the
time and peak RSS of each phase.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from dataloading.split_binary import Batch, ShardSpec, SplitBinaryDataset
from dlrm.app.assembly import AssembledRun
from dlrm.checkpoint.reader import Checkpoint
from dlrm.embedding.base import assign_rows, read_rows
from dlrm.embedding.initializer import initial_table_values
from dlrm.train.state import restore_training_state, save_training_state
from harness.assembly import assembled_run

BATCH = 16
REFERENCE_ROWS = 32
SEED = 7


def peak_rss_bytes() -> int:
    """The process's peak RSS (VmHWM) since it started or `reset_peak()`."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def reset_peak() -> None:
    """Peak RSS from now on (Linux: 5 > clear_refs resets VmHWM)."""
    Path("/proc/self/clear_refs").write_text("5")


def assembled(dataset: str) -> AssembledRun:
    """A width-1 model trained by SGD, in this process."""
    return assembled_run(
        dataset,
        batch_size=BATCH,
        optimizer="sgd",
        learning_rate=0.5,
        embedding_dim=(1,),
        bottom_mlp_dims=(3, 1),
        top_mlp_dims=(4, 1),
        seed=SEED,
    )


def table(s: AssembledRun) -> Any:
    ((_, variable),) = s.model.embeddings.local_shards()
    return variable


def rows_of(variable: Any, ids: np.ndarray) -> np.ndarray:
    """variable[ids] [len(ids)] of a width-1 table, one gather."""
    return tf.gather(variable, tf.constant(ids, tf.int64)).numpy()[:, 0]


def main(dataset: str, reference_dataset: str, checkpoints: str, steps: int) -> dict[str, Any]:
    phases: dict[str, dict[str, float]] = {}
    started = time.perf_counter()

    def phase(name: str, since: float) -> float:
        now = time.perf_counter()
        phases[name] = {"seconds": now - since, "peak_rss_bytes": peak_rss_bytes()}
        reset_peak()
        return now

    mark = phase("start", started)  # TensorFlow imported
    large = assembled(dataset)
    assert large.trainer is not None
    variable = table(large)
    rows, dim = large.model.embeddings.table_shape(0)
    mark = phase("create", mark)

    spec = large.spec
    batches: list[Batch] = list(
        SplitBinaryDataset(spec, "train", ShardSpec(BATCH)).to_tf_dataset().take(steps)
    )
    ids = np.concatenate([batch.categorical.numpy()[:, 0] for batch in batches])
    looked_up = np.unique(ids)
    if len(looked_up) > REFERENCE_ROWS:
        raise ValueError(f"{len(looked_up)} distinct ids, the reference holds {REFERENCE_ROWS}")
    # Neighbours of looked-up rows (and the last row) that no batch looks up.
    candidates = np.concatenate([looked_up - 1, looked_up + 1, [rows - 1]])
    candidates = candidates[(candidates >= 0) & (candidates < rows)]
    untouched = np.setdiff1d(candidates, looked_up)
    initial = {
        "looked_up": rows_of(variable, looked_up),
        "untouched": rows_of(variable, untouched),
    }

    reference = assembled(reference_dataset)
    assert reference.trainer is not None
    # The small table starts as the large one's looked-up rows, and the dense
    # weights are the same: the reference is the same model on those rows.
    start_rows = np.zeros((REFERENCE_ROWS, dim), np.float32)
    start_rows[: len(looked_up), 0] = initial["looked_up"]
    assign_rows(table(reference), 0, start_rows)
    for mine, theirs in zip(
        reference.trainer.dense_variables, large.trainer.dense_variables, strict=True
    ):
        mine.assign(theirs)
    mark = phase("reference", mark)

    losses, reference_losses = [], []
    for batch in batches:
        assert batch.categorical.dtype == tf.int64, batch.categorical.dtype
        losses.append(float(large.trainer.train_step(batch)))
        remapped = np.searchsorted(looked_up, batch.categorical.numpy()).astype(np.int64)
        small_batch = batch._replace(categorical=tf.constant(remapped))
        reference_losses.append(float(reference.trainer.train_step(small_batch)))
    trained = {
        "looked_up": rows_of(variable, looked_up),
        "untouched": rows_of(variable, untouched),
    }
    dense_difference = max(
        float(np.max(np.abs(a.numpy() - b.numpy())))
        for a, b in zip(
            large.trainer.dense_variables, reference.trainer.dense_variables, strict=True
        )
    )
    mark = phase("train", mark)

    path = save_training_state(large.trainer, checkpoints, {"model": large.model_config.to_dict()})
    mark = phase("save", mark)

    # What the files hold at those rows, read back by an independent reader.
    checkpoint = Checkpoint(path)
    in_file = {
        name: np.array(
            [checkpoint.read_table_slice(0, (int(r), int(r) + 1), (0, dim))[0, 0] for r in which]
        )
        for name, which in (("looked_up", looked_up), ("untouched", untouched))
    }
    manifest_shape = checkpoint.table_shape(0)
    mark = phase("read_back", mark)

    # Overwrite every looked-up row (and its neighbours) and a dense weight, then
    # restore: the checkpoint must bring back the trained values.
    for row in looked_up:
        start = max(0, int(row) - 1)
        assign_rows(
            variable, start, np.full((min(rows, int(row) + 2) - start, dim), 9.0, np.float32)
        )
    large.trainer.dense_variables[0].assign(tf.zeros_like(large.trainer.dense_variables[0]))
    large.trainer.step.assign(0)
    clobbered = rows_of(variable, looked_up)
    reset_peak()
    mark = time.perf_counter()
    step = restore_training_state(large.trainer, Checkpoint(path))
    mark = phase("restore", mark)
    restored = {
        "looked_up": rows_of(variable, looked_up),
        "untouched": rows_of(variable, untouched),
    }
    # The last rows by the checkpoint writer's reader, as the gather sees them.
    last_ids = np.arange(rows - 3, rows)
    last_rows = {
        "read_rows": read_rows(variable, rows - 3, rows)[:, 0],
        "gather": rows_of(variable, last_ids),
    }

    def listed(values: dict[str, np.ndarray]) -> dict[str, list[float]]:
        return {name: [float(v) for v in array] for name, array in values.items()}

    return {
        "rows": rows,
        "dim": dim,
        "variable_shape": [int(n) for n in variable.shape],
        "table_bytes": rows * dim * 4,
        "id_dtype": str(batches[0].categorical.dtype.name),
        "looked_up_ids": [int(i) for i in looked_up],
        "untouched_ids": [int(i) for i in untouched],
        "expected_initial": {
            name: [
                float(initial_table_values(0, rows, dim, SEED, (int(r), int(r) + 1))[0, 0])
                for r in which
            ]
            for name, which in (("looked_up", looked_up), ("untouched", untouched))
        },
        "initial": listed(initial),
        "trained": listed(trained),
        "reference_trained": [float(v) for v in table(reference).numpy()[: len(looked_up), 0]],
        "losses": losses,
        "reference_losses": reference_losses,
        "dense_difference": dense_difference,
        "in_file": listed(in_file),
        "manifest_shape": list(manifest_shape),
        "clobbered": [float(v) for v in clobbered],
        "restored": listed(restored),
        "restored_step": step,
        "last_rows": listed(last_rows),
        "checkpoint_files": checkpoint.manifest["files"],
        "phases": phases,
        "rss_after_restore_bytes": rss_bytes(),
        "seconds": time.perf_counter() - started,
    }


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    print(json.dumps(result))
