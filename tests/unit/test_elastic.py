"""The pieces of elastic training that run without a Horovod job: which errors
count as a lost rank, the peer they name, the launch it detects, the run's
progress and its hook after each checkpoint, and the errors when there is
nothing to continue from. Continuation itself runs on three hosts in
tests/integration/test_elastic.py."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import tensorflow as tf
from horovod.common.exceptions import HorovodInternalError

from dlrm.app.config import ConfigError, RunConfig
from dlrm.app.elastic import checkpoint_to_continue_from, train_elastic
from dlrm.app.modes.training import TrainProgress, train
from dlrm.checkpoint.format import CheckpointError
from dlrm.distributed.launcher import launched_elastic
from dlrm.distributed.membership import lost_a_rank, lost_peer
from harness.assembly import SMALL_MODEL, assembled_run
from harness.checkpoints import checkpoint_steps
from harness.datasets import SMALL_TABLES, dataset_fixture

STEPS = 10
dataset = dataset_fixture(
    SMALL_TABLES, 3, {"train": 8 * SMALL_MODEL["batch_size"], "test": 200}, seed=4
)

GLOO_READ_ERROR = (
    "Graph execution error:\n[third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error "
    "[127.0.0.1]:45232: Connection reset by peer\n\t [[{{node embedding_vectors}}]]"
)


def op_error(message: str) -> tf.errors.OpError:
    return tf.errors.UnknownError(None, None, message)


def test_a_failed_collective_is_a_lost_rank_and_other_errors_are_not() -> None:
    assert lost_a_rank(HorovodInternalError("gone"))
    assert lost_a_rank(op_error("Horovod has been shut down. This was caused by ..."))
    assert lost_a_rank(op_error(GLOO_READ_ERROR))
    assert not lost_a_rank(op_error("input must be a vector"))
    assert not lost_a_rank(ValueError("Horovod has been shut down"))  # not from an op
    assert not lost_a_rank(CheckpointError("unreadable"))


def test_the_peer_a_gloo_error_names_is_resolved_to_its_host() -> None:
    peer = lost_peer(op_error(GLOO_READ_ERROR))
    assert peer is not None and peer.endswith(" at 127.0.0.1"), peer
    assert lost_peer(op_error("Horovod has been shut down")) is None


def test_an_elastic_launch_is_horovodrun_with_a_discovery_script() -> None:
    assert launched_elastic({"HOROVOD_ELASTIC": "1", "HOROVOD_RANK": "0"})
    assert not launched_elastic({"HOROVOD_RANK": "0"})  # horovodrun -np N -H ...
    assert not launched_elastic({"HOROVOD_ELASTIC": "1"})  # no launcher's rank


def test_nothing_to_continue_from_names_the_step_and_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"a rank was lost at step 7 and .* holds no"):
        checkpoint_to_continue_from(str(tmp_path), 7, "a rank was lost")


def test_an_elastic_run_needs_a_checkpoint_directory() -> None:
    config = RunConfig(dataset_path="/nonexistent")
    with pytest.raises(ConfigError, match="needs --save_checkpoint_path"):
        train_elastic(config, io.StringIO(), lambda log, summary: None)


def test_progress_and_the_hook_after_each_checkpoint_before_the_last(
    dataset: Path, tmp_path: Path
) -> None:
    s = assembled_run(
        dataset,
        epochs=2,  # 8 steps an epoch: the run crosses an epoch
        max_steps=STEPS,
        evals_per_epoch=0,
        save_checkpoint_path=str(tmp_path),
        checkpoint_every_steps=4,
    )
    progress = TrainProgress()
    firsts: list[int] = []
    progress.on_first_step = lambda: firsts.append(progress.step)
    hooked: list[int] = []
    summary = train(s, progress, after_checkpoint=lambda: hooked.append(progress.step))
    assert summary["steps"] == progress.step == STEPS and progress.start_step == 0
    assert firsts == [1]
    assert hooked == [4, 8]  # not after the last step's checkpoint (10)
    assert checkpoint_steps(tmp_path) == [4, 8, 10]
