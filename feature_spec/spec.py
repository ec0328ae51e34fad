"""The FeatureSpec: load, validate and dump a dataset's `feature_spec.yaml`.

The format is NVIDIA DeepLearningExamples' (DLRM TF2), so datasets prepared by
either tool load in the other:

    feature_spec:   name -> {dtype, cardinality (categorical), hotness (optional)}
    source_spec:    mapping ("train", "test", ...) -> list of chunks
                    {type: split_binary, features: [...], files: [...]}
    channel_spec:   {label: [one feature], numerical: [...], categorical: [...]}
    metadata:       free-form (optional)

File paths are relative to the directory holding the YAML. Split binary files
are headerless and row-major: the label chunk holds the one `bool` label, the
numerical chunk holds every numerical feature as `float16` columns, and each
categorical feature has its own chunk of int8/int16/int32/int64 ids, `[N]` or
`[N, hotness]`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from feature_spec.errors import FeatureSpecError
from feature_spec.staged import write_file_atomically

LABEL_CHANNEL = "label"
NUMERICAL_CHANNEL = "numerical"
CATEGORICAL_CHANNEL = "categorical"
CHANNELS = (LABEL_CHANNEL, NUMERICAL_CHANNEL, CATEGORICAL_CHANNEL)

TRAIN_MAPPING = "train"
TEST_MAPPING = "test"

SPLIT_BINARY = "split_binary"
CHUNK_TYPES = (SPLIT_BINARY,)

SECTIONS = ("feature_spec", "source_spec", "channel_spec")

# `hotness: variable` in the YAML; `Feature.hotness` holds 0 for it.
VARIABLE_HOTNESS = "variable"
OFFSETS_DTYPE = "int64"

# Cardinality placeholder accepted only by tools that compute it (preproc.transcode).
AUTO_CARDINALITY = "auto"

LABEL_DTYPES = ("bool",)
NUMERICAL_DTYPES = ("float16",)
CATEGORICAL_DTYPES = ("int8", "int16", "int32", "int64")
_CHANNEL_DTYPES = {
    LABEL_CHANNEL: LABEL_DTYPES,
    NUMERICAL_CHANNEL: NUMERICAL_DTYPES,
    CATEGORICAL_CHANNEL: CATEGORICAL_DTYPES,
}


def offsets_file_name(ids_file_name: str) -> str:
    """The row offsets' file of a variable-length feature whose ids are in
    `ids_file_name` (`cat_3.bin` -> `cat_3.offsets.bin`)."""
    stem = ids_file_name[: -len(".bin")] if ids_file_name.endswith(".bin") else ids_file_name
    return f"{stem}.offsets.bin"


def ids_dtype(dtypes: Iterable[str]) -> np.dtype:
    """The one dtype in which every table's ids come, given how the tables'
    ids are stored: int64 when any table's are (its cardinality needs them, or
    the dataset chose them), else int32. The loader gives batches in it, and a
    SavedModel takes it (from the dtypes `minimal_categorical_dtype` gives its
    tables)."""
    return np.dtype(np.int64 if any(d == "int64" for d in dtypes) else np.int32)


def minimal_categorical_dtype(cardinality: int) -> str:
    """The smallest signed integer dtype that holds ids in [0, cardinality)."""
    if not isinstance(cardinality, int) or isinstance(cardinality, bool) or cardinality < 1:
        raise FeatureSpecError(f"cardinality: expected a positive int, got {cardinality!r}")
    for name in CATEGORICAL_DTYPES:
        if cardinality - 1 <= np.iinfo(name).max:
            return name
    raise FeatureSpecError(
        f"cardinality: expected at most {np.iinfo('int64').max + 1} (ids must fit int64), "
        f"got {cardinality}"
    )


@dataclasses.dataclass(frozen=True)
class Feature:
    """One feature of the dataset.

    Attributes:
        name: the key in `feature_spec`.
        dtype: numpy dtype name of its values on disk.
        cardinality: number of distinct ids (categorical features only); the
            string "auto" only in specs given to preproc.transcode.
        hotness: ids per row (categorical only); 1 is one-hot, stored as `[N]`;
            0 is a variable number of ids per row (`hotness: variable`), stored
            as values and offsets.
    """

    name: str
    dtype: str
    cardinality: int | str | None = None
    hotness: int = 1

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.dtype).itemsize)

    @property
    def is_variable_length(self) -> bool:
        return self.hotness == 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype}
        if self.cardinality is not None:
            out["cardinality"] = self.cardinality
        if self.hotness != 1:
            out["hotness"] = VARIABLE_HOTNESS if self.is_variable_length else self.hotness
        return out


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A group of features stored together in `files` (one file for split_binary)."""

    type: str
    features: tuple[str, ...]
    files: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "features": list(self.features), "files": list(self.files)}


