"""The loader when a read fails: a file that shrinks while training reads it is an
error naming it (never a SIGBUS), and a reader that raised reads no more."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from dataloading.errors import DatasetError
from dataloading.split_binary import ShardSpec, SplitBinaryDataset
from dataloading.synthetic import generate_split_binary
from feature_spec import FeatureSpec

BATCH, BATCHES = 64, 200


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("loader") / "data"
    generate_split_binary(path, (50, 30, 7), 2, rows={"train": BATCH * BATCHES}, seed=1)
    return path


def copy_of(dataset: Path, tmp_path: Path) -> FeatureSpec:
    copy = tmp_path / "data"
    for source in dataset.rglob("*"):
        target = copy / source.relative_to(dataset)
        if source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return FeatureSpec.load(copy)


@pytest.mark.parametrize("file", ["label", "categorical"])
def test_a_file_that_shrinks_while_it_is_read_is_an_error_naming_it(
    dataset: Path, tmp_path: Path, file: str
) -> None:
    spec = copy_of(dataset, tmp_path)
    data = SplitBinaryDataset(spec, "train", ShardSpec(BATCH))
    paths = spec.files("train")
    path = paths.label if file == "label" else paths.categorical["cat_1"]
    reader = data.batches()
    next(reader)  # reading: sizes checked at the start, as when the copy began
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(DatasetError) as error:
        for _ in reader:
            pass
    message = str(error.value)
    assert str(path) in message and "shrank while it was being read" in message
    assert f"{BATCH * BATCHES:,} rows" in message


def test_a_reader_that_raised_starts_no_more_reads(dataset: Path, tmp_path: Path) -> None:
    """An id out of range in batch 2: once the error is raised, the reader's
    prefetch has stopped (before, it read on while the traceback lived)."""
    spec = copy_of(dataset, tmp_path)
    path = spec.files("train").categorical["cat_0"]
    ids = np.fromfile(path, dtype=spec.categorical_features[0].dtype)
    ids[2 * BATCH + 5] = 100
    ids.tofile(path)
    data = SplitBinaryDataset(spec, "train", ShardSpec(BATCH))
    started: list[float] = []
    read_batch = data.read_batch

    def recorded(index: int):  # type: ignore[no-untyped-def]
        started.append(time.monotonic())
        return read_batch(index)

    data.read_batch = recorded  # type: ignore[method-assign]
    with pytest.raises(DatasetError, match="row 133: expected ids in") as error:
        for _ in data.batches():
            pass
    raised = time.monotonic()
    time.sleep(0.5)
    assert error.value.__context__ is None  # no TensorFlow error holding the reader
    assert [t for t in started if t > raised] == [], f"{len(started)} reads in all"
