"""The preprocessing pipeline shared by `preproc.criteo` and `preproc.transcode`.

Stages, each resumable (see `preproc.stages`):

    parse       raw lines -> typed rows + malformed reasons   _work/parsed/
    vocabulary  train rows -> value ids per feature           vocabulary/
    <mapping>   ids, numerical transform, order, binary files <mapping>/ (train, ...)
    dataset     feature_spec.yaml, report.json, _SUCCESS      the output directory

The vocabulary stays in the dataset (`vocabulary/`, named by the spec's
`metadata.vocabulary`), so that a later run can carry it forward
(`--vocabulary_from`, `preproc.lineage`). The output looks complete (has
`feature_spec.yaml`) only once every stage is done: a run first removes the dataset
files of an earlier run, and stage outputs of other settings, before it changes
anything.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dataloading.files import SplitBinaryFiles
from feature_spec import TRAIN_MAPPING, FeatureSpec, minimal_categorical_dtype
from feature_spec.staged import write_file_atomically
from feature_spec.vocabulary import METADATA_KEY, VocabularyLineage
from preproc.config import PipelineConfig
from preproc.encode import Ordering, encode, order_columns, plan_partitions, write_ordered
from preproc.errors import PreprocessingError
from preproc.layout import CategoricalKind
from preproc.line_parser import row_schema
from preproc.lineage import (
    KINDS_KEY,
    VOCABULARY_DIR,
    VOCABULARY_ID_DIGITS,
    ParentVocabulary,
    categorical_kinds,
    read_parent,
)
from preproc.output_spec import dataset_spec
from preproc.parse import (
    FILE_COLUMN,
    HEADER,
    MALFORMED_REASONS,
    LineIndex,
    parse_to_parquet,
    with_line_numbers,
)
from preproc.partition_writer import PartFormat
from preproc.report import build_report, format_report
from preproc.spark import Console, print_to_stderr, spark_progress
from preproc.stages import (
    SUCCESS,
    Marker,
    Stage,
    file_identity,
    fingerprint,
    read_marker,
    write_marker,
)
from preproc.vocabulary import build_vocabularies

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

WORK_DIR = "_work"
# The line index as a table for the splits' joins (`parse.with_line_numbers`), in WORK_DIR.
LINE_INDEX_FILE = "line_index.parquet"
SPEC_FILE = "feature_spec.yaml"
REPORT_FILE = "report.json"
MALFORMED_EXAMPLES = 20


def run_pipeline(
    config: PipelineConfig,
    spark: SparkSession,
    console: Console = print_to_stderr,
    progress_interval: float = 10.0,
) -> dict[str, Any]:
    """Preprocesses `config.files` into `config.output_dir`; returns the report.

    Raises:
        PreprocessingError: bad input files or output directory, a
            `--vocabulary_from` dataset that does not fit, or a malformed line in
            strict mode (naming the file, line and field).
    """
    return _Run(config, spark, console, progress_interval).run()


class _Run:
    def __init__(
        self,
        config: PipelineConfig,
        spark: SparkSession,
        console: Console,
        progress_interval: float,
    ) -> None:
        self.config = config
        self.spark = spark
        self.console = console
        self.progress_interval = progress_interval
        self.out = config.output_dir
        self.work = self.out / WORK_DIR
        self.timings: dict[str, dict[str, Any]] = {}
        # Checked before anything is written.
        self.parent: ParentVocabulary | None = None
        if config.vocabulary_from is not None:
            self.parent = read_parent(config.vocabulary_from, config.layout, config.oov_buckets)
        self.stages = self._plan()

    # ------------------------------------------------------------------ plan

    def _plan(self) -> dict[str, Stage]:
        config = self.config
        inputs = [file_identity(f.path) for f in config.files]
        # "format" names what the stage writes (the well-formed rows and their value
        # counts, `line_parser`): an output of another format is stale.
        parse = fingerprint(
            {"stage": "parse", "format": 3, "layout": _layout_json(config), "files": inputs}
        )
        parent = self.parent
        vocabulary = fingerprint(
            {
                "stage": "vocabulary",
                "parse": parse,
                "train_files": config.files_of(TRAIN_MAPPING),
                "thresholds": config.frequency_thresholds,
                "oov_buckets": config.oov_buckets,
                "parent": None
                if parent is None
                else {"id": parent.lineage.id, "cardinalities": parent.cardinalities},
            }
        )
        stages = {
            "parse": Stage("parse", self.work / "parsed", parse),
            "vocabulary": Stage("vocabulary", self.out / VOCABULARY_DIR, vocabulary),
        }
        for mapping in config.mappings:
            shuffled = config.shuffle_train and mapping == TRAIN_MAPPING
            settings = {
                "stage": mapping,
                "vocabulary": vocabulary,
                "files": config.files_of(mapping),
                "keys": [config.files[i].key for i in config.files_of(mapping)],
                "transform": config.numerical_transform.value,
                "shuffle": shuffled,
                "seed": config.seed if shuffled else None,
            }
            stages[mapping] = Stage(mapping, self.out / mapping, fingerprint(settings))
        dataset = {
            "stage": "dataset",
            "source": config.source,
            "metadata": dict(config.metadata),
            "mappings": {m: stages[m].fingerprint for m in config.mappings},
        }
        stages["dataset"] = Stage("dataset", self.out, fingerprint(dataset))
        return stages

    # ------------------------------------------------------------------- run

    def run(self) -> dict[str, Any]:
        self._prepare_output_dir()
        dataset = self.stages["dataset"]
        if dataset.finished() is not None and (self.out / REPORT_FILE).is_file():
            self.console(f"[preproc] {self.out}: complete from an earlier run with these settings")
            report: dict[str, Any] = json.loads((self.out / REPORT_FILE).read_text())
            return report
        # From here on the output must not look complete until it is.
        for name in (SUCCESS, SPEC_FILE, REPORT_FILE):
            (self.out / name).unlink(missing_ok=True)
        for name, stage in self.stages.items():
            if name != "dataset" and stage.remove_if_stale():
                self.console(f"[preproc] {name}: removed the output of other settings")

        parsed = self._stage("parse", self._parse)
        self._check_strict(parsed.summary)
        vocabulary = self._stage("vocabulary", self._vocabulary)
        splits = {}
        for mapping in self.config.mappings:
            write = functools.partial(
                self._write, mapping=mapping, parse=parsed, vocabulary=vocabulary
            )
            splits[mapping] = self._stage(mapping, write).summary
        return self._finish(parsed.summary, vocabulary.summary, splits)

    def _prepare_output_dir(self) -> None:
        out = self.out
        if self.config.overwrite and out.exists():
            shutil.rmtree(out)
        if out.exists() and not out.is_dir():
            raise PreprocessingError(f"--output_dir {out}: exists and is not a directory")
        if out.is_dir() and any(out.iterdir()):
            ours = (out / WORK_DIR).is_dir() or read_marker(out) is not None
            if not ours:
                raise PreprocessingError(
                    f"--output_dir {out}: exists, is not empty and holds no earlier "
                    f"preprocessing run; expected a new or empty directory (pass "
                    f"--overwrite to replace it)"
                )
        self.work.mkdir(parents=True, exist_ok=True)

    def _stage(self, name: str, body: Callable[[Path], dict[str, Any]]) -> Marker:
        stage = self.stages[name]
        marker = stage.finished()
        if marker is not None:
            self.console(
                f"[preproc] {name}: done in an earlier run ({marker.seconds:.1f} s), skipped"
            )
            self.timings[name] = {"seconds": marker.seconds, "skipped": True}
            return marker
        self.console(f"[preproc] {name}: started")
        with spark_progress(self.spark, name, self.console, self.progress_interval):
            marker = stage.run(body)
        self.console(f"[preproc] {name}: done in {marker.seconds:.1f} s{_brief(marker.summary)}")
        self.timings[name] = {"seconds": marker.seconds, "skipped": False}
        return marker

    # ---------------------------------------------------------------- stages

    def _parse(self, staging: Path) -> dict[str, Any]:
        config = self.config
        sizes = sum(f.path.stat().st_size for f in config.files)
        self.console(f"[preproc] parse: {len(config.files)} files, {sizes / 1e6:,.1f} MB")
        parsed = parse_to_parquet(
            self.spark,
            config.files,
            config.layout,
            staging / "rows",
            staging / "counts",
            MALFORMED_EXAMPLES,
        )
        files = []
        for number, file in enumerate(config.files):
            mine = [b for b in parsed.blocks if b["file"] == number]
            entry: dict[str, Any] = {
                "name": str(file.path),
                "mapping": file.mapping,
                "lines": sum(b["lines"] for b in mine),
                HEADER: sum(b[HEADER] for b in mine),
                "malformed": {r: sum(b[r] for b in mine) for r in MALFORMED_REASONS},
                "positives": sum(b["positives"] for b in mine),
            }
            entry["rows"] = entry["lines"] - entry[HEADER] - sum(entry["malformed"].values())
            files.append(entry)
        for example in parsed.examples:
            example["file"] = str(config.files[example["file"]].path)
        return {"line_index": parsed.index.to_json(), "files": files, "examples": parsed.examples}

    def _check_strict(self, parse: Mapping[str, Any]) -> None:
        if not self.config.strict or not parse["examples"]:
            return
        totals = {r: sum(f["malformed"][r] for f in parse["files"]) for r in MALFORMED_REASONS}
        first = parse["examples"][0]
        counts = ", ".join(f"{r} {n}" for r, n in totals.items() if n)
        raise PreprocessingError(
            f"{first['file']}:{first['line']}: malformed line ({first['reason']}): "
            f"{first['detail']}. {sum(totals.values())} malformed lines in all ({counts}); "
            f"--strict stops at the first. Fix the input, or rerun without --strict to "
            f"skip them (they are counted in the report)"
        )

    def _parsed_rows(self, mapping: str) -> DataFrame:
        from pyspark.sql import functions as F
        from pyspark.sql.pandas.types import from_arrow_schema

        # The schema given: inferring it would run a Spark job to read a footer.
        schema = from_arrow_schema(row_schema(self.config.layout))
        rows = self.stages["parse"].directory / "rows"
        parsed = self.spark.read.schema(schema).parquet(str(rows))
        files = list(self.config.files_of(mapping))
        return parsed.where(F.col(FILE_COLUMN).isin(files))  # well-formed rows only

    def _first_ids(self) -> list[int]:
        """Per categorical feature, the id of its first new value: after the parent's
        ids, else after 0 and the OOV buckets."""
        if self.parent is not None:
            return list(self.parent.cardinalities)
        return [1 + self.config.oov_buckets] * len(self.config.layout.categorical)

    def _vocabulary(self, staging: Path) -> dict[str, Any]:
        layout = self.config.layout
        features = layout.vocabulary_columns
        first_ids = self._first_ids()
        sizes: dict[int, dict[str, int]] = {}
        if features:
            sizes = build_vocabularies(
                self.spark,
                self.stages["parse"].directory / "counts",
                self.config.files_of(TRAIN_MAPPING),
                features,
                self.config.frequency_thresholds,
                staging,
                first_ids=first_ids,
                parent=None if self.parent is None else self.parent.tables,
                scratch=self.work / "vocabulary_counts",
            )
        entries = []
        for index, column in enumerate(layout.categorical):
            previous = None if self.parent is None else self.parent.cardinalities[index]
            if column.kind == CategoricalKind.ID:
                assert column.cardinality is not None  # checked by InputLayout
                entries.append(
                    {
                        "distinct": None,
                        "kept": None,
                        "new": None,
                        "cardinality": column.cardinality,
                        "previous_cardinality": previous,
                    }
                )
            else:
                size = sizes[index]
                cardinality = first_ids[index] + size["new"]
                entries.append(
                    {**size, "cardinality": cardinality, "previous_cardinality": previous}
                )
        return {"features": entries}

    def _write(
        self, staging: Path, mapping: str, parse: Marker, vocabulary: Marker
    ) -> dict[str, Any]:
        config = self.config
        index = LineIndex.from_json(parse.summary["line_index"])
        features = vocabulary.summary["features"]
        expected = sum(f["rows"] for f in parse.summary["files"] if f["mapping"] == mapping)
        rows = with_line_numbers(
            self.spark, self._parsed_rows(mapping), index, self.work / LINE_INDEX_FILE
        )
        vocabulary_dir = self.stages["vocabulary"].directory
        encoded, lookups = encode(
            self.spark,
            rows,
            config.layout,
            vocabulary_dir if config.layout.vocabulary_columns else None,
            [f["cardinality"] for f in features],
            config.numerical_transform,
            config.oov_buckets,
        )
        parallelism = self.spark.sparkContext.defaultParallelism
        tasks, buckets = plan_partitions(expected, parallelism, config.rows_per_partition)
        part = self._part_format(staging, features, lookups)
        ordered = order_columns(encoded, self._ordering(mapping, index), buckets)
        stats = write_ordered(ordered, config.layout, part, staging, tasks, buckets)
        if stats.rows != expected:
            raise PreprocessingError(
                f"{mapping}: wrote {stats.rows} rows, expected {expected} (the well-formed "
                f"lines of its files); the output was not published"
            )
        return {
            "rows": stats.rows,
            "positives": stats.positives,
            "zero_ids": stats.zero_ids,
            "ids": stats.ids,
            "bucket_ids": stats.bucket_ids,
            "new_ids": stats.new_ids,
            "saturated": stats.saturated,
        }

    def _ordering(self, mapping: str, index: LineIndex) -> Ordering:
        """The order of `mapping`'s rows: shuffled (train), else the input order."""
        config = self.config
        lines = index.lines_per_file(len(config.files))
        offsets, total = [0] * len(config.files), 0
        for number in config.files_of(mapping):
            offsets[number], total = total, total + lines[number]
        return Ordering(
            shuffle=config.shuffle_train and mapping == TRAIN_MAPPING,
            seed=config.seed,
            file_keys=tuple(f.key for f in config.files),
            file_offsets=tuple(offsets),
            total_lines=total,
        )

    def _part_format(
        self,
        staging: Path,
        features: Sequence[Mapping[str, Any]],
        lookups: tuple[str | None, ...],
    ) -> PartFormat:
        """What the writing tasks write, from the vocabulary stage's `features`."""
        layout = self.config.layout
        cardinalities = [f["cardinality"] for f in features]
        # Ids at or above the parent's cardinality are new ones (without a parent:
        # none, as no id reaches the cardinality).
        new_from = [
            c if f["previous_cardinality"] is None else f["previous_cardinality"]
            for c, f in zip(cardinalities, features, strict=True)
        ]
        oov_buckets = [
            self.config.oov_buckets if c.uses_vocabulary else 0 for c in layout.categorical
        ]
        return PartFormat(
            parts_dir=str(staging / "_parts"),
            num_numerical=len(layout.numerical),
            categorical_dtypes=tuple(minimal_categorical_dtype(c) for c in cardinalities),
            cardinalities=tuple(cardinalities),
            variable_length=layout.variable_length,
            vocabularies=lookups,
            oov_buckets=tuple(oov_buckets),
            new_ids_from=tuple(new_from),
        )

    # ---------------------------------------------------------------- finish

    def _finish(
        self,
        parse: Mapping[str, Any],
        vocabulary: Mapping[str, Any],
        splits: Mapping[str, Mapping[str, Any]],
    ) -> dict[str, Any]:
        config = self.config
        start = time.monotonic()
        cardinalities = [f["cardinality"] for f in vocabulary["features"]]
        metadata = {
            **config.metadata,
            "preprocessing": {
                "source": config.source,
                "numerical_transform": config.numerical_transform.value,
                "frequency_thresholds": {
                    column.name: threshold
                    for column, threshold in zip(
                        config.layout.categorical, config.frequency_thresholds, strict=True
                    )
                    if column.uses_vocabulary
                },
                KINDS_KEY: categorical_kinds(config.layout),
                "shuffle_train": config.shuffle_train,
                "seed": config.seed,
                "files": {
                    m: [config.files[i].key for i in config.files_of(m)] for m in config.mappings
                },
            },
            METADATA_KEY: self._lineage().to_metadata(),
        }
        spec = dataset_spec(config.layout, cardinalities, config.mappings, self.out, metadata)
        for mapping in config.mappings:  # sizes agree with the spec, rows with each other
            rows = SplitBinaryFiles.open(spec, mapping).rows
            if rows != splits[mapping]["rows"]:
                raise PreprocessingError(
                    f"{self.out / mapping}: holds {rows} rows, expected {splits[mapping]['rows']}"
                )
        report = build_report(config, spec, parse, vocabulary, splits, self.timings)
        write_file_atomically(self.out / REPORT_FILE, json.dumps(report, indent=1) + "\n")
        spec.dump(self.out / SPEC_FILE)
        FeatureSpec.load(self.out, required_mappings=config.mappings)  # reads back as the loader
        dataset = self.stages["dataset"]
        summary = {"mappings": list(config.mappings)}
        marker = Marker("dataset", dataset.fingerprint, time.monotonic() - start, summary)
        write_marker(self.out, marker)
        if not config.keep_intermediate:
            shutil.rmtree(self.work, ignore_errors=True)
        self.console(f"[preproc] dataset: {self.out / SPEC_FILE} written")
        return report

    def _lineage(self) -> VocabularyLineage:
        """This dataset's vocabulary: its id is the vocabulary stage's fingerprint
        (the same inputs and settings give the same id)."""
        vocabulary = self.stages["vocabulary"].fingerprint[:VOCABULARY_ID_DIGITS]
        if self.parent is not None:
            return self.parent.extended_by(vocabulary)
        return VocabularyLineage(
            vocabulary, directory=VOCABULARY_DIR, oov_buckets=self.config.oov_buckets
        )


def _layout_json(config: PipelineConfig) -> dict[str, Any]:
    return dataclasses.asdict(config.layout)


def _brief(summary: Mapping[str, Any]) -> str:
    if "rows" in summary:
        return f": {summary['rows']:,} rows, {summary['positives']:,} positives"
    if "files" in summary:
        lines = sum(f["lines"] for f in summary["files"])
        rows = sum(f["rows"] for f in summary["files"])
        return f": {lines:,} lines, {rows:,} well-formed rows"
    if "features" in summary:
        ids = sum(f["cardinality"] for f in summary["features"])
        return f": {len(summary['features'])} features, {ids:,} ids in all"
    return ""


__all__ = ["REPORT_FILE", "SPEC_FILE", "WORK_DIR", "format_report", "run_pipeline"]
