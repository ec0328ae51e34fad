"""Part files written per bucket and joined in order (list columns: ids and global
row offsets); the output spec layout; the report table."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataloading.files import SplitBinaryFiles
from feature_spec import FeatureSpec, build_split_binary_spec
from preproc.layout import (
    CategoricalColumn,
    CategoricalKind,
    InputLayout,
    NumericalColumn,
    NumericalKind,
    criteo_layout,
)
from preproc.output_spec import dataset_spec
from preproc.partition_writer import (
    PartFormat,
    PartStats,
    concatenate_parts,
    write_arrow_partition,
    write_partition,
)
from preproc.report import format_report

CARDINALITIES = (3, 300, 70000)
DTYPES = ("int8", "int16", "int32")


def batches(
    part: PartFormat, rows: list[tuple[object, ...]], size: int = 4
) -> list[pa.RecordBatch]:
    """`rows` (bucket, label, numerical..., categorical...) as Arrow batches of
    `size` rows, typed as Spark hands them to `mapInArrow`."""
    types = [pa.int32(), pa.bool_(), *[pa.float64()] * part.num_numerical]
    for i in range(len(part.cardinalities)):
        types.append(pa.list_(pa.int32()) if part.is_variable_length(i) else pa.int32())
    columns = list(zip(*rows, strict=True))
    arrays = [pa.array(column, type=t) for column, t in zip(columns, types, strict=True)]
    table = pa.Table.from_arrays(arrays, names=[f"c{i}" for i in range(len(arrays))])
    return table.to_batches(max_chunksize=size)


def write(part: PartFormat, rows: list[tuple[object, ...]], size: int = 4) -> list[PartStats]:
    return list(write_partition(part, batches(part, rows, size)))


def rows(bucket: int, start: int, count: int) -> list[tuple[object, ...]]:
    return [
        (bucket, (start + i) % 3 == 0, float(start + i), -0.5, (start + i) % 3, start + i, 7)
        for i in range(start, start + count)
    ]


def test_buckets_are_joined_in_order(tmp_path: Path) -> None:
    part = PartFormat(str(tmp_path / "_parts"), 2, DTYPES, CARDINALITIES)
    # Two tasks: buckets 0 and 3 (the change within a batch), and bucket 1 (bucket 2
    # got no rows).
    first = write(part, rows(0, 0, 5) + rows(3, 20, 6))
    second = write(part, rows(1, 10, 9))
    assert [s.rows for s in first + second] == [11, 9]
    assert concatenate_parts(part, tmp_path) == 3
    assert not (tmp_path / "_parts").exists()
    expected = rows(0, 0, 5) + rows(1, 10, 9) + rows(3, 20, 6)
    label = np.fromfile(tmp_path / "label.bin", dtype=np.bool_)
    np.testing.assert_array_equal(label, [r[1] for r in expected])
    numerical = np.fromfile(tmp_path / "numerical.bin", dtype=np.float16).reshape(-1, 2)
    np.testing.assert_array_equal(numerical[:, 0], [r[2] for r in expected])
    for i, dtype in enumerate(DTYPES):
        ids = np.fromfile(tmp_path / f"cat_{i}.bin", dtype=dtype)
        np.testing.assert_array_equal(ids, [r[4 + i] for r in expected])
    assert first[0].zero_ids[0] == sum(r[4] == 0 for r in rows(0, 0, 5) + rows(3, 20, 6))


def test_saturation_is_counted_and_ids_are_checked(tmp_path: Path) -> None:
    part = PartFormat(str(tmp_path / "_parts"), 2, DTYPES, CARDINALITIES)
    data = [(0, True, 1e6, -7e4, 0, 0, 0), (0, False, 65504.0, 1.0, 2, 299, 69999)]
    (stats,) = write(part, data)
    assert stats.saturated == [1, 1] and stats.positives == 1
    concatenate_parts(part, tmp_path)
    numerical = np.fromfile(tmp_path / "numerical.bin", dtype=np.float16).reshape(-1, 2)
    assert numerical.tolist() == [[65504.0, -65504.0], [65504.0, 1.0]]
    with pytest.raises(ValueError, match=r"cat_1: expected ids in \[0, 300\), got 300"):
        write(part, [(0, True, 0.0, 0.0, 0, 300, 0)])


def test_a_failed_bucket_leaves_no_part_and_stats_are_one_arrow_row(tmp_path: Path) -> None:
    part = PartFormat(str(tmp_path / "_parts"), 2, DTYPES, CARDINALITIES)
    good = rows(0, 0, 3)
    with pytest.raises(ValueError, match="cat_2: expected ids"):
        write(part, [*good, (1, True, 0.0, 0.0, 0, 0, 70000)])
    assert sorted(p.name for p in (tmp_path / "_parts").iterdir()) == ["000000"]
    (stats,) = write_arrow_partition(part, batches(part, good))
    assert stats.num_rows == 1
    assert stats.to_pylist()[0] == dataclasses.asdict(write(part, good)[0])


def list_rows(bucket: int, start: int, count: int) -> list[tuple[object, ...]]:
    """(bucket, label, numerical, one-hot id, ids of a list of length row % 4)."""
    return [
        (bucket, row % 2 == 0, float(row), row % 5, [(row + j) % 11 for j in range(row % 4)])
        for row in range(start, start + count)
    ]


def test_list_parts_are_joined_with_global_offsets(tmp_path: Path) -> None:
    part = PartFormat(
        str(tmp_path / "_parts"), 1, ("int8", "int16"), (5, 11), variable_length=(False, True)
    )
    # Buckets 0 and 2 in one task, bucket 1 (empty lists only) in another.
    empty = [(1, True, 0.0, 4, []), (1, False, 0.0, 0, [])]
    first = write(part, list_rows(0, 0, 7) + list_rows(2, 30, 5), size=3)
    second = write(part, empty, size=3)
    lists = sum(r % 4 for r in [*range(7), *range(30, 35)])
    assert [s.ids for s in first + second] == [[12, lists], [2, 0]]
    assert concatenate_parts(part, tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cat_0.bin", "cat_1.bin", "cat_1.offsets.bin", "label.bin", "numerical.bin"
    ]  # fmt: skip
    expected = list_rows(0, 0, 7) + empty + list_rows(2, 30, 5)
    lengths = [len(r[4]) for r in expected]  # type: ignore[arg-type]
    offsets = np.fromfile(tmp_path / "cat_1.offsets.bin", dtype=np.int64)
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(lengths)]))
    ids = np.fromfile(tmp_path / "cat_1.bin", dtype=np.int16)
    np.testing.assert_array_equal(ids, [i for r in expected for i in r[4]])  # type: ignore[attr-defined]
    one_hot = np.fromfile(tmp_path / "cat_0.bin", dtype=np.int8)
    np.testing.assert_array_equal(one_hot, [r[3] for r in expected])


def test_list_ids_are_checked(tmp_path: Path) -> None:
    part = PartFormat(str(tmp_path / "_parts"), 0, ("int8",), (11,), variable_length=(True,))
    with pytest.raises(ValueError, match=r"cat_0: expected ids in \[0, 11\), got 11"):
        write(part, [(0, True, [3]), (0, False, [0, 11, 2])])
    with pytest.raises(ValueError, match="variable_length: expected one entry per categorical"):
        PartFormat(str(tmp_path), 0, ("int8",), (11,), variable_length=(True, False))


def test_list_column_output_spec_loads(tmp_path: Path) -> None:
    layout = InputLayout(
        delimiter=",",
        fields=("y", "tags", "hour"),
        label_source="y",
        label_name="y",
        numerical=(),
        numerical_kind=NumericalKind.FLOAT,
        categorical=(
            CategoricalColumn("tags", "tags", CategoricalKind.TOKEN, variable_length=True),
            CategoricalColumn("hour", "hour", CategoricalKind.ID, 24),
        ),
        list_delimiter="|",
    )
    spec = dataset_spec(layout, [300, 24], ("train",), tmp_path, {})
    assert [(f.dtype, f.hotness) for f in spec.categorical_features] == [("int16", 0), ("int8", 1)]
    assert spec.files("train").offsets == {"tags": tmp_path / "train" / "cat_0.offsets.bin"}
    train = tmp_path / "train"
    train.mkdir()
    np.array([True, False], dtype=np.bool_).tofile(train / "label.bin")
    np.array([5, 299, 0], dtype=np.int16).tofile(train / "cat_0.bin")
    np.array([0, 3, 3], dtype=np.int64).tofile(train / "cat_0.offsets.bin")
    np.array([1, 23], dtype=np.int8).tofile(train / "cat_1.bin")
    spec.dump(tmp_path / "feature_spec.yaml")
    loaded = FeatureSpec.load(tmp_path)
    assert loaded == spec
    assert SplitBinaryFiles.open(loaded, "train").rows == 2


def test_criteo_output_spec_is_the_nvidia_layout(tmp_path: Path) -> None:
    cardinalities = [5 + i for i in range(25)] + [40000]
    ours = dataset_spec(criteo_layout(), cardinalities, ("train", "test"), tmp_path, {"a": 1})
    theirs = build_split_binary_spec(cardinalities, 13, base_directory=tmp_path, metadata={"a": 1})
    assert ours == theirs


def test_own_names_keep_nvidia_file_names(tmp_path: Path) -> None:
    layout = InputLayout(
        delimiter=",",
        fields=("y", "price", "country", "hour"),
        label_source="y",
        label_name="y",
        numerical=(NumericalColumn("price", "price"),),
        numerical_kind=NumericalKind.FLOAT,
        categorical=(
            CategoricalColumn("country", "country", CategoricalKind.TOKEN),
            CategoricalColumn("hour", "hour", CategoricalKind.ID, 24),
        ),
    )
    spec = dataset_spec(layout, [300, 24], ("train", "validation"), tmp_path, {})
    files = spec.files("validation")
    assert files.label == tmp_path / "validation" / "label.bin"
    assert files.categorical == {
        "country": tmp_path / "validation" / "cat_0.bin",
        "hour": tmp_path / "validation" / "cat_1.bin",
    }
    assert [f.dtype for f in spec.categorical_features] == ["int16", "int8"]


def test_report_table() -> None:
    report = {
        "output_dir": "/data",
        "splits": {
            "train": {"rows": 1000, "positives": 250, "positive_rate": 0.25},
            "test": {"rows": 10, "positives": 1, "positive_rate": 0.1},
        },
        "malformed": {"field_count": 1, "label": 0, "numerical": 2, "categorical": 0},
        "malformed_total": 3,
        "malformed_examples": [{"file": "day_0", "line": 7, "detail": "field 3 (I2): ..."}],
        "files": [{}, {}],
        "lines": 1014,
        "header_lines": 1,
        "categorical": [
            {
                "name": "cat_0",
                "source": "C1",
                "kind": "hex",
                "frequency_threshold": 2,
                "distinct_in_train": 1234,
                "cardinality": 99,
                "dtype": "int8",
                "oov_rate": {"train": 0.5, "test": 0.25},
            }
        ],
        "numerical": [{"saturated": {"train": 0, "test": 2}}],
        "numerical_transform": "log",
        "stages": {
            "parse": {"seconds": 2.0, "skipped": True},
            "train": {"seconds": 1.5, "skipped": False},
        },
    }
    text = format_report(json.loads(json.dumps(report)))
    assert "train  1,000        250         25.00%" in text
    assert "3 malformed lines skipped (field_count 1, label 0, numerical 2, categorical 0)" in text
    assert "e.g. day_0:7: field 3 (I2)" in text
    assert "cat_0        C1          2     1,234           99   int8     50.00%    25.00%" in text
    assert "2 values clipped to the float16 range" in text
    assert "stages: parse 2.0 s (earlier run), train 1.5 s" in text


def test_values_are_looked_up_in_the_vocabulary_by_the_writer(tmp_path: Path) -> None:
    """A feature given as values (text; a list of them) gets the ids of its
    vocabulary directory: missing, unseen: 0; a feature without a kept value (no
    directory): all 0."""
    colors = tmp_path / "vocabulary" / "_feature=0"
    colors.mkdir(parents=True)
    vocabulary = {"_value": ["red", "blue"], "_count": [9, 4], "_id": pa.array([1, 2], pa.int32())}
    pq.write_table(pa.table(vocabulary), colors / "part-00000.snappy.parquet")
    pq.write_table(pa.table(vocabulary), colors / ".hidden.parquet")  # Spark's .crc and such
    part = PartFormat(
        str(tmp_path / "_parts"),
        0,
        ("int8", "int8", "int8"),
        (3, 3, 1),
        variable_length=(False, True, False),
        vocabularies=(str(colors), str(colors), str(tmp_path / "vocabulary" / "_feature=2")),
    )
    table = pa.table(
        {
            "bucket": pa.array([0, 0, 0, 0], pa.int32()),
            "label": [True, False, False, True],
            "color": ["blue", None, "green", "red"],
            "colors": [["red", "red"], [], [None, "blue", "pink"], ["blue"]],
            "shape": ["round", None, "square", "round"],
        }
    )
    (stats,) = write_partition(part, table.to_batches(max_chunksize=3))
    concatenate_parts(part, tmp_path)
    np.testing.assert_array_equal(np.fromfile(tmp_path / "cat_0.bin", np.int8), [2, 0, 0, 1])
    np.testing.assert_array_equal(np.fromfile(tmp_path / "cat_1.bin", np.int8), [1, 1, 0, 2, 0, 2])
    offsets = np.fromfile(tmp_path / "cat_1.offsets.bin", np.int64)
    np.testing.assert_array_equal(offsets, [0, 2, 2, 5, 6])
    np.testing.assert_array_equal(np.fromfile(tmp_path / "cat_2.bin", np.int8), [0, 0, 0, 0])
    assert stats.zero_ids == [2, 2, 4] and stats.ids == [4, 6, 4]


def test_one_vocabulary_per_categorical_feature() -> None:
    with pytest.raises(ValueError, match=r"vocabularies: expected one entry per categorical"):
        PartFormat("parts", 0, DTYPES, CARDINALITIES, vocabularies=(None,))


def test_a_later_run_with_a_new_vocabulary_at_the_same_path_gets_its_ids(tmp_path: Path) -> None:
    """Spark reuses a Python worker across jobs: a vocabulary rewritten at the same
    path (a rerun with another threshold, same output directory) must be read anew."""
    colors = tmp_path / "vocabulary" / "_feature=0"
    part = PartFormat(str(tmp_path / "_parts"), 0, ("int8",), (3,), vocabularies=(str(colors),))
    table = pa.table({"bucket": pa.array([0, 0], pa.int32()), "label": [True, False]})
    table = table.append_column("color", pa.array(["red", "blue"]))
    found = []
    for kept in (["red", "blue"], ["blue"]):
        shutil.rmtree(colors.parent, ignore_errors=True)
        colors.mkdir(parents=True)
        ids = pa.array(range(1, len(kept) + 1), pa.int32())
        vocabulary = pa.table({"_value": kept, "_count": [5] * len(kept), "_id": ids})
        pq.write_table(vocabulary, colors / "part-00000.parquet")
        list(write_partition(part, table.to_batches()))
        concatenate_parts(part, tmp_path)
        found.append(np.fromfile(tmp_path / "cat_0.bin", np.int8).tolist())
    assert found == [[1, 2], [0, 1]]
