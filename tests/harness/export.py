"""A model exported by `main.py --mode export` and served from its SavedModel in a
fresh process (tests/integration/scripts/serve_saved_model.py), against the model of
the checkpoint it was exported from."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from dataloading.split_binary import ShardSpec, SplitBinaryDataset, categorical_tensors
from dlrm.checkpoint.model_state import restore_model_weights
from dlrm.checkpoint.reader import Checkpoint
from dlrm.model.config import ModelConfig
from dlrm.model.dlrm import Dlrm
from dlrm.model.export import serving_inputs
from feature_spec import FeatureSpec
from tests.harness.processes import main_py, run


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
    script = "tests/integration/scripts/serve_saved_model.py"
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
