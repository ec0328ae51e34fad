"""What the training loop follows, each a small object it asks after a step:
when to evaluate (`EvaluationPolicy`), when to write a checkpoint
(`CheckpointPolicy`), what to report (`ProgressReport`), and how far the run
goes (`Horizon`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from dlrm.app.reporting import MetricsLog, Throughput, format_duration


def eval_steps(steps_per_epoch: int, epochs: int, evals_per_epoch: int) -> list[int]:
    """Global step counts after which to evaluate: evenly spaced in each epoch."""
    points = []
    for epoch in range(epochs):
        for k in range(1, evals_per_epoch + 1):
            points.append(epoch * steps_per_epoch + round(k * steps_per_epoch / evals_per_epoch))
    return sorted(set(p for p in points if p > 0))


@dataclasses.dataclass(frozen=True)
class Horizon:
    """A run from `start_step` to `total_steps` over epochs of `steps_per_epoch`."""

    steps_per_epoch: int
    start_step: int
    total_steps: int

    def epoch_and_position(self, step: int) -> tuple[int, int]:
        """The epoch of `step` (0-based) and its batch in that epoch."""
        return divmod(step, self.steps_per_epoch)

    def reached(self, step: int) -> bool:
        return step >= self.total_steps


class EvaluationPolicy:
    """Evaluate after `evals_per_epoch` evenly spaced steps of each epoch that
    this run trains, and always after its last step."""

    def __init__(self, horizon: Horizon, epochs: int, evals_per_epoch: int) -> None:
        steps = [
            s
            for s in eval_steps(horizon.steps_per_epoch, epochs, evals_per_epoch)
            if horizon.start_step < s <= horizon.total_steps
        ]
        if not steps or steps[-1] != horizon.total_steps:
            steps.append(horizon.total_steps)
        self.steps = frozenset(steps)

    def due(self, step: int) -> bool:
        return step in self.steps


class CheckpointPolicy:
    """A checkpoint after each evaluation, every `every_steps` steps, and when
    `every_seconds` passed on rank 0's clock since the last one; never two of one
    step. Rank 0 asks for the timed one with a step's requests
    (`asks_for_time`), so every rank writes after the same step."""

    def __init__(
        self,
        every_steps: int,
        every_seconds: float,
        is_rank_zero: bool,
        saved_step: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.is_rank_zero = is_rank_zero
        self.saved_step = saved_step  # -1: none of this run's weights saved yet
        self._clock = clock
        self._last = clock()

    def asks_for_time(self) -> bool:
        """This rank's request with the next step: rank 0's interval has passed."""
        return (
            self.is_rank_zero
            and self.every_seconds > 0
            and self._clock() - self._last >= self.every_seconds
        )

    def due(self, step: int, evaluated: bool, timed: bool) -> bool:
        periodic = self.every_steps > 0 and step % self.every_steps == 0
        return evaluated or periodic or timed

    def needs_writing(self, step: int) -> bool:
        """Whether `step`'s weights are not in a checkpoint yet."""
        return step != self.saved_step

    def written(self, step: int | None) -> None:
        """A checkpoint of `step` was written (None: none was asked for); the
        interval starts again."""
        if step is not None:
            self.saved_step = step
        self._last = self._clock()


class ProgressReport:
    """Every `print_freq` steps, a progress line and a `train` record; the loss
    is wanted then, and at evaluations, at the last step and at a stop."""

    def __init__(self, log: MetricsLog, print_freq: int, throughput: Throughput) -> None:
        self.log = log
        self.print_freq = print_freq
        self.throughput = throughput

    def due(self, step: int) -> bool:
        return step % self.print_freq == 0

    def wants_loss(self, step: int, evaluating: bool, last: bool, stopping: bool) -> bool:
        return self.due(step) or evaluating or last or stopping

    def progress(self, step: int, epoch: int, loss: float, learning_rate: float) -> None:
        samples_per_second, eta = self.throughput.mark(step)
        self.log.print(
            f"epoch {epoch} step {step:,}/{self.throughput.total_steps:,} | loss {loss:.5f} | "
            f"lr {learning_rate:.4g} | {samples_per_second:,.0f} samples/s | "
            f"ETA {format_duration(eta)}"
        )
        self.log.write(
            "train",
            step=step,
            epoch=epoch,
            loss=loss,
            learning_rate=learning_rate,
            samples_per_second=samples_per_second,
        )
