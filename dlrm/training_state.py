"""Saving and restoring everything a run needs to continue: dense weights,
embedding shards, their optimizer slots, the step and the loss scale."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dlrm.checkpoint import Checkpoint, CheckpointError, CheckpointWriter
from dlrm.dist import Collectives, failures_on_any_rank
from dlrm.embedding.base import assign_rows, read_rows
from dlrm.embedding.shard import ShardingKind, TableShard
from dlrm.model import LEGACY_VALUES, Dlrm
from dlrm.optimizers import variable_name
from dlrm.trainer import Trainer
from feature_spec.vocabulary import VocabularyLineage

STEP_KEY = "trainer/step"
ITERATIONS_KEY = "optimizer/iterations"
LOSS_SCALE_KEYS = ("loss_scale/scale", "loss_scale/good_steps")
CARDINALITIES = "cardinalities"  # the field of the model config that may grow
VOCABULARY_FIELD = "vocabulary"  # the manifest's: the dataset vocabulary's id, or None


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
    chunks (`read_rows`), so a table of any size saves in one chunk of memory.

    Each of the three stages ends in one collective that every rank reaches
    whether its part worked or not; if any rank failed, every rank raises
    `CheckpointError` with that rank's message at once, nothing is published,
    and the previous checkpoints stay as they were.
    """
    trainer.check_finite()
    collectives = trainer.collectives
    lead = collectives.rank == 0
    step = int(trainer.step.numpy())
    writer: CheckpointWriter | None = None

    def stage() -> None:
        nonlocal writer
        if lead:
            writer = CheckpointWriter(root, step, create=True)

    _on_every_rank(collectives, f"staging checkpoint step {step} in {root}", "save_stage", stage)
    contents: dict[str, Any] = {}

    def write() -> None:
        nonlocal writer
        if writer is None:
            writer = CheckpointWriter(root, step, create=False)
        if lead:
            writer.add_dense(_dense_arrays(trainer, step))
        for shard, variable in trainer.model.embeddings.local_shards():
            if shard.kind == ShardingKind.DATA_PARALLEL and not lead:
                continue  # rank 0 writes the one copy
            # Streamed in row chunks: no copy of the shard or its slots in memory.
            writer.add_table_shard(
                shard,
                trainer.model.embeddings.table_shape(shard.table),
                functools.partial(read_rows, variable),
                {
                    slot: functools.partial(read_rows, value)
                    for slot, value in trainer.optimizer.slots(variable).items()
                },
            )
        contents.update(writer.contents())

    error = _attempt(write)
    gathered = collectives.allgather_object(
        (None if error is None else f"{type(error).__name__}: {error}", contents),
        name="save_write",
    )
    failed = [(rank, message) for rank, (message, _) in enumerate(gathered) if message]
    if failed:
        if lead and writer is not None:
            shutil.rmtree(writer.staging, ignore_errors=True)
        raise _failure(f"writing checkpoint step {step} in {root}", failed, error)

    def publish() -> None:
        if lead and writer is not None:
            writer.commit(
                {**manifest_fields, "optimizer": trainer.optimizer.hyperparameters()},
                keep=keep,
                gathered=[part for _, part in gathered],
            )

    _on_every_rank(
        collectives, f"publishing checkpoint step {step} in {root}", "save_publish", publish
    )
    assert writer is not None
    return writer.final


def _dense_arrays(trainer: Trainer, step: int) -> dict[str, np.ndarray]:
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
    return dense


def _attempt(action: Callable[[], None]) -> Exception | None:
    """Runs `action`; returns what it raised, to be shared with the other ranks
    (any exception: a rank must never leave its peers waiting)."""
    try:
        action()
    except Exception as error:  # reported to every rank, then raised
        return error
    return None


def _failure(
    what: str, failed: Sequence[tuple[int, str]], own: BaseException | None
) -> CheckpointError:
    (rank, message), *others = failed
    also = "".join(f"; on rank {r}: {m}" for r, m in others)
    error = CheckpointError(f"{what} failed on rank {rank}: {message}{also}")
    error.__cause__ = own
    error.same_on_every_rank = True  # `failed` is one allgather's (dlrm.launch)
    return error


def _on_every_rank(
    collectives: Collectives, what: str, name: str, action: Callable[[], None]
) -> None:
    """Runs `action` on every rank; raises `CheckpointError` on every rank if it
    failed on any (one collective, reached by every rank)."""
    error = _attempt(action)
    failed = failures_on_any_rank(collectives, error, name)
    if failed:
        raise _failure(what, failed, error)


