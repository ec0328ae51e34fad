"""Synthetic split-binary datasets (`dataloading.synthetic.generate_split_binary`),
each in a new temporary directory; `dataset = dataset_fixture(...)` makes one a
module fixture named `dataset`, written once for the module."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from dataloading.synthetic import generate_split_binary

# Five small tables of odd sizes, for models trained in the test process.
SMALL_TABLES = (23, 7, 11, 130, 5)


def synthetic_dataset(
    tmp_path_factory: pytest.TempPathFactory,
    cardinalities: Sequence[int],
    num_numerical: int,
    rows: Mapping[str, int],
    seed: int,
    **options: Any,
) -> Path:
    """The path of a new dataset: `generate_split_binary` of these arguments."""
    path = tmp_path_factory.mktemp("data") / "synthetic"
    generate_split_binary(path, cardinalities, num_numerical, rows=rows, seed=seed, **options)
    return path


def dataset_fixture(*args: Any, **kwargs: Any) -> Any:
    """A module fixture: the path of `synthetic_dataset(tmp_path_factory, *args, **kwargs)`."""

    @pytest.fixture(scope="module")
    def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return synthetic_dataset(tmp_path_factory, *args, **kwargs)

    return dataset
