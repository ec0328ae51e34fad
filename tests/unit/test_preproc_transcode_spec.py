"""preproc.transcode's input: the spec with csv chunks, `auto` cardinalities and
`hotness: variable` list columns, --input, --delimiter and --list_delimiter, and
errors that name the file, key or flag (no Spark)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from feature_spec import FeatureSpecError
from preproc.errors import PreprocessingError
from preproc.layout import CategoricalColumn, CategoricalKind, InputLayout, NumericalKind
from preproc.transcode import (
    build_layout,
    build_parser,
    parse_delimiter,
    parse_inputs,
    parse_list_delimiter,
    read_input_spec,
    transcode_config,
)


def spec_dict(**changes: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "channel_spec": {"label": ["y"], "numerical": ["a", "b"], "categorical": ["c", "d"]},
        "feature_spec": {
            "y": {"dtype": "bool"},
            "a": {"dtype": "float16"},
            "b": {"dtype": "float16"},
            "c": {"dtype": "int32", "cardinality": "auto"},
            "d": {"dtype": "int8", "cardinality": 7},
        },
        "source_spec": {
            "train": [{"type": "csv", "features": ["d", "y", "b", "a", "c"], "files": ["t.csv"]}],
            "test": [{"type": "csv", "features": ["d", "y", "b", "a", "c"], "files": ["e.csv"]}],
        },
    }
    spec.update(changes)
    return spec


def write(tmp_path: Path, spec: dict[str, Any]) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_reads_columns_files_and_auto(tmp_path: Path) -> None:
    spec, columns, files = read_input_spec(write(tmp_path, spec_dict()))
    assert columns == ("d", "y", "b", "a", "c")
    assert files == {"train": [tmp_path / "t.csv"], "test": [tmp_path / "e.csv"]}
    layout = build_layout(spec, columns, ",")
    assert layout.fields == columns and layout.label_source == "y"
    assert [c.name for c in layout.numerical] == ["a", "b"]  # channel order
    categorical = [("c", CategoricalKind.TOKEN, None), ("d", CategoricalKind.ID, 7)]
    assert [(c.name, c.kind, c.cardinality) for c in layout.categorical] == categorical
    assert layout.vocabulary_columns == (0,)


def test_without_csv_chunks_columns_follow_the_channels(tmp_path: Path) -> None:
    spec, columns, files = read_input_spec(write(tmp_path, spec_dict(source_spec={})))
    assert columns is None and files == {}
    assert build_layout(spec, columns, "\t").fields == ("y", "a", "b", "c", "d")


FEATURES = spec_dict()["feature_spec"]
BINARY_CHUNK = {"type": "split_binary", "features": ["y"], "files": ["x"]}
SHORT_CSV_CHUNK = {"type": "csv", "features": ["y", "a"], "files": ["t"]}
TOO_FEW_CHANNELS = {"label": ["y"], "numerical": ["a", "b"], "categorical": ["c"]}
BAD_CARDINALITY = {**FEATURES, "c": {"dtype": "int32", "cardinality": "many"}}
MULTI_HOT = {**FEATURES, "d": {"dtype": "int8", "cardinality": 7, "hotness": 2}}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"source_spec": {"train": [BINARY_CHUNK]}},
            r"source_spec.train\[0\].type: transcode reads delimited text; expected 'csv'",
        ),
        ({"source_spec": {"train": [SHORT_CSV_CHUNK]}}, "the csv columns must be every feature"),
        ({"channel_spec": TOO_FEW_CHANNELS}, r"feature_spec.d: feature is in no channel"),
        (
            {"feature_spec": BAD_CARDINALITY},
            r"feature_spec.c.cardinality: expected a positive int or \"auto\", got 'many'",
        ),
        (
            {"feature_spec": MULTI_HOT},
            r"feature_spec.d.hotness: transcode reads one value or a list of values per "
            r"field; expected 1 or 'variable', got 2 \(a fixed number of ids per row is not "
            r"supported: declare it 'variable'",
        ),
        (
            {"feature_spec": {**FEATURES, "a": {"dtype": "float16", "hotness": "variable"}}},
            r"feature_spec.a: cardinality/hotness apply to categorical features only",
        ),
    ],
)
def test_spec_errors_name_the_file_and_key(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    path = write(tmp_path, spec_dict(**changes))
    with pytest.raises(FeatureSpecError, match=message) as caught:
        read_input_spec(path)
    assert str(caught.value).startswith(str(path))


def test_inputs_and_delimiters() -> None:
    assert parse_inputs(["a.csv", "test=b.csv,c.csv", "x=y/z=1.csv"]) == {
        "train": [Path("a.csv")],
        "test": [Path("b.csv"), Path("c.csv")],
        "x": [Path("y/z=1.csv")],
    }
    assert parse_delimiter(None, Path("part.tsv.gz")) == "\t"
    assert parse_delimiter(None, Path("part.csv")) == ","
    assert parse_delimiter("tab", Path("x")) == "\t" and parse_delimiter("|", Path("x")) == "|"
    with pytest.raises(PreprocessingError, match="--delimiter"):
        parse_delimiter("\n", Path("x"))


VARIABLE = {
    **FEATURES,
    "c": {"dtype": "int32", "cardinality": "auto", "hotness": "variable"},
    "d": {"dtype": "int8", "cardinality": 7, "hotness": "variable"},
}


def test_variable_hotness_features_are_list_columns(tmp_path: Path) -> None:
    spec, columns, _ = read_input_spec(write(tmp_path, spec_dict(feature_spec=VARIABLE)))
    assert [f.is_variable_length for f in spec.categorical_features] == [True, True]
    layout = build_layout(spec, columns, ",")
    categorical = [("c", CategoricalKind.TOKEN, True), ("d", CategoricalKind.ID, True)]
    assert [(c.name, c.kind, c.variable_length) for c in layout.categorical] == categorical
    assert layout.variable_length == (True, True) and layout.vocabulary_columns == (0,)
    assert layout.list_delimiter == "|"  # the default beside commas
    assert build_layout(spec, columns, "|").list_delimiter == ";"
    assert build_layout(spec, columns, "\t", ",").list_delimiter == ","
    one_hot, columns, _ = read_input_spec(write(tmp_path, spec_dict()))
    assert build_layout(one_hot, columns, ",", ";").list_delimiter is None  # unused


def test_list_delimiters() -> None:
    assert parse_list_delimiter(None, ",") == "|" and parse_list_delimiter(None, "\t") == "|"
    assert parse_list_delimiter(None, "|") == ";" and parse_list_delimiter(None, "|;") == ","
    assert parse_list_delimiter("semicolon", ",") == ";"
    assert parse_list_delimiter("::", "\t") == "::"
    clash = (
        r"--list_delimiter: expected a separator apart from the field delimiter ',' "
        r"\(neither may contain the other\), got ','"
    )
    with pytest.raises(PreprocessingError, match=clash):
        parse_list_delimiter(",", ",")
    with pytest.raises(PreprocessingError, match=r"--list_delimiter: .* got ',,'"):
        parse_list_delimiter(",,", ",")
    with pytest.raises(PreprocessingError, match="--list_delimiter: expected a separator such"):
        parse_list_delimiter("", ",")
    with pytest.raises(PreprocessingError, match=r"all clash with the field delimiter '\|;,'"):
        parse_list_delimiter(None, "|;,")


def test_layout_needs_a_list_delimiter_for_list_columns() -> None:
    def layout(list_delimiter: str | None) -> InputLayout:
        return InputLayout(
            delimiter="\t",
            fields=("y", "tags"),
            label_source="y",
            label_name="y",
            numerical=(),
            numerical_kind=NumericalKind.FLOAT,
            categorical=(CategoricalColumn("tags", "tags", CategoricalKind.TOKEN, None, True),),
            list_delimiter=list_delimiter,
        )

    assert layout("|").variable_length == (True,)
    needed = r"expected one for the variable-length .*\['tags'\]"
    with pytest.raises(PreprocessingError, match=needed):
        layout(None)
    with pytest.raises(PreprocessingError, match="apart from the field delimiter"):
        layout("\t")


def test_config_from_flags(tmp_path: Path) -> None:
    def from_flags(spec: dict[str, Any], *flags: str, output_dir: str = "o") -> Any:
        """The config of `flags`, with `spec` written for --feature_spec."""
        args = ["--feature_spec", str(write(tmp_path, spec)), "--output_dir", output_dir, *flags]
        return transcode_config(build_parser().parse_args(args))

    for name in ("t.csv", "e.csv", "more.tsv"):
        (tmp_path / name).write_text("")
    out = str(tmp_path / "out")
    more = f"validation={tmp_path / 'more.tsv'}"
    config = from_flags(spec_dict(), "--input", more, "--frequency_threshold", "3", output_dir=out)
    assert config.mappings == ("train", "test", "validation")
    assert config.layout.delimiter == ","  # from the first train file
    assert config.frequency_thresholds == (3, 3)
    assert config.shuffle_train and config.numerical_transform.value == "none"
    assert config.layout.list_delimiter is None  # no list column
    lists = spec_dict(feature_spec=VARIABLE)
    assert from_flags(lists, "--list_delimiter", "pipe").layout.list_delimiter == "|"
    with pytest.raises(PreprocessingError, match="--list_delimiter: expected a separator apart"):
        from_flags(lists, "--list_delimiter", ",")
    with pytest.raises(PreprocessingError, match=r"input file nowhere\.csv: expected an existing"):
        from_flags(lists, "--input", "train=nowhere.csv", output_dir=out)
    with pytest.raises(PreprocessingError, match="--input: expected the files of the 'train'"):
        from_flags(spec_dict(source_spec={}))
