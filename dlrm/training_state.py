"""Saving and restoring everything a run needs to continue: dense weights,
embedding shards, their optimizer slots, the step and the loss scale."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dlrm.checkpoint import Checkpoint, CheckpointError, CheckpointWriter
from dlrm.model import Dlrm
from dlrm.optimizers import variable_name
from dlrm.trainer import Trainer

STEP_KEY = "trainer/step"
ITERATIONS_KEY = "optimizer/iterations"
LOSS_SCALE_KEYS = ("loss_scale/scale", "loss_scale/good_steps")


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
    the manifest once every rank has finished. No rank gathers the model.
    """
    trainer.check_finite()
    collectives = trainer.collectives
    lead = collectives.rank == 0
    step = int(trainer.step.numpy())
    writer = CheckpointWriter(root, step, create=lead) if lead else None
    collectives.barrier()
    if writer is None:
        writer = CheckpointWriter(root, step, create=False)
    dense: dict[str, np.ndarray] = {
        STEP_KEY: np.asarray(step, np.int64),
        ITERATIONS_KEY: np.asarray(trainer.optimizer.iterations.numpy()),
    }
    if trainer.loss_scale is not None:
        dense[LOSS_SCALE_KEYS[0]] = trainer.loss_scale.scale.numpy()
        dense[LOSS_SCALE_KEYS[1]] = trainer.loss_scale.good_steps.numpy()
    for variable in trainer.dense_variables:
        name = variable_name(variable)
        dense[name] = np.asarray(variable.numpy())
        for slot, slot_variable in trainer.optimizer.slots(variable).items():
            dense[f"{name}/{slot}"] = slot_variable.numpy()
    if lead:
        writer.add_dense(dense)
    for shard in trainer.model.embeddings.local_shards():
        if shard.replicated and not lead:
            continue
        writer.add_table_shard(
            shard.table,
            shard.shape,
            shard.rows,
            shard.columns,
            np.asarray(shard.variable.numpy()),
            {
                slot: value.numpy()
                for slot, value in trainer.optimizer.slots(shard.variable).items()
            },
        )
    gathered = collectives.allgather_object(writer.contents())
    if lead:
        writer.commit(
            {**manifest_fields, "optimizer": trainer.optimizer.hyperparameters()},
            keep=keep,
            gathered=gathered,
        )
    collectives.barrier()  # published before any rank goes on (or restores it)
    return writer.final


def check_model_matches(checkpoint: Checkpoint, model_config: Mapping[str, Any]) -> None:
    """Raises `CheckpointError` naming every architecture field that differs."""
    saved = checkpoint.manifest.get("model")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{checkpoint.path}: the manifest has no model config")
    differences = [
        f"{key}: checkpoint {saved.get(key)!r}, this run {value!r}"
        for key, value in model_config.items()
        if saved.get(key) != value
    ]
    if differences:
        raise CheckpointError(
            f"{checkpoint.path}: written for another model or dataset; " + "; ".join(differences)
        )


def restore_model_weights(model: Dlrm, checkpoint: Checkpoint) -> None:
    """Loads dense weights and embedding tables (not optimizer state) into `model`."""
    model.build_all()
    for variable in model.dense_variables:
        variable.assign(checkpoint.dense_array(variable_name(variable), variable.shape))
    for shard in model.embeddings.local_shards():
        shape = checkpoint.table_shape(shard.table)
        if shape != tuple(shard.shape):
            raise CheckpointError(
                f"{checkpoint.path}: table {shard.table} has shape {list(shape)}, the model "
                f"expects {list(shard.shape)} (another dataset or --embedding_dim?)"
            )
        shard.variable.assign(checkpoint.read_table_slice(shard.table, shard.rows, shard.columns))


def restore_training_state(trainer: Trainer, checkpoint: Checkpoint) -> int:
    """Loads `checkpoint` into `trainer` (any sharding it was written with):
    weights, optimizer slots, step and loss scale. Returns the step to continue from."""
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
    for shard in trainer.model.embeddings.local_shards():
        for slot, slot_variable in trainer.optimizer.slots(shard.variable).items():
            slot_variable.assign(
                checkpoint.read_table_slice(shard.table, shard.rows, shard.columns, slot)
            )
    step = int(checkpoint.dense_array(STEP_KEY))
    trainer.step.assign(step)
    trainer.optimizer.iterations.assign(int(checkpoint.dense_array(ITERATIONS_KEY)))
    if trainer.loss_scale is not None and LOSS_SCALE_KEYS[0] in checkpoint.dense():
        trainer.loss_scale.scale.assign(checkpoint.dense_array(LOSS_SCALE_KEYS[0]))
        trainer.loss_scale.good_steps.assign(checkpoint.dense_array(LOSS_SCALE_KEYS[1]))
    return step