@dataclasses.dataclass(frozen=True)
class SplitFiles:
    """The absolute paths of one mapping's split-binary files."""

    label: Path
    numerical: Path | None
    categorical: dict[str, Path]
    offsets: dict[str, Path] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """A validated dataset description. Build it with `load`, `from_dict` or helpers.

    Construction validates structure; `check_files` (done by `load` by default)
    additionally checks that every file exists.
    """

    features: Mapping[str, Feature]
    source_spec: Mapping[str, tuple[Chunk, ...]]
    channel_spec: Mapping[str, tuple[str, ...]]
    metadata: Mapping[str, Any]
    base_directory: Path
    allow_auto_cardinality: bool = False

    def __post_init__(self) -> None:
        _validate(self)

    # ----------------------------------------------------------------- loading

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        check_files: bool = True,
        required_mappings: Sequence[str] = (),
        allow_auto_cardinality: bool = False,
    ) -> FeatureSpec:
        """Reads and validates a `feature_spec.yaml`.

        Args:
            path: the YAML file, or a directory holding `feature_spec.yaml`.
            check_files: also check that every file named by `source_spec` exists.
            required_mappings: mappings that must be present (e.g. "train", "test").
            allow_auto_cardinality: accept cardinality "auto" (transcode input).

        Raises:
            FeatureSpecError: naming the file, the key path, the expected and the
                actual value.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "feature_spec.yaml"
        try:
            text = path.read_text()
        except OSError as err:
            raise FeatureSpecError(f"cannot read feature spec: {err}", source=str(path)) from err
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise FeatureSpecError(f"not valid YAML: {err}", source=str(path)) from err
        try:
            spec = cls.from_dict(
                raw, base_directory=path.parent, allow_auto_cardinality=allow_auto_cardinality
            )
            for mapping in required_mappings:
                spec.chunks(mapping)
            if check_files:
                spec.check_files()
        except FeatureSpecError as err:
            raise err.with_source(str(path)) from None
        return spec

    @classmethod
    def from_dict(
        cls,
        raw: Any,
        base_directory: str | os.PathLike[str] = ".",
        allow_auto_cardinality: bool = False,
    ) -> FeatureSpec:
        """Builds a FeatureSpec from the parsed YAML structure (validating it)."""
        if not isinstance(raw, Mapping):
            raise FeatureSpecError(
                f"<root>: expected a mapping with keys {', '.join(SECTIONS)}, "
                f"got {type(raw).__name__}"
            )
        for section in SECTIONS:
            if section not in raw:
                raise FeatureSpecError(
                    f"{section}: missing section; expected top-level keys "
                    f"{', '.join(SECTIONS)} (and optional metadata), got {sorted(raw)}"
                )
        features = _parse_features(raw["feature_spec"])
        source_spec = _parse_source_spec(raw["source_spec"])
        channel_spec = _parse_channel_spec(raw["channel_spec"])
        metadata = raw.get("metadata") or {}
        if not isinstance(metadata, Mapping):
            raise FeatureSpecError(f"metadata: expected a mapping, got {type(metadata).__name__}")
        return cls(
            features=features,
            source_spec=source_spec,
            channel_spec=channel_spec,
            metadata=dict(metadata),
            base_directory=Path(base_directory),
            allow_auto_cardinality=allow_auto_cardinality,
        )

    # ----------------------------------------------------------------- dumping

    def to_dict(self) -> dict[str, Any]:
        """The YAML structure, in NVIDIA's key order."""
        return {
            "channel_spec": {name: list(feats) for name, feats in self.channel_spec.items()},
            "feature_spec": {name: f.to_dict() for name, f in self.features.items()},
            "metadata": dict(self.metadata),
            "source_spec": {
                mapping: [chunk.to_dict() for chunk in chunks]
                for mapping, chunks in self.source_spec.items()
            },
        }

    def dump(self, path: str | os.PathLike[str]) -> Path:
        """Writes the YAML atomically (`.<name>.partial` beside it, then renamed)."""
        path = Path(path)
        if path.is_dir():
            path = path / "feature_spec.yaml"
        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)
        return write_file_atomically(path, text)

    # ----------------------------------------------------------------- queries

    @property
    def label_feature(self) -> Feature:
        return self.features[self.channel_spec[LABEL_CHANNEL][0]]

    @property
    def numerical_features(self) -> tuple[Feature, ...]:
        return tuple(self.features[n] for n in self.channel_spec[NUMERICAL_CHANNEL])

    @property
    def categorical_features(self) -> tuple[Feature, ...]:
        return tuple(self.features[n] for n in self.channel_spec[CATEGORICAL_CHANNEL])

    @property
    def cardinalities(self) -> tuple[int, ...]:
        """Per categorical feature, in channel order. Fails on "auto" cardinalities."""
        out = []
        for feature in self.categorical_features:
            if not isinstance(feature.cardinality, int):
                raise FeatureSpecError(
                    f"feature_spec.{feature.name}.cardinality: expected a positive int "
                    f"(computed), got {feature.cardinality!r}"
                )
            out.append(feature.cardinality)
        return tuple(out)

    @property
    def hotness(self) -> tuple[int, ...]:
        """Ids per row per categorical feature; 0 for a variable-length one."""
        return tuple(f.hotness for f in self.categorical_features)

    @property
    def mappings(self) -> tuple[str, ...]:
        return tuple(self.source_spec)

    def chunks(self, mapping: str) -> tuple[Chunk, ...]:
        if mapping not in self.source_spec:
            raise FeatureSpecError(
                f"source_spec.{mapping}: mapping missing; expected it among the "
                f"mappings, got {sorted(self.source_spec)}"
            )
        return self.source_spec[mapping]

    def files(self, mapping: str) -> SplitFiles:
        """The absolute paths of a mapping's label, numerical and categorical files."""
        label: Path | None = None
        numerical: Path | None = None
        categorical: dict[str, Path] = {}
        offsets: dict[str, Path] = {}
        for chunk in self.chunks(mapping):
            path = self.base_directory / chunk.files[0]
            first = chunk.features[0]
            if first in self.channel_spec[LABEL_CHANNEL]:
                label = path
            elif first in self.channel_spec[NUMERICAL_CHANNEL]:
                numerical = path
            else:
                categorical[first] = path
                if len(chunk.files) == 2:
                    offsets[first] = self.base_directory / chunk.files[1]
        assert label is not None  # guaranteed by _validate_mapping
        ordered = {f.name: categorical[f.name] for f in self.categorical_features}
        return SplitFiles(label=label, numerical=numerical, categorical=ordered, offsets=offsets)

    def check_files(self) -> None:
        """Raises FeatureSpecError naming the first file that does not exist."""
        for mapping, chunks in self.source_spec.items():
            for index, chunk in enumerate(chunks):
                for file in chunk.files:
                    path = self.base_directory / file
                    if not path.is_file():
                        raise FeatureSpecError(
                            f"source_spec.{mapping}[{index}].files: expected an existing "
                            f"file, got {str(path)!r} (missing)"
                        )


