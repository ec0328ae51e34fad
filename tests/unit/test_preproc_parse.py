"""The line parser of the Spark workers (`preproc.line_parser`), without Spark: the
columns it writes, the reason and message of every rejected line, and its column
checks against a line-by-line reading of the documented rules."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from preproc.layout import (
    CategoricalColumn,
    CategoricalKind,
    InputLayout,
    NumericalColumn,
    NumericalKind,
    criteo_layout,
)
from preproc.line_parser import BLOCK_SCHEMA, ParseTask, parse_partition, row_schema

# A layout with every kind: floats, a hex value, a token, an id, and lists of tokens
# and ids; the label in the middle, a two-character delimiter.
LAYOUT = InputLayout(
    delimiter="::",
    fields=("price", "label", "color", "ad", "slot", "tags", "slots"),
    label_source="label",
    label_name="clicked",
    numerical=(NumericalColumn("price", "price"),),
    numerical_kind=NumericalKind.FLOAT,
    categorical=(
        CategoricalColumn("color", "color", CategoricalKind.HEX),
        CategoricalColumn("ad", "ad", CategoricalKind.TOKEN),
        CategoricalColumn("slot", "slot", CategoricalKind.ID, cardinality=9),
        CategoricalColumn("tags", "tags", CategoricalKind.TOKEN, variable_length=True),
        CategoricalColumn(
            "slots", "slots", CategoricalKind.ID, cardinality=5, variable_length=True
        ),
    ),
    list_delimiter="|",
)


REASONS = ("header", "field_count", "label", "numerical", "categorical")


def input_table(
    lines: list[str], files: list[int], blocks: list[int], rows: Iterable[int]
) -> pa.Table:
    """The lines of a task's input, as Spark hands them to the parser."""
    return pa.table(
        {
            "_file": pa.array(files, pa.int32()),
            "_block": pa.array(blocks, pa.int64()),
            "_row": pa.array(rows, pa.int64()),
            "value": pa.array(lines, pa.string()),
        }
    )


def task_directories(tmp_path: Path) -> tuple[Path, Path]:
    """The directories a task writes its rows and its value counts to."""
    out, counts = tmp_path / "rows", tmp_path / "counts"
    out.mkdir(exist_ok=True)
    counts.mkdir(exist_ok=True)
    return out, counts


def run_task(
    tmp_path: Path, layout: InputLayout, lines: list[str], batch_rows: int = 3, examples: int = 20
) -> tuple[pa.Table, list[dict[str, Any]]]:
    """Parses `lines` (file 0, block 0, row ids 100...) as one task; returns the
    Parquet rows it wrote and its block rows."""
    out, counts = task_directories(tmp_path)
    zeros = [0] * len(lines)
    table = input_table(lines, zeros, zeros, range(100, 100 + len(lines)))
    task = ParseTask(layout, str(out), str(counts), examples)
    blocks = list(parse_partition(task, table.to_batches(max_chunksize=batch_rows)))
    written = list(out.iterdir())
    assert len(written) == 1 and written[0].name.startswith("part-"), written
    rows = pq.read_table(written[0])
    assert rows.schema == row_schema(layout)
    block_rows = [row for batch in blocks for row in batch.to_pylist()]
    assert all(batch.schema == BLOCK_SCHEMA for batch in blocks)
    return rows, block_rows


def test_well_formed_lines_become_typed_columns(tmp_path: Path) -> None:
    lines = [
        "2.5::1::0aF::ad-1::3::a|b::1|4",
        "::0::::::::::",  # every value missing: nulls, empty lists
        "-1e3::1::ff::x::8::|c:d::|2",  # list with an empty element: null
        ".5::0",  # trailing fields cut off: missing
    ]
    rows, blocks = run_task(tmp_path, LAYOUT, lines)
    assert rows.column("_row").to_pylist() == [100, 101, 102, 103]
    assert rows.column("_label").to_pylist() == [True, False, True, False]
    assert rows.column("_num0").to_pylist() == [2.5, None, -1000.0, 0.5]
    assert rows.column("_cat0").to_pylist() == ["0aF", None, "ff", None]
    assert rows.column("_cat1").to_pylist() == ["ad-1", None, "x", None]
    assert rows.column("_cat2").to_pylist() == [3, None, 8, None]
    assert rows.column("_cat3").to_pylist() == [["a", "b"], [], [None, "c:d"], []]
    assert rows.column("_cat4").to_pylist() == [[1, 4], [], [None, 2], []]
    expected = {"file": 0, "block": 0, "first_row": 100, "lines": 4, "positives": 2}
    assert blocks == [{**expected, **dict.fromkeys(REASONS, 0), "examples": "[]"}]


