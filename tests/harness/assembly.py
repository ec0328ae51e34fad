"""A run assembled in the test's own process, as `dlrm-train` assembles it
(`dlrm.app.assembly.assemble_run`), from a small model's `RunConfig` with the
test's overrides."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, TextIO

from dlrm.app.assembly import AssembledRun, assemble_run
from dlrm.app.config import RunConfig
from dlrm.app.reporting import MetricsLog
from dlrm.distributed.collectives import Collectives

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
