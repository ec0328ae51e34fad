"""`python main.py` as users run it: train, eval, inference, export, resume, errors.

Every run is a real process; assertions are on its metrics log, checkpoints and
exported model, not on its console text alone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dataloading.files import SplitBinaryFiles
from dataloading.synthetic import build_teacher
from dataloading.teacher import FeatureSampler
from dlrm.app.records import last_record, read_records
from dlrm.checkpoint.reader import Checkpoint
from dlrm.embedding.planner.placement import PlannerConfig, plan_sharding
from dlrm.embedding.planner.types import TableSpec
from dlrm.evaluation import metrics
from feature_spec import FeatureSpec
from harness.checkpoints import assert_identical
from harness.datasets import dataset_fixture
from harness.export import assert_export_serves_like_the_checkpoint
from harness.models import ADAM_FLAGS, EIGHT_TABLES
from harness.processes import main_py

NUM_NUMERICAL = 5
SEED = 3


dataset = dataset_fixture(EIGHT_TABLES, NUM_NUMERICAL, {"train": 60_000, "test": 20_000}, seed=SEED)


def adam_main_py(dataset: Path, *flags: str, **options: Any) -> subprocess.CompletedProcess[str]:
    """`main.py` as one process on `dataset`, the `ADAM_FLAGS` model, then `flags`."""
    return main_py(1, f"--dataset_path={dataset}", *ADAM_FLAGS, *flags, **options)


@pytest.fixture(scope="module")
def trained(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoint directory of a 2-epoch run."""
    out = tmp_path_factory.mktemp("run") / "checkpoints"
    adam_main_py(
        dataset, "--epochs=2", "--evals_per_epoch=2", f"--save_checkpoint_path={out}", check=True
    )
    return out


def teacher_auc(dataset: Path) -> float:
    spec = FeatureSpec.load(dataset / "feature_spec.yaml")
    files = SplitBinaryFiles.open(spec, "test")
    assert files.numerical is not None
    ids = [files.categorical[f.name].memmap().astype(np.int64) for f in spec.categorical_features]
    sampler = FeatureSampler(NUM_NUMERICAL, EIGHT_TABLES, (1,) * len(EIGHT_TABLES), 1.1)
    teacher = build_teacher(sampler, SEED, positive_rate=0.25)
    logits = teacher.logits(files.numerical.memmap().astype(np.float32), ids)
    return metrics.roc_auc(files.label.memmap(), logits)


def test_training_learns_the_teacher(dataset: Path, trained: Path, tmp_path: Path) -> None:
    untrained_log = tmp_path / "untrained.jsonl"
    adam_main_py(dataset, "--mode=eval", f"--log_path={untrained_log}", check=True)
    untrained = last_record(untrained_log, "summary")["auc"]
    # Only --amp on a CPU times the matmuls.
    assert "matmul_gflops" not in [r["event"] for r in read_records(untrained_log)]
    result = last_record(trained / "metrics.jsonl", "summary")
    best_possible = teacher_auc(dataset)
    # Threshold from the teacher: at least 60% of its margin over chance.
    threshold = 0.5 + 0.6 * (best_possible - 0.5)
    assert result["auc"] > threshold, (result, best_possible)
    assert result["auc"] > untrained + 0.1, (result["auc"], untrained)
    assert result["auc"] <= best_possible + 0.01
    events = [r["event"] for r in read_records(trained / "metrics.jsonl")]
    assert events.count("eval") == 4 and events[0] == "start" and "train" in events
    train_records = read_records(trained / "metrics.jsonl", "train")
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
    result = adam_main_py(dataset, "--amp", "--mode=eval", f"--log_path={log}", check=True)
    [speeds] = read_records(log, "matmul_gflops")
    assert speeds["float32"] > 0 and speeds["bfloat16"] > 0
    line = f"GFLOP/s in bfloat16 and {speeds['float32']:.0f} in float32"
    assert line in result.stdout + result.stderr
    slower = speeds["bfloat16"] < speeds["float32"]
    assert ("--amp will likely make training slower" in result.stdout + result.stderr) == slower
    assert last_record(log, "summary")["auc"] > 0


