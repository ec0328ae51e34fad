"""The training loop on one process: periodic checkpoints, a preemption signal
stopping at a checkpoint, and `--resume` continuing it to the weights of a run
that was never stopped."""

from __future__ import annotations

import io
import math
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from absl import flags

from dlrm.app.assembly import AssembledRun
from dlrm.app.config import RunConfig
from dlrm.app.dispatch import run_mode
from dlrm.app.flags import config_from_flags
from dlrm.app.modes.training import NothingToTrainError, train
from dlrm.app.restore import restore_for_training
from dlrm.checkpoint.format import CheckpointError, list_checkpoints
from dlrm.checkpoint.reader import Checkpoint
from harness.assembly import SMALL_MODEL, assembled_run
from harness.checkpoints import assert_identical
from harness.datasets import SMALL_TABLES, dataset_fixture

BATCH = SMALL_MODEL["batch_size"]
STEPS = 10

dataset = dataset_fixture(SMALL_TABLES, 3, {"train": 8 * BATCH, "test": 200}, seed=4)


def session(dataset: Path, **overrides: object) -> AssembledRun:
    """`SMALL_MODEL` for 2 epochs of 8 steps (the run crosses an epoch), cut at `STEPS`."""
    loop = {"epochs": 2, "max_steps": STEPS, "evals_per_epoch": 0, "keep_checkpoints": 20}
    return assembled_run(dataset, **{**loop, **overrides})


def steps_saved(root: Path) -> list[int]:
    return [Checkpoint(path).step for path in list_checkpoints(root)]


def signal_before_step(s: AssembledRun, step: int, sig: signal.Signals) -> None:
    """Sends `sig` to this process just before the trainer's `step`-th call (1-based)."""
    assert s.trainer is not None
    calls = 0
    step_function: Callable[..., Any] = s.trainer.train_step_agreeing

    def wrapped(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == step:
            os.kill(os.getpid(), sig)
        return step_function(*args)

    s.trainer.train_step_agreeing = wrapped  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("overrides", "saved"),
    [
        ({"checkpoint_every_steps": 3}, [3, 6, 9, 10]),
        ({"checkpoint_every_steps": 2, "keep_checkpoints": 2}, [8, 10]),
        # An interval shorter than a step: a checkpoint after every step, all ranks
        # told through the step (rank 0's clock).
        ({"checkpoint_every_seconds": 1e-6, "max_steps": 3}, [1, 2, 3]),
    ],
    ids=["every_n_steps_and_at_the_end", "keep_bounds_them", "when_the_interval_has_passed"],
)
def test_periodic_checkpoints(
    dataset: Path, tmp_path: Path, overrides: dict[str, Any], saved: list[int]
) -> None:
    summary = train(session(dataset, save_checkpoint_path=str(tmp_path), **overrides))
    assert steps_saved(tmp_path) == saved
    assert summary["steps"] == saved[-1] and "preempted" not in summary


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_preemption_signal_stops_at_a_checkpoint_and_resume_continues_it(
    dataset: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    straight = tmp_path / "straight"
    train(session(dataset, save_checkpoint_path=str(straight)))

    stopped = tmp_path / "stopped"
    flags: dict[str, Any] = {"save_checkpoint_path": str(stopped), "resume": True}
    if sig != signal.SIGTERM:
        flags["preemption_signal"] = sig.name
    before = signal.getsignal(sig)
    first = session(dataset, **flags)
    # The signal arrives while step 4 is prepared: it goes with step 5's requests.
    signal_before_step(first, 4, sig)
    summary = train(first)
    assert summary["preempted"] and summary["steps"] == 5
    assert "auc" not in summary  # no evaluation on the way out
    assert steps_saved(stopped) == [5]
    assert summary["checkpoint"] == str(stopped / "step_000000005")
    assert signal.getsignal(sig) == before  # the handler is the process's again

    # The same flags again: --resume finds step 5 and trains the rest.
    resumed = train(session(dataset, **flags))
    assert resumed["steps"] == STEPS and resumed["steps_this_run"] == STEPS - 5
    assert "preempted" not in resumed
    assert steps_saved(stopped) == [5, STEPS]
    assert_identical(
        Checkpoint(stopped / "step_000000010"), Checkpoint(straight / "step_000000010")
    )


def test_resume_starts_fresh_when_there_is_no_checkpoint_yet(dataset: Path, tmp_path: Path) -> None:
    summary = train(session(dataset, save_checkpoint_path=str(tmp_path), resume=True, max_steps=2))
    assert summary["steps_this_run"] == 2


def test_resume_prefers_the_run_own_checkpoints_to_restore_checkpoint_path(
    dataset: Path, tmp_path: Path
) -> None:
    warm, run = tmp_path / "warm", tmp_path / "run"
    train(session(dataset, save_checkpoint_path=str(warm), max_steps=2))
    flags = {"save_checkpoint_path": str(run), "restore_checkpoint_path": str(warm), "resume": True}
    assert train(session(dataset, **flags, max_steps=4))["steps_this_run"] == 2  # from warm
    assert train(session(dataset, **flags, max_steps=6))["steps_this_run"] == 2  # from run's 4


def test_an_unreadable_newest_checkpoint_is_an_error_not_a_fresh_start(
    dataset: Path, tmp_path: Path
) -> None:
    train(session(dataset, save_checkpoint_path=str(tmp_path), max_steps=2))
    (tmp_path / "step_000000002" / "manifest.json").write_text("{")
    with pytest.raises(CheckpointError, match="step_000000002"):
        train(session(dataset, save_checkpoint_path=str(tmp_path), resume=True))


def test_a_restore_past_the_schedule_end_names_the_step_the_end_and_the_flags(
    dataset: Path, tmp_path: Path
) -> None:
    """Yesterday's checkpoint at step 10, today's schedule 8 steps: nothing to
    train is an error (the command exits 2), not a run of 0 steps."""
    yesterday = tmp_path / "yesterday"
    train(session(dataset, save_checkpoint_path=str(yesterday)))
    today = session(dataset, restore_checkpoint_path=str(yesterday), epochs=1, max_steps=-1)
    with pytest.raises(NothingToTrainError) as error:
        train(today)
    message = str(error.value)
    assert "step_000000010 is at step 10, at or past the end of this run's schedule" in message
    assert "(step 8: 1 epoch(s) of 8 steps)" in message
    for remedy in ("--warm_start", "--epochs", "--max_steps"):
        assert remedy in message
    # Cut by --max_steps, the end says so.
    capped = session(dataset, restore_checkpoint_path=str(yesterday), max_steps=6)
    with pytest.raises(NothingToTrainError, match=r"\(step 6: 2 epoch\(s\) of 8 steps, cut at"):
        train(capped)
    # With --warm_start the same checkpoint trains today's 8 steps.
    warm = session(
        dataset, restore_checkpoint_path=str(yesterday), warm_start=True, epochs=1, max_steps=-1
    )
    assert train(warm)["steps_this_run"] == 8


def test_resuming_a_finished_run_is_a_success_with_its_evaluation(
    dataset: Path, tmp_path: Path
) -> None:
    flags = {"save_checkpoint_path": str(tmp_path), "resume": True}
    first = train(session(dataset, **flags))
    again = train(session(dataset, **flags))
    assert again["finished"] and again["steps"] == STEPS and again["steps_this_run"] == 0
    assert again["auc"] == first["auc"]  # the checkpoint's weights, evaluated again
    assert "final_loss" not in again  # no step, no loss: never NaN
    assert all(not isinstance(v, float) or math.isfinite(v) for v in again.values())
    assert all(math.isfinite(v) for v in first.values() if isinstance(v, float))
    assert steps_saved(tmp_path) == [STEPS]


def config_of(*argv: str) -> RunConfig:
    """dlrm-train's config of these flags."""
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["main.py", *argv])
    try:
        return config_from_flags()
    finally:
        flags.FLAGS.unparse_flags()


