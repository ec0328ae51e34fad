"""Checkpoints: a directory per saved step, written atomically, verified on read.

Layout of `<root>/step_<step:09d>/`:

- `manifest.json`: format version, step, the run config, model config,
  optimizer, the sharding plan, the embedding tables and their shards, and the
  sha256 and size of every other file. It is written last.
- `dense.npz`: dense weights, their optimizer slots and the trainer's counters,
  by name (no pickle).
- `embeddings/<TableShard.name>.npy` (`table_<t>.rows_<r0>_<r1>.cols_<c0>_<c1>.npy`):
  one file per table shard, and one per optimizer slot of it (`....<slot>.npy`).

The manifest lists each shard once, as a `StoredShard` (its `TableShard` with the
files) under its `StoredTable`; the plan it stores leaves the shards out
(`ShardingPlan.to_dict(with_shards=False)`, and `Checkpoint.plan` puts them
back). One process writes one shard per table (the whole table); sharded runs
write several, and `restore_table_slice` streams any [rows, columns] slice from
whatever shards a checkpoint has, in row chunks of bounded size, which is what
restoring on another number of ranks needs. Writing streams too: a shard is
written (and hashed) in row chunks read from a `RowReader`, so neither direction
needs a copy of a table. The writer and the reader check a table's shards with
`dlrm.embedding.shard`'s tiling checks, as the planner does: no two overlap, and
a restored slice is covered whole.

Opening a checkpoint reads and checks the manifest only. Each data file is
checked against its size and sha256 the first time it is read (once per
`Checkpoint`), so a rank verifies the files it reads and no others;
`Checkpoint.verify` checks every file. Manifests of format 1 (whose plan lists
the shards again, and whose oldest shard entries lack `table`, `kind` and
`rank`) read as well.

A checkpoint is built in `<root>/.step_<step>.partial` and renamed into place,
so a crash never leaves a directory that looks whole; older checkpoints beyond
`keep` are deleted only after the new one is in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from dlrm.embedding.planner import PlanError, ShardingPlan
from dlrm.embedding.shard import (
    Range,
    ShardError,
    ShardingKind,
    TableShard,
    check_covers,
    check_disjoint,
    range_intersection,
)
from feature_spec.staged import publish, staging_path, start_staging

# 2: the plan leaves out the shards, which the manifest lists under `tables`.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
DENSE_FILE = "dense.npz"
# Rows restored per `assign` call, or written per read, are sized to about
# this many bytes.
DEFAULT_CHUNK_BYTES = 64 << 20
_STEP_DIR = re.compile(r"^step_(\d+)$")
_HASH_BLOCK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the model."""

    # True when the ranks agreed on it through a collective (dlrm.launch).
    same_on_every_rank = False


RowReader = Callable[[int, int], np.ndarray]
"""`read(start, stop)`: rows [start, stop) of a shard (or of one of its optimizer
slots), [stop - start, width] float32; e.g. `dlrm.embedding.base.read_rows` of a
variable, so that a shard is written without a copy of it in memory."""


def shard_file_name(shard: TableShard) -> str:
    """`embeddings/table_<t>.rows_<r0>_<r1>.cols_<c0>_<c1>`, without the `.npy`
    (slot files add `.<slot>`)."""
    return f"embeddings/{shard.name}"


@dataclasses.dataclass(frozen=True)
class StoredShard:
    """A table shard in a checkpoint: the part of the table it holds (`shard`),
    the file of its values and the file of each optimizer slot, by slot name
    (paths relative to the checkpoint)."""

    shard: TableShard
    file: str
    slots: Mapping[str, str]

    def to_dict(self) -> dict[str, Any]:
        """Its manifest entry: `TableShard.to_dict()` with `file` and `slots`."""
        return {**self.shard.to_dict(), "file": self.file, "slots": dict(self.slots)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **defaults: Any) -> StoredShard:
        """The inverse of `to_dict`; `defaults` fill the `TableShard` keys that
        format 1's oldest entries lack. Raises ShardError, KeyError, TypeError."""
        slots = data.get("slots", {})
        if not isinstance(slots, Mapping):
            raise TypeError(f"slots: expected slot name -> file, got {slots!r}")
        shard = TableShard.from_dict(data, **defaults)
        return cls(shard, str(data["file"]), {str(k): str(v) for k, v in slots.items()})


