"""The training loop of `--mode train`: steps, progress, evaluations and
checkpoints, resumed from `--restore_checkpoint_path` at its step and data
position."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import tensorflow as tf

from dataloading.errors import DatasetError
from dataloading.split_binary import (
    SplitBinaryDataset,
)
from dlrm import metrics
from dlrm.checkpoint import Checkpoint
from dlrm.modes import eval_record, evaluate
from dlrm.reporting import Throughput, format_duration
from dlrm.session import Session, open_checkpoint
from dlrm.training_state import (
    restore_on_every_rank,
    restore_training_state,
    save_training_state,
)
from feature_spec import TRAIN_MAPPING


def eval_steps(steps_per_epoch: int, epochs: int, evals_per_epoch: int) -> list[int]:
    """Global step counts after which to evaluate: evenly spaced in each epoch."""
    points = []
    for epoch in range(epochs):
        for k in range(1, evals_per_epoch + 1):
            points.append(epoch * steps_per_epoch + round(k * steps_per_epoch / evals_per_epoch))
    return sorted(set(p for p in points if p > 0))


def train(session: Session) -> dict[str, Any]:
    config, log = session.config, session.log
    trainer = session.trainer
    assert trainer is not None
    train_data = SplitBinaryDataset(
        session.spec,
        TRAIN_MAPPING,
        session.shard(config.batch_size),
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
    if config.restore_checkpoint_path:
        path = config.restore_checkpoint_path

        def restore() -> tuple[Checkpoint, int]:
            checkpoint = open_checkpoint(path, session.model_config)
            return checkpoint, restore_training_state(trainer, checkpoint)

        checkpoint, start_step = restore_on_every_rank(session.collectives, path, restore)
        log.print(f"restored {checkpoint.path} at step {start_step}")
    if config.save_checkpoint_path and session.collectives.rank == 0:
        config.write(config.save_checkpoint_path)
        if session.plan is not None:  # reusable with --sharding_plan
            session.plan.save(Path(config.save_checkpoint_path) / "sharding_plan.json")
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
        f"precision {session.precision.dtype_policy}, xla {config.xla}, "
        f"optimizer {config.optimizer}"
    )
    log.write(
        "start",
        step=start_step,
        total_steps=total_steps,
        config=config.to_dict(),
        hosts=session.hosts,  # rank r ran on hosts[r]
    )
    throughput = Throughput(config.batch_size, start_step, total_steps)
    wall_start = time.perf_counter()
    train_seconds = 0.0
    last_result: metrics.EvaluationResult | None = None
    checkpoint_path: Path | None = None
    step = start_step
    loss = float("nan")
    while step < total_steps:
        epoch, position = divmod(step, steps_per_epoch)
        segment_start = time.perf_counter()
        for batch in train_data.batches(start=position):
            loss_tensor = trainer.train_step(batch)
            step += 1
            report = step % config.print_freq == 0
            if report or step in evals or step == total_steps:
                # Each rank's loss is its share of the global mean: their sum is it.
                loss = float(session.collectives.allreduce_sum([loss_tensor], ["loss"])[0].numpy())
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
            if step in evals:
                train_seconds += time.perf_counter() - segment_start
                last_result = evaluate(session)
                log.print(
                    f"eval at step {step:,}: AUC {last_result.auc:.5f} | logloss "
                    f"{last_result.logloss:.5f} | accuracy {last_result.accuracy:.4f} "
                    f"({last_result.samples:,} samples)"
                )
                log.write("eval", step=step, epoch=epoch, **eval_record(last_result))
                if config.save_checkpoint_path:
                    checkpoint_path = save_training_state(
                        trainer,
                        config.save_checkpoint_path,
                        manifest_fields(session),
                        keep=config.keep_checkpoints,
                    )
                    log.print(f"checkpoint: {checkpoint_path}")
                throughput.mark(step)
                segment_start = time.perf_counter()
            if step >= total_steps:
                break
        train_seconds += time.perf_counter() - segment_start
    trainer.check_finite()
    if last_result is None:  # resumed at or past the end: evaluate what was restored
        last_result = evaluate(session)
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
        **eval_record(last_result),
        "checkpoint": str(checkpoint_path) if checkpoint_path else None,
        "world_size": session.collectives.world_size,
    }
    return summary


def manifest_fields(session: Session) -> dict[str, Any]:
    return {
        "config": session.config.to_dict(),
        "model": session.model_config.to_dict(),
        "precision": session.precision.dtype_policy,
        "world_size": session.collectives.world_size,
        "plan": session.plan.to_dict() if session.plan is not None else None,
    }