@pytest.mark.parametrize("mode", ["eval", "inference"])
def test_eval_and_inference_take_the_architecture_from_the_checkpoint(
    dataset: Path, tmp_path: Path, mode: str
) -> None:
    trained = train(session(dataset, save_checkpoint_path=str(tmp_path)))
    given = [f"--mode={mode}", f"--dataset_path={dataset}", f"--restore_checkpoint_path={tmp_path}"]
    c = config_of(*given, "--batch_size=64", "--max_steps=2", "--benchmark_warmup_steps=0")
    assert (c.embedding_dim, c.bottom_mlp_dims, c.top_mlp_dims) == ((6,), (9, 6), (11, 1))
    summary = run_mode(c, io.StringIO())
    if mode == "eval":
        assert summary["auc"] == trained["auc"]
    else:
        assert summary["steps"] == 2 and summary["samples_per_second"] > 0
    # A flag given that contradicts the checkpoint is refused, naming the field.
    contradicting = config_of(*given, "--batch_size=64", "--bottom_mlp_dims=8,6")
    with pytest.raises(CheckpointError, match=r"bottom_mlp_dims: checkpoint \[9, 6\], this run"):
        run_mode(contradicting, io.StringIO())


@pytest.mark.parametrize("schedule_from", ["checkpoint", "zero"])
def test_a_warm_start_continues_the_schedule_or_starts_it_again(
    dataset: Path, tmp_path: Path, schedule_from: str
) -> None:
    """Yesterday warmed up over 20 steps and stopped at 10; today's first step
    continues the warmup at step 10 (the default), or starts it again at 0."""
    schedule = {"warmup_steps": 20, "learning_rate": 0.05}
    yesterday = tmp_path / "yesterday"
    train(session(dataset, save_checkpoint_path=str(yesterday), **schedule))
    flags = {
        **schedule,
        "restore_checkpoint_path": str(yesterday),
        "warm_start": True,
        "schedule_from": schedule_from,
        "save_checkpoint_path": str(tmp_path / "today"),
        "epochs": 1,
        "max_steps": -1,
    }
    today = session(dataset, **flags)
    assert today.trainer is not None
    restore_for_training(today)
    first = float(today.trainer.learning_rate_at(today.trainer.step))
    expected_step = STEPS if schedule_from == "checkpoint" else 0
    assert first == pytest.approx(0.05 * (expected_step + 1) / 20)
    # The offset is state: a run stopped at step 4 and resumed ends like one that
    # was not stopped.
    assert train(session(dataset, **flags))["steps_this_run"] == 8
    offset = Checkpoint(tmp_path / "today").dense()["trainer/schedule_offset"]
    assert int(offset) == expected_step
    halves = {**flags, "save_checkpoint_path": str(tmp_path / "halves"), "resume": True}
    train(session(dataset, **{**halves, "max_steps": 4}))
    assert train(session(dataset, **halves))["steps_this_run"] == 4
    assert_identical(
        Checkpoint(tmp_path / "halves" / "step_000000008"),
        Checkpoint(tmp_path / "today" / "step_000000008"),
    )
