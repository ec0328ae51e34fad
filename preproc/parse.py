"""Parsing delimited lines into typed columns, with a reason for every rejected line.

Lines are read as text (plain or compressed: Spark decompresses `.gz` by name), split
on the delimiter and checked field by field against the `InputLayout`:

- a line with more fields than the layout is malformed (`field_count`); fewer are
  accepted, the missing trailing fields read as empty (real logs cut them off);
- the label must be 0 or 1 (`label`);
- a non-empty numerical field must be a number of the layout's kind (`numerical`);
- a non-empty categorical field must be a value of its kind (`categorical`); in a
  variable-length field, every element of the list must (the message names it);
- a line equal to the field names is a header line, skipped and counted apart.

An empty field is a missing value (null); an empty variable-length field is an
empty list, an empty element of a list a missing value (null). Every line keeps
where it came from: the file index, the start of the file block Spark read it in
and a row id increasing within the block, from which `LineIndex` gives exact line
numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from preproc.config import InputFile
from preproc.layout import (
    LABEL_COLUMN,
    CategoricalColumn,
    CategoricalKind,
    InputLayout,
    NumericalKind,
    categorical_column,
    numerical_column,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

# Malformed-line reasons, in the order lines are checked (a line gets the first).
MALFORMED_REASONS = ("field_count", "label", "numerical", "categorical")
HEADER = "header"

FILE_COLUMN = "_file"
BLOCK_COLUMN = "_block"
ROW_COLUMN = "_row"
REASON_COLUMN = "_reason"
DETAIL_COLUMN = "_detail"
LINE_COLUMN = "_line"

# A well-formed non-empty value of each kind (unanchored; TOKEN: anything).
_PATTERNS = {
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


def read_lines(spark: SparkSession, files: Sequence[InputFile]) -> DataFrame:
    """Every line of `files`: [_file, _block, _row, value].

    Each file is its own scan, so `_file` is exact whatever the path spelling.
    """
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    scans = [
        spark.read.text(str(file.path)).select(
            F.lit(index).alias(FILE_COLUMN),
            F.col("_metadata.file_block_start").alias(BLOCK_COLUMN),
            "value",
        )
        for index, file in enumerate(files)
    ]
    lines = functools.reduce(DataFrame.unionAll, scans)
    # Increasing within a Spark partition, and a file block is read by one partition.
    return lines.withColumn(ROW_COLUMN, F.monotonically_increasing_id())


def parse_lines(lines: DataFrame, layout: InputLayout) -> DataFrame:
    """Typed columns and a malformed reason per line.

    Returns [_file, _block, _row, _reason, _detail, _label, _num<i>..., _cat<i>...]:
    `_reason` is null for a well-formed line, `header`, or one of
    `MALFORMED_REASONS` with `_detail` saying which field and what was expected.
    Missing values are null; numerical values are long (integer kind) or double,
    categorical values long (id) or string (hex, token: the text as written), an
    array of them for a variable-length feature.

    One regular expression checks a whole line; the field-by-field checks that
    find the reason run only for the lines it rejects.
    """
    from pyspark.sql import functions as F

    width = len(layout.fields)
    # Spark's line reader ends lines at \n, \r\n or \r: no \r is left in `value`.
    split = F.split("value", split_pattern(layout.delimiter), -1)
    framed = lines.select(
        FILE_COLUMN,
        BLOCK_COLUMN,
        ROW_COLUMN,
        split.alias("_fields"),
        F.col("value").rlike(line_pattern(layout)).alias("_well_formed"),
    )
    framed = framed.select("*", F.size("_fields").alias("_count"))
    count = F.col("_count")

    def field(source: str) -> Column:
        # Missing trailing fields read as empty (`get` is null past the end).
        return F.coalesce(F.get("_fields", layout.position(source)), F.lit(""))

    def valid(source: str, pattern: str) -> Column:
        value = field(source)
        return (value == "") | value.rlike(f"^(?:{pattern})$")

    checks: dict[str, list[tuple[Column, Column]]] = {reason: [] for reason in MALFORMED_REASONS}
    values: list[Column] = []
    label = field(layout.label_source)
    checks["label"].append((label.isin("0", "1"), _detail(layout, layout.label_source, "0 or 1")))
    values.append((label == "1").alias(LABEL_COLUMN))

    kind = layout.numerical_kind
    cast = "long" if kind == NumericalKind.INTEGER else "double"
    for index, number in enumerate(layout.numerical):
        check = valid(number.source, _PATTERNS[kind])
        checks["numerical"].append((check, _detail(layout, number.source, _EXPECTED[kind])))
        value = field(number.source)
        values.append(F.when(value != "", value.cast(cast)).alias(numerical_column(index)))

    for index, column in enumerate(layout.categorical):
        value = field(column.source)
        if column.variable_length:
            parsed_list, check_list = _parse_list(layout, column, value)
            values.append(parsed_list.alias(categorical_column(index)))
            if check_list is not None:
                checks["categorical"].append(check_list)
            continue
        if column.kind == CategoricalKind.HEX:
            check = valid(column.source, _PATTERNS[column.kind])
            parsed = value  # a token: as text, as it was written
        elif column.kind == CategoricalKind.ID:
            check = valid(column.source, _PATTERNS[column.kind]) & (
                (value == "") | (value.cast("long") < F.lit(column.cardinality))
            )
            parsed = value.cast("long")
        else:
            values.append(F.when(value != "", value).alias(categorical_column(index)))
            continue
        checks["categorical"].append((check, _detail(layout, column.source, _expected(column))))
        values.append(F.when(value != "", parsed).alias(categorical_column(index)))

    # An id out of range passes the line pattern; everything else is in it.
    in_range = [check for check, _ in checks["categorical"]] if _has_ids(layout) else []
    fast = functools.reduce(lambda a, b: a & b, in_range, F.col("_well_formed"))
    header = (count == width) & (F.col("_fields") == F.array(*[F.lit(f) for f in layout.fields]))
    reason = F.when(fast, F.lit(None)).when(header, F.lit(HEADER))
    reason = reason.when(count > width, F.lit("field_count"))
    detail = F.when(fast | header, F.lit(None)).when(
        count > width,
        F.concat(
            F.lit(f"expected at most {width} fields separated by {layout.delimiter!r}, got "),
            count.cast("string"),
        ),
    )
    for name in MALFORMED_REASONS[1:]:
        if not checks[name]:
            continue
        every = functools.reduce(lambda a, b: a & b, [check for check, _ in checks[name]])
        first_bad = F.coalesce(*[F.when(~check, message) for check, message in checks[name]])
        reason = reason.when(~every, F.lit(name))
        detail = detail.when(~every, first_bad)
    return framed.select(
        FILE_COLUMN,
        BLOCK_COLUMN,
        ROW_COLUMN,
        reason.cast("string").alias(REASON_COLUMN),
        detail.cast("string").alias(DETAIL_COLUMN),
        *values,
    )


def _parse_list(
    layout: InputLayout, column: CategoricalColumn, value: Column
) -> tuple[Column, tuple[Column, Column] | None]:
    """A variable-length field's elements (null: an empty element) and, unless any
    text is valid (token), its check and the message naming the first bad element."""
    from pyspark.sql import functions as F

    assert layout.list_delimiter is not None  # checked by InputLayout
    elements = F.split(value, split_pattern(layout.list_delimiter), -1)
    element_type = "bigint" if column.kind == CategoricalKind.ID else "string"

    def parse(element: Column) -> Column:
        parsed = element.cast(element_type) if column.kind == CategoricalKind.ID else element
        return F.when(element != "", parsed)

    # `split` of an empty field is one empty element; the field is an empty list.
    empty = F.array().cast(f"array<{element_type}>")
    parsed = F.when(value == "", empty).otherwise(F.transform(elements, parse))
    pattern = _PATTERNS.get(column.kind)
    if pattern is None:
        return parsed, None

    def valid(element: Column) -> Column:
        good = element.rlike(f"^(?:{pattern})$")
        if column.kind == CategoricalKind.ID:
            good = good & (element.cast("long") < F.lit(column.cardinality))
        return (element == "") | good

    check = (value == "") | F.forall(elements, valid)
    bad_indices = F.transform(elements, lambda element, i: F.when(~valid(element), i))
    first = F.array_min(bad_indices)  # 0-based; nulls (valid elements) are ignored
    first_bad = F.get(elements, first)
    position = layout.position(column.source)
    detail = F.concat(
        F.lit(f"field {position + 1} ({column.source}), list element "),
        (first + 1).cast("string"),
        F.lit(f": expected {_expected(column)}, got '"),
        F.substring(first_bad, 1, _QUOTED_CHARS),
        F.lit("'"),
    )
    return parsed, (check, detail)


def split_pattern(delimiter: str) -> str:
    """The Java regular expression that matches `delimiter` literally, in the form
    `String.split` takes its fast path for (no regex engine): the character itself,
    or a backslash and the character when it is special; `\\Q...\\E` for longer ones.
    Spark's `split` goes through `String.split`: 2-3x faster on the fast path."""
    if len(delimiter) != 1:
        return "\\Q" + delimiter + "\\E"
    return "\\" + delimiter if delimiter in ".$|()[{^?*+\\" else delimiter


