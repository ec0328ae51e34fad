"""Parsing delimited lines into typed columns, with a reason for every rejected line.

Runs in Spark's Python workers on Arrow batches of lines (`DataFrame.mapInArrow`):
the splitting, checking and casting are pyarrow compute kernels over whole columns,
and only rejected lines are looked at one by one (to name their reason). Each task
writes its well-formed rows as one Parquet file, and how often each value of each
vocabulary feature occurs in them per input file as another (the vocabularies are
summed from these, never from the rows again); it returns, per file block it read,
the line counts and its first rejected lines.

The rules, checked in this order (a line gets the first reason that applies):

- a line with more fields than the layout is malformed (`field_count`); fewer are
  accepted, the missing trailing fields read as empty (real logs cut them off);
- the label must be 0 or 1 (`label`);
- a non-empty numerical field must be a number of the layout's kind (`numerical`);
- a non-empty categorical field must be a value of its kind (`categorical`); in a
  variable-length field, every element of the list must (the message names it);
- a rejected line equal to the field names is a header line, skipped and counted
  apart.

An empty field is a missing value (null); an empty variable-length field is an
empty list, an empty element of a list a missing value (null).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from feature_spec.staged import staged_file
from preproc.layout import (
    LABEL_COLUMN,
    CategoricalColumn,
    CategoricalKind,
    InputLayout,
    NumericalKind,
    categorical_column,
    numerical_column,
)
from preproc.value_counts import (
    COUNT_COLUMN,
    COUNTS_SCHEMA,
    FEATURE_COLUMN,
    FILE_COLUMN,
    VALUE_COLUMN,
)

# Malformed-line reasons, in the order lines are checked (a line gets the first).
MALFORMED_REASONS = ("field_count", "label", "numerical", "categorical")
HEADER = "header"

BLOCK_COLUMN = "_block"
ROW_COLUMN = "_row"
LINE_COLUMN = "_line"

# A well-formed non-empty value of each kind (TOKEN: anything).
PATTERNS = {
    NumericalKind.INTEGER: r"-?[0-9]{1,18}",
    NumericalKind.FLOAT: r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?",
    CategoricalKind.HEX: r"[0-9a-fA-F]{1,8}",
    CategoricalKind.ID: r"[0-9]{1,10}",
}
_EXPECTED = {
    NumericalKind.INTEGER: "an integer",
    NumericalKind.FLOAT: "a number",
    CategoricalKind.HEX: "1 to 8 hex digits",
}
_QUOTED_CHARS = 40  # of a bad value, in the message
# Rows a task gathers before writing them as one Parquet row group.
ROW_GROUP_ROWS = 1 << 17

# What a task returns: one row per file block it read. `examples`: JSON list of
# [row id, reason, detail] of the block's first rejected lines (headers aside).
BLOCK_SCHEMA = pa.schema(
    [
        ("file", pa.int64()),
        ("block", pa.int64()),
        ("first_row", pa.int64()),
        ("lines", pa.int64()),
        ("positives", pa.int64()),
        (HEADER, pa.int64()),
        *((reason, pa.int64()) for reason in MALFORMED_REASONS),
        ("examples", pa.string()),
    ]
)


@dataclasses.dataclass(frozen=True)
class ParseTask:
    """What every parse task needs.

    Attributes:
        layout: the input's fields.
        output_dir: where the tasks write the rows' Parquet files (seen by every
            executor: a shared file system on a cluster).
        counts_dir: where they write the value counts (`COUNTS_SCHEMA`) of the
            vocabulary features (`layout.vocabulary_columns`).
        examples: rejected lines kept per block (in line order), for the report.
    """

    layout: InputLayout
    output_dir: str
    counts_dir: str
    examples: int


def row_schema(layout: InputLayout) -> pa.Schema:
    """The columns of the parsed rows: [_file, _block, _row, _label, _num<i>...,
    _cat<i>...]; numerical values are int64 (integer kind) or float64, categorical
    values int64 (id) or string (hex, token: the text as written), a list of them
    for a variable-length feature."""
    number = pa.int64() if layout.numerical_kind == NumericalKind.INTEGER else pa.float64()
    fields = [
        (FILE_COLUMN, pa.int32()),
        (BLOCK_COLUMN, pa.int64()),
        (ROW_COLUMN, pa.int64()),
        (LABEL_COLUMN, pa.bool_()),
    ]
    fields += [(numerical_column(i), number) for i in range(len(layout.numerical))]
    for index, column in enumerate(layout.categorical):
        value = pa.int64() if column.kind == CategoricalKind.ID else pa.string()
        fields.append(
            (categorical_column(index), pa.list_(value) if column.variable_length else value)
        )
    return pa.schema(fields)


def parse_partition(task: ParseTask, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The body of a parse task (`mapInArrow`): batches of [_file, _block, _row,
    value] lines in; one Parquet file of the well-formed rows and one of their value
    counts written (each staged under a hidden name of its own and renamed into
    place when complete: a retried task replaces it whole, and Spark and pyarrow
    skip hidden files); `BLOCK_SCHEMA` rows out."""
    parser = _Parser(task.layout)
    schema = parser.schema
    blocks: dict[tuple[int, int], _BlockCounts] = {}
    counts = _ValueCounts(task.layout)
    name = f"part-{_part_id()}.parquet"
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    rows_file = staged_file(Path(task.output_dir) / name, unique=True)
    with rows_file as staging, pq.ParquetWriter(staging, schema) as out:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            rows = parser.parse(batch, blocks, task.examples)
            counts.add(rows)
            pending.append(rows)
            pending_rows += rows.num_rows
            if pending_rows >= ROW_GROUP_ROWS:
                out.write_table(pa.Table.from_batches(pending, schema))
                pending, pending_rows = [], 0
        if pending:
            out.write_table(pa.Table.from_batches(pending, schema))
    with staged_file(Path(task.counts_dir) / name, unique=True) as staging:
        pq.write_table(counts.table(), staging)
    if blocks:
        yield pa.RecordBatch.from_pylist(
            [counts.to_row(file, block) for (file, block), counts in blocks.items()],
            schema=BLOCK_SCHEMA,
        )


