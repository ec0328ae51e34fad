"""`python main.py` as users run it: train, eval, inference, export, resume, errors.

Every run is a real process; assertions are on its metrics log, checkpoints and
exported model, not on its console text alone.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dataloading.files import SplitBinaryFiles
from dataloading.split_binary import ShardSpec, SplitBinaryDataset, categorical_tensors
from dataloading.synthetic import build_teacher, generate_split_binary
from dataloading.teacher import FeatureSampler
from dlrm.checkpoint.model_state import restore_model_weights
from dlrm.checkpoint.reader import Checkpoint
from dlrm.embedding.planner.placement import PlannerConfig, plan_sharding
from dlrm.embedding.planner.types import TableSpec
from dlrm.evaluation import metrics
from dlrm.model.config import ModelConfig
from dlrm.model.dlrm import Dlrm
from dlrm.model.export import serving_inputs
from feature_spec import FeatureSpec
from tests.harness.checkpoints import assert_identical
from tests.harness.processes import run

CARDINALITIES = (50, 200, 1000, 30, 5000, 7, 400, 90)
NUM_NUMERICAL = 5
SEED = 3
MODEL_FLAGS = [
    "--batch_size=1024",
    "--optimizer=adam",
    "--learning_rate=0.01",
    "--warmup_steps=0",
    "--decay_start_step=0",
    "--embedding_dim=8",
    "--bottom_mlp_dims=32,8",
    "--top_mlp_dims=32,1",
    "--print_freq=20",
]


def main_py(
    *flags: str, timeout: float = 300, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    result = run([sys.executable, "main.py", *flags], timeout=timeout, env=env)
    return result.returncode, result.stdout, result.stderr


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def summary(log: Path) -> dict:
    found = [r for r in records(log) if r["event"] == "summary"]
    assert found, log.read_text()
    return found[-1]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "synthetic"
    generate_split_binary(
        path, CARDINALITIES, NUM_NUMERICAL, rows={"train": 60_000, "test": 20_000}, seed=SEED
    )
    return path


@pytest.fixture(scope="module")
def trained(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoint directory of a 2-epoch run."""
    out = tmp_path_factory.mktemp("run") / "checkpoints"
    code, stdout, stderr = main_py(
        f"--dataset_path={dataset}",
        *MODEL_FLAGS,
        "--epochs=2",
        "--evals_per_epoch=2",
        f"--save_checkpoint_path={out}",
    )
    assert code == 0, stderr + stdout
    return out


def teacher_auc(dataset: Path) -> float:
    spec = FeatureSpec.load(dataset / "feature_spec.yaml")
    files = SplitBinaryFiles.open(spec, "test")
    assert files.numerical is not None
    ids = [files.categorical[f.name].memmap().astype(np.int64) for f in spec.categorical_features]
    sampler = FeatureSampler(NUM_NUMERICAL, CARDINALITIES, (1,) * len(CARDINALITIES), 1.1)
    teacher = build_teacher(sampler, SEED, positive_rate=0.25)
    logits = teacher.logits(files.numerical.memmap().astype(np.float32), ids)
    return metrics.roc_auc(files.label.memmap(), logits)


