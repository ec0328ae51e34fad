"""Table shards are written in row blocks: the bytes and checksums `np.save` gave."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from dlrm.checkpoint.format import CheckpointError
from dlrm.checkpoint.reader import Checkpoint
from dlrm.checkpoint.writer import CheckpointWriter
from dlrm.embedding.base import read_rows
from dlrm.embedding.shard import ShardingKind, TableShard

SHARD = TableShard(0, ShardingKind.ROW_WISE, 1, (5, 28), (0, 7))  # 23 rows of a [41, 7] table
TABLE_SHAPE = (41, 7)


def values(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((SHARD.height, SHARD.width), np.float32)


@pytest.mark.parametrize("block_bytes", [1, 3 * 7 * 4 + 5, 1 << 20])
def test_chunked_shards_are_np_save_bytes_with_their_checksums(
    tmp_path: Path, block_bytes: int
) -> None:
    table, accumulator = values(1), values(2)
    reads: list[tuple[int, int]] = []

    def read(start: int, stop: int) -> np.ndarray:
        reads.append((start, stop))
        return accumulator[start:stop]

    writer = CheckpointWriter(tmp_path, 3)
    writer.add_dense({"trainer/step": np.asarray(3, np.int64)})
    writer.add_table_shard(SHARD, TABLE_SHAPE, table, {"accumulator": read}, block_bytes)
    files = writer.contents()["files"]
    for name, array in [("", table), (".accumulator", accumulator)]:
        relative = f"embeddings/{SHARD.name}{name}.npy"
        written = (writer.staging / relative).read_bytes()
        expected = io.BytesIO()
        np.save(expected, array)
        assert written == expected.getvalue()
        assert files[relative] == {
            "sha256": hashlib.sha256(written).hexdigest(),
            "bytes": len(written),
        }
    rows = max(1, block_bytes // (7 * 4))
    assert reads == [(r, min(r + rows, SHARD.height)) for r in range(0, SHARD.height, rows)]

    path = writer.commit({})
    checkpoint = Checkpoint(path)
    checkpoint.verify()
    np.testing.assert_array_equal(checkpoint.read_table_slice(0, SHARD.rows, (0, 7)), table)
    restored = checkpoint.read_table_slice(0, SHARD.rows, (0, 7), slot="accumulator")
    np.testing.assert_array_equal(restored, accumulator)


def test_a_reader_that_returns_the_wrong_rows_is_an_error(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"rows \[0, 4\) read as shape \(3, 7\)"):
        writer.add_table_shard(SHARD, TABLE_SHAPE, lambda a, b: values(1)[a : b - 1], {}, 4 * 28)
    assert writer.contents()["tables"] == {}


def test_read_rows_copies_a_row_range_of_a_variable() -> None:
    variable = tf.Variable(values(4))
    # After a sparse update, as in training (the variable is then copy-on-read).
    variable.scatter_sub(tf.IndexedSlices(tf.ones([2, 7]), tf.constant([3, 20], tf.int64)))
    expected = variable.numpy()
    np.testing.assert_array_equal(read_rows(variable, 0, SHARD.height), expected)
    np.testing.assert_array_equal(read_rows(variable, 19, 22), expected[19:22])
    assert read_rows(variable, 4, 4).shape == (0, 7)
