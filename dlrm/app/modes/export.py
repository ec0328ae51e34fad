"""`--mode export`: a SavedModel from a checkpoint, on one process, without the dataset."""

from __future__ import annotations

from typing import Any

from dlrm.app.config import RunConfig
from dlrm.app.reporting import MetricsLog
from dlrm.checkpoint.format import CheckpointError
from dlrm.checkpoint.model_state import restore_model_weights
from dlrm.checkpoint.reader import Checkpoint
from dlrm.model.config import ModelConfig
from dlrm.model.dlrm import Dlrm
from dlrm.model.export import export_saved_model


def run_export(config: RunConfig, log: MetricsLog) -> dict[str, Any]:
    """SavedModel from a checkpoint; needs no dataset (the manifest has the model)."""
    assert config.restore_checkpoint_path and config.saved_model_output_path
    checkpoint = Checkpoint(config.restore_checkpoint_path)
    model_values = checkpoint.manifest.get("model")
    if not isinstance(model_values, dict):
        raise CheckpointError(f"{checkpoint.path}: the manifest has no model config")
    model_config = ModelConfig.from_dict(model_values)
    model = Dlrm(model_config, dtype_policy="float32")
    restore_model_weights(model, checkpoint)
    exported = export_saved_model(model, config.saved_model_output_path, config.quantize)
    log.print(f"exported {checkpoint.path} (step {checkpoint.step}) to {exported.path}")
    if exported.quantize != "none":
        log.print(exported.describe())
    return {
        "mode": "export",
        "checkpoint": str(checkpoint.path),
        "saved_model": str(exported.path),
        "quantize": exported.quantize,
        "tables": exported.tables,
        "float32_table_bytes": exported.float32_table_bytes,
        "table_bytes": exported.table_bytes,
    }
