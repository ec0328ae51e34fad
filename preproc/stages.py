"""Resumable stages: each writes into a hidden staging directory and is published
by renaming it into place with a `_SUCCESS` marker inside.

The marker is JSON: the stage's fingerprint (a hash of everything its output
depends on: settings, input files, upstream fingerprints), its duration and a
summary that later stages and the report read. A rerun skips a stage whose marker
holds the same fingerprint. A stage that fails removes its staging directory
(`.<name>.partial`); one killed leaves it, with no marker, and the next run clears it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from feature_spec.staged import staged_directory, write_file_atomically
from preproc.errors import PreprocessingError

SUCCESS = "_SUCCESS"
# Bump when a change to the code changes what a stage writes: old outputs rerun.
# 2: list columns; the split summaries count the ids written per feature.
# 3: OOV buckets, carried vocabularies; the split summaries count bucket and new ids.
FORMAT_VERSION = 3


def fingerprint(settings: Mapping[str, Any]) -> str:
    """A stable hash of JSON-serialisable `settings`."""
    text = json.dumps({"format_version": FORMAT_VERSION, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def file_identity(path: Path) -> dict[str, Any]:
    """What identifies an input file's content cheaply: path, size, modification time."""
    try:
        stat = path.stat()
    except OSError as err:
        raise PreprocessingError(f"{path}: cannot read input file: {err.strerror}") from err
    return {"path": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


@dataclasses.dataclass(frozen=True)
class Marker:
    stage: str
    fingerprint: str
    seconds: float
    summary: dict[str, Any]


def read_marker(directory: Path) -> Marker | None:
    """The marker of a published stage, or None when there is none (or it is not ours)."""
    try:
        raw = json.loads((directory / SUCCESS).read_text())
        return Marker(raw["stage"], raw["fingerprint"], float(raw["seconds"]), raw["summary"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_marker(directory: Path, marker: Marker) -> None:
    text = json.dumps(dataclasses.asdict(marker), indent=1, sort_keys=True)
    write_file_atomically(directory / SUCCESS, text + "\n")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One resumable stage: its name, published directory and fingerprint."""

    name: str
    directory: Path
    fingerprint: str

    def finished(self) -> Marker | None:
        """The marker when the stage is published with this fingerprint."""
        marker = read_marker(self.directory)
        return marker if marker is not None and marker.fingerprint == self.fingerprint else None

    def remove_if_stale(self) -> bool:
        """Deletes a published output of other settings; True when it did.

        Raises:
            PreprocessingError: the directory exists but holds no stage marker, so
                it was not written by a stage and is left alone.
        """
        if not self.directory.exists():
            return False
        marker = read_marker(self.directory)
        if marker is None:
            raise PreprocessingError(
                f"{self.directory}: exists but has no {SUCCESS} marker of a preprocessing "
                f"stage; expected the output of an earlier run or nothing. Remove it, or "
                f"choose another --output_dir"
            )
        if marker.fingerprint == self.fingerprint:
            return False
        shutil.rmtree(self.directory)
        return True

    def run(self, body: Callable[[Path], dict[str, Any]]) -> Marker:
        """Runs `body(staging_dir)` and publishes the directory with its summary."""
        with staged_directory(self.directory, overwrite=True) as staging:
            start = time.monotonic()
            summary = body(staging)
            marker = Marker(self.name, self.fingerprint, time.monotonic() - start, summary)
            write_marker(staging, marker)
        return marker