@dataclasses.dataclass(frozen=True)
class StoredTable:
    """Table `table` of `shape` [rows, columns] in a checkpoint, and the shards of
    it the checkpoint holds, in (rows, columns) order once published."""

    table: int
    shape: tuple[int, int]
    shards: tuple[StoredShard, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.table,
            "shape": list(self.shape),
            "shards": [shard.to_dict() for shard in self.shards],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], version: int) -> StoredTable:
        """The inverse of `to_dict`, for a manifest of format `version`. Raises
        ShardError, KeyError, TypeError or ValueError if `data` is not one."""
        table = int(data["index"])
        rows, columns = (int(n) for n in data["shape"])
        shards = []
        for entry in data["shards"]:
            if version > 1:
                shards.append(StoredShard.from_dict(entry))
                continue
            # Format 1's oldest entries lack table, kind and rank, which reading
            # does not need: the table's, the kind its place implies, rank 0.
            defaults = {"table": table, "kind": ShardingKind.TABLE_WISE, "rank": 0}
            stored = StoredShard.from_dict(entry, **defaults)
            if "kind" not in entry:
                kind = _kind_of(stored.shard, (rows, columns))
                stored = dataclasses.replace(
                    stored, shard=dataclasses.replace(stored.shard, kind=kind)
                )
            shards.append(stored)
        return cls(table, (rows, columns), tuple(shards))

    def in_order(self) -> StoredTable:
        """The same table with its shards in (rows, columns) order."""
        ordered = sorted(self.shards, key=lambda s: (s.shard.rows, s.shard.columns))
        return dataclasses.replace(self, shards=tuple(ordered))


