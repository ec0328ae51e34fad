"""Reading a checkpoint: the manifest checked on open, each file checked against
its size and sha256 when first read, any [rows, columns] slice of a table
streamed from whatever shards hold it."""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dlrm.checkpoint.format import (
    DENSE_FILE,
    FORMAT_VERSION,
    MANIFEST,
    READABLE_VERSIONS,
    CheckpointError,
    StoredTable,
    list_checkpoints,
    resolve_checkpoint,
    sha256_of_file,
)
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import PlanError
from dlrm.embedding.shard import (
    ROW_BLOCK_BYTES,
    Range,
    ShardError,
    TableShard,
    check_covers,
    check_disjoint,
    range_intersection,
)


class _NpyLayout(NamedTuple):
    """Where the array of a `.npy` file lies: C-order `shape` of `dtype` from
    byte `offset` on."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    offset: int
    bfloat16: bool = False  # uint16 holding a bfloat16 table's bits


class _Piece(NamedTuple):
    """The part of a requested slice that one shard file holds: `part` (table
    coordinates) of `shard`, whose values (or slot) are in `file`, `width`
    columns wide (the shard's, or 1 for a row-wise slot)."""

    file: str
    shard: TableShard
    part: TableShard
    width: int


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
                f"{', '.join(map(str, READABLE_VERSIONS[:-1]))} and {READABLE_VERSIONS[-1]}"
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
        digest = sha256_of_file(path)
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

    def table_dtype(self, table: int) -> str:
        """What the table's values are stored as: float32, bfloat16 or float16
        (`restore_table_slice` gives float32 whichever)."""
        return self._table(table).dtype

    def is_row_wise_slot(self, table: int, slot: str) -> bool:
        """Whether the table's `slot` is stored one value per row, [rows, 1]
        (row-wise Adagrad's accumulator): a slice of it is [rows, 1]."""
        return any(slot in stored.row_wise_slots for stored in self._table(table).shards)

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
            width = stored.shard.width if slot is None else stored.slot_width(slot)
            pieces.append(_Piece(file, stored.shard, part, width))
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
        expected = (piece.shard.height, piece.width)
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
        bfloat16 = self._table(piece.shard.table).dtype == "bfloat16" and dtype == np.uint16
        if fortran_order or not (dtype.kind == "f" or bfloat16):
            raise CheckpointError(
                f"{path}: a {'Fortran-order ' if fortran_order else ''}{dtype} array, "
                f"expected C-order float32, float16 or (a bfloat16 table's) uint16"
            )
        layout = _NpyLayout(tuple(shape), dtype, offset, bfloat16)
        self._layouts[piece.file] = layout
        return layout

    def restore_table_slice(
        self,
        table: int,
        rows: Range,
        columns: Range,
        assign: Callable[[int, np.ndarray], object],
        slot: str | None = None,
        block_bytes: int = ROW_BLOCK_BYTES,
    ) -> None:
        """Streams rows [r0, r1) x columns [c0, c1) of a table (or of its optimizer
        `slot`) to `assign` in consecutive row blocks.

        Calls `assign(row_offset, block)` with `block` float32 [n, c1 - c0] holding
        rows [r0 + row_offset, r0 + row_offset + n), assembled from the shards
        that overlap it, for row_offset = 0, n, 2n, ... (the last block may be
        shorter); e.g. `lambda offset, block: variable[offset:offset +
        len(block)].assign(block)`. Each block is a new array, which `assign` may
        keep. Blocks have as many rows as fit in `block_bytes` at the width of the
        request or of its widest shard, whichever is wider (at least one row), and
        that bounds the read buffer too: besides the caller's own memory, a
        restore holds one block and one read buffer.

        A row-wise slot (`is_row_wise_slot`) gives blocks [n, 1]: each row's
        value is the mean of the shards' values that cover the columns, weighted
        by how many of the columns each covers (one shard: its value).

        Every shard file the slice needs is verified (see `Checkpoint`) and its
        header checked before `assign` is first called, and coverage too: a
        failure raises `CheckpointError` before anything is assigned.
        """
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        pieces = self._pieces(table, rows, columns, slot)
        layouts = {piece.file: self._layout(piece) for piece in pieces}
        if slot is not None and self.is_row_wise_slot(table, slot):
            self._restore_row_wise(pieces, layouts, rows, columns, assign, block_bytes)
            return
        width = _length(columns)
        widest = max([width, *(piece.shard.width for piece in pieces)])
        itemsize = max([4, *(layout.dtype.itemsize for layout in layouts.values())])
        block_rows = max(1, block_bytes // (widest * itemsize))
        with contextlib.ExitStack() as stack:
            handles = self._open(stack, layouts)
            for start in range(rows[0], rows[1], block_rows):
                stop = min(start + block_rows, rows[1])
                block = np.empty((stop - start, width), np.float32)
                for piece in pieces:
                    part = range_intersection(piece.part.rows, (start, stop))
                    if part is not None:
                        origin = (start, columns[0])
                        self._read_piece(
                            piece, layouts[piece.file], handles[piece.file], part, block, origin
                        )
                assign(start - rows[0], block)
                del block  # before the next one is allocated

    def _open(self, stack: contextlib.ExitStack, files: Iterable[str]) -> dict[str, io.FileIO]:
        """Each of `files` of this checkpoint, opened unbuffered for positioned
        reads until `stack` closes."""
        return {
            file: stack.enter_context((self.path / file).open("rb", buffering=0)) for file in files
        }

    def _restore_row_wise(
        self,
        pieces: list[_Piece],
        layouts: Mapping[str, _NpyLayout],
        rows: Range,
        columns: Range,
        assign: Callable[[int, np.ndarray], object],
        block_bytes: int,
    ) -> None:
        """`restore_table_slice` of a row-wise slot: blocks [n, 1], each row the
        column-weighted mean of the pieces over it (in float64, then float32)."""
        if any(layout.shape[1] != 1 for layout in layouts.values()):
            raise CheckpointError(
                f"{self.path / MANIFEST}: the shards of table {pieces[0].shard.table} store "
                "a slot per row on some shards and per element on others"
            )
        width = _length(columns)
        block_rows = max(1, block_bytes // 8)
        with contextlib.ExitStack() as stack:
            handles = self._open(stack, layouts)
            for start in range(rows[0], rows[1], block_rows):
                stop = min(start + block_rows, rows[1])
                total = np.zeros((stop - start, 1), np.float64)
                for piece in pieces:
                    part = range_intersection(piece.part.rows, (start, stop))
                    if part is None:
                        continue
                    layout = layouts[piece.file]
                    values = np.empty((_length(part), 1), layout.dtype)
                    offset = layout.offset + (part[0] - piece.shard.rows[0]) * layout.dtype.itemsize
                    _read_exact(handles[piece.file], self.path / piece.file, offset, values)
                    share = piece.part.width / width
                    total[part[0] - start : part[1] - start] += share * values
                assign(start - rows[0], total.astype(np.float32))

    def _read_piece(
        self,
        piece: _Piece,
        layout: _NpyLayout,
        handle: io.FileIO,
        rows: Range,
        block: np.ndarray,
        block_origin: tuple[int, int],
    ) -> None:
        """Copies rows `rows` x `piece.part.columns` (table coordinates) from the
        shard file into `block`, whose element [0, 0] is table element `block_origin`."""
        shard, columns = piece.shard, piece.part.columns
        row_bytes = shard.width * layout.dtype.itemsize
        offset = layout.offset + (rows[0] - shard.rows[0]) * row_bytes
        target_rows = slice(rows[0] - block_origin[0], rows[1] - block_origin[0])
        path = self.path / piece.file
        block_columns = (block_origin[1], block_origin[1] + block.shape[1])
        if shard.columns == block_columns and layout.dtype == block.dtype:
            # The shard's rows are whole rows of the block: read them in place.
            _read_exact(handle, path, offset, block[target_rows])
            return
        buffer = np.empty((_length(rows), shard.width), layout.dtype)
        _read_exact(handle, path, offset, buffer)
        if layout.bfloat16:  # widened: the bits as a float32's high half
            buffer = (buffer.astype(np.uint32) << np.uint32(16)).view(np.float32)
        source_columns = slice(columns[0] - shard.columns[0], columns[1] - shard.columns[0])
        target_columns = slice(columns[0] - block_origin[1], columns[1] - block_origin[1])
        block[target_rows, target_columns] = buffer[:, source_columns]

    def read_table_slice(
        self,
        table: int,
        rows: Range,
        columns: Range,
        slot: str | None = None,
    ) -> np.ndarray:
        """Rows [r0, r1) x columns [c0, c1) of a table (or of its optimizer `slot`),
        float32 [r1 - r0, c1 - c0], assembled from the shards that overlap it.
        Holds the whole slice in memory; `restore_table_slice` streams it. A
        row-wise slot's slice is [r1 - r0, 1]."""
        width = 1 if slot is not None and self.is_row_wise_slot(table, slot) else None
        out = np.empty((_length(rows), width or _length(columns)), np.float32)

        def assign(offset: int, block: np.ndarray) -> None:
            out[offset : offset + len(block)] = block

        self.restore_table_slice(table, rows, columns, assign, slot)
        return out


def _length(span: Range) -> int:
    return span[1] - span[0]