def check_model_matches(
    checkpoint: Checkpoint,
    model_config: Mapping[str, Any],
    lineage: VocabularyLineage | None = None,
) -> None:
    """Raises `CheckpointError` naming every architecture field that differs.

    The tables may have fewer rows in the checkpoint than this run's dataset has
    ids (`cardinalities`): they grow on restore when the dataset's vocabulary
    (`lineage`) is the checkpoint's or extends it, so that every old id still
    means the same value. A table with more rows in the checkpoint, or growth
    without that lineage, is an error naming the table and both sizes: a table
    is never truncated, and rows are never given to other values.
    """
    saved = checkpoint.manifest.get("model")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{checkpoint.path}: the manifest has no model config")
    # A manifest written before a field existed holds the model that field's
    # legacy value describes (a dot model, before cross layers existed).
    saved = {**LEGACY_VALUES, **saved}
    differences = [
        f"{key}: checkpoint {saved.get(key)!r}, this run {value!r}"
        for key, value in model_config.items()
        if key != CARDINALITIES and saved.get(key) != value
    ]
    old, new = list(saved.get(CARDINALITIES) or []), list(model_config[CARDINALITIES])
    if len(old) != len(new):
        differences.append(
            f"{CARDINALITIES}: checkpoint {len(old)} tables {old}, this run {len(new)} tables {new}"
        )
    if differences:
        raise CheckpointError(
            f"{checkpoint.path}: written for another model or dataset; " + "; ".join(differences)
        )
    smaller = [(t, o, n) for t, (o, n) in enumerate(zip(old, new, strict=True)) if o > n]
    if smaller:
        raise CheckpointError(
            f"{checkpoint.path}: "
            + "; ".join(
                f"table {t} has {o:,} rows, this run's dataset {n:,}" for t, o, n in smaller
            )
            + ". A checkpoint's tables can grow to a dataset's cardinalities, never shrink "
            "(expected the dataset the checkpoint was trained on, or one whose vocabulary "
            "extends it: preprocess with --vocabulary_from)"
        )
    grown = grown_tables(checkpoint, new)
    if not grown:
        return
    vocabulary = checkpoint.manifest.get(VOCABULARY_FIELD)
    if lineage is not None and isinstance(vocabulary, str) and lineage.descends_from(vocabulary):
        return
    t, o, n = grown[0]
    if not isinstance(vocabulary, str):
        why = "the checkpoint records no vocabulary (its dataset was not made by dlrm-preprocess)"
    elif lineage is None:
        why = f"the checkpoint's vocabulary is {vocabulary}, and this dataset records none"
    else:
        why = (
            f"the checkpoint's vocabulary is {vocabulary}, and this dataset's ({lineage.id}) "
            f"does not extend it (it extends {list(lineage.extends) or 'none'})"
        )
    raise CheckpointError(
        f"{checkpoint.path}: table {t} has {o:,} rows, this run's dataset {n:,}"
        + (f" ({len(grown)} tables grow)" if len(grown) > 1 else "")
        + f"; a table grows only when the dataset's ids extend the checkpoint's, but {why}. "
        "Expected a dataset preprocessed with --vocabulary_from the checkpoint's dataset"
    )


def grown_tables(
    checkpoint: Checkpoint, cardinalities: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(table, rows in the checkpoint, rows now) of each table that grows on restore."""
    saved = checkpoint.manifest.get("model", {}).get(CARDINALITIES) or []
    return [(t, o, n) for t, (o, n) in enumerate(zip(saved, cardinalities, strict=False)) if o < n]


def restore_model_weights(model: Dlrm, checkpoint: Checkpoint) -> None:
    """Loads dense weights and embedding tables (not optimizer state) into `model`.

    Reads only what this process holds, in bounded chunks written straight into
    the variables, so a resharding restore needs one chunk of extra host memory,
    not a copy of the shard. A table with fewer rows in the checkpoint than in the
    model (checked by `check_model_matches`) fills its first rows; the others
    keep their initial values."""
    model.build_all()
    for variable in model.dense_variables:
        variable.assign(checkpoint.dense_array(variable_name(variable), variable.shape))
    for shard, variable in model.embeddings.local_shards():
        shape = checkpoint.table_shape(shard.table)
        expected = model.embeddings.table_shape(shard.table)
        if shape[1] != expected[1] or shape[0] > expected[0]:
            raise CheckpointError(
                f"{checkpoint.path}: table {shard.table} has shape {list(shape)}, the model "
                f"expects {list(expected)} (another dataset or --embedding_dim?)"
            )
        _restore_shard(checkpoint, shard, variable, None)


def _restore_shard(
    checkpoint: Checkpoint, shard: TableShard, variable: Any, slot: str | None
) -> None:
    """Fills the rows of `shard` that the checkpoint's table has (all of them,
    unless the table grew); the others keep what the variable holds."""
    stop = min(shard.rows[1], checkpoint.table_shape(shard.table)[0])
    if stop <= shard.rows[0]:
        return  # rows that are all new

    def assign(offset: int, chunk: np.ndarray) -> None:
        assign_rows(variable, offset, chunk)

    checkpoint.restore_table_slice(
        shard.table, (shard.rows[0], stop), shard.columns, assign, slot=slot
    )


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
    for shard, variable in trainer.model.embeddings.local_shards():
        for slot, slot_variable in trainer.optimizer.slots(variable).items():
            _restore_shard(checkpoint, shard, slot_variable, slot)
    step = int(checkpoint.dense_array(STEP_KEY))
    trainer.step.assign(step)
    trainer.optimizer.iterations.assign(int(checkpoint.dense_array(ITERATIONS_KEY)))
    if trainer.loss_scale is not None and LOSS_SCALE_KEYS[0] in checkpoint.dense():
        trainer.loss_scale.scale.assign(checkpoint.dense_array(LOSS_SCALE_KEYS[0]))
        trainer.loss_scale.good_steps.assign(checkpoint.dense_array(LOSS_SCALE_KEYS[1]))
    return step


def restore_on_every_rank(collectives: Collectives, path: str, restore: Callable[[], Any]) -> Any:
    """Runs `restore` (open, check and load a checkpoint) on every rank; if it
    fails on any rank, every rank raises `CheckpointError` naming that rank and
    its error, instead of the others waiting for it in their first step."""
    result: list[Any] = []
    _on_every_rank(collectives, f"restoring {path}", "restore", lambda: result.append(restore()))
    return result[0]
