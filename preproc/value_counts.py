"""The value counts table: per input file and vocabulary feature, how many times
each value occurs in the well-formed rows (a list: its elements).

The parse tasks write it (`preproc.line_parser`) and the vocabularies are summed
from it (`preproc.vocabulary`), whose tables share its feature, value and count
columns.
"""

from __future__ import annotations

import pyarrow as pa

FILE_COLUMN = "_file"  # the input file's index, as in the parsed rows
FEATURE_COLUMN = "_feature"  # the categorical index
VALUE_COLUMN = "_value"
COUNT_COLUMN = "_count"

COUNTS_SCHEMA = pa.schema(
    [
        (FILE_COLUMN, pa.int32()),
        (FEATURE_COLUMN, pa.int32()),
        (VALUE_COLUMN, pa.string()),
        (COUNT_COLUMN, pa.int64()),
    ]
)
