"""Your own delimited files (CSV, TSV) -> split binary files + feature_spec.yaml.

    python -m preproc.transcode --feature_spec raw/spec.yaml --output_dir data/ \
        [--input [MAPPING=]FILE[,FILE...] ...] [--delimiter ,] [--list_delimiter '|'] \
        [--log_transform] [--frequency_threshold N] \
        [--feature_frequency_threshold NAME=N,...] [--vocabulary_from EARLIER_DATASET] \
        [--oov_buckets K] [--strict]

The input spec is a FeatureSpec whose `source_spec` chunks have `type: csv`: the
chunk's `features` are the file's columns in order, its `files` the input files
(relative to the YAML). `--input` gives or replaces a mapping's files (a bare FILE
goes to `train`); without csv chunks the columns are label, numerical, categorical
in channel order. A categorical feature with `cardinality: auto` holds any text
and gets ids from a vocabulary counted on the train files (as preproc.criteo);
one with an integer cardinality already holds ids in [0, cardinality). A
categorical feature with `hotness: variable` holds a list of such values per
field, separated by `--list_delimiter` (default `|`, or `;` when the field
delimiter is `|`); an empty field is an empty list. It is written as ids and
int64 row offsets. Labels are 0 or 1; numericals are numbers, missing -> 0,
optionally log(1 + max(x, 0)). See docs/byo_dataset.md.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from feature_spec import (
    AUTO_CARDINALITY,
    SPLIT_BINARY,
    TRAIN_MAPPING,
    VARIABLE_HOTNESS,
    FeatureSpec,
    FeatureSpecError,
    offsets_file_name,
)
from preproc.cli import add_output_flags, add_spark_flags, run_cli, run_with_spark
from preproc.config import (
    InputFile,
    NumericalTransform,
    PipelineConfig,
    parse_thresholds,
    strip_compression_suffix,
)
from preproc.errors import PreprocessingError
from preproc.layout import (
    CategoricalColumn,
    CategoricalKind,
    InputLayout,
    NumericalColumn,
    NumericalKind,
)

CSV_CHUNK = "csv"
_MAPPING_PREFIX = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)=(.+)$")
_DELIMITER_NAMES = {"tab": "\t", "\\t": "\t", "comma": ",", "semicolon": ";", "pipe": "|"}
# The default list delimiter: the first of these apart from the field delimiter.
_LIST_DELIMITERS = ("|", ";", ",")


def read_input_spec(
    path: Path,
) -> tuple[FeatureSpec, tuple[str, ...] | None, dict[str, list[Path]]]:
    """The validated input spec, its column order (None without csv chunks) and its
    files per mapping.

    Raises:
        FeatureSpecError: naming the spec file, the key path, expected and actual.
    """
    source = str(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as err:
        raise FeatureSpecError(f"cannot read feature spec: {err}", source=source) from err
    except yaml.YAMLError as err:
        raise FeatureSpecError(f"not valid YAML: {err}", source=source) from err
    if not isinstance(raw, Mapping):
        raise FeatureSpecError(f"<root>: expected a mapping, got {type(raw).__name__}", source)
    columns: tuple[str, ...] | None = None
    files: dict[str, list[Path]] = {}
    for mapping, chunks in (raw.get("source_spec") or {}).items():
        if not isinstance(chunks, list):
            raise FeatureSpecError(f"source_spec.{mapping}: expected a list of chunks", source)
        for index, chunk in enumerate(chunks):
            key = f"source_spec.{mapping}[{index}]"
            if not isinstance(chunk, Mapping) or chunk.get("type") != CSV_CHUNK:
                got = chunk.get("type") if isinstance(chunk, Mapping) else chunk
                raise FeatureSpecError(
                    f"{key}.type: transcode reads delimited text; expected {CSV_CHUNK!r}, "
                    f"got {got!r}",
                    source,
                )
            chunk_columns = tuple(str(f) for f in chunk.get("features") or [])
            if columns is not None and chunk_columns != columns:
                raise FeatureSpecError(
                    f"{key}.features: expected the same columns in every csv chunk, "
                    f"{list(columns)}, got {list(chunk_columns)}",
                    source,
                )
            columns = chunk_columns
            chunk_files = chunk.get("files") or []
            if not isinstance(chunk_files, list) or not chunk_files:
                raise FeatureSpecError(f"{key}.files: expected a non-empty list", source)
            files.setdefault(str(mapping), []).extend(path.parent / str(f) for f in chunk_files)
    spec = _validated(raw, path)
    if columns is not None:
        names = [f.name for f in spec.features.values()]
        if sorted(columns) != sorted(names) or len(set(columns)) != len(columns):
            raise FeatureSpecError(
                f"source_spec: the csv columns must be every feature once; expected "
                f"{sorted(names)}, got {list(columns)}",
                source,
            )
    return spec, columns, files


def _validated(raw: Mapping[str, Any], path: Path) -> FeatureSpec:
    """The spec's features and channels, checked by FeatureSpec's own validation; a
    stand-in split-binary source_spec replaces the csv chunks for that check."""
    features = raw.get("feature_spec")
    channels = raw.get("channel_spec")
    names = [str(n) for n in features] if isinstance(features, Mapping) else []
    numerical = channels.get("numerical") if isinstance(channels, Mapping) else None
    numerical = [str(n) for n in numerical] if isinstance(numerical, list) else []
    chunks = [
        {"type": SPLIT_BINARY, "features": [name], "files": _stand_in_files(name, features)}
        for name in names
        if name not in numerical
    ]
    if numerical:
        chunks.append({"type": SPLIT_BINARY, "features": numerical, "files": ["numerical.bin"]})
    stand_in = {**raw, "source_spec": {TRAIN_MAPPING: chunks}}
    try:
        spec = FeatureSpec.from_dict(
            stand_in, base_directory=path.parent, allow_auto_cardinality=True
        )
    except FeatureSpecError as err:
        raise err.with_source(str(path)) from None
    for feature in spec.categorical_features:
        if feature.hotness > 1:
            raise FeatureSpecError(
                f"feature_spec.{feature.name}.hotness: transcode reads one value or a list "
                f"of values per field; expected 1 or {VARIABLE_HOTNESS!r}, got "
                f"{feature.hotness} (a fixed number of ids per row is not supported: "
                f"declare it {VARIABLE_HOTNESS!r} and write the ids as a list)",
                str(path),
            )
    return spec


def _stand_in_files(name: str, features: Any) -> list[str]:
    """The split-binary files FeatureSpec expects of feature `name` of the raw
    `feature_spec` section: two (ids and offsets) when it is `hotness: variable`."""
    entries = {str(k): v for k, v in features.items()} if isinstance(features, Mapping) else {}
    entry = entries.get(name)
    variable = isinstance(entry, Mapping) and entry.get("hotness") == VARIABLE_HOTNESS
    return [f"{name}.bin", offsets_file_name(f"{name}.bin")] if variable else [f"{name}.bin"]


def parse_inputs(items: Sequence[str]) -> dict[str, list[Path]]:
    """`--input` items: `MAPPING=FILE[,FILE...]`, or a bare FILE for `train`."""
    files: dict[str, list[Path]] = {}
    for item in items:
        match = _MAPPING_PREFIX.match(item)
        mapping, paths = (match.group(1), match.group(2)) if match else (TRAIN_MAPPING, item)
        for path in paths.split(","):
            if path:
                files.setdefault(mapping, []).append(Path(path))
    return files


def parse_delimiter(text: str | None, first_file: Path) -> str:
    """The `--delimiter` value (names such as `tab` allowed), or by file extension:
    tab for .tsv, comma otherwise."""
    if text is None:
        return "\t" if strip_compression_suffix(first_file.name).endswith(".tsv") else ","
    delimiter = _DELIMITER_NAMES.get(text, text)
    if not delimiter or "\n" in delimiter or "\r" in delimiter:
        raise PreprocessingError(
            f"--delimiter: expected a separator such as , or tab, got {text!r}"
        )
    return delimiter


def parse_list_delimiter(text: str | None, delimiter: str) -> str:
    """The `--list_delimiter` value (names such as `pipe` allowed), or by default `|`
    (`;` when the field delimiter holds `|`, then `,`): never one that contains the
    field delimiter or is contained in it."""
    if text is None:
        apart = [d for d in _LIST_DELIMITERS if d not in delimiter and delimiter not in d]
        if not apart:
            raise PreprocessingError(
                f"--list_delimiter: the defaults {list(_LIST_DELIMITERS)} all clash with the "
                f"field delimiter {delimiter!r}; expected --list_delimiter to name one"
            )
        return apart[0]
    separator = _DELIMITER_NAMES.get(text, text)
    if not separator or "\n" in separator or "\r" in separator:
        raise PreprocessingError(
            f"--list_delimiter: expected a separator such as | or ;, got {text!r}"
        )
    if separator in delimiter or delimiter in separator:
        raise PreprocessingError(
            f"--list_delimiter: expected a separator apart from the field delimiter "
            f"{delimiter!r} (neither may contain the other), got {text!r}"
        )
    return separator


def build_layout(
    spec: FeatureSpec,
    columns: Sequence[str] | None,
    delimiter: str,
    list_delimiter: str | None = None,
) -> InputLayout:
    """The input layout of a validated input spec. `list_delimiter` (None: the
    default for `delimiter`) is kept only when a feature is variable-length."""
    label = spec.label_feature.name
    numerical = tuple(NumericalColumn(f.name, f.name) for f in spec.numerical_features)
    categorical = []
    for feature in spec.categorical_features:
        if feature.cardinality == AUTO_CARDINALITY:
            kind, cardinality = CategoricalKind.TOKEN, None
        else:
            kind, cardinality = CategoricalKind.ID, int(feature.cardinality)  # type: ignore[arg-type]
        categorical.append(
            CategoricalColumn(
                feature.name, feature.name, kind, cardinality, feature.is_variable_length
            )
        )
    if columns is None:
        columns = (label, *(c.name for c in numerical), *(c.name for c in categorical))
    if any(c.variable_length for c in categorical):
        if list_delimiter is None:
            list_delimiter = parse_list_delimiter(None, delimiter)
    else:
        list_delimiter = None  # unused: kept out of the parse stage's fingerprint
    return InputLayout(
        delimiter=delimiter,
        fields=tuple(columns),
        label_source=label,
        label_name=label,
        numerical=numerical,
        numerical_kind=NumericalKind.FLOAT,
        categorical=tuple(categorical),
        list_delimiter=list_delimiter,
    )


def build_parser(prog: str = "python -m preproc.transcode") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    parser.add_argument("--feature_spec", required=True, help="the input spec (YAML)")
    parser.add_argument(
        "--input",
        nargs="+",
        action="extend",
        default=[],
        metavar="[MAPPING=]FILE",
        help="input files of a mapping (bare: train); replace the spec's csv files",
    )
    parser.add_argument("--delimiter", help="field separator (default: tab for .tsv, else ,)")
    parser.add_argument(
        "--list_delimiter",
        help="separator of the values of a `hotness: variable` field (default: |, or ; "
        "when the field separator is |)",
    )
    add_output_flags(parser)
    parser.add_argument(
        "--log_transform",
        action="store_true",
        help="store log(1 + max(x, 0)) instead of the numerical value",
    )
    add_spark_flags(parser)
    return parser


def transcode_config(args: argparse.Namespace) -> PipelineConfig:
    """The pipeline configuration of parsed flags (validated; errors name the flag)."""
    spec, columns, files = read_input_spec(Path(args.feature_spec))
    files.update(parse_inputs(args.input))
    if TRAIN_MAPPING not in files:
        raise PreprocessingError(
            f"--input: expected the files of the {TRAIN_MAPPING!r} mapping (a csv chunk in "
            f"source_spec.{TRAIN_MAPPING} or --input FILE), got mappings {sorted(files)}"
        )
    for paths in files.values():
        for path in paths:
            if not path.is_file():
                raise PreprocessingError(f"input file {path}: expected an existing file")
    mappings = (TRAIN_MAPPING, *(m for m in files if m != TRAIN_MAPPING))
    first = files[TRAIN_MAPPING][0]
    delimiter = parse_delimiter(args.delimiter, first)
    list_delimiter = parse_list_delimiter(args.list_delimiter, delimiter)
    layout = build_layout(spec, columns, delimiter, list_delimiter)
    names = [(c.name,) for c in layout.categorical]
    thresholds = parse_thresholds(
        args.frequency_threshold,
        args.feature_frequency_threshold,
        names,
        "--feature_frequency_threshold",
    )
    return PipelineConfig(
        layout=layout,
        files=tuple(InputFile.of(p, m) for m in mappings for p in files[m]),
        mappings=mappings,
        output_dir=Path(args.output_dir),
        frequency_thresholds=thresholds,
        numerical_transform=(
            NumericalTransform.LOG if args.log_transform else NumericalTransform.NONE
        ),
        shuffle_train=not args.no_shuffle,
        seed=args.seed,
        strict=args.strict,
        keep_intermediate=args.keep_intermediate,
        overwrite=args.overwrite,
        rows_per_partition=args.rows_per_partition,
        vocabulary_from=None if args.vocabulary_from is None else Path(args.vocabulary_from),
        oov_buckets=args.oov_buckets,
        source="transcode",
        metadata=dict(spec.metadata),
    )


def _main(argv: Sequence[str] | None, prog: str = "python -m preproc.transcode") -> int:
    args = build_parser(prog).parse_args(argv)
    return run_with_spark(transcode_config(args), args)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_main, argv)


def console_main() -> int:
    """The `dlrm-transcode` command: the same tool under its installed name."""
    return run_cli(lambda argv: _main(argv, "dlrm-transcode"), None)


if __name__ == "__main__":
    sys.exit(main())
