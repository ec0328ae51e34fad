"""The trainer on a small synthetic dataset: learning, AMP/XLA, resume, NaN stop."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from dataloading.split_binary import Batch, ShardSpec, SplitBinaryDataset
from dataloading.synthetic import generate_split_binary
from dlrm.app import Session, build_session
from dlrm.checkpoint import Checkpoint, CheckpointError
from dlrm.config import RunConfig
from dlrm.reporting import MetricsLog
from dlrm.trainer import NonFiniteLossError
from dlrm.training_state import (
    check_model_matches,
    restore_training_state,
    save_training_state,
)

CARDINALITIES = (23, 7, 11, 130, 5)
BATCH = 64


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "synthetic"
    generate_split_binary(path, CARDINALITIES, 3, rows={"train": 20 * BATCH, "test": 500}, seed=4)
    return path


def session(dataset: Path, **overrides: object) -> Session:
    values: dict = {
        "dataset_path": str(dataset),
        "batch_size": BATCH,
        "optimizer": "adagrad",
        "learning_rate": 0.05,
        "warmup_steps": 0,
        "decay_start_step": 0,
        "embedding_dim": 6,
        "bottom_mlp_dims": (9, 6),
        "top_mlp_dims": (11, 1),
        "seed": 1,
    }
    values.update(overrides)
    return build_session(RunConfig(**values), MetricsLog(None, None, console=io.StringIO()))


def batches(dataset: Path, count: int) -> list[Batch]:
    from feature_spec import FeatureSpec

    spec = FeatureSpec.load(dataset / "feature_spec.yaml")
    data = SplitBinaryDataset(spec, "train", ShardSpec(BATCH))
    return list(data.to_tf_dataset().take(count))


def weights(s: Session) -> list[np.ndarray]:
    assert s.trainer is not None
    return [
        np.asarray(v.numpy()) for v in s.trainer.dense_variables + s.trainer.embedding_variables
    ]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_loss_decreases(dataset: Path, optimizer: str) -> None:
    lr = {"sgd": 2.0, "adagrad": 0.1, "adam": 0.01}[optimizer]
    s = session(dataset, optimizer=optimizer, learning_rate=lr)
    assert s.trainer is not None
    data = batches(dataset, 8)
    epoch_losses = []
    for _ in range(6):
        epoch_losses.append(np.mean([float(s.trainer.train_step(b)) for b in data]))
    assert epoch_losses[-1] < 0.95 * epoch_losses[0], epoch_losses


@pytest.mark.parametrize(("amp", "xla"), [(True, False), (False, True), (True, True)])
def test_amp_and_xla_train_and_match_fp32(dataset: Path, amp: bool, xla: bool) -> None:
    reference = session(dataset, learning_rate=0.2)
    variant = session(dataset, learning_rate=0.2, amp=amp, xla=xla)
    assert reference.trainer is not None and variant.trainer is not None
    assert variant.precision.dtype_policy == ("mixed_bfloat16" if amp else "float32")
    for a, b in zip(weights(reference), weights(variant), strict=True):
        np.testing.assert_array_equal(a, b)  # same seed, same start
    data = batches(dataset, 8)
    first = [
        (float(reference.trainer.train_step(b)), float(variant.trainer.train_step(b)))
        for b in data[:3]
    ]
    # bfloat16 keeps ~3 significant digits; XLA alone only reorders float32 sums.
    tolerance = 2e-2 if amp else 1e-5
    for expected, actual in first:
        assert actual == pytest.approx(expected, rel=tolerance)
    for a, b in zip(weights(reference), weights(variant), strict=True):
        np.testing.assert_allclose(b, a, atol=5e-3 if amp else 1e-5)
    losses = [np.mean([float(variant.trainer.train_step(b)) for b in data]) for _ in range(6)]
    assert losses[-1] < 0.95 * losses[0], losses


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_resume_gives_the_same_weights_as_an_uninterrupted_run(
    dataset: Path, tmp_path: Path, optimizer: str
) -> None:
    data = batches(dataset, 10)
    straight = session(dataset, optimizer=optimizer)
    assert straight.trainer is not None
    for b in data:
        straight.trainer.train_step(b)

    first = session(dataset, optimizer=optimizer)
    assert first.trainer is not None
    for b in data[:5]:
        first.trainer.train_step(b)
    path = save_training_state(first.trainer, tmp_path, {"model": first.model_config.to_dict()})

    resumed = session(dataset, optimizer=optimizer, seed=99)  # other init: all must be restored
    assert resumed.trainer is not None
    checkpoint = Checkpoint(path)
    check_model_matches(checkpoint, resumed.model_config.to_dict())
    assert restore_training_state(resumed.trainer, checkpoint) == 5
    for b in data[5:]:
        resumed.trainer.train_step(b)
    for a, b in zip(weights(straight), weights(resumed), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    straight_state = straight.trainer.optimizer.state()
    resumed_state = resumed.trainer.optimizer.state()
    assert set(straight_state) == set(resumed_state)
    for name, value in straight_state.items():
        np.testing.assert_allclose(resumed_state[name], value, rtol=1e-6, atol=1e-7)


def test_checkpoint_of_another_model_is_refused(dataset: Path, tmp_path: Path) -> None:
    s = session(dataset)
    assert s.trainer is not None
    path = save_training_state(s.trainer, tmp_path, {"model": s.model_config.to_dict()})
    other = session(dataset, embedding_dim=4, bottom_mlp_dims=(9, 4))
    with pytest.raises(CheckpointError, match=r"embedding_dim: checkpoint 6, this run 4"):
        check_model_matches(Checkpoint(path), other.model_config.to_dict())
    adam = session(dataset, optimizer="adam")
    assert adam.trainer is not None
    with pytest.raises(
        CheckpointError, match=r"--optimizer adagrad, this run uses --optimizer adam"
    ):
        restore_training_state(adam.trainer, Checkpoint(path))


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_weights(
    dataset: Path, tmp_path: Path
) -> None:
    s = session(dataset)
    assert s.trainer is not None
    data = batches(dataset, 4)
    for b in data[:3]:
        s.trainer.train_step(b)
    good = weights(s)
    poisoned = data[3]._replace(
        numerical=tf.tensor_scatter_nd_update(data[3].numerical, [[0, 0]], [float("nan")])
    )
    loss = s.trainer.train_step(poisoned)
    assert not np.isfinite(float(loss))
    for a, b in zip(good, weights(s), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(NonFiniteLossError, match=r"not finite at step 3 .*--learning_rate"):
        s.trainer.check_finite()
    with pytest.raises(NonFiniteLossError):
        save_training_state(s.trainer, tmp_path, {})
    assert not list(tmp_path.iterdir())  # nothing written after the bad step
