"""The default FeatureSpec of the Criteo click logs (13 numerical, 26 categorical)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from feature_spec.errors import FeatureSpecError
from feature_spec.spec import (
    CATEGORICAL_CHANNEL,
    LABEL_CHANNEL,
    NUMERICAL_CHANNEL,
    SPLIT_BINARY,
    TEST_MAPPING,
    TRAIN_MAPPING,
    Chunk,
    Feature,
    FeatureSpec,
    minimal_categorical_dtype,
    offsets_file_name,
)

CRITEO_NUM_NUMERICAL = 13
CRITEO_NUM_CATEGORICAL = 26

# Per-table vocabulary sizes of Criteo 1TB as preprocessed for MLPerf DLRM
# (ids hashed into at most 40M rows): a realistic, skewed set of table sizes
# for planners and benchmarks.
CRITEO_1TB_MLPERF_CARDINALITIES = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546,
    403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984,
    585935, 12972, 108, 36,
)  # fmt: skip

# Ids per row of each table in MLPerf's DLRM-DCNv2 (multi-hot Criteo 1TB, made
# from the one-hot logs by drawing extra ids): the rows of table 20 hold 100.
MLPERF_DCNV2_MULTI_HOT_SIZES = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)  # fmt: skip

LABEL_NAME = "label"
LABEL_FILE = "label.bin"
NUMERICAL_FILE = "numerical.bin"


def numerical_name(index: int) -> str:
    return f"num_{index}"


def categorical_name(index: int) -> str:
    return f"cat_{index}"


def build_split_binary_spec(
    cardinalities: Sequence[int],
    num_numerical: int,
    hotness: Sequence[int] | None = None,
    mappings: Sequence[str] = (TRAIN_MAPPING, TEST_MAPPING),
    base_directory: str | os.PathLike[str] = ".",
    metadata: dict[str, Any] | None = None,
    id_dtype: str | None = None,
) -> FeatureSpec:
    """A split-binary FeatureSpec laid out as NVIDIA's tools lay it out.

    Files per mapping: `<mapping>/label.bin`, `<mapping>/numerical.bin` and
    `<mapping>/cat_<i>.bin`, with the minimal id dtype per table, or `id_dtype`
    for every table; a variable-length table (hotness 0) adds its row offsets,
    `<mapping>/cat_<i>.offsets.bin`.
    """
    hotness = tuple(hotness) if hotness is not None else (1,) * len(cardinalities)
    if len(hotness) != len(cardinalities):
        raise FeatureSpecError(
            f"hotness: expected one value per categorical feature "
            f"({len(cardinalities)}), got {len(hotness)}"
        )
    features: dict[str, Feature] = {LABEL_NAME: Feature(LABEL_NAME, "bool")}
    numerical = tuple(numerical_name(i) for i in range(num_numerical))
    categorical = tuple(categorical_name(i) for i in range(len(cardinalities)))
    for name in numerical:
        features[name] = Feature(name, "float16")
    for name, cardinality, hot in zip(categorical, cardinalities, hotness, strict=True):
        dtype = id_dtype or minimal_categorical_dtype(cardinality)
        features[name] = Feature(name, dtype, cardinality, hot)
    source_spec = {}
    for mapping in mappings:
        chunks = [Chunk(SPLIT_BINARY, (LABEL_NAME,), (f"{mapping}/{LABEL_FILE}",))]
        if numerical:
            chunks.append(Chunk(SPLIT_BINARY, numerical, (f"{mapping}/{NUMERICAL_FILE}",)))
        for name, hot in zip(categorical, hotness, strict=True):
            files = [f"{mapping}/{name}.bin"] + (
                [f"{mapping}/{offsets_file_name(f'{name}.bin')}"] if hot == 0 else []
            )
            chunks.append(Chunk(SPLIT_BINARY, (name,), tuple(files)))
        source_spec[mapping] = tuple(chunks)
    return FeatureSpec(
        features=features,
        source_spec=source_spec,
        channel_spec={
            LABEL_CHANNEL: (LABEL_NAME,),
            NUMERICAL_CHANNEL: numerical,
            CATEGORICAL_CHANNEL: categorical,
        },
        metadata=dict(metadata or {}),
        base_directory=Path(base_directory),
    )


def criteo_feature_spec(
    cardinalities: Sequence[int] = CRITEO_1TB_MLPERF_CARDINALITIES,
    hotness: Sequence[int] | None = None,
    base_directory: str | os.PathLike[str] = ".",
) -> FeatureSpec:
    """The Criteo layout: 13 numerical and 26 categorical features."""
    if len(cardinalities) != CRITEO_NUM_CATEGORICAL:
        raise FeatureSpecError(
            f"cardinalities: expected {CRITEO_NUM_CATEGORICAL} values for Criteo, "
            f"got {len(cardinalities)}"
        )
    return build_split_binary_spec(
        cardinalities,
        CRITEO_NUM_NUMERICAL,
        hotness=hotness,
        base_directory=base_directory,
    )