def line_pattern(layout: InputLayout) -> str:
    """A regular expression (Java) matching exactly the lines whose fields are all
    well-formed, trailing fields optional; ids are not range-checked by it."""
    delimiter = "\\Q" + layout.delimiter + "\\E"
    single = f"[^\\x{{{ord(layout.delimiter[0]):x}}}]*"  # \x{h}: safe in a class
    token = single if len(layout.delimiter) == 1 else f"(?:(?!{delimiter}).)*"
    kinds: dict[str, str] = {layout.label_source: "[01]"}
    for number in layout.numerical:
        kinds[number.source] = f"(?:{_PATTERNS[layout.numerical_kind]})?"
    for column in layout.categorical:
        pattern = _PATTERNS.get(column.kind)
        if pattern and column.variable_length:
            separator = "\\Q" + str(layout.list_delimiter) + "\\E"
            kinds[column.source] = f"(?:{pattern})?(?:{separator}(?:{pattern})?)*"
        else:
            kinds[column.source] = f"(?:{pattern})?" if pattern else token
    fields = [kinds[source] for source in layout.fields]
    tail = ""
    for pattern in reversed(fields[1:]):
        tail = f"(?:{delimiter}{pattern}{tail})?"
    return f"^{fields[0]}{tail}$"


def _has_ids(layout: InputLayout) -> bool:
    return any(c.kind == CategoricalKind.ID for c in layout.categorical)