REJECTED = [
    ("price::label::color::ad::slot::tags::slots", "header", ""),
    (
        "1::1::a::b::1::t::1::extra",
        "field_count",
        "expected at most 7 fields separated by '::', got 8",
    ),
    ("1::yes::a", "label", "field 2 (label): expected 0 or 1, got 'yes'"),
    ("", "label", "field 2 (label): expected 0 or 1, got ''"),
    ("2.5.1::0::zz", "numerical", "field 1 (price): expected a number, got '2.5.1'"),
    (
        "1::0::123456789",
        "categorical",
        "field 3 (color): expected 1 to 8 hex digits, got '123456789'",
    ),
    ("1::0::a::b::9", "categorical", "field 5 (slot): expected an integer id in [0, 9), got '9'"),
    ("1::0::a::b::-1", "categorical", "field 5 (slot): expected an integer id in [0, 9), got '-1'"),
    (
        "1::0::a::b::1::t::1||7|x",
        "categorical",
        "field 7 (slots), list element 3: expected an integer id in [0, 5), got '7'",
    ),
    (   # a long value is quoted up to 40 characters
        "1::0::g" + "f" * 50,
        "categorical",
        "field 3 (color): expected 1 to 8 hex digits, got 'g" + "f" * 39 + "'",
    ),
]  # fmt: skip


def test_every_rejected_line_gets_its_reason_and_message(tmp_path: Path) -> None:
    good = "1::1::a::b::1::t::1"
    lines = [good] + [line for line, _, _ in REJECTED] + [good]
    rows, blocks = run_task(tmp_path, LAYOUT, lines, batch_rows=4)
    assert rows.column("_row").to_pylist() == [100, 100 + len(lines) - 1]
    (block,) = blocks
    expected_counts = dict.fromkeys(REASONS, 0)
    for _, reason, _ in REJECTED:
        expected_counts[reason] += 1
    assert {k: block[k] for k in expected_counts} == expected_counts
    assert block["lines"] == len(lines) and block["positives"] == 2
    examples = json.loads(block["examples"])
    # Headers are counted, never given as examples; the rest in line order.
    assert examples == [
        [101 + i, reason, detail]
        for i, (_, reason, detail) in enumerate(REJECTED)
        if reason != "header"
    ]


def test_examples_are_limited_per_block_and_blocks_counted_apart(tmp_path: Path) -> None:
    out, counts = task_directories(tmp_path)
    bad = "x\t0"
    lines = [bad, bad, bad, bad, "1", bad]
    table = input_table(lines, [0, 0, 0, 1, 1, 1], [0, 0, 0, 64, 64, 64], [7, 8, 9, 3, 4, 5])
    task = ParseTask(criteo_layout(), str(out), str(counts), examples=2)
    (batch,) = parse_partition(task, table.to_batches(max_chunksize=4))
    first, second = batch.to_pylist()
    assert (first["file"], first["block"], first["first_row"], first["lines"]) == (0, 0, 7, 3)
    assert (second["file"], second["block"], second["first_row"], second["lines"]) == (1, 64, 3, 3)
    assert first["label"] == 3 and second["label"] == 2
    assert [e[0] for e in json.loads(first["examples"])] == [7, 8]
    assert [e[0] for e in json.loads(second["examples"])] == [3, 5]
    assert pq.read_table(next(out.iterdir())).column("_row").to_pylist() == [4]


def test_a_task_without_lines_writes_an_empty_table(tmp_path: Path) -> None:
    out, counts = task_directories(tmp_path)
    task = ParseTask(LAYOUT, str(out), str(counts), examples=5)
    assert list(parse_partition(task, [])) == []
    (written,) = out.iterdir()
    assert pq.read_table(written).num_rows == 0