def _kind_of(shard: TableShard, shape: tuple[int, int]) -> ShardingKind:
    """The kind that `shard`'s place in a table of `shape` implies."""
    full_rows, full_columns = shard.rows == (0, shape[0]), shard.columns == (0, shape[1])
    if full_rows and full_columns:
        return ShardingKind.TABLE_WISE
    return ShardingKind.COLUMN_WISE if full_rows else ShardingKind.ROW_WISE


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def _write_npy_rows(
    handle: BinaryIO,
    what: str,
    source: np.ndarray | RowReader,
    shape: tuple[int, int],
    chunk_rows: int,
) -> dict[str, Any]:
    """Writes float32 `shape` from `source` as a C-order `.npy` file (the bytes
    `np.save` writes), `chunk_rows` rows at a time; returns its sha256 and size."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header,
        {
            "descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)),
            "fortran_order": False,
            "shape": shape,
        },
    )
    digest = hashlib.sha256(header.getvalue())
    size = handle.write(header.getvalue())
    rows, width = shape
    for start in range(0, rows, chunk_rows):
        stop = min(start + chunk_rows, rows)
        if isinstance(source, np.ndarray):
            chunk = np.ascontiguousarray(source[start:stop], np.float32)
        else:
            chunk = np.ascontiguousarray(source(start, stop), np.float32)
            if chunk.shape != (stop - start, width):
                raise CheckpointError(
                    f"{what}: rows [{start}, {stop}) read as shape {chunk.shape}, expected "
                    f"{(stop - start, width)}"
                )
        data = chunk.data.cast("B")
        digest.update(data)
        size += handle.write(data)
        del chunk, data  # before the next chunk is read
    return {"sha256": digest.hexdigest(), "bytes": size}


def _placed(shards: Iterable[TableShard]) -> list[str]:
    """`['table_0.rows_0_23.cols_0_4 (column_wise, rank 0)', ...]`, sorted."""
    return sorted(f"{s.name} ({s.kind}, rank {s.rank})" for s in shards)


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
        self.staging = staging_path(self.final)
        if create:
            start_staging(self.final, overwrite=True)
            (self.staging / "embeddings").mkdir()
        self._files: dict[str, dict[str, Any]] = {}
        self._tables: dict[int, StoredTable] = {}

    def contents(self) -> dict[str, Any]:
        """What this writer added: `files` with their checksums, and `tables`
        (table -> `StoredTable` of the shards it wrote); rank 0 gathers every
        rank's before `commit`."""
        return {"files": dict(self._files), "tables": dict(self._tables)}

    def _written(self, relative: str, checksum: dict[str, Any] | None = None) -> None:
        """Syncs a finished file and records its checksum (`checksum` when its
        bytes were hashed as they were written, else read back)."""
        path = self.staging / relative
        _fsync(path)
        if checksum is None:
            checksum = {"sha256": _sha256(path), "bytes": path.stat().st_size}
        self._files[relative] = checksum

    def add_dense(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Dense weights, their slots and counters, by name."""
        path = self.staging / DENSE_FILE
        with path.open("wb") as handle:
            named: dict[str, Any] = {name: np.asarray(value) for name, value in arrays.items()}
            np.savez(handle, **named)
        self._written(DENSE_FILE)

    def add_table_shard(
        self,
        shard: TableShard,
        table_shape: tuple[int, int],
        values: np.ndarray | RowReader,
        slots: Mapping[str, np.ndarray | RowReader],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        """One shard of table `shard.table` (whole shape `table_shape`) and its
        optimizer slots, each [shard.height, shard.width], stored as float32.

        Each of `values` and `slots` is an array (a memory map too) or a
        `RowReader`; either is written, and hashed, in row chunks of about
        `chunk_bytes`, one file after the other, so that writing holds one chunk
        besides what the caller holds. The files are `np.save`'s, byte for byte.
        """
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        table_shape = (int(table_shape[0]), int(table_shape[1]))
        if not shard.fits(table_shape):
            raise CheckpointError(
                f"{shard.name}: {shard.describe()} lie outside table {shard.table} of shape "
                f"{list(table_shape)}"
            )
        expected = (shard.height, shard.width)
        for name, array in [("values", values), *slots.items()]:
            if isinstance(array, np.ndarray) and tuple(array.shape) != expected:
                raise CheckpointError(
                    f"{shard.name}: {name} has shape {tuple(array.shape)}, expected {expected}"
                )
        entry = self._tables.get(shard.table, StoredTable(shard.table, table_shape, ()))
        if entry.shape != table_shape:
            raise CheckpointError(
                f"{shard.name}: table shape {list(table_shape)}, an earlier shard of table "
                f"{shard.table} said {list(entry.shape)}"
            )
        base = shard_file_name(shard)
        chunk_rows = max(1, chunk_bytes // (4 * max(shard.width, 1)))
        files = {"values": f"{base}.npy", **{slot: f"{base}.{slot}.npy" for slot in slots}}
        for name, source in [("values", values), *slots.items()]:
            relative = files[name]
            with (self.staging / relative).open("wb") as handle:
                checksum = _write_npy_rows(
                    handle, f"{shard.name} {name}", source, expected, chunk_rows
                )
            self._written(relative, checksum)
        stored = StoredShard(shard, files["values"], {slot: files[slot] for slot in slots})
        self._tables[shard.table] = dataclasses.replace(entry, shards=(*entry.shards, stored))

    def _plan_without_shards(
        self, data: Mapping[str, Any], tables: Sequence[StoredTable]
    ) -> dict[str, Any]:
        """The plan `data` as the manifest stores it, without its shards, after
        checking that the shards written are the plan's: every shard of a
        model-parallel table, rank 0's copy of a data-parallel one."""
        try:
            plan = ShardingPlan.from_dict(data)
        except PlanError as error:
            raise CheckpointError(f"{self.staging}: the manifest's plan: {error}") from error
        written = {t.table: {stored.shard for stored in t.shards} for t in tables}
        for table in sorted({t.table for t in plan.tables} | set(written)):
            planned = plan.tables[table].shards if table < len(plan.tables) else ()
            expected = {s for s in planned if s.kind.is_model_parallel or s.rank == 0}
            if written.get(table, set()) != expected:
                raise CheckpointError(
                    f"{self.staging}: table {table}: the plan needs shards "
                    f"{_placed(expected)} written, the ranks wrote "
                    f"{_placed(written.get(table, set()))}"
                )
        return plan.to_dict(with_shards=False)

    def commit(
        self,
        fields: Mapping[str, Any],
        keep: int = 0,
        gathered: Sequence[Mapping[str, Any]] | None = None,
    ) -> Path:
        """Writes the manifest (with checksums), publishes, prunes old checkpoints.

        Args:
            fields: JSON-serialisable manifest entries (config, model, optimizer, ...).
                A `plan` (`ShardingPlan.to_dict()`, or None) is stored without its
                shards, which must be those written: the manifest lists them once.
            keep: keep this many newest checkpoints under `root` (0: keep all).
            gathered: every rank's `contents()` when several ranks wrote into
                the staging directory; this writer's own by default.

        Raises:
            CheckpointError: ranks wrote a table with different shapes, shards
                overlap, or the shards written are not the plan's; nothing is
                published then.
        """
        files: dict[str, Any] = {}
        tables: dict[int, StoredTable] = {}
        for part in gathered if gathered is not None else [self.contents()]:
            files.update(part["files"])
            for table, entry in part["tables"].items():
                merged = tables.setdefault(table, dataclasses.replace(entry, shards=()))
                if merged.shape != entry.shape:
                    raise CheckpointError(
                        f"{self.staging}: ranks wrote table {table} with shapes "
                        f"{list(merged.shape)} and {list(entry.shape)}"
                    )
                tables[table] = dataclasses.replace(merged, shards=merged.shards + entry.shards)
        stored = [tables[t].in_order() for t in sorted(tables)]
        for entry in stored:
            try:
                check_disjoint(entry.table, entry.shape, [s.shard for s in entry.shards])
            except ShardError as error:
                raise CheckpointError(f"{self.staging}: {error}") from error
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            **fields,
            "tables": [entry.to_dict() for entry in stored],
            "files": {name: files[name] for name in sorted(files)},
        }
        if fields.get("plan") is not None:
            manifest["plan"] = self._plan_without_shards(fields["plan"], stored)
        manifest_path = self.staging / MANIFEST
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        _fsync(manifest_path)
        publish(self.staging, self.final)
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


