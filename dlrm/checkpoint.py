"""Checkpoints: a directory per saved step, written atomically, verified on read.

Layout of `<root>/step_<step:09d>/`:

- `manifest.json`: format version, step, the run config, model config,
  optimizer, the embedding tables and their shards, and the sha256 and size of
  every other file. It is written last.
- `dense.npz`: dense weights, their optimizer slots and the trainer's counters,
  by name (no pickle).
- `embeddings/table_<t>.rows_<r0>_<r1>.cols_<c0>_<c1>.npy`: one file per table
  shard, and one per optimizer slot of it (`....<slot>.npy`). One process
  writes one shard per table (the whole table); sharded runs write several, and
  `read_table_slice` assembles any [rows, columns] slice from whatever shards a
  checkpoint has (memory-mapped), which is what restoring on another number of
  ranks needs.

A checkpoint is built in `<root>/.step_<step>.partial` and renamed into place,
so a crash never leaves a directory that looks whole; older checkpoints beyond
`keep` are deleted only after the new one is in place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DENSE_FILE = "dense.npz"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the model."""


@dataclasses.dataclass(frozen=True)
class TableShard:
    """Rows [r0, r1) x columns [c0, c1) of one table, stored in `file`, with its
    optimizer slots in `slot_files` (slot name -> file)."""

    rows: tuple[int, int]
    columns: tuple[int, int]
    file: str
    slot_files: Mapping[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": list(self.rows),
            "columns": list(self.columns),
            "file": self.file,
            "slots": dict(self.slot_files),
        }


def shard_file_name(table: int, rows: tuple[int, int], columns: tuple[int, int]) -> str:
    return f"embeddings/table_{table}.rows_{rows[0]}_{rows[1]}.cols_{columns[0]}_{columns[1]}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def step_directory_name(step: int) -> str:
    return f"step_{step:09d}"


