"""The split-binary reader against the numpy contents of generated files."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from dataloading.errors import DatasetError
from dataloading.files import RaggedIds
from dataloading.split_binary import InputMode, LastBatch, ShardSpec, SplitBinaryDataset
from dataloading.synthetic import generate_split_binary
from feature_spec import FeatureSpec, FeatureSpecError
from feature_spec.staged import write_file_atomically
from harness.datasets import dataset_fixture

# Odd sizes so that shape and offset bugs surface.
CARDINALITIES = (23, 7, 300, 40000, 11)
NUM_NUMERICAL = 3
TRAIN_ROWS = 1003
GLOBAL_BATCH = 64


dataset_dir = dataset_fixture(
    CARDINALITIES, NUM_NUMERICAL, {"train": TRAIN_ROWS, "test": 130}, seed=3
)
multi_hot_dir = dataset_fixture(
    (23, 7, 300), 2, {"train": 200}, seed=5, hotness=(1, 3, 2), chunk_rows=77
)


def contents(spec: FeatureSpec, mapping: str) -> dict[str, np.ndarray]:
    """Every file of a mapping, read independently with np.fromfile."""
    files = spec.files(mapping)
    out = {
        "label": np.fromfile(files.label, dtype=np.bool_),
        "numerical": np.fromfile(files.numerical, dtype=np.float16).reshape(
            -1, len(spec.numerical_features)
        ),
    }
    for feature in spec.categorical_features:
        ids = np.fromfile(files.categorical[feature.name], dtype=feature.dtype)
        out[feature.name] = ids.reshape(-1, feature.hotness) if feature.hotness > 1 else ids
    return out


def test_one_rank_reads_every_row_in_order(dataset_dir: Path) -> None:
    spec = FeatureSpec.load(dataset_dir)
    data = contents(spec, "train")
    dataset = SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH))
    assert dataset.num_batches == TRAIN_ROWS // GLOBAL_BATCH
    batches = list(dataset.to_tf_dataset().as_numpy_iterator())
    assert len(batches) == TRAIN_ROWS // GLOBAL_BATCH
    rows = len(batches) * GLOBAL_BATCH
    label = np.concatenate([b.label for b in batches])
    numerical = np.concatenate([b.numerical for b in batches])
    categorical = np.concatenate([b.categorical for b in batches])
    assert label.dtype == np.float32 and label.shape == (rows, 1)
    assert numerical.dtype == np.float32 and numerical.shape == (rows, NUM_NUMERICAL)
    assert categorical.dtype == np.int32 and categorical.shape == (rows, len(CARDINALITIES))
    np.testing.assert_array_equal(label[:, 0], data["label"][:rows].astype(np.float32))
    np.testing.assert_array_equal(numerical, data["numerical"][:rows].astype(np.float32))
    for t, feature in enumerate(spec.categorical_features):
        np.testing.assert_array_equal(categorical[:, t], data[feature.name][:rows])
    assert all(b.weight.min() == 1.0 for b in batches)


@pytest.mark.parametrize("input_mode", list(InputMode))
def test_two_ranks_partition_each_global_batch(dataset_dir: Path, input_mode: InputMode) -> None:
    spec = FeatureSpec.load(dataset_dir)
    data = contents(spec, "train")
    local = GLOBAL_BATCH // 2
    owned = (
        {0: (0, 3), 1: (1, 2, 4)} if input_mode == InputMode.MODEL_PARALLEL else {0: None, 1: None}
    )
    readers = {
        rank: SplitBinaryDataset(
            spec,
            "train",
            ShardSpec(GLOBAL_BATCH, rank, 2, owned[rank], input_mode=input_mode),
        )
        for rank in (0, 1)
    }
    iterators = {rank: r.to_tf_dataset().as_numpy_iterator() for rank, r in readers.items()}
    for b in range(TRAIN_ROWS // GLOBAL_BATCH):
        for rank in (0, 1):
            batch = next(iterators[rank])
            rows = slice(b * GLOBAL_BATCH + rank * local, b * GLOBAL_BATCH + (rank + 1) * local)
            np.testing.assert_array_equal(batch.label[:, 0], data["label"][rows])
            np.testing.assert_array_equal(
                batch.numerical, data["numerical"][rows].astype(np.float32)
            )
            if input_mode == InputMode.MODEL_PARALLEL:
                # Only the owned tables, for the whole global batch.
                cat_rows = slice(b * GLOBAL_BATCH, (b + 1) * GLOBAL_BATCH)
                tables = owned[rank]
            else:
                cat_rows, tables = rows, tuple(range(len(CARDINALITIES)))
            assert batch.categorical.shape == (cat_rows.stop - cat_rows.start, len(tables))
            for column, t in enumerate(tables):
                expected = data[spec.categorical_features[t].name][cat_rows]
                np.testing.assert_array_equal(batch.categorical[:, column], expected)
    for iterator in iterators.values():
        with pytest.raises(StopIteration):
            next(iterator)


def test_rank_without_tables_gets_empty_ids(dataset_dir: Path) -> None:
    spec = FeatureSpec.load(dataset_dir)
    batch = SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH, 1, 2, ())).read_batch(0)
    assert batch.categorical.shape == (GLOBAL_BATCH, 0)


def test_padded_last_batch_is_masked(dataset_dir: Path) -> None:
    spec = FeatureSpec.load(dataset_dir)
    data = contents(spec, "train")
    full, remainder = divmod(TRAIN_ROWS, GLOBAL_BATCH)
    assert remainder > GLOBAL_BATCH // 2  # rank 1 gets some real rows too
    local = GLOBAL_BATCH // 2
    for rank in (0, 1):
        dataset = SplitBinaryDataset(
            spec, "train", ShardSpec(GLOBAL_BATCH, rank, 2), last_batch=LastBatch.PAD
        )
        assert dataset.num_batches == full + 1
        last = list(dataset.to_tf_dataset().as_numpy_iterator())[-1]
        start = full * GLOBAL_BATCH + rank * local
        real = min(max(TRAIN_ROWS - start, 0), local)
        assert last.weight[:, 0].tolist() == [1.0] * real + [0.0] * (local - real)
        np.testing.assert_array_equal(last.label[:real, 0], data["label"][start : start + real])
        assert not last.label[real:].any() and not last.numerical[real:].any()
        cat_start = full * GLOBAL_BATCH
        cat_real = TRAIN_ROWS - cat_start
        assert last.categorical.shape == (GLOBAL_BATCH, len(CARDINALITIES))
        np.testing.assert_array_equal(last.categorical[:cat_real, 0], data["cat_0"][cat_start:])
        assert not last.categorical[cat_real:].any()


def test_drop_never_yields_partial_batch(dataset_dir: Path) -> None:
    spec = FeatureSpec.load(dataset_dir)
    dataset = SplitBinaryDataset(spec, "test", ShardSpec(GLOBAL_BATCH), last_batch="drop")
    batches = list(dataset.to_tf_dataset().as_numpy_iterator())
    assert len(batches) == 130 // GLOBAL_BATCH
    assert all(b.label.shape == (GLOBAL_BATCH, 1) for b in batches)


def test_multi_hot_tables_come_as_tuple(multi_hot_dir: Path) -> None:
    spec = FeatureSpec.load(multi_hot_dir)
    data = contents(spec, "train")
    dataset = SplitBinaryDataset(spec, "train", ShardSpec(20, 0, 2, (1, 2)))
    batches = list(dataset.to_tf_dataset().as_numpy_iterator())
    assert len(batches) == 10
    ids_1 = np.concatenate([b.categorical[0] for b in batches])
    ids_2 = np.concatenate([b.categorical[1] for b in batches])
    assert ids_1.shape == (200, 3) and ids_2.shape == (200, 2) and ids_1.dtype == np.int32
    np.testing.assert_array_equal(ids_1, data["cat_1"])
    np.testing.assert_array_equal(ids_2, data["cat_2"])


@pytest.mark.parametrize("hotness", [(1, 1, 1), (1, 3, 2)], ids=["one_hot", "multi_hot"])
def test_int64_stored_ids_come_as_int64_for_every_table(tmp_path: Path, hotness: tuple) -> None:
    """One table stored as int64 makes every table's ids int64 (the ranks agree
    on one dtype, whatever tables they read)."""
    generate_split_binary(tmp_path / "d", (23, 7, 300), 2, rows={"train": 100}, hotness=hotness)
    spec = FeatureSpec.load(tmp_path / "d")
    wide = copy_dataset(tmp_path / "d", tmp_path / "wide")
    path = wide.files("train").categorical["cat_2"]
    write_file_atomically(path, np.fromfile(path, np.int16).astype(np.int64).tobytes())
    text = (tmp_path / "wide" / "feature_spec.yaml").read_text()
    text = text.replace("  cat_2:\n    dtype: int16\n", "  cat_2:\n    dtype: int64\n")
    (tmp_path / "wide" / "feature_spec.yaml").write_text(text)
    wide = FeatureSpec.load(tmp_path / "wide")
    assert [f.dtype for f in wide.categorical_features] == ["int8", "int8", "int64"]
    for tables in [(0, 1, 2), (0, 1)]:  # rank 0 of 2 reads tables 0 and 1 only
        shard = ShardSpec(20, 0, 2, tables) if len(tables) < 3 else ShardSpec(20)
        narrow_batch = next(iter(SplitBinaryDataset(spec, "train", shard).to_tf_dataset()))
        wide_batch = next(iter(SplitBinaryDataset(wide, "train", shard).to_tf_dataset()))
        for narrow, ids in zip(
            tf.nest.flatten(narrow_batch.categorical),
            tf.nest.flatten(wide_batch.categorical),
            strict=True,
        ):
            assert narrow.dtype == tf.int32 and ids.dtype == tf.int64
            np.testing.assert_array_equal(ids.numpy(), narrow.numpy())


# ---------------------------------------------------------------- bad input


def copy_dataset(source: Path, target: Path) -> FeatureSpec:
    shutil.copytree(source, target)
    return FeatureSpec.load(target)


# Tests change a dataset's files with write_file_atomically (a new file renamed into
# place), never in place: a dataset read before may still have the file memory-mapped
# (tf.data's prefetch goes on reading after an error), and a mapped file cut short
# under a reader is a bus error that kills the test process.


def test_file_not_whole_rows(dataset_dir: Path, tmp_path: Path) -> None:
    spec = copy_dataset(dataset_dir, tmp_path / "d")
    path = spec.files("train").numerical
    assert path is not None
    write_file_atomically(path, path.read_bytes() + b"\0" * 5)
    with pytest.raises(DatasetError) as info:
        SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH))
    message = str(info.value)
    assert str(path) in message and "multiple of 6 bytes" in message
    assert f"got {TRAIN_ROWS * 6 + 5} bytes" in message


def test_row_counts_differ(dataset_dir: Path, tmp_path: Path) -> None:
    spec = copy_dataset(dataset_dir, tmp_path / "d")
    path = spec.files("train").categorical["cat_3"]  # int32 ids
    write_file_atomically(path, path.read_bytes()[: -4 * 3])
    with pytest.raises(DatasetError) as info:
        SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH))
    message = str(info.value)
    assert str(path) in message
    assert f"expected {TRAIN_ROWS} rows = {TRAIN_ROWS * 4} bytes" in message
    assert f"got {TRAIN_ROWS - 3} rows" in message


def overwrite_id(spec: FeatureSpec, name: str, row: int, value: int) -> Path:
    """Sets the id of `row` of feature `name` (first id of a multi-hot row) in
    the train split; returns the file's path."""
    feature = next(f for f in spec.categorical_features if f.name == name)
    path = spec.files("train").categorical[name]
    ids = np.fromfile(path, dtype=feature.dtype)
    ids[row * feature.hotness] = value
    write_file_atomically(path, ids.tobytes())
    return path