# --------------------------------------------------------------------- parsing


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_features(raw: Any) -> dict[str, Feature]:
    if not isinstance(raw, Mapping) or not raw:
        raise FeatureSpecError(
            f"feature_spec: expected a non-empty mapping of feature name -> "
            f"{{dtype, cardinality}}, got {raw!r}"
        )
    features = {}
    for name, entry in raw.items():
        key = f"feature_spec.{name}"
        if not isinstance(entry, Mapping):
            raise FeatureSpecError(f"{key}: expected a mapping with 'dtype', got {entry!r}")
        if "dtype" not in entry:
            raise FeatureSpecError(f"{key}.dtype: missing; expected a numpy dtype name")
        known = {"dtype", "cardinality", "hotness"}
        unknown = sorted(set(entry) - known)
        if unknown:
            raise FeatureSpecError(f"{key}: unknown keys {unknown}; expected only {sorted(known)}")
        hotness = entry.get("hotness", 1)
        if hotness == VARIABLE_HOTNESS:
            hotness = 0
        elif not _is_int(hotness) or hotness < 1:
            raise FeatureSpecError(
                f"{key}.hotness: expected a positive int or {VARIABLE_HOTNESS!r}, got {hotness!r}"
            )
        features[str(name)] = Feature(
            name=str(name),
            dtype=str(entry["dtype"]),
            cardinality=entry.get("cardinality"),
            hotness=hotness,
        )
    return features