def test_resume_from_a_checkpoint_matches_a_straight_run(dataset: Path, tmp_path: Path) -> None:
    common = ["--optimizer=adagrad", "--learning_rate=0.05", "--evals_per_epoch=0"]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    adam_main_py(
        dataset, *common, "--max_steps=40", f"--save_checkpoint_path={straight}", check=True
    )
    adam_main_py(dataset, *common, "--max_steps=20", f"--save_checkpoint_path={halves}", check=True)
    adam_main_py(
        dataset,
        *common,
        "--max_steps=40",
        f"--save_checkpoint_path={halves}",
        f"--restore_checkpoint_path={halves}",
        check=True,
    )
    resumed = last_record(halves / "metrics.jsonl", "summary")
    assert resumed["steps"] == 40 and resumed["steps_this_run"] == 20
    assert_identical(Checkpoint(halves / "step_000000040"), Checkpoint(straight / "step_000000040"))


def test_export_serves_the_same_predictions_in_a_fresh_process(
    dataset: Path, trained: Path, tmp_path: Path
) -> None:
    served = assert_export_serves_like_the_checkpoint(trained, dataset, tmp_path, rows=500)
    assert float(served.std()) > 0.05  # a trained model, not a constant


def test_inference_mode_reports_throughput(dataset: Path, trained: Path, tmp_path: Path) -> None:
    log = tmp_path / "inference.jsonl"
    adam_main_py(
        dataset,
        "--mode=inference",
        "--max_steps=15",
        "--benchmark_warmup_steps=3",
        f"--restore_checkpoint_path={trained}",
        f"--log_path={log}",
        check=True,
    )
    result = last_record(log, "summary")
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
    result = adam_main_py(dataset, "--mode=eval", f"--restore_checkpoint_path={copy}")
    assert result.returncode == 1
    assert str(victim) in result.stderr and "truncated" in result.stderr
    assert str(sorted(copy.glob("step_*"))[-2]) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch_size=0"], "--batch_size: expected > 0, got 0"),
        (["--embedding_dim=16"], "--bottom_mlp_dims: the last width must equal --embedding_dim"),
        (["--bottom_mlp_dims=32,x"], "--bottom_mlp_dims: expected comma-separated integers"),
    ],
)
def test_bad_flags_exit_with_the_flag_named(dataset: Path, flags: list[str], message: str) -> None:
    result = adam_main_py(dataset, *flags, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_sharding_plan_for_two_ranks_is_refused_by_one_process(
    dataset: Path, tmp_path: Path
) -> None:
    spec = FeatureSpec.load(dataset)
    plan = plan_sharding([TableSpec(rows, 8) for rows in spec.cardinalities], PlannerConfig(2))
    plan_file = plan.save(tmp_path / "plan.json")
    result = adam_main_py(dataset, f"--sharding_plan={plan_file}", timeout=120)
    assert result.returncode == 1
    message = f"--sharding_plan {plan_file}: the sharding plan is for 2 ranks, this run has 1"
    assert message in result.stderr and "Traceback" not in result.stderr


def test_export_refuses_to_run_under_a_launcher(tmp_path: Path) -> None:
    flags = (
        "--mode=export",
        f"--restore_checkpoint_path={tmp_path}",
        f"--saved_model_output_path={tmp_path / 'model'}",
    )
    # What horovodrun sets for each rank: every rank refuses, rank 0 says why.
    for rank in ("0", "1"):
        result = main_py(1, *flags, env={"HOROVOD_RANK": rank}, timeout=120)
        assert result.returncode == 2
        said = "--mode export: run it as one process" in result.stderr
        assert said == (rank == "0") and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "model").exists()
