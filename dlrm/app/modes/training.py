"""`--mode train`: the training loop. It starts where `dlrm.app.restore` says
(`--restore_checkpoint_path`, or with `--resume` the newest checkpoint in
`--save_checkpoint_path`), at that step and data position, and after each step
asks its policies (`dlrm.app.policies`) whether to report, evaluate, write a
checkpoint or stop. A preemption signal (`dlrm.distributed.preemption`) and
rank 0's checkpoint timer travel with a step's requests
(`Trainer.train_step_agreeing`), so every rank stops, or writes, after the same
step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tensorflow as tf

from dataloading.errors import DatasetError
from dataloading.split_binary import Batch, SplitBinaryDataset
from dlrm.app.assembly import AssembledRun
from dlrm.app.config import ConfigError
from dlrm.app.modes.evaluation import eval_record, evaluate
from dlrm.app.policies import CheckpointPolicy, EvaluationPolicy, Horizon, ProgressReport
from dlrm.app.reporting import Throughput, peak_memory
from dlrm.app.restore import TrainingStart, restore_for_training
from dlrm.checkpoint.model_state import VOCABULARY_FIELD
from dlrm.distributed.preemption import StopSignals, parse_signal
from dlrm.evaluation.metrics import EvaluationResult
from dlrm.train.state import save_training_state
from feature_spec import TRAIN_MAPPING


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
    data = training_data(run)
    start = restore_for_training(run)
    horizon = horizon_of(run, data, start)
    if horizon.reached(horizon.start_step):
        return finished_already(run, start, horizon)
    write_run_files(run)
    announce(run, data, horizon)
    loop = TrainingLoop(run, data, horizon, start, progress or TrainProgress(), after_checkpoint)
    return loop.run()


def training_data(run: AssembledRun) -> SplitBinaryDataset:
    """This rank's reader of the train split; DatasetError when it has no batch."""
    config = run.config
    data = SplitBinaryDataset(
        run.spec, TRAIN_MAPPING, run.shard(config.batch_size), check_batch_ids=config.check_ids
    )
    if data.num_batches == 0:
        raise DatasetError(
            f"{config.feature_spec_path}: the train split has {data.rows} rows, fewer "
            f"than one global batch (--batch_size {config.batch_size})"
        )
    return data


def horizon_of(run: AssembledRun, data: SplitBinaryDataset, start: TrainingStart) -> Horizon:
    """`--epochs` of the train split, or `--max_steps` when fewer."""
    config = run.config
    total = config.epochs * data.num_batches
    if config.max_steps > 0:
        total = min(total, config.max_steps)
    return Horizon(data.num_batches, start.step, total)


class NothingToTrainError(ConfigError):
    """The checkpoint a run starts from is at or past the end of its schedule."""


def finished_already(run: AssembledRun, start: TrainingStart, horizon: Horizon) -> dict[str, Any]:
    """A run that starts at or past its schedule's end: with `--resume` on its own
    checkpoint it has finished, which is a success, said in one line, with the
    checkpoint's evaluation; else `NothingToTrainError` names the step, the end
    and the flags that would train."""
    config = run.config
    end = f"step {horizon.total_steps:,}: {config.epochs} epoch(s) of {horizon.steps_per_epoch:,}"
    if 0 < config.max_steps < config.epochs * horizon.steps_per_epoch:
        end += f" steps, cut at --max_steps {config.max_steps:,}"
    else:
        end += " steps"
    if not start.resumed:
        raise NothingToTrainError(
            f"nothing to train: --restore_checkpoint_path {start.checkpoint} is at step "
            f"{start.step:,}, at or past the end of this run's schedule ({end}). To train "
            "from it, add --warm_start (this dataset from its first batch, the weights and "
            "optimizer state from the checkpoint), more --epochs or a larger --max_steps"
        )
    run.log.print(
        f"nothing to train: {start.checkpoint} is at step {start.step:,}, the end of this "
        f"run's schedule ({end}); the run has finished"
    )
    result = evaluate(run)
    return {
        "mode": "train",
        "steps": start.step,
        "steps_this_run": 0,
        "finished": True,
        **eval_record(result),
        "checkpoint": start.checkpoint,
        "world_size": run.collectives.world_size,
    }


def write_run_files(run: AssembledRun) -> None:
    """The resolved config, and the plan (reusable with `--sharding_plan`), next to
    the checkpoints (rank 0)."""
    directory = run.config.save_checkpoint_path
    if directory and run.collectives.rank == 0:
        run.config.write(directory)
        if run.plan is not None:
            run.plan.save(Path(directory) / "sharding_plan.json")