def assert_names_bad_id(
    message: str, path: Path, table: int, name: str, row: int, value: int, cardinality: int
) -> None:
    assert str(path) in message
    assert f"table {table} (feature {name!r})" in message
    assert f"row {row}:" in message
    assert f"expected ids in [0, {cardinality}), got {value}" in message


def test_id_out_of_range_in_whole_files_on_request(dataset_dir: Path, tmp_path: Path) -> None:
    spec = copy_dataset(dataset_dir, tmp_path / "d")
    path = overwrite_id(spec, "cat_1", 517, 7)  # cardinality 7, int8
    SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH))  # files not scanned by default
    with pytest.raises(DatasetError) as info:
        SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH), check_file_ids=True)
    assert_names_bad_id(str(info.value), path, 1, "cat_1", 517, 7, 7)


# (table, row, value): just too large in an int8 table, negative in an int32 table,
# in the last row of the last full batch, the int8 maximum in the first row.
BAD_IDS = [
    (1, 517, 7),
    (3, 70, -1),
    (2, TRAIN_ROWS // GLOBAL_BATCH * GLOBAL_BATCH - 1, 300),
    (4, 0, 127),
]


@pytest.mark.parametrize(("table", "row", "value"), BAD_IDS)
def test_batch_with_id_out_of_range_raises(
    dataset_dir: Path, tmp_path: Path, table: int, row: int, value: int
) -> None:
    spec = copy_dataset(dataset_dir, tmp_path / "d")
    name = f"cat_{table}"
    path = overwrite_id(spec, name, row, value)
    dataset = SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH))
    bad_batch = row // GLOBAL_BATCH
    for index in range(dataset.num_batches):
        if index != bad_batch:
            dataset.read_batch(index)
    with pytest.raises(DatasetError) as info:
        dataset.read_batch(bad_batch)
    assert_names_bad_id(str(info.value), path, table, name, row, value, CARDINALITIES[table])
    with pytest.raises(DatasetError) as info:
        for _batch in dataset.batches():
            pass
    assert_names_bad_id(str(info.value), path, table, name, row, value, CARDINALITIES[table])


