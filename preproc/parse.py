"""Reading input lines and parsing them into Parquet rows, with exact line numbers.

Lines are read as text by Spark (plain or compressed: Spark decompresses `.gz` by
name) and parsed in its Python workers by `preproc.line_parser`, which says what a
well-formed line is. Every line keeps where it came from: the file index, the start
of the file block Spark read it in and a row id increasing within the block, from
which `LineIndex` gives exact line numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from feature_spec.staged import staged_file
from preproc.config import InputFile
from preproc.layout import InputLayout
from preproc.line_parser import (
    BLOCK_COLUMN,
    BLOCK_SCHEMA,
    COUNTS_SCHEMA,
    FILE_COLUMN,
    HEADER,
    LINE_COLUMN,
    MALFORMED_REASONS,
    ROW_COLUMN,
    ParseTask,
    parse_partition,
    row_schema,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


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


def with_line_numbers(
    spark: SparkSession, rows: DataFrame, index: LineIndex, table_path: Path
) -> DataFrame:
    """`rows` with `_line`, the 0-based line number in its file (broadcast join).

    The index is written to `table_path` (Parquet) for Spark to read in the JVM. A
    DataFrame made from a Python list would start Python workers just to
    re-serialise it (0.7 s of a split stage), and array literals grow slow past a
    few thousand blocks (3x the join's time at 10,000 blocks)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    blocks = index.blocks
    columns = {
        FILE_COLUMN: [b.file for b in blocks],
        BLOCK_COLUMN: [b.start for b in blocks],
        "_first_row": [b.first_row for b in blocks],
        "_first_line": [b.first_line for b in blocks],
    }
    arrays = pa.table({name: pa.array(values, pa.int64()) for name, values in columns.items()})
    with staged_file(table_path) as staging:
        pq.write_table(arrays, staging)
    table = spark.read.schema(from_arrow_schema(arrays.schema)).parquet(str(table_path))
    joined = rows.join(F.broadcast(table), [FILE_COLUMN, BLOCK_COLUMN])
    line = F.col("_first_line") + F.col(ROW_COLUMN) - F.col("_first_row")
    return joined.withColumn(LINE_COLUMN, line).drop("_first_row", "_first_line")


@dataclasses.dataclass(frozen=True)
class Parsed:
    """What the parse job found.

    Attributes:
        index: the line index of every block read.
        blocks: per block, {file, lines, positives, header, <reason>...}.
        examples: up to the limit, the first malformed lines in input order:
            {file (index), line (1-based), reason, detail}.
    """

    index: LineIndex
    blocks: list[dict[str, int]]
    examples: list[dict[str, Any]]


def parse_to_parquet(
    spark: SparkSession,
    files: Sequence[InputFile],
    layout: InputLayout,
    output: Path,
    counts: Path,
    examples: int,
) -> Parsed:
    """Parses every line of `files` in one Spark job: writes the well-formed rows as
    Parquet files into `output` (columns: `line_parser.row_schema`) and their value
    counts into `counts` (`line_parser.COUNTS_SCHEMA`)."""
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import from_arrow_schema

    output.mkdir(parents=True, exist_ok=True)
    counts.mkdir(parents=True, exist_ok=True)
    task = ParseTask(
        layout=layout, output_dir=str(output), counts_dir=str(counts), examples=examples
    )
    job = read_lines(spark, files).mapInArrow(
        functools.partial(parse_partition, task), from_arrow_schema(BLOCK_SCHEMA)
    )
    rows = [row.asDict() for row in job.collect()]
    if not any(output.glob("part-*.parquet")):  # no lines at all: empty tables
        pq.write_table(row_schema(layout).empty_table(), output / "part-empty.parquet")
        pq.write_table(COUNTS_SCHEMA.empty_table(), counts / "part-empty.parquet")
    index = LineIndex.from_blocks(
        [Block(r["file"], r["block"], r["first_row"], r["lines"]) for r in rows]
    )
    blocks = [
        {
            "file": r["file"],
            "lines": r["lines"],
            "positives": r["positives"],
            **{name: r[name] for name in (*MALFORMED_REASONS, HEADER)},
        }
        for r in rows
    ]
    found = [
        {
            "file": r["file"],
            "line": index.line(r["file"], r["block"], row) + 1,
            "reason": reason,
            "detail": detail,
        }
        for r in rows
        for row, reason, detail in json.loads(r["examples"])
    ]
    found.sort(key=lambda e: (e["file"], e["line"]))
    return Parsed(index, blocks, found[:examples])
