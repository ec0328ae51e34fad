"""Which vocabulary a dataset's categorical ids come from, and which it extends.

A preprocessed dataset records it in its FeatureSpec's metadata:

    metadata:
      vocabulary:
        id: 3f0c9a61d2b4e7a8          # this dataset's vocabulary
        extends: [9b1e..., 51c0...]   # the vocabularies it carries forward, newest first
        directory: vocabulary         # value -> id tables, relative to the spec
        oov_buckets: 0                # ids 1..K hold hashed rare values

A vocabulary that extends another keeps every id the other gave and appends new
ones, so a checkpoint trained on a dataset whose vocabulary is `id` or one of
`extends` can be restored on this dataset: its tables only grow. Datasets that were
not made by the preprocessing (synthetic, bring-your-own) carry no lineage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from feature_spec.errors import FeatureSpecError

METADATA_KEY = "vocabulary"


@dataclasses.dataclass(frozen=True)
class VocabularyLineage:
    """A dataset's vocabulary (`id`) and those it extends (`extends`, newest first)."""

    id: str
    extends: tuple[str, ...] = ()
    directory: str = "vocabulary"
    oov_buckets: int = 0

    def descends_from(self, vocabulary: str) -> bool:
        """Whether ids given by `vocabulary` mean the same values here."""
        return vocabulary == self.id or vocabulary in self.extends

    def to_metadata(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "extends": list(self.extends),
            "directory": self.directory,
            "oov_buckets": self.oov_buckets,
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> VocabularyLineage | None:
        """The lineage a spec's metadata records, or None when it records none.

        Raises:
            FeatureSpecError: `metadata.vocabulary` is present but malformed.
        """
        raw = metadata.get(METADATA_KEY)
        if raw is None:
            return None
        where = f"metadata.{METADATA_KEY}"
        if not isinstance(raw, Mapping):
            raise FeatureSpecError(f"{where}: expected a mapping, got {type(raw).__name__}")
        vocabulary = raw.get("id")
        if not isinstance(vocabulary, str) or not vocabulary:
            raise FeatureSpecError(f"{where}.id: expected a non-empty string, got {vocabulary!r}")
        extends = raw.get("extends", [])
        if not isinstance(extends, list) or not all(isinstance(e, str) and e for e in extends):
            raise FeatureSpecError(
                f"{where}.extends: expected a list of vocabulary ids, got {extends!r}"
            )
        directory = raw.get("directory", "vocabulary")
        if not isinstance(directory, str) or not directory:
            raise FeatureSpecError(f"{where}.directory: expected a path, got {directory!r}")
        buckets = raw.get("oov_buckets", 0)
        if not isinstance(buckets, int) or isinstance(buckets, bool) or buckets < 0:
            raise FeatureSpecError(f"{where}.oov_buckets: expected an int >= 0, got {buckets!r}")
        return cls(vocabulary, tuple(extends), directory, buckets)