def test_tf_dataset_error_carries_the_message(dataset_dir: Path, tmp_path: Path) -> None:
    from dataloading.split_binary import raise_dataset_errors

    spec = copy_dataset(dataset_dir, tmp_path / "d")
    path = overwrite_id(spec, "cat_1", 517, 7)
    dataset = SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH))
    # Iterated directly, the error is TensorFlow's, its message inside.
    with pytest.raises(tf.errors.InvalidArgumentError, match="row 517"):
        list(dataset.to_tf_dataset())
    # Through raise_dataset_errors, also after repeat/take and as numpy.
    for elements in (
        dataset.to_tf_dataset().repeat().take(3 * dataset.num_batches),
        dataset.to_tf_dataset(start=8).as_numpy_iterator(),
    ):
        with pytest.raises(DatasetError) as info:
            list(raise_dataset_errors(elements))
        message = str(info.value)
        assert_names_bad_id(message, path, 1, "cat_1", 517, 7, 7)
        assert "Traceback" not in message and "<<" not in message
    # Batches before the bad one arrive first.
    batches = dataset.batches()
    for _ in range(517 // GLOBAL_BATCH):
        next(batches)
    with pytest.raises(DatasetError):
        next(batches)


def test_multi_hot_id_out_of_range(multi_hot_dir: Path, tmp_path: Path) -> None:
    spec = copy_dataset(multi_hot_dir, tmp_path / "d")
    path = overwrite_id(spec, "cat_1", 57, 7)  # hotness 3, cardinality 7
    dataset = SplitBinaryDataset(spec, "train", ShardSpec(20, 0, 2, (1, 2)))
    with pytest.raises(DatasetError) as info:
        list(dataset.batches())
    message = str(info.value)
    assert_names_bad_id(message, path, 1, "cat_1", 57, 7, 7)
    assert "ids of the row: [7, " in message


def test_id_check_off(dataset_dir: Path, tmp_path: Path) -> None:
    spec = copy_dataset(dataset_dir, tmp_path / "d")
    overwrite_id(spec, "cat_1", 517, 7)
    dataset = SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH), check_batch_ids=False)
    categorical = np.concatenate([b.categorical for b in dataset.batches()])
    assert categorical[517, 1] == 7  # passed through unchecked