def test_a_failed_task_leaves_no_file(tmp_path: Path) -> None:
    out, counts = task_directories(tmp_path)

    def batches() -> Any:
        yield from input_table(["1"], [0], [0], [0]).to_batches()
        raise OSError("the executor lost its input")

    task = ParseTask(criteo_layout(), str(out), str(counts), examples=5)
    with pytest.raises(OSError, match="lost its input"):
        list(parse_partition(task, batches()))
    assert list(out.iterdir()) == []


# ---------------------------------------------------- against the rules, line by line

HEX = re.compile(r"[0-9a-fA-F]{1,8}")
FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,3})?")
ID = re.compile(r"[0-9]{1,10}")


def well_formed(line: str) -> bool:
    """LAYOUT's rules, written out for this test."""
    fields = line.split("::")
    if len(fields) > 7:
        return False
    price, label, color, _ad, slot, _tags, slots = fields + [""] * (7 - len(fields))
    if label not in ("0", "1") or (price and not FLOAT.fullmatch(price)):
        return False
    if color and not HEX.fullmatch(color):
        return False
    if slot and not (ID.fullmatch(slot) and int(slot) < 9):
        return False
    elements = slots.split("|") if slots else []
    return all(not e or (ID.fullmatch(e) and int(e) < 5) for e in elements)


def test_the_column_checks_agree_with_the_rules_on_random_lines(tmp_path: Path) -> None:
    rng = random.Random(11)
    # Per field: well-formed values, then malformed ones.
    pieces = {
        "price": (
            ["", "1", "-2.5", ".5", "5.", "1e3", "1e1234", "+.5e-2"],
            ["x", "1..2", "-", "e5"],
        ),
        "label": (["0", "1"], ["", "2", "01", " 1"]),
        "color": (["", "a", "0aF", "12345678"], ["123456789", "g", "A-B"]),
        "ad": (["", "ad", "a b", "|", "ä"], []),
        "slot": (["", "0", "8", "00"], ["9", "-1", "1.0", "99999999999"]),
        "tags": (["", "a", "a|b", "|", "||x"], []),
        "slots": (["", "0", "4", "1|2", "1||3", "|"], ["5", "1|x", "4|5"]),
    }
    lines = []
    for _ in range(3000):
        fields = [
            rng.choice(bad if bad and rng.random() < 0.06 else good)
            for good, bad in pieces.values()
        ]
        cut = rng.choice([7, 7, 7, 8, 5, 2, 1])
        lines.append("::".join(fields[:cut] + ["extra"] * (cut == 8)))
    rows, blocks = run_task(tmp_path, LAYOUT, lines, batch_rows=500, examples=3000)
    expected = [100 + i for i, line in enumerate(lines) if well_formed(line)]
    assert 300 < len(expected) < 2700  # both kinds are well represented
    assert rows.column("_row").to_pylist() == expected
    (block,) = blocks
    assert len(json.loads(block["examples"])) + block["header"] == len(lines) - len(expected)


def test_value_counts_per_file_of_the_vocabulary_features(tmp_path: Path) -> None:
    """Summed over the task's batches, per input file; list elements one by one;
    missing values and rejected lines not counted; id features have none."""
    lines = [
        "1::1::a::x::1::t|u|t::1",
        "1::0::a::x",
        "1::0::B::::::|t",
        "1::0::a::x::1::t::9",  # rejected (slots out of range): not counted
        "1::1::a::y::2::u::1",  # file 1 from here
        "1::1::a",
    ]
    out, counts = task_directories(tmp_path)
    table = input_table(lines, [0, 0, 0, 0, 1, 1], [0] * 6, range(6))
    list(parse_partition(ParseTask(LAYOUT, str(out), str(counts), 5), table.to_batches(2)))
    (written,) = counts.iterdir()
    found = {
        (r["_file"], r["_feature"], r["_value"]): r["_count"]
        for r in pq.read_table(written).to_pylist()
    }
    assert found == {
        (0, 0, "a"): 2, (0, 0, "B"): 1, (0, 1, "x"): 2, (0, 3, "t"): 3, (0, 3, "u"): 1,
        (1, 0, "a"): 2, (1, 1, "y"): 1, (1, 3, "u"): 1,
    }  # fmt: skip