def _parse_source_spec(raw: Any) -> dict[str, tuple[Chunk, ...]]:
    if not isinstance(raw, Mapping) or not raw:
        raise FeatureSpecError(
            f"source_spec: expected a non-empty mapping of mapping name "
            f"(e.g. train, test) -> list of chunks, got {raw!r}"
        )
    out = {}
    for mapping, chunks in raw.items():
        key = f"source_spec.{mapping}"
        if not isinstance(chunks, list) or not chunks:
            raise FeatureSpecError(f"{key}: expected a non-empty list of chunks, got {chunks!r}")
        parsed = []
        for index, chunk in enumerate(chunks):
            ckey = f"{key}[{index}]"
            if not isinstance(chunk, Mapping):
                raise FeatureSpecError(
                    f"{ckey}: expected a mapping with type, features, files; got {chunk!r}"
                )
            for field in ("type", "features", "files"):
                if field not in chunk:
                    raise FeatureSpecError(f"{ckey}.{field}: missing")
            for field in ("features", "files"):
                value = chunk[field]
                if not isinstance(value, list) or not value:
                    raise FeatureSpecError(
                        f"{ckey}.{field}: expected a non-empty list, got {value!r}"
                    )
            parsed.append(
                Chunk(
                    type=str(chunk["type"]),
                    features=tuple(str(f) for f in chunk["features"]),
                    files=tuple(str(f) for f in chunk["files"]),
                )
            )
        out[str(mapping)] = tuple(parsed)
    return out


