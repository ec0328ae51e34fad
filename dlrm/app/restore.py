"""Which checkpoint a run starts from, opened and checked against the run, and
restored on every rank together: `--restore_checkpoint_path`, or with
`--resume` the newest checkpoint in `--save_checkpoint_path`, for the training
loop (weights, optimizer state, step) and for the other modes (weights)."""

from __future__ import annotations

import dataclasses

from dlrm.app.assembly import AssembledRun
from dlrm.checkpoint.every_rank import restore_on_every_rank
from dlrm.checkpoint.format import CheckpointError, newest_checkpoint
from dlrm.checkpoint.model_state import (
    check_model_matches,
    grown_tables,
    restore_model_weights,
    table_dtype_change,
)
from dlrm.checkpoint.reader import Checkpoint
from dlrm.train.state import restore_training_state
from dlrm.train.trainer import Trainer


def open_checkpoint(run: AssembledRun, path: str) -> Checkpoint:
    """Opens `path` and checks it fits this run's model; its tables may have fewer
    rows when this dataset's vocabulary extends the checkpoint's (they grow)."""
    checkpoint = Checkpoint(path)
    check_model_matches(checkpoint, run.model_config.to_dict(), run.vocabulary)
    return checkpoint


def restore_weights(run: AssembledRun, path: str) -> Checkpoint:
    """The model's weights from `path`, on every rank (eval and inference)."""

    def restore() -> Checkpoint:
        checkpoint = open_checkpoint(run, path)
        restore_model_weights(run.model, checkpoint)
        return checkpoint

    checkpoint: Checkpoint = restore_on_every_rank(run.collectives, path, restore)
    _say_dtype_change(run, checkpoint)
    return checkpoint


def _say_dtype_change(run: AssembledRun, checkpoint: Checkpoint) -> None:
    """Prints how the checkpoint's tables were converted, when they were."""
    change = table_dtype_change(checkpoint, run.model.embeddings.table_dtype.name)
    if change is not None:
        run.log.print(change)


def resume_path(run: AssembledRun) -> str | None:
    """With `--resume`, the newest complete checkpoint in `--save_checkpoint_path`,
    as rank 0 sees it (None when there is none yet); every rank must see the same
    one, else every rank stops with `CheckpointError` naming the ranks."""
    config = run.config
    if not (config.resume and config.save_checkpoint_path):
        return None
    found = newest_checkpoint(config.save_checkpoint_path)
    newest = str(found) if found is not None else None
    seen = run.collectives.allgather_object(newest, name="resume_from")
    if any(other != seen[0] for other in seen):
        error = CheckpointError(
            f"--resume: the ranks see different newest checkpoints in "
            f"{config.save_checkpoint_path}: "
            + ", ".join(f"rank {rank}: {path or 'none'}" for rank, path in enumerate(seen))
            + "; it must be a directory every rank sees alike (a shared file system)"
        )
        error.same_on_every_rank = True
        raise error
    return seen[0]


@dataclasses.dataclass(frozen=True)
class TrainingStart:
    """Where training starts: `step`, the step whose weights are already in a
    checkpoint of this run (-1: none, a fresh or warm start), and the checkpoint
    restored, when one was (`resumed`: the run's own, found by `--resume`)."""

    step: int = 0
    saved_step: int = -1
    checkpoint: str | None = None
    resumed: bool = False


def restore_for_training(run: AssembledRun) -> TrainingStart:
    """Restores the trainer from `--resume`'s checkpoint, else from
    `--restore_checkpoint_path` (at its step, or at step 0 with `--warm_start`),
    and says so; a run with neither starts at step 0."""
    config, log, trainer = run.config, run.log, run.trainer
    assert trainer is not None
    own = resume_path(run)
    path = own or config.restore_checkpoint_path
    if not path:
        return TrainingStart()
    warm_start = config.warm_start and own is None

    def restore() -> tuple[Checkpoint, int]:
        checkpoint = open_checkpoint(run, path)
        return checkpoint, restore_training_state(trainer, checkpoint)

    checkpoint, saved_at = restore_on_every_rank(run.collectives, path, restore)
    _say_dtype_change(run, checkpoint)
    grown = grown_tables(checkpoint, run.model_config.cardinalities)
    if warm_start:  # this run's data from its start
        schedule_step = warm_schedule(trainer, saved_at, config.schedule_from)
        log.print(
            f"warm start from {checkpoint.path} (its step {saved_at}; the learning-rate "
            f"schedule from its step {schedule_step:,}){_brief(grown)}"
        )
    else:
        log.print(f"restored {checkpoint.path} at step {saved_at}{_brief(grown)}")
    start = TrainingStart(checkpoint=str(checkpoint.path))
    if not warm_start:
        start = TrainingStart(saved_at, saved_at, str(checkpoint.path), own is not None)
    log.write(
        "restore",
        step=start.step,
        path=str(checkpoint.path),
        saved_step=saved_at,
        warm_start=warm_start,
        grown=[{"table": t, "rows": old, "to": new} for t, old, new in grown],
    )
    return start


def warm_schedule(trainer: Trainer, saved_at: int, schedule_from: str) -> int:
    """A warm start's first step is step 0 of this run's data; its schedule stands
    where the checkpoint's stood (`schedule_from` "checkpoint": its own offset plus
    its steps) or at its start ("zero"). Returns that schedule step."""
    offset = int(trainer.schedule_offset.numpy()) + saved_at if schedule_from == "checkpoint" else 0
    trainer.step.assign(0)
    trainer.schedule_offset.assign(offset)
    return offset


def _brief(grown: list[tuple[int, int, int]]) -> str:
    """`; 3 tables grew by 1,234 rows (most: table 7, 800 -> 1,600)`, or ""."""
    if not grown:
        return ""
    added = sum(new - old for _, old, new in grown)
    table, old, new = max(grown, key=lambda g: g[2] - g[1])
    return (
        f"; {len(grown)} tables grew by {added:,} rows (most: table {table}, "
        f"{old:,} -> {new:,}; all in the metrics log's restore record)"
    )
