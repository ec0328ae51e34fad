"""FeatureSpec: loading, round trip, helpers, and one test per validation rule."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from feature_spec import (
    CRITEO_1TB_MLPERF_CARDINALITIES,
    FeatureSpec,
    FeatureSpecError,
    build_split_binary_spec,
    criteo_feature_spec,
    minimal_categorical_dtype,
)

# NVIDIA's layout, written by hand: label, 2 numerical in one chunk, 2 categorical.
VALID_YAML = """
channel_spec:
  categorical: [cat_0, cat_1]
  label: [label]
  numerical: [num_0, num_1]
feature_spec:
  cat_0: {cardinality: 23, dtype: int8}
  cat_1: {cardinality: 40000, dtype: int32, hotness: 3}
  label: {dtype: bool}
  num_0: {dtype: float16}
  num_1: {dtype: float16}
metadata: {}
source_spec:
  train:
  - {features: [num_0, num_1], files: [train/numerical.bin], type: split_binary}
  - {features: [label], files: [train/label.bin], type: split_binary}
  - {features: [cat_0], files: [train/cat_0.bin], type: split_binary}
  - {features: [cat_1], files: [train/cat_1.bin], type: split_binary}
  test:
  - {features: [num_0, num_1], files: [test/numerical.bin], type: split_binary}
  - {features: [label], files: [test/label.bin], type: split_binary}
  - {features: [cat_0], files: [test/cat_0.bin], type: split_binary}
  - {features: [cat_1], files: [test/cat_1.bin], type: split_binary}
