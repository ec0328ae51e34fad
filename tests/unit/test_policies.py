"""The training loop's policies, each alone (`dlrm.app.policies`)."""

from __future__ import annotations

import io
from pathlib import Path

from dlrm.app.policies import CheckpointPolicy, EvaluationPolicy, Horizon, ProgressReport
from dlrm.app.records import read_records
from dlrm.app.reporting import MetricsLog, Throughput


def test_the_horizon_counts_epochs_from_where_the_run_starts() -> None:
    horizon = Horizon(steps_per_epoch=8, start_step=5, total_steps=20)
    assert horizon.epoch_and_position(5) == (0, 5)
    assert horizon.epoch_and_position(17) == (2, 1)
    assert not horizon.reached(19) and horizon.reached(20)


def test_evaluations_spread_over_the_epochs_this_run_trains_and_after_its_last_step() -> None:
    two_a_epoch = EvaluationPolicy(Horizon(10, 0, 20), epochs=2, evals_per_epoch=2)
    assert sorted(two_a_epoch.steps) == [5, 10, 15, 20]
    # Resumed at step 12 with a cap at 17: the ones ahead, and the last step.
    resumed = EvaluationPolicy(Horizon(10, 12, 17), epochs=2, evals_per_epoch=2)
    assert sorted(resumed.steps) == [15, 17]
    assert resumed.due(15) and not resumed.due(5)
    assert sorted(EvaluationPolicy(Horizon(10, 0, 30), 3, 0).steps) == [30]


def test_checkpoints_every_n_steps_after_evaluations_and_on_rank_zero_clock() -> None:
    now = [100.0]
    policy = CheckpointPolicy(4, 30.0, is_rank_zero=True, saved_step=-1, clock=lambda: now[0])
    assert [s for s in range(1, 13) if policy.due(s, evaluated=False, timed=False)] == [4, 8, 12]
    assert policy.due(5, evaluated=True, timed=False)
    assert policy.due(6, evaluated=False, timed=True)
    assert not policy.asks_for_time()
    now[0] = 130.0
    assert policy.asks_for_time()
    policy.written(6)
    assert not policy.asks_for_time()  # the interval starts again
    assert not policy.needs_writing(6) and policy.needs_writing(7)
    now[0] = 160.0
    policy.written(None)  # due, but nothing written (no --save_checkpoint_path)
    assert not policy.asks_for_time() and policy.needs_writing(7)
    # Other ranks never ask: rank 0's clock decides for all of them.
    other = CheckpointPolicy(0, 1e-9, is_rank_zero=False, saved_step=-1, clock=lambda: now[0])
    now[0] = 1e6
    assert not other.asks_for_time()
    assert not CheckpointPolicy(0, 0.0, True, -1).asks_for_time()  # no interval set


def test_progress_is_reported_every_print_freq_steps_with_the_loss_it_needs(
    tmp_path: Path,
) -> None:
    console, path = io.StringIO(), tmp_path / "metrics.jsonl"
    log = MetricsLog(path, None, console=console)
    report = ProgressReport(log, print_freq=5, throughput=Throughput(64, 0, 20))
    assert [s for s in range(1, 21) if report.due(s)] == [5, 10, 15, 20]
    assert report.wants_loss(7, evaluating=True, last=False, stopping=False)
    assert report.wants_loss(7, evaluating=False, last=False, stopping=True)
    assert not report.wants_loss(7, evaluating=False, last=False, stopping=False)
    report.progress(5, epoch=0, loss=0.5, learning_rate=0.01)
    log.close()
    assert console.getvalue().startswith("epoch 0 step 5/20 | loss 0.50000 | lr 0.01 |")
    (record,) = read_records(path)
    assert (record["event"], record["step"], record["loss"]) == ("train", 5, 0.5)
    assert record["samples_per_second"] > 0
