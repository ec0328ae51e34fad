"""How a delimited input file is laid out: its fields, and how each one is parsed.

An `InputLayout` is the explicit schema of the raw input: the names of the fields
in file order, which field is the label, which are numerical and which are
categorical features (in output channel order), and what a well-formed value of
each looks like. Criteo's layout is `criteo_layout()`; `preproc.transcode`
builds one from a FeatureSpec.

A categorical field may hold a list of values (`variable_length`, the FeatureSpec's
`hotness: variable`): the field is split on the layout's `list_delimiter`, and every
element is a value of the column's kind.

Spark columns are named by role and position (`_label`, `_num0`, `_cat3`), never by
feature name, so any feature name is safe.
"""

from __future__ import annotations

import dataclasses
import enum

from feature_spec.criteo import (
    CRITEO_NUM_CATEGORICAL,
    CRITEO_NUM_NUMERICAL,
    LABEL_NAME,
    categorical_name,
    numerical_name,
)
from preproc.errors import PreprocessingError


class NumericalKind(str, enum.Enum):
    INTEGER = "integer"  # optional minus sign and 1-18 digits (Criteo's counts)
    FLOAT = "float"  # decimal or exponent notation


class CategoricalKind(str, enum.Enum):
    HEX = "hex"  # 1-8 hex digits (Criteo's hashed values), kept as text; ids from a vocabulary
    TOKEN = "token"  # any non-empty text; ids from a vocabulary
    ID = "id"  # an integer id already in [0, cardinality), written as it is


@dataclasses.dataclass(frozen=True)
class NumericalColumn:
    name: str  # output feature name
    source: str  # field name in the input


@dataclasses.dataclass(frozen=True)
class CategoricalColumn:
    """A categorical field. `cardinality` is given for `ID` columns only;
    `variable_length`: the field holds a list of values (empty field: empty list)."""

    name: str
    source: str
    kind: CategoricalKind
    cardinality: int | None = None
    variable_length: bool = False

    @property
    def uses_vocabulary(self) -> bool:
        return self.kind != CategoricalKind.ID


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """The fields of one line of input and how to parse them.

    Attributes:
        delimiter: the field separator (no quoting: a delimiter always separates).
        fields: field names in file order; every field is used exactly once.
        label_source: the field holding the label (0 or 1).
        label_name: the output name of the label feature.
        numerical: numerical features, in output channel order.
        numerical_kind: how every numerical field is written.
        categorical: categorical features, in output channel order.
        list_delimiter: the separator of list elements in a variable-length
            field; required when there is one. It and `delimiter` must not contain
            each other (a field would never hold a list, or never end).
    """

    delimiter: str
    fields: tuple[str, ...]
    label_source: str
    label_name: str
    numerical: tuple[NumericalColumn, ...]
    numerical_kind: NumericalKind
    categorical: tuple[CategoricalColumn, ...]
    list_delimiter: str | None = None

    def __post_init__(self) -> None:
        if not self.delimiter or "\n" in self.delimiter or "\r" in self.delimiter:
            raise PreprocessingError(
                f"delimiter: expected a non-empty separator without line breaks, "
                f"got {self.delimiter!r}"
            )
        used = [self.label_source, *(c.source for c in self.numerical)]
        used += [c.source for c in self.categorical]
        if sorted(used) != sorted(self.fields) or len(set(used)) != len(used):
            raise PreprocessingError(
                f"input layout: expected every field used exactly once by the label, "
                f"numerical and categorical features, got fields {list(self.fields)} "
                f"and features {used}"
            )
        for column in self.categorical:
            if (column.kind == CategoricalKind.ID) != (column.cardinality is not None):
                raise PreprocessingError(
                    f"{column.name}: an id column needs a cardinality and only it has one; "
                    f"got kind {column.kind.value} with cardinality {column.cardinality}"
                )
        self._check_list_delimiter()

    def _check_list_delimiter(self) -> None:
        lists = [c.name for c in self.categorical if c.variable_length]
        separator = self.list_delimiter
        if separator is None:
            if lists:
                raise PreprocessingError(
                    f"list delimiter: expected one for the variable-length features {lists}, "
                    f"got none"
                )
            return
        if not separator or "\n" in separator or "\r" in separator:
            raise PreprocessingError(
                f"list delimiter: expected a non-empty separator without line breaks, "
                f"got {separator!r}"
            )
        if separator in self.delimiter or self.delimiter in separator:
            raise PreprocessingError(
                f"list delimiter: expected a separator apart from the field delimiter "
                f"{self.delimiter!r}, got {separator!r}"
            )

    def position(self, source: str) -> int:
        """0-based index of field `source` in a line."""
        return self.fields.index(source)

    @property
    def vocabulary_columns(self) -> tuple[int, ...]:
        """Indices (channel order) of the categorical features that get a vocabulary."""
        return tuple(i for i, c in enumerate(self.categorical) if c.uses_vocabulary)

    @property
    def variable_length(self) -> tuple[bool, ...]:
        """Per categorical feature (channel order): whether it holds a list of values."""
        return tuple(c.variable_length for c in self.categorical)


# Spark column names: by role and position, never by feature name.
LABEL_COLUMN = "_label"


def numerical_column(index: int) -> str:
    return f"_num{index}"


def categorical_column(index: int) -> str:
    return f"_cat{index}"


def criteo_layout() -> InputLayout:
    """Criteo's click logs: label, I1..I13 (integer counts), C1..C26 (8 hex digits),
    tab-separated; written as `label`, `num_0..num_12`, `cat_0..cat_25`."""
    numerical = tuple(
        NumericalColumn(numerical_name(i), f"I{i + 1}") for i in range(CRITEO_NUM_NUMERICAL)
    )
    categorical = tuple(
        CategoricalColumn(categorical_name(i), f"C{i + 1}", CategoricalKind.HEX)
        for i in range(CRITEO_NUM_CATEGORICAL)
    )
    return InputLayout(
        delimiter="\t",
        fields=("label", *(c.source for c in numerical), *(c.source for c in categorical)),
        label_source="label",
        label_name=LABEL_NAME,
        numerical=numerical,
        numerical_kind=NumericalKind.INTEGER,
        categorical=categorical,
    )