def test_training_learns_the_teacher(dataset: Path, trained: Path, tmp_path: Path) -> None:
    untrained_log = tmp_path / "untrained.jsonl"
    code, _, stderr = main_py(
        f"--dataset_path={dataset}", *MODEL_FLAGS, "--mode=eval", f"--log_path={untrained_log}"
    )
    assert code == 0, stderr
    untrained = summary(untrained_log)["auc"]
    # Only --amp on a CPU times the matmuls.
    assert "matmul_gflops" not in [r["event"] for r in records(untrained_log)]
    result = summary(trained / "metrics.jsonl")
    best_possible = teacher_auc(dataset)
    # Threshold from the teacher: at least 60% of its margin over chance.
    threshold = 0.5 + 0.6 * (best_possible - 0.5)
    assert result["auc"] > threshold, (result, best_possible)
    assert result["auc"] > untrained + 0.1, (result["auc"], untrained)
    assert result["auc"] <= best_possible + 0.01
    events = [r["event"] for r in records(trained / "metrics.jsonl")]
    assert events.count("eval") == 4 and events[0] == "start" and "train" in events
    train_records = [r for r in records(trained / "metrics.jsonl") if r["event"] == "train"]
    assert all(r["samples_per_second"] > 0 and np.isfinite(r["loss"]) for r in train_records)
    assert result["steps"] == 2 * (60_000 // 1024)
    assert list((trained / "tensorboard").glob("events.out.tfevents.*"))
    written = json.loads((trained / "config.json").read_text())
    assert written["optimizer"] == "adam" and written["bottom_mlp_dims"] == [32, 8]
    # Checkpoints at every evaluation, the last three kept.
    assert [p.name for p in sorted(trained.glob("step_*"))] == [
        "step_000000058",
        "step_000000087",
        "step_000000116",
    ]


def test_amp_on_a_cpu_reports_how_fast_it_multiplies_in_bfloat16(
    dataset: Path, tmp_path: Path
) -> None:
    log = tmp_path / "amp.jsonl"
    code, stdout, stderr = main_py(
        f"--dataset_path={dataset}", *MODEL_FLAGS, "--amp", "--mode=eval", f"--log_path={log}"
    )
    assert code == 0, stderr
    [speeds] = [r for r in records(log) if r["event"] == "matmul_gflops"]
    assert speeds["float32"] > 0 and speeds["bfloat16"] > 0
    line = f"GFLOP/s in bfloat16 and {speeds['float32']:.0f} in float32"
    assert line in stdout + stderr
    slower = speeds["bfloat16"] < speeds["float32"]
    assert ("--amp will likely make training slower" in stdout + stderr) == slower
    assert summary(log)["auc"] > 0


def test_resume_from_a_checkpoint_matches_a_straight_run(dataset: Path, tmp_path: Path) -> None:
    common = [
        f"--dataset_path={dataset}",
        *MODEL_FLAGS,
        "--optimizer=adagrad",
        "--learning_rate=0.05",
        "--evals_per_epoch=0",
    ]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert main_py(*common, "--max_steps=40", f"--save_checkpoint_path={straight}")[0] == 0
    assert main_py(*common, "--max_steps=20", f"--save_checkpoint_path={halves}")[0] == 0
    code, _, stderr = main_py(
        *common,
        "--max_steps=40",
        f"--save_checkpoint_path={halves}",
        f"--restore_checkpoint_path={halves}",
    )
    assert code == 0, stderr
    resumed = summary(halves / "metrics.jsonl")
    assert resumed["steps"] == 40 and resumed["steps_this_run"] == 20
    assert_identical(Checkpoint(halves / "step_000000040"), Checkpoint(straight / "step_000000040"))


def test_export_serves_the_same_predictions_in_a_fresh_process(
    dataset: Path, trained: Path, tmp_path: Path
) -> None:
    served = assert_export_serves_like_the_checkpoint(trained, dataset, tmp_path, rows=500)
    assert float(served.std()) > 0.05  # a trained model, not a constant


def assert_export_serves_like_the_checkpoint(
    checkpoints: Path, dataset: Path, tmp_path: Path, rows: int
) -> np.ndarray:
    """Exports the newest checkpoint in `checkpoints` with `main.py --mode
    export`, serves the first `rows` test rows from the SavedModel in a fresh
    process and checks the probabilities against the checkpoint's model;
    returns them."""
    saved_model = tmp_path / "saved_model"
    code, _, stderr = main_py(
        "--mode=export",
        f"--restore_checkpoint_path={checkpoints}",
        f"--saved_model_output_path={saved_model}",
    )
    assert code == 0, stderr
    checkpoint = Checkpoint(checkpoints)
    spec = FeatureSpec.load(dataset / "feature_spec.yaml")
    batch = SplitBinaryDataset(spec, "test", ShardSpec(rows)).read_batch(0)
    numerical = batch.numerical
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, numerical=numerical, **serving_inputs(batch.categorical, spec.cardinalities))
    served_path = tmp_path / "served.npy"
    script = "tests/integration/scripts/serve_saved_model.py"
    result = run(
        [sys.executable, script, str(saved_model), str(inputs), str(served_path)], timeout=120
    )
    assert result.returncode == 0, result.stderr
    model = Dlrm(ModelConfig.from_dict(checkpoint.manifest["model"]))
    restore_model_weights(model, checkpoint)
    expected = 1 / (1 + np.exp(-model(numerical, categorical_tensors(batch.categorical)).numpy()))
    served = np.load(served_path)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    return served