class _NpyLayout(NamedTuple):
    """Where the array of a `.npy` file lies: C-order `shape` of `dtype` from
    byte `offset` on."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    offset: int


class _Piece(NamedTuple):
    """The part of a requested slice that one shard file holds: `part` (table
    coordinates) of `shard`, whose values (or slot) are in `file`."""

    file: str
    shard: TableShard
    part: TableShard


def _read_exact(handle: io.FileIO, path: Path, offset: int, out: np.ndarray) -> None:
    """Fills the C-contiguous `out` with the bytes of `handle` from `offset` on."""
    view = out.data.cast("B")
    handle.seek(offset)
    done = 0
    while done < len(view):
        count = handle.readinto(view[done:])
        if not count:
            raise CheckpointError(
                f"{path}: ends at byte {offset + done}, expected {offset + len(view)} or more"
            )
        done += count


class Checkpoint:
    """A checkpoint opened for reading.

    Opening reads and checks the manifest only (format, keys, the shards of each
    table: inside the table, not overlapping, their files listed); `tables`
    holds what it lists, as `StoredTable`s. With `verify`
    (the default), each data file is checked against the manifest's size and
    sha256 the first time this object reads it, before its data is used; a
    mismatch raises `CheckpointError` naming the file. `verify()` checks every
    file at once, for tools that read everything.
    """

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
        if version not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{manifest_path}: format_version {version}, this tool reads "
                f"{' and '.join(map(str, READABLE_VERSIONS))}"
            )
        self.tables: Mapping[int, StoredTable] = self._read_tables(version)
        self._verify_reads = verify
        self._verified: set[str] = set()
        self._layouts: dict[str, _NpyLayout] = {}
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

    def _read_tables(self, version: int) -> dict[int, StoredTable]:
        """The manifest's tables, checked: well formed, each listed once, each
        table's shards inside it and not overlapping (so summed areas tell
        coverage), and every file they name listed with a checksum."""
        manifest_path = self.path / MANIFEST
        listed = self.manifest["files"]
        tables: dict[int, StoredTable] = {}
        for data in self.manifest["tables"]:
            try:
                entry = StoredTable.from_dict(data, version)
            except (AttributeError, KeyError, TypeError, ValueError) as error:
                raise CheckpointError(
                    f"{manifest_path}: malformed table entry {str(data)[:200]} ({error})"
                ) from error
            if entry.table in tables:
                raise CheckpointError(f"{manifest_path}: table {entry.table} is listed twice")
            try:
                check_disjoint(entry.table, entry.shape, [stored.shard for stored in entry.shards])
            except ShardError as error:
                raise CheckpointError(f"{manifest_path}: {error}") from error
            for stored in entry.shards:
                for name in [stored.file, *stored.slots.values()]:
                    if name not in listed:
                        raise CheckpointError(
                            f"{manifest_path}: table {entry.table} names {name}, which has no "
                            f"entry under 'files'{self._previous_hint()}"
                        )
            tables[entry.table] = entry
        return tables

    @property
    def plan(self) -> ShardingPlan | None:
        """The sharding plan of the ranks that wrote it; None when one process did."""
        data = self.manifest.get("plan")
        if data is None:
            return None
        shards = [stored.shard for table in self.tables.values() for stored in table.shards]
        try:
            return ShardingPlan.from_dict(data, shards=shards)
        except PlanError as error:
            raise CheckpointError(f"{self.path / MANIFEST}: plan: {error}") from error

    # ----------------------------------------------------------- verification

    @property
    def verified_files(self) -> frozenset[str]:
        """The files (relative to `path`) this object has checked so far."""
        return frozenset(self._verified)

    def verify(self, names: Iterable[str] | None = None) -> None:
        """Checks that every listed file (or each of `names`, relative to `path`)
        exists with the size and sha256 the manifest gives."""
        for name in self.manifest["files"] if names is None else names:
            self._verify_file(name)

    def _verify_file(self, name: str) -> None:
        path = self.path / name
        expected = self.manifest["files"].get(name)
        if expected is None:
            raise CheckpointError(
                f"{path}: not listed under 'files' in the manifest, so it cannot be "
                f"verified{self._previous_hint()}"
            )
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
        self._verified.add(name)

    def _checked(self, name: str) -> Path:
        """The path of file `name`, verified first (once) when this object verifies."""
        if self._verify_reads and name not in self._verified:
            self._verify_file(name)
        return self.path / name

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    # ------------------------------------------------------------------ dense

    def dense(self) -> dict[str, np.ndarray]:
        if self._dense is None:
            path = self._checked(DENSE_FILE)
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

    def _table(self, table: int) -> StoredTable:
        if table not in self.tables:
            raise CheckpointError(
                f"{self.path / MANIFEST}: no embedding table {table} (it has tables "
                f"{sorted(self.tables)})"
            )
        return self.tables[table]

    def table_shape(self, table: int) -> tuple[int, int]:
        return self._table(table).shape

    def _pieces(self, table: int, rows: Range, columns: Range, slot: str | None) -> list[_Piece]:
        """The shard files holding the requested slice, each with its part of it;
        raises unless they cover the slice."""
        if not (rows[0] < rows[1] and columns[0] < columns[1]):
            raise CheckpointError(
                f"{self.path}: table {table}: empty request rows {list(rows)} x columns "
                f"{list(columns)}"
            )
        pieces = []
        for stored in self._table(table).shards:
            part = stored.shard.clip(rows, columns)
            if part is None:
                continue
            file = stored.file if slot is None else stored.slots.get(slot)
            if file is None:
                raise CheckpointError(
                    f"{self.path}: table {table} has no optimizer slot {slot!r}; the "
                    f"checkpoint was written with another optimizer"
                )
            pieces.append(_Piece(file, stored.shard, part))
        try:  # the shards do not overlap (checked on opening)
            check_covers(table, rows, columns, [piece.part for piece in pieces])
        except ShardError as error:
            raise CheckpointError(f"{self.path / MANIFEST}: {error}") from error
        return pieces

    def _layout(self, piece: _Piece) -> _NpyLayout:
        """The verified `.npy` header of `piece.file`, checked against the manifest."""
        if piece.file in self._layouts:
            return self._layouts[piece.file]
        path = self._checked(piece.file)
        expected = (piece.shard.height, piece.shard.width)
        try:
            with path.open("rb") as handle:
                version = np.lib.format.read_magic(handle)
                if version == (1, 0):
                    shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(handle)
                elif version == (2, 0):
                    shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(handle)
                else:
                    raise ValueError(f"unsupported .npy format version {version}")
                offset = handle.tell()
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{path}: unreadable ({error})") from error
        if tuple(shape) != expected:
            raise CheckpointError(f"{path}: shape {tuple(shape)}, the manifest says {expected}")
        if fortran_order or dtype.kind != "f":
            raise CheckpointError(
                f"{path}: a {'Fortran-order ' if fortran_order else ''}{dtype} array, "
                f"expected C-order float32"
            )
        layout = _NpyLayout(tuple(shape), dtype, offset)
        self._layouts[piece.file] = layout
        return layout

    def restore_table_slice(
        self,
        table: int,
        rows: Range,
        columns: Range,
        assign: Callable[[int, np.ndarray], object],
        slot: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        """Streams rows [r0, r1) x columns [c0, c1) of a table (or of its optimizer
        `slot`) to `assign` in consecutive row chunks.

        Calls `assign(row_offset, chunk)` with `chunk` float32 [n, c1 - c0] holding
        rows [r0 + row_offset, r0 + row_offset + n), assembled from the shards
        that overlap it, for row_offset = 0, n, 2n, ... (the last chunk may be
        shorter); e.g. `lambda offset, chunk: variable[offset:offset +
        len(chunk)].assign(chunk)`. Each chunk is a new array, which `assign` may
        keep. Chunks have as many rows as fit in `chunk_bytes` at the width of the
        request or of its widest shard, whichever is wider (at least one row), and
        that bounds the read buffer too: besides the caller's own memory, a
        restore holds one chunk and one read buffer.

        Every shard file the slice needs is verified (see `Checkpoint`) and its
        header checked before `assign` is first called, and coverage too: a
        failure raises `CheckpointError` before anything is assigned.
        """
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        pieces = self._pieces(table, rows, columns, slot)
        layouts = {piece.file: self._layout(piece) for piece in pieces}
        width = _length(columns)
        widest = max([width, *(piece.shard.width for piece in pieces)])
        itemsize = max([4, *(layout.dtype.itemsize for layout in layouts.values())])
        chunk_rows = max(1, chunk_bytes // (widest * itemsize))
        with contextlib.ExitStack() as stack:
            handles = {
                file: stack.enter_context((self.path / file).open("rb", buffering=0))
                for file in layouts
            }
            for start in range(rows[0], rows[1], chunk_rows):
                stop = min(start + chunk_rows, rows[1])
                chunk = np.empty((stop - start, width), np.float32)
                for piece in pieces:
                    part = range_intersection(piece.part.rows, (start, stop))
                    if part is not None:
                        origin = (start, columns[0])
                        self._read_piece(
                            piece, layouts[piece.file], handles[piece.file], part, chunk, origin
                        )
                assign(start - rows[0], chunk)
                del chunk  # before the next one is allocated

    def _read_piece(
        self,
        piece: _Piece,
        layout: _NpyLayout,
        handle: io.FileIO,
        rows: Range,
        chunk: np.ndarray,
        chunk_origin: tuple[int, int],
    ) -> None:
        """Copies rows `rows` x `piece.part.columns` (table coordinates) from the
        shard file into `chunk`, whose element [0, 0] is table element `chunk_origin`."""
        shard, columns = piece.shard, piece.part.columns
        row_bytes = shard.width * layout.dtype.itemsize
        offset = layout.offset + (rows[0] - shard.rows[0]) * row_bytes
        target_rows = slice(rows[0] - chunk_origin[0], rows[1] - chunk_origin[0])
        path = self.path / piece.file
        chunk_columns = (chunk_origin[1], chunk_origin[1] + chunk.shape[1])
        if shard.columns == chunk_columns and layout.dtype == chunk.dtype:
            # The shard's rows are whole rows of the chunk: read them in place.
            _read_exact(handle, path, offset, chunk[target_rows])
            return
        buffer = np.empty((_length(rows), shard.width), layout.dtype)
        _read_exact(handle, path, offset, buffer)
        source_columns = slice(columns[0] - shard.columns[0], columns[1] - shard.columns[0])
        target_columns = slice(columns[0] - chunk_origin[1], columns[1] - chunk_origin[1])
        chunk[target_rows, target_columns] = buffer[:, source_columns]

    def read_table_slice(
        self,
        table: int,
        rows: Range,
        columns: Range,
        slot: str | None = None,
    ) -> np.ndarray:
        """Rows [r0, r1) x columns [c0, c1) of a table (or of its optimizer `slot`),
        float32 [r1 - r0, c1 - c0], assembled from the shards that overlap it.
        Holds the whole slice in memory; `restore_table_slice` streams it."""
        out = np.empty((_length(rows), _length(columns)), np.float32)

        def assign(offset: int, chunk: np.ndarray) -> None:
            out[offset : offset + len(chunk)] = chunk

        self.restore_table_slice(table, rows, columns, assign, slot)
        return out


def _length(span: Range) -> int:
    return span[1] - span[0]
