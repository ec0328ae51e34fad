"""The typed configuration of one preprocessing run (built by the CLIs from flags)."""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from feature_spec import TRAIN_MAPPING
from preproc.errors import PreprocessingError
from preproc.layout import InputLayout, criteo_layout

# Compression suffixes Spark (Hadoop) decompresses by file name.
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".deflate", ".lz4", ".snappy", ".zst")
MAPPING_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
# Rows one Spark task sorts and writes at most, when the split is ordered.
DEFAULT_ROWS_PER_PARTITION = 2_000_000


class NumericalTransform(str, enum.Enum):
    """What happens to a numerical value after missing values became 0."""

    NONE = "none"  # kept as it is (saturating at the float16 range)
    CLAMP = "clamp"  # negatives become 0
    LOG = "log"  # negatives become 0, then log(1 + x)


@dataclasses.dataclass(frozen=True)
class InputFile:
    """One input file and the mapping ("train", "test", ...) its rows go to.

    `key` names the file in the seeded shuffle: the file name without directory
    and compression suffix, so `day_3` and `day_3.gz` shuffle the same way.
    """

    path: Path
    mapping: str
    key: str

    @classmethod
    def of(cls, path: str | Path, mapping: str) -> InputFile:
        path = Path(path)
        return cls(path=path, mapping=mapping, key=strip_compression_suffix(path.name))


def strip_compression_suffix(name: str) -> str:
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Everything that decides the output of a run.

    Attributes:
        layout: the input fields and how to parse them.
        files: input files in input order; their `mapping` says where rows go.
            Vocabularies are counted on the "train" mapping only.
        mappings: output mappings in the order they are written ("train" first).
        output_dir: where the dataset (feature_spec.yaml, <mapping>/) is written.
        frequency_thresholds: per categorical feature (channel order): values seen
            fewer times in training become id 0.
        numerical_transform: see `NumericalTransform`.
        shuffle_train: order the train rows by a seeded hash of (file, line).
        seed: the shuffle seed.
        strict: fail on the first malformed row instead of skipping it.
        keep_intermediate: keep `_work/` (parsed rows, vocabularies) after success.
        overwrite: delete an existing output directory first.
        rows_per_partition: the most rows one Spark task orders and writes.
        source: what produced the run ("criteo" or "transcode"), for the metadata.
        metadata: written into the output spec's metadata (next to "preprocessing").
        vocabulary_from: an earlier dataset of this pipeline whose vocabulary is
            carried forward: its ids are kept, new values get ids after them.
        oov_buckets: K > 0: rare and unseen values get one of the ids 1..K by a hash
            of the value (kept values then start at K + 1); 0: they get id 0.
    """

    layout: InputLayout
    files: tuple[InputFile, ...]
    mappings: tuple[str, ...]
    output_dir: Path
    frequency_thresholds: tuple[int, ...]
    numerical_transform: NumericalTransform
    shuffle_train: bool = True
    seed: int = 0
    strict: bool = False
    keep_intermediate: bool = False
    overwrite: bool = False
    rows_per_partition: int = DEFAULT_ROWS_PER_PARTITION
    source: str = "criteo"
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    vocabulary_from: Path | None = None
    oov_buckets: int = 0

    def __post_init__(self) -> None:
        if not self.mappings or self.mappings[0] != TRAIN_MAPPING:
            raise PreprocessingError(
                f"mappings: expected {TRAIN_MAPPING!r} first (vocabularies are counted on "
                f"it), got {list(self.mappings)}"
            )
        for mapping in self.mappings:
            if not MAPPING_NAME.match(mapping):
                raise PreprocessingError(
                    f"mapping {mapping!r}: expected a name of letters, digits and '_' "
                    f"starting with a letter"
                )
            if not any(f.mapping == mapping for f in self.files):
                raise PreprocessingError(f"mapping {mapping!r}: expected input files, got none")
        stray = sorted({f.mapping for f in self.files} - set(self.mappings))
        if stray:
            raise PreprocessingError(
                f"input files name mappings {stray} that are not among {list(self.mappings)}"
            )
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            twice = sorted({str(p) for p in paths if paths.count(p) > 1})
            raise PreprocessingError(f"input files: each file once, got {twice} more than once")
        if len(self.frequency_thresholds) != len(self.layout.categorical):
            raise PreprocessingError(
                f"frequency thresholds: expected one per categorical feature "
                f"({len(self.layout.categorical)}), got {len(self.frequency_thresholds)}"
            )
        bad = [t for t in self.frequency_thresholds if t < 0]
        if bad:
            raise PreprocessingError(f"frequency threshold: expected >= 0, got {bad[0]}")
        if self.rows_per_partition < 1:
            raise PreprocessingError(
                f"--rows_per_partition: expected a positive int, got {self.rows_per_partition}"
            )
        if self.oov_buckets < 0:
            raise PreprocessingError(f"--oov_buckets: expected an int >= 0, got {self.oov_buckets}")
        if self.vocabulary_from is not None and (
            self.vocabulary_from.resolve() == self.output_dir.resolve()
        ):
            raise PreprocessingError(
                f"--vocabulary_from {self.vocabulary_from}: expected an earlier dataset, got "
                f"--output_dir itself (its vocabulary is rewritten by this run); write the "
                f"new dataset to another directory"
            )

    def files_of(self, mapping: str) -> tuple[int, ...]:
        """Indices into `files` of the files of `mapping`, in input order."""
        return tuple(i for i, f in enumerate(self.files) if f.mapping == mapping)


def last_day_test_config(
    days: Sequence[Path], output_dir: Path, frequency_threshold: int, overwrite: bool = False
) -> PipelineConfig:
    """Criteo day files in day order: the last one the test split, the others train,
    one threshold for every feature, the log transform (the benchmark's and the
    class archive's run)."""
    layout = criteo_layout()
    return PipelineConfig(
        layout=layout,
        files=tuple(
            InputFile.of(day, "test" if i == len(days) - 1 else TRAIN_MAPPING)
            for i, day in enumerate(days)
        ),
        mappings=(TRAIN_MAPPING, "test"),
        output_dir=output_dir,
        frequency_thresholds=(frequency_threshold,) * len(layout.categorical),
        numerical_transform=NumericalTransform.LOG,
        overwrite=overwrite,
    )


def parse_thresholds(
    default: int, overrides: Sequence[str], names: Sequence[Sequence[str]], flag: str
) -> tuple[int, ...]:
    """Per-feature frequency thresholds from a default and `NAME=N` overrides.

    Args:
        default: the threshold of every feature not overridden.
        overrides: items `NAME=N`, each possibly a comma-separated list.
        names: per categorical feature, the names it may be called by
            (e.g. ("C1", "cat_0")).
        flag: the flag the overrides came from, for error messages.
    """
    if default < 0:
        raise PreprocessingError(f"--frequency_threshold: expected >= 0, got {default}")
    thresholds = [default] * len(names)
    index = {alias: i for i, aliases in enumerate(names) for alias in aliases}
    for item in (part for entry in overrides for part in entry.split(",") if part):
        name, sep, value = item.partition("=")
        if not sep or name not in index:
            known = ", ".join(aliases[0] for aliases in names)
            raise PreprocessingError(
                f"{flag}: expected NAME=N with NAME a categorical feature ({known}), got {item!r}"
            )
        try:
            threshold = int(value)
        except ValueError:
            threshold = -1
        if threshold < 0:
            raise PreprocessingError(
                f"{flag}: expected a non-negative integer threshold, got {item!r}"
            )
        thresholds[index[name]] = threshold
    return tuple(thresholds)