class _ValueCounts:
    """The value counts of one task's well-formed rows, summed batch by batch."""

    def __init__(self, layout: InputLayout) -> None:
        self.features = layout.vocabulary_columns
        self.lists = layout.variable_length
        self.partial: dict[int, list[pa.Table]] = {i: [] for i in self.features}

    def add(self, rows: pa.RecordBatch) -> None:
        for index in self.features:
            values = rows.column(categorical_column(index))
            files = rows.column(FILE_COLUMN)
            if self.lists[index]:
                files = pc.take(files, pc.list_parent_indices(values))
                values = pc.list_flatten(values)
            pairs = pa.table({FILE_COLUMN: files, VALUE_COLUMN: values})
            grouped = (
                pairs.filter(pc.is_valid(values))
                .group_by([FILE_COLUMN, VALUE_COLUMN])
                .aggregate([(VALUE_COLUMN, "count")])
            )
            self.partial[index].append(
                grouped.rename_columns({f"{VALUE_COLUMN}_count": COUNT_COLUMN})
            )

    def table(self) -> pa.Table:
        tables = []
        for index, partial in self.partial.items():
            if not partial:
                continue
            total = (
                pa.concat_tables(partial)
                .group_by([FILE_COLUMN, VALUE_COLUMN])
                .aggregate([(COUNT_COLUMN, "sum")])
                .rename_columns({f"{COUNT_COLUMN}_sum": COUNT_COLUMN})
            )
            feature = pa.array(np.full(total.num_rows, index, np.int32))
            tables.append(total.append_column(FEATURE_COLUMN, feature))
        if not tables:
            return COUNTS_SCHEMA.empty_table()
        return pa.concat_tables(tables).select(COUNTS_SCHEMA.names).cast(COUNTS_SCHEMA)


def _part_id() -> str:
    """The Spark partition's number (a retried task replaces its file), or a
    unique name outside Spark."""
    try:
        from pyspark import TaskContext
    except ImportError:  # pragma: no cover - pyspark is a dependency
        context = None
    else:
        context = TaskContext.get()
    return f"{context.partitionId():05d}" if context is not None else uuid.uuid4().hex


@dataclasses.dataclass
class _BlockCounts:
    first_row: int
    lines: int = 0
    positives: int = 0
    reasons: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys((HEADER, *MALFORMED_REASONS), 0)
    )
    examples: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)

    def to_row(self, file: int, block: int) -> dict[str, Any]:
        return {
            "file": file,
            "block": block,
            "first_row": self.first_row,
            "lines": self.lines,
            "positives": self.positives,
            **self.reasons,
            "examples": json.dumps(self.examples),
        }


class _Fields:
    """The fields of a batch of lines, split once and taken out by position."""

    def __init__(self, lines: pa.Array, delimiter: str) -> None:
        parts = pc.split_pattern(lines, pattern=delimiter)
        self.offsets = parts.offsets.to_numpy()
        self.counts = np.diff(self.offsets)  # fields per line
        self.flat = parts.values
        self.taken: dict[int, pa.Array] = {}

    def text(self, position: int) -> pa.Array:
        """The text of field `position` of every line ("" past its last field)."""
        if position not in self.taken:
            present = self.counts > position
            index = pa.array(np.where(present, self.offsets[:-1] + position, 0))
            taken = pc.take(self.flat, index)
            self.taken[position] = taken if present.all() else pc.if_else(present, taken, "")
        return self.taken[position]


