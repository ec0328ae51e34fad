"""The dataset contract: FeatureSpec YAML + split binary files (pure Python)."""

from feature_spec.criteo import (
    CRITEO_1TB_MLPERF_CARDINALITIES,
    CRITEO_NUM_CATEGORICAL,
    CRITEO_NUM_NUMERICAL,
    MLPERF_DCNV2_MULTI_HOT_SIZES,
    build_split_binary_spec,
    criteo_feature_spec,
)
from feature_spec.errors import FeatureSpecError
from feature_spec.spec import (
    AUTO_CARDINALITY,
    CATEGORICAL_CHANNEL,
    LABEL_CHANNEL,
    NUMERICAL_CHANNEL,
    SPLIT_BINARY,
    TEST_MAPPING,
    TRAIN_MAPPING,
    VARIABLE_HOTNESS,
    Chunk,
    Feature,
    FeatureSpec,
    SplitFiles,
    ids_dtype,
    minimal_categorical_dtype,
    offsets_file_name,
)

__all__ = [
    "AUTO_CARDINALITY",
    "CATEGORICAL_CHANNEL",
    "CRITEO_1TB_MLPERF_CARDINALITIES",
    "CRITEO_NUM_CATEGORICAL",
    "CRITEO_NUM_NUMERICAL",
    "LABEL_CHANNEL",
    "MLPERF_DCNV2_MULTI_HOT_SIZES",
    "NUMERICAL_CHANNEL",
    "SPLIT_BINARY",
    "TEST_MAPPING",
    "TRAIN_MAPPING",
    "VARIABLE_HOTNESS",
    "Chunk",
    "Feature",
    "FeatureSpec",
    "FeatureSpecError",
    "SplitFiles",
    "build_split_binary_spec",
    "criteo_feature_spec",
    "ids_dtype",
    "minimal_categorical_dtype",
    "offsets_file_name",
]
