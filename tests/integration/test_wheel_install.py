"""The product as a user outside the checkout has it: the project's wheel installed
into a new virtual environment, beside the pinned packages and the Horovod wheel
that `make install` built (all from the wheelhouse of `packaging/wheelhouse.sh`,
with no package index), then every command run from a directory outside the
checkout: generate a click log, preprocess it with Spark, train on 2 ranks under
horovodrun, evaluate, export. The CPU kernels, which the wheel carries as
sources, compile on first use into the new environment."""

from __future__ import annotations

import json
import os
import subprocess
import venv
from pathlib import Path

import pytest

from tests.integration.conftest import REPO
from tests.integration.quiet import noise_in

WHEELHOUSE = REPO / ".cache" / "wheelhouse"
MODEL = [
    "--embedding_dim=8",
    "--bottom_mlp_dims=16,8",
    "--top_mlp_dims=16,1",
    "--optimizer=adam",
    "--learning_rate=0.01",
    "--warmup_steps=0",
    "--decay_start_step=0",
    "--batch_size=1024",
]


def _run(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, f"{args}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of a new venv holding the installed wheel and its dependencies."""
    made = subprocess.run(
        ["bash", str(REPO / "packaging" / "wheelhouse.sh"), str(WHEELHOUSE)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    root = tmp_path_factory.mktemp("installed")
    venv.create(root / "venv", with_pip=True)
    python = root / "venv" / "bin" / "python"
    _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--find-links",
            str(WHEELHOUSE),
            "-r",
            str(REPO / "requirements.txt"),
            "-c",
            str(REPO / "constraints.txt"),
            "horovod",
            "dlrm-hybrid",
        ],
        cwd=root,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        timeout=1200,
    )
    return python.parent


def test_the_installed_commands_run_the_product_from_outside_the_checkout(
    installed: Path, tmp_path: Path
) -> None:
    # Nothing of the checkout's: no PYTHONPATH, a working directory outside it, and
    # TensorFlow's logging left at the product's own default.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL")}
    env["PATH"] = f"{installed}{os.pathsep}{env.get('PATH', '')}"
    work = tmp_path / "work"
    work.mkdir()
    python = str(installed / "python")
    where = _run(
        [python, "-c", "import dlrm, preproc; print(dlrm.__file__); print(preproc.__file__)"],
        work,
        env,
    )
    for module_file in where.stdout.split():
        assert Path(module_file).is_relative_to(installed.parent), module_file
        assert not Path(module_file).is_relative_to(REPO), module_file

    clicklog = ["dlrm-synthetic", "clicklog", "--output_dir=raw", "--days=2", "--rows_per_day=6000"]
    _run(clicklog, work, env)
    preprocess = _run(
        [
            "dlrm-preprocess",
            "--input_dir=raw",
            "--output_dir=data",
            "--train_days=0",
            "--test_days=1",
            "--driver_memory=1g",
        ],
        work,
        env,
    )
    assert (work / "data" / "feature_spec.yaml").is_file()
    train = _run(
        [
            "horovodrun",
            "--gloo",
            "-np",
            "2",
            "-H",
            "localhost:2",
            "dlrm-train",
            "--dataset_path=data",
            "--save_checkpoint_path=run",
            *MODEL,
        ],
        work,
        env,
    )
    # The kernels compiled on first use, into the new environment, once.
    kernels = list((installed.parent / "lib" / "dlrm-kernels").glob("dlrm_kernels-*.so"))
    assert len(kernels) == 1, kernels
    assert "the CPU kernels are not in use" not in train.stdout + train.stderr
    records = [
        json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    summary = [r for r in records if r["event"] == "summary"][-1]
    assert summary["world_size"] == 2 and summary["steps"] > 0
    restore = ["--dataset_path=data", "--restore_checkpoint_path=run", *MODEL]
    evaluate = _run(["dlrm-train", "--mode=eval", "--log_path=eval.jsonl", *restore], work, env)
    evaluated = [json.loads(x) for x in (work / "eval.jsonl").read_text().splitlines()]
    assert evaluated[-1]["event"] == "summary" and evaluated[-1]["mode"] == "eval"
    # One process scores the checkpoint the 2 ranks wrote as they did.
    assert evaluated[-1]["auc"] == pytest.approx(summary["auc"], abs=1e-6)
    _run(
        [
            "dlrm-train",
            "--mode=export",
            "--restore_checkpoint_path=run",
            "--saved_model_output_path=model",
        ],
        work,
        env,
    )
    assert (work / "model" / "saved_model.pb").is_file()
    for step in (preprocess, train, evaluate):
        assert noise_in(step.stdout + step.stderr) == []
