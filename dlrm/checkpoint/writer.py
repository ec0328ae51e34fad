"""Writing a checkpoint: every file streamed and hashed in row blocks into a
staging directory, published by one rename with its manifest, older ones pruned."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dlrm.checkpoint.format import (
    DENSE_FILE,
    FLOAT32_TABLES_VERSION,
    FORMAT_VERSION,
    MANIFEST,
    TABLE_DTYPES,
    CheckpointError,
    RowReader,
    StoredShard,
    StoredTable,
    list_checkpoints,
    sha256_of_file,
    shard_file_name,
    step_directory_name,
)
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import PlanError
from dlrm.embedding.shard import (
    ROW_BLOCK_BYTES,
    ShardError,
    TableShard,
    check_disjoint,
)
from feature_spec.staged import publish, staging_path, start_staging


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 `values` rounded to nearest (even) bfloat16, as its uint16 bits
    (exact for values a bfloat16 table widened); NaN stays a quiet NaN."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def _stored(block: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 block as a table of `dtype` stores it on disk."""
    if dtype == "bfloat16":
        return bfloat16_bits(block)
    if dtype == "float16":
        return np.ascontiguousarray(block, np.float16)
    return block


def _write_npy_rows(
    handle: BinaryIO,
    what: str,
    source: np.ndarray | RowReader,
    rows: int,
    widths: Sequence[int],
    block_bytes: int,
    dtype: str = "float32",
) -> tuple[dict[str, Any], int]:
    """Writes float32 [rows, width] from `source` as a C-order `.npy` file (the
    bytes `np.save` writes) in row blocks of about `block_bytes`, stored as
    `dtype` (bfloat16 as its bits, uint16); returns its sha256 and size, and its
    width: one of `widths`, the array's or that of the first block a `RowReader`
    gives."""

    def read(start: int, stop: int) -> np.ndarray:
        if isinstance(source, np.ndarray):
            block = np.ascontiguousarray(source[start:stop], np.float32)
        else:
            block = np.ascontiguousarray(source(start, stop), np.float32)
        return _stored(block, dtype)

    on_disk = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}[dtype]
    block_rows = max(1, block_bytes // (4 * max(max(widths), 1)))
    first = read(0, min(block_rows, rows))
    width = first.shape[1] if first.ndim == 2 and first.shape[1] in widths else widths[0]
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header,
        {
            "descr": np.lib.format.dtype_to_descr(np.dtype(on_disk)),
            "fortran_order": False,
            "shape": (rows, width),
        },
    )
    digest = hashlib.sha256(header.getvalue())
    size = handle.write(header.getvalue())
    block: np.ndarray | None = first
    del first
    for start in range(0, rows, block_rows):
        stop = min(start + block_rows, rows)
        if block is None:
            block = read(start, stop)
        if block.shape != (stop - start, width):
            raise CheckpointError(
                f"{what}: rows [{start}, {stop}) read as shape {block.shape}, expected "
                f"{(stop - start, width)}"
            )
        data = block.data.cast("B")
        digest.update(data)
        size += handle.write(data)
        block = None
        del data  # before the next block is read
    return {"sha256": digest.hexdigest(), "bytes": size}, width


def _placed(shards: Iterable[TableShard]) -> list[str]:
    """`['table_0.rows_0_23.cols_0_4 (column_wise, rank 0)', ...]`, sorted."""
    return sorted(f"{s.name} ({s.kind}, rank {s.rank})" for s in shards)


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
            checksum = {"sha256": sha256_of_file(path), "bytes": path.stat().st_size}
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
        block_bytes: int = ROW_BLOCK_BYTES,
        row_wise_slots: Collection[str] = (),
        dtype: str = "float32",
    ) -> None:
        """One shard of table `shard.table` (whole shape `table_shape`) and its
        optimizer slots: values [shard.height, shard.width], given in float32 and
        stored as `dtype` (the table's: float32, bfloat16 or float16); each slot,
        float32, that shape or, a row-wise slot, [shard.height, 1].

        Which slots are row-wise: `row_wise_slots`, and any other whose array
        (or first block) is one column wide on a shard of more.

        Each of `values` and `slots` is an array (a memory map too) or a
        `RowReader`; either is written, and hashed, in row blocks of about
        `block_bytes`, one file after the other, so that writing holds one block
        besides what the caller holds. The files are `np.save`'s, byte for byte.
        """
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if dtype not in TABLE_DTYPES:
            raise CheckpointError(f"{shard.name}: dtype {dtype!r}, expected one of {TABLE_DTYPES}")
        table_shape = (int(table_shape[0]), int(table_shape[1]))
        if not shard.fits(table_shape):
            raise CheckpointError(
                f"{shard.name}: {shard.describe()} lie outside table {shard.table} of shape "
                f"{list(table_shape)}"
            )
        unknown = set(row_wise_slots) - set(slots)
        if unknown:
            raise CheckpointError(
                f"{shard.name}: row-wise slots {sorted(unknown)} are not among its slots "
                f"{sorted(slots)}"
            )
        widths = {
            "values": (shard.width,),
            **{name: (1,) if name in row_wise_slots else (shard.width, 1) for name in slots},
        }
        for name, array in [("values", values), *slots.items()]:
            if isinstance(array, np.ndarray) and not any(
                tuple(array.shape) == (shard.height, w) for w in widths[name]
            ):
                expected = " or ".join(str((shard.height, w)) for w in widths[name])
                raise CheckpointError(
                    f"{shard.name}: {name} has shape {tuple(array.shape)}, expected {expected}"
                )
        entry = self._tables.get(shard.table, StoredTable(shard.table, table_shape, (), dtype))
        if entry.dtype != dtype:
            raise CheckpointError(
                f"{shard.name}: table dtype {dtype}, an earlier shard of table {shard.table} "
                f"said {entry.dtype}"
            )
        if entry.shape != table_shape:
            raise CheckpointError(
                f"{shard.name}: table shape {list(table_shape)}, an earlier shard of table "
                f"{shard.table} said {list(entry.shape)}"
            )
        base = shard_file_name(shard)
        files = {"values": f"{base}.npy", **{slot: f"{base}.{slot}.npy" for slot in slots}}
        row_wise = []
        for name, source in [("values", values), *slots.items()]:
            relative = files[name]
            with (self.staging / relative).open("wb") as handle:
                checksum, width = _write_npy_rows(
                    handle,
                    f"{shard.name} {name}",
                    source,
                    shard.height,
                    widths[name],
                    block_bytes,
                    dtype if name == "values" else "float32",
                )
            self._written(relative, checksum)
            if name != "values" and (name in row_wise_slots or width != shard.width):
                row_wise.append(name)
        stored = StoredShard(
            shard, files["values"], {slot: files[slot] for slot in slots}, tuple(row_wise)
        )
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
                if merged.dtype != entry.dtype:
                    raise CheckpointError(
                        f"{self.staging}: ranks wrote table {table} as {merged.dtype} and "
                        f"{entry.dtype}"
                    )
                tables[table] = dataclasses.replace(merged, shards=merged.shards + entry.shards)
        stored = [tables[t].in_order() for t in sorted(tables)]
        for entry in stored:
            try:
                check_disjoint(entry.table, entry.shape, [s.shard for s in entry.shards])
            except ShardError as error:
                raise CheckpointError(f"{self.staging}: {error}") from error
        sixteen_bit = any(entry.dtype != "float32" for entry in stored)
        manifest = {
            "format_version": FORMAT_VERSION if sixteen_bit else FLOAT32_TABLES_VERSION,
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