def _parse_channel_spec(raw: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(raw, Mapping):
        raise FeatureSpecError(
            f"channel_spec: expected a mapping with channels {', '.join(CHANNELS)}, got {raw!r}"
        )
    out = {}
    for channel in CHANNELS:
        if channel not in raw:
            raise FeatureSpecError(
                f"channel_spec.{channel}: missing channel; expected channels "
                f"{', '.join(CHANNELS)}, got {sorted(raw)}"
            )
        names = raw[channel]
        if names is None:
            names = []
        if not isinstance(names, list):
            raise FeatureSpecError(
                f"channel_spec.{channel}: expected a list of feature names, got {names!r}"
            )
        out[channel] = tuple(str(n) for n in names)
    unknown = sorted(set(raw) - set(CHANNELS))
    if unknown:
        raise FeatureSpecError(
            f"channel_spec: unknown channels {unknown}; expected only {', '.join(CHANNELS)}"
        )
    return out


# ------------------------------------------------------------------ validation


def _validate(spec: FeatureSpec) -> None:
    channels = spec.channel_spec
    label = channels[LABEL_CHANNEL]
    if len(label) != 1:
        raise FeatureSpecError(
            f"channel_spec.label: expected exactly one feature, got {len(label)}: {list(label)}"
        )
    if not channels[CATEGORICAL_CHANNEL] and not channels[NUMERICAL_CHANNEL]:
        raise FeatureSpecError(
            "channel_spec: expected at least one numerical or categorical feature, got none"
        )
    channel_of: dict[str, str] = {}
    for channel in CHANNELS:
        for name in channels[channel]:
            if name not in spec.features:
                raise FeatureSpecError(
                    f"channel_spec.{channel}: feature {name!r} is not in feature_spec; "
                    f"expected one of {sorted(spec.features)}"
                )
            if name in channel_of:
                raise FeatureSpecError(
                    f"channel_spec: feature {name!r} is in two channels "
                    f"({channel_of[name]} and {channel}); expected exactly one"
                )
            channel_of[name] = channel
    for name in spec.features:
        if name not in channel_of:
            raise FeatureSpecError(
                f"feature_spec.{name}: feature is in no channel; expected it under "
                f"channel_spec.{{{', '.join(CHANNELS)}}}"
            )
    for name, feature in spec.features.items():
        _validate_feature(feature, channel_of[name], spec.allow_auto_cardinality)
    for mapping, chunks in spec.source_spec.items():
        _validate_mapping(mapping, chunks, spec, channel_of)


def _validate_feature(feature: Feature, channel: str, allow_auto: bool) -> None:
    key = f"feature_spec.{feature.name}"
    allowed = _CHANNEL_DTYPES[channel]
    if feature.dtype not in allowed:
        raise FeatureSpecError(
            f"{key}.dtype: unknown dtype for a {channel} feature; expected one of "
            f"{list(allowed)}, got {feature.dtype!r}"
        )
    if channel != CATEGORICAL_CHANNEL:
        if feature.cardinality is not None or feature.hotness != 1:
            raise FeatureSpecError(
                f"{key}: cardinality/hotness apply to categorical features only; "
                f"{feature.name!r} is {channel}"
            )
        return
    cardinality = feature.cardinality
    if cardinality == AUTO_CARDINALITY and allow_auto:
        return
    if not _is_int(cardinality) or cardinality < 1:  # type: ignore[operator]
        expected = "a positive int" + (' or "auto"' if allow_auto else "")
        raise FeatureSpecError(f"{key}.cardinality: expected {expected}, got {cardinality!r}")
    limit = int(np.iinfo(feature.dtype).max) + 1
    if cardinality > limit:  # type: ignore[operator]
        raise FeatureSpecError(
            f"{key}.cardinality: {cardinality} ids do not fit dtype {feature.dtype} "
            f"(at most {limit}); expected dtype {minimal_categorical_dtype(cardinality)}"  # type: ignore[arg-type]
        )


def _validate_mapping(
    mapping: str,
    chunks: Iterable[Chunk],
    spec: FeatureSpec,
    channel_of: Mapping[str, str],
) -> None:
    covered: dict[str, int] = {}
    for index, chunk in enumerate(chunks):
        key = f"source_spec.{mapping}[{index}]"
        _check_chunk_type(key, chunk)
        _check_chunk_files(key, chunk, spec)
        _cover_chunk_features(key, index, chunk, spec, covered)
        _check_chunk_channel(key, chunk, spec, channel_of)
    _check_every_feature_covered(mapping, spec, covered)


def _check_chunk_type(key: str, chunk: Chunk) -> None:
    if chunk.type not in CHUNK_TYPES:
        raise FeatureSpecError(
            f"{key}.type: unknown chunk type; expected one of {list(CHUNK_TYPES)}, "
            f"got {chunk.type!r}"
        )


def _check_chunk_files(key: str, chunk: Chunk, spec: FeatureSpec) -> None:
    """One file, or two (its ids and its row offsets) for a variable-length feature."""
    variable = any(
        name in spec.features and spec.features[name].is_variable_length for name in chunk.features
    )
    if variable and len(chunk.files) != 2:
        raise FeatureSpecError(
            f"{key}.files: a variable-length feature is two files, its ids and its "
            f"{OFFSETS_DTYPE} row offsets; expected 2 files, got {len(chunk.files)}: "
            f"{list(chunk.files)}"
        )
    if not variable and len(chunk.files) != 1:
        raise FeatureSpecError(
            f"{key}.files: a split_binary chunk is one file; expected 1 file, "
            f"got {len(chunk.files)}: {list(chunk.files)}"
        )


def _cover_chunk_features(
    key: str, index: int, chunk: Chunk, spec: FeatureSpec, covered: dict[str, int]
) -> None:
    """Adds the features of chunk `index` to `covered` (feature -> chunk), each a
    feature of feature_spec not covered yet."""
    for name in chunk.features:
        if name not in spec.features:
            raise FeatureSpecError(
                f"{key}.features: feature {name!r} is not in feature_spec; expected "
                f"one of {sorted(spec.features)}"
            )
        if name in covered:
            raise FeatureSpecError(
                f"{key}.features: feature {name!r} is already in chunk "
                f"{covered[name]} of this mapping; expected each feature in one chunk"
            )
        covered[name] = index


def _check_chunk_channel(
    key: str, chunk: Chunk, spec: FeatureSpec, channel_of: Mapping[str, str]
) -> None:
    """The features of one channel: all numerical ones in channel order, or one
    categorical one."""
    channels = {channel_of[name] for name in chunk.features}
    if len(channels) != 1:
        raise FeatureSpecError(
            f"{key}.features: expected features of one channel per chunk, got "
            f"{sorted(channels)} in {list(chunk.features)}"
        )
    channel = channels.pop()
    numerical = spec.channel_spec[NUMERICAL_CHANNEL]
    if channel == NUMERICAL_CHANNEL and chunk.features != numerical:
        raise FeatureSpecError(
            f"{key}.features: a split_binary numerical chunk holds all numerical "
            f"features in channel order; expected {list(numerical)}, "
            f"got {list(chunk.features)}"
        )
    if channel == CATEGORICAL_CHANNEL and len(chunk.features) != 1:
        raise FeatureSpecError(
            f"{key}.features: a split_binary categorical chunk holds one feature; "
            f"got {list(chunk.features)}"
        )


def _check_every_feature_covered(
    mapping: str, spec: FeatureSpec, covered: Mapping[str, int]
) -> None:
    missing = [name for name in spec.features if name not in covered]
    if missing:
        raise FeatureSpecError(
            f"source_spec.{mapping}: features {missing} are in no chunk; expected every "
            f"feature of feature_spec in exactly one chunk"
        )
