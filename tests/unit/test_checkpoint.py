"""Checkpoint files: round trip, assembling slices from shards, streaming restores,
lazy verification, atomicity, corruption."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dlrm.checkpoint.reader as reader_module
from dlrm.checkpoint.format import MANIFEST, CheckpointError, list_checkpoints, resolve_checkpoint
from dlrm.checkpoint.reader import Checkpoint
from dlrm.checkpoint.writer import CheckpointWriter
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import TableSpec
from dlrm.embedding.shard import Range, ShardingKind, TableShard
from harness.placements import table_plan

TABLE = np.arange(23 * 7, dtype=np.float32).reshape(23, 7)
Layout = list[tuple[Range, Range]]

# Shard layouts of TABLE, each a list of disjoint rectangles that cover it.
LAYOUTS: dict[str, Layout] = {
    "whole": [((0, 23), (0, 7))],
    "rows": [((0, 8), (0, 7)), ((8, 9), (0, 7)), ((9, 23), (0, 7))],
    "columns": [((0, 23), (0, 3)), ((0, 23), (3, 4)), ((0, 23), (4, 7))],
    "mixed": [((0, 10), (0, 7)), ((10, 23), (0, 3)), ((10, 23), (3, 7))],
}


def table_shard(rows: Range, columns: Range, rank: int = 0) -> TableShard:
    if rows == (0, 23) and columns == (0, 7):
        kind = ShardingKind.TABLE_WISE
    elif rows == (0, 23):
        kind = ShardingKind.COLUMN_WISE
    else:
        kind = ShardingKind.ROW_WISE
    return TableShard(0, kind, rank, rows, columns)


def write(root: Path, step: int, shards: Layout, keep: int = 0) -> Path:
    writer = CheckpointWriter(root, step)
    writer.add_dense({"w": np.full((2, 3), step, np.float32), "trainer/step": np.asarray(step)})
    for rank, (rows, columns) in enumerate(shards):
        part = TABLE[rows[0] : rows[1], columns[0] : columns[1]]
        writer.add_table_shard(
            table_shard(rows, columns, rank), TABLE.shape, part + step, {"m": -part}
        )
    return writer.commit({"model": {"embedding_dim": 7}}, keep=keep)


def restore_in_blocks(
    checkpoint: Checkpoint, rows: Range, columns: Range, block_bytes: int, slot: str | None = None
) -> list[tuple[int, np.ndarray]]:
    calls: list[tuple[int, np.ndarray]] = []
    checkpoint.restore_table_slice(
        0, rows, columns, lambda offset, block: calls.append((offset, block)), slot, block_bytes
    )
    return calls


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_round_trip_whole_table(tmp_path: Path) -> None:
    path = write(tmp_path, 5, LAYOUTS["whole"])
    checkpoint = Checkpoint(path)
    assert checkpoint.step == 5
    np.testing.assert_array_equal(checkpoint.dense_array("w", (2, 3)), np.full((2, 3), 5))
    np.testing.assert_array_equal(checkpoint.read_table_slice(0, (0, 23), (0, 7)), TABLE + 5)
    np.testing.assert_array_equal(
        checkpoint.read_table_slice(0, (4, 9), (2, 5), "m"), -TABLE[4:9, 2:5]
    )
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["files"]["dense.npz"]["sha256"]
    assert not list(tmp_path.glob(".*partial"))


def test_shard_entries_carry_kind_and_rank(tmp_path: Path) -> None:
    # Two ranks write one column shard each into the staging directory rank 0 made.
    shards = list(table_plan(0, TableSpec(23, 7), "column_wise", 2).shards)  # (0, 3), (3, 7)
    writers = [CheckpointWriter(tmp_path, 4), CheckpointWriter(tmp_path, 4, create=False)]
    for writer, shard in zip(writers, shards, strict=True):
        part = TABLE[:, shard.columns[0] : shard.columns[1]]
        writer.add_table_shard(shard, TABLE.shape, part, {"m": -part})
    path = writers[0].commit({}, gathered=[writer.contents() for writer in writers])

    entries = json.loads((path / MANIFEST).read_text())["tables"][0]["shards"]
    assert entries == [
        {
            **shard.to_dict(),
            "file": f"embeddings/{shard.name}.npy",
            "slots": {"m": f"embeddings/{shard.name}.m.npy"},
        }
        for shard in shards
    ]
    assert entries[1]["file"] == "embeddings/table_0.rows_0_23.cols_3_7.npy"  # as before
    assert [TableShard.from_dict(entry) for entry in entries] == shards
    checkpoint = Checkpoint(path)
    np.testing.assert_array_equal(checkpoint.read_table_slice(0, (0, 23), (0, 7)), TABLE)
    np.testing.assert_array_equal(checkpoint.read_table_slice(0, (3, 5), (0, 7), "m"), -TABLE[3:5])


def test_manifest_without_kind_and_rank_still_reads(tmp_path: Path) -> None:
    # Shard entries as checkpoints written before shards carried table, kind and rank
    # (format 1, whose plan, here absent, was the only other change in format 2).
    path = write(tmp_path, 2, LAYOUTS["mixed"])
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["format_version"] = 1
    for shard in manifest["tables"][0]["shards"]:
        for key in ("table", "kind", "rank"):
            del shard[key]
        assert set(shard) == {"rows", "columns", "file", "slots"}
    (path / MANIFEST).write_text(json.dumps(manifest))
    checkpoint = Checkpoint(path)
    checkpoint.verify()
    np.testing.assert_array_equal(checkpoint.read_table_slice(0, (0, 23), (0, 7)), TABLE + 2)
    np.testing.assert_array_equal(
        checkpoint.read_table_slice(0, (8, 15), (2, 6), "m"), -TABLE[8:15, 2:6]
    )


def test_slices_assembled_across_row_and_column_shards(tmp_path: Path) -> None:
    checkpoint = Checkpoint(write(tmp_path, 1, LAYOUTS["mixed"]))
    np.testing.assert_array_equal(checkpoint.read_table_slice(0, (0, 23), (0, 7)), TABLE + 1)
    np.testing.assert_array_equal(
        checkpoint.read_table_slice(0, (8, 15), (2, 6)), TABLE[8:15, 2:6] + 1
    )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(
    ("rows", "columns"),
    [
        ((0, 23), (0, 7)),  # the whole table
        ((0, 8), (0, 7)),  # a row-wise shard of 3 ranks
        ((16, 23), (0, 7)),
        ((0, 23), (4, 7)),  # a column-wise shard
        ((7, 12), (2, 5)),  # crosses every shard boundary
        ((22, 23), (6, 7)),  # one element
    ],
)
@pytest.mark.parametrize("block_bytes", [1, 20, 60, 1 << 20])
def test_restore_in_chunks_equals_a_whole_read(
    tmp_path: Path, layout: str, rows: Range, columns: Range, block_bytes: int
) -> None:
    checkpoint = Checkpoint(write(tmp_path, 3, LAYOUTS[layout]))
    width = columns[1] - columns[0]
    for slot, expected in [(None, TABLE + 3), ("m", -TABLE)]:
        calls = restore_in_blocks(checkpoint, rows, columns, block_bytes, slot)
        offsets = [offset for offset, _ in calls]
        assert offsets == list(np.cumsum([0] + [len(block) for _, block in calls[:-1]]))
        for _, block in calls:
            assert block.dtype == np.float32 and block.shape[1] == width
            assert block.nbytes <= max(block_bytes, width * 4)  # at least one row
        restored = np.concatenate([block for _, block in calls])
        np.testing.assert_array_equal(
            restored, expected[rows[0] : rows[1], columns[0] : columns[1]]
        )
        np.testing.assert_array_equal(restored, checkpoint.read_table_slice(0, rows, columns, slot))
    if block_bytes == 1:
        assert len(calls) == rows[1] - rows[0]


def test_chunks_are_sized_by_the_widest_shard_read(tmp_path: Path) -> None:
    # One column of a 7-wide shard: the read buffer is 7 wide, so blocks have
    # block_bytes // 28 rows, not block_bytes // 4.
    checkpoint = Checkpoint(write(tmp_path, 1, LAYOUTS["whole"]))
    calls = restore_in_blocks(checkpoint, (0, 23), (2, 3), block_bytes=56)
    assert [len(block) for _, block in calls] == [2] * 11 + [1]


def test_uncovered_slice_is_an_error(tmp_path: Path) -> None:
    checkpoint = Checkpoint(write(tmp_path, 1, [((0, 10), (0, 7)), ((10, 23), (0, 3))]))
    with pytest.raises(CheckpointError, match=r"table 0 do not cover rows \[5, 12\]"):
        checkpoint.read_table_slice(0, (5, 12), (0, 7))
    calls: list[int] = []
    with pytest.raises(CheckpointError, match=r"do not cover rows \[0, 23\] x columns \[2, 5\]"):
        checkpoint.restore_table_slice(0, (0, 23), (2, 5), lambda offset, _: calls.append(offset))
    assert calls == []  # nothing assigned before the error
    np.testing.assert_array_equal(
        checkpoint.read_table_slice(0, (5, 23), (0, 3)), TABLE[5:, :3] + 1
    )


def test_restore_verifies_only_the_files_it_reads(tmp_path: Path) -> None:
    path = write(tmp_path, 1, LAYOUTS["rows"])
    untouched = path / "embeddings" / "table_0.rows_9_23.cols_0_7.npy"
    flip_last_byte(untouched)
    checkpoint = Checkpoint(path)  # the manifest only
    assert checkpoint.verified_files == frozenset()
    np.testing.assert_array_equal(checkpoint.read_table_slice(0, (0, 9), (0, 7)), TABLE[:9] + 1)
    assert checkpoint.verified_files == {
        "embeddings/table_0.rows_0_8.cols_0_7.npy",
        "embeddings/table_0.rows_8_9.cols_0_7.npy",
    }
    np.testing.assert_array_equal(checkpoint.dense_array("w"), np.ones((2, 3)))
    assert "dense.npz" in checkpoint.verified_files

    calls: list[int] = []
    with pytest.raises(CheckpointError, match="corrupted: sha256") as error:
        checkpoint.restore_table_slice(0, (5, 12), (0, 7), lambda offset, _: calls.append(offset))
    assert str(untouched) in str(error.value)
    assert calls == []  # verified before any data is used
    with pytest.raises(CheckpointError, match=str(untouched)):
        Checkpoint(path).verify()


def test_each_file_is_hashed_once_per_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = Checkpoint(write(tmp_path, 1, LAYOUTS["columns"]))
    hashed: list[str] = []
    original = reader_module.sha256_of_file

    def counting(path: Path) -> str:
        hashed.append(path.name)
        return original(path)

    monkeypatch.setattr(reader_module, "sha256_of_file", counting)
    for rows in [(0, 5), (5, 23), (0, 23)]:
        checkpoint.read_table_slice(0, rows, (0, 4))
    assert sorted(hashed) == ["table_0.rows_0_23.cols_0_3.npy", "table_0.rows_0_23.cols_3_4.npy"]


def test_unverified_reads_skip_the_checksums(tmp_path: Path) -> None:
    path = write(tmp_path, 1, LAYOUTS["whole"])
    flip_last_byte(path / "embeddings" / "table_0.rows_0_23.cols_0_7.npy")
    checkpoint = Checkpoint(path, verify=False)
    assert checkpoint.read_table_slice(0, (0, 1), (0, 7)).shape == (1, 7)
    assert checkpoint.verified_files == frozenset()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corruption_names_the_file_and_the_previous_checkpoint(tmp_path: Path, damage: str) -> None:
    previous = write(tmp_path, 10, LAYOUTS["whole"])
    latest = write(tmp_path, 20, LAYOUTS["whole"])
    victim = next((latest / "embeddings").glob("*.m.npy"))
    if damage == "flip":
        flip_last_byte(victim)
        expected = "corrupted: sha256"
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-8])
        expected = "truncated or corrupted"
    else:
        victim.unlink()
        expected = "missing"
    checkpoint = Checkpoint(tmp_path)  # resolves to the newest: the damaged one
    np.testing.assert_array_equal(checkpoint.read_table_slice(0, (0, 23), (0, 7)), TABLE + 20)
    for read in [checkpoint.verify, lambda: checkpoint.read_table_slice(0, (0, 1), (0, 7), "m")]:
        with pytest.raises(CheckpointError) as error:
            read()
        message = str(error.value)
        assert str(victim) in message and expected in message
        assert str(previous) in message
    Checkpoint(previous).verify()  # still usable


def test_corrupted_dense_file_fails_when_read(tmp_path: Path) -> None:
    path = write(tmp_path, 1, LAYOUTS["whole"])
    flip_last_byte(path / "dense.npz")
    checkpoint = Checkpoint(path)
    with pytest.raises(CheckpointError, match=r"dense.npz: corrupted: sha256"):
        checkpoint.dense_array("w")


def test_writer_refuses_a_shard_outside_the_table_or_of_another_shape(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"outside table 0 of shape \[23, 7\]"):
        writer.add_table_shard(table_shard((20, 30), (0, 7)), (23, 7), np.zeros((10, 7)), {})
    with pytest.raises(CheckpointError, match=r"values has shape \(3, 7\), expected \(2, 7\)"):
        writer.add_table_shard(table_shard((0, 2), (0, 7)), (23, 7), np.zeros((3, 7)), {})


def test_newest_is_resolved_and_old_ones_pruned(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        write(tmp_path, step, LAYOUTS["whole"], keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000000020", "step_000000030"]
    assert resolve_checkpoint(tmp_path).name == "step_000000030"


def test_unreadable_manifest(tmp_path: Path) -> None:
    path = write(tmp_path, 3, LAYOUTS["whole"])
    (path / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest.json: unreadable manifest"):
        Checkpoint(path)


def test_interrupted_write_is_invisible(tmp_path: Path) -> None:
    write(tmp_path, 1, LAYOUTS["whole"])
    writer = CheckpointWriter(tmp_path, 2)
    writer.add_dense({"w": np.zeros(3, np.float32)})
    # No commit: the crash case. Nothing new looks like a checkpoint.
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000000001"]
    assert Checkpoint(tmp_path).step == 1


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        Checkpoint(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="not a checkpoint; expected a directory with"):
        Checkpoint(tmp_path)


def two_rank_plan(kind: ShardingKind) -> ShardingPlan:
    """TABLE on 2 ranks as `kind`, and a replicated [5, 3] table 1."""
    tables = (
        table_plan(0, TableSpec(23, 7), kind, 2),
        table_plan(1, TableSpec(5, 3), "data_parallel", 2),
    )
    return ShardingPlan(2, "cost", tables)


def write_plan(root: Path, plan: ShardingPlan, skip: TableShard | None = None) -> Path:
    """What `save_training_state` writes for `plan`: every rank its own shards, rank 0
    the one copy of a replicated table (and `skip` left out)."""
    writers = [CheckpointWriter(root, 6), CheckpointWriter(root, 6, create=False)]
    for shard in plan.shards:
        if (shard.kind == ShardingKind.DATA_PARALLEL and shard.rank) or shard == skip:
            continue
        values = np.arange(shard.elements, dtype=np.float32).reshape(shard.height, shard.width)
        shape = (plan.tables[shard.table].spec.rows, plan.tables[shard.table].spec.dim)
        writers[shard.rank].add_table_shard(shard, shape, values + shard.table, {"m": -values})
    gathered = [writer.contents() for writer in writers]
    return writers[0].commit({"plan": plan.to_dict()}, gathered=gathered)


@pytest.mark.parametrize("kind", [ShardingKind.COLUMN_WISE, ShardingKind.ROW_WISE])
def test_the_manifest_lists_each_shard_once(tmp_path: Path, kind: ShardingKind) -> None:
    plan = two_rank_plan(kind)
    path = write_plan(tmp_path, plan)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format_version"] == 2
    assert manifest["plan"] == plan.to_dict(with_shards=False)
    assert all("shards" not in table for table in manifest["plan"]["tables"])
    listed = [TableShard.from_dict(s) for table in manifest["tables"] for s in table["shards"]]
    assert listed == [*plan.tables[0].shards, plan.tables[1].shards[0]]  # rank 0's copy
    checkpoint = Checkpoint(path)
    assert checkpoint.plan == plan  # the replicated table on every rank again
    assert [s.shard for s in checkpoint.tables[0].shards] == list(plan.tables[0].shards)
    np.testing.assert_array_equal(
        checkpoint.read_table_slice(1, (0, 5), (2, 3), "m")[:, 0], -2 - 3 * np.arange(5)
    )


def test_a_checkpoint_without_a_plan_has_none(tmp_path: Path) -> None:
    assert Checkpoint(write(tmp_path, 1, LAYOUTS["whole"])).plan is None


def test_shards_that_are_not_the_plans_are_not_published(tmp_path: Path) -> None:
    plan = two_rank_plan(ShardingKind.COLUMN_WISE)
    with pytest.raises(CheckpointError) as error:
        write_plan(tmp_path, plan, skip=plan.tables[0].shards[1])
    message = str(error.value)
    assert "table 0: the plan needs shards" in message
    assert "table_0.rows_0_23.cols_3_7 (column_wise, rank 1)" in message  # expected
    assert message.endswith("the ranks wrote ['table_0.rows_0_23.cols_0_3 (column_wise, rank 0)']")
    assert list_checkpoints(tmp_path) == []


def test_overlapping_shards_are_not_published(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, 1)
    for rows in [(0, 12), (10, 23)]:
        part = TABLE[rows[0] : rows[1]]
        writer.add_table_shard(table_shard(rows, (0, 7)), TABLE.shape, part, {})
    with pytest.raises(CheckpointError, match=r"table 0 has overlapping shards rows \[10, 23\]"):
        writer.commit({})
    assert list_checkpoints(tmp_path) == []


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(format_version=4), r"format_version 4, this tool reads 1, 2 and 3"),
        (lambda m: m["tables"].append(m["tables"][0]), r"table 0 is listed twice"),
        (
            lambda m: m["tables"][0]["shards"][0].update(table=1),
            r"table 0 lists table_1.rows_0_8.cols_0_7, a shard of table 1",
        ),
        (
            lambda m: m["tables"][0]["shards"][2].update(rows=[9, 24]),
            r"table 0 of shape \[23, 7\] has a shard rows \[9, 24\] x columns \[0, 7\] outside it",
        ),
        (
            lambda m: m["tables"][0]["shards"][1].update(rows=[7, 9]),
            r"table 0 has overlapping shards rows \[7, 9\]",
        ),
        # Format 2's shard entries are whole table shards: only format 1's oldest may
        # lack table, kind and rank.
        (
            lambda m: m["tables"][0]["shards"][1].pop("kind"),
            r"malformed table entry .*KeyError\('kind'\)",
        ),
    ],
)
def test_manifests_that_do_not_describe_their_shards_are_refused(
    tmp_path: Path, edit: Callable[[dict[str, Any]], object], message: str
) -> None:
    path = write(tmp_path, 2, LAYOUTS["rows"])
    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"{path / MANIFEST}: .*{message}"):
        Checkpoint(path)


def test_uncovered_slices_name_the_shortfall(tmp_path: Path) -> None:
    checkpoint = Checkpoint(write(tmp_path, 1, [((0, 10), (0, 7)), ((10, 23), (0, 3))]))
    with pytest.raises(CheckpointError, match=r"\[0, 7\]: they hold 44 of its 56 elements"):
        checkpoint.read_table_slice(0, (5, 13), (0, 7))
    with pytest.raises(CheckpointError, match=r"rows \[20, 30\] .* they hold 9 of its 30"):
        checkpoint.read_table_slice(0, (20, 30), (0, 3))  # beyond the table