def test_rank_checks_only_the_ids_it_reads(dataset_dir: Path, tmp_path: Path) -> None:
    spec = copy_dataset(dataset_dir, tmp_path / "d")
    path = overwrite_id(spec, "cat_1", 517, 7)  # batch 8, in the local rows of rank 0
    # Model-parallel input: rank 0 reads tables 0 and 3, rank 1 reads table 1.
    without_table_1 = SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH, 0, 2, (0, 3)))
    assert len(list(without_table_1.batches())) == TRAIN_ROWS // GLOBAL_BATCH
    model_parallel = SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH, 1, 2, (1, 2, 4)))
    with pytest.raises(DatasetError) as info:
        model_parallel.read_batch(8)
    assert_names_bad_id(str(info.value), path, 1, "cat_1", 517, 7, 7)
    # Data-parallel input: every table, for the rank's own rows only.
    data_parallel = {
        rank: SplitBinaryDataset(
            spec, "train", ShardSpec(GLOBAL_BATCH, rank, 2, input_mode=InputMode.DATA_PARALLEL)
        )
        for rank in (0, 1)
    }
    data_parallel[1].read_batch(8)
    with pytest.raises(DatasetError) as info:
        data_parallel[0].read_batch(8)
    assert_names_bad_id(str(info.value), path, 1, "cat_1", 517, 7, 7)