class _Parser:
    """Parses batches of lines of one layout (patterns compiled once per task)."""

    def __init__(self, layout: InputLayout) -> None:
        self.layout = layout
        self.width = len(layout.fields)
        self.label_position = layout.position(layout.label_source)
        self.numerical_positions = [layout.position(n.source) for n in layout.numerical]
        self.categorical_positions = [layout.position(c.source) for c in layout.categorical]
        self.number_pattern = f"^(?:{PATTERNS[layout.numerical_kind]})$"
        self.number_type = (
            pa.int64() if layout.numerical_kind == NumericalKind.INTEGER else pa.float64()
        )
        self.checks = {kind: re.compile(pattern) for kind, pattern in PATTERNS.items()}
        self.schema = row_schema(layout)

    # ------------------------------------------------------------ vectorised

    def parse(
        self,
        batch: pa.RecordBatch,
        blocks: dict[tuple[int, int], _BlockCounts],
        examples: int,
    ) -> pa.RecordBatch:
        """The well-formed rows of `batch`, typed; counts the lines into `blocks`."""
        lines = batch.column("value")
        fields = _Fields(lines, self.layout.delimiter)
        good, lists = self._check(fields)
        clicked = pc.equal(fields.text(self.label_position), "1")
        self._count(batch, good, _numpy(clicked), blocks, examples, lines)
        return self._typed_rows(batch, fields, lists, clicked, pa.array(good))

    def _check(self, fields: _Fields) -> tuple[np.ndarray, dict[int, pa.Array]]:
        """Per line, whether it is well-formed; and the elements of each
        variable-length field (by categorical index)."""
        good = fields.counts <= self.width
        label = fields.text(self.label_position)
        good &= _numpy(pc.is_in(label, value_set=pa.array(["0", "1"])))
        for position in self.numerical_positions:
            good &= _numpy(self._valid(fields.text(position), self.number_pattern))
        lists: dict[int, pa.Array] = {}
        for index, column in enumerate(self.layout.categorical):
            text = fields.text(self.categorical_positions[index])
            if column.variable_length:
                lists[index], element_ok = self._elements(column, text)
                good &= element_ok
            elif column.kind != CategoricalKind.TOKEN:
                good &= self._valid_value(column, text)
        return good, lists

    def _typed_rows(
        self,
        batch: pa.RecordBatch,
        fields: _Fields,
        lists: dict[int, pa.Array],
        clicked: pa.Array,
        keep: pa.Array,
    ) -> pa.RecordBatch:
        """The lines `keep` selects as rows of `schema`."""
        columns: list[pa.Array] = [
            batch.column(FILE_COLUMN).filter(keep),
            batch.column(BLOCK_COLUMN).filter(keep),
            batch.column(ROW_COLUMN).filter(keep),
            clicked.filter(keep),
        ]
        for position in self.numerical_positions:
            text = _nulls_for_empty(fields.text(position).filter(keep))
            columns.append(pc.cast(text, self.number_type))
        for index, column in enumerate(self.layout.categorical):
            if column.variable_length:
                columns.append(self._typed_list(column, lists[index].filter(keep)))
                continue
            values = _nulls_for_empty(fields.text(self.categorical_positions[index]).filter(keep))
            columns.append(
                pc.cast(values, pa.int64()) if column.kind == CategoricalKind.ID else values
            )
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)

    def _valid(self, text: pa.Array, pattern: str) -> pa.Array:
        return pc.or_(pc.equal(text, ""), pc.match_substring_regex(text, pattern))

    def _valid_value(self, column: CategoricalColumn, text: pa.Array) -> np.ndarray:
        """Empty, or a value of the column's kind (an id: in range)."""
        matches = _numpy(pc.match_substring_regex(text, f"^(?:{PATTERNS[column.kind]})$"))
        if column.kind == CategoricalKind.ID:
            assert column.cardinality is not None  # checked by InputLayout
            ids = _numpy(pc.cast(pc.if_else(matches, text, "0"), pa.int64()))
            matches &= ids < column.cardinality
        return matches | _numpy(pc.equal(text, ""))

    def _elements(self, column: CategoricalColumn, text: pa.Array) -> tuple[pa.Array, np.ndarray]:
        """A variable-length field's elements (an empty field: an empty list) and,
        per line, whether every element is empty or a value of the column's kind."""
        assert self.layout.list_delimiter is not None  # checked by InputLayout
        split = pc.split_pattern(text, pattern=self.layout.list_delimiter)
        lengths = np.where(_numpy(pc.equal(text, "")), 0, np.diff(split.offsets.to_numpy()))
        starts = split.offsets.to_numpy()[:-1]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        values = pc.take(split.values, pa.array(index, pa.int64()))
        elements = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)
        if column.kind == CategoricalKind.TOKEN:
            return elements, np.ones(len(text), dtype=bool)
        element_ok = self._valid_value(column, values)
        line_ok = np.ones(len(text), dtype=bool)
        rows = np.repeat(np.arange(len(text)), lengths)
        line_ok[rows[~element_ok]] = False
        return elements, line_ok

    def _typed_list(self, column: CategoricalColumn, elements: pa.Array) -> pa.Array:
        values = _nulls_for_empty(elements.values)
        if column.kind == CategoricalKind.ID:
            values = pc.cast(values, pa.int64())
        offsets = elements.offsets
        return pa.ListArray.from_arrays(pc.subtract(offsets, offsets[0]), values)

    def _count(
        self,
        batch: pa.RecordBatch,
        good: np.ndarray,
        clicked: np.ndarray,
        blocks: dict[tuple[int, int], _BlockCounts],
        examples: int,
        lines: pa.Array,
    ) -> None:
        files = batch.column(FILE_COLUMN).to_numpy()
        starts = batch.column(BLOCK_COLUMN).to_numpy()
        rows = batch.column(ROW_COLUMN).to_numpy()
        positive = good & clicked
        # A batch holds consecutive lines of one or more blocks.
        cuts = np.flatnonzero((files[1:] != files[:-1]) | (starts[1:] != starts[:-1])) + 1
        for begin, end in zip([0, *cuts], [*cuts, len(files)], strict=True):
            key = (int(files[begin]), int(starts[begin]))
            counts = blocks.setdefault(key, _BlockCounts(first_row=int(rows[begin])))
            counts.first_row = min(counts.first_row, int(rows[begin]))
            counts.lines += end - begin
            counts.positives += int(np.count_nonzero(positive[begin:end]))
        rejected = np.flatnonzero(~good)
        if not len(rejected):
            return
        texts = pc.take(lines.cast(pa.binary()), pa.array(rejected)).to_pylist()
        for at, raw in zip(rejected, texts, strict=True):
            counts = blocks[(int(files[at]), int(starts[at]))]
            reason, detail = self.reason(raw.decode("utf-8", errors="replace"))
            counts.reasons[reason] += 1
            if reason != HEADER and len(counts.examples) < examples:
                counts.examples.append((int(rows[at]), reason, detail))

    # ------------------------------------------------------------ one line

    def reason(self, line: str) -> tuple[str, str]:
        """Why `line` is rejected: (reason, detail); ("header", "") for the names."""
        layout = self.layout
        fields = line.split(layout.delimiter)
        if fields == list(layout.fields):
            return HEADER, ""
        if len(fields) > self.width:
            return "field_count", (
                f"expected at most {self.width} fields separated by {layout.delimiter!r}, "
                f"got {len(fields)}"
            )
        fields += [""] * (self.width - len(fields))
        label = fields[self.label_position]
        if label not in ("0", "1"):
            return "label", self._detail(layout.label_source, "0 or 1", label)
        check = self.checks[layout.numerical_kind]
        for number, position in zip(layout.numerical, self.numerical_positions, strict=True):
            value = fields[position]
            if value and not check.fullmatch(value):
                expected = _EXPECTED[layout.numerical_kind]
                return "numerical", self._detail(number.source, expected, value)
        for column, position in zip(layout.categorical, self.categorical_positions, strict=True):
            value = fields[position]
            if column.kind == CategoricalKind.TOKEN or not value:
                continue
            if not column.variable_length:
                if not self._is_value(column, value):
                    return "categorical", self._detail(column.source, _expected(column), value)
                continue
            assert layout.list_delimiter is not None  # checked by InputLayout
            for place, element in enumerate(value.split(layout.list_delimiter)):
                if element and not self._is_value(column, element):
                    return "categorical", (
                        f"field {position + 1} ({column.source}), list element {place + 1}: "
                        f"expected {_expected(column)}, got '{element[:_QUOTED_CHARS]}'"
                    )
        raise AssertionError(f"line rejected by the column checks but not by the rules: {line!r}")

    def _is_value(self, column: CategoricalColumn, value: str) -> bool:
        if not self.checks[column.kind].fullmatch(value):
            return False
        return column.kind != CategoricalKind.ID or int(value) < (column.cardinality or 0)

    def _detail(self, source: str, expected: str, value: str) -> str:
        position = self.layout.position(source)
        return (
            f"field {position + 1} ({source}): expected {expected}, got '{value[:_QUOTED_CHARS]}'"
        )


def _expected(column: CategoricalColumn) -> str:
    if column.kind == CategoricalKind.ID:
        return f"an integer id in [0, {column.cardinality})"
    return _EXPECTED[column.kind]


def _numpy(array: pa.Array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False)


def _nulls_for_empty(text: pa.Array) -> pa.Array:
    return pc.if_else(pc.equal(text, ""), pa.scalar(None, text.type), text)
