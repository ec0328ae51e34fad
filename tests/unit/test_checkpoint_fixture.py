"""A checkpoint written by older code (tests/data/checkpoint_v1, format 1, 2 ranks,
Adam) restores bit for bit: onto one process, and resharded onto other layouts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dlrm.checkpoint.format import MANIFEST
from dlrm.checkpoint.reader import Checkpoint
from dlrm.embedding.shard import Range
from tests.data import make_checkpoint_fixture as fixture

FIXTURE = Path(__file__).parents[1] / "data" / "checkpoint_v1"


def same_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal dtype, shape and bytes (so -0.0 and subnormals count)."""
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape)
    assert actual.tobytes() == expected.tobytes()


@pytest.fixture(name="checkpoint")
def open_fixture() -> Checkpoint:
    return Checkpoint(FIXTURE)


def test_the_fixture_is_format_1_as_written(checkpoint: Checkpoint) -> None:
    assert checkpoint.manifest["format_version"] == 1
    assert checkpoint.path.name == f"step_{fixture.STEP:09d}"
    assert checkpoint.step == fixture.STEP
    # Format 1 lists the shards twice: in the plan and under the tables.
    assert all("shards" in table for table in checkpoint.manifest["plan"]["tables"])
    checkpoint.verify()


def test_restores_onto_one_process_bit_for_bit(checkpoint: Checkpoint) -> None:
    for table, shape in enumerate(fixture.SHAPES):
        assert checkpoint.table_shape(table) == shape
        for slot in (None, *fixture.SLOTS):
            whole = checkpoint.read_table_slice(table, (0, shape[0]), (0, shape[1]), slot)
            same_bits(whole, fixture.table_values(table, slot))
    dense = fixture.dense_values()
    assert sorted(checkpoint.dense()) == sorted(dense)
    for name, expected in dense.items():
        same_bits(checkpoint.dense_array(name, expected.shape), expected)


def split(size: int, parts: int) -> list[Range]:
    """[0, size) in `parts` ranges of near-equal length."""
    return [(int(p[0]), int(p[-1]) + 1) for p in np.array_split(np.arange(size), parts)]


def layouts(shape: tuple[int, int], ranks: int) -> dict[str, list[tuple[Range, Range]]]:
    """The slices `ranks` ranks would hold of a table, split by rows or by columns."""
    rows, columns = shape
    return {
        "rows": [(r, (0, columns)) for r in split(rows, ranks)],
        "columns": [((0, rows), c) for c in split(columns, min(ranks, columns))],
    }


def restore(
    checkpoint: Checkpoint,
    table: int,
    rows: Range,
    columns: Range,
    slot: str | None,
    block_bytes: int,
) -> np.ndarray:
    """The slice as a rank restores it: streamed into its own array, block by block."""
    target = np.full((rows[1] - rows[0], columns[1] - columns[0]), np.nan, np.float32)

    def assign(offset: int, block: np.ndarray) -> None:
        target[offset : offset + len(block)] = block

    checkpoint.restore_table_slice(table, rows, columns, assign, slot, block_bytes)
    return target


@pytest.mark.parametrize("ranks", [1, 3, 4])
@pytest.mark.parametrize("kind", ["rows", "columns"])
@pytest.mark.parametrize("block_bytes", [1, 84, 1 << 20])  # 84: rows cross shard edges
def test_restores_resharded_bit_for_bit(
    checkpoint: Checkpoint, ranks: int, kind: str, block_bytes: int
) -> None:
    for table, shape in enumerate(fixture.SHAPES):
        for slot in (None, *fixture.SLOTS):
            expected = fixture.table_values(table, slot)
            for rows, columns in layouts(shape, ranks)[kind]:
                restored = restore(checkpoint, table, rows, columns, slot, block_bytes)
                same_bits(restored, expected[rows[0] : rows[1], columns[0] : columns[1]])


def test_the_plan_it_stored_reads_back(checkpoint: Checkpoint) -> None:
    assert checkpoint.plan == fixture.plan()
    shards = [s.shard for table in checkpoint.tables.values() for s in table.shards]
    written = [s for s in fixture.table_shards() if s.kind.is_model_parallel or s.rank == 0]
    assert sorted(shards, key=str) == sorted(written, key=str)


def test_the_script_now_writes_the_current_format(tmp_path: Path) -> None:
    path = fixture.write(tmp_path)
    checkpoint = Checkpoint(path)
    assert checkpoint.manifest["format_version"] == 2
    assert checkpoint.plan == fixture.plan()
    for table, shape in enumerate(fixture.SHAPES):
        for slot in (None, *fixture.SLOTS):
            whole = checkpoint.read_table_slice(table, (0, shape[0]), (0, shape[1]), slot)
            same_bits(whole, fixture.table_values(table, slot))
    # The shards and slot files are the same bytes in both formats.
    old = json.loads((FIXTURE / f"step_{fixture.STEP:09d}" / MANIFEST).read_text())
    new = json.loads((path / MANIFEST).read_text())
    shard_files = {name for name in old["files"] if name.startswith("embeddings/")}
    assert {name: new["files"][name] for name in shard_files} == {
        name: old["files"][name] for name in shard_files
    }
