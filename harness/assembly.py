"""A run assembled in the test's own process, as `dlrm-train` assembles it
(`dlrm.app.assembly.assemble_run`), from a small model's `RunConfig` with the
test's overrides, and what tests read of it: its first batches, its weights."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from dataloading.split_binary import Batch, ShardSpec, SplitBinaryDataset
from dlrm.app.assembly import AssembledRun, assemble_run
from dlrm.app.config import RunConfig
from dlrm.app.reporting import MetricsLog
from dlrm.distributed.collectives import Collectives
from feature_spec import FeatureSpec

# Widths 6 and odd MLP widths (so that shape bugs surface), Adagrad from the first step.
SMALL_MODEL: dict[str, Any] = {
    "batch_size": 64,
    "optimizer": "adagrad",
    "learning_rate": 0.05,
    "warmup_steps": 0,
    "decay_start_step": 0,
    "embedding_dim": 6,
    "bottom_mlp_dims": (9, 6),
    "top_mlp_dims": (11, 1),
    "seed": 1,
}
BATCH: int = SMALL_MODEL["batch_size"]


def small_config(dataset: str | os.PathLike[str], **overrides: Any) -> RunConfig:
    """`SMALL_MODEL` on `dataset`, with `overrides` (RunConfig's fields)."""
    return RunConfig(**{**SMALL_MODEL, "dataset_path": str(dataset), **overrides})


def assembled_run(
    dataset: str | os.PathLike[str],
    collectives: Collectives | None = None,
    log_path: Path | None = None,
    console: TextIO | None = None,
    **overrides: Any,
) -> AssembledRun:
    """`small_config(dataset, **overrides)` assembled on `collectives` (one process
    when None), its metrics logged to `log_path` when given, what it prints to
    `console` (by default, nowhere)."""
    log = MetricsLog(log_path, None, console=console or io.StringIO())
    return assemble_run(small_config(dataset, **overrides), log, collectives)


def batches(dataset: Path, count: int) -> list[Batch]:
    """The first `count` global batches of `BATCH` rows of `dataset`'s train split."""
    spec = FeatureSpec.load(dataset / "feature_spec.yaml")
    data = SplitBinaryDataset(spec, "train", ShardSpec(BATCH))
    return list(data.to_tf_dataset().take(count))


def weights(run: AssembledRun) -> list[np.ndarray]:
    """Every dense weight, then every embedding variable, of `run`'s trainer."""
    assert run.trainer is not None
    return [
        np.asarray(v.numpy()) for v in run.trainer.dense_variables + run.trainer.embedding_variables
    ]
