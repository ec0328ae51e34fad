"""`main.py --mode export --quantize int8`: a trained model exported with float32 and
with int8 tables, both served in a fresh process that cannot import this project;
the int8 model scores the test split as the float32 one does, in about a quarter
of the table bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dlrm.evaluation.metrics import roc_auc
from dlrm.model.quantization import SCALE_OFFSET_BYTES
from harness.datasets import dataset_fixture
from harness.export import (
    export_checkpoint,
    serve_without_the_project,
    write_test_split_inputs,
)
from harness.models import ADAM_FLAGS, EIGHT_TABLES
from harness.processes import main_py

# Wide enough that the scales and offsets (8 bytes a row) cost little: (D + 8) / 4D.
DIM = 64
TEST_ROWS = 20_000

dataset = dataset_fixture(EIGHT_TABLES, 5, {"train": 40_960, "test": TEST_ROWS}, seed=4)


@pytest.fixture(scope="module")
def trained(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoint directory of a one-epoch run (40 steps) of the `ADAM_FLAGS` model at
    width `DIM`."""
    out = tmp_path_factory.mktemp("run") / "checkpoints"
    main_py(
        1,
        f"--dataset_path={dataset}",
        *ADAM_FLAGS,
        f"--embedding_dim={DIM}",
        f"--bottom_mlp_dims=32,{DIM}",
        "--evals_per_epoch=0",
        f"--save_checkpoint_path={out}",
        check=True,
    )
    return out


def test_int8_export_scores_like_float32_in_a_quarter_of_the_bytes(
    dataset: Path, trained: Path, tmp_path: Path
) -> None:
    float32 = export_checkpoint(trained, tmp_path / "float32")
    int8 = export_checkpoint(trained, tmp_path / "int8", "--quantize=int8")
    rows = sum(EIGHT_TABLES)
    assert float32["quantize"] == "none" and int8["quantize"] == "int8"
    assert int8["tables"] == len(EIGHT_TABLES)
    assert float32["table_bytes"] == int8["float32_table_bytes"] == 4 * rows * DIM
    assert int8["table_bytes"] == rows * (DIM + SCALE_OFFSET_BYTES)
    assert f"int8 tables: {len(EIGHT_TABLES)} tables, " in int8["console"]

    work = tmp_path / "client"  # no project here: the client's own directory
    work.mkdir()
    labels = write_test_split_inputs(dataset, TEST_ROWS, work / "inputs.npz")
    served: list[dict[str, Any]] = serve_without_the_project(
        [tmp_path / "float32", tmp_path / "int8"], work / "inputs.npz", work
    )
    float32_served, int8_served = served

    float32_auc = roc_auc(labels, float32_served["probability"])
    int8_auc = roc_auc(labels, int8_served["probability"])
    assert float32_auc > 0.6  # a trained model: the comparison means something
    assert abs(int8_auc - float32_auc) <= 0.003, (float32_auc, int8_auc)

    expected_ratio = (DIM + SCALE_OFFSET_BYTES) / (4 * DIM)  # 0.28125 at D = 64
    ratio = int8_served["table_bytes"] / float32_served["table_bytes"]
    assert 0.25 < ratio < 0.30 and ratio == pytest.approx(expected_ratio, rel=1e-9)
    assert int8_served["table_bytes"] == int8["table_bytes"]  # what the export reported
    assert int8_served["dense_bytes"] == float32_served["dense_bytes"]
    # On disk too: the variables/ directories, less the dense weights both hold.
    on_disk = [s["variables_bytes"] - s["dense_bytes"] for s in served]
    assert on_disk[1] / on_disk[0] == pytest.approx(expected_ratio, rel=0.02)


def test_quantize_is_refused_outside_export(dataset: Path, tmp_path: Path) -> None:
    result = main_py(1, f"--dataset_path={dataset}", "--quantize=int8", timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--quantize int8: only with --mode export" in result.stderr