class CheckpointWriter:
    """Builds one checkpoint in a staging directory; `commit` publishes it.

    Usage: `add_dense(...)`, `add_table_shard(...)` for each shard, then
    `commit(manifest_fields)`. Nothing is visible under `root` before `commit`.
    """

    def __init__(self, root: str | os.PathLike[str], step: int, create: bool = True) -> None:
        """`create`: start a fresh staging directory (rank 0, or the only
        process); other ranks open the one rank 0 created."""
        self.root = Path(root)
        self.step = step
        self.final = self.root / step_directory_name(step)
        self.staging = self.root / f".{step_directory_name(step)}.partial"
        if create:
            shutil.rmtree(self.staging, ignore_errors=True)
            (self.staging / "embeddings").mkdir(parents=True)
        self._files: list[str] = []
        self._tables: dict[int, dict[str, Any]] = {}

    def contents(self) -> dict[str, Any]:
        """What this writer added: files with their checksums, and table shards
        (gathered from every rank by rank 0 before `commit`)."""
        return {
            "files": {
                name: {
                    "sha256": _sha256(self.staging / name),
                    "bytes": (self.staging / name).stat().st_size,
                }
                for name in self._files
            },
            "tables": self._tables,
        }

    def _written(self, relative: str) -> None:
        _fsync(self.staging / relative)
        self._files.append(relative)

    def add_dense(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Dense weights, their slots and counters, by name."""
        path = self.staging / DENSE_FILE
        with path.open("wb") as handle:
            named: dict[str, Any] = {name: np.asarray(value) for name, value in arrays.items()}
            np.savez(handle, **named)
        self._written(DENSE_FILE)

    def add_table_shard(
        self,
        table: int,
        shape: tuple[int, int],
        rows: tuple[int, int],
        columns: tuple[int, int],
        values: np.ndarray,
        slots: Mapping[str, np.ndarray],
    ) -> None:
        """One shard of table `table` (whole shape `shape`) and its optimizer slots."""
        expected = (rows[1] - rows[0], columns[1] - columns[0])
        for name, array in [("values", values), *slots.items()]:
            if tuple(array.shape) != expected:
                raise CheckpointError(
                    f"table {table} shard rows {rows} columns {columns}: {name} has shape "
                    f"{tuple(array.shape)}, expected {expected}"
                )
        base = shard_file_name(table, rows, columns)
        np.save(self.staging / f"{base}.npy", np.ascontiguousarray(values, np.float32))
        self._written(f"{base}.npy")
        slot_files = {}
        for slot, array in slots.items():
            relative = f"{base}.{slot}.npy"
            np.save(self.staging / relative, np.ascontiguousarray(array, np.float32))
            self._written(relative)
            slot_files[slot] = relative
        entry = self._tables.setdefault(table, {"index": table, "shape": list(shape), "shards": []})
        entry["shards"].append(TableShard(rows, columns, f"{base}.npy", slot_files).to_dict())

    def commit(
        self,
        fields: Mapping[str, Any],
        keep: int = 0,
        gathered: Sequence[Mapping[str, Any]] | None = None,
    ) -> Path:
        """Writes the manifest (with checksums), publishes, prunes old checkpoints.

        Args:
            fields: JSON-serialisable manifest entries (config, model, optimizer, ...).
            keep: keep this many newest checkpoints under `root` (0: keep all).
            gathered: every rank's `contents()` when several ranks wrote into
                the staging directory; this writer's own by default.
        """
        files: dict[str, Any] = {}
        tables: dict[int, dict[str, Any]] = {}
        for part in gathered if gathered is not None else [self.contents()]:
            files.update(part["files"])
            for table, entry in part["tables"].items():
                merged = tables.setdefault(int(table), {**entry, "shards": []})
                merged["shards"].extend(entry["shards"])
        for entry in tables.values():
            entry["shards"].sort(key=lambda shard: (shard["rows"], shard["columns"]))
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            **fields,
            "tables": [tables[t] for t in sorted(tables)],
            "files": {name: files[name] for name in sorted(files)},
        }
        manifest_path = self.staging / MANIFEST
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        _fsync(manifest_path)
        if self.final.exists():
            retired = self.root / f".{self.final.name}.retired"
            shutil.rmtree(retired, ignore_errors=True)
            os.replace(self.final, retired)
            os.replace(self.staging, self.final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(self.staging, self.final)
        if keep > 0:
            for old in list_checkpoints(self.root)[:-keep]:
                if old != self.final:
                    shutil.rmtree(old, ignore_errors=True)
        return self.final


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Published checkpoint directories under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """`path` itself if it holds a manifest, else its newest `step_*` checkpoint."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    raise CheckpointError(
        f"{path}: not a checkpoint; expected a directory with {MANIFEST} "
        f"or a directory of step_* checkpoints"
    )


