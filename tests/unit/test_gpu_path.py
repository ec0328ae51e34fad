"""The GPU code path run on a CPU (`DLRM_GPU_PATH_ON_CPU=1`): float16 with dynamic
loss scaling trains, an overflow skips its step and halves the scale, a run of
skipped steps stops training, and the loss scale's state survives a checkpoint."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from dlrm.app.assembly import AssembledRun
from dlrm.app.config import ConfigError
from dlrm.app.sharding import ResolvedSettings
from dlrm.checkpoint.reader import Checkpoint
from dlrm.distributed.agreement import RankMismatchError, check_ranks_agree
from dlrm.distributed.collectives import Collectives
from dlrm.distributed.devices import GPU_PATH_ON_CPU_ENV, gpu_code_path
from dlrm.train import state
from dlrm.train.precision import INITIAL_LOSS_SCALE_ENV, Precision
from dlrm.train.state import SKIPPED_STEPS_KEY, restore_training_state, save_training_state
from dlrm.train.trainer import MAX_CONSECUTIVE_SKIPS, LossScaleError
from harness.assembly import BATCH, assembled_run, batches, weights
from harness.datasets import SMALL_TABLES, dataset_fixture
from harness.non_finite import nan_in_one_logit

dataset = dataset_fixture(SMALL_TABLES, 3, {"train": 20 * BATCH, "test": 500}, seed=4)
# Overflows float16 in every step's gradients: the scaled gradient of one logit is
# already 1e30 / 64 times the unscaled one, past float16's 65504 by far.
HUGE_SCALE = 1e30


@pytest.fixture
def gpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GPU_PATH_ON_CPU_ENV, "1")


def float16_run(dataset: Path, **overrides: Any) -> AssembledRun:
    run = assembled_run(dataset, amp=True, learning_rate=0.1, **overrides)
    assert run.trainer is not None and run.trainer.loss_scale is not None
    return run


def loss_scale_state(run: AssembledRun) -> tuple[float, int, int]:
    """(scale, finite steps since it last changed, steps skipped in a row)."""
    assert run.trainer is not None and run.trainer.loss_scale is not None
    scale = run.trainer.loss_scale
    return (
        float(scale.scale.numpy()),
        int(scale.good_steps.numpy()),
        int(scale.skipped_steps.numpy()),
    )


def test_the_switch_resolves_the_gpu_code_path_on_a_cpu(
    dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = assembled_run(dataset, amp=True)
    assert not gpu_code_path()
    assert cpu.resolved == ResolvedSettings(
        on_gpu=False,
        emulated=False,
        precision=Precision("mixed_bfloat16"),
        initial_loss_scale=None,
        dense_chunk_rows=cpu.config.dense_chunk_rows_for(False),
        use_kernels=True,
    )
    monkeypatch.setenv(GPU_PATH_ON_CPU_ENV, "1")
    console = io.StringIO()
    gpu = assembled_run(dataset, amp=True, console=console)
    assert gpu_code_path()
    assert gpu.resolved == ResolvedSettings(
        on_gpu=True,
        emulated=True,
        precision=Precision("mixed_float16"),
        initial_loss_scale=2.0**15,
        dense_chunk_rows=0,
        use_kernels=False,
    )
    assert "DLRM_GPU_PATH_ON_CPU=1: the GPU code path runs on this CPU" in console.getvalue()
    assert gpu.model.interaction.block_rows is None  # the dot interaction, whole
    assert not gpu.model.use_kernels
    assert gpu.trainer is not None and gpu.trainer.dense_chunk_rows == 0
    assert gpu.trainer.loss_scale is not None
    assert gpu.resolved.to_dict()["wire_dtype"] == "float16"
    monkeypatch.setenv(INITIAL_LOSS_SCALE_ENV, "a lot")
    with pytest.raises(ConfigError, match="DLRM_INITIAL_LOSS_SCALE: expected a positive number"):
        assembled_run(dataset, amp=True)


def test_float16_with_loss_scaling_learns(dataset: Path, gpu_path: None) -> None:
    run = float16_run(dataset)
    assert run.trainer is not None
    data = batches(dataset, 8)
    losses = [np.mean([float(run.trainer.train_step(b)) for b in data]) for _ in range(6)]
    assert losses[-1] < 0.95 * losses[0], losses
    assert loss_scale_state(run) == (2.0**15, 48, 0)  # no overflow at the default scale
    run.trainer.check_finite()


def test_an_overflowing_step_is_skipped_and_halves_the_scale(
    dataset: Path, gpu_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(INITIAL_LOSS_SCALE_ENV, str(HUGE_SCALE))
    run = float16_run(dataset)
    assert run.trainer is not None
    before = weights(run)
    loss = float(run.trainer.train_step(batches(dataset, 1)[0]))
    assert np.isfinite(loss)  # the loss is unscaled: only the gradients overflowed
    for a, b in zip(before, weights(run), strict=True):
        np.testing.assert_array_equal(b, a)
    assert loss_scale_state(run) == (float(np.float32(HUGE_SCALE) / 2), 0, 1)
    assert int(run.trainer.step.numpy()) == 1  # skipped, still a step of the data
    run.trainer.check_finite()  # not a failure


def test_a_non_finite_loss_under_loss_scaling_is_skipped_not_a_failure(
    dataset: Path, gpu_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float16 overflow in the forward pass (here a NaN logit, which leaves the
    gradients finite) skips the step and halves the scale, as an overflow of the
    gradients does; a finite step after it ends the run of skipped steps."""
    run = float16_run(dataset)
    assert run.trainer is not None
    poisoned = tf.Variable(False)
    monkeypatch.setattr(
        run.model, "dense_forward", nan_in_one_logit(run.model.dense_forward, poisoned)
    )
    data = batches(dataset, 3)
    run.trainer.train_step(data[0])
    before = weights(run)
    poisoned.assign(True)
    assert np.isnan(float(run.trainer.train_step(data[1])))
    for a, b in zip(before, weights(run), strict=True):
        np.testing.assert_array_equal(b, a)
    assert loss_scale_state(run) == (2.0**14, 0, 1)
    run.trainer.check_finite()
    poisoned.assign(False)
    run.trainer.train_step(data[2])
    assert loss_scale_state(run) == (2.0**14, 1, 0)
    assert any(not np.array_equal(a, b) for a, b in zip(before, weights(run), strict=True))


