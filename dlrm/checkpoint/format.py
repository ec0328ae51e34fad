"""Checkpoints: a directory per saved step, written atomically, verified on read.

Layout of `<root>/step_<step:09d>/`:

- `manifest.json`: format version, step, the run config, model config,
  optimizer, the sharding plan, the embedding tables and their shards, and the
  sha256 and size of every other file. It is written last.
- `dense.npz`: dense weights, their optimizer slots and the trainer's counters,
  by name (no pickle).
- `embeddings/<TableShard.name>.npy` (`table_<t>.rows_<r0>_<r1>.cols_<c0>_<c1>.npy`):
  one file per table shard, and one per optimizer slot of it (`....<slot>.npy`):
  the shard's shape, or [rows, 1] for a row-wise slot (row-wise Adagrad's
  accumulator, listed under the shard's `row_wise_slots`). A table's values are
  stored in its `dtype` (the manifest's, float32 when absent): float16 as
  `<f2`, bfloat16 as its bits, `<u2`; slots are always float32. Restoring
  widens to float32, and a variable of another dtype rounds to nearest.

A row-wise slot reshards with the table's rows: row ranges split and join; a
slice whose columns several column shards held gets the mean of their values
weighted by the columns each holds (a row-wise accumulator is a mean of squares
over its shard's columns, so this is the whole row's), and a column shard cut
from wider stored shards gets that mean too (a copy, from a single one).

The manifest lists each shard once, as a `StoredShard` (its `TableShard` with the
files) under its `StoredTable`; the plan it stores leaves the shards out
(`ShardingPlan.to_dict(with_shards=False)`, and `Checkpoint.plan` puts them
back). One process writes one shard per table (the whole table); sharded runs
write several, and `restore_table_slice` streams any [rows, columns] slice from
whatever shards a checkpoint has, in row blocks of bounded size, which is what
restoring on another number of ranks needs. Writing streams too: a shard is
written (and hashed) in row blocks read from a `RowReader`, so neither direction
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

import dataclasses
import hashlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dlrm.embedding.shard import (
    ShardingKind,
    TableShard,
)

# 2: the plan leaves out the shards, which the manifest lists under `tables`.
# 3: a table may store 16-bit values (its `dtype`). A checkpoint of float32
# tables is still written as 2, which older code reads.
FORMAT_VERSION = 3
FLOAT32_TABLES_VERSION = 2


READABLE_VERSIONS = (1, 2, 3)


# What a table's values may be stored as (`StoredTable.dtype`).
TABLE_DTYPES = ("float32", "bfloat16", "float16")


MANIFEST = "manifest.json"


DENSE_FILE = "dense.npz"


_STEP_DIR = re.compile(r"^step_(\d+)$")


_HASH_BLOCK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the model."""

    # True when the ranks agreed on it through a collective (dlrm.distributed.launcher).
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
    (paths relative to the checkpoint); `row_wise_slots`: the slots stored as
    one value per row, [rows, 1]."""

    shard: TableShard
    file: str
    slots: Mapping[str, str]
    row_wise_slots: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Its manifest entry: `TableShard.to_dict()` with `file`, `slots` and,
        when it has any, `row_wise_slots`."""
        entry = {**self.shard.to_dict(), "file": self.file, "slots": dict(self.slots)}
        if self.row_wise_slots:
            entry["row_wise_slots"] = list(self.row_wise_slots)
        return entry

    def slot_width(self, slot: str) -> int:
        """The columns of `slot`'s file: 1 for a row-wise slot, else the shard's."""
        return 1 if slot in self.row_wise_slots else self.shard.width

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **defaults: Any) -> StoredShard:
        """The inverse of `to_dict`; `defaults` fill the `TableShard` keys that
        format 1's oldest entries lack. Raises ShardError, KeyError, TypeError."""
        slots = data.get("slots", {})
        if not isinstance(slots, Mapping):
            raise TypeError(f"slots: expected slot name -> file, got {slots!r}")
        shard = TableShard.from_dict(data, **defaults)
        row_wise = tuple(str(name) for name in data.get("row_wise_slots", ()))
        if not set(row_wise) <= set(slots):
            raise ValueError(f"row_wise_slots {list(row_wise)} are not all among its slots")
        return cls(shard, str(data["file"]), {str(k): str(v) for k, v in slots.items()}, row_wise)


@dataclasses.dataclass(frozen=True)
class StoredTable:
    """Table `table` of `shape` [rows, columns] in a checkpoint, and the shards of
    it the checkpoint holds, in (rows, columns) order once published."""

    table: int
    shape: tuple[int, int]
    shards: tuple[StoredShard, ...]
    dtype: str = "float32"  # of its values (TABLE_DTYPES); slots are float32

    def to_dict(self) -> dict[str, Any]:
        entry = {
            "index": self.table,
            "shape": list(self.shape),
            "shards": [shard.to_dict() for shard in self.shards],
        }
        if self.dtype != "float32":
            entry["dtype"] = self.dtype
        return entry

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], version: int) -> StoredTable:
        """The inverse of `to_dict`, for a manifest of format `version`. Raises
        ShardError, KeyError, TypeError or ValueError if `data` is not one."""
        table = int(data["index"])
        rows, columns = (int(n) for n in data["shape"])
        dtype = str(data.get("dtype", "float32"))
        if dtype not in TABLE_DTYPES:
            raise ValueError(f"table {table}: dtype {dtype!r}, expected one of {TABLE_DTYPES}")
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
        return cls(table, (rows, columns), tuple(shards), dtype)

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


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def step_directory_name(step: int) -> str:
    return f"step_{step:09d}"


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


def newest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest published checkpoint directory under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """`path` itself if it holds a manifest, else its newest `step_*` checkpoint."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    newest = newest_checkpoint(path)
    if newest is not None:
        return newest
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    raise CheckpointError(
        f"{path}: not a checkpoint; expected a directory with {MANIFEST} "
        f"or a directory of step_* checkpoints"
    )
