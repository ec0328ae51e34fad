"""`python main.py --interaction cross` as users run it: the DCNv2 model learns the
teacher as well as the dot model on the same budget of steps, a cross model
with one embedding width per table exports and serves in a fresh process, and
the scaled-down MLPerf DLRM-DCNv2 flagfile trains on multi-hot data."""

from __future__ import annotations

import sys
from pathlib import Path

from dlrm.app.records import last_record, read_records
from dlrm.checkpoint.reader import Checkpoint
from feature_spec import (
    CRITEO_1TB_MLPERF_CARDINALITIES,
    MLPERF_DCNV2_MULTI_HOT_SIZES,
    FeatureSpec,
)
from harness.datasets import dataset_fixture
from harness.export import assert_export_serves_like_the_checkpoint
from harness.models import ADAM_FLAGS, EIGHT_TABLES
from harness.processes import main_py, run

# One epoch over fresh rows, as click logs are trained: 234 steps of 1024.
TRAIN_ROWS = 240_000
COMMON = [*ADAM_FLAGS, "--epochs=1", "--evals_per_epoch=4", "--print_freq=50"]
DOT = ["--embedding_dim=8"]
# The default cross network: 3 layers; projection 512 is not below the width
# (8 + 8 x 8 = 72), so the layers are full rank.
CROSS = ["--interaction=cross", "--embedding_dim=8"]
# Widths per table, as many parameters as 8 each.
PER_TABLE = ["--interaction=cross", "--embedding_dim=4,8,8,4,16,4,12,8"]
# Seeds move the final AUC of either model by about 0.001 (measured: dot
# 0.8306-0.8318, cross 0.8316-0.8323 over 3 seeds).
SEED_SPREAD = 0.002


dataset = dataset_fixture(EIGHT_TABLES, 5, {"train": TRAIN_ROWS, "test": 20_000}, seed=3)


def eval_aucs(dataset: Path, log: Path, *flags: str) -> list[float]:
    main_py(1, f"--dataset_path={dataset}", *COMMON, *flags, f"--log_path={log}", check=True)
    return [r["auc"] for r in read_records(log, "eval")]


def test_cross_learns_the_teacher_as_well_as_dot(dataset: Path, tmp_path: Path) -> None:
    dot = eval_aucs(dataset, tmp_path / "dot.jsonl", *DOT)
    cross = eval_aucs(dataset, tmp_path / "cross.jsonl", *CROSS)
    assert len(dot) == len(cross) == 4
    assert dot[-1] > 0.8, dot  # it learned (untrained: about 0.5)
    # Cross learns faster (measured: +0.004 to +0.013 after a quarter of the
    # steps) and ends level with dot, within the seeds' spread.
    assert cross[0] > dot[0], (cross, dot)
    assert cross[-1] >= dot[-1] - SEED_SPREAD, (cross, dot)


def test_per_table_widths_export_and_serve_in_a_fresh_process(
    dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "checkpoints"
    main_py(
        1,
        f"--dataset_path={dataset}",
        *COMMON,
        *PER_TABLE,
        "--num_cross_layers=2",
        "--cross_layer_projection_dim=16",  # low rank: 16 < 8 + 64
        "--max_steps=40",
        f"--save_checkpoint_path={out}",
        check=True,
    )
    assert last_record(out / "metrics.jsonl", "summary")["auc"] > 0.7
    checkpoint = Checkpoint(out)  # the newest
    manifest = checkpoint.manifest["model"]
    assert manifest["interaction"] == "cross"
    assert manifest["embedding_dim"] == [4, 8, 8, 4, 16, 4, 12, 8]
    assert checkpoint.table_shape(4) == (5000, 16)

    served = assert_export_serves_like_the_checkpoint(out, dataset, tmp_path, rows=300)
    assert float(served.std()) > 0.02  # a trained model, not a constant


def test_a_cross_checkpoint_is_refused_by_a_dot_run(dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "checkpoints"
    main_py(
        1, f"--dataset_path={dataset}", *COMMON, *CROSS, "--max_steps=2",
        f"--save_checkpoint_path={out}",
        check=True,
    )  # fmt: skip
    result = main_py(
        1, f"--dataset_path={dataset}", *COMMON, *DOT, "--max_steps=4",
        f"--restore_checkpoint_path={out}",
    )  # fmt: skip
    assert result.returncode == 1
    assert "interaction: checkpoint 'cross', this run 'dot'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_scaled_down_mlperf_dcnv2_configuration_learns(tmp_path: Path) -> None:
    """dlrm/flagfiles/mlperf_dcnv2_small.flags on the dataset its comment makes
    (fewer rows: 48 steps), as a user runs them."""
    data = tmp_path / "mlperf_small"
    run(
        [
            sys.executable,
            "-m",
            "dataloading.synthetic",
            "--shape=mlperf_dcnv2_small",
            f"--output_dir={data}",
            "--train_rows=200000",
            "--test_rows=20000",
        ],
        timeout=300,
        check=True,
    )
    spec = FeatureSpec.load(data / "feature_spec.yaml")
    assert spec.hotness == MLPERF_DCNV2_MULTI_HOT_SIZES and max(spec.hotness) == 100
    assert spec.cardinalities == tuple(min(c, 2000) for c in CRITEO_1TB_MLPERF_CARDINALITIES)
    log = tmp_path / "metrics.jsonl"
    main_py(
        1,
        "--flagfile=dlrm/flagfiles/mlperf_dcnv2_small.flags",
        f"--dataset_path={data}",
        f"--log_path={log}",
        check=True,
    )
    result_summary = last_record(log, "summary")
    assert result_summary["steps"] == 200_000 // 4096
    # Measured 0.824 after 48 steps (0.835 after 97); untrained about 0.5.
    assert result_summary["auc"] > 0.78, result_summary
