"""The vocabulary an earlier dataset carries forward (`--vocabulary_from`), checked
against this run's layout before anything is written.

A dataset of this pipeline keeps its vocabulary tables in `<dataset>/vocabulary/`
and records in its spec's metadata which vocabulary it is (`metadata.vocabulary`,
`feature_spec.vocabulary.VocabularyLineage`) and how each categorical feature was
encoded (`metadata.preprocessing.categorical_kinds`). A run that carries it forward
needs the same categorical features, in the same order, of the same kinds, and the
same OOV buckets: otherwise an id would not mean the same value in both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from feature_spec import FeatureSpec, FeatureSpecError
from feature_spec.vocabulary import VocabularyLineage
from preproc.errors import PreprocessingError
from preproc.layout import InputLayout

# Where a dataset keeps its vocabulary tables, relative to its spec.
VOCABULARY_DIR = "vocabulary"
# The key of `metadata.preprocessing` naming each categorical feature's kind.
KINDS_KEY = "categorical_kinds"
# The length of a vocabulary id (hex digits of the vocabulary stage's fingerprint).
VOCABULARY_ID_DIGITS = 16


@dataclasses.dataclass(frozen=True)
class ParentVocabulary:
    """An earlier dataset's vocabulary.

    Attributes:
        dataset: the dataset directory (as given to `--vocabulary_from`).
        lineage: what its spec records.
        tables: its vocabulary directory ([_value, _count, _id], `_feature=<i>/`).
        cardinalities: per categorical feature (channel order), its cardinality
            there: the first id this run may give to a new value.
    """

    dataset: Path
    lineage: VocabularyLineage
    tables: Path
    cardinalities: tuple[int, ...]

    def extended_by(self, vocabulary: str) -> VocabularyLineage:
        """The lineage of a vocabulary that carries this one forward."""
        return dataclasses.replace(
            self.lineage,
            id=vocabulary,
            extends=(self.lineage.id, *self.lineage.extends),
            directory=VOCABULARY_DIR,
        )


def categorical_kinds(layout: InputLayout) -> dict[str, str]:
    """Per categorical feature name (channel order), its kind, as the metadata records it."""
    return {column.name: column.kind.value for column in layout.categorical}


def read_parent(dataset: Path, layout: InputLayout, oov_buckets: int) -> ParentVocabulary:
    """The vocabulary of `dataset`, checked against this run.

    Raises:
        PreprocessingError: naming `dataset`, the key or feature, the expected and
            the actual value: no spec, no lineage, no vocabulary directory, other
            categorical features or kinds, other OOV buckets.
    """
    where = f"--vocabulary_from {dataset}"
    spec_file = dataset / "feature_spec.yaml"
    if not spec_file.is_file():
        raise PreprocessingError(
            f"{where}: expected a dataset written by the preprocessing (feature_spec.yaml "
            f"and {VOCABULARY_DIR}/), got no {spec_file.name}"
            + ("" if dataset.is_dir() else " (no such directory)")
        )
    try:
        spec = FeatureSpec.load(dataset, check_files=False)
        lineage = VocabularyLineage.from_metadata(spec.metadata)
    except FeatureSpecError as err:
        raise PreprocessingError(f"{where}: {err}") from None
    if lineage is None:
        raise PreprocessingError(
            f"{where}: {spec_file.name} has no metadata.vocabulary; expected the vocabulary "
            f"lineage every dataset of this preprocessing records (a dataset made otherwise, "
            f"or by an older version, cannot be carried forward)"
        )
    tables = dataset / lineage.directory
    if not tables.is_dir():
        raise PreprocessingError(
            f"{where}: metadata.vocabulary.directory names {lineage.directory!r}; expected "
            f"the directory {tables} of its vocabulary tables, found none"
        )
    if lineage.oov_buckets != oov_buckets:
        raise PreprocessingError(
            f"--oov_buckets: expected {lineage.oov_buckets}, the OOV buckets of {where} "
            f"(metadata.vocabulary.oov_buckets), got {oov_buckets}; a carried vocabulary "
            f"keeps its buckets"
        )
    _check_features(where, spec, layout)
    cardinalities = tuple(
        int(spec.features[column.name].cardinality)  # type: ignore[arg-type]
        for column in layout.categorical
    )
    return ParentVocabulary(dataset, lineage, tables, cardinalities)


def _check_features(where: str, spec: FeatureSpec, layout: InputLayout) -> None:
    theirs = [feature.name for feature in spec.categorical_features]
    ours = [column.name for column in layout.categorical]
    if theirs != ours:
        first = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            min(len(ours), len(theirs)),
        )
        expected = ours[first] if first < len(ours) else "no more features"
        actual = theirs[first] if first < len(theirs) else "no more features"
        raise PreprocessingError(
            f"{where}: channel_spec.categorical[{first}]: expected {expected!r}, got "
            f"{actual!r}; a carried vocabulary needs the same categorical features in the "
            f"same order ({len(ours)} here: {_names(ours)}; {len(theirs)} there: "
            f"{_names(theirs)})"
        )
    preprocessing = spec.metadata.get("preprocessing")
    kinds = preprocessing.get(KINDS_KEY) if isinstance(preprocessing, Mapping) else None
    if not isinstance(kinds, Mapping):
        raise PreprocessingError(
            f"{where}: metadata.preprocessing.{KINDS_KEY}: expected each categorical "
            f"feature's kind, got {_short(kinds)}"
        )
    for name, kind in categorical_kinds(layout).items():
        if kinds.get(name) != kind:
            raise PreprocessingError(
                f"{where}: feature {name!r}: expected kind {kind!r} (this run's), got "
                f"{kinds.get(name)!r} (metadata.preprocessing.{KINDS_KEY}); a carried "
                f"vocabulary needs features of the same kinds"
            )


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:8])
    return shown + (", ..." if len(names) > 8 else "")


def _short(value: Any) -> str:
    return "none" if value is None else repr(value)[:80]
