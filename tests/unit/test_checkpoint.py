"""Checkpoint files: round trip, assembling slices from shards, atomicity, corruption."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dlrm.checkpoint import (
    MANIFEST,
    Checkpoint,
    CheckpointError,
    CheckpointWriter,
    list_checkpoints,
    resolve_checkpoint,
)

TABLE = np.arange(23 * 7, dtype=np.float32).reshape(23, 7)


def write(
    root: Path, step: int, shards: list[tuple[tuple[int, int], tuple[int, int]]], keep: int = 0
) -> Path:
    writer = CheckpointWriter(root, step)
    writer.add_dense({"w": np.full((2, 3), step, np.float32), "trainer/step": np.asarray(step)})
    for rows, columns in shards:
        part = TABLE[rows[0] : rows[1], columns[0] : columns[1]]
        writer.add_table_shard(0, TABLE.shape, rows, columns, part + step, {"m": -part})
    return writer.commit({"model": {"embedding_dim": 7}}, keep=keep)


def test_round_trip_whole_table(tmp_path: Path) -> None:
    path = write(tmp_path, 5, [((0, 23), (0, 7))])
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


def test_slices_assembled_across_row_and_column_shards(tmp_path: Path) -> None:
    # Rows split 0-10 / 10-23, and the second row range split again by columns.
    shards = [((0, 10), (0, 7)), ((10, 23), (0, 3)), ((10, 23), (3, 7))]
    checkpoint = Checkpoint(write(tmp_path, 1, shards))
    np.testing.assert_array_equal(checkpoint.read_table_slice(0, (0, 23), (0, 7)), TABLE + 1)
    np.testing.assert_array_equal(
        checkpoint.read_table_slice(0, (8, 15), (2, 6)), TABLE[8:15, 2:6] + 1
    )


def test_uncovered_slice_is_an_error(tmp_path: Path) -> None:
    checkpoint = Checkpoint(write(tmp_path, 1, [((0, 10), (0, 7))]))
    with pytest.raises(CheckpointError, match=r"do not cover rows \[5, 12\]"):
        checkpoint.read_table_slice(0, (5, 12), (0, 7))


def test_newest_is_resolved_and_old_ones_pruned(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        write(tmp_path, step, [((0, 23), (0, 7))], keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000000020", "step_000000030"]
    assert resolve_checkpoint(tmp_path).name == "step_000000030"


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corruption_names_the_file_and_the_previous_checkpoint(tmp_path: Path, damage: str) -> None:
    previous = write(tmp_path, 10, [((0, 23), (0, 7))])
    latest = write(tmp_path, 20, [((0, 23), (0, 7))])
    victim = next((latest / "embeddings").glob("*.m.npy"))
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
        expected = "corrupted: sha256"
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-8]))
        expected = "truncated or corrupted"
    else:
        victim.unlink()
        expected = "missing"
    with pytest.raises(CheckpointError) as error:
        Checkpoint(tmp_path)  # resolves to the newest: the damaged one
    message = str(error.value)
    assert str(victim) in message and expected in message
    assert str(previous) in message
    assert Checkpoint(previous).step == 10  # still usable


def test_unreadable_manifest(tmp_path: Path) -> None:
    path = write(tmp_path, 3, [((0, 23), (0, 7))])
    (path / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest.json: unreadable manifest"):
        Checkpoint(path)


def test_interrupted_write_is_invisible(tmp_path: Path) -> None:
    write(tmp_path, 1, [((0, 23), (0, 7))])
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