def test_a_run_of_skipped_steps_stops_training_naming_the_step_and_the_scale(
    dataset: Path, tmp_path: Path, gpu_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From 1e30 the halvings would take about 85 steps to reach a scale that
    trains: the bound stops it first, at step MAX_CONSECUTIVE_SKIPS - 1."""
    monkeypatch.setenv(INITIAL_LOSS_SCALE_ENV, str(HUGE_SCALE))
    run = float16_run(dataset)
    assert run.trainer is not None
    data = batches(dataset, 10)
    for step in range(MAX_CONSECUTIVE_SKIPS - 1):
        run.trainer.train_step(data[step % len(data)])
    run.trainer.check_finite()
    run.trainer.train_step(data[0])
    scale = float(np.float32(HUGE_SCALE) / 2**MAX_CONSECUTIVE_SKIPS)
    assert loss_scale_state(run) == (scale, 0, MAX_CONSECUTIVE_SKIPS)
    last = MAX_CONSECUTIVE_SKIPS - 1
    message = (
        rf"{MAX_CONSECUTIVE_SKIPS} steps in a row, up to step {last}, had a loss or "
        r"gradient that was not finite .* the loss scale " + re.escape(f"(now {scale:g})")
    )
    with pytest.raises(LossScaleError, match=message) as raised:
        run.trainer.check_finite()
    assert (raised.value.step, raised.value.skipped) == (last, MAX_CONSECUTIVE_SKIPS)
    with pytest.raises(LossScaleError):  # and no checkpoint after it
        save_training_state(run.trainer, tmp_path, {})
    assert not list(tmp_path.iterdir())


def test_the_loss_scale_and_skipped_steps_survive_a_checkpoint(
    dataset: Path, tmp_path: Path, gpu_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(INITIAL_LOSS_SCALE_ENV, str(HUGE_SCALE))
    run = float16_run(dataset)
    assert run.trainer is not None
    for b in batches(dataset, 3):
        run.trainer.train_step(b)
    saved = loss_scale_state(run)
    assert saved == (float(np.float32(HUGE_SCALE) / 8), 0, 3)
    path = save_training_state(run.trainer, tmp_path / "new", {})
    monkeypatch.delenv(INITIAL_LOSS_SCALE_ENV)
    resumed = float16_run(dataset, seed=99)
    assert resumed.trainer is not None
    assert loss_scale_state(resumed) == (2.0**15, 0, 0)
    assert restore_training_state(resumed.trainer, Checkpoint(path)) == 3
    assert loss_scale_state(resumed) == saved

    # A checkpoint written before skipped steps were counted restores them as 0.
    write_dense = state._dense_arrays

    def without_skipped_steps(trainer: Any, step: int) -> dict[str, np.ndarray]:
        arrays = write_dense(trainer, step)
        del arrays[SKIPPED_STEPS_KEY]
        return arrays

    monkeypatch.setattr(state, "_dense_arrays", without_skipped_steps)
    old = save_training_state(run.trainer, tmp_path / "old", {})
    assert SKIPPED_STEPS_KEY not in Checkpoint(old).dense()
    assert restore_training_state(resumed.trainer, Checkpoint(old)) == 3
    assert loss_scale_state(resumed) == (saved[0], saved[1], 0)


class OtherRankOnTheGpuPath(Collectives):
    """Rank 0 of two, whose rank 1 resolved the emulated GPU code path."""

    world_size = 2

    def __init__(self, theirs: ResolvedSettings) -> None:
        self.theirs = theirs

    def allgather_object(self, value: Any, name: str) -> list[Any]:
        return [value, {**value, "resolved": self.theirs.to_dict()}]


def test_ranks_that_resolve_different_code_paths_disagree_naming_what_differs() -> None:
    ours = ResolvedSettings(False, False, Precision("mixed_bfloat16"), None, 512, True)
    theirs = ResolvedSettings(True, True, Precision("mixed_float16"), 2.0**15, 0, False)
    facts = {"flags": {"amp": True}, "resolved": ours.to_dict()}
    with pytest.raises(RankMismatchError) as raised:
        check_ranks_agree(OtherRankOnTheGpuPath(theirs), facts, {"resolved": "Same devices"})
    message = str(raised.value)
    assert (
        "rank 1 differs from rank 0 in resolved.code_path (rank 0: 'cpu', rank 1: 'gpu, "
        "emulated on a CPU (DLRM_GPU_PATH_ON_CPU=1)'); also in resolved.dense_chunk_rows "
        "(512 against 0), resolved.dtype_policy ('mixed_bfloat16' against 'mixed_float16'), "
        "resolved.initial_loss_scale (None against 32768.0). Same devices"
    ) in message
    check_ranks_agree(OtherRankOnTheGpuPath(ours), facts)  # alike: no error