def _expected(column: CategoricalColumn) -> str:
    if column.kind == CategoricalKind.ID:
        return f"an integer id in [0, {column.cardinality})"
    return _EXPECTED[column.kind]


def _detail(layout: InputLayout, source: str, expected: str) -> Column:
    from pyspark.sql import functions as F

    position = layout.position(source)
    got = F.substring(F.coalesce(F.get("_fields", position), F.lit("")), 1, _QUOTED_CHARS)
    return F.concat(
        F.lit(f"field {position + 1} ({source}): expected {expected}, got '"), got, F.lit("'")
    )


# ---------------------------------------------------------------- line numbers


@dataclasses.dataclass(frozen=True)
class Block:
    """The lines of one file block: they carry row ids first_row, first_row + 1, ..."""

    file: int
    start: int  # byte offset of the block in the file
    first_row: int
    lines: int
    first_line: int = 0  # 0-based line number of the block's first line in its file


@dataclasses.dataclass(frozen=True)
class LineIndex:
    """Exact line numbers from (file, block, row id), whatever Spark's partitioning."""

    blocks: tuple[Block, ...]

    @classmethod
    def from_blocks(cls, blocks: Sequence[Block]) -> LineIndex:
        numbered = []
        next_line: dict[int, int] = {}
        for block in sorted(blocks, key=lambda b: (b.file, b.start)):
            first = next_line.get(block.file, 0)
            numbered.append(dataclasses.replace(block, first_line=first))
            next_line[block.file] = first + block.lines
        return cls(tuple(numbered))

    def lines_per_file(self, files: int) -> list[int]:
        counts = [0] * files
        for block in self.blocks:
            counts[block.file] += block.lines
        return counts

    def line(self, file: int, start: int, row: int) -> int:
        """0-based line number of row id `row` of block `start` of `file`."""
        for block in self.blocks:
            if block.file == file and block.start == start:
                return block.first_line + row - block.first_row
        raise KeyError((file, start))

    def to_json(self) -> list[list[int]]:
        return [[b.file, b.start, b.first_row, b.lines, b.first_line] for b in self.blocks]

    @classmethod
    def from_json(cls, raw: list[list[int]]) -> LineIndex:
        return cls(tuple(Block(*map(int, entry)) for entry in raw))