def announce(run: AssembledRun, data: SplitBinaryDataset, horizon: Horizon) -> None:
    config = run.config
    run.log.print(
        f"training: {data.rows:,} rows, {horizon.steps_per_epoch:,} steps per epoch of "
        f"{config.batch_size:,}; steps {horizon.start_step:,} -> {horizon.total_steps:,}; "
        f"precision {run.precision.dtype_policy}, xla {config.xla}, "
        f"optimizer {config.optimizer}"
    )
    run.log.write(
        "start",
        step=horizon.start_step,
        total_steps=horizon.total_steps,
        config=config.to_dict(),
        hosts=run.hosts,  # rank r ran on hosts[r]
        # What the flags meant on this device (precision, chunks, kernels, loss scale).
        resolved=run.resolved.to_dict() if run.resolved is not None else None,
    )


def manifest_fields(run: AssembledRun) -> dict[str, Any]:
    """What a checkpoint's manifest records of the run besides the trainer's state."""
    return {
        "config": run.config.to_dict(),
        "model": run.model_config.to_dict(),
        "precision": run.precision.dtype_policy,
        "world_size": run.collectives.world_size,
        "plan": run.plan.to_dict() if run.plan is not None else None,
        VOCABULARY_FIELD: run.vocabulary.id if run.vocabulary is not None else None,
    }