def test_inference_mode_reports_throughput(dataset: Path, trained: Path, tmp_path: Path) -> None:
    log = tmp_path / "inference.jsonl"
    code, _, stderr = main_py(
        f"--dataset_path={dataset}",
        *MODEL_FLAGS,
        "--mode=inference",
        "--max_steps=15",
        "--benchmark_warmup_steps=3",
        f"--restore_checkpoint_path={trained}",
        f"--log_path={log}",
    )
    assert code == 0, stderr
    result = summary(log)
    assert result["steps"] == 15 and result["samples_per_second"] > 0
    assert result["latency_p50_ms"] <= result["latency_p99_ms"]


def test_corrupted_checkpoint_is_named_and_the_previous_one_offered(
    dataset: Path, trained: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "checkpoints"
    shutil.copytree(trained, copy)
    newest = sorted(copy.glob("step_*"))[-1]
    victim = newest / "dense.npz"
    victim.write_bytes(victim.read_bytes()[:-100])
    code, _, stderr = main_py(
        f"--dataset_path={dataset}",
        *MODEL_FLAGS,
        "--mode=eval",
        f"--restore_checkpoint_path={copy}",
    )
    assert code == 1
    assert str(victim) in stderr and "truncated" in stderr
    assert str(sorted(copy.glob("step_*"))[-2]) in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch_size=0"], "--batch_size: expected > 0, got 0"),
        (["--embedding_dim=16"], "--bottom_mlp_dims: the last width must equal --embedding_dim"),
        (["--bottom_mlp_dims=32,x"], "--bottom_mlp_dims: expected comma-separated integers"),
    ],
)
def test_bad_flags_exit_with_the_flag_named(dataset: Path, flags: list[str], message: str) -> None:
    code, _, stderr = main_py(f"--dataset_path={dataset}", *MODEL_FLAGS, *flags, timeout=60)
    assert code == 2
    assert message in stderr and "Traceback" not in stderr


def test_a_sharding_plan_for_two_ranks_is_refused_by_one_process(
    dataset: Path, tmp_path: Path
) -> None:
    spec = FeatureSpec.load(dataset)
    plan = plan_sharding([TableSpec(rows, 8) for rows in spec.cardinalities], PlannerConfig(2))
    plan_file = plan.save(tmp_path / "plan.json")
    code, _, stderr = main_py(
        f"--dataset_path={dataset}", *MODEL_FLAGS, f"--sharding_plan={plan_file}", timeout=120
    )
    assert code == 1
    message = f"--sharding_plan {plan_file}: the sharding plan is for 2 ranks, this run has 1"
    assert message in stderr and "Traceback" not in stderr


def test_export_refuses_to_run_under_a_launcher(tmp_path: Path) -> None:
    flags = (
        "--mode=export",
        f"--restore_checkpoint_path={tmp_path}",
        f"--saved_model_output_path={tmp_path / 'model'}",
    )
    # What horovodrun sets for each rank: every rank refuses, rank 0 says why.
    for rank in ("0", "1"):
        code, _, stderr = main_py(*flags, env={"HOROVOD_RANK": rank}, timeout=120)
        assert code == 2
        said = "--mode export: run it as one process" in stderr
        assert said == (rank == "0") and "Traceback" not in stderr, stderr
    assert not (tmp_path / "model").exists()
