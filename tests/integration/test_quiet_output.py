"""What a user sees at default verbosity: only lines they can act on.

`dlrm-train` on a dataset with a variable-length (`hotness: variable`) table,
alone and under `horovodrun`, with TensorFlow's logging left at the product's
own default (no TF_CPP_MIN_LOG_LEVEL in the environment): none of the known
noise (harness/quiet.py). `--verbosity 0` brings TensorFlow's lines
back, and still no AutoGraph warning: the step functions convert. A message
that every rank has alike is printed once per job, and horovodrun adds one line,
not a traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dlrm.app.records import read_records
from harness import processes
from harness.datasets import dataset_fixture
from harness.processes import USER_ENV, on_ranks
from harness.quiet import noise_in

SMALL = ["--embedding_dim=8", "--bottom_mlp_dims=16,8", "--top_mlp_dims=16,1", "--batch_size=512"]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`args` in a user's environment, the venv's commands first on PATH."""
    return processes.run(args, timeout=600, env=USER_ENV, cwd=cwd)


# Table 1 holds a variable number of ids per row (hotness 0).
dataset = dataset_fixture(
    (50, 23, 300), 4, {"train": 3000, "test": 1000}, seed=3, hotness=[1, 0, 2]
)


def test_training_prints_no_noise_at_default_verbosity(dataset: Path, tmp_path: Path) -> None:
    assert "variable" in (dataset / "feature_spec.yaml").read_text()
    result = run(
        ["dlrm-train", f"--dataset_path={dataset}", "--save_checkpoint_path=run", *SMALL],
        tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert noise_in(output) == [], output[-3000:]
    assert "summary: mode train" in result.stdout
    assert read_records(tmp_path / "run" / "metrics.jsonl")[-1]["event"] == "summary"


def test_verbosity_brings_tensorflows_lines_back_and_autograph_converts(
    dataset: Path, tmp_path: Path
) -> None:
    result = run(["dlrm-train", f"--dataset_path={dataset}", "--verbosity=0", *SMALL], tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    kinds = {found.split(":")[0] for found in noise_in(output)}
    assert "a glog/absl-formatted log line" in kinds or "absl's pre-init notice" in kinds, output
    # The step functions convert: AutoGraph has nothing to warn about, even when asked.
    assert "an AutoGraph conversion warning" not in kinds, output[-3000:]


def test_ranks_train_quietly_and_report_a_shared_error_once(dataset: Path, tmp_path: Path) -> None:
    trained = run(on_ranks(2, ["dlrm-train", f"--dataset_path={dataset}", *SMALL]), tmp_path)
    output = trained.stdout + trained.stderr
    assert trained.returncode == 0, output[-3000:]
    assert noise_in(output) == [], output[-3000:]
    assert "world_size 2" in trained.stdout
    # 1,000 rows do not divide by 3 ranks: every rank finds it, one says it.
    failed = run(
        on_ranks(3, ["dlrm-train", f"--dataset_path={dataset}", *SMALL[:-1], "--batch_size=1000"]),
        tmp_path,
    )
    output = failed.stdout + failed.stderr
    assert failed.returncode != 0
    assert output.count("the global batch must divide by the number of ranks (3)") == 1, output
    # horovodrun reports the failed rank in one line, without its own traceback.
    assert "Traceback" not in output, output
    assert "horovodrun: Horovod detected that one or more processes exited" in output
