"""A model exported by `main.py --mode export` and served from its SavedModel in a
fresh process (harness/scripts/serve_saved_model.py), against the model of
the checkpoint it was exported from; SavedModels served where the project cannot be
imported (`serve_without_the_project`), for the quantized export's tests and the
serving benchmark."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

from dataloading.split_binary import ShardSpec, SplitBinaryDataset, categorical_tensors
from dlrm.app.records import last_record
from dlrm.checkpoint.model_state import restore_model_weights
from dlrm.checkpoint.reader import Checkpoint
from dlrm.model.config import ModelConfig
from dlrm.model.dlrm import Dlrm
from dlrm.model.export import serving_inputs
from feature_spec import FeatureSpec
from harness.processes import REPO, main_py, run


def assert_export_serves_like_the_checkpoint(
    checkpoints: Path, dataset: Path, tmp_path: Path, rows: int
) -> np.ndarray:
    """Exports the newest checkpoint in `checkpoints` with `main.py --mode
    export`, serves the first `rows` test rows from the SavedModel in a fresh
    process and checks the probabilities against the checkpoint's model;
    returns them."""
    saved_model = tmp_path / "saved_model"
    main_py(
        1,
        "--mode=export",
        f"--restore_checkpoint_path={checkpoints}",
        f"--saved_model_output_path={saved_model}",
        check=True,
    )
    checkpoint = Checkpoint(checkpoints)
    spec = FeatureSpec.load(dataset / "feature_spec.yaml")
    batch = SplitBinaryDataset(spec, "test", ShardSpec(rows)).read_batch(0)
    numerical = batch.numerical
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, numerical=numerical, **serving_inputs(batch.categorical, spec.cardinalities))
    served_path = tmp_path / "served.npy"
    script = "harness/scripts/serve_saved_model.py"
    run(
        [sys.executable, script, str(saved_model), str(inputs), str(served_path)],
        timeout=120,
        check=True,
    )
    model = Dlrm(ModelConfig.from_dict(checkpoint.manifest["model"]))
    restore_model_weights(model, checkpoint)
    expected = 1 / (1 + np.exp(-model(numerical, categorical_tensors(batch.categorical)).numpy()))
    served = np.load(served_path)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    return served


def export_checkpoint(
    checkpoints: Path, output: Path, *flags: str, timeout: float = 300
) -> dict[str, Any]:
    """`main.py --mode export` of `checkpoints` to `output` with `flags` (e.g.
    `--quantize=int8`); returns its summary record (from a metrics log beside
    `output`) and its console output (`console`)."""
    log = output.with_name(output.name + ".metrics.jsonl")
    result = main_py(
        1,
        "--mode=export",
        f"--restore_checkpoint_path={checkpoints}",
        f"--saved_model_output_path={output}",
        f"--log_path={log}",
        *flags,
        timeout=timeout,
        check=True,
    )
    return {**last_record(log, "summary"), "console": result.stdout}


def write_test_split_inputs(dataset: Path, rows: int, path: Path) -> np.ndarray:
    """The first `rows` test rows of `dataset` as the serving signature's inputs, in
    `path` (.npz); returns their labels [rows]."""
    spec = FeatureSpec.load(dataset / "feature_spec.yaml")
    batch = SplitBinaryDataset(spec, "test", ShardSpec(rows)).read_batch(0)
    inputs = serving_inputs(batch.categorical, spec.cardinalities)
    np.savez(path, numerical=np.asarray(batch.numerical), **inputs)
    return np.asarray(batch.label).reshape(-1)


SERVE_WITHOUT_THE_PROJECT = REPO / "harness" / "scripts" / "serve_without_the_project.py"


def serve_without_the_project(
    models: list[Path], inputs: Path, work: Path, timeout: float = 600
) -> list[dict[str, Any]]:
    """Serves each of `models` on `inputs` (.npz) in one fresh process that cannot
    import this project (harness/scripts/serve_without_the_project.py:
    `python -I -S`, run from `work`, no PYTHONPATH); per model, `probability` [n]
    and its `table_bytes`, `dense_bytes` and `variables_bytes`."""
    output = work / "served.npz"
    site_packages = sysconfig.get_paths()["purelib"]
    command = [sys.executable, "-I", "-S", str(SERVE_WITHOUT_THE_PROJECT), site_packages]
    run(
        [*command, str(inputs), str(output), *map(str, models)],
        timeout=timeout,
        env={"PYTHONPATH": None},
        cwd=work,
        check=True,
    )
    served = np.load(output)
    return [
        {
            "probability": served[f"probability_{index}"].reshape(-1),
            **{
                key: int(served[f"{key}_{index}"])
                for key in ("table_bytes", "dense_bytes", "variables_bytes")
            },
        }
        for index in range(len(models))
    ]
