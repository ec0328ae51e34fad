"""Writing a whole output directory atomically: a staging directory beside it,
renamed into place once complete, so an interrupted run leaves nothing that
looks finished and an existing output is never half-replaced."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def start_staging(output: Path, overwrite: bool) -> Path:
    """A fresh, empty staging directory for `output`.

    Raises:
        FileExistsError: `output` exists, is not empty and `overwrite` is false.
    """
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{output}: output directory exists and is not empty; expected a new or empty "
            f"directory (pass overwrite=True / --overwrite to replace it)"
        )
    staging = output.with_name(f".{output.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, output: Path) -> None:
    """Replaces `output` by the completed `staging` directory."""
    if output.exists():
        shutil.rmtree(output)
    os.replace(staging, output)