def test_global_batch_not_divisible(dataset_dir: Path) -> None:
    with pytest.raises(DatasetError, match="multiple of the world size 3, got 64"):
        ShardSpec(64, 0, 3)


@pytest.mark.parametrize("tables", [(0, 5), (1, 1)])
def test_bad_local_tables(dataset_dir: Path, tables: tuple[int, ...]) -> None:
    spec = FeatureSpec.load(dataset_dir)
    with pytest.raises(DatasetError, match=r"distinct table indices in \[0, 5\)"):
        SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH, 0, 2, tables))


def test_missing_mapping(dataset_dir: Path) -> None:
    spec = FeatureSpec.load(dataset_dir)
    with pytest.raises(FeatureSpecError, match=r"source_spec\.validation: mapping missing"):
        SplitBinaryDataset(spec, "validation", ShardSpec(GLOBAL_BATCH))


# ------------------------------------------------------------ variable length

VARIABLE_CARDINALITIES = (23, 7, 300)
VARIABLE_HOTNESS = (0, 1, 0)  # tables 0 and 2: 0 to 4 ids per row
VARIABLE_ROWS = 211


variable_dir = dataset_fixture(
    VARIABLE_CARDINALITIES,
    2,
    {"train": VARIABLE_ROWS},
    seed=6,
    hotness=VARIABLE_HOTNESS,
    max_variable_hotness=4,
    chunk_rows=50,
)


def variable_rows(spec: FeatureSpec, name: str) -> list[np.ndarray]:
    """Each row's ids of a variable-length feature, read with np.fromfile."""
    files = spec.files("train")
    feature = next(f for f in spec.categorical_features if f.name == name)
    values = np.fromfile(files.categorical[name], dtype=feature.dtype)
    offsets = np.fromfile(files.offsets[name], dtype=np.int64)
    return [values[a:b] for a, b in itertools.pairwise(offsets)]