class Checkpoint:
    """A verified checkpoint, opened for reading."""

    def __init__(self, path: str | os.PathLike[str], verify: bool = True) -> None:
        self.path = resolve_checkpoint(path)
        manifest_path = self.path / MANIFEST
        try:
            self.manifest: dict[str, Any] = json.loads(manifest_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(
                f"{manifest_path}: unreadable manifest ({error}){self._previous_hint()}"
            ) from error
        for key in ("format_version", "step", "files", "tables"):
            if key not in self.manifest:
                raise CheckpointError(
                    f"{manifest_path}: manifest has no {key!r}; expected a manifest written "
                    f"by this tool (format version {FORMAT_VERSION}){self._previous_hint()}"
                )
        version = self.manifest["format_version"]
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{manifest_path}: format_version {version}, this tool reads {FORMAT_VERSION}"
            )
        if verify:
            self.verify()
        self._dense: dict[str, np.ndarray] | None = None

    def _previous_hint(self) -> str:
        others = [p for p in list_checkpoints(self.path.parent) if p != self.path]
        older = [p for p in others if p.name < self.path.name]
        if not older:
            return ""
        return (
            f". The previous checkpoint {older[-1]} is separate; pass "
            f"--restore_checkpoint_path {older[-1]} to restore it instead"
        )

    def verify(self) -> None:
        """Checks that every listed file exists with its size and sha256."""
        for name, expected in self.manifest["files"].items():
            path = self.path / name
            if not path.is_file():
                raise CheckpointError(
                    f"{path}: file listed in the manifest is missing{self._previous_hint()}"
                )
            size = path.stat().st_size
            if size != expected["bytes"]:
                raise CheckpointError(
                    f"{path}: truncated or corrupted: {size} bytes, the manifest says "
                    f"{expected['bytes']}{self._previous_hint()}"
                )
            digest = _sha256(path)
            if digest != expected["sha256"]:
                raise CheckpointError(
                    f"{path}: corrupted: sha256 {digest}, the manifest says "
                    f"{expected['sha256']}{self._previous_hint()}"
                )

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    # ------------------------------------------------------------------ dense

    def dense(self) -> dict[str, np.ndarray]:
        if self._dense is None:
            path = self.path / DENSE_FILE
            try:
                with np.load(path, allow_pickle=False) as data:
                    self._dense = {name: data[name] for name in data.files}
            except (OSError, ValueError) as error:
                raise CheckpointError(f"{path}: unreadable ({error})") from error
        return self._dense

    def dense_array(self, name: str, shape: Iterable[int] | None = None) -> np.ndarray:
        dense = self.dense()
        if name not in dense:
            raise CheckpointError(
                f"{self.path / DENSE_FILE}: no array {name!r}; the checkpoint was written for "
                f"another model or optimizer (has {len(dense)} arrays)"
            )
        array = dense[name]
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.path / DENSE_FILE}: {name!r} has shape {tuple(array.shape)}, "
                f"the model expects {tuple(shape)}"
            )
        return array

    # ------------------------------------------------------------- embeddings

    def _table(self, table: int) -> dict[str, Any]:
        for entry in self.manifest["tables"]:
            if entry["index"] == table:
                return dict(entry)
        raise CheckpointError(f"{self.path / MANIFEST}: no embedding table {table}")

    def table_shape(self, table: int) -> tuple[int, int]:
        rows, dim = self._table(table)["shape"]
        return int(rows), int(dim)

    def read_table_slice(
        self,
        table: int,
        rows: tuple[int, int],
        columns: tuple[int, int],
        slot: str | None = None,
    ) -> np.ndarray:
        """Rows [r0, r1) x columns [c0, c1) of a table (or of its optimizer `slot`),
        assembled from the shards that overlap it."""
        entry = self._table(table)
        out = np.empty((rows[1] - rows[0], columns[1] - columns[0]), np.float32)
        covered = np.zeros(out.shape, bool)
        for shard in entry["shards"]:
            (sr0, sr1), (sc0, sc1) = shard["rows"], shard["columns"]
            r0, r1 = max(rows[0], sr0), min(rows[1], sr1)
            c0, c1 = max(columns[0], sc0), min(columns[1], sc1)
            if r0 >= r1 or c0 >= c1:
                continue
            relative = shard["file"] if slot is None else shard["slots"].get(slot)
            if relative is None:
                raise CheckpointError(
                    f"{self.path}: table {table} has no optimizer slot {slot!r}; the "
                    f"checkpoint was written with another optimizer"
                )
            path = self.path / relative
            try:
                data = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as error:
                raise CheckpointError(f"{path}: unreadable ({error})") from error
            if data.shape != (sr1 - sr0, sc1 - sc0):
                raise CheckpointError(
                    f"{path}: shape {data.shape}, the manifest says {(sr1 - sr0, sc1 - sc0)}"
                )
            target = (slice(r0 - rows[0], r1 - rows[0]), slice(c0 - columns[0], c1 - columns[0]))
            out[target] = data[r0 - sr0 : r1 - sr0, c0 - sc0 : c1 - sc0]
            covered[target] = True
        if not covered.all():
            raise CheckpointError(
                f"{self.path / MANIFEST}: the shards of table {table} do not cover rows "
                f"{list(rows)} x columns {list(columns)}"
            )
        return out
