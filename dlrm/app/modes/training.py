"""The training loop of `--mode train`: steps, progress, evaluations and
checkpoints, resumed from `--restore_checkpoint_path` (or, with `--resume`, the
newest checkpoint in `--save_checkpoint_path`) at its step and data position.

Checkpoints are written after each evaluation, every `--checkpoint_every_steps`
steps, when `--checkpoint_every_seconds` passed on rank 0's clock since the last
one, and when a preemption signal stops the run (`dlrm.distributed.preemption`). The ranks
agree on the last two through the step itself (`Trainer.train_step_agreeing`), so
every rank writes, or stops, after the same step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tensorflow as tf

from dataloading.errors import DatasetError
from dataloading.split_binary import (
    SplitBinaryDataset,
)
from dlrm.app.assembly import AssembledRun, open_checkpoint
from dlrm.app.modes.evaluation import eval_record, evaluate
from dlrm.app.reporting import Throughput, format_duration
from dlrm.checkpoint.every_rank import restore_on_every_rank
from dlrm.checkpoint.format import CheckpointError, newest_checkpoint
from dlrm.checkpoint.model_state import VOCABULARY_FIELD, grown_tables
from dlrm.checkpoint.reader import Checkpoint
from dlrm.distributed.preemption import StopSignals, parse_signal
from dlrm.evaluation import metrics
from dlrm.train.state import restore_training_state, save_training_state
from feature_spec import TRAIN_MAPPING


def eval_steps(steps_per_epoch: int, epochs: int, evals_per_epoch: int) -> list[int]:
    """Global step counts after which to evaluate: evenly spaced in each epoch."""
    points = []
    for epoch in range(epochs):
        for k in range(1, evals_per_epoch + 1):
            points.append(epoch * steps_per_epoch + round(k * steps_per_epoch / evals_per_epoch))
    return sorted(set(p for p in points if p > 0))


@dataclasses.dataclass
class TrainProgress:
    """How far a run got, readable when it failed (`dlrm.app.elastic`): the step it
    started at and the last step every rank finished."""

    start_step: int = 0
    step: int = 0
    on_first_step: Callable[[], None] | None = None  # called after the first step


def train(
    run: AssembledRun,
    progress: TrainProgress | None = None,
    after_checkpoint: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Trains to the end (or to a preemption signal); returns the summary.

    Args:
        progress: updated after every step.
        after_checkpoint: called on every rank after each checkpoint written before
            the last step (the ranks are at the same step there), e.g. to stop for
            hosts that joined (`dlrm.app.elastic`).
    """
    progress = progress if progress is not None else TrainProgress()
    config, log = run.config, run.log
    trainer = run.trainer
    assert trainer is not None
    train_data = SplitBinaryDataset(
        run.spec,
        TRAIN_MAPPING,
        run.shard(config.batch_size),
        check_batch_ids=config.check_ids,
    )
    steps_per_epoch = train_data.num_batches
    if steps_per_epoch == 0:
        raise DatasetError(
            f"{config.feature_spec_path}: the train split has {train_data.rows} rows, fewer "
            f"than one global batch (--batch_size {config.batch_size})"
        )
    total_steps = config.epochs * steps_per_epoch
    if config.max_steps > 0:
        total_steps = min(total_steps, config.max_steps)
    start_step = 0
    own = resume_path(run)
    path = own or config.restore_checkpoint_path
    warm_start = config.warm_start and own is None
    if path:

        def restore() -> tuple[Checkpoint, int]:
            checkpoint = open_checkpoint(run, path)
            return checkpoint, restore_training_state(trainer, checkpoint)

        checkpoint, saved_at = restore_on_every_rank(run.collectives, path, restore)
        grown = grown_tables(checkpoint, run.model_config.cardinalities)
        if warm_start:  # this run's data and schedule from their start
            trainer.step.assign(0)
            log.print(f"warm start from {checkpoint.path} (its step {saved_at}){brief(grown)}")
        else:
            start_step = saved_at
            log.print(f"restored {checkpoint.path} at step {start_step}{brief(grown)}")
        log.write(
            "restore",
            step=start_step,
            path=str(checkpoint.path),
            saved_step=saved_at,
            warm_start=warm_start,
            grown=[{"table": t, "rows": old, "to": new} for t, old, new in grown],
        )
    if config.save_checkpoint_path and run.collectives.rank == 0:
        config.write(config.save_checkpoint_path)
        if run.plan is not None:  # reusable with --sharding_plan
            run.plan.save(Path(config.save_checkpoint_path) / "sharding_plan.json")
    evals = [
        s
        for s in eval_steps(steps_per_epoch, config.epochs, config.evals_per_epoch)
        if start_step < s <= total_steps
    ]
    if not evals or evals[-1] != total_steps:
        evals.append(total_steps)
    log.print(
        f"training: {train_data.rows:,} rows, {steps_per_epoch:,} steps per epoch of "
        f"{config.batch_size:,}; steps {start_step:,} -> {total_steps:,}; "
        f"precision {run.precision.dtype_policy}, xla {config.xla}, "
        f"optimizer {config.optimizer}"
    )
    log.write(
        "start",
        step=start_step,
        total_steps=total_steps,
        config=config.to_dict(),
        hosts=run.hosts,  # rank r ran on hosts[r]
    )
    progress.start_step = progress.step = start_step
    throughput = Throughput(config.batch_size, start_step, total_steps)
    wall_start = time.perf_counter()
    train_seconds = 0.0
    last_result: metrics.EvaluationResult | None = None
    checkpoint_path: Path | None = None
    saved_step = start_step if path and not warm_start else -1
    last_save = time.monotonic()
    step = start_step
    loss = float("nan")
    stopped = False
    is_rank_zero = run.collectives.rank == 0

    def save() -> None:
        nonlocal checkpoint_path, saved_step, last_save
        if config.save_checkpoint_path and saved_step != step:
            start = time.perf_counter()
            checkpoint_path = save_training_state(
                trainer,
                config.save_checkpoint_path,
                manifest_fields(run),
                keep=config.keep_checkpoints,
            )
            seconds = time.perf_counter() - start
            saved_step = step
            log.print(f"checkpoint: {checkpoint_path} ({seconds:.1f} s)")
            log.write("checkpoint", step=step, path=str(checkpoint_path), seconds=seconds)
        last_save = time.monotonic()

    signal = parse_signal(config.preemption_signal) if config.preemption_signal else None
    with StopSignals(signal) as signals:
        while step < total_steps and not stopped:
            epoch, position = divmod(step, steps_per_epoch)
            segment_start = time.perf_counter()
            # Held until the loop is over: dropping an iterator with reads in flight
            # waits for them (about a second, far longer on a loaded host), which
            # must not come between a preemption signal and its checkpoint.
            batches = train_data.batches(start=position)
            for batch in batches:
                timer = (
                    is_rank_zero
                    and config.checkpoint_every_seconds > 0
                    and time.monotonic() - last_save >= config.checkpoint_every_seconds
                )
                loss_tensor, agreed = trainer.train_step_agreeing(
                    batch, [signals.seen is not None, timer]
                )
                step += 1
                stopped, timed = (bool(flag) for flag in agreed.numpy())
                progress.step = step
                if step == start_step + 1 and progress.on_first_step is not None:
                    progress.on_first_step()
                report = step % config.print_freq == 0
                if report or step in evals or step == total_steps or stopped:
                    # Each rank's loss is its share of the global mean: their sum is it.
                    loss = float(run.collectives.allreduce_sum([loss_tensor], ["loss"])[0].numpy())
                    trainer.check_finite()
                if report:
                    samples_per_second, eta = throughput.mark(step)
                    lr = float(trainer.learning_rate(tf.constant(step - 1, tf.int64)))
                    log.print(
                        f"epoch {epoch} step {step:,}/{total_steps:,} | loss {loss:.5f} | "
                        f"lr {lr:.4g} | {samples_per_second:,.0f} samples/s | "
                        f"ETA {format_duration(eta)}"
                    )
                    log.write(
                        "train",
                        step=step,
                        epoch=epoch,
                        loss=loss,
                        learning_rate=lr,
                        samples_per_second=samples_per_second,
                    )
                if stopped:
                    break
                periodic = (
                    config.checkpoint_every_steps > 0 and step % config.checkpoint_every_steps == 0
                )
                if step in evals or periodic or timed:
                    train_seconds += time.perf_counter() - segment_start
                    if step in evals:
                        last_result = evaluate(run)
                        log.print(
                            f"eval at step {step:,}: AUC {last_result.auc:.5f} | logloss "
                            f"{last_result.logloss:.5f} | accuracy {last_result.accuracy:.4f} "
                            f"({last_result.samples:,} samples)"
                        )
                        log.write("eval", step=step, epoch=epoch, **eval_record(last_result))
                    save()
                    if after_checkpoint is not None and step < total_steps:
                        after_checkpoint()
                    throughput.mark(step)
                    segment_start = time.perf_counter()
                if step >= total_steps:
                    break
            train_seconds += time.perf_counter() - segment_start
        if stopped:  # still under StopSignals: a second signal does not cut the save short
            log.print(f"preemption signal: stopping at step {step:,}")
            log.write("preempted", step=step, loss=loss)
            save()
            # Rank 0 reports the stop once, and a launcher ends the job at the first
            # rank that exits; the others wait a few seconds for that report
            # (`cli._error`). So every rank drops its reader first (waiting for the
            # reads in flight: seconds on a loaded host), and they leave together.
            del batches
            run.collectives.allgather_object(step, name="preempted_exit")
    trainer.check_finite()
    if last_result is None and not stopped:  # resumed at or past the end: evaluate it
        last_result = evaluate(run)
    trained = step - start_step
    summary = {
        "mode": "train",
        "steps": step,
        "steps_this_run": trained,
        "final_loss": loss,
        "train_samples_per_second": trained * config.batch_size / train_seconds
        if train_seconds > 0
        else 0.0,
        "wall_time_s": time.perf_counter() - wall_start,
        **(eval_record(last_result) if last_result is not None else {}),
        "checkpoint": str(checkpoint_path) if checkpoint_path else None,
        "world_size": run.collectives.world_size,
    }
    if stopped:
        summary["preempted"] = True
    return summary


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


def brief(grown: list[tuple[int, int, int]]) -> str:
    """`; 3 tables grew by 1,234 rows (most: table 7, 800 -> 1,600)`, or ""."""
    if not grown:
        return ""
    added = sum(new - old for _, old, new in grown)
    table, old, new = max(grown, key=lambda g: g[2] - g[1])
    return (
        f"; {len(grown)} tables grew by {added:,} rows (most: table {table}, "
        f"{old:,} -> {new:,}; all in the metrics log's restore record)"
    )


def manifest_fields(run: AssembledRun) -> dict[str, Any]:
    return {
        "config": run.config.to_dict(),
        "model": run.model_config.to_dict(),
        "precision": run.precision.dtype_policy,
        "world_size": run.collectives.world_size,
        "plan": run.plan.to_dict() if run.plan is not None else None,
        VOCABULARY_FIELD: run.vocabulary.id if run.vocabulary is not None else None,
    }
