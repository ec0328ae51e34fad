"""A trainer's state in a checkpoint: dense weights, embedding shards, their
optimizer slots, the step and the loss scale, saved by every rank together and
restored onto any sharding."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dlrm.checkpoint.every_rank import attempt, on_every_rank, rank_failure
from dlrm.checkpoint.format import CheckpointError
from dlrm.checkpoint.model_state import restore_model_weights, restore_shard
from dlrm.checkpoint.reader import Checkpoint
from dlrm.checkpoint.writer import CheckpointWriter
from dlrm.embedding.base import read_rows
from dlrm.embedding.shard import ShardingKind
from dlrm.train.trainer import Trainer
from dlrm.variables import variable_name

STEP_KEY = "trainer/step"
# Absent from checkpoints written before warm starts could continue the schedule: 0.
SCHEDULE_OFFSET_KEY = "trainer/schedule_offset"
ITERATIONS_KEY = "optimizer/iterations"
LOSS_SCALE_KEYS = ("loss_scale/scale", "loss_scale/good_steps")
# Steps skipped in a row (`Trainer`'s bound on them). Absent from checkpoints written
# before they were counted: 0, so at worst a run of skipped steps counts from the
# restore on.
SKIPPED_STEPS_KEY = "loss_scale/skipped_steps"


def save_training_state(
    trainer: Trainer,
    root: str | os.PathLike[str],
    manifest_fields: Mapping[str, Any],
    keep: int = 0,
) -> Path:
    """Writes a checkpoint of `trainer` at its current step; returns its directory.

    Under several ranks (`trainer.collectives`), every rank writes its own table
    shards in parallel into the staging directory rank 0 created (a filesystem
    all ranks share); rank 0 writes the dense part and replicated tables, then
    the manifest once every rank has finished. No rank gathers the model, and
    no rank copies a shard: each shard and slot is streamed to its file in row
    blocks (`read_rows`), so a table of any size saves in one block of memory.

    Each of the three stages ends in one collective that every rank reaches
    whether its part worked or not; if any rank failed, every rank raises
    `CheckpointError` with that rank's message at once, nothing is published,
    and the previous checkpoints stay as they were.
    """
    trainer.check_finite()
    collectives = trainer.collectives
    step = int(trainer.step.numpy())
    where = f"checkpoint step {step} in {root}"
    staged: list[CheckpointWriter] = []

    def stage() -> None:
        if collectives.rank == 0:
            staged.append(CheckpointWriter(root, step, create=True))

    on_every_rank(collectives, f"staging {where}", "save_stage", stage)
    writer, contents = _write_parts(trainer, root, step, staged, where)

    def publish() -> None:
        if collectives.rank == 0:
            manifest = {**manifest_fields, "optimizer": trainer.optimizer.hyperparameters()}
            writer.commit(manifest, keep=keep, gathered=contents)

    on_every_rank(collectives, f"publishing {where}", "save_publish", publish)
    return writer.final


def _write_parts(
    trainer: Trainer,
    root: str | os.PathLike[str],
    step: int,
    staged: list[CheckpointWriter],
    where: str,
) -> tuple[CheckpointWriter, list[dict[str, Any]]]:
    """Every rank's part, written into the staging directory rank 0 created
    (`staged`: its writer there); returns this rank's writer and every rank's
    contents. If any rank failed, every rank raises `CheckpointError` naming it,
    and the staging directory goes."""
    collectives = trainer.collectives
    contents: dict[str, Any] = {}

    def write() -> None:
        if not staged:
            staged.append(CheckpointWriter(root, step, create=False))
        _write_own_part(trainer, staged[0], step)
        contents.update(staged[0].contents())

    error = attempt(write)
    gathered = collectives.allgather_object(
        (None if error is None else f"{type(error).__name__}: {error}", contents),
        name="save_write",
    )
    failed = [(rank, message) for rank, (message, _) in enumerate(gathered) if message]
    if failed:
        if collectives.rank == 0 and staged:
            shutil.rmtree(staged[0].staging, ignore_errors=True)
        raise rank_failure(f"writing {where}", failed, error)
    return staged[0], [part for _, part in gathered]


def _write_own_part(trainer: Trainer, writer: CheckpointWriter, step: int) -> None:
    """This rank's table shards and their slots (rank 0: also the dense part and
    the one copy of each replicated table), each streamed in row blocks
    (`read_rows`): no copy of a shard or its slots in memory."""
    is_rank_zero = trainer.collectives.rank == 0
    if is_rank_zero:
        writer.add_dense(_dense_arrays(trainer, step))
    embeddings = trainer.model.embeddings
    for shard, variable in embeddings.local_shards():
        if shard.kind == ShardingKind.DATA_PARALLEL and not is_rank_zero:
            continue
        writer.add_table_shard(
            shard,
            embeddings.table_shape(shard.table),
            functools.partial(read_rows, variable),
            {
                slot: functools.partial(read_rows, value)
                for slot, value in trainer.optimizer.slots(variable).items()
            },
            dtype=variable.dtype.name,
        )


def _dense_arrays(trainer: Trainer, step: int) -> dict[str, np.ndarray]:
    dense: dict[str, np.ndarray] = {
        STEP_KEY: np.asarray(step, np.int64),
        SCHEDULE_OFFSET_KEY: np.asarray(trainer.schedule_offset.numpy(), np.int64),
        ITERATIONS_KEY: np.asarray(trainer.optimizer.iterations.numpy()),
    }
    if trainer.loss_scale is not None:
        dense[LOSS_SCALE_KEYS[0]] = trainer.loss_scale.scale.numpy()
        dense[LOSS_SCALE_KEYS[1]] = trainer.loss_scale.good_steps.numpy()
        dense[SKIPPED_STEPS_KEY] = trainer.loss_scale.skipped_steps.numpy()
    for variable in trainer.dense_variables:
        name = variable_name(variable)
        dense[name] = np.asarray(variable.numpy())
        for slot, slot_variable in trainer.optimizer.slots(variable).items():
            dense[f"{name}/{slot}"] = slot_variable.numpy()
    return dense


def restore_training_state(trainer: Trainer, checkpoint: Checkpoint) -> int:
    """Loads `checkpoint` into `trainer` (any sharding it was written with):
    weights, optimizer slots, step, the schedule's offset and the loss scale.
    Returns the step to continue from."""
    saved = checkpoint.manifest.get("optimizer", {}).get("name")
    if saved != trainer.optimizer.name:
        raise CheckpointError(
            f"{checkpoint.path}: written with --optimizer {saved}, this run uses "
            f"--optimizer {trainer.optimizer.name}; optimizer state cannot carry over"
        )
    restore_model_weights(trainer.model, checkpoint)
    for variable in trainer.dense_variables:
        name = variable_name(variable)
        for slot, slot_variable in trainer.optimizer.slots(variable).items():
            slot_variable.assign(checkpoint.dense_array(f"{name}/{slot}", variable.shape))
    for shard, variable in trainer.model.embeddings.local_shards():
        for slot, slot_variable in trainer.optimizer.slots(variable).items():
            restore_shard(checkpoint, shard, slot_variable, slot)
    step = int(checkpoint.dense_array(STEP_KEY))
    trainer.step.assign(step)
    dense = checkpoint.dense()
    trainer.schedule_offset.assign(int(dense.get(SCHEDULE_OFFSET_KEY, 0)))
    trainer.optimizer.iterations.assign(int(checkpoint.dense_array(ITERATIONS_KEY)))
    if trainer.loss_scale is not None and LOSS_SCALE_KEYS[0] in dense:
        trainer.loss_scale.scale.assign(checkpoint.dense_array(LOSS_SCALE_KEYS[0]))
        trainer.loss_scale.good_steps.assign(checkpoint.dense_array(LOSS_SCALE_KEYS[1]))
        trainer.loss_scale.skipped_steps.assign(int(dense.get(SKIPPED_STEPS_KEY, 0)))
    return step