"""


def valid() -> dict[str, Any]:
    return yaml.safe_load(VALID_YAML)


def write_spec(directory: Path, raw: Any, with_files: bool = True) -> Path:
    path = directory / "feature_spec.yaml"
    path.write_text(yaml.safe_dump(raw) if not isinstance(raw, str) else raw)
    if with_files and isinstance(raw, dict):
        for chunks in (raw.get("source_spec") or {}).values():
            for chunk in chunks or []:
                for file in chunk.get("files") or []:
                    (directory / file).parent.mkdir(parents=True, exist_ok=True)
                    (directory / file).touch()
    return path


def load_error(tmp_path: Path, raw: Any, **kwargs: Any) -> str:
    path = write_spec(tmp_path, raw)
    with pytest.raises(FeatureSpecError) as info:
        FeatureSpec.load(path, **kwargs)
    message = str(info.value)
    assert str(path) in message, message  # every error names the file
    return message


# ------------------------------------------------------------------- valid specs


def test_loads_nvidia_layout(tmp_path: Path) -> None:
    spec = FeatureSpec.load(write_spec(tmp_path, valid()))
    assert spec.label_feature.name == "label"
    assert [f.name for f in spec.numerical_features] == ["num_0", "num_1"]
    assert spec.cardinalities == (23, 40000)
    assert spec.hotness == (1, 3)
    files = spec.files("test")
    assert files.label == tmp_path / "test/label.bin"
    assert files.numerical == tmp_path / "test/numerical.bin"
    assert list(files.categorical) == ["cat_0", "cat_1"]
    assert files.categorical["cat_1"] == tmp_path / "test/cat_1.bin"


def test_load_accepts_directory(tmp_path: Path) -> None:
    write_spec(tmp_path, valid())
    assert FeatureSpec.load(tmp_path).cardinalities == (23, 40000)


def test_dump_round_trip(tmp_path: Path) -> None:
    spec = FeatureSpec.load(write_spec(tmp_path, valid()))
    out = tmp_path / "copy"
    out.mkdir()
    spec.dump(out / "feature_spec.yaml")
    again = FeatureSpec.from_dict(yaml.safe_load((out / "feature_spec.yaml").read_text()), tmp_path)
    assert again == spec
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_numerical_channel_may_be_empty(tmp_path: Path) -> None:
    raw = valid()
    raw["channel_spec"]["numerical"] = []
    for name in ("num_0", "num_1"):
        del raw["feature_spec"][name]
    for mapping in ("train", "test"):
        raw["source_spec"][mapping] = raw["source_spec"][mapping][1:]
    spec = FeatureSpec.load(write_spec(tmp_path, raw))
    assert spec.files("train").numerical is None


@pytest.mark.parametrize(
    ("cardinality", "dtype"),
    [
        (1, "int8"),
        (128, "int8"),
        (129, "int16"),
        (32768, "int16"),
        (32769, "int32"),
        (2**31, "int32"),
        (2**31 + 1, "int64"),  # tables of more than 2^31 rows
    ],
)
def test_minimal_categorical_dtype(cardinality: int, dtype: str) -> None:
    assert minimal_categorical_dtype(cardinality) == dtype


@pytest.mark.parametrize("bad", [0, -3, 2**63 + 1, 2.5, True])
def test_minimal_categorical_dtype_rejects(bad: Any) -> None:
    with pytest.raises(FeatureSpecError, match="cardinality"):
        minimal_categorical_dtype(bad)


def test_criteo_default_spec() -> None:
    spec = criteo_feature_spec()
    assert len(spec.numerical_features) == 13
    assert len(spec.categorical_features) == 26
    assert spec.cardinalities == CRITEO_1TB_MLPERF_CARDINALITIES
    dtypes = {f.name: f.dtype for f in spec.categorical_features}
    assert dtypes["cat_0"] == "int32" and dtypes["cat_5"] == "int8" and dtypes["cat_2"] == "int16"
    assert spec.mappings == ("train", "test")
    assert spec.files("train").categorical["cat_25"].as_posix().endswith("train/cat_25.bin")


def test_criteo_spec_needs_26_tables() -> None:
    with pytest.raises(FeatureSpecError, match="expected 26"):
        criteo_feature_spec(cardinalities=(10, 20))


def test_build_spec_with_multi_hot() -> None:
    spec = build_split_binary_spec([7, 11], 3, hotness=[1, 4], mappings=("train",))
    assert spec.hotness == (1, 4)
    feature = spec.to_dict()["feature_spec"]["cat_1"]
    assert feature == {"dtype": "int8", "cardinality": 11, "hotness": 4}


# --------------------------------------------------------------- one per rule


# Each rule: a change to the valid spec, and the parts of the error it makes.
Change = Callable[[dict[str, Any]], object]
RULES: dict[str, tuple[Change, list[str]]] = {
    "missing_section": (lambda raw: raw.pop("channel_spec"), ["channel_spec: missing section"]),
    "unknown_dtype": (
        lambda raw: raw["feature_spec"]["num_1"].update(dtype="float64"),
        ["feature_spec.num_1.dtype", "['float16']", "'float64'"],
    ),
    "categorical_dtype_too_small_for_cardinality": (
        lambda raw: raw["feature_spec"]["cat_0"].update(cardinality=300),
        ["feature_spec.cat_0.cardinality", "expected dtype int16"],
    ),
    "feature_in_no_channel": (
        lambda raw: raw["feature_spec"].update(orphan={"dtype": "float16"}),
        ["feature_spec.orphan: feature is in no channel"],
    ),
    "feature_in_two_channels": (
        lambda raw: raw["channel_spec"]["numerical"].append("cat_0"),
        ["'cat_0' is in two channels (numerical and categorical)"],
    ),
    "channel_names_unknown_feature": (
        lambda raw: raw["channel_spec"]["categorical"].append("cat_9"),
        ["channel_spec.categorical: feature 'cat_9' is not in feature_spec"],
    ),
    "missing_channel": (
        lambda raw: raw["channel_spec"].pop("numerical"),
        ["channel_spec.numerical: missing channel"],
    ),
    "unknown_chunk_type": (
        lambda raw: raw["source_spec"]["test"][2].update(type="parquet"),
        ["source_spec.test[2].type: unknown chunk type", "'parquet'"],
    ),
    "bad_hotness": (
        lambda raw: raw["feature_spec"]["cat_1"].update(hotness=0),
        ["feature_spec.cat_1.hotness: expected a positive int or 'variable', got 0"],
    ),
    "feature_in_no_chunk": (
        lambda raw: raw["source_spec"]["train"].pop(3),
        ["source_spec.train: features ['cat_1'] are in no chunk"],
    ),
    "feature_in_two_chunks": (
        lambda raw: raw["source_spec"]["train"].append(
            copy.deepcopy(raw["source_spec"]["train"][2])
        ),
        ["'cat_0' is already in chunk 2"],
    ),
    "numerical_chunk_must_hold_all_numerical": (
        lambda raw: raw["source_spec"]["train"][0].update(features=["num_1", "num_0"]),
        ["expected ['num_0', 'num_1']"],
    ),
    "split_binary_chunk_is_one_file": (
        lambda raw: raw["source_spec"]["train"][2].update(files=["train/a.bin", "train/b.bin"]),
        ["source_spec.train[2].files: a split_binary chunk is one file"],
    ),
    "unknown_feature_key": (
        lambda raw: raw["feature_spec"]["cat_0"].update(cardinalty=5),
        ["feature_spec.cat_0: unknown keys ['cardinalty']"],
    ),
    "cardinality_on_numerical_feature": (
        lambda raw: raw["feature_spec"]["num_0"].update(cardinality=5),
        ["apply to categorical features only"],
    ),
}


@pytest.mark.parametrize(("change", "parts"), RULES.values(), ids=list(RULES))
def test_spec_breaking_a_rule(tmp_path: Path, change: Change, parts: list[str]) -> None:
    raw = valid()
    change(raw)
    message = load_error(tmp_path, raw)
    for part in parts:
        assert part in message


def test_not_a_mapping(tmp_path: Path) -> None:
    assert "<root>: expected a mapping" in load_error(tmp_path, ["a", "list"])


def test_invalid_yaml(tmp_path: Path) -> None:
    path = write_spec(tmp_path, "feature_spec: [unclosed")
    with pytest.raises(FeatureSpecError, match="not valid YAML"):
        FeatureSpec.load(path)


def test_missing_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(FeatureSpecError, match="cannot read feature spec"):
        FeatureSpec.load(tmp_path / "nope.yaml")


def test_missing_file(tmp_path: Path) -> None:
    path = write_spec(tmp_path, valid())
    (tmp_path / "test/cat_1.bin").unlink()
    with pytest.raises(FeatureSpecError) as info:
        FeatureSpec.load(path)
    assert "source_spec.test[3].files" in str(info.value)
    assert "test/cat_1.bin" in str(info.value) and "missing" in str(info.value)
    FeatureSpec.load(path, check_files=False)  # structure alone is valid


def test_mapping_missing(tmp_path: Path) -> None:
    raw = valid()
    del raw["source_spec"]["test"]
    message = load_error(tmp_path, raw, required_mappings=("train", "test"))
    assert "source_spec.test: mapping missing" in message and "['train']" in message


@pytest.mark.parametrize("bad", [0, -1, "many", 2.5, None, True])
def test_cardinality_not_positive_int(tmp_path: Path, bad: Any) -> None:
    raw = valid()
    raw["feature_spec"]["cat_1"]["cardinality"] = bad
    message = load_error(tmp_path, raw)
    assert "feature_spec.cat_1.cardinality: expected a positive int" in message
    assert repr(bad) in message


def test_auto_cardinality_only_when_allowed(tmp_path: Path) -> None:
    raw = valid()
    raw["feature_spec"]["cat_1"]["cardinality"] = "auto"
    assert "positive int, got 'auto'" in load_error(tmp_path, raw)
    spec = FeatureSpec.load(tmp_path / "feature_spec.yaml", allow_auto_cardinality=True)
    with pytest.raises(FeatureSpecError, match="computed"):
        spec.cardinalities  # noqa: B018


@pytest.mark.parametrize("labels", [[], ["label", "num_0"]])
def test_label_channel_not_exactly_one(tmp_path: Path, labels: list[str]) -> None:
    raw = valid()
    raw["channel_spec"]["label"] = labels
    if labels:
        raw["channel_spec"]["numerical"].remove("num_0")
    assert "channel_spec.label: expected exactly one feature" in load_error(tmp_path, raw)


def test_categorical_chunk_holds_one_feature(tmp_path: Path) -> None:
    raw = valid()
    chunks = raw["source_spec"]["train"]
    chunks[2]["features"] = ["cat_0", "cat_1"]
    chunks.pop(3)
    assert "categorical chunk holds one feature" in load_error(tmp_path, raw)


def test_chunk_mixing_channels(tmp_path: Path) -> None:
    raw = valid()
    chunks = raw["source_spec"]["train"]
    chunks[1]["features"] = ["label", "cat_0"]
    chunks.pop(2)
    assert "expected features of one channel per chunk" in load_error(tmp_path, raw)


def test_one_rule_names_the_offsets_file_and_the_ids_dtype() -> None:
    from feature_spec import ids_dtype, minimal_categorical_dtype, offsets_file_name

    assert offsets_file_name("cat_3.bin") == "cat_3.offsets.bin"
    assert ids_dtype(["int8", "int16", "int32"]) == np.int32
    assert ids_dtype(["int8", "int64"]) == np.int64  # one wide table: every table's
    # What the loader gives a dataset stored as its cardinalities need, a SavedModel takes.
    assert ids_dtype([minimal_categorical_dtype(c) for c in (10, 2**31)]) == np.int32
    assert ids_dtype([minimal_categorical_dtype(c) for c in (10, 2**31 + 1)]) == np.int64
