"""The delimiter patterns handed to Spark's `split` (Java regular expressions)."""

from __future__ import annotations

import re

import pytest

from preproc.parse import split_pattern


@pytest.mark.parametrize("delimiter", ["\t", ",", ";", "|", ".", "\\", "$", "+", "]", "x"])
def test_one_character_is_split_literally_on_the_fast_path(delimiter: str) -> None:
    pattern = split_pattern(delimiter)
    # String.split's fast path: one character, or a backslash and a non-alphanumeric.
    assert pattern == delimiter or (len(pattern) == 2 and pattern == "\\" + delimiter)
    text = f"a{delimiter}{delimiter}b{delimiter}"
    assert re.split(pattern, text) == text.split(delimiter)


def test_longer_delimiters_are_quoted() -> None:
    assert split_pattern("::") == "\\Q::\\E"