@pytest.mark.parametrize("input_mode", list(InputMode))
def test_variable_length_tables_come_as_ragged_tensors(
    variable_dir: Path, input_mode: InputMode
) -> None:
    """Each rank's ragged ids are exactly the rows of the files it should read
    (the global batch of its tables, or its local rows); the last batch is
    padded with empty rows."""
    spec = FeatureSpec.load(variable_dir)
    rows = {name: variable_rows(spec, name) for name in ("cat_0", "cat_2")}
    assert any(len(r) == 0 for r in rows["cat_0"])  # empty rows occur
    batch_size, world = 40, 2
    for rank in range(world):
        tables = (2, 1) if input_mode == InputMode.MODEL_PARALLEL else None
        shard = ShardSpec(batch_size, rank, world, tables, input_mode)
        dataset = SplitBinaryDataset(spec, "train", shard, last_batch="pad")
        batches = list(dataset.batches())
        assert len(batches) == -(-VARIABLE_ROWS // batch_size)
        read_tables = [2, 1] if tables else [0, 1, 2]
        for index, batch in enumerate(batches):
            start = index * batch_size
            cat_rows = batch_size
            if input_mode == InputMode.DATA_PARALLEL:
                start, cat_rows = start + rank * batch_size // world, batch_size // world
            assert len(batch.categorical) == len(read_tables)
            for table, ids in zip(read_tables, batch.categorical, strict=True):
                if VARIABLE_HOTNESS[table] == 1:
                    assert ids.shape == (cat_rows, 1)
                    continue
                assert isinstance(ids, tf.RaggedTensor) and ids.dtype == tf.int32
                want = [list(r) for r in rows[f"cat_{table}"][start : start + cat_rows]]
                want += [[]] * (cat_rows - len(want))  # padding rows past the end
                assert [list(row) for row in ids.to_list()] == want


def test_variable_length_read_batch_gives_ragged_ids(variable_dir: Path) -> None:
    spec = FeatureSpec.load(variable_dir)
    batch = SplitBinaryDataset(spec, "train", ShardSpec(30)).read_batch(2)
    ids = batch.categorical[0]
    assert isinstance(ids, RaggedIds) and ids.row_lengths.shape == (30,)
    want = variable_rows(spec, "cat_0")[60:90]
    assert [len(r) for r in want] == ids.row_lengths.tolist()
    np.testing.assert_array_equal(ids.values, np.concatenate(want))


def test_variable_length_offsets_must_match_the_ids(variable_dir: Path, tmp_path: Path) -> None:
    spec = copy_dataset(variable_dir, tmp_path / "d")
    offsets_path = spec.files("train").offsets["cat_2"]
    offsets = np.fromfile(offsets_path, dtype=np.int64)
    # One more id than the offsets account for.
    ids_path = spec.files("train").categorical["cat_2"]
    write_file_atomically(ids_path, ids_path.read_bytes() + np.int16(5).tobytes())
    with pytest.raises(DatasetError) as info:
        SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH))
    message = str(info.value)
    assert str(offsets_path) in message
    expected = f"expected offsets from 0 to the number of ids in {ids_path} ({offsets[-1] + 1})"
    assert expected in message
    # The last row missing: a row count that differs from the label's.
    write_file_atomically(ids_path, ids_path.read_bytes()[: 2 * int(offsets[-2])])
    write_file_atomically(offsets_path, offsets[:-1].tobytes())
    with pytest.raises(DatasetError, match=f"expected {VARIABLE_ROWS + 1} int64 offsets"):
        SplitBinaryDataset(spec, "train", ShardSpec(GLOBAL_BATCH))


def test_variable_length_decreasing_offsets_and_bad_ids_name_the_row(
    variable_dir: Path, tmp_path: Path
) -> None:
    spec = copy_dataset(variable_dir, tmp_path / "d")
    files = spec.files("train")
    offsets = np.fromfile(files.offsets["cat_0"], dtype=np.int64)
    row = int(np.flatnonzero(np.diff(offsets) >= 2)[3])  # a row with 2+ ids
    values = np.fromfile(files.categorical["cat_0"], dtype=np.int8)
    values[offsets[row] + 1] = 23  # its second id: one past the table
    write_file_atomically(files.categorical["cat_0"], values.tobytes())
    dataset = SplitBinaryDataset(spec, "train", ShardSpec(20))
    with pytest.raises(DatasetError) as info:
        list(dataset.batches())
    message = str(info.value)
    assert_names_bad_id(message, files.categorical["cat_0"], 0, "cat_0", row, 23, 23)
    assert "ids of the row: [" in message
    with pytest.raises(DatasetError, match=f"row {row}"):
        SplitBinaryDataset(spec, "train", ShardSpec(20), check_file_ids=True)
    # Offsets that go back: a negative number of ids in a row.
    broken = offsets.copy()
    broken[row + 1] = broken[row] - 1
    write_file_atomically(files.offsets["cat_0"], broken.tobytes())
    for scan_files in (False, True):
        with pytest.raises(DatasetError, match=f"offsets of row {row} decrease"):
            dataset = SplitBinaryDataset(spec, "train", ShardSpec(20), check_file_ids=scan_files)
            list(dataset.batches())