class TrainingLoop:
    """One run of the loop: steps until the horizon or a preemption signal, with
    what the policies ask for in between; `run()` returns the summary."""

    def __init__(
        self,
        run: AssembledRun,
        data: SplitBinaryDataset,
        horizon: Horizon,
        start: TrainingStart,
        progress: TrainProgress,
        after_checkpoint: Callable[[], None] | None,
    ) -> None:
        config = run.config
        assert run.trainer is not None
        self.assembled, self.trainer, self.data, self.horizon = run, run.trainer, data, horizon
        self.progress, self.after_checkpoint = progress, after_checkpoint
        self.evaluations = EvaluationPolicy(horizon, config.epochs, config.evals_per_epoch)
        self.checkpoints = CheckpointPolicy(
            config.checkpoint_every_steps,
            config.checkpoint_every_seconds,
            run.collectives.rank == 0,
            start.saved_step,
        )
        throughput = Throughput(config.batch_size, horizon.start_step, horizon.total_steps)
        self.report = ProgressReport(run.log, config.print_freq, throughput)
        self.step = progress.start_step = progress.step = horizon.start_step
        self.loss = float("nan")
        self.train_seconds = 0.0
        self.last_result: EvaluationResult | None = None
        self.checkpoint_path: Path | None = None

    def run(self) -> dict[str, Any]:
        config = self.assembled.config
        wall_start = time.perf_counter()
        signal = parse_signal(config.preemption_signal) if config.preemption_signal else None
        with StopSignals(signal) as signals:
            # Held until the loop is over: dropping a reader with reads in flight waits
            # for them (about a second, far longer on a loaded host), which must not
            # come between a preemption signal and its checkpoint.
            reader: list[Iterator[Batch]] = []  # the current epoch's
            preempted = self._train(signals, reader)
            if preempted:  # still under StopSignals: a second signal does not cut the save short
                self._stop_preempted(reader)
        self.trainer.check_finite()
        return self._summary(time.perf_counter() - wall_start, preempted)

    def _train(self, signals: StopSignals, reader: list[Iterator[Batch]]) -> bool:
        """Steps to the horizon, epoch by epoch; True when a signal stopped it."""
        while not self.horizon.reached(self.step):
            epoch, position = self.horizon.epoch_and_position(self.step)
            segment_start = time.perf_counter()
            reader[:] = [self.data.batches(start=position)]
            for batch, following in self._with_following(reader[0]):
                stopped, timed = self._step(batch, following, epoch, signals)
                if stopped:
                    self.train_seconds += time.perf_counter() - segment_start
                    return True
                if self.evaluations.due(self.step) or self.checkpoints.due(self.step, False, timed):
                    self.train_seconds += time.perf_counter() - segment_start
                    self._evaluate_and_save(epoch)
                    segment_start = time.perf_counter()
                if self.horizon.reached(self.step):
                    break
            self.train_seconds += time.perf_counter() - segment_start
        return False

    def _with_following(self, batches: Iterator[Batch]) -> Iterator[tuple[Batch, Batch | None]]:
        """Each batch of the epoch with the one after it, when the trainer exchanges
        the next batch's ids during a step (`Trainer.train_step_agreeing`) and the
        next step is within the horizon; else None (the same on every rank)."""
        if not self.trainer.exchanges_ids_ahead:
            yield from ((batch, None) for batch in batches)
            return
        batch = next(batches, None)
        step = self.step
        while batch is not None:
            following = None if self.horizon.reached(step + 1) else next(batches, None)
            yield batch, following
            batch, step = following, step + 1

    def _step(
        self, batch: Batch, following: Batch | None, epoch: int, signals: StopSignals
    ) -> tuple[bool, bool]:
        """One training step with this rank's requests; returns what every rank
        agreed: whether to stop, and whether rank 0's checkpoint interval passed."""
        requests = [signals.seen is not None, self.checkpoints.asks_for_time()]
        loss, agreed = self.trainer.train_step_agreeing(batch, requests, following)
        self.step += 1
        stopped, timed = (bool(flag) for flag in agreed.numpy())
        self.progress.step = self.step
        if self.step == self.horizon.start_step + 1 and self.progress.on_first_step:
            self.progress.on_first_step()
        evaluating, last = self.evaluations.due(self.step), self.horizon.reached(self.step)
        if self.report.wants_loss(self.step, evaluating, last, stopped):
            # Each rank's loss is its share of the global mean: their sum is it.
            collectives = self.assembled.collectives
            self.loss = float(collectives.allreduce_sum([loss], ["loss"])[0].numpy())
            self.trainer.check_finite()
        if self.report.due(self.step):
            rate = float(self.trainer.learning_rate_at(tf.constant(self.step - 1, tf.int64)))
            self.report.progress(self.step, epoch, self.loss, rate)
        return stopped, timed

    def _evaluate_and_save(self, epoch: int) -> None:
        """An evaluation when one is due, then a checkpoint, then what comes after one."""
        log = self.assembled.log
        if self.evaluations.due(self.step):
            result = self.last_result = evaluate(self.assembled)
            log.print(
                f"eval at step {self.step:,}: AUC {result.auc:.5f} | logloss "
                f"{result.logloss:.5f} | accuracy {result.accuracy:.4f} "
                f"({result.samples:,} samples)"
            )
            log.write("eval", step=self.step, epoch=epoch, **eval_record(result))
        self._save()
        if self.after_checkpoint is not None and not self.horizon.reached(self.step):
            self.after_checkpoint()
        self.report.throughput.mark(self.step)

    def _save(self) -> None:
        """A checkpoint of this step, unless there is none to write or it is written."""
        config, log = self.assembled.config, self.assembled.log
        if not (config.save_checkpoint_path and self.checkpoints.needs_writing(self.step)):
            self.checkpoints.written(None)
            return
        started = time.perf_counter()
        self.checkpoint_path = save_training_state(
            self.trainer,
            config.save_checkpoint_path,
            manifest_fields(self.assembled),
            keep=config.keep_checkpoints,
        )
        seconds = time.perf_counter() - started
        self.checkpoints.written(self.step)
        log.print(f"checkpoint: {self.checkpoint_path} ({seconds:.1f} s)")
        log.write("checkpoint", step=self.step, path=str(self.checkpoint_path), seconds=seconds)

    def _stop_preempted(self, reader: list[Iterator[Batch]]) -> None:
        """A checkpoint of the step every rank stopped after, then every rank
        leaves together."""
        log = self.assembled.log
        log.print(f"preemption signal: stopping at step {self.step:,}")
        log.write("preempted", step=self.step, loss=self.loss)
        self._save()
        # Rank 0 reports the stop once, and a launcher ends the job at the first rank
        # that exits; the others wait a few seconds for that report (`cli._error`).
        # So every rank drops its reader first (waiting for the reads in flight:
        # seconds on a loaded host), and they leave together.
        reader.clear()
        self.assembled.collectives.allgather_object(self.step, name="preempted_exit")

    def _summary(self, wall_seconds: float, preempted: bool) -> dict[str, Any]:
        config = self.assembled.config
        trained = self.step - self.horizon.start_step
        summary = {
            "mode": "train",
            "steps": self.step,
            "steps_this_run": trained,
            "final_loss": self.loss,
            "train_samples_per_second": trained * config.batch_size / self.train_seconds
            if self.train_seconds > 0
            else 0.0,
            "wall_time_s": wall_seconds,
            **(eval_record(self.last_result) if self.last_result is not None else {}),
            "checkpoint": str(self.checkpoint_path) if self.checkpoint_path else None,
            "world_size": self.assembled.collectives.world_size,
            # Steps whose ids crossed between the ranks during the step before.
            "ids_exchanged_ahead": self.trainer.ids_exchanged_ahead,
            **peak_memory(),  # rank 0's
        }
        if preempted:
            summary["preempted"] = True
        return summary