def with_line_numbers(spark: SparkSession, rows: DataFrame, index: LineIndex) -> DataFrame:
    """`rows` with `_line`, the 0-based line number in its file (broadcast join)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType, StructField, StructType

    schema = StructType(
        [
            StructField(FILE_COLUMN, LongType()),
            StructField(BLOCK_COLUMN, LongType()),
            StructField("_first_row", LongType()),
            StructField("_first_line", LongType()),
        ]
    )
    table = spark.createDataFrame(
        [(b.file, b.start, b.first_row, b.first_line) for b in index.blocks], schema
    )
    joined = rows.join(F.broadcast(table), [FILE_COLUMN, BLOCK_COLUMN])
    line = F.col("_first_line") + F.col(ROW_COLUMN) - F.col("_first_row")
    return joined.withColumn(LINE_COLUMN, line).drop("_first_row", "_first_line")


def summarize(parsed: DataFrame) -> tuple[LineIndex, list[dict[str, Any]]]:
    """Line index and per-block counts of a parsed input, in one aggregation.

    Returns the index and, per block, {file, lines, positives, header, <reason>...}.
    """
    from pyspark.sql import functions as F

    reason = F.col(REASON_COLUMN)
    counts = [
        F.sum((reason == name).cast("long")).alias(name) for name in (*MALFORMED_REASONS, HEADER)
    ]
    rows = (
        parsed.groupBy(FILE_COLUMN, BLOCK_COLUMN)
        .agg(
            F.min(ROW_COLUMN).alias("first_row"),
            F.count(F.lit(1)).alias("lines"),
            F.sum((reason.isNull() & F.col(LABEL_COLUMN)).cast("long")).alias("positives"),
            *counts,
        )
        .collect()
    )
    index = LineIndex.from_blocks(
        [Block(r[FILE_COLUMN], r[BLOCK_COLUMN], r["first_row"], r["lines"]) for r in rows]
    )
    per_block = []
    for r in rows:
        entry = {"file": int(r[FILE_COLUMN]), "lines": int(r["lines"])}
        entry["positives"] = int(r["positives"] or 0)
        for name in (*MALFORMED_REASONS, HEADER):
            entry[name] = int(r[name] or 0)
        per_block.append(entry)
    return index, per_block


def first_malformed(parsed: DataFrame, index: LineIndex, limit: int) -> list[dict[str, Any]]:
    """Up to `limit` malformed lines in input order: {file, line (1-based), reason, detail}."""
    from pyspark.sql import functions as F

    reason = F.col(REASON_COLUMN)
    rows = (
        parsed.where(reason.isNotNull() & (reason != HEADER))
        .select(FILE_COLUMN, BLOCK_COLUMN, ROW_COLUMN, REASON_COLUMN, DETAIL_COLUMN)
        .orderBy(FILE_COLUMN, BLOCK_COLUMN, ROW_COLUMN)
        .limit(limit)
        .collect()
    )
    return [
        {
            "file": int(r[FILE_COLUMN]),
            "line": index.line(r[FILE_COLUMN], r[BLOCK_COLUMN], r[ROW_COLUMN]) + 1,
            "reason": r[REASON_COLUMN],
            "detail": r[DETAIL_COLUMN],
        }
        for r in rows
    ]
