"""The FeatureSpec of a preprocessed dataset, laid out as NVIDIA's tools lay it out.

Per mapping: `<mapping>/label.bin`, `<mapping>/numerical.bin` and
`<mapping>/cat_<i>.bin` (i = position in the categorical channel), whatever the
features are called, plus `<mapping>/cat_<i>.offsets.bin` for a variable-length
feature (`hotness: variable`); ids in the smallest dtype that holds the
cardinality. With Criteo's names this is exactly
`feature_spec.build_split_binary_spec`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from feature_spec import (
    CATEGORICAL_CHANNEL,
    LABEL_CHANNEL,
    NUMERICAL_CHANNEL,
    SPLIT_BINARY,
    Chunk,
    Feature,
    FeatureSpec,
    minimal_categorical_dtype,
)
from feature_spec.criteo import LABEL_FILE, NUMERICAL_FILE
from preproc.layout import InputLayout
from preproc.partition_writer import categorical_file, categorical_offsets_file


def dataset_spec(
    layout: InputLayout,
    cardinalities: Sequence[int],
    mappings: Sequence[str],
    base_directory: Path,
    metadata: Mapping[str, Any],
) -> FeatureSpec:
    """The spec of the split-binary files the pipeline writes for `layout`."""
    label = layout.label_name
    numerical = tuple(c.name for c in layout.numerical)
    categorical = tuple(c.name for c in layout.categorical)
    features = {label: Feature(label, "bool")}
    for name in numerical:
        features[name] = Feature(name, "float16")
    for column, cardinality in zip(layout.categorical, cardinalities, strict=True):
        dtype = minimal_categorical_dtype(cardinality)
        hotness = 0 if column.variable_length else 1
        features[column.name] = Feature(column.name, dtype, cardinality, hotness)
    source_spec = {}
    for mapping in mappings:
        chunks = [Chunk(SPLIT_BINARY, (label,), (f"{mapping}/{LABEL_FILE}",))]
        if numerical:
            chunks.append(Chunk(SPLIT_BINARY, numerical, (f"{mapping}/{NUMERICAL_FILE}",)))
        for i, column in enumerate(layout.categorical):
            files = [f"{mapping}/{categorical_file(i)}"]
            if column.variable_length:
                files.append(f"{mapping}/{categorical_offsets_file(i)}")
            chunks.append(Chunk(SPLIT_BINARY, (column.name,), tuple(files)))
        source_spec[mapping] = tuple(chunks)
    return FeatureSpec(
        features=features,
        source_spec=source_spec,
        channel_spec={
            LABEL_CHANNEL: (label,),
            NUMERICAL_CHANNEL: numerical,
            CATEGORICAL_CHANNEL: categorical,
        },
        metadata=dict(metadata),
        base_directory=base_directory,
    )
