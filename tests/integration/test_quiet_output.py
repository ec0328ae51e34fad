"""What a user sees at default verbosity: only lines they can act on.

`dlrm-train` on a dataset with a variable-length (`hotness: variable`) table,
alone and under `horovodrun`, with TensorFlow's logging left at the product's
own default (no TF_CPP_MIN_LOG_LEVEL in the environment): none of the known
noise (tests/integration/quiet.py). `--verbosity 0` brings TensorFlow's lines
back, and still no AutoGraph warning: the step functions convert. A message
that every rank has alike is printed once per job, and horovodrun adds one line,
not a traceback."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dataloading.synthetic import generate_split_binary
from tests.harness.processes import REPO, horovodrun
from tests.integration.quiet import noise_in

SMALL = ["--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--batch_size=512"]


def user_env() -> dict[str, str]:
    """A user's environment: the venv's commands on PATH, nothing set for logging."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "PYTHONPATH")}
    env["PATH"] = f"{REPO / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=600, check=False
    )


@pytest.fixture(scope="module")
def variable_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quiet") / "data"
    generate_split_binary(
        path,
        cardinalities=[50, 23, 300],
        num_numerical=4,
        rows={"train": 3000, "test": 1000},
        hotness=[1, 0, 2],  # 0: hotness variable
        seed=3,
    )
    assert "variable" in (path / "feature_spec.yaml").read_text()
    return path


def test_training_prints_no_noise_at_default_verbosity(
    variable_dataset: Path, tmp_path: Path
) -> None:
    result = run(
        ["dlrm-train", f"--dataset_path={variable_dataset}", "--save_checkpoint_path=run", *SMALL],
        tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert noise_in(output) == [], output[-3000:]
    assert "summary: mode train" in result.stdout
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(records[-1])["event"] == "summary"


def test_verbosity_brings_tensorflows_lines_back_and_autograph_converts(
    variable_dataset: Path, tmp_path: Path
) -> None:
    result = run(
        ["dlrm-train", f"--dataset_path={variable_dataset}", "--verbosity=0", *SMALL], tmp_path
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    kinds = {found.split(":")[0] for found in noise_in(output)}
    assert "a glog/absl-formatted log line" in kinds or "absl's pre-init notice" in kinds, output
    # The step functions convert: AutoGraph has nothing to warn about, even when asked.
    assert "an AutoGraph conversion warning" not in kinds, output[-3000:]


def test_ranks_train_quietly_and_report_a_shared_error_once(
    variable_dataset: Path, tmp_path: Path
) -> None:
    launch = [horovodrun(), "--gloo", "-np", "2", "-H", "localhost:2", "dlrm-train"]
    trained = run([*launch, f"--dataset_path={variable_dataset}", *SMALL], tmp_path)
    output = trained.stdout + trained.stderr
    assert trained.returncode == 0, output[-3000:]
    assert noise_in(output) == [], output[-3000:]
    assert "world_size 2" in trained.stdout
    # 1,000 rows do not divide by 3 ranks: every rank finds it, one says it.
    failed = run(
        [
            horovodrun(),
            "--gloo",
            "-np",
            "3",
            "-H",
            "localhost:3",
            "dlrm-train",
            f"--dataset_path={variable_dataset}",
            *SMALL[:-1],
            "--batch_size=1000",
        ],
        tmp_path,
    )
    output = failed.stdout + failed.stderr
    assert failed.returncode != 0
    assert output.count("the global batch must divide by the number of ranks (3)") == 1, output
    # horovodrun reports the failed rank in one line, without its own traceback.
    assert "Traceback" not in output, output
    assert "horovodrun: Horovod detected that one or more processes exited" in output
